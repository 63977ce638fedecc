"""Streaming statistics: the counters the expert sources keep."""
from __future__ import annotations

from dataclasses import dataclass



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
