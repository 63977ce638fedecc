"""Streaming statistics: counters the expert sources keep, and the process's peak memory."""
from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

import psutil


@dataclass
class StreamingCounters:
    hits: int = 0             # needed experts found in the cache (loaded, or being loaded by a prefetch)
    misses: int = 0           # needed experts nobody had started loading: read on demand
    late_prefetches: int = 0  # hits whose prefetch was still in flight when the layer needed them
    stall_seconds: float = 0.0  # time the model waited for expert I/O

    def to_dict(self, io_seconds: float) -> dict:
        """`io_hidden_fraction`: the share of expert I/O time (all loads, summed) that did not stall
        the model; 1.0 when every read overlapped compute, 0.0 when the model waited for all of it."""
        requests = self.hits + self.misses
        hidden = None if io_seconds <= 0 else min(1.0, max(0.0, 1.0 - self.stall_seconds / io_seconds))
        return {"expert_hits": self.hits, "expert_misses": self.misses,
                "hit_rate": self.hits / requests if requests else None,
                "late_prefetches": self.late_prefetches, "io_stall_seconds": self.stall_seconds,
                "io_seconds": io_seconds, "io_hidden_fraction": hidden}


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
    peak = getattr(psutil.Process().memory_info(), "peak_wset", None)
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
