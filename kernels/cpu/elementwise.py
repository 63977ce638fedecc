"""Row-wise kernels: RMSNorm, RoPE (half-split), SiLU * up, softmax, embedding lookup.

Helpers work on one row (or one token) so the fused forward can call them inside its parallel
loops; the public kernels at the bottom run them over whole arrays for the op-by-op path.
"""
from __future__ import annotations

import numpy as np
from numba import prange, types

from kernels.cpu import formats as wf
from kernels.cpu.linear import dequantize_rows
from kernels.cpu.intrinsics import float_from_bits
from kernels.cpu.runtime import helper, kernel, mutable, readonly

# exp(x) = 2^n * e^r with n = round(x / ln 2), r = x - n ln 2 (ln 2 split in two for exactness), and
# e^r from Cephes' expf polynomial on |r| <= ln(2)/2: measured within 4.5 ulp of exp (1.1 ulp on
# average) over [-87, 88] with this module's fast-math flags.
# Written with arithmetic only, no libm call, so that LLVM vectorises the loops that use it.
_LOG2E = np.float32(1.44269504088896341)
_LN2_HIGH, _LN2_LOW = np.float32(0.693359375), np.float32(-2.12194440e-4)
_EXP_MIN, _EXP_MAX = np.float32(-87.33654), np.float32(88.72283)  # e^x is normal and finite in between
_P0, _P1, _P2 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3)
_P3, _P4, _P5 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1)


@helper
def exp_approx(x):
    """e^x for float32 x, clamped to the normal range (so exp(-inf) gives ~1e-38, not 0: callers that
    need an exact 0 for masked entries test for -inf themselves)."""
    x = min(max(x, _EXP_MIN), _EXP_MAX)
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _LN2_HIGH - n * _LN2_LOW
    p = ((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5
    e_r = p * (r * r) + r + np.float32(1.0)
    return e_r * float_from_bits(np.int32((np.int32(n) + 127) << 23))


@helper(ordered=True)
def sum_of_squares(x):
    """sum(x^2) in a fixed order: 8 interleaved partial sums (p_i takes x[8j + i]; LLVM may still
    pack them into one vector, the lanes being independent), added pairwise, then the tail."""
    n = x.shape[0]
    whole = n - n % 8
    p0 = p1 = p2 = p3 = p4 = p5 = p6 = p7 = np.float32(0.0)
    for b in range(0, whole, 8):
        p0 += x[b] * x[b]
        p1 += x[b + 1] * x[b + 1]
        p2 += x[b + 2] * x[b + 2]
        p3 += x[b + 3] * x[b + 3]
        p4 += x[b + 4] * x[b + 4]
        p5 += x[b + 5] * x[b + 5]
        p6 += x[b + 6] * x[b + 6]
        p7 += x[b + 7] * x[b + 7]
    total = ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7))
    for i in range(whole, n):
        total += x[i] * x[i]
    return total


@helper(ordered=True)
def rms_norm_row(x, weight, eps, out):
    """out = x / sqrt(mean(x^2) + eps) * weight, in IEEE arithmetic and a fixed order: the norm
    before a layer's K/V gives the same bits in the fused and the op-by-op kernels."""
    n = x.shape[0]
    inverse = np.float32(1.0) / np.sqrt(sum_of_squares(x) / np.float32(n) + np.float32(eps))
    for i in range(n):
        out[i] = x[i] * inverse * weight[i]


@helper(ordered=True)
def rope_row(x, cos, sin):
    """Rotate one head vector x [Dh] in place: [x1 cos - x2 sin, x2 cos + x1 sin] (half-split)."""
    half = cos.shape[0]
    for i in range(half):
        x1 = x[i]
        x2 = x[half + i]
        x[i] = x1 * cos[i] - x2 * sin[i]
        x[half + i] = x2 * cos[i] + x1 * sin[i]


@helper
def silu_times(gate, up, out):
    """out = silu(gate) * up = gate / (1 + exp(-gate)) * up."""
    for i in range(gate.shape[0]):
        g = gate[i]
        out[i] = g / (np.float32(1.0) + exp_approx(-g)) * up[i]


_GELU_2C = np.float32(2.0 * np.sqrt(2.0 / np.pi))
_GELU_CUBIC = np.float32(0.044715)


@helper
def gelu_tanh_times(gate, up, out):
    """out = gelu_tanh(gate) * up. 0.5 g (1 + tanh(u)) = g / (1 + e^(-2u)), u = sqrt(2/pi) (g + 0.044715 g^3):
    silu's form, so it vectorises the same way."""
    for i in range(gate.shape[0]):
        g = gate[i]
        out[i] = g / (np.float32(1.0) + exp_approx(-_GELU_2C * (g + _GELU_CUBIC * g * g * g))) * up[i]


@helper
def gelu_tanh_times_in_place(gate, up):
    """gate = gelu_tanh(gate) * up (as silu_times_in_place, for its vectorised loop)."""
    for i in range(gate.shape[0]):
        g = gate[i]
        gate[i] = g / (np.float32(1.0) + exp_approx(-_GELU_2C * (g + _GELU_CUBIC * g * g * g))) * up[i]


@helper
def silu_times_in_place(gate, up):
    """gate = silu(gate) * up. silu_times with out = gate would give the same values, but LLVM's
    overlap check then keeps that loop scalar."""
    for i in range(gate.shape[0]):
        g = gate[i]
        gate[i] = g / (np.float32(1.0) + exp_approx(-g)) * up[i]


@helper
def softmax_row(scores, out):
    """out = exp(scores - max) / sum; -inf entries get weight 0."""
    n = scores.shape[0]
    peak = -np.inf
    for i in range(n):
        peak = max(peak, scores[i])
    total = np.float32(0.0)
    for i in range(n):
        e = exp_approx(scores[i] - peak) if scores[i] != -np.inf else np.float32(0.0)
        out[i] = e
        total += e
    inverse = np.float32(1.0) / total
    for i in range(n):
        out[i] *= inverse


@helper
def embed_row(table, token, row_scratch, out):
    """out [D] = row `token` of the embedding table (dequantized through row_scratch [>= K_padded])."""
    dequantize_rows(table, token, 1, row_scratch)
    for i in range(out.shape[0]):
        out[i] = row_scratch[0, i]


# --------------------------------------------------------------------------------------------
# Public kernels (op by op)

_f32_ro_1d, _f32_ro_2d = readonly(types.float32, 1), readonly(types.float32, 2)
_f32_1d, _f32_2d = mutable(types.float32, 1), mutable(types.float32, 2)


@kernel(types.void(_f32_ro_2d, _f32_ro_1d, types.float32, _f32_2d), parallel=True)
def rms_norm_kernel(x, weight, eps, out):
    for t in prange(x.shape[0]):
        rms_norm_row(x[t], weight, eps, out[t])


@kernel(types.void(mutable(types.float32, 3), _f32_ro_2d, _f32_ro_2d))
def rope_kernel(x, cos, sin):
    """x [T, H, Dh] rotated in place by cos/sin [T, Dh/2]."""
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            rope_row(x[t, h], cos[t], sin[t])


@kernel(types.void(_f32_ro_1d, _f32_ro_1d, _f32_1d))
def swiglu_kernel(gate, up, out):
    silu_times(gate, up, out)


@kernel(types.void(_f32_ro_1d, _f32_ro_1d, _f32_1d))
def gelu_tanh_gated_kernel(gate, up, out):
    gelu_tanh_times(gate, up, out)


@kernel(types.void(_f32_ro_2d, _f32_2d))
def softmax_kernel(scores, out):
    for t in range(scores.shape[0]):
        softmax_row(scores[t], out[t])


@kernel(types.void(readonly(types.int64, 1), readonly(types.int64, 1), _f32_2d, _f32_2d))
def embed_kernel(table, ids, row_scratch, out):
    for t in range(ids.shape[0]):
        embed_row(table, ids[t], row_scratch, out[t])


def embed(descriptor: np.ndarray, ids: np.ndarray) -> np.ndarray:
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    rows = int(descriptor[wf.W_ROWS])
    if ids.size and (ids.min() < 0 or ids.max() >= rows):
        raise IndexError(f"token id out of range [0, {rows}) in embedding lookup")
    out = np.empty((ids.size, int(descriptor[wf.W_COLS])), np.float32)
    embed_kernel(descriptor, ids, np.empty((1, int(descriptor[wf.W_COLS_PADDED])), np.float32), out)
    return out
