"""How many expert reads a streamed MoE decode cannot avoid, and how fast this machine's disk serves them.

    python benchmarks/moe_read_floor.py MOE_CKPT [--budget 50%] [--tokens 200] [--json FILE]

1. Records the real routes of --tokens greedy decode steps (all experts resident), then replays them
   through an expert cache holding the budget's share of experts (one entry per expert), loading on
   demand, under: Belady's policy (it knows the future: the floor no policy beats), LRU, "cycle"
   (evict the expert whose layer comes last) and "nextuse" (evict the one whose next use is expected
   furthest ahead, from the share of its layer's visits that used it: streaming/cache.py
   NextUsePolicy, what the predictive strategy uses). Prints the reads per token each needs.
2. Reads random records of the checkpoint's experts.bin with O_DIRECT from 1, 2, 4 and 8 threads
   (no storage emulation): the real disk's reads/s and GB/s at each queue depth, and so the time the
   floor's reads take per token.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from report import publish

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import edge  # noqa: E402
from edge.bench import benchmark_prompt  # noqa: E402
from streaming.budget import parse_budget  # noqa: E402
from streaming.floor import POLICIES, demand_reads, disk_throughput  # noqa: E402


def record_routes(path: str, tokens: int) -> list[dict[int, list[int]]]:
    """Per decode step: MoE layer -> the distinct experts its route used."""
    steps = []
    prompt, _ = benchmark_prompt(path, 64)
    with edge.load(path, device="cpu", threads=1, expert_strategy="resident") as model:

        def observe(layer, hidden, expert_ids=None, expert_weights=None):
            if expert_ids is not None:
                steps[-1][layer] = sorted(set(np.asarray(expert_ids).ravel().tolist()))

        with model.session(capacity=len(prompt) + tokens + 1) as session:
            token = int(session.prefill(prompt).argmax())
            for _ in range(tokens):
                steps.append({})
                token = int(session.prefill([token], observer=observe).argmax())
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--budget", default="50%", help="share of the expert bytes the cache holds")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    share = parse_budget(args.budget).expert_percent
    if share is None:
        parser.error("--budget must be a share of the experts, such as 50%")
    print(f"recording the routes of {args.tokens} decode steps ...", file=sys.stderr)
    steps = record_routes(args.model, args.tokens)
    layers = sorted(steps[0])
    uses = [(layer, expert) for step in steps for layer in layers for expert in step[layer]]
    per_token = len(uses) // len(steps)
    with edge.load(args.model) as model:
        index = model.checkpoint.experts
        n_experts = sum(len(index.layers[layer].records) for layer in layers)
        record_bytes = -(-max(index.layout(layer).raw_length for layer in layers) // 4096) * 4096
        experts_file = index.path
    capacity = int(n_experts * share / 100)
    reads = {policy: demand_reads(uses, layers, per_token, capacity, policy) / len(steps) for policy in POLICIES}
    disk = [disk_throughput(experts_file, record_bytes, depth) for depth in (1, 2, 4, 8)]
    best = max(disk, key=lambda d: d["reads_per_second"])
    report = {"model": args.model, "budget": args.budget, "tokens": len(steps), "expert_uses_per_token": per_token,
              "experts": n_experts, "cache_entries": capacity, "record_bytes": record_bytes,
              "demand_reads_per_token": reads, "disk": disk,
              "floor_read_ms_per_token": 1e3 * reads["belady"] / best["reads_per_second"]}
    print(f"{per_token} expert uses per token; cache of {capacity} of {n_experts} experts ({args.budget}); "
          f"records of {record_bytes // 1024} KB")
    for policy, value in reads.items():
        print(f"  demand reads per token, {policy:6s} {value:7.1f}")
    for row in disk:
        print(f"  O_DIRECT queue depth {row['queue_depth']}: {row['reads_per_second']:7.0f} reads/s "
              f"{row['gb_per_second']:5.2f} GB/s")
    print(f"  the Belady floor's reads take {report['floor_read_ms_per_token']:.1f} ms per token at the best depth")
    publish(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
