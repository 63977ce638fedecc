"""Expert store I/O: real read throughput (O_DIRECT vs buffered + page drop) and the storage emulation.

    python benchmarks/streaming_io.py [--experts 64] [--expert-mb 1.5] [--threads 1,2,4] [--json FILE]

Writes an expert file of random f16 experts in a temporary folder (on the filesystem of --dir), then:
1. reads every expert in a shuffled order, twice, per io mode: what the disk gives to one thread;
2. reads batches of 1, 2 and 4 experts that lie back to back in the file (O_DIRECT, one thread),
   which the store reads with one request per batch: wall time and kernel CPU time per expert;
3. for each storage preset, reads experts from 1, 2, 4 threads at once: the effective bandwidth must
   stay at or under the preset's (reads share the emulated device) and no read may be shorter than
   the preset's latency + size / bandwidth.
Prints a table and, with --json, writes the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from converters.expert_file import ExpertFileWriter  # noqa: E402
from quant import Scheme  # noqa: E402
from quant.expert_file import EXPERTS_FILE, PROJECTIONS, ExpertIndex, ExpertLayout  # noqa: E402
from streaming.storage import PRESETS  # noqa: E402
from streaming.store import ExpertStore  # noqa: E402


def write_experts(folder: str, n_experts: int, expert_mb: float) -> ExpertIndex:
    hidden = 1024
    intermediate = max(32, int(expert_mb * 1e6 / (3 * hidden * 2)) // 32 * 32)
    shapes = {"gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden), "down_proj": (hidden, intermediate)}
    layout = ExpertLayout.plan({p: Scheme("f16") for p in PROJECTIONS}, shapes)
    rng = np.random.default_rng(0)
    with ExpertFileWriter(os.path.join(folder, EXPERTS_FILE)) as writer:
        writer.add_layer(0, layout, n_experts)
        for expert in range(n_experts):
            writer.write(0, expert, {p: rng.standard_normal(s).astype(np.float16) for p, s in shapes.items()})
    return ExpertIndex(folder, writer.entry())


def real_throughput(index: ExpertIndex, direct: bool) -> dict:
    store = ExpertStore(index, direct_io=direct)
    buffer = store.new_buffer(0)
    order = np.random.default_rng(1).permutation(len(index.layers[0].records))
    passes = []
    for _ in range(2):
        started = time.perf_counter()
        for expert in order:
            store.read(0, int(expert), buffer)
        passes.append(time.perf_counter() - started)
    stats = store.stats()
    store.close()
    total = sum(index.record(0, int(e)).length for e in order)
    return {"io_mode": stats["io_mode"], "mb_per_s_pass1": total / passes[0] / 1e6,
            "mb_per_s_pass2": total / passes[1] / 1e6, "ms_per_read": 1e3 * passes[1] / len(order)}


def batched_reads(index: ExpertIndex, batch: int) -> dict:
    """Read every expert once, `batch` neighbours per read_batch call, the batches in a shuffled order."""
    store = ExpertStore(index, direct_io=True)
    buffers = [store.new_buffer(0) for _ in range(batch)]
    n_experts = len(index.layers[0].records) // batch * batch
    starts = np.random.default_rng(2).permutation(np.arange(0, n_experts, batch))
    store.read_batch([(0, i, buffers[i]) for i in range(batch)])  # load the compiled reader first
    store.reads = store.read_calls = 0
    system, started = resource.getrusage(resource.RUSAGE_SELF).ru_stime, time.perf_counter()
    for first in starts:
        store.read_batch([(0, int(first) + i, buffers[i]) for i in range(batch)])
    wall, system = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF).ru_stime - system
    stats = store.stats()
    store.close()
    return {"batch": batch, "io_mode": stats["io_mode"], "reads": stats["reads"], "read_calls": stats["read_calls"],
            "ms_per_expert": 1e3 * wall / n_experts, "system_us_per_expert": 1e6 * system / n_experts}


def emulated(index: ExpertIndex, preset: str, threads: int, reads_per_thread: int) -> dict:
    store = ExpertStore(index, storage=preset)
    model = PRESETS[preset]
    durations: list[float] = []
    lock = threading.Lock()

    def reader(offset: int) -> None:
        buffer = store.new_buffer(0)
        for i in range(reads_per_thread):
            expert = (offset + i * threads) % len(index.layers[0].records)
            started = time.perf_counter()
            store.read(0, expert, buffer)
            with lock:
                durations.append(time.perf_counter() - started)

    started = time.perf_counter()
    workers = [threading.Thread(target=reader, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - started
    stats = store.stats()
    store.close()
    size = index.record(0, 0).length
    return {"storage": preset, "threads": threads, "reads": len(durations),
            "model_mb_per_s": model.bandwidth_bytes_per_s / 1e6, "achieved_mb_per_s": stats["bytes_read"] / wall / 1e6,
            "model_read_ms": 1e3 * model.read_seconds(size), "shortest_read_ms": 1e3 * min(durations),
            "median_read_ms": 1e3 * float(np.median(durations))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--expert-mb", type=float, default=1.5)
    parser.add_argument("--threads", default="1,2,4")
    parser.add_argument("--reads", type=int, default=24, help="emulated reads per thread")
    parser.add_argument("--dir", default=None, help="folder for the temporary expert file (default: system temp)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        index = write_experts(folder, args.experts, args.expert_mb)
        size_mb = index.record(0, 0).length / 1e6
        real = [real_throughput(index, direct) for direct in (True, False)]
        batched = [batched_reads(index, batch) for batch in (1, 2, 4, 1, 2, 4)]  # twice, interleaved
        emulation = [emulated(index, preset, int(t), args.reads) for preset in PRESETS
                     for t in args.threads.split(",")]
    print(f"expert file: {args.experts} experts of {size_mb:.2f} MB")
    print(f"{'io mode':18s} {'pass 1 MB/s':>12s} {'pass 2 MB/s':>12s} {'ms/read':>8s}")
    for row in real:
        print(f"{row['io_mode']:18s} {row['mb_per_s_pass1']:12.0f} {row['mb_per_s_pass2']:12.0f} {row['ms_per_read']:8.3f}")
    print(f"\n{'batch of neighbours':>19s} {'read calls':>10s} {'ms/expert':>9s} {'kernel CPU us/expert':>20s}")
    for row in batched:
        print(f"{row['batch']:19d} {row['read_calls']:10d} {row['ms_per_expert']:9.3f} {row['system_us_per_expert']:20.1f}")
    print(f"\n{'storage':8s} {'threads':>7s} {'model MB/s':>10s} {'got MB/s':>9s} {'model ms':>9s} {'min ms':>8s} "
          f"{'median ms':>9s}")
    for row in emulation:
        print(f"{row['storage']:8s} {row['threads']:7d} {row['model_mb_per_s']:10.0f} {row['achieved_mb_per_s']:9.0f} "
              f"{row['model_read_ms']:9.3f} {row['shortest_read_ms']:8.3f} {row['median_read_ms']:9.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"expert_mb": size_mb, "experts": args.experts, "real": real, "batched": batched,
                       "emulated": emulation}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
