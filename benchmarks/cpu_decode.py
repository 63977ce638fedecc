"""CPU backend speed on SmolLM2-135M (or any checkpoint): prefill and decode tokens/s per thread
count, cold and warm start, and whether the greedy tokens equal the reference backend's.

    python benchmarks/cpu_decode.py [CHECKPOINT] [--threads 1,2] [--prompt-tokens 128]
                                    [--new-tokens 128] [--repeats 3] [--no-reference] [--no-startup]
                                    [--json results.json]

CHECKPOINT defaults to the built-in SmolLM2-135M-Instruct (Q4_1 + Q8_0 embeddings, converted
losslessly on first use). For each thread count: a 128-token prompt (a fixed English text,
tokenized and cut to length) is prefilled in one call, then 128 tokens are decoded greedily, one
call each; `repeats` runs, the best kept (the least disturbed by other processes) and the median
shown beside it. Timings are wall clock around the model calls only.

Startup, in fresh processes: cold = an empty Numba cache (a new ZLLM_EDGE_HOME), so every kernel
the model needs is compiled; warm = the same again, the cache now filled. Each reports the time
from `edge.load` to the first generated token (and, apart, the `import edge` before it).

The reference check decodes the same prompt on device="reference" (slow: ~0.4 s per token) and
reports how many greedy tokens agree, and at a divergence the reference's top-2 log-prob gap.
The machine's load average is printed: on a shared machine other processes steal cores.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from report import publish

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import edge  # noqa: E402
from edge.home import default_model_checkpoint  # noqa: E402

PROMPT_TEXT = (
    "The history of the city begins with a small settlement on the banks of the river, where "
    "fishermen and traders built wooden houses and a market square. Over the centuries the town grew "
    "into a centre of commerce: merchants brought spices, cloth and salt from distant ports, and "
    "craftsmen opened workshops along the narrow streets. A cathedral was raised in the twelfth "
    "century, a university followed two hundred years later, and the old walls were torn down to make "
    "room for wide avenues, parks and railway stations. Today visitors walk through the museums, "
    "taste the local food in the covered market and climb the tower for a view over the roofs. "
    "In the following paragraphs we describe the main districts of the city, its museums, its cuisine "
    "and the festivals that fill its squares every summer."
)

STARTUP_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import edge
t1 = time.perf_counter()
model = edge.load(sys.argv[1], device="cpu", threads=int(sys.argv[2]))
generation = model.generate(json.loads(sys.argv[3]), max_new_tokens=1)
tokens = list(generation.steps())
t2 = time.perf_counter()
print(json.dumps({"import_seconds": t1 - t0, "load_to_first_token_seconds": t2 - t1,
                  "threading_layer": model.device_info()["threading_layer"]}))
"""


def prompt_ids(model, n_tokens: int) -> list[int]:
    ids = model.encode(PROMPT_TEXT)
    while len(ids) < n_tokens:
        ids = ids + ids
    return ids[:n_tokens]


def greedy_run(model, prompt: list[int], new_tokens: int) -> tuple[float, float, list[int], list[float]]:
    """(prefill seconds, decode seconds, greedy tokens, top-2 log-prob gaps)."""
    session = model.session(capacity=len(prompt) + new_tokens + 1)
    start = time.perf_counter()
    logits = session.prefill(prompt)
    prefill_seconds = time.perf_counter() - start
    tokens, gaps = [], []
    decode_seconds = 0.0
    for _ in range(new_tokens):
        token = int(logits.argmax())
        tokens.append(token)
        top_two = np.partition(logits, -2)[-2:]
        gaps.append(float(abs(top_two[1] - top_two[0])))  # logit gap = log-prob gap
        start = time.perf_counter()
        logits = session.decode(token)
        decode_seconds += time.perf_counter() - start
    return prefill_seconds, decode_seconds, tokens, gaps


def throughput(checkpoint: str, threads: int, n_prompt: int, n_new: int, repeats: int) -> dict:
    with edge.load(checkpoint, device="cpu", threads=threads) as model:
        prompt = prompt_ids(model, n_prompt)
        greedy_run(model, prompt[:16], 4)  # warm-up: first calls fault in pages and start threads
        runs = [greedy_run(model, prompt, n_new) for _ in range(repeats)]
        info = model.device_info()
    prefill = [n_prompt / r[0] for r in runs]
    decode = [n_new / r[1] for r in runs]
    token_sets = {tuple(r[2]) for r in runs}
    return {
        "threads": threads,
        "prefill_tokens_per_second": max(prefill), "prefill_median": statistics.median(prefill),
        "decode_tokens_per_second": max(decode), "decode_median": statistics.median(decode),
        "tokens": runs[0][2], "same_tokens_every_repeat": len(token_sets) == 1,
        "threading_layer": info["threading_layer"], "prompt": prompt,
    }


def startup(checkpoint: str, threads: int, prompt: list[int]) -> dict:
    home = tempfile.mkdtemp(prefix="zllm-cold-")
    env = dict(os.environ, ZLLM_EDGE_HOME=home)
    results = {}
    for label in ("cold", "warm"):
        out = subprocess.run([sys.executable, "-c", STARTUP_CHILD, checkpoint, str(threads), json.dumps(prompt)],
                             env=env, cwd=REPO, capture_output=True, text=True, check=True)
        results[label] = json.loads(out.stdout.strip().splitlines()[-1])
    return results


def reference_tokens(checkpoint: str, prompt: list[int], n_new: int) -> tuple[list[int], list[float]]:
    with edge.load(checkpoint, device="reference") as model:
        _, _, tokens, gaps = greedy_run(model, prompt, n_new)
    return tokens, gaps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", nargs="?", default=None)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-reference", action="store_true", help="skip the (slow) reference token check")
    parser.add_argument("--no-startup", action="store_true", help="skip the cold/warm start subprocesses")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    checkpoint = args.checkpoint or default_model_checkpoint()
    thread_counts = [int(t) for t in args.threads.split(",")]
    load_before = os.getloadavg()

    rows = [throughput(checkpoint, t, args.prompt_tokens, args.new_tokens, args.repeats) for t in thread_counts]
    prompt = rows[0].pop("prompt")
    for row in rows[1:]:
        row.pop("prompt")
    if not args.no_startup:
        for row in rows:
            row["startup"] = startup(checkpoint, row["threads"], prompt[:16])
    reference = None
    if not args.no_reference:
        tokens, gaps = reference_tokens(checkpoint, prompt, args.new_tokens)
        reference = {"tokens": tokens}
        for row in rows:
            agree = next((i for i, (a, b) in enumerate(zip(row["tokens"], tokens)) if a != b), len(tokens))
            row["tokens_equal_reference"] = agree == len(tokens)
            row["tokens_agreeing_with_reference"] = agree
            if agree < len(tokens):
                row["reference_logit_gap_at_divergence"] = gaps[agree]

    import llvmlite.binding as llvm

    results = {
        "checkpoint": checkpoint, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "repeats": args.repeats, "cpu": llvm.get_host_cpu_name(), "cores": os.cpu_count(),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "runs": [{k: v for k, v in row.items() if k != "tokens"} for row in rows],
    }
    print(f"{os.path.basename(checkpoint)}: {args.prompt_tokens}-token prompt, {args.new_tokens} greedy tokens, "
          f"best of {args.repeats} (median); cpu {results['cpu']}, {results['cores']} cores, load average "
          f"{load_before[0]:.2f} before / {results['load_average_after'][0]:.2f} after")
    print(f"{'threads':>7} {'prefill tok/s':>22} {'decode tok/s':>20} {'cold start':>11} {'warm start':>11} "
          f"{'= reference':>12}")
    for row in rows:
        start = row.get("startup")
        cold = f"{start['cold']['load_to_first_token_seconds']:.2f} s" if start else "-"
        warm = f"{start['warm']['load_to_first_token_seconds']:.2f} s" if start else "-"
        same = "-" if reference is None else (
            "yes" if row["tokens_equal_reference"] else f"{row['tokens_agreeing_with_reference']}/{args.new_tokens}")
        print(f"{row['threads']:>7} {row['prefill_tokens_per_second']:>11.1f} ({row['prefill_median']:>7.1f}) "
              f"{row['decode_tokens_per_second']:>9.1f} ({row['decode_median']:>6.1f}) {cold:>11} {warm:>11} {same:>12}")
    publish(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
