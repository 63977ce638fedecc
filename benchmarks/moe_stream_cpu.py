"""Where a streamed MoE decode spends CPU: the model's thread against the loading threads.

    python benchmarks/moe_stream_cpu.py MOE_CKPT [--budget 50%] [--storage nvme] [--threads 1]
                                        [--strategies resident,predictive,predictive:cycle]
                                        [--new-tokens 48] [--json FILE]

A strategy may name its expert policy after a colon (predictive:cycle); without one it has its default.

Per strategy, in this one process (run it on a quiet machine): load, warm up on one prompt, then
greedy-decode --new-tokens tokens on another and report wall time, the CPU time of the thread that
runs the model (time.thread_time), the whole process's user and system CPU (psutil: the loading
threads are the difference), I/O stall and expert reads per token. When wall time is about
(process CPU) / cores, the cores are saturated and hiding I/O behind compute cannot work.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import psutil

from report import publish

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import edge  # noqa: E402
from edge.bench import text_prompt  # noqa: E402


def measure(path: str, label: str, budget: str, storage: str | None, threads: int, new_tokens: int,
            prefetch_threads: int) -> dict:
    strategy, _, policy = label.partition(":")
    resident = strategy == "resident"
    with edge.load(path, device="cpu", threads=threads, memory_budget="100%" if resident else budget,
                   storage=None if resident else storage, expert_strategy=strategy, expert_policy=policy or None,
                   prefetch_threads=prefetch_threads) as model:
        prompt = text_prompt(model.tokenizer, 64)
        for ids, steps in ((prompt[:32], 4), (prompt[32:], new_tokens)):  # warm-up, then the measured run
            with model.session(capacity=len(ids) + steps + 1) as session:
                token = int(session.prefill(ids).argmax())
                before = model.stats()
                process = psutil.Process()
                cpu, thread_cpu, started = process.cpu_times(), time.thread_time(), time.perf_counter()
                for _ in range(steps):
                    token = int(session.decode(token).argmax())
                wall = time.perf_counter() - started
                thread_cpu = time.thread_time() - thread_cpu
                after_cpu, after = process.cpu_times(), model.stats()
    reads = (after.get("expert_reads") or 0) - (before.get("expert_reads") or 0)
    demand_loads = (after.get("demand_loads") or 0) - (before.get("demand_loads") or 0)
    stall = (after.get("io_stall_seconds") or 0.0) - (before.get("io_stall_seconds") or 0.0)
    return {"strategy": label, "budget": "100%" if resident else budget, "tokens": new_tokens,
            "decode_tokens_per_second": new_tokens / wall, "wall_seconds": wall,
            "model_thread_cpu_seconds": thread_cpu, "process_user_seconds": after_cpu.user - cpu.user,
            "process_system_seconds": after_cpu.system - cpu.system, "io_stall_seconds": stall,
            "expert_reads_per_token": reads / new_tokens, "demand_loads_per_token": demand_loads / new_tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--budget", default="50%")
    parser.add_argument("--storage", default="nvme")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--strategies", default="resident,predictive")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prefetch-threads", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = [measure(args.model, s.strip(), args.budget, args.storage, args.threads, args.new_tokens, args.prefetch_threads)
            for s in args.strategies.split(",") if s.strip()]
    print(f"{'strategy':>17} {'budget':>6} {'tok/s':>6} {'wall s':>7} {'model thread s':>14} "
          f"{'process user s':>14} {'system s':>8} {'stall s':>7} {'reads/token':>11} {'misses/token':>12}")
    for r in rows:
        print(f"{r['strategy']:>17} {r['budget']:>6} {r['decode_tokens_per_second']:>6.1f} {r['wall_seconds']:>7.2f} "
              f"{r['model_thread_cpu_seconds']:>14.2f} {r['process_user_seconds']:>14.2f} "
              f"{r['process_system_seconds']:>8.2f} {r['io_stall_seconds']:>7.2f} {r['expert_reads_per_token']:>11.1f} "
              f"{r['demand_loads_per_token']:>12.1f}")
    report = {"model": args.model, "cores": os.cpu_count(), "threads": args.threads, "storage": args.storage,
              "prefetch_threads": args.prefetch_threads,
              "rows": rows}
    publish(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
