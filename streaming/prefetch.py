"""The prefetcher: loads experts into the cache from one priority queue, through one of two engines.

Order: demand loads first (a miss: an expert the layer being computed needs and nobody is loading),
then prefetches by (layer distance, -predictor score).

    RingLoader    io_uring (kernels/cpu/uring.py): the model's thread submits the queue's head in one
                  compiled call, up to RING_DEPTH reads in flight, and takes completed ones between
                  layers; one completion thread in a compiled loop that never returns to Python checks
                  their crc32, so no Python runs per read off the model's thread. The default where
                  the kernel allows io_uring.
    ThreadLoader  a small pool of threads, each reading a batch per call without the GIL; the model's
                  thread, which waits for its misses, reads queued demand loads too, beside the pool
                  threads, so a layer's misses are read in parallel and none waits for a pool thread
                  busy with a prefetch. The portable fallback (no io_uring, compressed records).

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
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from edge.core.errors import ZllmError
from edge.core.moe import ExpertWeights
from streaming.cache import LOADING, Entry, ExpertCache, Key
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
log = logging.getLogger(__name__)


@dataclass(order=True)
class Task:
    priority: tuple                                  # (layer distance, -predictor score)
    sequence: int
    key: Key = field(compare=False)
    target: int = field(compare=False)               # position of the layer that needs the expert
    entry: Entry | None = field(default=None, compare=False)  # reserved up front for a demand load
    cancelled: bool = field(default=False, compare=False)


class LoadQueue:
    """The queue of loads both engines serve (demand loads first, then prefetches by distance and
    score) and their counters; an engine reads what it takes from it (ThreadLoader, RingLoader)."""

    engine = ""  # as model.stats() names it
    threads = 0  # loading threads of ours

    def __init__(self, store: ExpertStore, cache: ExpertCache,
                 prepare: Callable[[int, int, np.ndarray, int], ExpertWeights]):
        self.store, self.cache, self.prepare = store, cache, prepare
        self.lock = cache.lock
        # Loaders wait for tasks on their own condition (over the same lock): notifying the cache's
        # condition (loads finished, pins released) must not wake every idle loader, each of which
        # would take the GIL from the model's thread only to go back to sleep.
        self.work = threading.Condition(cache.lock)
        self.position = -1
        self._queue: list[Task] = []
        self._queued: dict[Key, Task] = {}
        self._sequence = itertools.count()
        self._closed = False
        self._in_flight = 0
        self.prefetches_queued = self.prefetches_loaded = self.prefetches_cancelled = 0
        self.prefetches_skipped = self.demand_loads = 0
        self.reads_refused = 0  # reads io_uring did not take, read by the model's thread instead
        self.io_seconds = 0.0  # summed wall time of loads (read + decompress + prepare)

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
        `lock` (a layer pins its experts under one hold). An entry whose load failed is loaded again."""
        self.cache.discard_failed(key)
        entry = self.cache.entries.get(key)
        if entry is not None:
            entry.pins += 1
            return entry, False
        queued = self._queued.get(key)
        if queued is not None:  # predicted, but its read has not started: it becomes a demand load
            self._cancel(queued)
        entry = self.cache.reserve(key, self.store.buffer_bytes(key[0]), for_prefetch=False, position=self.position,
                                   wait_for_loads=self._wait_for_loads)
        entry.pins += 1  # pinned before anyone can evict it
        self._push(Task(DEMAND, next(self._sequence), key, self.position, entry))
        self.demand_loads += 1
        return entry, True

    def _pop_demand(self) -> Task | None:
        """The first queued demand load, taken off the queue (the lock is held)."""
        while self._queue and (self._queue[0].cancelled or self._queue[0].entry is not None):
            task = heapq.heappop(self._queue)
            if not task.cancelled:
                del self._queued[task.key]
                self._in_flight += 1
                return task
        return None

    def _take_prefetch(self) -> Entry | None:
        """The next queued prefetch still worth loading, taken off the queue with its entry reserved;
        None when the queue holds none (or a demand load comes first). The lock is held."""
        dropped = False
        while self._queue and self._queue[0].entry is None:
            task = heapq.heappop(self._queue)
            if task.cancelled:
                continue
            del self._queued[task.key]
            dropped = True
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
            self._in_flight += 1
            return entry
        if dropped and not self._queued:  # the queue emptied without a load to publish: wake wait_idle
            self.lock.notify_all()
        return None

    def _publish(self, outcomes: list[tuple[Entry, ExpertWeights | None, BaseException | None]],
                 prefetched: list[bool]) -> None:
        """Mark loaded entries ready (or failed) and wake their waiters once. The lock is held."""
        for (entry, weights, error), was_prefetch in zip(outcomes, prefetched):
            if error is None:
                self.prefetches_loaded += was_prefetch
                self.cache.mark_ready(entry, weights, notify=False)
            else:
                self.cache.mark_failed(entry, error, notify=False)
        self.lock.notify_all()

    def _prepared(self, entry: Entry, result) -> tuple[Entry, ExpertWeights | None, BaseException | None]:
        """(entry, its prepared weights or None, the error or None) from a read's raw view or error."""
        if isinstance(result, BaseException):
            return entry, None, result
        try:
            return entry, self.prepare(entry.key[0], entry.key[1], result, entry.address), None
        except Exception as exc:  # stored on the entry and raised where it is needed
            return entry, None, exc

    # --- what an engine provides -----------------------------------------------------------------
    def _wait_for_loads(self) -> None:
        """A demand load found the cache full of entries being loaded (the lock is held): wait until
        one is published. Loading threads publish and notify `lock`."""
        self.lock.wait()

    def poll(self) -> None:
        """Start queued loads and publish finished ones, without waiting (the model's thread, between
        layers and before it looks at which experts are ready)."""

    def wait_loaded(self, entry: Entry) -> None:
        """Block until the entry's load is published (READY or FAILED)."""
        raise NotImplementedError

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
                    "prefetch_threads": self.threads, "io_engine": self.engine, "io_seconds": self.io_seconds,
                    "io_uring_reads_refused": self.reads_refused}

    def close(self) -> None:
        with self.lock:
            self._closed = True
            self.lock.notify_all()
            self.work.notify_all()


class ThreadLoader(LoadQueue):
    """A pool of threads that take loads off the queue and read them, a batch per call without the GIL
    (ExpertStore.read_batch); the model's thread reads its own queued misses beside them."""

    engine = "threads"

    def __init__(self, store: ExpertStore, cache: ExpertCache,
                 prepare: Callable[[int, int, np.ndarray, int], ExpertWeights],
                 threads: int = DEFAULT_THREADS, batch: int = LOAD_BATCH):
        if threads < 1 or batch < 1:
            raise ValueError(f"the prefetcher needs at least one thread and batches of at least one record, "
                             f"got {threads} threads, batches of {batch}")
        super().__init__(store, cache, prepare)
        self.batch = batch
        self._threads = [threading.Thread(target=self._work, name=f"zllm-prefetch-{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    @property
    def threads(self) -> int:
        return len(self._threads)

    def wait_loaded(self, entry: Entry) -> None:
        # misses no pool thread has taken are read here, in parallel with the pool's reads
        while entry.state == LOADING:
            with self.lock:
                task = self._pop_demand()
            if task is None:
                break
            self._load([task.entry], prefetched=False)
        self.cache.wait_loaded(entry)

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
                entry = self._take_prefetch() if len(batch) < self.batch else None
                if entry is not None:
                    batch.append(entry)
                elif batch:
                    return batch, True
                # else a demand load came first, or nothing worth loading was left: look again

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
        outcomes = [self._prepared(entry, result) for entry, result in zip(batch, results)]
        with self.lock:
            self._in_flight -= len(batch)
            self.io_seconds += (time.monotonic() - started) * len(batch)
            self._publish(outcomes, [prefetched] * len(batch))

    def close(self) -> None:
        super().close()
        for thread in self._threads:
            thread.join()


# Reads the ring keeps in flight. Demand loads beyond it wait in the queue, ahead of every prefetch,
# and go out as soon as a read completes.
RING_DEPTH = 16
# Sleeps (kernels/cpu/uring.py WAIT_MICROSECONDS each) a wait for a read lasts before it looks again
# whether the completion thread is still there.
WAIT_SLEEPS = 5000


class RingLoader(LoadQueue):
    """Loads through io_uring (kernels/cpu/uring.py): the model's thread submits the queue's head in
    `poll` between layers, and takes what completed, while one completion thread, which never returns
    to Python, waits for the completions and checks each record's crc32. `wait_loaded` waits (without
    the GIL) for the one read it needs. An emulated storage device (streaming/storage.py) books each
    read when it is submitted, and a completed read is published no earlier than the emulated device
    would have delivered it."""

    engine = "io_uring"
    threads = 1  # the completion thread

    def __init__(self, store: ExpertStore, cache: ExpertCache,
                 prepare: Callable[[int, int, np.ndarray, int], ExpertWeights], depth: int = RING_DEPTH):
        from kernels.cpu import uring

        super().__init__(store, cache, prepare)
        self._uring = uring
        self.depth = depth
        self._ring = np.zeros(uring.RING_BYTES, np.uint8)
        self._ring_address = self._ring.ctypes.data
        status = uring.ring_init(self._ring_address, 2 * depth)
        if status < 0:
            raise OSError(-status, f"io_uring_setup: {os.strerror(-status)}")
        # per tag (a read in flight's slot): its buffer and record length (for the crc32), and what the
        # completion thread publishes: the bytes read or -errno, the crc32, and done (set last)
        self._addresses = np.zeros(depth, np.uint64)
        self._lengths = np.zeros(depth, np.int64)
        self._results = np.zeros(depth, np.int64)
        self._crcs = np.zeros(depth, np.uint32)
        self._done = np.zeros(depth, np.int64)
        self._finished = np.zeros(depth, np.int64)
        self._refused = np.zeros(1, np.int64)  # why ring_submit's last call left reads out (an errno)
        self._free_tags = list(range(depth - 1, -1, -1))
        self._flight: dict[int, tuple[Entry, bool, float, float | None]] = {}  # tag -> (entry, prefetch, start, due)
        self._arrived: list[tuple[float, Entry, ExpertWeights | None, BaseException | None, bool]] = []
        self._completion_error: int = 0
        for compiled in (uring.ring_submit, uring.ring_stop, uring.ring_complete, uring.ring_finished, uring.ring_wait):
            compiled.dispatcher  # compiled (or loaded from the cache) now, not at the first read's wait
        self._completer = threading.Thread(target=self._complete, name="zllm-io-uring", daemon=True)
        self._completer.start()

    def _complete(self) -> None:
        self._completion_error = self._uring.ring_complete(self._ring.ctypes.data, self._addresses, self._lengths,
                                                           self.store.verify, self._results, self._crcs, self._done,
                                                           self._uring.NO_WAKE)

    # --- submitting (the lock is held) -------------------------------------------------------------
    def _submit(self) -> None:
        """Submit the queue's head (demand loads, then prefetches) while tags are free."""
        if not self._queue:
            return
        batch: list[tuple[Entry, bool]] = []
        while len(batch) < len(self._free_tags) and not self._closed:
            demanded = self._pop_demand()
            if demanded is not None:
                batch.append((demanded.entry, False))
                continue
            entry = self._take_prefetch()
            if entry is None:
                break
            batch.append((entry, True))
        if not batch:
            return
        if self._completion_error:  # nobody would collect them: they fail where they are needed
            self._in_flight -= len(batch)
            for entry, prefetched in batch:
                self._arrived.append((0.0, entry, None, self._read_error(entry, self._completion_error), prefetched))
            return
        offsets, spans, addresses, tags = [], [], [], []
        now = time.monotonic()
        for entry, prefetched in batch:
            layer, expert = entry.key
            offset, span, length = self.store.read_span(layer, expert, entry.buffer)
            tag = self._free_tags.pop()
            offsets.append(offset)
            spans.append(span)
            addresses.append(entry.address)
            tags.append(tag)
            self._addresses[tag], self._lengths[tag] = entry.address, length
            self._flight[tag] = (entry, prefetched, now, self.store.book(length, now))
        taken = self._uring.ring_submit(self._ring_address, self.store.fd, np.array(offsets, np.int64),
                                        np.array(spans, np.int64), np.array(addresses, np.uint64),
                                        np.array(tags, np.int64), self._done, self._refused)
        if taken < len(batch):
            self._read_refused(tags[taken:], int(self._refused[0]))

    def _read_refused(self, tags: list[int], error: int) -> None:
        """Reads the kernel did not take (out of resources, interrupted: errno `error`) are read here, by
        this thread, rather than failed: a submission refused is no fault of the expert's record."""
        self.reads_refused += len(tags)
        log.warning("io_uring did not take %d expert read(s) (%s); the model's thread reads them", len(tags),
                    os.strerror(error))
        for tag in tags:
            entry, prefetched, started, _ = self._flight.pop(tag)
            self._free_tags.append(tag)
            self._in_flight -= 1
            layer, expert = entry.key
            try:
                raw = self.store.read(layer, expert, entry.buffer)
            except Exception as exc:  # stored on the entry and raised where it is needed
                raw = exc
            _, weights, failure = self._prepared(entry, raw)
            self.io_seconds += time.monotonic() - started
            self._arrived.append((0.0, entry, weights, failure, prefetched))

    def _read_error(self, entry: Entry, negative_errno: int) -> BaseException:
        """The typed error (naming layer and expert) of entry's read that failed with -negative_errno."""
        layer, expert = entry.key
        error = OSError(-negative_errno, os.strerror(-negative_errno))
        return self.store.read_error(layer, expert, self.store.index.record(layer, expert), error)

    # --- completing (the lock is held) -------------------------------------------------------------
    def _take_finished(self) -> None:
        """Take the reads the completion thread has published: check, prepare, and hold them until due."""
        if not self._flight:
            return
        if self._completion_error:  # the completion thread has stopped: what is in flight fails with its error
            finished = list(self._flight)
        else:
            flight = np.fromiter(self._flight, np.int64, len(self._flight))
            finished = self._finished[:self._uring.ring_finished(self._done, flight, self._finished)].tolist()
        if not finished:
            return
        now = time.monotonic()
        results, crcs = self._results.tolist(), self._crcs.tolist()  # (one call, not two numpy scalars per read)
        for tag in finished:
            entry, prefetched, started, due = self._flight.pop(tag)
            result, crc = results[tag], crcs[tag]
            self._free_tags.append(tag)
            self._in_flight -= 1
            layer, expert = entry.key
            if self._completion_error:  # no read of the ring is trusted any more: no second read either
                raw = self._read_error(entry, self._completion_error)
            else:
                try:
                    raw = self.store.finish_read(layer, expert, entry.buffer, result, crc, now - started)
                except Exception as exc:  # stored on the entry and raised where it is needed
                    raw = exc
            _, weights, error = self._prepared(entry, raw)
            self.io_seconds += now - started
            self._arrived.append((due or 0.0, entry, weights, error, prefetched))

    def _deliver(self) -> None:
        """Publish the arrived reads whose emulated delivery time has passed."""
        if not self._arrived:
            return
        now = time.monotonic()
        due = [item for item in self._arrived if item[0] <= now]
        if due:
            self._arrived = [item for item in self._arrived if item[0] > now]
            self._publish([(entry, weights, error) for _, entry, weights, error, _ in due],
                          [prefetched for *_, prefetched in due])

    def _step(self) -> None:
        self._take_finished()
        self._submit()
        self._deliver()

    def poll(self) -> None:
        with self.lock:
            self._step()

    def _wait_for_loads(self) -> None:
        """A demand load found the cache full of entries being loaded (the lock is held): publish what
        has completed, else wait for a read, since no other thread publishes them. (No new prefetch is
        submitted first: it would take the room the demand load waits for.)"""
        self._take_finished()
        self._deliver()
        if self._arrived or self._flight:
            self._wait_for_a_read()
        else:  # loads reserved but not submitted yet (every tag was in flight): send them
            self._submit()

    def _wait_for_a_read(self) -> None:
        """Wait out the emulated device for a read that arrived, else wait for the oldest read in flight."""
        if self._arrived:
            self.store.wait_until(min(item[0] for item in self._arrived))
        elif self._flight:
            self._uring.ring_wait(self._done, next(iter(self._flight)), WAIT_SLEEPS)

    def wait_loaded(self, entry: Entry) -> None:
        with self.lock:
            while True:
                self._step()
                if entry.state != LOADING:
                    return
                arrived = [item[0] for item in self._arrived if item[1] is entry]
                if arrived:  # read, waiting out the emulated device
                    self.store.wait_until(arrived[0])
                    continue
                if not self._flight:
                    raise ZllmError(f"layer {entry.key[0]} expert {entry.key[1]} is loading but no read of it is "
                                    "queued or in flight")
                # its read, or (while it waits in the queue for a tag) the oldest read in flight
                tag = next((t for t, flight in self._flight.items() if flight[0] is entry), next(iter(self._flight)))
                self._uring.ring_wait(self._done, tag, WAIT_SLEEPS)

    def wait_idle(self) -> None:
        with self.lock:
            while (self._queued or self._flight or self._arrived) and not self._closed:
                self._step()
                self._wait_for_a_read()

    def close(self) -> None:
        with self.lock:
            for tag in list(self._flight):  # the kernel may still write into their buffers
                while not self._uring.ring_wait(self._done, tag, WAIT_SLEEPS) and self._completer.is_alive():
                    pass
            self._flight.clear()
            if self._completer.is_alive() and self._uring.ring_stop(self._ring.ctypes.data) == 0:
                self._completer.join()
            self._uring.ring_exit(self._ring.ctypes.data)
        super().close()
