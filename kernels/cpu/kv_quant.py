"""The KV cache formats (quant/kv_formats.py) on the CPU: int8 per-group maxima, codes and
dequantization, and f16 widening, as parallel loops over cached rows.

R = rows of values (cached positions x heads), D = values per row, G = group size.

The scale arithmetic that decides the codes (max / 127 rounded to f16, its f32 inverse) runs in
numpy on the small [R, D/G] array, exactly as in the reference, so both produce the same codes.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic

from kernels.cpu.runtime import kernel, mutable, readonly
from quant.kv_formats import INT8_LIMIT

# one read-only signature per kernel: writable arrays are accepted where read-only ones are declared
_f32_ro_2d, _f32_2d = readonly(types.float32, 2), mutable(types.float32, 2)
_i8_ro_2d, _i8_2d = readonly(types.int8, 2), mutable(types.int8, 2)


@kernel(types.void(_f32_ro_2d, types.int64, _f32_2d), parallel=True)
def group_maxima_kernel(x, group, out):
    """out [R, D/G] = max |x| over each group of x [R, D]."""
    for r in prange(x.shape[0]):
        for g in range(out.shape[1]):
            peak = np.float32(0.0)
            for d in range(g * group, (g + 1) * group):
                peak = max(peak, abs(x[r, d]))
            out[r, g] = peak


@kernel(types.void(_f32_ro_2d, _f32_ro_2d, types.int64, _i8_2d), parallel=True)
def encode_kernel(x, inverse, group, codes):
    """codes [R, D] = clip(rint(x * inverse of the group's scale), -127, 127)."""
    limit = np.float32(INT8_LIMIT)
    for r in prange(x.shape[0]):
        row_x, row_inverse, row_codes = x[r], inverse[r], codes[r]
        for g in range(row_inverse.shape[0]):
            factor = row_inverse[g]
            base = g * group
            for j in range(group):
                code = np.rint(row_x[base + j] * factor)
                row_codes[base + j] = np.int8(min(max(code, -limit), limit))


@kernel(types.void(_i8_ro_2d, _f32_ro_2d, types.int64, _f32_2d), parallel=True)
def decode_kernel(codes, scales, group, out):
    """out [R, D] = codes * the group's scale. Row views and a hoisted scale let the inner loop
    vectorise (indexing [r, d // group] per element measured 5x slower)."""
    for r in prange(codes.shape[0]):
        row_codes, row_scales, row_out = codes[r], scales[r], out[r]
        for g in range(row_scales.shape[0]):
            scale = row_scales[g]
            base = g * group
            for j in range(group):
                row_out[base + j] = np.float32(row_codes[base + j]) * scale


@intrinsic
def half_to_single(typingctx, bits):
    """The float32 equal to the IEEE half whose bit pattern is `bits` (uint16): LLVM's exact
    half -> float extension, which compiles to the CPU's conversion instruction (F16C, NEON)
    where there is one, vectorised in loops."""
    signature = types.float32(types.uint16)

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return signature, codegen


@kernel(types.void(readonly(types.uint16, 2), _f32_2d), parallel=True)
def widen_halves_kernel(bits, out):
    """out [R, D] = the IEEE half-precision values whose bit patterns are `bits` [R, D]."""
    for r in prange(bits.shape[0]):
        for d in range(bits.shape[1]):
            out[r, d] = half_to_single(bits[r, d])


def quantize_int8(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """x [..., D] f32 -> (codes int8 [..., D], scales f16 [..., D/G]), as quant.kv_formats.quantize_int8."""
    shape = x.shape
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, shape[-1])
    if shape[-1] % group:
        raise ValueError(f"int8 KV rows of {shape[-1]} values do not split into groups of {group}")
    maxima = np.empty((rows.shape[0], shape[-1] // group), np.float32)
    group_maxima_kernel(rows, group, maxima)
    scales = (maxima / np.float32(INT8_LIMIT)).astype(np.float16)
    wide = scales.astype(np.float32)
    with np.errstate(divide="ignore"):
        inverse = np.where(wide > 0, np.float32(1.0) / wide, np.float32(0.0)).astype(np.float32)
    codes = np.empty(rows.shape, np.int8)
    encode_kernel(rows, inverse, group, codes)
    return codes.reshape(shape), scales.reshape(*shape[:-1], shape[-1] // group)


def widen_halves(halves: np.ndarray) -> np.ndarray:
    """f16 [..., D] -> f32 [..., D], as numpy's astype."""
    shape = halves.shape
    out = np.empty((int(np.prod(shape[:-1])), shape[-1]), np.float32)
    widen_halves_kernel(np.ascontiguousarray(halves).view(np.uint16).reshape(out.shape), out)
    return out.reshape(shape)


def dequantize_int8(codes: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    """(codes [..., D], scales [..., D/G]) -> f32 [..., D]."""
    shape = codes.shape
    out = np.empty((int(np.prod(shape[:-1])), shape[-1]), np.float32)
    decode_kernel(np.ascontiguousarray(codes).reshape(out.shape),
                  widen_halves(scales).reshape(out.shape[0], shape[-1] // group), group, out)
    return out.reshape(shape)
