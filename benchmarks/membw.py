"""Memory bandwidth probe: how many bytes per second this machine streams from DRAM, per thread count.

Decode of a dense model reads every weight once per token, so bandwidth / (weight bytes per
token) is an upper bound on decode tokens/s; benchmarks/peers.py reports each engine's decode
speed as a fraction of that bound.

Two kernels over arrays far larger than the last-level cache (256 MiB by default), run by
`threads` Python threads on disjoint slices (both release the GIL):
    read   a compiled loop summing int64 words, its slice read as 1 or 4 interleaved streams (the
           better kept: one core keeps more lines in flight over several streams): bytes read / s
    copy   np.copyto between two arrays: (bytes read + bytes written) / s
Each is repeated and the best time kept (the least disturbed by other processes). The bound is
the read rate: decode only reads its weights, and a core that copies at some rate reads at half
of it (the other half are its writes), so the copy rate is no rate a read stream reaches.

    python benchmarks/membw.py [--threads 1,2] [--mib 256]
"""
from __future__ import annotations

import argparse
import json
import threading
import time

import numba
import numpy as np

STREAMS = (1, 4)


@numba.njit
def _stream_words(n_words, streams):
    """Words of each stream when n_words are read as `streams` streams of whole 64-byte lines."""
    return n_words // (8 * streams) * 8


@numba.njit(nogil=True, fastmath=True, boundscheck=False)
def _read_words(words, streams):
    """The sum of the first streams * _stream_words(len, streams) words, read as `streams`
    interleaved streams of 8 words (64 bytes) at a time."""
    length = _stream_words(words.shape[0], streams)
    sums = np.zeros(8, np.int64)
    for i in range(0, length, 8):
        for j in range(streams):
            base = j * length + i
            for lane in range(8):
                sums[lane] += words[base + lane]
    return sums.sum()


def _timed_parallel(work, slices) -> float:
    """Seconds for all threads to run work(slice) once, started together."""
    barrier = threading.Barrier(len(slices) + 1)

    def run(part):
        barrier.wait()
        work(part)

    threads = [threading.Thread(target=run, args=(part,)) for part in slices]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - started


def probe(threads: int = 1, mib: int = 256, repeats: int = 5) -> dict:
    """Best read and copy bandwidth (bytes/s) with `threads` threads over `mib` MiB per array."""
    n = mib * (1 << 20) // 8
    source = np.ones(n, dtype=np.int64)  # ones, not empty: every page is really mapped
    target = np.zeros(n, dtype=np.int64)
    bounds = np.linspace(0, n, threads + 1).astype(np.int64)
    parts = list(zip(bounds[:-1], bounds[1:]))

    def copy(part):
        np.copyto(target[part[0]:part[1]], source[part[0]:part[1]])

    _read_words(source[:64], 1)  # compiled before it is timed
    read_rates = {}
    for streams in STREAMS:
        def read(part, streams=streams):
            _read_words(source[part[0]:part[1]], streams)

        bytes_read = sum(streams * _stream_words(end - begin, streams) for begin, end in parts) * source.itemsize
        read_rates[streams] = bytes_read / min(_timed_parallel(read, parts) for _ in range(repeats))
    copy_seconds = min(_timed_parallel(copy, parts) for _ in range(repeats))
    read_rate = max(read_rates.values())
    copy_rate = 2 * source.nbytes / copy_seconds
    return {"threads": threads, "array_bytes": int(source.nbytes), "read_bytes_per_second": read_rate,
            "read_bytes_per_second_by_streams": {str(k): v for k, v in read_rates.items()},
            "copy_bytes_per_second": copy_rate, "bandwidth_bytes_per_second": read_rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args()
    results = [probe(int(t), args.mib) for t in args.threads.split(",")]
    for r in results:
        print(f"threads {r['threads']}: read {r['read_bytes_per_second'] / 1e9:.1f} GB/s, "
              f"copy {r['copy_bytes_per_second'] / 1e9:.1f} GB/s")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
