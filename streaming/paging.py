"""The plain-mmap strategy (what llama.cpp does): experts used in place through a mapping of
experts.bin, the operating system's page cache doing the caching.

On a machine with plenty of RAM the page cache would hold every expert and make the comparison
meaningless, so a page cache limited to the budget's expert share is emulated:
- resident experts are tracked in LRU order; when their bytes exceed the share, the least recently
  used is dropped from memory: madvise(MADV_DONTNEED) on its range of the mapping and
  posix_fadvise(POSIX_FADV_DONTNEED) on its range of the file, so its next use faults it in from disk;
- the mapping is advised MADV_RANDOM, so the kernel does not read neighbouring experts ahead
  for free;
- touching an expert that is not resident faults its pages in on the calling thread (there are no
  prefetch threads: every such read stalls the model) and the storage model is applied to those
  bytes, exactly as the expert store applies it to its reads; the bytes faulted in are checked
  against the record's crc32, so a damaged record is refused as the other strategies refuse it.
Only uncompressed checkpoints can be used in place.
"""
from __future__ import annotations

import bisect
import mmap
import os
import time
from collections import OrderedDict
from typing import Callable, Mapping

import numpy as np

from edge.core.errors import CheckpointError
from edge.core.moe import ExpertSet, ExpertWeights, distinct_experts
from quant.expert_file import ExpertIndex, check_stored_record
from streaming.source import prepared_expert
from streaming.stats import StreamingCounters
from streaming.storage import EmulatedDevice, parse_storage
from streaming.store import aligned_length

Key = tuple[int, int]
FOLIO_BYTES = 2 << 20  # the largest page-cache folio one fault maps (a PMD: 2 MB on x86-64 and arm64)


class MappedExperts:
    """ExpertSource over an mmap of experts.bin with an emulated, bounded page cache."""

    def __init__(self, index: ExpertIndex, prepare_weight, cache_bytes: int | None, storage=None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        if index.compression is not None:
            raise CheckpointError(f"{index.path}: expert_strategy 'mmap' uses experts in place, but this checkpoint "
                                  f"stores them {index.compression}-compressed; convert without --compress-experts, "
                                  "or use expert_strategy 'predictive' or 'ondemand'")
        self.index = index
        self.prepare_weight = prepare_weight
        self.cache_bytes = cache_bytes
        self.storage = parse_storage(storage)
        self.device = EmulatedDevice(self.storage, clock, sleep) if self.storage else None
        self.clock = clock
        self._fd = os.open(index.path, os.O_RDONLY)
        self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
        self._map.madvise(mmap.MADV_RANDOM)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            self._map.madvise(mmap.MADV_NOHUGEPAGE)  # no 2 MB mappings: experts are dropped one by one
        self._file_bytes = os.fstat(self._fd).st_size
        # every record's page-aligned span, by offset (to unmap what a fault maps around an expert)
        self._spans = sorted((*self._span(key), key) for key in
                             ((layer, expert) for layer, experts in index.layers.items()
                              for expert in range(len(experts.records))))
        self._span_starts = [start for start, _, _ in self._spans]
        self._bytes = np.frombuffer(self._map, np.uint8)  # [file bytes], read-only
        self._resident: OrderedDict[Key, ExpertWeights] = OrderedDict()  # LRU first
        self._resident_bytes = 0
        self.peak_resident_bytes = 0
        self.counters = StreamingCounters()
        self.bytes_read = 0
        self.evictions = 0

    def _span(self, key: Key) -> tuple[int, int]:
        record = self.index.record(*key)
        return record.offset, aligned_length(record.length)

    def _page_in(self, key: Key) -> ExpertWeights:
        offset, length = self._span(key)
        started = self.clock()
        done = self.device.schedule(length, started) if self.device else None
        record = self.index.record(*key)
        # reading the record for its crc32 faults it in from disk now, on this thread, as using it would
        check_stored_record(self.index, *key, self._bytes[record.offset: record.offset + record.length])
        view = self._bytes[offset: offset + self.index.layout(key[0]).raw_length]
        if self.device:
            self.device.wait_until(done)
        self.counters.stall_seconds += self.clock() - started
        self.bytes_read += length
        self._unmap_around(key)
        return prepared_expert(self.index, self.prepare_weight, key[0], key[1], view)

    def _unmap_around(self, key: Key) -> None:
        """Unmap every page within FOLIO_BYTES of expert `key` that no resident expert (nor `key`)
        covers. Where the page cache holds the file in large folios (ext4 on recent kernels), one
        fault maps the whole folio, neighbouring experts included; left mapped, they would count in
        the RSS outside the budget's account, and no later MADV_DONTNEED of a single expert would
        release them."""
        offset, length = self._span(key)
        low = offset - offset % FOLIO_BYTES
        high = min(self._file_bytes, -(-(offset + length) // FOLIO_BYTES) * FOLIO_BYTES)
        cursor = low
        for index in range(max(0, bisect.bisect_right(self._span_starts, low) - 1), len(self._spans)):
            start, span_length, other = self._spans[index]
            if start >= high:
                break
            if other == key or other in self._resident:
                if start > cursor:
                    self._map.madvise(mmap.MADV_DONTNEED, cursor, start - cursor)
                cursor = max(cursor, start + span_length)
        if cursor < high:
            self._map.madvise(mmap.MADV_DONTNEED, cursor, high - cursor)

    def _drop(self, key: Key) -> None:
        offset, length = self._span(key)
        del self._resident[key]
        self._resident_bytes -= length
        self._map.madvise(mmap.MADV_DONTNEED, offset, length)
        os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_DONTNEED)
        self.evictions += 1

    def experts(self, layer: int, expert_ids: np.ndarray, residual: np.ndarray,
                router_logits: np.ndarray | None = None) -> Mapping[int, ExpertWeights]:
        wanted = distinct_experts(expert_ids)
        chosen = ExpertSet()
        for expert in wanted:
            key = (layer, expert)
            if key in self._resident:
                self.counters.hits += 1
                self._resident.move_to_end(key)
            else:
                self.counters.misses += 1
                self._make_room(self._span(key)[1], keep={(layer, e) for e in wanted})
                self._resident[key] = self._page_in(key)
                self._resident_bytes += self._span(key)[1]
                self.peak_resident_bytes = max(self.peak_resident_bytes, self._resident_bytes)
            chosen[expert] = self._resident[key]
        return chosen

    def _make_room(self, length: int, keep: set[Key]) -> None:
        """Drop least recently used experts (not those this layer needs) until `length` more bytes fit."""
        if self.cache_bytes is None:
            return
        for key in [k for k in self._resident if k not in keep]:
            if self._resident_bytes + length <= self.cache_bytes:
                break
            self._drop(key)

    def begin_request(self) -> None:
        pass  # the page cache's recency carries over requests

    def begin_token(self, embedding) -> None:
        pass  # no predictor: the page cache maps experts as layers touch them

    def resize_cache(self, cache_bytes: int) -> None:
        """Experts past the new bound are dropped as the next ones are mapped."""
        self.cache_bytes = int(cache_bytes)

    def stats(self) -> dict:
        stats = self.counters.to_dict(io_seconds=self.counters.stall_seconds)
        stats.update({"expert_source": "mmap", "bytes_read": self.bytes_read, "io_mode": "mmap",
                      "storage": self.storage.describe() if self.storage else "native",
                      "expert_cache_bytes": self.cache_bytes, "expert_cache_peak_bytes": self.peak_resident_bytes,
                      "expert_evictions": self.evictions, "predictor_precision": None, "predictor_recall": None})
        return stats

    def close(self) -> None:
        self._resident.clear()
        self._bytes = None
        try:
            self._map.close()
        except BufferError:  # weights handed out earlier still view the mapping; it closes when they go
            pass
        os.close(self._fd)
