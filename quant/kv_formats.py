"""Storage formats of the KV cache: what a cached key, value or latent row costs and how it is
rounded. Devices own the buffers (devices/cache_buffers.py); this module owns the math.

N = rows (cached positions), H = heads, D = a head's dimension, G = group size along D.

- "f32": stored as computed.
- "f16": IEEE half; relative error <= 2^-11 per element (values beyond 65504 become inf).
- "int8": symmetric per group of G values along D: scale = f16(max|x| / 127), code =
  rint(x * (1 / scale)) clipped to [-127, 127]. Per element |x - code * scale| <= scale / 2,
  i.e. <= max|x| / 254 of its group, plus the scale's own f16 rounding (2^-11 relative).
"""
from __future__ import annotations

import numpy as np

# the formats' names and row sizes belong to the core (a memory plan needs them without this math)
from edge.core.kv import KV_FORMATS, KV_INT8_GROUP, kv_bytes_per_row, kv_group_size  # noqa: F401

INT8_LIMIT = 127


def kv_relative_error_bound(fmt: str) -> float:
    """Worst-case error of one stored element, relative to the largest |value| of its group (int8)
    or to itself (f16)."""
    return {"f32": 0.0, "f16": 2.0 ** -11, "int8": 0.5 / INT8_LIMIT * (1 + 2.0 ** -11) + 2.0 ** -11}[fmt]


def int8_scales(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Scales f16 [N, H, D/G] of x [N, H, D] f32, and the f32 inverse scales the codes use (0 for an
    all-zero group)."""
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    scales = (np.abs(groups).max(axis=-1) / np.float32(INT8_LIMIT)).astype(np.float16)
    wide = scales.astype(np.float32)
    with np.errstate(divide="ignore"):
        inverse = np.where(wide > 0, np.float32(1.0) / wide, np.float32(0.0)).astype(np.float32)
    return scales, inverse


def quantize_int8(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """x [N, H, D] f32 -> (codes int8 [N, H, D], scales f16 [N, H, D/G])."""
    x = np.asarray(x, dtype=np.float32)
    scales, inverse = int8_scales(x, group)
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    codes = np.clip(np.rint(groups * inverse[..., None]), -INT8_LIMIT, INT8_LIMIT).astype(np.int8)
    return codes.reshape(x.shape), scales


def dequantize_int8(codes: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    """(codes [N, H, D], scales [N, H, D/G]) -> f32 [N, H, D]."""
    groups = codes.reshape(*codes.shape[:-1], codes.shape[-1] // group, group).astype(np.float32)
    return (groups * scales.astype(np.float32)[..., None]).reshape(codes.shape)
