"""Reading expert records without the GIL: positional reads and their crc32 in one compiled call.

An expert load is a pread of ~100 KB and a crc32 of it. Done from Python, each load also takes
the GIL several times (the call, the checksum, the bookkeeping around them), and every time it
does, the model's thread, which runs Python between its kernels, waits. Here a loading thread
hands over a batch of records and the whole batch is read and checked in one `nogil` call.

The functions are the C library's `pread` and ISA-L's `crc32_gzip_refl` (the zlib crc32, with
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

# ssize_t pread(int fd, void *buf, size_t count, off_t offset); pointers pass as 64-bit integers
_pread = types.ExternalFunction("pread", types.int64(types.int32, types.uint64, types.uint64, types.int64))
# uint32_t crc32_gzip_refl(uint32_t init_crc, const unsigned char *buf, uint64_t len)
_crc32 = types.ExternalFunction("crc32_gzip_refl", types.uint32(types.uint32, types.uint64, types.uint64))

I64, U64, U32 = types.int64, types.uint64, types.uint32


@kernel(types.void(I64, readonly(I64, 1), readonly(I64, 1), readonly(I64, 1), readonly(U64, 1), types.boolean,
                   mutable(I64, 1), mutable(U32, 1)))
def read_records(fd, offsets, spans, lengths, addresses, checksum, got, crcs):
    """For each record i: read spans[i] bytes at offsets[i] into addresses[i]; got[i] = the bytes
    read (-1 when the read failed: the caller reads it again to learn why); crcs[i] = crc32 of the
    first min(got[i], lengths[i]) bytes when `checksum`."""
    for i in range(offsets.shape[0]):
        n = _pread(np.int32(fd), addresses[i], np.uint64(spans[i]), offsets[i])
        got[i] = n
        if checksum and n > 0:
            crcs[i] = _crc32(np.uint32(0), addresses[i], np.uint64(min(n, lengths[i])))
