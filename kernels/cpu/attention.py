"""Causal attention with grouped KV heads (MHA/GQA/MQA) and an optional sliding window.

Work is cut into items. Prefill: (token, KV head), an item serving every query head of its KV
head's group, so each key and value is read once for the group. Decode: (KV split), the keys of
its single token cut into decode_splits() pieces by their number alone (never by the thread count,
so that a token's attention has the same bits at any number of threads), an item serving every query head and reading its slice of
the cache front to back, whole rows, a block at a time (`partial_attention_heads`). A token
attends to keys whose position is not after its own (and, with a window W, less than W behind it).
Each item computes, per query head, a partial softmax over its slice of the keys: the maximum
score m, the sum l of exp(score - m), and the unnormalised output sum(exp(score - m) * v); the
partials of a decode token's splits merge exactly:

    M = max_i m_i,    out = sum_i exp(m_i - M) acc_i / sum_i exp(m_i - M) l_i

which equals one pass over all keys up to f32 rounding.
"""
from __future__ import annotations

import numpy as np
from numba import prange, types

from kernels.cpu.elementwise import exp_approx
from kernels.cpu.formats import F16 as K_F16, F32 as K_F32, IR_FORMATS
from kernels.cpu.intrinsics import prefetch_bytes
from kernels.cpu.llvm_attention import make_key_dots, make_weighted_row_sum
from kernels.cpu.runtime import helper, kernel, mutable, readonly


# The cache is read through addresses: keys and values [S, Hkv, Dh] of f32 (element_bytes 4) or
# f16 (element_bytes 2), the layout of the backend's allocate_kv and of an f16 CacheBuffer.

# Tiles of the dot products of query heads with cached keys, (heads, keys) per call: heads * keys
# <= TILE_HEADS, so that a tile's 16-lane accumulators stay in registers beside its key rows on
# 16-register targets (AVX2). A GQA group's heads share each load of a key; MHA's one head shares
# each load of the query between four keys. No software prefetch: the caller requests the rows ahead.
# The value sums take up to TILE_HEADS heads of a group per pass over the value rows.
TILE_HEADS = 4
KEY_TILES = ((4, 1), (3, 1), (2, 2), (2, 1), (1, 4), (1, 1))


def _make_key_scores(fmt):
    tile_4x1, tile_3x1, tile_2x2, tile_2x1, tile_1x4, tile_1x1 = (make_key_dots(fmt, h, k) for h, k in KEY_TILES)

    @helper
    def format_key_scores(keys, row_bytes, head_dim, s_begin, s_end, queries, n_heads, scores, n):
        first = 0
        while first < n_heads:
            heads = min(TILE_HEADS, n_heads - first)
            q, out = queries + 4 * first * head_dim, scores + 4 * first * n
            if heads >= 3:
                for s in range(s_begin, s_end):
                    if heads == 4:
                        tile_4x1(keys, row_bytes, head_dim, s, q, out, n)
                    else:
                        tile_3x1(keys, row_bytes, head_dim, s, q, out, n)
            elif heads == 2:
                paired = s_begin + (s_end - s_begin) // 2 * 2
                for s in range(s_begin, paired, 2):
                    tile_2x2(keys, row_bytes, head_dim, s, q, out, n)
                for s in range(paired, s_end):
                    tile_2x1(keys, row_bytes, head_dim, s, q, out, n)
            else:
                quads = s_begin + (s_end - s_begin) // 4 * 4
                for s in range(s_begin, quads, 4):
                    tile_1x4(keys, row_bytes, head_dim, s, q, out, n)
                for s in range(quads, s_end):
                    tile_1x1(keys, row_bytes, head_dim, s, q, out, n)
            first += heads

    return format_key_scores


half_key_scores, float_key_scores = _make_key_scores(IR_FORMATS[K_F16]), _make_key_scores(IR_FORMATS[K_F32])


@helper
def key_scores(element_bytes, keys, row_bytes, head_dim, s_begin, s_end, queries, n_heads, scores, n):
    """scores[g * n + s] = query g . key row s for g < n_heads and s_begin <= s < s_end: the query
    heads [n_heads, Dh] (f32 at address `queries`) of one KV head's group against its keys (rows
    row_bytes apart from address `keys`); scores f32 rows of n. Bits independent of the tiling
    (llvm_attention.make_key_dots)."""
    if element_bytes == 2:
        half_key_scores(keys, row_bytes, head_dim, s_begin, s_end, queries, n_heads, scores, n)
    else:
        float_key_scores(keys, row_bytes, head_dim, s_begin, s_end, queries, n_heads, scores, n)


def _make_value_sums(half: bool):
    sum_1, sum_2, sum_3, sum_4 = (make_weighted_row_sum(half, h) for h in range(1, TILE_HEADS + 1))

    @helper
    def format_value_sums(values, row_bytes, n_rows, weights, weight_bytes, head_dim, out, out_bytes, n_heads):
        first = 0
        while first < n_heads:
            heads = min(TILE_HEADS, n_heads - first)
            w, o = weights + first * weight_bytes, out + first * out_bytes
            if heads == 4:
                sum_4(values, row_bytes, n_rows, w, weight_bytes, head_dim, o, out_bytes)
            elif heads == 3:
                sum_3(values, row_bytes, n_rows, w, weight_bytes, head_dim, o, out_bytes)
            elif heads == 2:
                sum_2(values, row_bytes, n_rows, w, weight_bytes, head_dim, o, out_bytes)
            else:
                sum_1(values, row_bytes, n_rows, w, weight_bytes, head_dim, o, out_bytes)
            first += heads

    return format_value_sums


half_value_sums, float_value_sums = _make_value_sums(True), _make_value_sums(False)


@helper
def sum_values(element_bytes, values, row_bytes, n_rows, weights, weight_bytes, head_dim, out, out_bytes, n_heads):
    """For g < n_heads: out_g [Dh] = sum over i < n_rows of weights_g[i] * value row i (head g's
    weights at address weights + g * weight_bytes, its out at out + g * out_bytes; the rows
    row_bytes apart from address `values`). Bits independent of the tiling
    (llvm_attention.make_weighted_row_sum)."""
    if element_bytes == 2:
        half_value_sums(values, row_bytes, n_rows, weights, weight_bytes, head_dim, out, out_bytes, n_heads)
    else:
        float_value_sums(values, row_bytes, n_rows, weights, weight_bytes, head_dim, out, out_bytes, n_heads)


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


def scratch_floats(n_heads: int, n_keys: int, head_dim: int) -> int:
    """Floats of per-thread scratch an item needs: scores, accumulators, maxima and sums of up to
    n_heads query heads, one block's value sums of as many, and a decode item's own copy of the
    query heads (decode_query)."""
    return n_heads * (n_keys + 3 * head_dim + 2)


@helper
def decode_query(work, q_width):
    """The last q_width floats of an item's scratch: where a fused decode item keeps the query heads
    it rotates for itself (item_scratch uses the front, up to the keys the item reads)."""
    return work[work.shape[0] - q_width:]


# Keys a decode item takes at a time: their K rows (then V rows), every KV head's, are read once
# and used for every query head while they are in L1/L2 (32 rows of SmolLM2's 3 x 64 floats are
# 24 KiB).
ROWS_PER_BLOCK = 32
# The cache comes from memory (the weights streamed since its last use evict it), and requesting
# only the next block left too few misses in flight: an item requests up to AHEAD_BYTES of its keys
# and as many of its values at its start, then the next block as it goes. The bound keeps the
# requests within L2 beside the weights' own.
AHEAD_BYTES = 64 * 1024


@helper
def item_scratch(work, n_heads, n, head_dim):
    """Views of an item's per-thread scratch (>= scratch_floats(n_heads, n, Dh) floats): scores
    [n_heads * n], accumulators [n_heads, Dh] zeroed, peaks [n_heads] at -inf, totals [n_heads] at
    0, and rows [n_heads, Dh]."""
    scores = work[:n_heads * n]
    accs = work[n_heads * n:n_heads * (n + head_dim)].reshape((n_heads, head_dim))
    peaks = work[n_heads * (n + head_dim):n_heads * (n + head_dim + 1)]
    totals = work[n_heads * (n + head_dim + 1):n_heads * (n + head_dim + 2)]
    rows = work[n_heads * (n + head_dim + 2):n_heads * (n + 2 * head_dim + 2)].reshape((n_heads, head_dim))
    accs[:] = 0.0
    peaks[:] = -np.inf
    totals[:] = 0.0
    return scores, accs, peaks, totals, rows


@helper
def scale_and_mask(scores, n, positions, q_position, window, scale, peaks):
    """In place: each query head's n scores (rows of `scores`, one per entry of peaks) times `scale`,
    -inf for a key the query may not see (after it, or a window or more behind); peaks [G] their
    maxima. Vectorised: no branch per key."""
    for g in range(peaks.shape[0]):
        row = scores[g * n:(g + 1) * n]
        peak = np.float32(-np.inf)
        for s in range(n):
            p = positions[s]
            visible = p <= q_position and (window == 0 or q_position - p < window)
            score = row[s] * scale if visible else np.float32(-np.inf)
            row[s] = score
            peak = max(peak, score)
        peaks[g] = peak


@helper
def exponentiate_scores(scores, peaks, totals, n):
    """In place: each query head's n scores (rows of `scores`) become exp(score - peak), masked
    ones (-inf) 0, and totals [G] their sums (0 for a head that sees none of the keys)."""
    for g in range(peaks.shape[0]):
        row = scores[g * n:(g + 1) * n]
        if peaks[g] == -np.inf:
            row[:] = 0.0
            totals[g] = 0.0
            continue
        peak = peaks[g]
        total = np.float32(0.0)
        for s in range(n):  # vectorised: exp_approx is plain arithmetic
            weight = exp_approx(row[s] - peak) if row[s] != -np.inf else np.float32(0.0)
            row[s] = weight
            total += weight
        totals[g] = total


@helper
def partial_attention(q, keys, values, n_kv, element_bytes, kv_head, s_begin, s_end, k_positions, q_position, window,
                      scale, work):
    """Partial softmax of the query heads q [G, Dh] (one KV head's group) over keys[s_begin:s_end,
    kv_head] (the cache's addresses). Returns (peaks [G] = m, totals [G] = l, accs [G, Dh]), all
    views of `work` (per-thread scratch, >= scratch_floats(G, n, Dh)).

    The dot products with the keys and the weighted sum of the values run in hand-written vector
    loops (llvm_ir.py) straight over the cache rows, one KV head's rows Hkv * Dh floats apart."""
    group, head_dim = q.shape
    n = s_end - s_begin
    scores, accs, peaks, totals, _ = item_scratch(work, group, n, head_dim)
    row_bytes = element_bytes * n_kv * head_dim
    first_row = element_bytes * (s_begin * n_kv + kv_head) * head_dim
    first_key, first_value = keys + first_row, values + first_row
    key_scores(element_bytes, first_key, row_bytes, head_dim, 0, n, q.ctypes.data, group, scores.ctypes.data, n)
    scale_and_mask(scores, n, k_positions[s_begin:s_end], q_position, window, scale, peaks)
    exponentiate_scores(scores, peaks, totals, n)
    sum_values(element_bytes, first_value, row_bytes, n, scores.ctypes.data, 4 * n, head_dim, accs.ctypes.data,
               4 * head_dim, group)
    return peaks, totals, accs


@helper
def prefetch_share(first_key, first_value, row_bytes, n, next_row, share, n_shares):
    """Request share `share` of n_shares of the next block's rows: rows [next_row, next_row +
    ROWS_PER_BLOCK) of the item's keys then values, read as one sequence of 2n rows (the values
    follow the keys). Spread over a block's query heads, the requests overlap the arithmetic
    instead of waiting in one burst; they repeat the start's requests for rows it covered (the
    memory system may drop a request while too many are in flight)."""
    begin = min(next_row + ROWS_PER_BLOCK * share // n_shares, 2 * n)
    end = min(next_row + ROWS_PER_BLOCK * (share + 1) // n_shares, 2 * n)
    if begin < n:
        prefetch_bytes(first_key + begin * row_bytes, (min(end, n) - begin) * row_bytes)
    if end > n:
        first = max(begin, n)
        prefetch_bytes(first_value + (first - n) * row_bytes, (end - first) * row_bytes)


@helper
def partial_attention_heads(q, keys, values, n_kv, element_bytes, s_begin, s_end, k_positions, q_position, window,
                            scale, work):
    """Partial softmax of every query head q [Hq, Dh] over keys[s_begin:s_end] of all KV heads (a
    decode token's slice of the cache, given by its addresses). Returns (peaks [Hq], totals [Hq],
    accs [Hq, Dh]), views of `work` (>= scratch_floats(Hq, n, Dh)).

    The keys are taken ROWS_PER_BLOCK at a time and each block serves all query heads, so the cache
    is read front to back once for the scores and once for the values, whole rows in order (one KV
    head's slice of a row at a time would read the cache once per KV head, in strided pieces)."""
    n_heads, head_dim = q.shape
    group = n_heads // n_kv
    n = s_end - s_begin
    scores, accs, peaks, totals, block_sums = item_scratch(work, n_heads, n, head_dim)
    row_bytes = element_bytes * n_kv * head_dim
    first_key = keys + s_begin * row_bytes
    first_value = values + s_begin * row_bytes
    ahead = max(ROWS_PER_BLOCK, AHEAD_BYTES // row_bytes)  # rows requested at the start
    prefetch_bytes(first_key, min(n, ahead) * row_bytes)
    prefetch_bytes(first_value, min(n, ahead) * row_bytes)
    for b_begin in range(0, n, ROWS_PER_BLOCK):
        b_end = min(b_begin + ROWS_PER_BLOCK, n)
        for kv_head in range(n_kv):  # the group's query heads share each load of a key
            first_head = kv_head * group
            for h in range(first_head, first_head + group):
                prefetch_share(first_key, first_value, row_bytes, n, b_end, h, n_heads)
            key_scores(element_bytes, first_key + element_bytes * kv_head * head_dim, row_bytes, head_dim, b_begin,
                       b_end, q[first_head].ctypes.data, group, scores[first_head * n:].ctypes.data, n)
    scale_and_mask(scores, n, k_positions[s_begin:s_end], q_position, window, scale, peaks)
    exponentiate_scores(scores, peaks, totals, n)
    for b_begin in range(0, n, ROWS_PER_BLOCK):
        b_end = min(b_begin + ROWS_PER_BLOCK, n)
        for kv_head in range(n_kv):  # the group's query heads share each load of a value
            first_head = kv_head * group
            for h in range(first_head, first_head + group):
                prefetch_share(first_key, first_value, row_bytes, n, n + b_end, h, n_heads)
            sum_values(element_bytes, first_value + b_begin * row_bytes + element_bytes * kv_head * head_dim,
                       row_bytes, b_end - b_begin, scores[first_head * n + b_begin:].ctypes.data, 4 * n, head_dim,
                       block_sums.ctypes.data, 4 * head_dim, group)
            for g in range(group):
                for d in range(head_dim):
                    accs[first_head + g, d] += block_sums[g, d]
    return peaks, totals, accs


# A decode token's visible keys are cut into one split per DECODE_SPLIT_KEYS (at most
# MAX_DECODE_SPLITS: tasks enough for a laptop's threads; the merge stays a few vector ops per head).
DECODE_SPLIT_KEYS = 64
MAX_DECODE_SPLITS = 16


@helper
def decode_splits(n_keys, window):
    """The number of splits of a decode token at cache index n_keys - 1 (keys before it visible,
    the last `window` of them where window > 0)."""
    visible = n_keys if window == 0 else min(n_keys, window)
    return min(MAX_DECODE_SPLITS, max(1, (visible + DECODE_SPLIT_KEYS - 1) // DECODE_SPLIT_KEYS))


@helper
def decode_attention_item(split, n_splits, n_heads, q_rows, keys, values, n_kv, element_bytes, q_position, k_positions,
                          scale, window, work, peaks, totals, accs):
    """A decode token's KV split -> the partials of every query head, stored at rows
    h * n_splits + split of peaks/totals/accs. q_rows: [1, Hq * Dh]; work: per-thread scratch of
    scratch_floats(Hq, S, Dh) floats."""
    head_dim = accs.shape[1]
    first, end = visible_range(k_positions, q_position, window)
    length = end - first
    s_begin = first + length * split // n_splits
    s_end = first + length * (split + 1) // n_splits
    q = q_rows[0, :n_heads * head_dim].reshape((n_heads, head_dim))
    head_peaks, head_totals, head_accs = partial_attention_heads(q, keys, values, n_kv, element_bytes, s_begin, s_end,
                                                                 k_positions, q_position, window, scale, work)
    for h in range(n_heads):
        row = h * n_splits + split
        peaks[row] = head_peaks[h]
        totals[row] = head_totals[h]
        accs[row] = head_accs[h]


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
            weight = exp_approx(peaks[i] - peak)
            denominator += weight * totals[i]
            for d in range(out.shape[0]):
                out[d] += weight * accs[i, d]
    inverse = np.float32(1.0) / denominator
    for d in range(out.shape[0]):
        out[d] *= inverse


@helper
def item_span(item, n_splits, n_heads, n_kv, q_positions, k_positions, window):
    """Item = (token, KV head, split) -> (token, kv_head, q_position, [s_begin, s_end) its keys, and
    first_row: its first query head's row (token * Hq + h) * n_splits + split of the partials; the
    group's heads follow every n_splits rows)."""
    group = n_heads // n_kv
    split = item % n_splits
    kv_head = (item // n_splits) % n_kv
    token = item // (n_splits * n_kv)
    q_position = q_positions[token]
    first, end = visible_range(k_positions, q_position, window)
    length = end - first
    s_begin = first + length * split // n_splits
    s_end = first + length * (split + 1) // n_splits
    first_row = (token * n_heads + kv_head * group) * n_splits + split
    return token, kv_head, q_position, s_begin, s_end, first_row


@helper
def attention_item(item, n_splits, n_heads, n_kv, q_rows, keys, values, element_bytes, q_positions, k_positions, scale,
                   window, work, peaks, totals, accs):
    """Item = (token, KV head, split) -> the partials of its query heads, stored at rows
    ((token * Hq + h) * n_splits + split) of peaks/totals/accs. q_rows: [T, Hq * Dh]; keys, values:
    the cache's addresses; work: per-thread scratch of scratch_floats(Hq, S, Dh) floats."""
    head_dim = accs.shape[1]
    group = n_heads // n_kv  # query heads that share one KV head
    token, kv_head, q_position, s_begin, s_end, first_row = item_span(item, n_splits, n_heads, n_kv, q_positions,
                                                                      k_positions, window)
    first_head = kv_head * group
    q = q_rows[token, first_head * head_dim:(first_head + group) * head_dim].reshape((group, head_dim))
    group_peaks, group_totals, group_accs = partial_attention(q, keys, values, n_kv, element_bytes, kv_head, s_begin,
                                                              s_end, k_positions, q_position, window, scale, work)
    for g in range(group):
        row = first_row + g * n_splits
        peaks[row] = group_peaks[g]
        totals[row] = group_totals[g]
        accs[row] = group_accs[g]


# --------------------------------------------------------------------------------------------
# Public kernel (op by op)

_f32_ro_3d = readonly(types.float32, 3)
_i64_ro_1d = readonly(types.int64, 1)
_f32_1d, _f32_2d, _f32_3d = mutable(types.float32, 1), mutable(types.float32, 2), mutable(types.float32, 3)


@kernel(types.void(readonly(types.float32, 2), _f32_ro_3d, _f32_ro_3d, _i64_ro_1d, _i64_ro_1d, types.float32,
                   types.int64, types.int64, types.int64, types.int64, _f32_2d, _f32_1d, _f32_1d, _f32_2d, _f32_2d),
        parallel=True)
def attention_kernel(q_rows, keys, values, q_positions, k_positions, scale, window, n_heads, n_splits, n_threads,
                     scores, peaks, totals, accs, out):
    """out [T, Hq * Dh] from q_rows [T, Hq * Dh]; scores [n_threads, scratch_floats(Hq, S, Dh)]
    scratch, peaks/totals [T * Hq * n_splits], accs [same, Dh]."""
    n_tokens, n_kv, head_dim = q_rows.shape[0], keys.shape[1], keys.shape[2]
    if n_tokens == 1:  # decode: one item per KV split, every head
        for part in prange(n_threads):
            for split in range(part, n_splits, n_threads):
                decode_attention_item(split, n_splits, n_heads, q_rows, keys.ctypes.data, values.ctypes.data, n_kv, 4,
                                      q_positions[0], k_positions, scale, window, scores[part], peaks, totals, accs)
    else:
        n_items = n_tokens * n_kv * n_splits
        for part in prange(n_threads):
            for item in range(part, n_items, n_threads):
                attention_item(item, n_splits, n_heads, n_kv, q_rows, keys.ctypes.data, values.ctypes.data, 4,
                               q_positions, k_positions, scale, window, scores[part], peaks, totals, accs)
    for t in range(n_tokens):
        for h in range(n_heads):
            first = (t * n_heads + h) * n_splits
            merge_partials(peaks[first:first + n_splits], totals[first:first + n_splits],
                           accs[first:first + n_splits], out[t, h * head_dim:(h + 1) * head_dim])


def attention(q, k, v, q_positions, k_positions, scale: float, window: int | None, n_threads: int) -> np.ndarray:
    """Causal attention of q [T, Hq, Dh] over k, v [S, Hkv, Dh] -> [T, Hq, Dh] float32; a single
    token's keys are cut into decode_splits() pieces."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    k = np.ascontiguousarray(k, dtype=np.float32)
    v = np.ascontiguousarray(v, dtype=np.float32)
    n_tokens, n_heads, head_dim = q.shape
    if n_heads % k.shape[1]:
        raise ValueError(f"attention: {n_heads} query heads do not divide into {k.shape[1]} KV heads")
    n_splits = decode_split_count(q_positions, k_positions, window) if n_tokens == 1 else 1
    n_rows = n_tokens * n_heads * n_splits
    out = np.empty((n_tokens, n_heads * head_dim), np.float32)
    work = np.empty((n_threads, scratch_floats(n_heads, k.shape[0], head_dim)), np.float32)
    attention_kernel(q.reshape(n_tokens, n_heads * head_dim), k, v, np.ascontiguousarray(q_positions, dtype=np.int64),
                     np.ascontiguousarray(k_positions, dtype=np.int64), np.float32(scale), int(window or 0), n_heads,
                     n_splits, n_threads, work, np.empty(n_rows, np.float32), np.empty(n_rows, np.float32),
                     np.empty((n_rows, head_dim), np.float32), out)
    return out.reshape(n_tokens, n_heads, head_dim)


def decode_split_count(q_positions, k_positions, window) -> int:
    """decode_splits() of a single query over these key positions (the op-by-op kernels' keys need
    not be contiguous: the count of those visible decides)."""
    q = int(np.asarray(q_positions).reshape(-1)[0])
    k = np.asarray(k_positions)
    visible = int(np.count_nonzero((k <= q) & ((q - k < window) if window else True)))
    return decode_splits(visible, 0)


# --------------------------------------------------------------------------------------------
# Per-head products (MLA's absorbed form: queries into latent space, latent averages back out)

@kernel(types.void(readonly(types.float32, 3), _f32_ro_3d, _f32_3d), parallel=True)
def head_matmul_kernel(x, w, out):
    """out [T, H, N] = x [T, H, K] times w [H, N, K] transposed, per head."""
    n_tokens, n_heads, n_out = out.shape
    for item in prange(n_heads * n_out):
        h = item // n_out
        n = item % n_out
        row = w[h, n]
        for t in range(n_tokens):
            total = np.float32(0.0)
            for k in range(row.shape[0]):
                total += x[t, h, k] * row[k]
            out[t, h, n] = total


def head_matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    w = np.ascontiguousarray(w, dtype=np.float32)
    if x.shape[1] != w.shape[0] or x.shape[2] != w.shape[2]:
        raise ValueError(f"head_matmul: x {list(x.shape)} does not match w {list(w.shape)} ([T, H, K] and [H, N, K])")
    out = np.empty((x.shape[0], x.shape[1], w.shape[1]), np.float32)
    head_matmul_kernel(x, w, out)
    return out
