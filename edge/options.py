"""How a model is loaded, as one value: `edge.load(path, **settings)` makes a LoadOptions of its
settings, and the command line makes one from its flags before it converts or loads anything, so
each setting is checked once (InvalidArgumentError) and then
travels as this value, not as a dozen loose arguments."""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

from edge.core.arguments import flag, integer, shown
from edge.core.errors import InvalidArgumentError
from edge.core.kv import check_kv_format_name
from streaming.options import StreamingOptions


@dataclass(frozen=True)
class LoadOptions:
    """Everything `edge.load` takes besides the checkpoint's path.

    memory_budget: bytes, a size ("512MB"), or "P%" (everything that is not an expert plus a cache of
    P% of the expert bytes); it covers dense weights, the KV cache of `kv_capacity` positions (sessions
    share them), scratch and the expert cache (streaming/budget.py).
    kv_cache: the KV cache's storage format ("f32", "f16", "int8").
    gpu_expert_cache (device "gpu", MoE models): the bytes of uploaded experts the GPU keeps, keyed by
    (layer, expert) and evicted least recently used: bytes, a size ("64MB") or "P%" of every expert's
    device bytes. Default: every expert if they take at most half the adapter's memory (host RAM for a
    CPU adapter such as lavapipe; 4 GiB assumed for a GPU, whose memory wgpu does not report), else
    that half. Below one layer's experts it is refused (ExpertCacheError naming the minimum).
    verify: check every file's sha256 (and every expert record's checksum) at load."""

    device: str = "reference"
    threads: int | None = None
    memory_budget: int | str | None = None
    kv_capacity: int | None = None
    kv_cache: str = "f32"
    verify: bool = False
    streaming: StreamingOptions = dataclasses.field(default_factory=StreamingOptions)
    gpu_expert_cache: int | str | None = None

    def __post_init__(self) -> None:
        """The checks that need no checkpoint; what a device accepts beyond them (a thread count above
        what it can start, a variant) its backend checks."""
        from devices.base import THREADED_DEVICES, device_name_problem  # read now: tests register devices of their own
        from streaming.budget import parse_budget

        device = self.device
        problem = device_name_problem(device)
        if problem:
            raise InvalidArgumentError(problem)
        if self.threads is not None:
            object.__setattr__(self, "threads", integer("threads", self.threads, minimum=1))
            kind = device.partition(":")[0]
            if kind not in THREADED_DEVICES:  # their backends refuse it too, but only once the model is converted
                raise InvalidArgumentError(f"device {kind!r} runs no threads of its own; --threads/threads= applies "
                                           f"to the {' and '.join(THREADED_DEVICES)} devices")
        if self.kv_capacity is not None:
            object.__setattr__(self, "kv_capacity", integer("kv_capacity", self.kv_capacity, minimum=1))
        if not isinstance(self.streaming, StreamingOptions):
            raise InvalidArgumentError(f"streaming must be a StreamingOptions, got {shown(self.streaming)}")
        check_kv_format_name(self.kv_cache)
        object.__setattr__(self, "verify", flag("verify", self.verify))
        parse_budget(self.memory_budget)
        try:  # its size is the device's to weigh against the experts; its spelling is checked here
            parse_budget(self.gpu_expert_cache)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"gpu_expert_cache: {exc}") from None

    @classmethod
    def of(cls, device: str = "reference", threads: int | None = None, memory_budget: int | str | None = None,
           verify: bool = False, storage: str | None = None, expert_strategy: str | None = None,
           expert_policy: str | None = None, prefetch_depth: int = 2, prefetch_threads: int = 4,
           kv_capacity: int | None = None, kv_cache: str = "f32",
           gpu_expert_cache: int | str | None = None, io_engine: str = "auto",
           expert_engine: str = "auto") -> "LoadOptions":
        """From edge.load's keyword arguments (the streaming ones flat)."""
        streaming = StreamingOptions(storage, expert_strategy, expert_policy, prefetch_depth, prefetch_threads,
                                     io_engine, expert_engine)
        return cls(device, threads, memory_budget, kv_capacity, kv_cache, verify, streaming, gpu_expert_cache)

    @classmethod
    def from_settings(cls, positional: tuple = (), settings: dict | None = None) -> "LoadOptions":
        """From arguments as a caller wrote them (positional ones in `of`'s order), a setting that is
        unknown, given twice or one too many refused by name."""
        settings = dict(settings or {})
        known = list(inspect.signature(cls.of).parameters)
        if len(positional) > len(known):
            raise InvalidArgumentError(f"edge.load takes at most {len(known)} settings by position "
                                       f"({', '.join(known)}), got {len(positional)}")
        twice = sorted(name for name in known[:len(positional)] if name in settings)
        if twice:
            raise InvalidArgumentError(f"edge.load got {', '.join(twice)} both by position and by name")
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise InvalidArgumentError(f"edge.load got unknown settings {', '.join(unknown)}; it takes "
                                       f"{', '.join(known)} (or options=LoadOptions(...))")
        return cls.of(**dict(zip(known, positional)), **settings)
