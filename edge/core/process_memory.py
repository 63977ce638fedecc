"""The process's memory: its resident set, its peak, and what the runtime's own code takes of it.

A memory budget means the whole process, less only the interpreter and the package's import. Beside
weights, caches and scratch, the runtime itself takes memory no library reports: the modules a first
load imports (numpy, numba, llvmlite, a device's backend), Numba's compiler and each kernel it
compiles or loads from its cache (LLVM keeps the machine code and its own tables), thread pools and
I/O engines. `runtime_memory` measures each such part as the resident set it added the first time
this process loaded it, and keeps the figure: later loads reuse the part, so a model's budget
counts it without depending on what was loaded before.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import threading

import psutil

THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
HUGE_PAGE = 2 << 20


def resident_bytes() -> int:
    return _process(os.getpid()).memory_info().rss


@functools.lru_cache(maxsize=None)
def _process(pid: int) -> psutil.Process:
    """(keyed by pid: a forked child must not read its parent's figures)"""
    return psutil.Process(pid)


def peak_rss_bytes() -> int | None:
    """This process's peak resident set size so far: Linux's VmHWM, Windows' peak working set, or None
    where the system keeps no high-water mark (a caller samples RSS itself then)."""
    try:
        with open(f"/proc/{os.getpid()}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = getattr(_process(os.getpid()).memory_info(), "peak_wset", None)
    return int(peak) if peak is not None else None


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    """glibc's malloc_trim from the process's own symbols, or None (another C library, Windows)."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):
        return None


def release_free_heap() -> None:
    """Give the C heap's free memory back to the OS (glibc's malloc_trim; elsewhere nothing).

    Memory a closed model freed may stay mapped in the allocator; a later load then reuses it without
    the resident set growing, so what that load adds would understate what it takes."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class RuntimeMemory:
    """Resident bytes per part of the runtime, each measured once; a part's name starts with its kind
    ("imports edge.api", "backend cpu", "kernel kernels.cpu.moe.mixture_decode_kernel")."""

    def __init__(self):
        self._parts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._nesting = threading.local()  # a part loaded while another is measured counts in that one

    @contextlib.contextmanager
    def measure(self, part: str):
        """Count what the block adds to the resident set as `part`, unless `part` was measured before
        in this process or the block runs inside another part's measurement (which counts it)."""
        depth = getattr(self._nesting, "depth", 0)
        if depth or part in self._parts:
            self._nesting.depth = depth + 1
            try:
                yield
            finally:
                self._nesting.depth = depth
            return
        release_free_heap()  # so that the part's allocations grow the resident set, not reuse freed memory
        before = resident_bytes()
        self._nesting.depth = 1
        try:
            yield
        finally:
            self._nesting.depth = 0
        self.record(part, resident_bytes() - before)

    def record(self, part: str, n_bytes: int) -> None:
        with self._lock:
            self._parts.setdefault(part, max(0, int(n_bytes)))

    def total(self) -> int:
        with self._lock:
            return sum(self._parts.values())

    def parts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._parts)

    def by_kind(self) -> dict[str, int]:
        """Totals by the first word of the parts' names: imports, backend, kernel."""
        totals: dict[str, int] = {}
        for part, n_bytes in self.parts().items():
            kind = part.split(" ", 1)[0]
            totals[kind] = totals.get(kind, 0) + n_bytes
        return totals


runtime_memory = RuntimeMemory()


def huge_pages_available() -> bool:
    """Whether memory advised MADV_HUGEPAGE gets 2 MB pages: Linux with THP "always" or "madvise"."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_ANONYMOUS"):
        return False
    try:
        with open(THP_SETTING) as f:
            setting = f.read()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting
