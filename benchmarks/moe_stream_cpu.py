"""Where a streamed MoE decode spends CPU: the model's thread against the loading threads.

    python benchmarks/moe_stream_cpu.py MOE_CKPT [--budget 50%] [--storage nvme] [--threads 1]
                                        [--strategies resident,predictive,predictive:cycle]
                                        [--new-tokens 48] [--by-method] [--json FILE]

A strategy may name its expert policy after a colon (predictive:cycle); without one it has its default.

Per strategy, in this one process (run it on a quiet machine): load, warm up on one prompt, then
greedy-decode --new-tokens tokens on another and report wall time, the CPU time of the thread that
runs the model (time.thread_time), the whole process's user and system CPU (psutil: the loading
threads are the difference), I/O stall and expert reads per token. When wall time is about
(process CPU) / cores, the cores are saturated and hiding I/O behind compute cannot work.

--by-method also times, per decoded token, the calls the model's thread makes into the expert
source (pinning a layer's experts, the predictor's observe and forecast, scheduling prefetches)
and the expert mixture (which waits for the loads it needs and reads misses no loading thread has
taken): thread CPU and wall time each (their difference is time spent waiting: for a load, or for
the GIL the loading threads hold).
Only calls on the model's thread are counted.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import threading
import time

import psutil

from report import publish

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import edge  # noqa: E402
from edge.bench import text_prompt  # noqa: E402


# (owner, method) pairs --by-method times, as "module:Class.method"
TIMED_METHODS = ("streaming.source:StreamingExperts.experts", "streaming.slots:SlotExperts.experts",
                 "streaming.source:StreamedLayer.__init__", "streaming.slots:SlotLayer.__init__",
                 "streaming.source:StreamingExperts._schedule", "streaming.slots:SlotExperts._schedule",
                 "streaming.predictor:ExpertPredictor.observe", "streaming.predictor:ExpertPredictor.forecast",
                 "streaming.predictor:ExpertPredictor.observe_and_forecast",
                 "streaming.predictor:ExpertPredictor.decode_arguments",
                 "devices.cpu.backend:CpuBackend.expert_mixture", "streaming.source:StreamedLayer._wait",
                 "streaming.slots:SlotLayer.ready_run", "streaming.slots:SlotLayer.ready_rows",
                 "streaming.prefetch:RingLoader.wait_loaded", "streaming.prefetch:RingLoader.poll")
METHOD_LABELS = {"StreamingExperts.experts": "expert source, all", "StreamedLayer.__init__": "  pin a layer's experts",
                 "StreamingExperts._schedule": "  schedule prefetches", "ExpertPredictor.observe": "  predictor observe",
                 "ExpertPredictor.forecast": "  predictor forecast",
                 "ExpertPredictor.observe_and_forecast": "  predictor observe and forecast",
                 "ExpertPredictor.decode_arguments": "  predictor's arguments to the slot table's call",
                 "CpuBackend.expert_mixture": "expert mixture, all", "StreamedLayer._wait": "  wait for loads",
                 "RingLoader.wait_loaded": "    wait for a read (io_uring)",
                 "RingLoader.poll": "  submit and take reads (io_uring)",
                 "SlotExperts.experts": "slot table, all",
                 "SlotLayer.__init__": "  pin, evict, submit misses (and the predictor's decode step)",
                 "SlotExperts._schedule": "  queue prefetches", "SlotLayer.ready_run": "  wait for a run of reads",
                 "SlotLayer.ready_rows": "  wait for a run of reads, and its descriptor rows"}


@contextlib.contextmanager
def timed_methods(totals: dict):
    """Wrap TIMED_METHODS so that their calls on this thread add (thread CPU, wall, calls) to totals."""
    import importlib

    model_thread, originals = threading.get_ident(), []

    def wrapper(function, name):
        def timed(*args, **kwargs):
            if threading.get_ident() != model_thread:
                return function(*args, **kwargs)
            cpu, wall = time.thread_time(), time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                total = totals[name]
                total[0] += time.thread_time() - cpu
                total[1] += time.perf_counter() - wall
                total[2] += 1
        return timed

    for spec in TIMED_METHODS:
        module, _, qualified = spec.partition(":")
        owner_name, _, method = qualified.partition(".")
        owner = getattr(importlib.import_module(module), owner_name)
        originals.append((owner, method, getattr(owner, method)))
        setattr(owner, method, wrapper(getattr(owner, method), qualified))
    try:
        yield
    finally:
        for owner, method, function in originals:
            setattr(owner, method, function)


def measure(path: str, label: str, budget: str, storage: str | None, threads: int, new_tokens: int,
            prefetch_threads: int, by_method: bool = False) -> dict:
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
                methods = collections.defaultdict(lambda: [0.0, 0.0, 0])
                timing = timed_methods(methods) if by_method else contextlib.nullcontext()
                cpu, thread_cpu, started = process.cpu_times(), time.thread_time(), time.perf_counter()
                with timing:
                    for _ in range(steps):
                        token = int(session.decode(token).argmax())
                wall = time.perf_counter() - started
                thread_cpu = time.thread_time() - thread_cpu
                after_cpu, after = process.cpu_times(), model.stats()
    reads = (after.get("expert_reads") or 0) - (before.get("expert_reads") or 0)
    read_calls = (after.get("expert_read_calls") or 0) - (before.get("expert_read_calls") or 0)
    demand_loads = (after.get("demand_loads") or 0) - (before.get("demand_loads") or 0)
    stall = (after.get("io_stall_seconds") or 0.0) - (before.get("io_stall_seconds") or 0.0)
    return {"strategy": label, "budget": "100%" if resident else budget, "tokens": new_tokens,
            "decode_tokens_per_second": new_tokens / wall, "wall_seconds": wall,
            "model_thread_cpu_seconds": thread_cpu, "process_user_seconds": after_cpu.user - cpu.user,
            "process_system_seconds": after_cpu.system - cpu.system, "io_stall_seconds": stall,
            "expert_reads_per_token": reads / new_tokens, "read_calls_per_token": read_calls / new_tokens,
            "demand_loads_per_token": demand_loads / new_tokens,
            "methods_per_token": {name: {"cpu_ms": 1e3 * cpu_s / new_tokens, "wall_ms": 1e3 * wall_s / new_tokens,
                                         "calls": calls / new_tokens}
                                  for name, (cpu_s, wall_s, calls) in methods.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--budget", default="50%")
    parser.add_argument("--storage", default="nvme")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--strategies", default="resident,predictive")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prefetch-threads", type=int, default=4)
    parser.add_argument("--by-method", action="store_true",
                        help="also time the model thread's calls into the expert source and the mixture")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = [measure(args.model, s.strip(), args.budget, args.storage, args.threads, args.new_tokens, args.prefetch_threads,
                    args.by_method)
            for s in args.strategies.split(",") if s.strip()]
    print(f"{'strategy':>17} {'budget':>6} {'tok/s':>6} {'wall s':>7} {'model thread s':>14} "
          f"{'process user s':>14} {'system s':>8} {'stall s':>7} {'reads/token':>11} {'calls/token':>11} "
          f"{'misses/token':>12}")
    for r in rows:
        print(f"{r['strategy']:>17} {r['budget']:>6} {r['decode_tokens_per_second']:>6.1f} {r['wall_seconds']:>7.2f} "
              f"{r['model_thread_cpu_seconds']:>14.2f} {r['process_user_seconds']:>14.2f} "
              f"{r['process_system_seconds']:>8.2f} {r['io_stall_seconds']:>7.2f} {r['expert_reads_per_token']:>11.1f} "
              f"{r['read_calls_per_token']:>11.1f} {r['demand_loads_per_token']:>12.1f}")
    for r in rows:
        if r["methods_per_token"]:
            print(f"{r['strategy']} at {r['budget']}, the model's thread, per token:  CPU ms   wall ms  calls")
            for name in (spec.partition(":")[2] for spec in TIMED_METHODS):
                if name not in r["methods_per_token"]:
                    continue
                t = r["methods_per_token"][name]
                print(f"  {METHOD_LABELS[name]:<28} {t['cpu_ms']:>8.2f} {t['wall_ms']:>9.2f} {t['calls']:>6.0f}")
    report = {"model": args.model, "cores": os.cpu_count(), "threads": args.threads, "storage": args.storage,
              "prefetch_threads": args.prefetch_threads,
              "rows": rows}
    publish(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
