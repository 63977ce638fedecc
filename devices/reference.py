"""The numpy float32 oracle. Every accelerated backend is tested against these functions, so
they are written to be read: one line of math per step, no fusion, no cleverness.

Quantized weights are dequantized at the moment they are used and then dropped: loading
stays zero-copy (the checkpoint's mmap), at the cost of speed.
"""
from __future__ import annotations

import numpy as np

from devices.cache_buffers import CacheBuffer, KvCodec, StoredRows, decode_stored
from edge.core import numerics
from edge.core.contract import Capabilities, ComputeThreads
from edge.core.kv import KV_FORMATS
from edge.core.numerics import gelu_tanh, silu, softmax
from quant import QuantizedTensor
from quant.kv_formats import dequantize_int8, quantize_int8


def as_float32(weight) -> np.ndarray:
    if isinstance(weight, QuantizedTensor):
        return weight.dequantize()
    return np.asarray(weight, dtype=np.float32)


def embed(table, ids: np.ndarray) -> np.ndarray:
    if isinstance(table, QuantizedTensor):
        return table.dequantize_rows(ids)
    return np.asarray(table[ids], dtype=np.float32)


def linear(x: np.ndarray, weight, bias=None) -> np.ndarray:
    y = x @ as_float32(weight).T
    if bias is not None:
        y += as_float32(bias)
    return y


def rms_norm(x: np.ndarray, weight, eps: float) -> np.ndarray:
    return numerics.rms_norm(x, as_float32(weight), eps)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def causal_mask(q_positions: np.ndarray, k_positions: np.ndarray, window: int | None) -> np.ndarray:
    """True where query i may attend key j: j is not in the future (nor outside the window)."""
    visible = k_positions[None, :] <= q_positions[:, None]
    if window is not None:
        visible &= q_positions[:, None] - k_positions[None, :] < window
    return visible


def attention(q, k, v, q_positions, k_positions, scale, window=None) -> np.ndarray:
    n_q_heads, n_kv_heads = q.shape[1], k.shape[1]
    group = n_q_heads // n_kv_heads  # query heads sharing one key/value head (GQA/MQA)
    k = np.repeat(k, group, axis=1)  # [S, Hq, Dh]
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) * scale  # [Hq, T, S]
    mask = causal_mask(np.asarray(q_positions), np.asarray(k_positions), window)
    scores = np.where(mask[None], scores, -np.inf)
    return np.einsum("hts,shd->thd", softmax(scores), v).astype(np.float32)


def attention_over_cache(q, keys: StoredRows, values: StoredRows, q_positions, k_positions, scale,
                         window=None) -> np.ndarray:
    """Attention over K/V rows as the cache stores them: dequantize, then `attention`."""
    return attention(q, decode_stored(keys, NUMPY_KV_CODEC), decode_stored(values, NUMPY_KV_CODEC),
                     q_positions, k_positions, scale, window)


def head_matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per-head products: x [T, H, K] and w [H, N, K] -> [T, H, N], out[t, h] = w[h] @ x[t, h]."""
    return np.einsum("thk,hnk->thn", x, w).astype(np.float32)


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return silu(gate) * up


def gelu_tanh_gated(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return gelu_tanh(gate) * up


NUMPY_KV_CODEC = KvCodec(quantize_int8, dequantize_int8, lambda halves: halves.astype(np.float32))


class ReferenceBackend:
    name = "reference"
    # sliding layers may keep only their window; MoE layers mix their experts op by op (edge/moe.py)
    capabilities = Capabilities(kv_formats=KV_FORMATS, cache_buffers=True, ring_buffers=True, stored_attention=True)

    def __init__(self, threads: int | None = None, variant: str | None = None):
        if variant is not None:
            raise ValueError(f"device 'reference' has no variants, got 'reference:{variant}'")
        if threads is not None:  # refused as the gpu refuses it, rather than accepted and ignored
            raise ValueError("device 'reference' is the numpy oracle and runs no threads of its own; "
                             "--threads/threads= applies to the cpu and npu devices")
        self.threads = threads

    def prepare_weight(self, weight):
        return weight  # mmap views and QuantizedTensors are used where they lie

    load_weight = prepare_weight

    @property
    def expert_backend(self):
        return self

    embed = staticmethod(embed)
    linear = staticmethod(linear)
    rms_norm = staticmethod(rms_norm)
    rope = staticmethod(rope)
    attention = staticmethod(attention)
    attention_over_cache = staticmethod(attention_over_cache)
    swiglu = staticmethod(swiglu)
    gelu_tanh_gated = staticmethod(gelu_tanh_gated)
    head_matmul = staticmethod(head_matmul)

    def allocate_kv(self, capacity: int, kv_heads: int, head_dim: int):
        # np.zeros maps untouched pages lazily: memory grows with the valid length, not capacity
        return (np.zeros((capacity, kv_heads, head_dim), np.float32),
                np.zeros((capacity, kv_heads, head_dim), np.float32))

    def allocate_cache(self, rows: int, heads: int, dim: int, fmt: str) -> CacheBuffer:
        return CacheBuffer(rows, heads, dim, fmt, NUMPY_KV_CODEC)

    def compute_threads(self, spec, tokens: int) -> ComputeThreads:
        return ComputeThreads()  # numpy's own threads hold nothing the budget must reserve

    def compile_forward(self, model):
        return None, "ops: the numpy oracle is the op-by-op composition"

    def info(self) -> dict:
        return {"device": "reference", "backend": "numpy float32 oracle", "numpy": np.__version__}
