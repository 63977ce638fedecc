"""The `npu` device: the model as ONNX graphs, run by the best ONNX Runtime execution provider.

Device strings:

    npu                      the first available provider in providers.PRIORITY (the CPU provider
                             last, with a logged warning that device_info() repeats)
    npu:<provider>           exactly that provider (qnn, openvino, vitisai, coreml, directml, cpu);
                             missing -> DeviceUnavailableError
    npu:<provider>,key=value,...   settings (below); npu:auto,... keeps the automatic choice

Settings (anything else is passed to the provider as a provider option, e.g. npu:qnn,soc_model=57):

    layers_per_graph=N   layers per graph (0: one graph for the whole model; default 0)
    static=0|1           fixed-shape graphs: decode S=1 and prefill chunks S=prefill_chunk
                         (default: what the provider needs, see providers.PROVIDERS)
    prefill_chunk=N      tokens per static prefill graph (default 64)
    attention=contrib|standard   graph form (default: what the provider takes)
    accuracy_level=0..4  MatMulNBits' activation precision (default 4 on the CPU provider, where
                         int8 activations are the fast path, 0 elsewhere; 0 = float32)
    affine_int4=group_offset|zero_point   how affine int4 weights reach MatMulNBits (onnx_weights.py;
                         default group_offset: exact, and 16-35x faster than float zero points on
                         onnxruntime 1.32's CPU provider, measured on a 1536x576 int4 g32 weight)
    allow_cpu_nodes=0|1  let onnxruntime place nodes the provider rejects on its CPU provider
                         (placement is reported by device_info(); default 0: such a graph fails to load)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from converters.onnx_export import ATTENTION_FORMS, ExportOptions
from devices.base import MoeUnsupportedError, check_gqa_only, has_moe_layers
from devices.npu import ops
from devices.npu.executor import NpuExecutor, allocate_kv
from devices.npu.graph_cache import GraphCache
from devices.npu.providers import PRIORITY, choose_provider, import_onnxruntime

_FLAGS = {"0": False, "1": True, "false": False, "true": True}


@dataclass
class NpuSettings:
    provider: str | None = None  # None: automatic
    layers_per_graph: int = 0
    static_shapes: bool | None = None
    prefill_chunk: int = 64
    attention: str | None = None
    accuracy_level: int | None = None
    affine_int4: str = "group_offset"
    allow_cpu_nodes: bool = False
    threads: int | None = None
    provider_options: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, variant: str | None, threads: int | None) -> "NpuSettings":
        settings = cls(threads=threads)
        if not variant:
            return settings
        provider, *pairs = variant.split(",")
        settings.provider = None if provider in ("", "auto") else provider
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep:
                raise ValueError(f"device setting {pair!r} in 'npu:{variant}' is not key=value")
            settings._set(key.strip(), value.strip(), variant)
        return settings

    def _set(self, key: str, value: str, variant: str) -> None:
        def number(minimum: int) -> int:
            if not value.isdigit() or int(value) < minimum:
                raise ValueError(f"device setting {key} in 'npu:{variant}' must be an integer >= {minimum}, got {value!r}")
            return int(value)

        def flag() -> bool:
            if value.lower() not in _FLAGS:
                raise ValueError(f"device setting {key} in 'npu:{variant}' must be 0 or 1, got {value!r}")
            return _FLAGS[value.lower()]

        if key == "layers_per_graph":
            self.layers_per_graph = number(0)
        elif key == "static":
            self.static_shapes = flag()
        elif key == "prefill_chunk":
            self.prefill_chunk = number(1)
        elif key == "accuracy_level":
            self.accuracy_level = number(0)
        elif key == "allow_cpu_nodes":
            self.allow_cpu_nodes = flag()
        elif key == "attention":
            if value not in ATTENTION_FORMS:
                raise ValueError(f"device setting attention in 'npu:{variant}' must be one of {ATTENTION_FORMS}")
            self.attention = value
        elif key == "affine_int4":
            self.affine_int4 = value
        else:
            self.provider_options[key] = value


class NpuBackend:
    name = "npu"
    runs_moe = False

    def __init__(self, threads: int | None = None, variant: str | None = None):
        self.settings = NpuSettings.parse(variant, threads)
        self.ort = import_onnxruntime()
        self.runtime = choose_provider(self.ort, self.settings.provider, self.settings.provider_options)
        provider = self.runtime.provider
        settings = self.settings
        if settings.attention is None:
            settings.attention = "standard" if settings.static_shapes else provider.attention
        if settings.static_shapes is None:
            settings.static_shapes = provider.static_shapes
        if settings.static_shapes and settings.attention == "contrib":
            raise ValueError("static shapes use the standard attention form (GroupQueryAttention's padded "
                             "chunks are not portable across providers); drop attention=contrib or static=1")
        if settings.accuracy_level is None:
            settings.accuracy_level = 4 if provider.key == "cpu" else 0
        self.export_options = ExportOptions(settings.attention, settings.affine_int4, settings.accuracy_level)
        self.executors: list[NpuExecutor] = []
        self._ops = ops.OpRunner(self.runtime, settings)

    # --- the fused path ---------------------------------------------------------------------
    def prepare_weight(self, weight):
        return weight  # graphs read the checkpoint's arrays when they are exported, nothing to prepare

    def compile_forward(self, transformer):
        check_gqa_only(transformer, "npu")
        if has_moe_layers(transformer):
            raise MoeUnsupportedError("npu")
        cache = GraphCache(transformer, self.export_options)
        executor = NpuExecutor(transformer, cache, self.runtime, self.settings)
        self.executors.append(executor)
        return executor

    kv_formats = ("f32",)  # edge refuses kv_cache="f16"/"int8" on this device
    ring_buffers = False  # sliding layers keep every position and mask by window

    def allocate_kv(self, capacity: int, kv_heads: int, head_dim: int):
        return allocate_kv(capacity, kv_heads, head_dim)

    # --- single operations (one small graph each, on the same provider) ---------------------
    def embed(self, table, ids: np.ndarray) -> np.ndarray:
        return self._ops.embed(table, ids)

    def linear(self, x: np.ndarray, weight, bias=None) -> np.ndarray:
        return self._ops.linear(x, weight, bias)

    def rms_norm(self, x: np.ndarray, weight, eps: float) -> np.ndarray:
        return self._ops.rms_norm(x, weight, eps)

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        return self._ops.rope(x, cos, sin)

    def attention(self, q, k, v, q_positions, k_positions, scale, window):
        return self._ops.attention(q, k, v, q_positions, k_positions, scale, window)

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        return self._ops.swiglu(gate, up)

    # --- reporting --------------------------------------------------------------------------
    def info(self) -> dict:
        runtime, settings = self.runtime, self.settings
        info = {
            "device": "npu",
            "backend": f"onnxruntime {self.ort.__version__}",
            "provider": runtime.name,
            "provider_options": dict(runtime.options),
            "provider_priority": list(PRIORITY),
            "graph_form": settings.attention,
            "static_shapes": settings.static_shapes,
            "prefill_chunk": settings.prefill_chunk if settings.static_shapes else None,
            "layers_per_graph": settings.layers_per_graph or "all",
            "accuracy_level": settings.accuracy_level,
            "affine_int4": settings.affine_int4,
            "allow_cpu_nodes": settings.allow_cpu_nodes,
            "warnings": list(runtime.notes),
        }
        for executor in self.executors:
            info["graph_cache"] = executor.graph_cache.folder
            info["graphs_built"] = list(executor.graph_cache.built)
            info["placement"] = executor.placement()
        placement = info.get("placement", {})
        elsewhere = sorted({ep for graph in placement.values() for ep in graph if ep != runtime.name})
        if elsewhere:
            info["warnings"].append(f"nodes placed outside {runtime.name}: on {', '.join(elsewhere)} "
                                    "(see placement)")
        return info
