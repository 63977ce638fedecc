"""How a MoE model's routed experts are held and streamed, as one value (edge.load's streaming settings)."""
from __future__ import annotations

from dataclasses import dataclass

from edge.core.arguments import integer
from edge.core.errors import InvalidArgumentError

IO_ENGINES = ("auto", "io_uring", "threads")  # auto: io_uring where the kernel allows it, else threads


def check_io_engine(name: str) -> str:
    if name not in IO_ENGINES:
        raise InvalidArgumentError(f"io_engine {name!r} is not known; choose one of {', '.join(IO_ENGINES)}")
    return name


@dataclass(frozen=True)
class StreamingOptions:
    """How a MoE model's routed experts are held and streamed (streaming/).

    storage: None/"native", a preset ("nvme", "ufs", "emmc", "sd") or "custom:bw=500MB,lat=200us";
    expert_strategy: "resident" (default without a budget, or with one that holds every expert),
    "predictive" (default with a smaller budget), "ondemand" (no predictor, no prefetch) or "mmap"
    (plain mmap + bounded page cache);
    expert_policy: "lru", "lfu", "forecast" (evict what the predictor needs least), "cycle" (evict
    the expert whose layer comes last in the layer-by-layer cycle, ties by the predictor's need) or
    "nextuse" (evict the expert whose next use is expected furthest ahead: the cycle order weighed by
    how often each expert's layer uses it; the default with the predictive strategy); "lru", the
    default otherwise, evicts exactly what that cycle needs next;
    io_engine: how streamed experts are read: "io_uring" (submitted and collected by the model's
    thread in compiled calls, no reader threads), "threads" (prefetch_threads reader threads) or
    "auto" (io_uring where the kernel and the records allow it, else threads)."""

    storage: str | None = None
    expert_strategy: str | None = None
    expert_policy: str | None = None
    prefetch_depth: int = 2
    prefetch_threads: int = 4
    io_engine: str = "auto"

    def __post_init__(self) -> None:
        check_io_engine(self.io_engine)
        object.__setattr__(self, "prefetch_threads", integer("prefetch_threads", self.prefetch_threads, minimum=1))
        object.__setattr__(self, "prefetch_depth", integer("prefetch_depth", self.prefetch_depth, minimum=1))
