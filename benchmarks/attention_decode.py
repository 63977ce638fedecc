"""The cpu backend's decode attention on its own: nanoseconds per (key, query head) and KV bytes per second.

    python benchmarks/attention_decode.py [--keys 256,2048] [--heads 9 --kv-heads 3 --head-dim 64]
                                          [--layers 1,30] [--repeats 9] [--json FILE]

One decode token's attention over an f16 cache [keys, KV heads, head dim], cut into the splits the
fused forward uses (kernels/cpu/attention.py decode_splits) and run through the same item
(partial_attention_heads) on one thread, for every layer's own cache: with 1 layer the cache stays in
L2/L3 (the arithmetic's cost), with 30 (SmolLM2's count) it comes from memory as in a real decode
step. The default shape is SmolLM2-135M's (GQA 9 / 3 heads of 64). Each figure is the best and the
median of --repeats timed calls; the machine's load average is printed, since other processes steal
the core.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from numba import types

from report import publish

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.cpu.attention import decode_splits, partial_attention_heads, scratch_floats  # noqa: E402
from kernels.cpu.runtime import kernel, mutable, readonly  # noqa: E402

F16_BYTES = 2


@kernel(types.float64(readonly(types.float32, 2), readonly(types.uint16, 4), readonly(types.uint16, 4),
                      readonly(types.int64, 1), types.int64, mutable(types.float32, 1)))
def attend_every_layer(q, keys, values, k_positions, n_splits, work):
    """Every layer's decode attention of q [Hq, Dh] over its keys/values [S, Hkv, Dh] -> a checksum."""
    n_layers, n_keys, n_kv = keys.shape[0], keys.shape[1], keys.shape[2]
    total = 0.0
    for layer in range(n_layers):
        for split in range(n_splits):
            peaks, totals, accs = partial_attention_heads(
                q, keys[layer].ctypes.data, values[layer].ctypes.data, n_kv, F16_BYTES, n_keys * split // n_splits,
                n_keys * (split + 1) // n_splits, k_positions, n_keys, 0, np.float32(q.shape[1] ** -0.5), work)
            total += peaks[0] + totals[0] + accs[0, 0]
    return total


def measure(n_keys: int, n_layers: int, heads: int, kv_heads: int, head_dim: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    shape = (n_layers, n_keys, kv_heads, head_dim)
    keys, values = (rng.standard_normal(shape).astype(np.float16).view(np.uint16) for _ in range(2))
    for cache in (keys, values):
        cache.setflags(write=False)
    q = rng.standard_normal((heads, head_dim)).astype(np.float32)
    q.setflags(write=False)
    positions = np.arange(n_keys, dtype=np.int64)
    positions.setflags(write=False)
    n_splits = decode_splits(n_keys, 0)
    work = np.zeros(scratch_floats(heads, n_keys, head_dim), np.float32)
    attend_every_layer(q, keys, values, positions, n_splits, work)  # compile or load, and warm up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        attend_every_layer(q, keys, values, positions, n_splits, work)
        seconds.append(time.perf_counter() - start)
    pairs = n_layers * n_keys * heads
    best, median = min(seconds), float(np.median(seconds))
    return {"keys": n_keys, "layers": n_layers, "splits": n_splits, "kv_bytes": 2 * keys.nbytes,
            "best_ns_per_key_head": best / pairs * 1e9, "median_ns_per_key_head": median / pairs * 1e9,
            "best_kv_bytes_per_second": 2 * keys.nbytes / best}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", default="256,2048")
    parser.add_argument("--layers", default="1,30")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads or args.repeats < 1:
        parser.error("--heads must be a multiple of --kv-heads, and --repeats at least 1")
    result = {"shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim},
              "load_average_before": os.getloadavg(), "rows": []}
    print(f"decode attention, f16 cache, {args.heads} / {args.kv_heads} heads of {args.head_dim}, one thread")
    print(f"  {'keys':>6s} {'layers':>6s} {'splits':>6s} {'best ns':>8s} {'median ns':>9s} {'KV GB/s':>8s}")
    for n_keys in (int(k) for k in args.keys.split(",")):
        for n_layers in (int(n) for n in args.layers.split(",")):
            row = measure(n_keys, n_layers, args.heads, args.kv_heads, args.head_dim, args.repeats)
            result["rows"].append(row)
            print(f"  {n_keys:6d} {n_layers:6d} {row['splits']:6d} {row['best_ns_per_key_head']:8.2f} "
                  f"{row['median_ns_per_key_head']:9.2f} {row['best_kv_bytes_per_second'] / 1e9:8.2f}")
    result["load_average_after"] = os.getloadavg()
    publish(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
