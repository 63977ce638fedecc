"""The prefetcher: a small pool of threads that load experts into the cache from one priority queue.

Order: demand loads (experts the layer being computed is waiting for) first, then prefetches by
(layer distance, -predictor score). Positions count layer visits across forward passes
(`pass * num_layers + layer`), so "stale" is well defined across tokens: when the model moves
past a layer, prefetches queued for that layer or an earlier one are dropped. A read already in
flight completes into the cache. An error while loading is stored on the entry and raised by the
call that needs that expert (see StreamingExperts), never in the thread and never swallowed.

All shared state is guarded by the cache's lock (one Condition for the queue and the cache).
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from edge.errors import ZllmError
from edge.moe import ExpertWeights
from streaming.cache import Entry, ExpertCache, Key
from streaming.store import ExpertStore

DEMAND = (0, 0, 0.0)


@dataclass(order=True)
class Task:
    priority: tuple
    sequence: int
    key: Key = field(compare=False)
    target: int = field(compare=False)               # position of the layer that needs the expert
    entry: Entry | None = field(compare=False)       # reserved up front for a demand load
    cancelled: bool = field(default=False, compare=False)


class Prefetcher:
    def __init__(self, store: ExpertStore, cache: ExpertCache,
                 prepare: Callable[[int, int, np.ndarray], ExpertWeights],
                 threads: int = 2):
        if threads < 1:
            raise ValueError(f"the prefetcher needs at least one thread, got {threads}")
        self.store, self.cache, self.prepare = store, cache, prepare
        self.lock = cache.lock
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
        self.lock.notify_all()

    def is_pending(self, key: Key) -> bool:
        with self.lock:
            return key in self._queued or key in self.cache.entries

    def prefetch(self, key: Key, target: int, distance: int, score: float) -> bool:
        """Queue a prefetch of key for the layer at `target`; False if it is cached or queued already."""
        with self.lock:
            if key in self._queued or key in self.cache.entries or self._closed:
                return False
            self._push(Task((1, distance, -float(score)), next(self._sequence), key, target, None))
            self.prefetches_queued += 1
            return True

    def demand(self, key: Key) -> tuple[Entry, bool]:
        """The entry of an expert the current layer needs, pinned: the cached or loading one, else a new
        one reserved now and loaded ahead of every prefetch (then the flag is True)."""
        with self.lock:
            entry = self.cache.get(key)
            if entry is not None:
                entry.pins += 1
                return entry, False
            queued = self._queued.get(key)
            if queued is not None:  # predicted, but its read has not started: it becomes a demand load
                self._cancel(queued)
            entry = self.cache.reserve(key, self.store.buffer_bytes(key[0]), for_prefetch=False,
                                       position=self.position)
            entry.pins += 1  # pinned before anyone can evict it
            self._push(Task(DEMAND, next(self._sequence), key, self.position, entry))
            self.demand_loads += 1
            return entry, True

    # --- loading (pool threads) ----------------------------------------------------------------
    def _next_task(self) -> tuple[Task, Entry] | None:
        with self.lock:
            while True:
                while not self._queue and not self._closed:
                    self.lock.wait()
                if self._closed:
                    return None
                task = heapq.heappop(self._queue)
                if task.cancelled:
                    continue
                del self._queued[task.key]
                if task.entry is not None:
                    self._in_flight += 1
                    return task, task.entry
                if task.target < self.position:
                    self.prefetches_cancelled += 1
                    continue
                if task.key in self.cache.entries:
                    continue
                try:
                    entry = self.cache.reserve(task.key, self.store.buffer_bytes(task.key[0]), for_prefetch=True,
                                               position=self.position)
                except ZllmError:  # an expert the cache can never hold: the demand load will report it
                    entry = None
                if entry is None:
                    self.prefetches_skipped += 1
                    continue
                entry.needed_at = task.target
                self._in_flight += 1
                return task, entry

    def _work(self) -> None:
        while (picked := self._next_task()) is not None:
            task, entry = picked
            layer, expert = entry.key
            started = time.monotonic()
            try:
                raw = self.store.read(layer, expert, entry.buffer)
                weights, error = self.prepare(layer, expert, raw), None
            except Exception as exc:  # stored on the entry and raised where the expert is needed
                weights, error = None, exc
            with self.lock:
                self._in_flight -= 1
                self.io_seconds += time.monotonic() - started
                if error is None:
                    self.prefetches_loaded += task.entry is None
                    self.cache.mark_ready(entry, weights)
                else:
                    self.cache.mark_failed(entry, error)

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
        for thread in self._threads:
            thread.join()
