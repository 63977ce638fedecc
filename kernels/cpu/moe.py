"""One compiled call per MoE layer: the routed experts' mixture.

T = tokens, D = hidden size, Ed = distinct experts this call uses (ascending id), I = an expert's
intermediate size, P = threads, R = routed (token, expert) pairs.

    out[t] = sum over the experts e that token t chose, in ascending id order, of
             coeff[t, e] * down_e(silu(gate_e(x[t])) * up_e(x[t]))

Experts arrive as a descriptor table [3 * Ed, W_FIELDS] (gate, up, down of each, kernels/cpu/formats.py)
and the route as token lists per expert (CSR: `offsets` [Ed + 1] into `tokens` [R] and `coeffs` [R]).
The projections are the linear kernels' row blocks (kernels/cpu/linear.py): row ranges are cut at
multiples of MATVEC_BLOCK / TILE_M, and every output row is summed by the same code whatever range
holds it, so the result does not depend on the thread count; experts are added in ascending id
order, so it does not depend on where their weights came from either.

Decode (T = 1): x is prepared once for every gate/up; each thread computes its rows of every
expert's gate and up and their silu product, then its rows of the output from every expert's down
projection, expert after expert, requesting the first rows of the next expert's matrices while it
computes one (linear.prefetch_head: an expert's matrices are small, and a matvec's own prefetches
run only a few row blocks ahead). Prefill: expert after expert, that expert's tokens are gathered and
transposed, gate/up are tiled into [I, Te] (already the down projection's transposed input), the
down projection gives [Te, D], and its rows are scaled and added to the tokens' outputs.
"""
from __future__ import annotations

import numpy as np
from numba import prange, types

from kernels.cpu.elementwise import silu_times, silu_times_in_place
from kernels.cpu.formats import W_ACTIVATIONS, W_COLS, W_COLS_PADDED, W_FIELDS, W_PREFILL_INT8, W_ROWS
from kernels.cpu.linear import (BLOCK_FLOATS, CHUNK, MATVEC_BLOCK, TILE_M, gemm_rows, matvec_rows, padded_tokens,
                                padded_tokens_in_kernel, pairs_length, prefetch_head, prepare_vector, quantize_tokens,
                                quantized_capacity, quantized_tokens_shape, split, sums_length, tile_scratch_rows,
                                transpose_tokens)
from kernels.cpu.runtime import kernel, mutable, readonly

GATE, UP, DOWN = 0, 1, 2  # a distinct expert's rows in the descriptor table: 3 * e + GATE, ...

_i64_ro_1d, _i64_ro_2d = readonly(types.int64, 1), readonly(types.int64, 2)
_f32_ro_1d, _f32_ro_2d = readonly(types.float32, 1), readonly(types.float32, 2)
_f32_1d, _f32_2d, _f32_3d = mutable(types.float32, 1), mutable(types.float32, 2), mutable(types.float32, 3)

_DECODE_SIGNATURE = types.void(_i64_ro_2d, _f32_ro_2d, _f32_ro_1d, types.int64, _f32_2d,
                               _f32_1d, _f32_1d, _f32_1d, _f32_2d, _f32_2d, _f32_2d, _f32_2d, _f32_2d, _f32_2d,
                               _f32_1d)


@kernel(_DECODE_SIGNATURE, parallel=True)
def mixture_decode_kernel(weights, x, coeffs, n_threads, out, x_natural, x_pairs, x_sums, gate_rows, up_rows,
                          hidden, h_natural, h_pairs, h_sums, down_rows):
    """One token: out [1, D] += sum_e coeffs[e] * down_e(silu(gate_e(x)) * up_e(x)), x [1, D].

    Scratch: x_* prepared x; gate_rows / up_rows / hidden [Ed, I_max]; h_* [Ed, ...] each expert's
    prepared hidden vector; down_rows [D]."""
    n_experts = coeffs.shape[0]
    prepare_vector(x[0], x_natural, x_pairs, x_sums, weights[GATE, W_ACTIVATIONS])
    for part in prange(n_threads):  # every expert's gate and up rows of this part, then silu * up
        for e in range(n_experts):
            gate, up = weights[3 * e + GATE], weights[3 * e + UP]
            begin, end = split(gate[W_ROWS], n_threads, part, MATVEC_BLOCK)
            if e + 1 < n_experts:
                next_begin = split(weights[3 * e + 3 + GATE, W_ROWS], n_threads, part, MATVEC_BLOCK)[0]
                prefetch_head(weights[3 * e + 3 + GATE], next_begin)
                prefetch_head(weights[3 * e + 3 + UP], next_begin)
            matvec_rows(gate, begin, end, x_natural, x_pairs, x_sums, gate_rows[e])
            matvec_rows(up, begin, end, x_natural, x_pairs, x_sums, up_rows[e])
            silu_times(gate_rows[e, begin:end], up_rows[e, begin:end], hidden[e, begin:end])
    for e in prange(n_experts):  # each expert's hidden vector as the down projection takes it
        down = weights[3 * e + DOWN]
        k_padded = down[W_COLS_PADDED]
        prepare_vector(hidden[e, :down[W_COLS]], h_natural[e, :k_padded], h_pairs[e], h_sums[e], down[W_ACTIVATIONS])
    d_model = out.shape[1]
    for part in prange(n_threads):  # this part's output rows, expert after expert (ascending id)
        begin, end = split(d_model, n_threads, part, MATVEC_BLOCK)
        for e in range(n_experts):
            down = weights[3 * e + DOWN]
            k_padded = down[W_COLS_PADDED]
            if e + 1 < n_experts:
                prefetch_head(weights[3 * e + 3 + DOWN], begin)
            matvec_rows(down, begin, end, h_natural[e, :k_padded], h_pairs[e], h_sums[e], down_rows)
            coeff = coeffs[e]
            for r in range(begin, end):
                out[0, r] += coeff * down_rows[r]


_PREFILL_SIGNATURE = types.void(_i64_ro_2d, _f32_ro_2d, _i64_ro_1d, _i64_ro_1d, _f32_ro_1d, types.int64, _f32_2d,
                                _f32_2d, _f32_2d, _f32_2d, _f32_2d, _f32_2d, _f32_3d, _f32_2d)


@kernel(_PREFILL_SIGNATURE, parallel=True)
def mixture_prefill_kernel(weights, x, offsets, tokens, coeffs, n_threads, out, gathered, xt, gate_t, up_t, xq,
                           tiles, blocks):
    """T tokens: out [T, D] += the mixture, expert after expert; expert e's tokens are
    tokens[offsets[e]:offsets[e + 1]] with weights coeffs[...] (ascending token order).

    Scratch: gathered [>= Te, D]; xt [>= D_padded, padded Te]; gate_t / up_t [>= I_padded, padded Te];
    xq [quantized_tokens_shape(max(K_max, I_padded), Te)] (the gate/up or down input quantized, for
    weights prefilled on integer panels); tiles [P, tile_scratch_rows(most routed tokens), K_max];
    blocks [P, BLOCK_FLOATS]."""
    n_experts = offsets.shape[0] - 1
    d_model = out.shape[1]
    for e in range(n_experts):
        first, n_routed = offsets[e], offsets[e + 1] - offsets[e]
        if n_routed == 0:
            continue
        gate, up, down = weights[3 * e + GATE], weights[3 * e + UP], weights[3 * e + DOWN]
        rows = gathered[:n_routed]
        for i in range(n_routed):
            rows[i] = x[tokens[first + i]]
        k_padded = max(gate[W_COLS_PADDED], up[W_COLS_PADDED])
        columns = padded_tokens_in_kernel(n_routed)
        for part in prange(n_threads):
            k_begin, k_end = split(k_padded, n_threads, part, CHUNK)
            transpose_tokens(rows, xt, k_begin, k_end)
            if gate[W_PREFILL_INT8] + up[W_PREFILL_INT8] > 0:
                quantize_tokens(xt.ctypes.data, xt.shape[1], k_begin // CHUNK, k_end // CHUNK, columns, xq.ctypes.data,
                                quantized_capacity(xq), tiles[part].ctypes.data)
        for part in prange(n_threads):  # gate and up rows [I, Te], then silu(gate) * up in place
            begin, end = split(gate[W_ROWS], n_threads, part, TILE_M)
            tile, block = tiles[part], blocks[part]
            gemm_rows(gate, begin, end, xt, xq, n_routed, tile, block, gate_t, begin, False, True)
            gemm_rows(up, begin, end, xt, xq, n_routed, tile, block, up_t, begin, False, True)
            for r in range(begin, end):
                silu_times_in_place(gate_t[r, :n_routed], up_t[r, :n_routed])
        for r in range(gate[W_ROWS], down[W_COLS_PADDED]):  # the down projection's zero padding
            for t in range(gate_t.shape[1]):
                gate_t[r, t] = 0.0
        if down[W_PREFILL_INT8]:
            for part in prange(n_threads):
                k_begin, k_end = split(down[W_COLS_PADDED], n_threads, part, CHUNK)
                quantize_tokens(gate_t.ctypes.data, gate_t.shape[1], k_begin // CHUNK, k_end // CHUNK, columns,
                                xq.ctypes.data, quantized_capacity(xq), tiles[part].ctypes.data)
        for part in prange(n_threads):  # down rows [Te, D] into `rows` (x is no longer needed there)
            begin, end = split(down[W_ROWS], n_threads, part, TILE_M)
            gemm_rows(down, begin, end, gate_t, xq, n_routed, tiles[part], blocks[part], rows, begin, False, False)
        for i in range(n_routed):
            coeff = coeffs[first + i]
            destination = out[tokens[first + i]]
            for r in range(d_model):
                destination[r] += coeff * rows[i, r]


def _check(descriptors: np.ndarray, d_model: int) -> None:
    if descriptors.ndim != 2 or descriptors.shape[1] != W_FIELDS or descriptors.shape[0] % 3:
        raise ValueError(f"expert_mixture: expected a descriptor table [3 * experts, {W_FIELDS}], "
                         f"got {descriptors.shape}")
    experts = descriptors.reshape(-1, 3, W_FIELDS)  # [Ed, gate/up/down, W_FIELDS]
    rows, cols = experts[:, :, W_ROWS], experts[:, :, W_COLS]  # [Ed, 3] each
    if (cols[:, GATE] != d_model).any() or (cols[:, UP] != d_model).any() or (rows[:, DOWN] != d_model).any():
        raise ValueError(f"expert_mixture: x has {d_model} features but an expert's gate/up take "
                         f"{sorted(set(cols[:, GATE].tolist()) | set(cols[:, UP].tolist()))} and its "
                         f"down gives {sorted(set(rows[:, DOWN].tolist()))}")
    if (rows[:, GATE] != rows[:, UP]).any() or (cols[:, DOWN] != rows[:, GATE]).any():
        raise ValueError("expert_mixture: an expert's gate, up and down disagree on its intermediate size")


def check_expert_table(table: np.ndarray) -> None:
    """One expert's gate, up, down descriptor rows [3, W_FIELDS] agree with each other: checked once,
    where a backend packs an expert, so that decode calls need not check them again."""
    _check(table, int(table[GATE, W_COLS]))


class DecodeScratch:
    """The decode kernel's scratch for up to `n_experts` experts of one shape, reused call after call."""

    def __init__(self, n_experts: int, d_model: int, k_max: int, i_max: int, h_padded: int):
        self.shape = (n_experts, d_model, k_max, i_max, h_padded)
        self.x_natural = np.empty(k_max, np.float32)
        self.x_pairs = np.empty(pairs_length(k_max), np.float32)
        self.x_sums = np.empty(sums_length(k_max), np.float32)
        self.gate_rows = np.empty((n_experts, i_max), np.float32)
        self.up_rows = np.empty((n_experts, i_max), np.float32)
        self.hidden = np.empty((n_experts, i_max), np.float32)
        self.h_natural = np.empty((n_experts, h_padded), np.float32)
        self.h_pairs = np.empty((n_experts, pairs_length(h_padded)), np.float32)
        self.h_sums = np.empty((n_experts, sums_length(h_padded)), np.float32)
        self.down_rows = np.empty(d_model, np.float32)

    @staticmethod
    def shape_for(descriptors: np.ndarray) -> tuple[int, int, int, int, int]:
        """(experts, D, K_max, I_max, padded I_max) of a descriptor table [3 * Ed, W_FIELDS]."""
        return (descriptors.shape[0] // 3, int(descriptors[DOWN, W_ROWS]), int(descriptors[:, W_COLS_PADDED].max()),
                int(descriptors[GATE::3, W_ROWS].max()), int(descriptors[DOWN::3, W_COLS_PADDED].max()))

    @staticmethod
    def expert_shape(table: np.ndarray) -> tuple[int, int, int]:
        """(K_max, I, padded I) of one expert's rows [3, W_FIELDS]: shape_for's last three."""
        return DecodeScratch.shape_for(table)[2:]

    def holds(self, shape: tuple[int, int, int, int, int]) -> bool:
        """Room for `shape`: as many experts or more, the same D, sizes at least as large (longer
        prepared vectors only add zero padding, which changes no sum)."""
        return shape[1] == self.shape[1] and all(need <= have for need, have in zip(shape, self.shape))


def mixture_decode(descriptors: np.ndarray, x: np.ndarray, coeffs: np.ndarray, n_threads: int, out: np.ndarray,
                   scratch: DecodeScratch) -> None:
    """One token's routed mixture: out [1, D] += sum_e coeffs[e] * expert e (x [1, D] f32), the experts
    described by `descriptors` [3 * Ed, W_FIELDS] in ascending id order, each checked already
    (check_expert_table); `scratch` holds them (DecodeScratch.holds)."""
    n = len(coeffs)
    if descriptors.shape != (3 * n, W_FIELDS) or (descriptors[DOWN::3, W_ROWS] != x.shape[1]).any():
        raise ValueError(f"mixture_decode: {n} coefficients and x of {x.shape[1]} features for a descriptor "
                         f"table {descriptors.shape} whose experts give {descriptors[DOWN::3, W_ROWS].tolist()}")
    s = scratch
    mixture_decode_kernel(descriptors, x, coeffs, n_threads, out, s.x_natural, s.x_pairs, s.x_sums,
                          s.gate_rows[:n], s.up_rows[:n], s.hidden[:n], s.h_natural[:n], s.h_pairs[:n],
                          s.h_sums[:n], s.down_rows)


def expert_mixture(descriptors: np.ndarray, experts: np.ndarray, x: np.ndarray, ids: np.ndarray,
                   weights: np.ndarray, n_threads: int, out: np.ndarray) -> None:
    """out [T, D] += the share of the routed mixture that comes from `experts` [Ed] (ascending ids,
    each used by the route), whose gate, up, down `descriptors` [3 * Ed, W_FIELDS] describes; x [T, D]
    f32, the route ids [T, A] and weights [T, A] f32.

    Calling it for consecutive ascending batches of the route's experts adds every output in the
    same order as one call with all of them, so the result is the same to the bit."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n_tokens, d_model = x.shape
    descriptors = np.ascontiguousarray(descriptors, dtype=np.int64)
    _check(descriptors, d_model)
    experts = np.asarray(experts, dtype=np.int64)
    n_experts = descriptors.shape[0] // 3
    if experts.shape != (n_experts,):
        raise ValueError(f"expert_mixture: {experts.shape[0]} expert ids for a descriptor table of {n_experts} experts")
    if out.shape != (n_tokens, d_model) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"expert_mixture: out must be a C-contiguous float32 [{n_tokens}, {d_model}] array, "
                         f"got {out.dtype} {out.shape}")
    flat_ids = np.asarray(ids, dtype=np.int64).reshape(-1)  # [T * A]
    flat_weights = np.asarray(weights, dtype=np.float32).reshape(-1)
    position = np.minimum(np.searchsorted(experts, flat_ids), n_experts - 1)  # [T * A]: index in `experts`
    in_batch = experts[position] == flat_ids
    if np.bincount(position[in_batch], minlength=n_experts).min() == 0:
        raise ValueError(f"expert_mixture: experts {experts.tolist()} are not all in the route {sorted(set(flat_ids.tolist()))}")
    intermediate = descriptors[GATE::3, W_ROWS]
    k_max = int(descriptors[:, W_COLS_PADDED].max())
    if n_tokens == 1:
        # a token's A ids are distinct (top-k): one weight per expert
        coeffs = np.zeros(n_experts, np.float32)
        coeffs[position[in_batch]] = flat_weights[in_batch]
        scratch = DecodeScratch(*DecodeScratch.shape_for(descriptors))
        mixture_decode(descriptors, x, coeffs, n_threads, out, scratch)
        return
    # the batch's routed (token, weight) pairs grouped by expert, ascending tokens within each
    slots = np.nonzero(in_batch)[0]
    slots = slots[np.argsort(position[slots], kind="stable")]
    tokens = (slots // ids.shape[1]).astype(np.int64)
    coeffs = np.ascontiguousarray(flat_weights[slots])
    offsets = np.zeros(n_experts + 1, np.int64)
    np.cumsum(np.bincount(position[in_batch], minlength=n_experts), out=offsets[1:])
    most = int(np.diff(offsets).max())
    columns = padded_tokens(most)
    h_rows = max(int(descriptors[DOWN::3, W_COLS_PADDED].max()), int(intermediate.max()))
    mixture_prefill_kernel(
        descriptors, x, offsets, tokens, coeffs, n_threads, out,
        np.empty((most, d_model), np.float32), np.empty((k_max, columns), np.float32),
        np.empty((h_rows, columns), np.float32), np.empty((h_rows, columns), np.float32),
        np.empty(quantized_tokens_shape(max(k_max, h_rows), most), np.float32),
        np.empty((n_threads, tile_scratch_rows(most), k_max), np.float32),
        np.empty((n_threads, BLOCK_FLOATS), np.float32))
