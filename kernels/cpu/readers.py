"""Reader threads for the slot table where io_uring does not run: old kernels, seccomp sandboxes
(Android apps'), platforms without the liburing package. Each reader is an operating system thread
that runs reader_loop, one compiled loop that never returns to Python until it is stopped, so no
Python runs per read on any thread, as with io_uring.

lanes [R, LANE_FIELDS] int64, one row per reader. The model's thread posts a read (slot, file,
offset, span) into an idle row, counts it in L_POSTED (atomically: whoever sees the count sees the
read) and wakes the reader through the row's eventfd; the reader reads, checks the crc32, publishes
results[slot], crcs[slot] and done[slot] as kernels/cpu/uring.py ring_complete does, and counts the
read in L_FINISHED. A row is idle when both counts agree: one read per reader, so the disk's queue is
as deep as the readers, and reads start in the order the slot table hands them out (demand loads
first). A failed read publishes -EIO; the caller reads it again to learn why.
"""
from __future__ import annotations

import numpy as np
from numba import types

from kernels.cpu.intrinsics import atomic_add, atomic_load
from kernels.cpu.record_io import _crc32, _preadv
from kernels.cpu.runtime import helper, kernel, mutable, readonly
from kernels.cpu.wake import _read, _write, wake_waiters

L_POSTED, L_FINISHED, L_SLOT, L_FD, L_OFFSET, L_SPAN, L_EVENT, L_STOP = range(8)
LANE_FIELDS = 8
EIO = 5

I64, U32, U64 = types.int64, types.uint32, types.uint64


@helper
def lane_word(lanes, r, field):
    """The address of lanes[r, field], for the atomic operations."""
    return lanes.ctypes.data + 8 * (r * LANE_FIELDS + field)


@helper
def lane_idle(lanes, r):
    """Whether reader r has finished every read posted to it."""
    return atomic_load(lane_word(lanes, r, L_FINISHED)) == lanes[r, L_POSTED]


@helper
def _post(lanes, r):
    """Count what row r holds as posted (whoever sees the count sees the row) and wake its reader:
    -> write's result."""
    atomic_add(lane_word(lanes, r, L_POSTED), 1)
    one = np.ones(1, np.uint64)
    return _write(np.int32(lanes[r, L_EVENT]), one.ctypes.data, 8)


@helper
def post_read(lanes, r, slot, fd, offset, span):
    """Hand reader r (idle) the read of `span` bytes at `offset` of `fd` into `slot`'s buffer."""
    lanes[r, L_SLOT], lanes[r, L_FD], lanes[r, L_OFFSET], lanes[r, L_SPAN] = slot, fd, offset, span
    _post(lanes, r)


@kernel(I64(mutable(I64, 2), I64))
def reader_stop(lanes, r):
    """Tell reader r to return once it has finished what it was posted (its row idle or not)."""
    lanes[r, L_STOP] = 1
    return _post(lanes, r)


@kernel(I64(mutable(I64, 2), I64, readonly(U64, 1), readonly(I64, 1), types.boolean, mutable(I64, 1),
            mutable(U32, 1), mutable(I64, 1), mutable(I64, 1)))
def reader_loop(lanes, r, addresses, lengths, checksum, results, crcs, done, wake):
    """Reader r's loop: block on its eventfd until a read is posted, read it (crc32 of the first
    min(result, lengths[slot]) bytes with `checksum`), publish results[slot], crcs[slot] and done[slot]
    (last, atomically), wake the thread waiting for a read (kernels/cpu/wake.py), count it finished;
    -> 0 when reader_stop asks it to return."""
    handled = 0
    counter = np.zeros(1, np.uint64)
    iovec = np.zeros(2, np.uint64)
    while True:
        while atomic_load(lane_word(lanes, r, L_POSTED)) == handled:
            _read(np.int32(lanes[r, L_EVENT]), counter.ctypes.data, 8)  # (interrupted: look again)
        handled += 1
        if lanes[r, L_STOP] != 0:
            return 0
        s = lanes[r, L_SLOT]
        iovec[0], iovec[1] = addresses[s], np.uint64(lanes[r, L_SPAN])
        got = _preadv(np.int32(lanes[r, L_FD]), iovec.ctypes.data, np.int32(1), lanes[r, L_OFFSET])
        results[s] = got if got >= 0 else -EIO
        if checksum and got > 0:
            crcs[s] = _crc32(np.uint32(0), addresses[s], np.uint64(min(got, lengths[s])))
        atomic_add(done.ctypes.data + 8 * s, 1)
        atomic_add(lane_word(lanes, r, L_FINISHED), 1)
        wake_waiters(wake)
