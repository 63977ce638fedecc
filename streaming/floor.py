"""What a streamed MoE decode cannot beat: the expert reads an omniscient cache still needs, and
how fast the disk serves reads at a queue depth.

A route trace is a list of expert uses [(layer, expert)] in execution order, `per_token` uses per
decode step. Replaying it through a cache of `capacity` entries (one per expert) under Belady's
policy (evict the entry needed furthest ahead: it knows the future) gives the fewest demand reads
any policy can make; LRU, "cycle" and "nextuse" are the online policies streaming/cache.py runs.
"""
from __future__ import annotations

import heapq
import mmap
import os
import random
import threading
import time

POLICIES = ("belady", "nextuse", "cycle", "lru")


def demand_reads(uses: list[tuple[int, int]], layers: list[int], per_token: int, capacity: int, policy: str,
                 counted: list[bool] | None = None) -> int:
    """Demand reads of the expert uses [(layer, expert)] in order through a cache of `capacity` entries.

    `counted` (Belady only): which uses' reads count; the others only fill the cache, as the routes that
    ran before the measured steps (a prompt's prefill) filled it."""
    if counted is not None and (policy != "belady" or len(counted) != len(uses)):
        raise ValueError(f"`counted` takes one flag per use and the belady policy, got {len(counted)} flags "
                         f"for {len(uses)} uses and {policy!r}")
    if policy == "belady":
        next_use, seen = [0] * len(uses), {}
        for i in range(len(uses) - 1, -1, -1):
            next_use[i], seen[uses[i]] = seen.get(uses[i], len(uses)), i
        cached, heap, reads = {}, [], 0
        for i, key in enumerate(uses):
            if key not in cached:
                reads += 1 if counted is None or counted[i] else 0
                while len(cached) >= capacity:  # evict the entry needed furthest ahead
                    when, victim = heapq.heappop(heap)
                    if cached.get(victim) == -when:
                        del cached[victim]
            cached[key] = next_use[i]
            heapq.heappush(heap, (-next_use[i], key))
        return reads
    order = {layer: i for i, layer in enumerate(layers)}
    n = len(order)
    cached, reads = {}, 0  # key -> last use
    used = {}  # key -> visits of its layer that used it (nextuse)
    for i, key in enumerate(uses):
        if key not in cached:
            reads += 1
            if len(cached) >= capacity:
                here = order[key[0]]
                in_use = {k for k in uses[i - (i % per_token): i] if k[0] == key[0]}
                candidates = [k for k in cached if k not in in_use]

                def distance(k):  # MoE layers until k's layer is computed again (its own: a whole cycle)
                    return (order[k[0]] - here) % n or n

                if policy == "lru":
                    victim = min(candidates, key=cached.__getitem__)
                elif policy == "cycle":  # the layer the model reaches last, then least recently used
                    victim = min(candidates, key=lambda k: (-distance(k), cached[k]))
                else:  # nextuse: distance + n (1 - p) / p, p = (uses + 1) / (visits + 2) of k's layer so far
                    visits = i // per_token + 1

                    def expected(k):
                        p = (used.get(k, 0) + 1) / (visits + 2)
                        return distance(k) + n * (1 - p) / p

                    victim = max(candidates, key=lambda k: (expected(k), -cached[k]))
                del cached[victim]
        cached[key] = i
        used[key] = used.get(key, 0) + 1
    return reads



def disk_throughput(experts_file: str, record_bytes: int, depth: int, reads: int = 800) -> dict:
    size = os.path.getsize(experts_file)

    def worker():
        fd = os.open(experts_file, os.O_RDONLY | os.O_DIRECT)
        buffer = mmap.mmap(-1, record_bytes)  # page aligned, as O_DIRECT needs
        rng = random.Random(threading.get_ident())
        try:
            for _ in range(reads // depth):
                os.preadv(fd, [buffer], rng.randrange(0, size // record_bytes - 1) * record_bytes)
        finally:
            os.close(fd)

    threads = [threading.Thread(target=worker) for _ in range(depth)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    done = reads // depth * depth
    return {"queue_depth": depth, "reads_per_second": done / seconds, "gb_per_second": done * record_bytes / seconds / 1e9}



def read_seconds(reads: float, record_bytes: int, bandwidth: float, latency: float, depth: int) -> float:
    """Time `reads` reads of `record_bytes` take at queue depth `depth` on a device of `bandwidth`
    bytes/s and `latency` seconds per command: the bytes at the bandwidth, the latency once per
    queue-full of commands."""
    return reads * record_bytes / bandwidth + -(-reads // depth) * latency
