"""Memory the CPU kernels stream through, in 2 MB pages where the operating system offers them.

Decode reads every weight once per token. Read from the checkpoint's mmap, each 4 KB page is a TLB
entry of its own and the hardware prefetcher stops at every page boundary; the same bytes in
transparent huge pages (2 MB) stream faster (SmolLM2 INT8, 2 threads, five alternating runs of
`zllm-edge bench`: decode median 201 -> 218 tok/s). So the CPU backend copies the weights a model
keeps for its lifetime into anonymous memory advised MADV_HUGEPAGE, once at load, and drops its own
mapping of the file pages it copied: they stay in the page cache, but the process does not hold the
weights twice.

Where the kernel has no transparent huge pages (not Linux, or THP "never") the weights stay views
of the mmap, as they are on the other devices; `huge_pages_available` (edge/core/process_memory.py)
says which, and the bench reports it.
"""
from __future__ import annotations

import mmap
import threading

import numpy as np

from edge.core.process_memory import HUGE_PAGE
from quant.safetensors_io import release_view

CHUNK_BYTES = 64 << 20  # address space reserved at a time; only the pages written are ever allocated
ALIGNMENT = 64          # a cache line: every copy starts on one


class HugePageArena:
    """Read-only copies of arrays, carved in order out of anonymous private mappings advised
    MADV_HUGEPAGE. Only the pages written are ever allocated.

    Nothing is freed one by one: the mappings live as long as the arrays handed out (each holds
    its mapping), which is the model's lifetime."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self._chunk: np.ndarray | None = None  # the mapping being filled, as bytes
        self._used = 0
        self._lock = threading.Lock()
        self.copied_bytes = 0

    def allocate(self, n_bytes: int, alignment: int = ALIGNMENT) -> np.ndarray:
        """n_bytes of writable, zero-filled uint8 memory starting at a multiple of `alignment` (a
        power of two up to HUGE_PAGE)."""
        with self._lock:
            start = -(-self._used // alignment) * alignment
            if self._chunk is None or start + n_bytes > len(self._chunk):
                size = max(self.chunk_bytes, -(-n_bytes // HUGE_PAGE) * HUGE_PAGE)
                mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                mapping.madvise(mmap.MADV_HUGEPAGE)
                whole = np.frombuffer(mapping, np.uint8)
                skip = (-whole.ctypes.data) % HUGE_PAGE  # huge pages cover 2 MB-aligned ranges only
                self._chunk, start = whole[skip:skip + size], 0
            self._used = start + n_bytes
            return self._chunk[start:start + n_bytes]

    def copy(self, array: np.ndarray) -> np.ndarray:
        """A read-only, C-contiguous copy of `array` in huge pages; the caller's mapping of the
        original's file pages (if it is a view of one) is dropped."""
        out = self.allocate(array.nbytes).view(array.dtype).reshape(array.shape)
        out[...] = array
        out.flags.writeable = False
        self.copied_bytes += array.nbytes
        release_view(array)
        return out
