"""The cpu backend's decode attention on its own: nanoseconds per (key, query head) and KV bytes per second.

    python benchmarks/attention_decode.py [--keys 256,2048] [--heads 9 --kv-heads 3 --head-dim 64]
                                          [--layers 1,30] [--weights-between 0,2.6] [--repeats 9]
                                          [--json FILE]

One decode token's attention over an f16 cache [keys, KV heads, head dim], cut into the splits the
fused forward uses (kernels/cpu/attention.py decode_splits) and run through the same item
(partial_attention_heads) on one thread, for every layer's own cache: with 1 layer the cache stays in
L2/L3 (the arithmetic's cost), with 30 (SmolLM2's count) it comes from memory as in a real decode
step. --weights-between reads that many MB of other memory before each layer's attention (untimed
reads are not possible inside one call, so the figures subtract the time of the same reads alone):
what a decode step's weight rows do to the caches between two layers' attention (SmolLM2-135M INT4
streams about 2.6 MB per layer).

A second table compares, on one block of keys in cache (the arithmetic alone), the dot products
and value sums with each query head on its own (one call per head) and with a GQA group's heads
sharing each key and value row (one call per KV head, kernels/cpu/attention.py TILE_HEADS), in
alternating rounds within this process; both give the same bits. The default shape is SmolLM2-135M's (GQA 9 / 3 heads of 64). Each figure is the best and the
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

from kernels.cpu.attention import (ROWS_PER_BLOCK, decode_splits, key_scores, partial_attention_heads,  # noqa: E402
                                   scratch_floats, sum_values)
from kernels.cpu.runtime import kernel, mutable, readonly  # noqa: E402

F16_BYTES = 2


@kernel(types.float64(readonly(types.float32, 2), readonly(types.uint16, 4), readonly(types.uint16, 4),
                      readonly(types.int64, 1), types.int64, mutable(types.float32, 1), readonly(types.float32, 2),
                      types.boolean))
def attend_every_layer(q, keys, values, k_positions, n_splits, work, weights, attend):
    """Every layer's decode attention of q [Hq, Dh] over its keys/values [S, Hkv, Dh], after reading
    that layer's row of `weights` (if attend is False, only the reads) -> a checksum."""
    n_layers, n_keys, n_kv = keys.shape[0], keys.shape[1], keys.shape[2]
    total = 0.0
    for layer in range(n_layers):
        row = weights[layer % weights.shape[0]]
        read = np.float32(0.0)
        for i in range(0, row.shape[0], 16):  # one float per cache line
            read += row[i]
        total += read
        if not attend:
            continue
        for split in range(n_splits):
            peaks, totals, accs = partial_attention_heads(
                q, keys[layer].ctypes.data, values[layer].ctypes.data, n_kv, F16_BYTES, n_keys * split // n_splits,
                n_keys * (split + 1) // n_splits, k_positions, n_keys, 0, np.float32(q.shape[1] ** -0.5), work)
            total += peaks[0] + totals[0] + accs[0, 0]
    return total


@kernel(types.void(readonly(types.uint16, 3), readonly(types.float32, 2), readonly(types.float32, 2), types.int64,
                   types.int64, types.boolean, mutable(types.float32, 2), mutable(types.float32, 2)))
def block_arithmetic(rows, queries, weights, heads_per_call, repeats, values, scores, sums):
    """`repeats` times: the scores of every query head against the rows [n, Hkv, Dh] as keys (values
    False), or the weighted sums of the rows as values (weights [Hq, n]), heads_per_call heads of a
    KV head's group per call."""
    n, n_kv, head_dim = rows.shape
    n_heads = queries.shape[0]
    group = n_heads // n_kv
    row_bytes = F16_BYTES * n_kv * head_dim
    for _ in range(repeats):
        for h in range(0, n_heads, heads_per_call):
            cache = rows.ctypes.data + F16_BYTES * (h // group) * head_dim
            if values:
                sum_values(F16_BYTES, cache, row_bytes, n, weights[h].ctypes.data, 4 * n, head_dim,
                           sums[h].ctypes.data, 4 * head_dim, heads_per_call)
            else:
                key_scores(F16_BYTES, cache, row_bytes, head_dim, 0, n, queries[h].ctypes.data, heads_per_call,
                           scores[h].ctypes.data, n)


def compare_tiles(heads: int, kv_heads: int, head_dim: int, rounds: int) -> dict:
    """ns per (key, query head) of the block's dot products and value sums, one head per call against a
    group per call: the best of `rounds` alternating rounds."""
    rng = np.random.default_rng(1)
    n = ROWS_PER_BLOCK
    rows = rng.standard_normal((n, kv_heads, head_dim)).astype(np.float16).view(np.uint16)
    queries = rng.standard_normal((heads, head_dim)).astype(np.float32)
    weights = rng.random((heads, n)).astype(np.float32)
    results = {}
    for values in (False, True):
        outputs = {}
        for per_call in (1, heads // kv_heads):
            scores, sums = np.zeros((heads, n), np.float32), np.zeros((heads, head_dim), np.float32)
            block_arithmetic(rows, queries, weights, per_call, 1, values, scores, sums)
            outputs[per_call] = (scores, sums)
        one, group = outputs[1], outputs[heads // kv_heads]
        assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(one, group)), \
            "a group per call gave other bits than one head per call"
        repeats, best = 2000, {per_call: float("inf") for per_call in outputs}
        for _ in range(rounds):
            for per_call, (scores, sums) in outputs.items():
                start = time.perf_counter()
                block_arithmetic(rows, queries, weights, per_call, repeats, values, scores, sums)
                best[per_call] = min(best[per_call], (time.perf_counter() - start) / (repeats * heads * n) * 1e9)
        results["value_sums" if values else "key_dots"] = {"ns_one_head_per_call": best[1],
                                                           "ns_group_per_call": best[heads // kv_heads]}
    return results


def best_and_median(call, repeats: int) -> tuple[float, float]:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return min(seconds), float(np.median(seconds))


def measure(n_keys: int, n_layers: int, heads: int, kv_heads: int, head_dim: int, weights_mb: float,
            repeats: int) -> dict:
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
    # each layer its own weights (rows of 0 floats when there are none), so that none stay cached
    weights = np.ones((n_layers, int(weights_mb * 2 ** 20) // 4), np.float32)
    weights.setflags(write=False)

    def run(attend: bool):
        return lambda: attend_every_layer(q, keys, values, positions, n_splits, work, weights, attend)

    run(True)()  # compile or load, and warm up
    best, median = best_and_median(run(True), repeats)
    if weights_mb > 0:
        reads_best, reads_median = best_and_median(run(False), repeats)
        best, median = best - reads_best, median - reads_median
    pairs = n_layers * n_keys * heads
    return {"keys": n_keys, "layers": n_layers, "weights_mb_between_layers": weights_mb, "splits": n_splits,
            "kv_bytes": 2 * keys.nbytes, "best_ns_per_key_head": best / pairs * 1e9,
            "median_ns_per_key_head": median / pairs * 1e9, "best_kv_bytes_per_second": 2 * keys.nbytes / best}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", default="256,2048")
    parser.add_argument("--layers", default="1,30")
    parser.add_argument("--weights-between", default="0", help="MB read before each layer, comma-separated")
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
    print(f"  {'keys':>6s} {'layers':>6s} {'MB between':>10s} {'splits':>6s} {'best ns':>8s} {'median ns':>9s} "
          f"{'KV GB/s':>8s}")
    for n_keys in (int(k) for k in args.keys.split(",")):
        for n_layers in (int(n) for n in args.layers.split(",")):
            for weights_mb in (float(w) for w in args.weights_between.split(",")):
                row = measure(n_keys, n_layers, args.heads, args.kv_heads, args.head_dim, weights_mb, args.repeats)
                result["rows"].append(row)
                print(f"  {n_keys:6d} {n_layers:6d} {weights_mb:10.1f} {row['splits']:6d} "
                      f"{row['best_ns_per_key_head']:8.2f} {row['median_ns_per_key_head']:9.2f} "
                      f"{row['best_kv_bytes_per_second'] / 1e9:8.2f}")
    result["tiles"] = compare_tiles(args.heads, args.kv_heads, args.head_dim, max(args.repeats, 5))
    print(f"one block of {ROWS_PER_BLOCK} keys in cache: ns per (key, query head), best of alternating rounds")
    print(f"  {'':10s} {'one head per call':>18s} {'group per call':>15s}")
    for name, row in result["tiles"].items():
        print(f"  {name:10s} {row['ns_one_head_per_call']:18.2f} {row['ns_group_per_call']:15.2f}")
    result["load_average_after"] = os.getloadavg()
    publish(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
