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

Mixture-of-Experts models run split: attention, norms, dense FFN layers, router logits, shared
experts and the LM head in the provider's graphs; each MoE layer's routed experts on the CPU
backend (devices/cpu, Numba kernels, `threads` threads), fed by the model's expert source
(resident or streamed under a memory budget). device_info()["parts"] says which part runs where.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from devices.base import check_llama_layers
from devices.npu import ops
from devices.npu.executor import NpuExecutor, allocate_kv
from devices.npu.graph_cache import GraphCache
from devices.npu.onnx_export import ATTENTION_FORMS, ExportOptions
from devices.npu.providers import PRIORITY, choose_provider, import_onnxruntime
from edge.core.contract import Capabilities, ComputeThreads

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
        cpus = os.cpu_count() or 1
        if threads is not None and threads > cpus:  # as the cpu device refuses more than it can start
            raise ValueError(f"threads={threads} but this machine has {cpus} logical CPUs; pass threads <= {cpus}")
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
    # K/V in f32 over every position (sliding layers mask by window); routed experts on the CPU backend
    # (expert_backend), the rest in graphs
    capabilities = Capabilities(expert_mixture=True)

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
        self._expert_backend = None
        self.moe_layers: list[int] = []  # of the compiled model: their routed experts run on expert_backend
        self.dense_ffn_layers: list[int] = []
        self.shared_experts = False  # the compiled model's MoE layers have shared experts (run in graphs)

    # --- Mixture-of-Experts: routed experts on the CPU backend --------------------------------
    @property
    def expert_backend(self):
        """The backend that runs routed experts (the CPU backend, with this device's thread count, and
        int8 activations exactly when the graphs' MatMulNBits take them: accuracy_level 4);
        expert sources prepare expert weights for it. Created on first use: dense models never start it."""
        if self._expert_backend is None:
            from devices.cpu import CpuBackend

            activations = "int8" if self.settings.accuracy_level == 4 else "f32"
            self._expert_backend = CpuBackend(threads=self.settings.threads, variant=activations)
        return self._expert_backend

    def expert_mixture(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, experts) -> np.ndarray:
        """The routed experts' mixture of one MoE layer (devices/base.py), on the CPU backend."""
        return self.expert_backend.expert_mixture(x, ids, weights, experts)

    # --- the fused path ---------------------------------------------------------------------
    def prepare_weight(self, weight):
        return weight  # graphs read the checkpoint's arrays when they are exported, nothing to prepare

    load_weight = prepare_weight

    def compute_threads(self, spec, tokens: int) -> ComputeThreads:
        from devices.cpu.backend import prefill_tile_bytes

        return ComputeThreads(1, prefill_tile_bytes(spec, tokens))  # the expert backend's prefill tile

    def compile_forward(self, model):
        check_llama_layers(model, "npu")
        moe = [(i, layer.moe) for i, layer in enumerate(model.layers) if layer.moe is not None]
        self.moe_layers = [i for i, _ in moe]
        self.dense_ffn_layers = [i for i in range(len(model.layers)) if i not in self.moe_layers]
        self.shared_experts = any(weights.shared_gate is not None for _, weights in moe)
        cache = GraphCache(model, self.export_options)
        executor = NpuExecutor(model, cache, self.runtime, self.settings, self.embed)
        self.executors.append(executor)
        return executor, "fused"

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
        info["parts"] = self._parts()
        if self.moe_layers:
            cpu = self.expert_backend.info()
            info["expert_backend"] = {key: cpu[key] for key in ("device", "backend", "threads", "threading_layer")
                                      if key in cpu}
            info["intra_op_spinning"] = False  # graphs and expert kernels take turns on the same cores
        placement = info.get("placement", {})
        elsewhere = sorted({ep for graph in placement.values() for ep in graph if ep != runtime.name})
        if elsewhere:
            info["warnings"].append(f"nodes placed outside {runtime.name}: on {', '.join(elsewhere)} "
                                    "(see placement)")
        return info

    def _parts(self) -> dict[str, str]:
        """Which part of the model runs where."""
        graphs = f"onnxruntime graphs on {self.runtime.name}"
        parts = {part: graphs for part in ("embedding", "attention", "norms", "lm_head")}
        if self.dense_ffn_layers:
            parts["dense_ffn"] = graphs
        if self.moe_layers:
            parts["router_logits"] = graphs
            if self.shared_experts:
                parts["shared_experts"] = graphs
            parts["routing"] = "host (edge's top-k and the family's scoring)"
            parts["routed_experts"] = (f"cpu backend (Numba kernels, {self.expert_backend.threads} threads), "
                                       f"layers {', '.join(map(str, self.moe_layers))}")
        return parts
