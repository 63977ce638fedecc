"""The backend contract: the operations a decoder-only transformer is made of.

Shapes: T = tokens in this call, S = cached positions, D = hidden size,
Hq / Hkv = query / key-value heads, Dh = head dimension, N x K = a weight's rows x inputs.
A weight is whatever `prepare_weight` returned for a float array or a quant.QuantizedTensor.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Protocol

import numpy as np


class Backend(Protocol):
    name: str
    runs_moe: bool  # whether the op-by-op composition of a Mixture-of-Experts model runs on this backend

    def prepare_weight(self, weight) -> Any: ...

    def embed(self, table, ids: np.ndarray) -> np.ndarray:
        """Rows of the embedding table: [T] ids -> [T, D]."""

    def linear(self, x: np.ndarray, weight, bias=None) -> np.ndarray:
        """x [T, K] times weight [N, K] transposed, plus bias [N]: -> [T, N]."""

    def rms_norm(self, x: np.ndarray, weight, eps: float) -> np.ndarray:
        """Normalise the last axis by its root mean square, then scale by weight."""

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Rotate x [T, H, Dh] (half-split layout) by cos/sin [T, Dh/2]."""

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray,
                  k_positions: np.ndarray, scale: float, window: int | None) -> np.ndarray:
        """Causal attention of q [T, Hq, Dh] over k, v [S, Hkv, Dh]: -> [T, Hq, Dh]."""

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """silu(gate) * up."""

    def allocate_kv(self, capacity: int, kv_heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
        """Key and value buffers for one layer: [capacity, Hkv, Dh] each."""

    # Optional, for backends that hold more than plain float32 K/V (edge/kv_cache.py asks for them):
    # kv_formats: tuple[str, ...]   the storage formats allocate_cache takes (quant/kv_formats.py)
    # ring_buffers: bool            sliding-window layers may keep only their window
    def allocate_cache(self, rows: int, heads: int, dim: int, fmt: str):
        """A buffer of rows x heads x dim in a KV storage format, indexed like an array:
        `buffer[rows] = x` stores float32 x (quantizing), `buffer[rows]` reads float32, and
        `buffer.round_trip(x)` is what storing x would read back (devices/cache_buffers.py)."""

    def attention_over_cache(self, q: np.ndarray, keys, values, q_positions: np.ndarray, k_positions: np.ndarray,
                             scale: float, window: int | None) -> np.ndarray:
        """Optional: `attention` over K/V as the cache stores them (devices/cache_buffers.StoredRows:
        f32 / f16 values or int8 codes + f16 scales, [S, Hkv, Dh]), without an f32 copy of the cache."""

    def head_matmul(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """Per-head products (MLA's absorbed form): x [T, H, K], w [H, N, K] float32 -> [T, H, N]."""

    # Optional, for backends that run MoE layers faster than op by op (edge/moe.py asks for it):
    def expert_mixture(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, experts) -> np.ndarray:
        """The routed experts' mixture of one MoE layer: x [T, D], expert ids [T, A], route weights
        [T, A], experts {id: edge.moe.ExpertWeights} -> sum over each token's chosen experts of
        weight * down(silu(gate(x)) * up(x)), [T, D]. Experts are added in ascending id order (so the
        result does not depend on which ExpertSource supplied them), and a mapping with a
        `window_size` is read at most that many experts at a time (edge/moe.py ExpertSource).
        Without it, edge/moe.py `expert_mixture` composes linear and swiglu per expert."""

    # Optional, for backends that run routed experts from their own memory (gpu):
    # expert_backend: the object whose prepare_weight an ExpertSource prepares expert weights with
    #                 (edge/api.py; the gpu hands the stored host views over unchanged)
    def configure_expert_cache(self, layers: dict, capacity: int | float | None) -> None:
        """Size the device's expert cache before the model is built: layers {MoE layer: (E, {projection:
        (quant.Scheme, shape)})}, capacity in bytes, a share (0, 1] of every expert's bytes, or None for
        the device's default; raises ValueError when it cannot hold one layer's experts at once.
        `expert_stats()` then reports its counters (model.stats() includes them)."""

    def compile_forward(self, transformer) -> Callable | None:
        """A fused executor for the whole forward pass, or None to run edge's op-by-op composition.

        Backends whose speed depends on not returning to Python between operations (one compiled
        call per layer on the CPU, one recorded command buffer on the GPU, one ONNX graph on an
        NPU) return a callable with the signature of `edge.model.Transformer.forward_ops`:
        (ids, cache, all_logits, observer) -> logits. It must compute the same math as the
        composition (the parity tests compare them) and call `observer(layer, hidden)` after each
        layer when one is given. It may also have `next_token(ids, cache) -> int`: the argmax of the
        last token's logits (ties to the lowest id), picked without returning the logits (greedy steps)."""

    def info(self) -> dict: ...


class DeviceUnavailableError(RuntimeError):
    """A backend cannot run on this machine (driver, runtime or hardware missing); the message
    says what is missing and how to get it. edge/ reports it as a typed error, never falls back."""


class AttentionUnsupportedError(DeviceUnavailableError):
    """The device has no kernels for the model's attention kind (e.g. MLA)."""

    def __init__(self, device: str, kind: str):
        super().__init__(f"device {device!r} does not implement {kind.upper()} attention (it runs MHA/GQA/MQA "
                         f"with float32 K/V caches); use device 'cpu' or 'reference'")


def check_gqa_only(transformer, device: str) -> None:
    """Refuse models whose attention a GQA-only executor would compute wrongly."""
    kind = transformer.spec.attention_kind
    if kind != "gqa":
        raise AttentionUnsupportedError(device, kind)


def has_moe_layers(transformer) -> bool:
    return any(getattr(layer, "moe", None) is not None for layer in transformer.layers)


# device kind -> "module:BackendClass". A device that is missing here, or whose backend cannot
# start on this machine, is an error: there is never a fallback to another device.
BACKENDS: dict[str, str] = {
    "reference": "devices.reference:ReferenceBackend",
    "cpu": "devices.cpu:CpuBackend",
    "gpu": "devices.gpu:GpuBackend",
    "npu": "devices.npu:NpuBackend",
}
DEVICES = tuple(BACKENDS)
THREADED_DEVICES = ("cpu", "npu")  # the others schedule their own work and refuse a thread count


def split_device_list(text: str) -> list[str]:
    """A comma-separated list of devices (`--device` / `--devices`) into device strings: a key=value
    setting belongs to the device before it (cpu,npu:qnn,allow_cpu_nodes=1 -> cpu, npu:qnn,allow_cpu_nodes=1)."""
    devices: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if devices and "=" in piece and ":" not in piece.partition("=")[0]:
            devices[-1] += "," + piece
        else:
            devices.append(piece)
    return devices


def create_backend(device: str, threads: int | None = None) -> Backend:
    """The backend for a device name such as "reference", "cpu" or "npu:openvino"."""
    kind, _, variant = device.partition(":")
    if kind not in BACKENDS:
        raise ValueError(f"device {device!r} is not available; available devices: {', '.join(DEVICES)}")
    module_name, class_name = BACKENDS[kind].split(":")
    backend_class = getattr(importlib.import_module(module_name), class_name)
    return backend_class(threads=threads, variant=variant or None)
