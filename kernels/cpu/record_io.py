"""Reading expert records without the GIL: positional reads and their crc32 in one compiled call.

An expert load is a pread of ~100 KB and a crc32 of it. Done from Python, each load also takes
the GIL several times (the call, the checksum, the bookkeeping around them), and every time it
does, the model's thread, which runs Python between its kernels, waits. Here a loading thread
hands over a batch of records and the whole batch is read and checked in one `nogil` call.

The functions are the C library's `preadv` and ISA-L's `crc32_gzip_refl` (the zlib crc32, with
carry-less-multiply SIMD), bound by symbol name; ISA-L ships inside the `isal` package, whose
extension module is loaded so the symbol resolves when the kernel is compiled or loaded from the
cache. Addresses are int64 `array.ctypes.data` values; the caller keeps the arrays alive.
"""
from __future__ import annotations

import llvmlite.binding as llvm
import numpy as np
from isal import isal_zlib
from numba import types

from kernels.cpu.runtime import kernel, mutable, readonly

llvm.load_library_permanently(isal_zlib.__file__)

# ssize_t preadv(int fd, const struct iovec *iov, int iovcnt, off_t offset); an iovec is a (buffer
# address, length) pair of 64-bit integers, pointers pass as 64-bit integers
_preadv = types.ExternalFunction("preadv", types.int64(types.int32, types.uint64, types.int32, types.int64))
# uint32_t crc32_gzip_refl(uint32_t init_crc, const unsigned char *buf, uint64_t len)
_crc32 = types.ExternalFunction("crc32_gzip_refl", types.uint32(types.uint32, types.uint64, types.uint64))

I64, U64, U32 = types.int64, types.uint64, types.uint32

# Records one read call takes at most (Linux allows 1024 iovecs).
MAX_RECORDS_PER_CALL = 64


@kernel(I64(I64, readonly(I64, 1), readonly(I64, 1), readonly(I64, 1), readonly(U64, 1), types.boolean,
            mutable(I64, 1), mutable(U32, 1)))
def read_records(fd, offsets, spans, lengths, addresses, checksum, got, crcs):
    """For each record i: read spans[i] bytes at offsets[i] into addresses[i]; got[i] = the bytes
    read (-1 when the read failed: the caller reads it again to learn why); crcs[i] = crc32 of the
    first min(got[i], lengths[i]) bytes when `checksum`. Returns the number of read calls made.

    Records that lie back to back in the file (one's span ends where the next begins) are read by
    one preadv that scatters them into their buffers: one request to the disk instead of several
    (`python benchmarks/streaming_io.py --experts 1024 --expert-mb 0.08`, 0.2 MB records, O_DIRECT,
    one reader, this machine: 0.31-0.33 ms and 29-48 us of kernel CPU per record read alone,
    0.23-0.25 ms and 24-35 us two at a time, 0.18-0.21 ms and 7-9 us four at a time)."""
    n = offsets.shape[0]
    order = np.argsort(offsets)
    iovecs = np.empty(2 * min(n, MAX_RECORDS_PER_CALL), np.uint64)
    calls = 0
    first = 0
    while first < n:
        end = first + 1  # the run order[first:end] of records back to back
        while end < n and end - first < MAX_RECORDS_PER_CALL and \
                offsets[order[end - 1]] + spans[order[end - 1]] == offsets[order[end]]:
            end += 1
        for k in range(first, end):
            iovecs[2 * (k - first)] = addresses[order[k]]
            iovecs[2 * (k - first) + 1] = np.uint64(spans[order[k]])
        remaining = _preadv(np.int32(fd), iovecs.ctypes.data, np.int32(end - first), offsets[order[first]])
        calls += 1
        for k in range(first, end):  # a short read fills the run's first records
            i = order[k]
            if remaining < 0:
                got[i] = -1
            else:
                got[i] = min(spans[i], remaining)
                remaining -= got[i]
        first = end
    if checksum:
        for i in range(n):
            if got[i] > 0:
                crcs[i] = _crc32(np.uint32(0), addresses[i], np.uint64(min(got[i], lengths[i])))
    return calls
