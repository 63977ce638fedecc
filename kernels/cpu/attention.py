"""Causal attention with grouped KV heads (MHA/GQA/MQA) and an optional sliding window.

Work is cut into items (query head, token, KV split). A token attends to keys whose position is
not after its own (and, with a window W, less than W behind it). Each item computes a partial
softmax over its slice of the keys: its maximum score m, the sum l of exp(score - m), and the
unnormalised output sum(exp(score - m) * v). Prefill uses one split per (head, token); decode
splits the keys of its single token across threads, and the partials merge exactly:

    M = max_i m_i,    out = sum_i exp(m_i - M) acc_i / sum_i exp(m_i - M) l_i

which equals one pass over all keys up to f32 rounding.
"""
from __future__ import annotations

import numpy as np
from numba import prange, types

from kernels.cpu.runtime import helper, kernel, mutable, readonly


@helper
def visible_range(k_positions, q_position, window):
    """[first, last + 1) of the keys this query may see; positions need not be contiguous, the
    per-key test in `partial_attention` decides, this only narrows the scan."""
    first, end = k_positions.shape[0], 0
    for s in range(k_positions.shape[0]):
        p = k_positions[s]
        if p <= q_position and (window == 0 or q_position - p < window):
            if s < first:
                first = s
            end = s + 1
    if end == 0:
        first = 0
    return first, end


@helper
def partial_attention(q, keys, values, kv_head, s_begin, s_end, k_positions, q_position, window, scale,
                      scores, acc):
    """Partial softmax of q [Dh] over keys[s_begin:s_end, kv_head]: returns (m, l), writes acc [Dh]."""
    head_dim = q.shape[0]
    peak = -np.inf
    for s in range(s_end - s_begin):
        key_index = s_begin + s
        p = k_positions[key_index]
        if p <= q_position and (window == 0 or q_position - p < window):
            key = keys[key_index, kv_head]
            dot = np.float32(0.0)
            for d in range(head_dim):
                dot += q[d] * key[d]
            score = dot * scale
            scores[s] = score
            peak = max(peak, score)
        else:
            scores[s] = -np.inf
    for d in range(head_dim):
        acc[d] = 0.0
    total = np.float32(0.0)
    if peak == -np.inf:
        return peak, total
    for s in range(s_end - s_begin):
        if scores[s] != -np.inf:
            weight = np.exp(scores[s] - peak)
            total += weight
            value = values[s_begin + s, kv_head]
            for d in range(head_dim):
                acc[d] += weight * value[d]
    return peak, total


@helper
def merge_partials(peaks, totals, accs, out):
    """out [Dh] = the softmax-weighted sum over all partials (module docstring)."""
    n = peaks.shape[0]
    peak = -np.inf
    for i in range(n):
        peak = max(peak, peaks[i])
    for d in range(out.shape[0]):
        out[d] = 0.0
    denominator = np.float32(0.0)
    for i in range(n):
        if totals[i] > 0.0:
            weight = np.exp(peaks[i] - peak)
            denominator += weight * totals[i]
            for d in range(out.shape[0]):
                out[d] += weight * accs[i, d]
    inverse = np.float32(1.0) / denominator
    for d in range(out.shape[0]):
        out[d] *= inverse


@helper
def attention_item(item, n_splits, q, keys, values, q_positions, k_positions, scale, window, scores,
                   peaks, totals, accs):
    """Item = (token, query head, split) -> its partial, stored at row `item` of peaks/totals/accs."""
    n_heads = q.shape[1]
    group = n_heads // keys.shape[1]  # query heads that share one KV head
    split = item % n_splits
    head = (item // n_splits) % n_heads
    token = item // (n_splits * n_heads)
    q_position = q_positions[token]
    first, end = visible_range(k_positions, q_position, window)
    length = end - first
    s_begin = first + length * split // n_splits
    s_end = first + length * (split + 1) // n_splits
    peaks[item], totals[item] = partial_attention(q[token, head], keys, values, head // group, s_begin, s_end,
                                                  k_positions, q_position, window, scale, scores, accs[item])


# --------------------------------------------------------------------------------------------
# Public kernel (op by op)

_f32_ro_3d = readonly(types.float32, 3)
_i64_ro_1d = readonly(types.int64, 1)
_f32_1d, _f32_2d, _f32_3d = mutable(types.float32, 1), mutable(types.float32, 2), mutable(types.float32, 3)


@kernel(types.void(_f32_ro_3d, _f32_ro_3d, _f32_ro_3d, _i64_ro_1d, _i64_ro_1d, types.float32, types.int64,
                   types.int64, types.int64, _f32_2d, _f32_1d, _f32_1d, _f32_2d, _f32_3d), parallel=True)
def attention_kernel(q, keys, values, q_positions, k_positions, scale, window, n_splits, n_threads, scores,
                     peaks, totals, accs, out):
    """out [T, Hq, Dh]; scores [n_threads, S], peaks/totals [T * Hq * n_splits], accs [same, Dh]."""
    n_tokens, n_heads = q.shape[0], q.shape[1]
    n_items = n_tokens * n_heads * n_splits
    for part in prange(n_threads):
        for item in range(part, n_items, n_threads):
            attention_item(item, n_splits, q, keys, values, q_positions, k_positions, scale, window,
                           scores[part], peaks, totals, accs)
    for t in range(n_tokens):
        for h in range(n_heads):
            first = (t * n_heads + h) * n_splits
            merge_partials(peaks[first:first + n_splits], totals[first:first + n_splits],
                           accs[first:first + n_splits], out[t, h])


def attention(q, k, v, q_positions, k_positions, scale: float, window: int | None, n_threads: int) -> np.ndarray:
    """Causal attention of q [T, Hq, Dh] over k, v [S, Hkv, Dh] -> [T, Hq, Dh] float32."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    k = np.ascontiguousarray(k, dtype=np.float32)
    v = np.ascontiguousarray(v, dtype=np.float32)
    n_tokens, n_heads, head_dim = q.shape
    if n_heads % k.shape[1]:
        raise ValueError(f"attention: {n_heads} query heads do not divide into {k.shape[1]} KV heads")
    n_splits = n_threads if n_tokens == 1 else 1
    n_items = n_tokens * n_heads * n_splits
    out = np.empty_like(q)
    attention_kernel(q, k, v, np.ascontiguousarray(q_positions, dtype=np.int64),
                     np.ascontiguousarray(k_positions, dtype=np.int64), np.float32(scale), int(window or 0),
                     n_splits, n_threads, np.empty((n_threads, max(k.shape[0], 1)), np.float32),
                     np.empty(n_items, np.float32), np.empty(n_items, np.float32),
                     np.empty((n_items, head_dim), np.float32), out)
    return out
