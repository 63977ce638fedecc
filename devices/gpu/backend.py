"""GpuBackend: the backend contract (devices/base.py) on a Vulkan device."""
from __future__ import annotations

import time

import numpy as np

from devices.base import MoeUnsupportedError, check_gqa_only, has_moe_layers
from devices.gpu.context import GpuContext, select_vulkan_adapter
from devices.gpu.forward import FusedForward
from devices.gpu.launches import LaunchBuilder, Tuning
from devices.gpu.ops import GpuOps
from devices.gpu.shaders import KernelCache
from devices.gpu.tensors import GpuKV, GpuMatrix, GpuVector
from quant import QuantizedTensor


class GpuBackend:
    name = "gpu"
    runs_moe = False

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

    def softmax(self, x):
        return self.ops.softmax(x)

    def argmax(self, x):
        return self.ops.argmax(x)

    kv_formats = ("f32",)  # edge refuses kv_cache="f16"/"int8" on this device
    ring_buffers = False  # sliding layers keep every position and mask by window

    def allocate_kv(self, capacity: int, kv_heads: int, head_dim: int):
        return GpuKV(self.ctx, capacity, kv_heads, head_dim), GpuKV(self.ctx, capacity, kv_heads, head_dim)

    def compile_forward(self, transformer):
        check_gqa_only(transformer, "gpu")
        if has_moe_layers(transformer):
            raise MoeUnsupportedError("gpu")
        return FusedForward(self, transformer)

    def info(self) -> dict:
        return {
            "device": "gpu",
            **self.ctx.info(),
            "kernels": "cpu-shaped" if self.tuning.uniform_inputs else "gpu-shaped",
            "weight_bytes_on_device": self.weight_bytes,
            "upload_seconds": round(self.upload_seconds, 3),
        }
