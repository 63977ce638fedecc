"""Expert reads through io_uring, in compiled calls that do not hold the GIL.

The model's thread queues a batch of positional reads into the ring in one call (ring_submit) and
goes back to computing; the kernel's workers read them in parallel (the disk's queue is as deep as
the reads in flight). One completion thread of ours runs ring_complete, a compiled loop that never
returns to Python while the ring lives: it waits in the kernel for each completion, checks the
record's crc32 and publishes the result in plain arrays, which the model's thread reads without a
system call (ring_finished) or waits on (ring_wait). So neither the reads nor their checks take the
GIL or the model thread's time, and no Python runs per read outside the model's thread.

The functions are liburing's, bound by symbol name from the shared library the PyPI package
`liburing` ships (its extension module exports the library's inline helpers too), as ISA-L's
crc32 is bound in record_io.py. Where the package is missing (it has wheels for x86-64 Linux) or
the kernel refuses io_uring (old kernels, seccomp sandboxes such as Android apps'),
`unavailable_reason()` says why and the streaming reads through reader threads instead
(kernels/cpu/readers.py for the slot table, streaming/prefetch.py for the Python cache).

A ring is a caller-owned byte array holding liburing's `struct io_uring`; addresses are int64
`array.ctypes.data` values; the caller keeps the arrays alive.
"""
from __future__ import annotations

import glob
import os

import numpy as np
from numba import types

import kernels.cpu.record_io  # noqa: F401  (loads ISA-L, whose crc32 ring_complete calls)
from kernels.cpu.intrinsics import atomic_add, atomic_load, int64_pointer, sleep_microseconds, spin_pause
from kernels.cpu.runtime import helper, kernel, mutable, readonly
from kernels.cpu.wake import wake_waiters

RING_BYTES = 1024  # room for liburing's struct io_uring (216 bytes in liburing 2.x)
EINTR, EAGAIN, ENOSYS = 4, 11, 38
IOSQE_ASYNC = 1 << 4  # hand the request to the kernel's workers instead of issuing it inline
STOP_TAG = (1 << 62) - 1  # the user data of ring_stop's no-op
VOID_TAG = STOP_TAG - 1  # the user data of a read the kernel did not take, turned into a no-op
NO_WAKE = np.array([0, -1], np.int64)  # ring_complete's wake where no thread waits on an eventfd
WAIT_MICROSECONDS = 20
# Submissions tried again (WAIT_MICROSECONDS apart) while the kernel takes none of the queued reads
# because it was interrupted or short of resources (EINTR, EAGAIN), before the rest are given up.
SUBMIT_ATTEMPTS = 50

_unavailable: str | None = None
try:
    import liburing as _liburing
    import llvmlite.binding as llvm

    _libraries = glob.glob(os.path.join(os.path.dirname(_liburing.__file__), "liburing*.so"))
    if not _libraries:
        raise ImportError(f"no liburing*.so beside {_liburing.__file__}")
    llvm.load_library_permanently(_libraries[0])
except (ImportError, OSError, RuntimeError) as exc:  # no wheel for this platform, or the library does not load
    _unavailable = f"the liburing package is not usable here ({exc})"


def _bind_refusing_stubs() -> list:
    """Where liburing does not load, its symbols still resolve, to functions that refuse (no ring: -ENOSYS;
    no submission entry), so that kernels which also read through reader threads (the slot table's)
    compile on every platform. ring_init refuses first, so nothing else is ever called."""
    import ctypes as c

    import llvmlite.binding as llvm

    stubs = []
    for name, restype, argtypes, value in (
            ("io_uring_queue_init", c.c_int32, (c.c_uint32, c.c_uint64, c.c_uint32), -ENOSYS),
            ("io_uring_queue_exit", None, (c.c_uint64,), None),
            ("io_uring_get_sqe", c.c_uint64, (c.c_uint64,), 0),
            ("io_uring_prep_read", None, (c.c_uint64, c.c_int32, c.c_uint64, c.c_uint32, c.c_uint64), None),
            ("io_uring_sqe_set_data64", None, (c.c_uint64, c.c_uint64), None),
            ("io_uring_sqe_set_flags", None, (c.c_uint64, c.c_uint32), None),
            ("io_uring_prep_nop", None, (c.c_uint64,), None),
            ("io_uring_submit", c.c_int32, (c.c_uint64,), -ENOSYS),
            ("io_uring_sq_ready", c.c_uint32, (c.c_uint64,), 0),
            ("io_uring_wait_cqe", c.c_int32, (c.c_uint64, c.c_uint64), -ENOSYS),
            ("io_uring_cqe_seen", None, (c.c_uint64, c.c_uint64), None)):
        stub = c.CFUNCTYPE(restype, *argtypes)(lambda *args, value=value: value)
        llvm.add_symbol(name, c.cast(stub, c.c_void_p).value)
        stubs.append(stub)  # kept alive: the symbols point into them
    return stubs


_stubs = _bind_refusing_stubs() if _unavailable is not None else []

I32, U32, I64, U64 = types.int32, types.uint32, types.int64, types.uint64
# int io_uring_queue_init(unsigned entries, struct io_uring *ring, unsigned flags)
_queue_init = types.ExternalFunction("io_uring_queue_init", I32(U32, U64, U32))
# void io_uring_queue_exit(struct io_uring *ring)
_queue_exit = types.ExternalFunction("io_uring_queue_exit", types.void(U64))
# struct io_uring_sqe *io_uring_get_sqe(struct io_uring *ring): NULL when the submission queue is full
_get_sqe = types.ExternalFunction("io_uring_get_sqe", U64(U64))
# void io_uring_prep_read(struct io_uring_sqe *sqe, int fd, void *buf, unsigned nbytes, __u64 offset)
_prep_read = types.ExternalFunction("io_uring_prep_read", types.void(U64, I32, U64, U32, U64))
# void io_uring_sqe_set_data64(struct io_uring_sqe *sqe, __u64 data) / io_uring_sqe_set_flags(sqe, unsigned flags)
_set_data = types.ExternalFunction("io_uring_sqe_set_data64", types.void(U64, U64))
_set_flags = types.ExternalFunction("io_uring_sqe_set_flags", types.void(U64, U32))
# void io_uring_prep_nop(struct io_uring_sqe *sqe)
_prep_nop = types.ExternalFunction("io_uring_prep_nop", types.void(U64))
# int io_uring_submit(struct io_uring *ring): how many queued entries the kernel took, or -errno
_submit = types.ExternalFunction("io_uring_submit", I32(U64))
# unsigned io_uring_sq_ready(const struct io_uring *ring): entries queued that the kernel has not taken
_sq_ready = types.ExternalFunction("io_uring_sq_ready", U32(U64))
# int io_uring_wait_cqe(struct io_uring *ring, struct io_uring_cqe **cqe)
_wait_cqe = types.ExternalFunction("io_uring_wait_cqe", I32(U64, U64))
# void io_uring_cqe_seen(struct io_uring *ring, struct io_uring_cqe *cqe)
_cqe_seen = types.ExternalFunction("io_uring_cqe_seen", types.void(U64, U64))
# uint32_t crc32_gzip_refl(uint32_t init_crc, const unsigned char *buf, uint64_t len) (ISA-L, record_io.py loads it)
_crc32 = types.ExternalFunction("crc32_gzip_refl", U32(U32, U64, U64))


@helper
def submit_queued(ring):
    """Hands the ring's queued entries to the kernel, trying again while it takes none for a passing
    reason (EINTR, EAGAIN, nothing taken) up to SUBMIT_ATTEMPTS times; the last status."""
    status, attempts = 0, 0
    while _sq_ready(ring) > 0:
        status = _submit(ring)
        if status > 0:
            attempts = 0
        elif (status == 0 or status == -EINTR or status == -EAGAIN) and attempts < SUBMIT_ATTEMPTS:
            attempts += 1
            sleep_microseconds(WAIT_MICROSECONDS)
        else:
            break
    return status


@helper
def void_entry(sqe):
    """A queued entry the kernel did not take becomes a no-op that ring_complete skips."""
    _prep_nop(sqe)
    _set_data(sqe, np.uint64(VOID_TAG))
    _set_flags(sqe, np.uint32(0))


@kernel(I32(I64, I64))
def ring_init(ring, entries):
    """Set up a ring of `entries` submission slots in the struct at `ring`: 0, or -errno."""
    return _queue_init(np.uint32(entries), np.uint64(ring), np.uint32(0))


@kernel(types.void(I64))
def ring_exit(ring):
    _queue_exit(np.uint64(ring))


@kernel(I64(I64, I32, readonly(I64, 1), readonly(I64, 1), readonly(U64, 1), readonly(I64, 1), mutable(I64, 1),
            mutable(I64, 1)))
def ring_submit(ring, fd, offsets, spans, addresses, tags, done, refused):
    """Queue read i (spans[i] bytes at offsets[i] of fd into addresses[i], known by tags[i]) for every i,
    with done[tags[i]] cleared, and submit them: -> how many the kernel took (the first ones, in order);
    refused[0] = why it did not take the rest (an errno; EAGAIN when the ring had no room), else 0.

    The kernel takes queued entries only when they are submitted, and a submission may take some or
    none (EINTR, EAGAIN: it is tried again a few times; another error ends it). Entries it did not take
    would go out with the next submission, into buffers whose callers were told they failed: they are
    turned into no-ops (VOID_TAG, which ring_complete skips) first. Each read is handed to the kernel's
    own workers (IOSQE_ASYNC), so the submitting thread pays for the submission, not for the read."""
    n = offsets.shape[0]
    sqes = np.zeros(n, np.uint64)
    queued = 0
    refused[0] = 0
    for i in range(n):
        sqe = _get_sqe(np.uint64(ring))
        if sqe == 0:
            refused[0] = EAGAIN
            break
        _prep_read(sqe, fd, addresses[i], np.uint32(spans[i]), np.uint64(offsets[i]))
        _set_data(sqe, np.uint64(tags[i]))
        _set_flags(sqe, np.uint32(IOSQE_ASYNC))
        done[tags[i]] = 0
        sqes[i] = sqe
        queued += 1
    status = submit_queued(np.uint64(ring)) if queued > 0 else 0
    left = min(queued, np.int64(_sq_ready(np.uint64(ring))))  # ours were queued last: the ones not taken
    for i in range(queued - left, queued):
        void_entry(sqes[i])
    if left > 0:
        refused[0] = -status if status < 0 else EAGAIN
    return queued - left


@kernel(I64(I64))
def ring_stop(ring):
    """Queue the no-op that tells ring_complete to return: 0, or -errno."""
    sqe = _get_sqe(np.uint64(ring))
    if sqe == 0:
        return -EAGAIN
    _prep_nop(sqe)
    _set_data(sqe, np.uint64(STOP_TAG))
    submitted = _submit(np.uint64(ring))
    return submitted if submitted < 0 else 0


@kernel(I64(I64, readonly(U64, 1), readonly(I64, 1), types.boolean, mutable(I64, 1), mutable(U32, 1),
            mutable(I64, 1), mutable(I64, 1)))
def ring_complete(ring, addresses, lengths, checksum, results, crcs, done, wake):
    """The completion thread's loop, which never returns to Python until ring_stop's no-op arrives: wait
    in the kernel for each completed read, then results[tag] = the bytes read (or -errno), with
    `checksum` crcs[tag] = the crc32 of the first min(result, lengths[tag]) bytes at addresses[tag], and
    done[tag] = 1 published last (atomically: whoever sees it sees the rest), and wake the thread waiting
    for a read (kernels/cpu/wake.py; wake[W_EVENT] -1: none is). -> 0, or -errno."""
    cqe_at = np.zeros(1, np.int64)
    while True:
        status = _wait_cqe(np.uint64(ring), np.uint64(cqe_at.ctypes.data))
        if status == -EINTR:
            continue
        if status < 0:
            return status
        cqe = int64_pointer(cqe_at[0])
        tag = cqe[0]
        result = (cqe[1] << 32) >> 32  # the signed 32-bit res after user_data
        _cqe_seen(np.uint64(ring), np.uint64(cqe_at[0]))
        if tag == STOP_TAG:
            return 0
        if tag == VOID_TAG:
            continue
        results[tag] = result
        if checksum and result > 0:
            crcs[tag] = _crc32(np.uint32(0), addresses[tag], np.uint64(min(result, lengths[tag])))
        atomic_add(done.ctypes.data + 8 * tag, 1)
        wake_waiters(wake)


@kernel(I64(readonly(I64, 1), readonly(I64, 1), mutable(I64, 1)), keep_gil=True)
def ring_finished(done, tags, finished):
    """finished[:n] = the tags among `tags` whose reads ring_complete has published; -> n."""
    n = 0
    for i in range(tags.shape[0]):
        if atomic_load(done.ctypes.data + 8 * tags[i]) != 0:
            finished[n] = tags[i]
            n += 1
    return n


@kernel(types.boolean(readonly(I64, 1), I64, I64))
def ring_wait(done, tag, sleeps):
    """Block (without the GIL) until ring_complete has published the read tagged `tag`: a short spin,
    then up to `sleeps` sleeps of WAIT_MICROSECONDS that give the core away. -> whether it was published
    (False: the caller looks again, after checking that the completion thread is still there)."""
    spins = 0
    while atomic_load(done.ctypes.data + 8 * tag) == 0:
        spins += 1
        if spins < 200:
            spin_pause()
        elif spins - 200 < sleeps:
            sleep_microseconds(WAIT_MICROSECONDS)
        else:
            return False
    return True


def unavailable_reason() -> str | None:
    """None when io_uring can run here, else why not (the package missing, the kernel refusing it)."""
    if _unavailable is not None:
        return _unavailable
    ring = np.zeros(RING_BYTES, np.uint8)
    status = ring_init(ring.ctypes.data, 2)
    if status < 0:
        return f"the kernel refused io_uring_setup ({os.strerror(-status)})"
    ring_exit(ring.ctypes.data)
    return None
