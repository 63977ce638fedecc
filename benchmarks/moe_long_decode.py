"""Does a streamed MoE decode hold its memory over a long generation?

    python benchmarks/moe_long_decode.py MOE_CKPT [--budget 50%] [--storage nvme] [--threads 1]
                                         [--tokens 2000] [--every 100] [--json FILE] [--plot FILE.png]

In this process (which has imported only the package before the load): load the checkpoint under
the budget, prefill a short prompt, then decode --tokens tokens greedily in one session whose KV
capacity holds them all, sampling the resident set every --every tokens. Reported: the RSS over
the package's import at each sample against the budget, the growth from the first sample to the
last (the session's KV grows by the same bytes per token whatever the model holds, so the KV a
sample's positions take is shown beside it) and decode speed per interval, as a table, JSON and
optionally a plot.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from report import publish

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import edge  # noqa: E402
from edge.core.process_memory import peak_rss_bytes, resident_bytes  # noqa: E402

IMPORTED_RSS = resident_bytes()  # the interpreter and the package's import: what a budget is compared above


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--budget", default="50%")
    parser.add_argument("--storage", default="nvme")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    from edge.bench_moe import RSS_TOLERANCE  # (after IMPORTED_RSS: it imports numpy)
    from edge.core.kv import kv_bytes_per_token

    prompt = [1 + i for i in range(16)]
    capacity = len(prompt) + args.tokens
    with edge.load(args.checkpoint, device="cpu", threads=args.threads, memory_budget=args.budget,
                   storage=args.storage, kv_capacity=capacity) as model:
        kv_per_token = kv_bytes_per_token(model.spec, "f32")
        samples = []
        with model.session(capacity=capacity) as session:
            token = session.next_token(prompt)
            started = last = time.perf_counter()
            for step in range(1, args.tokens + 1):
                token = session.next_token([token])
                if step % args.every == 0:
                    now = time.perf_counter()
                    samples.append({"tokens": step, "rss_over_import_bytes": resident_bytes() - IMPORTED_RSS,
                                    "kv_bytes": (len(prompt) + step) * kv_per_token,
                                    "tokens_per_second": args.every / (now - last)})
                    last = now
                    print(f"[long decode] {step}/{args.tokens} tokens, RSS over import "
                          f"{samples[-1]['rss_over_import_bytes'] / 1e6:.1f} MB", file=sys.stderr, flush=True)
            seconds = time.perf_counter() - started
        plan, stats = model.memory, model.stats()
    first, final = samples[0], samples[-1]
    peak = peak_rss_bytes()
    peak_over_import = None if peak is None else peak - IMPORTED_RSS
    result = {
        "checkpoint": os.path.abspath(args.checkpoint), "budget": args.budget, "budget_bytes": plan.budget_bytes,
        "storage": args.storage, "threads": args.threads, "tokens": args.tokens,
        "decode_tokens_per_second": args.tokens / seconds, "samples": samples,
        "growth_bytes": final["rss_over_import_bytes"] - first["rss_over_import_bytes"],
        "kv_growth_bytes": final["kv_bytes"] - first["kv_bytes"],
        "peak_rss_over_import_bytes": peak_over_import,
        "process_within_budget": (None if peak_over_import is None
                                  else peak_over_import <= plan.budget_bytes * (1 + RSS_TOLERANCE)),
        "hit_rate": stats.get("hit_rate"), "io_engine": stats.get("io_engine"),
    }
    print(f"{'tokens':>7}  {'RSS-import MB':>13}  {'KV MB':>6}  {'tok/s':>6}")
    for sample in samples:
        print(f"{sample['tokens']:>7}  {sample['rss_over_import_bytes'] / 1e6:>13.1f}  "
              f"{sample['kv_bytes'] / 1e6:>6.1f}  {sample['tokens_per_second']:>6.1f}")
    print(f"growth from {first['tokens']} to {final['tokens']} tokens: {result['growth_bytes'] / 1e6:.1f} MB "
          f"(the KV of those positions: {result['kv_growth_bytes'] / 1e6:.1f} MB); budget "
          f"{plan.budget_bytes / 1e6:.1f} MB, peak RSS over import "
          + ("- (no high-water mark here)" if peak_over_import is None else f"{peak_over_import / 1e6:.1f} MB"))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(7, 4))
        steps = [s["tokens"] for s in samples]
        axis.plot(steps, [s["rss_over_import_bytes"] / 1e6 for s in samples], label="RSS over import")
        axis.axhline(plan.budget_bytes / 1e6, color="gray", linestyle="--", label=f"budget {args.budget}")
        axis.set_xlabel("decoded tokens")
        axis.set_ylabel("MB")
        axis.set_title(f"{os.path.basename(args.checkpoint.rstrip('/'))}: streamed decode, {args.threads} thread(s)")
        axis.legend()
        figure.tight_layout()
        figure.savefig(args.plot)
    publish(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
