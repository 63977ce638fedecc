"""GpuBackend: the backend contract (devices/base.py) on a Vulkan device."""
from __future__ import annotations

import time

import numpy as np

from devices.base import DeviceUnavailableError, check_llama_layers, has_moe_layers
from devices.gpu.context import GpuContext, select_vulkan_adapter
from devices.gpu.expert_cache import GpuExpertCache, HostExpertWeights
from devices.gpu.forward import FusedForward
from devices.gpu.launches import MAX_HEAD_DIM, LaunchBuilder, Tuning
from devices.gpu.ops import GpuOps
from devices.gpu.shaders import KernelCache
from devices.gpu.tensors import GpuKV, GpuMatrix, GpuVector
from edge.core.contract import Capabilities, ComputeThreads
from quant import QuantizedTensor


class GpuBackend:
    name = "gpu"
    # K/V in f32 over every position (sliding layers mask by window); routed experts in the GPU expert
    # cache (configure_expert_cache); greedy tokens picked on the GPU
    capabilities = Capabilities(expert_mixture=True, expert_cache=True, greedy_on_device=True)
    # what ExpertSources prepare experts with (edge/api.py): nothing, they hand the MoE block the experts'
    # stored bytes as host views, and the GPU expert cache (configure_expert_cache) uploads them
    expert_backend = HostExpertWeights()

    def __init__(self, threads: int | None = None, variant: str | None = None, *,
                 max_binding_bytes: int | None = None, tuning: Tuning | None = None):
        """threads/variant as create_backend passes them ("gpu:N" picks the N-th Vulkan adapter).
        max_binding_bytes and tuning are for tests: a smaller binding limit exercises the split of
        large tensors, and Tuning.for_device(is_cpu=False) runs the GPU-shaped kernels anywhere."""
        if threads is not None:
            raise ValueError("device 'gpu' schedules its own work; --threads/threads= applies to the cpu device only")
        self.ctx = GpuContext(select_vulkan_adapter(variant))
        if max_binding_bytes is not None:  # tests force the split path of tensors on small limits
            self.ctx.max_binding_bytes = min(self.ctx.max_binding_bytes, int(max_binding_bytes))
        self.tuning = tuning or Tuning.for_device(self.ctx.is_cpu)
        self.kernels = KernelCache(self.ctx)
        self.builder = LaunchBuilder(self.ctx, self.kernels, self.tuning, dummy=self.ctx.storage(16, "unused"))
        self.ops = GpuOps(self.ctx, self.builder)
        self.upload_seconds = 0.0
        self.weight_bytes = 0
        self.expert_cache: GpuExpertCache | None = None

    def prepare_weight(self, weight):
        """Upload a weight: a matrix (float [N, K] or QuantizedTensor) or a vector (norm gain, bias)."""
        began = time.perf_counter()
        if isinstance(weight, QuantizedTensor) or np.ndim(weight) == 2:
            prepared = GpuMatrix(self.ctx, weight)
        elif np.ndim(weight) == 1:
            prepared = GpuVector(self.ctx, weight)
        else:
            raise ValueError(f"device 'gpu' takes 1-D or 2-D weights, got shape {np.shape(weight)}")
        self.upload_seconds += time.perf_counter() - began
        self.weight_bytes += prepared.nbytes
        return prepared

    load_weight = prepare_weight  # the model's own weights are uploaded once, as every weight is

    def embed(self, table, ids):
        return self.ops.embed(table, ids)

    def linear(self, x, weight, bias=None):
        return self.ops.linear(x, weight, bias)

    def rms_norm(self, x, weight, eps):
        return self.ops.rms_norm(x, weight, eps)

    def rope(self, x, cos, sin):
        return self.ops.rope(x, cos, sin)

    def attention(self, q, k, v, q_positions, k_positions, scale, window=None):
        return self.ops.attention(q, k, v, q_positions, k_positions, scale, window)

    def swiglu(self, gate, up):
        return self.ops.swiglu(gate, up)

    def expert_mixture(self, x, ids, weights, experts):
        """The routed experts' mixture for edge's op-by-op composition (Transformer.forward_ops), which has
        no layer to key a cache by: each expert's stored weights are uploaded for this call only and run
        through this device's ops, in ascending id order and at most `window_size` at a time (edge/moe.py).
        Generation uses the fused executor, which keeps experts in the GPU expert cache instead."""
        x = np.asarray(x, dtype=np.float32)
        out = np.zeros(x.shape, dtype=np.float32)  # [T, D]
        for expert in np.unique(ids):  # ascending
            rows, slots = np.nonzero(ids == expert)  # tokens routed to this expert, and in which of their A slots
            stored = experts[int(expert)]
            gate, up, down = (GpuMatrix(self.ctx, w) for w in (stored.gate, stored.up, stored.down))
            xe = x[rows]  # [Te, D]
            ye = self.linear(self.swiglu(self.linear(xe, gate), self.linear(xe, up)), down)  # [Te, D]
            for matrix in (gate, up, down):  # each op has read its result back: the buffers are free
                matrix.release()
            out[rows] += weights[rows, slots][:, None] * ye
        return out

    def softmax(self, x):
        return self.ops.softmax(x)

    def argmax(self, x):
        return self.ops.argmax(x)

    def allocate_kv(self, capacity: int, kv_heads: int, head_dim: int):
        return GpuKV(self.ctx, capacity, kv_heads, head_dim), GpuKV(self.ctx, capacity, kv_heads, head_dim)

    def configure_expert_cache(self, layers: dict, capacity: int | float | None = None) -> None:
        """Size the GPU expert cache of a MoE model: layers {MoE layer: (E, {projection: (quant.Scheme,
        shape)})}; capacity in bytes, a share of every expert's device bytes (float in (0, 1]), or None
        for the default (expert_cache.py). Raises ExpertCacheTooSmallError below one layer's experts."""
        if self.expert_cache is not None:
            self.expert_cache.close()
        self.expert_cache = GpuExpertCache(self.ctx, layers, capacity)

    def compute_threads(self, spec, tokens: int) -> ComputeThreads:
        return ComputeThreads()  # the GPU's scratch lives in its own memory (memory_bytes reports it)

    def compile_forward(self, model):
        check_llama_layers(model, "gpu")
        if model.spec.head_dim > MAX_HEAD_DIM:  # refused at load, not at the first prefill
            raise DeviceUnavailableError(f"device 'gpu' runs attention heads of up to {MAX_HEAD_DIM} dimensions; "
                                         f"this model's have {model.spec.head_dim}: use device 'cpu' or 'npu'")
        if has_moe_layers(model) and self.expert_cache is None:
            raise ValueError("device 'gpu' runs a Mixture-of-Experts model through its GPU expert cache: call "
                             "backend.configure_expert_cache(...) before building the model (edge.load does)")
        return FusedForward(self, model), "fused"

    def expert_stats(self) -> dict:
        """The GPU expert cache's counters (empty for a dense model)."""
        return self.expert_cache.stats() if self.expert_cache is not None else {}

    def memory_bytes(self) -> dict:
        """Bytes of this device's buffers: weights, the expert cache's experts, the rest (KV caches,
        activations, uniforms), all of them now, and the peak since the backend started."""
        experts = self.expert_cache.held_bytes if self.expert_cache is not None else 0
        allocated = self.ctx.allocated_bytes
        return {"weights": self.weight_bytes, "experts": experts,
                "kv_and_scratch": allocated - self.weight_bytes - experts,
                "allocated": allocated, "peak_allocated": self.ctx.peak_allocated_bytes}

    def info(self) -> dict:
        expert_upload = self.expert_cache.upload_seconds if self.expert_cache is not None else 0.0
        return {
            "device": "gpu",
            **self.ctx.info(),
            "kernels": "cpu-shaped" if self.tuning.uniform_inputs else "gpu-shaped",
            "weight_bytes_on_device": self.weight_bytes,
            "memory_bytes": self.memory_bytes(),
            "upload_seconds": round(self.upload_seconds + expert_upload, 3),  # weights at load, experts when used
            **({"expert_cache": {**self.expert_stats(), "rule": self.expert_cache.capacity_rule}}
               if self.expert_cache is not None else {}),
        }
