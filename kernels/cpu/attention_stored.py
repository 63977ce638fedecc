"""Causal attention over a KV cache as stored: f16 values, or int8 codes with f16 per-group scales
(quant/kv_formats.py). Each f16 row, and each int8 value row, is widened into a per-thread f32 row
of Dh values right before it is used; an int8 key enters its scores as sum over groups of
scale_g * (q . codes_g). Attention thus reads the cache's own bytes (2 or ~1.06 per value instead
of 4) and never builds an f32 copy of the cache.

The work is cut as in kernels/cpu/attention.py: items (token, KV head, split), each serving the
query heads of its KV head's group, partial softmaxes merged exactly by log-sum-exp. The widened
rows equal the numpy dequantization bit for bit (an f16 widens exactly; code * scale is one f32
product in both), so results differ from "dequantize, then the f32 kernel" by f32 rounding only
(summation order, and the int8 key dot's per-group factoring).

T = tokens, S = key positions, Hq / Hkv = query / KV heads, Dh = head dim, G = int8 group size.
"""
from __future__ import annotations

import numpy as np
from numba import prange, types

from kernels.cpu.attention import (decode_split_count, exponentiate_scores, item_scratch, item_span, merge_partials,
                                   scratch_floats)
from kernels.cpu.kv_quant import half_to_single
from kernels.cpu.runtime import helper, kernel, mutable, readonly

STORED_FORMATS = ("f16", "int8")


@helper
def widen_row(halves, codes, scales, group, s, kv_head, row):
    """row [Dh] = the stored row (s, kv_head) as f32: from int8 codes x f16 scales when `codes` has
    rows, else from the f16 bit patterns `halves` (the unused format's arrays are empty)."""
    if codes.shape[0] > 0:
        row_codes, row_scales = codes[s, kv_head], scales[s, kv_head]
        for g in range(row_scales.shape[0]):
            factor = half_to_single(row_scales[g])
            base = g * group
            for j in range(group):
                row[base + j] = np.float32(row_codes[base + j]) * factor
    else:
        row_halves = halves[s, kv_head]
        for d in range(row.shape[0]):
            row[d] = half_to_single(row_halves[d])


@helper
def widen_scales(scales, s, kv_head, out):
    """out[:D/G] = the f16 scales of the int8 row (s, kv_head) as f32."""
    row_scales = scales[s, kv_head]
    for g in range(row_scales.shape[0]):
        out[g] = half_to_single(row_scales[g])


@helper
def int8_dot(q, codes, scales, group):
    """q [Dh] . (codes [Dh] x per-group scales [D/G]): each group's integer-valued dot, then its scale."""
    total = np.float32(0.0)
    for g in range(codes.shape[0] // group):
        base = g * group
        partial = np.float32(0.0)
        for j in range(group):
            partial += q[base + j] * np.float32(codes[base + j])
        total += partial * scales[g]
    return total


def stored_scratch_floats(n_heads: int, n_keys: int, head_dim: int) -> int:
    """Per-thread scratch of an item: the f32 kernel's, whose spare row holds a widened key or value."""
    return scratch_floats(n_heads, n_keys, head_dim)


@helper
def partial_attention_stored(q, key_halves, key_codes, key_scales, value_halves, value_codes, value_scales, group_size,
                             kv_head, s_begin, s_end, k_positions, q_position, window, scale, work):
    """As kernels.cpu.attention.partial_attention, over stored rows: (peaks [G], totals [G],
    accs [G, Dh]) of the query heads q [G, Dh] over keys s_begin..s_end-1 of kv_head."""
    group, head_dim = q.shape
    n = s_end - s_begin
    scores, accs, peaks, totals, rows = item_scratch(work, group, n, head_dim)
    row = rows[0]
    if key_codes.shape[0] > 0:  # int8: per group, scale x (q . codes); no widened key row
        for s in range(n):
            key_index = s_begin + s
            p = k_positions[key_index]
            visible = p <= q_position and (window == 0 or q_position - p < window)
            if visible:
                widen_scales(key_scales, key_index, kv_head, row)
            for g in range(group):
                score = int8_dot(q[g], key_codes[key_index, kv_head], row, group_size) * scale if visible else -np.inf
                scores[g * n + s] = score
                peaks[g] = max(peaks[g], score)
    else:
        for s in range(n):
            key_index = s_begin + s
            p = k_positions[key_index]
            if p <= q_position and (window == 0 or q_position - p < window):
                widen_row(key_halves, key_codes, key_scales, group_size, key_index, kv_head, row)
                for g in range(group):
                    dot = np.float32(0.0)
                    for d in range(head_dim):
                        dot += q[g, d] * row[d]
                    score = dot * scale
                    scores[g * n + s] = score
                    peaks[g] = max(peaks[g], score)
            else:
                for g in range(group):
                    scores[g * n + s] = -np.inf
    exponentiate_scores(scores, peaks, totals, n)
    for s in range(n):
        weighted = False  # masked for every head of the group: no need to widen the value row
        for g in range(group):
            weighted = weighted or scores[g * n + s] != 0.0
        if not weighted:
            continue
        widen_row(value_halves, value_codes, value_scales, group_size, s_begin + s, kv_head, row)
        for g in range(group):
            weight = scores[g * n + s]
            if weight != 0.0:
                acc = accs[g]
                for d in range(head_dim):
                    acc[d] += weight * row[d]
    return peaks, totals, accs


_u16_ro_3d, _i8_ro_3d = readonly(types.uint16, 3), readonly(types.int8, 3)
_i64_ro_1d = readonly(types.int64, 1)
_f32_1d, _f32_2d = mutable(types.float32, 1), mutable(types.float32, 2)


@kernel(types.void(readonly(types.float32, 2), _u16_ro_3d, _i8_ro_3d, _u16_ro_3d, _u16_ro_3d, _i8_ro_3d, _u16_ro_3d,
                   types.int64, _i64_ro_1d, _i64_ro_1d, types.float32, types.int64, types.int64, types.int64,
                   types.int64, types.int64, _f32_2d, _f32_1d, _f32_1d, _f32_2d, _f32_2d),
        parallel=True)
def stored_attention_kernel(q_rows, key_halves, key_codes, key_scales, value_halves, value_codes, value_scales,
                            group_size, q_positions, k_positions, scale, window, n_heads, n_kv, n_splits, n_threads,
                            work, peaks, totals, accs, out):
    """out [T, Hq * Dh] from q_rows [T, Hq * Dh] over stored K/V: f16 bits [S, Hkv, Dh] (codes and
    scales empty) or int8 codes [S, Hkv, Dh] with f16 scale bits [S, Hkv, Dh/G] (halves empty);
    work [n_threads, stored_scratch_floats(Hq, S, Dh)], peaks/totals [T * Hq * n_splits], accs
    [same, Dh]."""
    n_tokens, head_dim = q_rows.shape[0], accs.shape[1]
    group = n_heads // n_kv
    n_items = n_tokens * n_kv * n_splits
    for part in prange(n_threads):
        for item in range(part, n_items, n_threads):
            token, kv_head, q_position, s_begin, s_end, first_row = item_span(item, n_splits, n_heads, n_kv,
                                                                              q_positions, k_positions, window)
            first_head = kv_head * group
            q = q_rows[token, first_head * head_dim:(first_head + group) * head_dim].reshape((group, head_dim))
            group_peaks, group_totals, group_accs = partial_attention_stored(
                q, key_halves, key_codes, key_scales, value_halves, value_codes, value_scales, group_size, kv_head,
                s_begin, s_end, k_positions, q_position, window, scale, work[part])
            for g in range(group):
                row = first_row + g * n_splits
                peaks[row] = group_peaks[g]
                totals[row] = group_totals[g]
                accs[row] = group_accs[g]
    for t in range(n_tokens):
        for h in range(n_heads):
            first = (t * n_heads + h) * n_splits
            merge_partials(peaks[first:first + n_splits], totals[first:first + n_splits],
                           accs[first:first + n_splits], out[t, h * head_dim:(h + 1) * head_dim])


_NO_HALVES = np.empty((0, 0, 0), np.uint16)
_NO_CODES = np.empty((0, 0, 0), np.int8)


def _kernel_arrays(fmt: str, data: np.ndarray, scales: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(halves, codes, scales) as the kernel takes them; views of the cache's arrays, no copy."""
    if fmt == "f16":
        return np.ascontiguousarray(data, dtype=np.float16).view(np.uint16), _NO_CODES, _NO_HALVES
    if fmt == "int8":
        return (_NO_HALVES, np.ascontiguousarray(data, dtype=np.int8),
                np.ascontiguousarray(scales, dtype=np.float16).view(np.uint16))
    raise ValueError(f"stored attention: KV format {fmt!r} is not one of {', '.join(STORED_FORMATS)}")


def stored_attention(q, fmt: str, group: int, keys: np.ndarray, key_scales: np.ndarray | None, values: np.ndarray,
                     value_scales: np.ndarray | None, q_positions, k_positions, scale: float, window: int | None,
                     n_threads: int) -> np.ndarray:
    """Causal attention of q [T, Hq, Dh] over keys/values stored in `fmt`: f16 [S, Hkv, Dh], or int8
    codes [S, Hkv, Dh] with f16 scales [S, Hkv, Dh/group] -> [T, Hq, Dh] float32. A single token's
    keys are split n_threads ways."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    n_tokens, n_heads, head_dim = q.shape
    n_keys, n_kv = keys.shape[0], keys.shape[1]
    if keys.shape != values.shape or keys.shape[2] != head_dim:
        raise ValueError(f"stored attention: keys {list(keys.shape)} and values {list(values.shape)} must both be "
                         f"[S, Hkv, {head_dim}]")
    if n_heads % n_kv:
        raise ValueError(f"stored attention: {n_heads} query heads do not divide into {n_kv} KV heads")
    if fmt == "int8" and (head_dim % group or key_scales.shape != (n_keys, n_kv, head_dim // group)
                          or value_scales.shape != key_scales.shape):
        raise ValueError(f"stored attention: int8 scales {list(key_scales.shape)} / {list(value_scales.shape)} do not "
                         f"match groups of {group} over keys {list(keys.shape)}")
    if len(k_positions) != n_keys:
        raise ValueError(f"stored attention: {len(k_positions)} key positions for {n_keys} stored rows")
    key_arrays = _kernel_arrays(fmt, keys, key_scales)
    value_arrays = _kernel_arrays(fmt, values, value_scales)
    n_splits = decode_split_count(q_positions, k_positions, window) if n_tokens == 1 else 1
    n_rows = n_tokens * n_heads * n_splits
    out = np.empty((n_tokens, n_heads * head_dim), np.float32)
    work = np.empty((n_threads, stored_scratch_floats(n_heads, n_keys, head_dim)), np.float32)
    stored_attention_kernel(q.reshape(n_tokens, n_heads * head_dim), *key_arrays, *value_arrays, int(group),
                            np.ascontiguousarray(q_positions, dtype=np.int64),
                            np.ascontiguousarray(k_positions, dtype=np.int64), np.float32(scale), int(window or 0),
                            n_heads, n_kv, n_splits, n_threads, work, np.empty(n_rows, np.float32),
                            np.empty(n_rows, np.float32), np.empty((n_rows, head_dim), np.float32), out)
    return out.reshape(n_tokens, n_heads, head_dim)
