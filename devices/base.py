"""The backend contract: the operations a decoder-only transformer is made of.

Shapes: T = tokens in this call, S = cached positions, D = hidden size,
Hq / Hkv = query / key-value heads, Dh = head dimension, N x K = a weight's rows x inputs.
A weight is whatever `prepare_weight` returned for a float array or a quant.QuantizedTensor.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class Backend(Protocol):
    name: str

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

    def info(self) -> dict: ...


DEVICES = ("reference",)


def create_backend(device: str, threads: int | None = None) -> Backend:
    """The backend for a device name; an unknown or unavailable device is an error, never a fallback."""
    kind = device.split(":", 1)[0]
    if kind == "reference":
        from devices.reference import ReferenceBackend

        return ReferenceBackend(threads=threads)
    raise ValueError(f"device {device!r} is not available; available devices: {', '.join(DEVICES)}")
