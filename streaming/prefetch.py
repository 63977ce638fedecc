"""The prefetcher: a small pool of threads that load experts into the cache from one priority queue.

Order: demand loads first (a miss: an expert the layer being computed needs and nobody is loading),
then prefetches by (layer distance, -predictor score). The model's thread, which waits for its
misses, reads queued demand loads too, beside the pool threads, so a layer's misses are read in
parallel and none waits for a pool thread busy with a prefetch.

Positions count layer visits across forward passes (`pass * num_layers + layer`), so "stale" is
well defined across tokens: when the model moves past a layer, prefetches queued for that layer or
an earlier one are dropped. A read already in
flight completes into the cache. An error while loading is stored on the entry and raised by the
call that needs that expert (see StreamingExperts), never in the thread and never swallowed.

All shared state is guarded by the cache's lock: the cache's condition tells demand loads that
room may have been made; the pool threads wait on a second condition over the same lock for tasks.
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from edge.core.errors import ZllmError
from edge.core.moe import ExpertWeights
from streaming.cache import Entry, ExpertCache, Key
from streaming.store import ExpertStore

# Records a loading thread reads in one call without the GIL (one after another: the disk's queue is
# as deep as the number of threads). Larger batches take the GIL less often but hold a batch's first
# expert back until its last one has been read.
LOAD_BATCH = 4
DEMAND = (0, 0.0)  # ahead of every prefetch, whose priority is (distance >= 1, -score)
# Loading threads by default: each keeps one read in flight. The disk measured here serves 0.9 GB/s
# to one reader and 1.3-1.5 GB/s at 2-8 (benchmarks/moe_read_floor.py); on the MoEfied SmolLM2 at a
# 50% budget, 4 threads decoded 17.4-18.2 tok/s against 16.0-17.9 with 2 (benchmarks/moe_stream_cpu.py
# --prefetch-threads).
DEFAULT_THREADS = 4


@dataclass(order=True)
class Task:
    priority: tuple                                  # (layer distance, -predictor score)
    sequence: int
    key: Key = field(compare=False)
    target: int = field(compare=False)               # position of the layer that needs the expert
    entry: Entry | None = field(default=None, compare=False)  # reserved up front for a demand load
    cancelled: bool = field(default=False, compare=False)


class Prefetcher:
    def __init__(self, store: ExpertStore, cache: ExpertCache,
                 prepare: Callable[[int, int, np.ndarray], ExpertWeights],
                 threads: int = DEFAULT_THREADS, batch: int = LOAD_BATCH):
        if threads < 1 or batch < 1:
            raise ValueError(f"the prefetcher needs at least one thread and batches of at least one record, "
                             f"got {threads} threads, batches of {batch}")
        self.batch = batch
        self.store, self.cache, self.prepare = store, cache, prepare
        self.lock = cache.lock
        # Pool threads wait for tasks on their own condition (over the same lock): notifying the
        # cache's condition (loads finished, pins released) must not wake every idle loader, each of
        # which would take the GIL from the model's thread only to go back to sleep.
        self.work = threading.Condition(cache.lock)
        self.position = -1
        self._queue: list[Task] = []
        self._queued: dict[Key, Task] = {}
        self._sequence = itertools.count()
        self._closed = False
        self._in_flight = 0
        self.prefetches_queued = self.prefetches_loaded = self.prefetches_cancelled = 0
        self.prefetches_skipped = self.demand_loads = 0
        self.io_seconds = 0.0  # summed wall time of loads (read + decompress + prepare)
        self._threads = [threading.Thread(target=self._work, name=f"zllm-prefetch-{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    @property
    def threads(self) -> int:
        return len(self._threads)

    # --- scheduling (the model's thread) -------------------------------------------------------
    def advance(self, position: int) -> None:
        """The model reached `position`: drop queued prefetches for positions already passed."""
        with self.lock:
            self.position = position
            for task in [t for t in self._queued.values() if t.entry is None and t.target < position]:
                self._cancel(task)
                self.prefetches_cancelled += 1

    def _cancel(self, task: Task) -> None:
        task.cancelled = True
        del self._queued[task.key]

    def _push(self, task: Task) -> None:
        heapq.heappush(self._queue, task)
        self._queued[task.key] = task
        self.work.notify()

    def prefetch(self, key: Key, target: int, distance: int, score: float) -> bool:
        """Queue a prefetch of key for the layer at `target`; False if it is cached or queued already.
        The caller holds `lock` (a whole forecast is queued under one hold)."""
        if key in self._queued or key in self.cache.entries or self._closed:
            return False
        self._push(Task((distance, -float(score)), next(self._sequence), key, target))
        self.prefetches_queued += 1
        return True

    def demand(self, key: Key) -> tuple[Entry, bool]:
        """The entry of an expert the current layer needs, pinned: the cached or loading one, else a new
        one reserved now and queued ahead of every prefetch (then the flag is True). The caller holds
        `lock` (a layer pins its experts under one hold)."""
        entry = self.cache.entries.get(key)
        if entry is not None:
            entry.pins += 1
            return entry, False
        queued = self._queued.get(key)
        if queued is not None:  # predicted, but its read has not started: it becomes a demand load
            self._cancel(queued)
        entry = self.cache.reserve(key, self.store.buffer_bytes(key[0]), for_prefetch=False, position=self.position)
        entry.pins += 1  # pinned before anyone can evict it
        self._push(Task(DEMAND, next(self._sequence), key, self.position, entry))
        self.demand_loads += 1
        return entry, True

    def load_demanded(self) -> None:
        """Read queued demand loads in the calling thread until none is left: the thread that waits for
        them works on them beside the pool threads, so a layer's misses are read in parallel and none
        waits for a pool thread to finish a prefetch."""
        while True:
            with self.lock:
                task = self._pop_demand()
            if task is None:
                return
            self._load([task.entry], prefetched=False)

    def _pop_demand(self) -> Task | None:
        """The first queued demand load, taken off the queue (the lock is held)."""
        while self._queue and (self._queue[0].cancelled or self._queue[0].entry is not None):
            task = heapq.heappop(self._queue)
            if not task.cancelled:
                del self._queued[task.key]
                self._in_flight += 1
                return task
        return None

    # --- loading (pool threads) ----------------------------------------------------------------
    def _next_batch(self) -> tuple[list[Entry], bool] | None:
        """A demand load alone, or up to `batch` prefetches in priority order, each with its entry
        reserved, and whether they are prefetches; None at close."""
        with self.lock:
            batch: list[Entry] = []
            while True:
                while not self._queue and not self._closed and not batch:
                    self.work.wait()
                if self._closed:
                    return None
                if not batch and (demanded := self._pop_demand()) is not None:
                    return [demanded.entry], False
                if not self._queue or len(batch) == self.batch or self._queue[0].entry is not None:
                    if not batch:
                        continue  # only cancelled tasks were left: wait for more
                    self._in_flight += len(batch)
                    return batch, True
                task = heapq.heappop(self._queue)
                if task.cancelled:
                    continue
                del self._queued[task.key]
                if task.target < self.position:
                    self.prefetches_cancelled += 1
                    continue
                if task.key in self.cache.entries:
                    continue
                try:
                    entry = self.cache.reserve(task.key, self.store.buffer_bytes(task.key[0]), for_prefetch=True,
                                               position=self.position, needed_at=task.target)
                except ZllmError:  # an expert the cache can never hold: the demand load will report it
                    entry = None
                if entry is None:
                    self.prefetches_skipped += 1
                    continue
                batch.append(entry)

    def _work(self) -> None:
        while (picked := self._next_batch()) is not None:
            self._load(*picked)

    def _load(self, batch: list[Entry], prefetched: bool) -> None:
        """Read a batch of reserved entries, prepare them, and publish them together."""
        started = time.monotonic()
        try:
            results = self.store.read_batch([(e.key[0], e.key[1], e.buffer) for e in batch])
        except Exception as exc:  # stored on the entries and raised where they are needed
            results = [exc] * len(batch)
        outcomes = []
        for entry, result in zip(batch, results):
            if isinstance(result, BaseException):
                outcomes.append((entry, None, result))
                continue
            try:
                outcomes.append((entry, self.prepare(entry.key[0], entry.key[1], result), None))
            except Exception as exc:
                outcomes.append((entry, None, exc))
        with self.lock:
            self._in_flight -= len(batch)
            self.io_seconds += (time.monotonic() - started) * len(batch)
            for entry, weights, error in outcomes:
                if error is None:
                    self.prefetches_loaded += prefetched
                    self.cache.mark_ready(entry, weights, notify=False)
                else:
                    self.cache.mark_failed(entry, error, notify=False)
            self.lock.notify_all()  # one wake-up for the batch

    def wait_idle(self) -> None:
        """Block until nothing is queued or being loaded (benchmarks and tests use it between phases)."""
        with self.lock:
            while (self._queued or self._in_flight) and not self._closed:
                self.lock.wait()

    def stats(self) -> dict:
        with self.lock:
            return {"prefetches_queued": self.prefetches_queued, "prefetches_loaded": self.prefetches_loaded,
                    "prefetches_cancelled": self.prefetches_cancelled,
                    "prefetches_skipped_full": self.prefetches_skipped, "demand_loads": self.demand_loads,
                    "prefetch_threads": self.threads, "io_seconds": self.io_seconds}

    def close(self) -> None:
        with self.lock:
            self._closed = True
            self.lock.notify_all()
            self.work.notify_all()
        for thread in self._threads:
            thread.join()
