"""The expert store: reads one (layer, expert) record of experts.bin into a caller's buffer.

Honest I/O: on Linux the file is opened with O_DIRECT and read with positional reads into
4096-aligned buffers in aligned lengths, so a read goes to the disk, not to the page cache.
Where the filesystem refuses O_DIRECT (tmpfs and some others answer EINVAL at open or at the
first read), the store reads through the page cache and then drops the range it read with
posix_fadvise(POSIX_FADV_DONTNEED), so the next read of that expert goes to the disk again.
Which of the two happens is reported as `io_mode` ("direct" | "buffered+dontneed"), never hidden.

A read that fails, comes back short or fails its crc32 is read once more, whole, before its typed
error is raised (ExpertReadError, ExpertChecksumError, naming the layer and the expert): a fault on
the way (a transient I/O error, a read cut short, a bit flipped in transfer) passes, a record damaged
on disk does not. Such second reads are counted (`reads_again`).

A StorageModel (streaming/storage.py) can be laid on top of the real read.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
from typing import Callable

import numpy as np

from edge.core.errors import CheckpointError
from kernels.cpu.record_io import read_records
from quant.expert_file import ExpertIndex, check_stored_record, raw_record
from streaming.storage import EmulatedDevice, StorageModel, parse_storage

PAGE = 4096
IO_DIRECT = "direct"
IO_BUFFERED = "buffered+dontneed"
log = logging.getLogger(__name__)


def aligned_length(n_bytes: int, alignment: int = PAGE) -> int:
    return -(-n_bytes // alignment) * alignment


def aligned_empty(n_bytes: int, alignment: int = PAGE) -> np.ndarray:
    """An uninitialised uint8 buffer of n_bytes whose first byte sits at a multiple of `alignment`."""
    block = np.empty(n_bytes + alignment, np.uint8)
    skip = (-block.ctypes.data) % alignment
    return block[skip: skip + n_bytes]


def _read_until_end(fd: int, target: np.ndarray, length: int, offset: int, direct: bool) -> int:
    """Positional reads into target until `length` bytes are in or the file ends: -> the bytes read."""
    got = 0
    while got < length:
        # an O_DIRECT read starts on a page: one that stopped inside a page reads that page again
        start = got - got % PAGE if direct else got
        n = os.preadv(fd, [memoryview(target[start:])], offset + start)
        if start + n <= got:  # nothing new: the end of the file
            break
        got = start + n
    return got


class ExpertReadError(CheckpointError):
    """The operating system failed to read an expert record (I/O error, file gone)."""


class ExpertStore:
    """Positional reads of expert records; thread-safe (each thread has its own staging buffer)."""

    def __init__(self, index: ExpertIndex, storage: "str | StorageModel | None" = None, verify: bool = True,
                 direct_io: bool = True, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.index = index
        self.verify = verify
        self.storage = parse_storage(storage)
        self.device = EmulatedDevice(self.storage, clock, sleep) if self.storage else None
        self.clock = clock
        if not os.path.isfile(index.path):
            raise CheckpointError(f"{index.path} is missing; the checkpoint's experts cannot be read, convert it again")
        self._lock = threading.Lock()
        self._local = threading.local()
        self._buffer_bytes: dict[int, int] = {}  # layer -> buffer_bytes (asked once per load)
        self._largest_stored = max((r.length for layer in index.layers.values() for r in layer.records), default=0)
        self.fd, self.io_mode = -1, IO_BUFFERED
        self._retired_fds: list[int] = []
        self._open(direct_io and hasattr(os, "O_DIRECT"))
        self.reads = 0
        self.read_calls = 0           # read system calls: records back to back share one
        self.bytes_read = 0
        self.read_seconds = 0.0       # wall time of reads, emulated waits included
        self.emulated_seconds = 0.0   # of which spent sleeping for the storage model
        self.reads_again = 0          # records read a second time after a failed, short or damaged read

    # --- opening ------------------------------------------------------------------------------
    def _open(self, direct: bool) -> None:
        if direct:
            try:
                self.fd, self.io_mode = os.open(self.index.path, os.O_RDONLY | os.O_DIRECT), IO_DIRECT
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.info("%s: O_DIRECT refused (%s); reading buffered and dropping pages", self.index.path, exc)
        self.fd, self.io_mode = os.open(self.index.path, os.O_RDONLY), IO_BUFFERED

    def _fall_back_to_buffered(self, old_fd: int) -> None:
        with self._lock:
            if self.fd == old_fd and self.io_mode == IO_DIRECT:
                log.info("%s: O_DIRECT reads refused (EINVAL); reading buffered and dropping pages", self.index.path)
                self._open(False)
                # closed at close(): another thread may still be reading through it, and a number
                # closed now could be reused by an unrelated file under that read
                self._retired_fds.append(old_fd)

    # --- sizes --------------------------------------------------------------------------------
    def buffer_bytes(self, layer: int) -> int:
        """Size of the buffer one expert of `layer` is read into (its raw record, aligned up)."""
        size = self._buffer_bytes.get(layer)
        if size is None:
            size = self._buffer_bytes[layer] = aligned_length(self.index.layout(layer).raw_length)
        return size

    def new_buffer(self, layer: int) -> np.ndarray:
        return aligned_empty(self.buffer_bytes(layer))

    def _staging(self) -> np.ndarray:
        """This thread's aligned buffer for compressed records (read, then decompressed into the target)."""
        buffer = getattr(self._local, "staging", None)
        if buffer is None:
            buffer = self._local.staging = aligned_empty(aligned_length(self._largest_stored))
        return buffer

    @property
    def staging_bytes(self) -> int:
        """Memory one reading thread needs beside the target buffer (zero without compression)."""
        return aligned_length(self._largest_stored) if self.index.compression else 0

    # --- reading ------------------------------------------------------------------------------
    def _pread(self, target: np.ndarray, length: int, offset: int) -> int:
        """Read `length` bytes at `offset` into target; returns the bytes that belong to the record. A read
        that returns fewer bytes than asked (the OS may, short of the file's end) is continued where it
        stopped, so only the end of the file leaves a record short."""
        while True:
            fd, mode = self.fd, self.io_mode
            span = aligned_length(length) if mode == IO_DIRECT else length
            try:
                got = _read_until_end(fd, target[:span], length, offset, mode == IO_DIRECT)
            except OSError as exc:
                if exc.errno == errno.EINVAL and mode == IO_DIRECT:
                    self._fall_back_to_buffered(fd)
                    continue
                raise
            if mode == IO_BUFFERED:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
            return min(got, length)

    def read(self, layer: int, expert: int, out: np.ndarray) -> np.ndarray:
        """Read expert (layer, expert) into `out` (from new_buffer(layer)); returns its raw record view."""
        record = self.index.record(layer, expert)
        raw_length = self.index.layout(layer).raw_length
        compressed = self.index.compression is not None
        if len(out) < self.buffer_bytes(layer):
            raise ValueError(f"layer {layer} expert {expert}: buffer of {len(out)} bytes, "
                             f"reading the record needs {self.buffer_bytes(layer)} (new_buffer makes one)")
        target = self._staging() if compressed else out
        started = self.clock()
        done = self.device.schedule(record.length, started) if self.device else None
        try:
            got = self._read_checked(layer, expert, target, record)
        except CheckpointError:
            got = self._read_again(layer, expert, target, record)
        slept = self.device.wait_until(done) if self.device else 0.0
        elapsed = self.clock() - started
        with self._lock:
            self.reads += 1
            self.read_calls += 1
            self.bytes_read += got
            self.read_seconds += elapsed
            self.emulated_seconds += slept
        stored = target[:got]
        if compressed:
            return raw_record(self.index, layer, expert, stored, out)
        return out[:raw_length]

    def read_batch(self, requests: list[tuple[int, int, np.ndarray]]) -> list[np.ndarray | CheckpointError]:
        """Read several records, each (layer, expert, out) as for `read`; returns, in request order, each
        raw record view or the typed error reading it raised, once the batch's emulated time has passed.

        The records are read and checksummed in one call that does not hold the GIL
        (kernels/cpu/record_io.py) and are booked on the emulated device together, as a queue of
        commands issued at once. Compressed records are read one by one (`read`): each needs its
        own staging buffer and decompression."""
        if not requests:
            return []
        if self.index.compression is not None:
            results = []
            for layer, expert, out in requests:
                try:
                    results.append(self.read(layer, expert, out))
                except CheckpointError as exc:
                    results.append(exc)
            return results
        records = [self.index.record(layer, expert) for layer, expert, _ in requests]
        for (layer, expert, out), record in zip(requests, records):
            if len(out) < self.buffer_bytes(layer):
                raise ValueError(f"layer {layer} expert {expert}: buffer of {len(out)} bytes, reading the record "
                                 f"needs {self.buffer_bytes(layer)} (new_buffer makes one)")
        fd, mode, n_records = self.fd, self.io_mode, len(records)
        sizes = [r.length for r in records]
        lengths = np.array(sizes, np.int64)
        spans = (lengths + (PAGE - 1)) // PAGE * PAGE if mode == IO_DIRECT else lengths
        got, crcs = np.empty(n_records, np.int64), np.zeros(n_records, np.uint32)
        started = self.clock()
        done = self.device.schedule_batch(sizes, started) if self.device else None
        calls = read_records(fd, np.fromiter((r.offset for r in records), np.int64, n_records), spans, lengths,
                     np.fromiter((out.ctypes.data for _, _, out in requests), np.uint64, n_records), self.verify,
                     got, crcs)
        if mode == IO_DIRECT and (got >= lengths).all() and (not self.verify or all(
                crc == r.crc32 for crc, r in zip(crcs.tolist(), records))):  # every record whole and intact
            results = [out[:self.index.layout(layer).raw_length] for layer, _, out in requests]
            n_bytes = int(lengths.sum())
        else:
            results, n_bytes = self._check_batch(requests, records, got, crcs)
        slept = self.device.wait_until(done) if self.device else 0.0
        with self._lock:
            self.reads += n_records
            self.read_calls += calls
            self.bytes_read += n_bytes
            self.read_seconds += (self.clock() - started) * n_records
            self.emulated_seconds += slept
        return results

    # --- reads issued elsewhere (an io_uring engine, streaming/prefetch.py RingLoader) ------------
    def read_span(self, layer: int, expert: int, out: np.ndarray) -> tuple[int, int, int]:
        """(file offset, bytes to read, record length) of a read of (layer, expert) into `out`, which
        another engine issues on `fd` and hands back to finish_read. Uncompressed records only."""
        if self.index.compression is not None:
            raise ValueError("compressed expert records are read by read() and read_batch(), which decompress them")
        if len(out) < self.buffer_bytes(layer):
            raise ValueError(f"layer {layer} expert {expert}: buffer of {len(out)} bytes, reading the record "
                             f"needs {self.buffer_bytes(layer)} (new_buffer makes one)")
        record = self.index.record(layer, expert)
        span = aligned_length(record.length) if self.io_mode == IO_DIRECT else record.length
        return record.offset, span, record.length

    def book(self, n_bytes: int, issued_at: float) -> float | None:
        """Book a read of n_bytes issued now on the emulated device: when it delivers it (None: native)."""
        return self.device.schedule(n_bytes, issued_at) if self.device else None

    def wait_until(self, due: float) -> None:
        """Sleep until an emulated read's delivery time (counted as the store's emulated wait)."""
        slept = self.device.wait_until(due) if self.device else 0.0
        with self._lock:
            self.emulated_seconds += slept

    def finish_read(self, layer: int, expert: int, out: np.ndarray, result: int, crc: int,
                    elapsed: float) -> np.ndarray:
        """The raw record view of a read another engine completed into `out` (result: bytes read or
        -errno; crc: the crc32 of what was read). A read that failed, came back short or damaged is read
        again here (`_read_again`, which also switches the store to buffered reads where O_DIRECT was
        refused), and raises its typed error if it fails again."""
        record = self.index.record(layer, expert)
        got = max(min(result, record.length), 0)
        if self.io_mode == IO_BUFFERED and got:
            os.posix_fadvise(self.fd, record.offset, record.length, os.POSIX_FADV_DONTNEED)
        with self._lock:
            self.reads += 1
            self.read_calls += 1
            self.bytes_read += got
            self.read_seconds += elapsed
        if got != record.length or (self.verify and crc != record.crc32):
            again = self._read_again(layer, expert, out, record)
            with self._lock:
                self.bytes_read += again
        return out[:self.index.layout(layer).raw_length]

    def read_again(self, layer: int, expert: int, out: np.ndarray) -> np.ndarray:
        """Another engine's read of (layer, expert) into `out` failed, came back short or damaged: read it
        once more, whole (`_read_again`): its raw record view, or its typed error."""
        again = self._read_again(layer, expert, out, self.index.record(layer, expert))
        with self._lock:
            self.bytes_read += again
        return out[:self.index.layout(layer).raw_length]

    def _check_batch(self, requests, records, got: np.ndarray, crcs: np.ndarray) -> tuple[list, int]:
        """read_batch's results record by record: buffered reads drop their pages, and a record whose
        read failed, came back short or damaged is read again (`_read_again`): its raw view, or the
        typed error the second read raised."""
        fd, mode = self.fd, self.io_mode
        results, n_bytes = [], 0
        for (layer, expert, out), record, n, crc in zip(requests, records, got.tolist(), crcs.tolist()):
            n = min(n, record.length)
            if n > 0 and mode == IO_BUFFERED:
                os.posix_fadvise(fd, record.offset, record.length, os.POSIX_FADV_DONTNEED)
            n_bytes += max(n, 0)
            try:
                if n != record.length or (self.verify and crc != record.crc32):
                    n_bytes += self._read_again(layer, expert, out, record)
                results.append(out[:self.index.layout(layer).raw_length])
            except CheckpointError as exc:
                results.append(exc)
        return results, n_bytes

    def _read_checked(self, layer: int, expert: int, out: np.ndarray, record) -> int:
        """Read the record into `out` and check it: its length, or its typed error."""
        got = self._read_or_raise(layer, expert, out, record)
        check_stored_record(self.index, layer, expert, out[:got], self.verify)
        return got

    def _read_again(self, layer: int, expert: int, out: np.ndarray, record) -> int:
        """A read of the record failed, came back short or failed its crc32: read it once more, whole, so
        that a fault on the way (a transient I/O error, a read cut short) passes, while a record damaged
        on disk raises its typed error (ExpertReadError, ExpertChecksumError)."""
        with self._lock:
            self.reads_again += 1
        return self._read_checked(layer, expert, out, record)

    def _read_or_raise(self, layer: int, expert: int, out: np.ndarray, record) -> int:
        try:
            return self._pread(out, record.length, record.offset)
        except OSError as exc:
            raise self.read_error(layer, expert, record, exc) from exc

    def read_error(self, layer: int, expert: int, record, error: OSError) -> ExpertReadError:
        """The typed error of a failed read of (layer, expert)'s record, naming both and the OS error."""
        return ExpertReadError(f"{self.index.path}: reading layer {layer} expert {expert} ({record.length} bytes at "
                               f"offset {record.offset}) failed: {error}; check the disk holding the checkpoint")

    def stats(self) -> dict:
        with self._lock:
            return {"io_mode": self.io_mode, "storage": self.storage.describe() if self.storage else "native",
                    "reads": self.reads, "read_calls": self.read_calls, "bytes_read": self.bytes_read,
                    "read_seconds": self.read_seconds, "reads_again": self.reads_again,
                    "emulated_wait_seconds": self.emulated_seconds}

    def close(self) -> None:
        with self._lock:
            for fd in [self.fd, *self._retired_fds]:
                if fd >= 0:
                    os.close(fd)
            self.fd, self._retired_fds = -1, []

    def __enter__(self) -> "ExpertStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
