"""How a MoE model's routed experts are held and streamed, as one value (edge.load's streaming settings)."""
from __future__ import annotations

from dataclasses import dataclass

from edge.core.arguments import choice, integer, shown
from edge.core.errors import InvalidArgumentError

IO_ENGINES = ("auto", "io_uring", "threads")  # auto: io_uring where the kernel allows it, else threads
# compiled: the slot table in compiled calls (streaming/slots.py); python: the cache and loaders of
# streaming/source.py and streaming/prefetch.py; auto: compiled where it runs, else python
EXPERT_ENGINES = ("auto", "compiled", "python")
# Each loading thread is an operating system thread with a read of its own in flight; a count beyond
# what any storage queue serves only adds threads that wait (and a huge one would never finish starting).
MAX_PREFETCH_THREADS = 256


def check_io_engine(name: str) -> str:
    return choice("io_engine", name, IO_ENGINES)


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
    io_engine: how streamed experts are read: "io_uring" (submitted by the model's thread in compiled
    calls, collected by one completion thread), "threads" (prefetch_threads reader threads: compiled
    loops under the compiled expert engine, batches read in compiled calls under the python one) or
    "auto" (io_uring where the kernel and the records allow it, else threads);
    expert_engine: where the expert cache, its loads and its waits run: "compiled" (a slot table in
    compiled calls, no Python per read: uncompressed records, the lru, lfu and nextuse policies),
    "python" (streaming/source.py: every policy and record format) or "auto" (compiled where it runs,
    else python; `model.stats()["expert_engine"]` says which and why)."""

    storage: str | None = None
    expert_strategy: str | None = None
    expert_policy: str | None = None
    prefetch_depth: int = 2
    prefetch_threads: int = 4
    io_engine: str = "auto"
    expert_engine: str = "auto"

    def __post_init__(self) -> None:
        """Every setting checked when made (InvalidArgumentError), whether or not the strategy uses it:
        a misspelt policy or storage is refused, not ignored until another strategy reads it."""
        from streaming.budget import STRATEGIES  # imported here: they pull in the expert file format
        from streaming.cache import POLICIES
        from streaming.storage import StorageModel, parse_storage

        check_io_engine(self.io_engine)
        choice("expert_engine", self.expert_engine, EXPERT_ENGINES)
        if self.expert_strategy is not None:
            choice("expert_strategy", self.expert_strategy, STRATEGIES)
        if self.expert_policy is not None:
            choice("expert_policy", self.expert_policy, POLICIES)
        if self.storage is not None and not isinstance(self.storage, (str, StorageModel)):
            raise InvalidArgumentError(f"storage must be a name such as 'nvme' or 'custom:bw=500MB,lat=200us', "
                                       f"got {shown(self.storage)}")
        parse_storage(self.storage)
        object.__setattr__(self, "prefetch_threads", integer("prefetch_threads", self.prefetch_threads, minimum=1,
                                                             maximum=MAX_PREFETCH_THREADS))
        object.__setattr__(self, "prefetch_depth", integer("prefetch_depth", self.prefetch_depth, minimum=1))
