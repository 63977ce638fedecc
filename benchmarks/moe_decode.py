"""Resident MoE decode speed on device "cpu": the per-expert op-by-op loop against the one-call
expert mixture (kernels/cpu/moe.py), per thread count.

    python benchmarks/moe_decode.py [CHECKPOINT] [--threads 1,2] [--prompt-tokens 32]
                                    [--new-tokens 48] [--repeats 2] [--json results.json]

CHECKPOINT defaults to the built-in default MoE (SmolLM2-135M MoEfied with `--moefy`'s default,
built on first use). Every expert is resident (expert_strategy "resident"). For each thread count
and each path, a prompt is prefilled in one call and tokens are decoded greedily, one call each;
the best of `repeats` runs is kept (the least disturbed by other processes) with the median beside
it. "loop" is edge/moe.py's per-expert loop over the backend's linear/swiglu ops (what the cpu
backend ran before it had `expert_mixture`); "fused" is the backend's one-call mixture. Both must
give the same greedy tokens. The machine's load average is printed: other processes steal cores.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from report import publish

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import edge  # noqa: E402
from edge.home import default_moe_checkpoint  # noqa: E402

PROMPT_TEXT = ("The history of the city begins with a small settlement on the banks of the river, where "
               "fishermen and traders built wooden houses and a market square.")
PATHS = ("loop", "fused")


def greedy_run(model, prompt: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    """(prefill seconds, decode seconds, greedy tokens)."""
    session = model.session(capacity=len(prompt) + new_tokens + 1)
    start = time.perf_counter()
    logits = session.prefill(prompt)
    prefill_seconds = time.perf_counter() - start
    tokens, decode_seconds = [], 0.0
    for _ in range(new_tokens):
        token = int(logits.argmax())
        tokens.append(token)
        start = time.perf_counter()
        logits = session.decode(token)
        decode_seconds += time.perf_counter() - start
    return prefill_seconds, decode_seconds, tokens


def measure(checkpoint: str, threads: int, path: str, n_prompt: int, n_new: int, repeats: int) -> dict:
    with edge.load(checkpoint, device="cpu", threads=threads, expert_strategy="resident") as model:
        if path == "loop":
            # hide the backend's one-call mixture: edge/moe.py then runs its per-expert loop
            model.backend.expert_mixture = None
        prompt = (model.encode(PROMPT_TEXT) * n_prompt)[:n_prompt]
        greedy_run(model, prompt[:8], 2)  # warm-up: compile or load kernels, fault in pages
        runs = [greedy_run(model, prompt, n_new) for _ in range(repeats)]
    prefill = [n_prompt / r[0] for r in runs]
    decode = [n_new / r[1] for r in runs]
    return {"threads": threads, "path": path,
            "prefill_tokens_per_second": max(prefill), "prefill_median": statistics.median(prefill),
            "decode_tokens_per_second": max(decode), "decode_median": statistics.median(decode),
            "tokens": runs[0][2], "same_tokens_every_repeat": len({tuple(r[2]) for r in runs}) == 1}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", nargs="?", default=None)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    checkpoint = args.checkpoint or default_moe_checkpoint()
    load_before = os.getloadavg()
    rows = [measure(checkpoint, int(t), path, args.prompt_tokens, args.new_tokens, args.repeats)
            for t in args.threads.split(",") for path in PATHS]
    for row in rows:
        loop = next(r for r in rows if r["threads"] == row["threads"] and r["path"] == "loop")
        row["tokens_equal_loop"] = row["tokens"] == loop["tokens"]
        row["decode_speedup_over_loop"] = row["decode_tokens_per_second"] / loop["decode_tokens_per_second"]
    results = {"checkpoint": checkpoint, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
               "repeats": args.repeats, "cores": os.cpu_count(), "load_average_before": load_before,
               "load_average_after": os.getloadavg(),
               "runs": [{k: v for k, v in row.items() if k != "tokens"} for row in rows]}
    print(f"{os.path.basename(checkpoint)}: resident experts, {args.prompt_tokens}-token prompt, {args.new_tokens} "
          f"greedy tokens, best of {args.repeats} (median); {results['cores']} cores, load average "
          f"{load_before[0]:.2f} before / {results['load_average_after'][0]:.2f} after")
    print(f"{'threads':>7} {'path':>6} {'prefill tok/s':>20} {'decode tok/s':>20} {'speedup':>8} {'= loop':>7}")
    for row in rows:
        print(f"{row['threads']:>7} {row['path']:>6} {row['prefill_tokens_per_second']:>9.1f} "
              f"({row['prefill_median']:>8.1f}) {row['decode_tokens_per_second']:>9.1f} ({row['decode_median']:>8.1f}) "
              f"{row['decode_speedup_over_loop']:>7.2f}x {'yes' if row['tokens_equal_loop'] else 'NO':>7}")
    publish(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
