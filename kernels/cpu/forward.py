"""The fused decoder forward: embedding -> layers -> final norm -> LM head in one compiled call.

T = tokens in this call, D = hidden size, Hq / Hkv = query / key-value heads, Dh = head dim,
I = intermediate size, V = vocabulary, P = threads.

Python is not in the loop: one call runs layers [first, last) (all of them, or one at a time when
an observer wants the hidden state between layers) and the embedding / LM head when asked.

Scheduling. A call is a fixed list of steps (STEPS below, per layer, then the head). A step is
either serial (norms, RoPE and the cache write, merging attention partials: O(T * D) work, one
task) or parallel (transposing the input for prefill, projections cut into row ranges, attention
items): a number of independent tasks. In decode the serial steps that only prepare the next
projection's input (norms, the attention merge, the down projection's input) are replicated:
every thread does that microsecond of work into its own buffers rather than wait for one thread
to do it and hand it over, which saves a barrier each (int8 SmolLM2, 2 threads: decode 163 -> 172
tok/s, `zllm-edge bench`, alternating runs); decode's RoPE and cache write happen inside the
attention step, each KV split rotating the query heads for itself. All P threads enter one parallel region and walk the
steps together; in each step a thread takes the next task number from the step's atomic counter
until none is left, and a step starts only when every task of the previous one has finished.
Nothing assigns work to a particular thread, so
  - there is one parallel region per call, not one per projection (~150 per token would each
    pay a thread wake-up), and the threads meet only at the task counters;
  - a thread the OS takes away simply takes fewer tasks: on a busy machine the others carry on,
    instead of waiting at a fixed partition (with OpenMP's spinning that made 2 threads slower
    than 1);
  - it cannot deadlock if the runtime starts the threads late or one after another: whoever runs
    takes all the tasks, and a late thread finds the counters spent and returns.

Weights arrive as descriptor rows (formats.py); norm gains and biases as offsets into one f32
`params` array; the KV cache as a (keys, values) address pair per layer, each buffer laid out
[capacity, Hkv, Dh] as the backend's `allocate_kv` (f32) or an f16 CacheBuffer made it.
"""
from __future__ import annotations

import numba
from numba import prange, types

from kernels.cpu.attention import attention_item, decode_attention_item, decode_query, decode_splits, merge_partials
from kernels.cpu.elementwise import embed_row, gelu_tanh_times_in_place, rms_norm_row, rope_row, silu_times_in_place
from kernels.cpu.formats import W_ACTIVATIONS, W_COLS_PADDED, W_PREFILL_INT8, W_ROWS
from kernels.cpu.intrinsics import (atomic_add, atomic_load, float32_pointer, half_bits, monotonic_seconds,
                                    sleep_microseconds, spin_pause, uint16_pointer)
from kernels.cpu.linear import (CHUNK, MATVEC_BLOCK, TILE_ROWS, gemm_rows, matvec_rows, padded_tokens_in_kernel,
                                prefetch_matvec_head, prepare_vector, quantize_tokens, quantized_capacity,
                                transpose_tokens)
from kernels.cpu.runtime import helper, kernel, mutable, readonly

# Columns of the layer table. Weights are row indices into the descriptor table; norms and biases
# are offsets into `params` (NO_PARAM: absent).
(L_INPUT_NORM, L_Q, L_K, L_V, L_O, L_Q_BIAS, L_K_BIAS, L_V_BIAS, L_O_BIAS, L_Q_NORM, L_K_NORM,
 L_POST_NORM, L_GATE, L_UP, L_DOWN, L_GATE_BIAS, L_UP_BIAS, L_DOWN_BIAS, L_WINDOW, L_ROUTER, L_ROUTER_BIAS,
 L_ATTN_OUT_NORM, L_FFN_OUT_NORM, L_ACTIVATION, L_ROPE_TABLE) = range(25)
LAYER_FIELDS = 25
NO_PARAM = -1
# Gemma's layers: the attention's and the feed-forward's outputs go through their own norm (L_ATTN_OUT_NORM,
# L_FFN_OUT_NORM) before the residual add, the feed-forward gates with GELU-tanh (L_ACTIVATION), and
# sliding layers rotate by a table of their own (L_ROPE_TABLE: which block of cos/sin rows, 0 or 1).
SILU, GELU_TANH = 0, 1
# A Mixture-of-Experts layer has a router (L_ROUTER) instead of gate/up/down: its call ends with the
# router logits [T, E] of the post-attention norm's output (in the gate/up step), and the caller
# routes, mixes the experts and adds them to the residual stream before the next layer runs. So a
# MoE layer is always the last layer of a call.

# Entries of the model vector `dims`.
(M_HIDDEN, M_HEADS, M_KV_HEADS, M_HEAD_DIM, M_INTERMEDIATE, M_VOCAB, M_EMBED, M_LM_HEAD, M_FINAL_NORM,
 M_LAYERS, M_KV_BYTES, M_EMBED_SCALE) = range(12)
MODEL_FIELDS = 12  # M_KV_BYTES: bytes of a cached K/V element, 4 (f32) or 2 (f16); M_EMBED_SCALE: a param or NO_PARAM

# Steps of one layer (each is one serial task or a set of parallel tasks; 0 tasks = skipped).
(S_INPUT_NORM, S_INPUT_T, S_QKV, S_ROPE, S_ATTEND, S_MERGE, S_ATTN_T, S_O, S_ATTN_OUT_NORM, S_POST_NORM, S_POST_T,
 S_GATE_UP, S_DOWN_INPUT, S_DOWN, S_FFN_OUT_NORM) = range(15)
LAYER_STEPS = 15
# (A layer with output norms writes its o and down projections into `branch`; the serial S_ATTN_OUT_NORM
# and S_FFN_OUT_NORM steps normalise it and add it to the residual stream. Other layers skip both.)
# (Prefill writes gate/up transposed, [I, T]: silu(gate) * up is then already the down
# projection's transposed input, so the down projection needs no transpose step.)
# Steps before and after the layers.
S_EMBED, S_FINAL_NORM, S_HEAD_T, S_HEAD = 100, 101, 102, 103
HEAD_STEPS = 3  # S_FINAL_NORM, S_HEAD_T, S_HEAD
# Step kinds. A REPLICATED step is a decode step's small serial work that every thread does for
# itself (norm, merge, preparing the next projection's input vector into its own buffers), so that
# no thread waits for another to hand it over: one barrier less per such step.
SERIAL, TRANSPOSE, PROJECT, ATTEND, REPLICATED = range(5)

# Task sizes. Prefill: one tile of rows per projection task, and no more than TASKS_PER_THREAD
# attention tasks per thread (causal rows differ in length; many tasks balance them). Decode: one
# projection task per thread (DECODE_TASKS_PER_THREAD), of at least 64 rows. Tasks are still taken
# from a counter, so a thread the OS delays before it starts leaves its task to the others; but
# smaller tasks cost more than they balance: on SmolLM2-135M int4 (Zen 4, quiet machine,
# benchmarks/cpu_profile.py), decode took 6.29 ms per token at 2 threads with 8 tasks per thread,
# 5.46 with 2 and 4.98 with 1 (1 thread: 7.48 with 8 tasks, 6.72 with 1).
DECODE_MIN_ROWS_PER_TASK = 64
DECODE_TASKS_PER_THREAD = 1
TASKS_PER_THREAD = 8
PREFILL_ROWS_PER_TASK = TILE_ROWS
# Counters of a step: the next task to take and the tasks finished, each on its own cache line
# (threads take tasks while others report finishing them).
SYNC_STRIDE = 16
NEXT, DONE = 0, 8
# Waiting for a step to finish: spin (decode's steps take microseconds), then nap, which hands the
# core to the thread being waited for when both share one (a busy machine). Measured here: one
# `pause` is ~49 ns on Zen 4, so 4000 spins are ~200 us (longer than a prefill task); usleep(1)
# returns after ~65 us (timer slack).
SPINS_BEFORE_SLEEP = 4000
NAP_MICROSECONDS = 1


@helper
def param(params, offset, length):
    return params[offset:offset + length]


@helper
def ceil_div(a, b):
    return -(-a // b)


@helper
def step_of(index, first, last, run_embedding):
    """(layer or -1, step) of the index-th step of this call."""
    if run_embedding:
        if index == 0:
            return -1, S_EMBED
        index -= 1
    n_layer_steps = (last - first) * LAYER_STEPS
    if index < n_layer_steps:
        return first + index // LAYER_STEPS, index % LAYER_STEPS
    return -1, S_FINAL_NORM + (index - n_layer_steps)


@helper
def is_moe(spec):
    return spec[L_ROUTER] != NO_PARAM


@helper
def ffn_input_weight(spec):
    """The weight whose input the post-attention norm prepares: gate (dense) or router (MoE)."""
    return spec[L_ROUTER] if is_moe(spec) else spec[L_GATE]


@helper
def projection_rows(step, spec, weights, dims):
    """Rows of the concatenated output space of a PROJECT step (q|k|v, gate rows, ...)."""
    if step == S_QKV:
        return weights[spec[L_Q], W_ROWS] + weights[spec[L_K], W_ROWS] + weights[spec[L_V], W_ROWS]
    if step == S_O:
        return weights[spec[L_O], W_ROWS]
    if step == S_GATE_UP:
        return weights[ffn_input_weight(spec), W_ROWS]
    if step == S_DOWN:
        return weights[spec[L_DOWN], W_ROWS]
    return weights[dims[M_LM_HEAD], W_ROWS]  # S_HEAD


@helper
def plan(step, spec, weights, dims, start, n_tokens, n_out, n_threads, run_head):
    """(kind, number of tasks) of a step. Every thread computes this for itself."""
    prefill = n_tokens > 1
    if step == S_EMBED:
        return SERIAL, 1
    if step == S_ROPE:  # decode does it within the attention step (run_task)
        return SERIAL, 1 if prefill else 0
    if step == S_ATTN_OUT_NORM:
        return SERIAL, 1 if spec[L_ATTN_OUT_NORM] != NO_PARAM else 0
    if step == S_FFN_OUT_NORM:
        return SERIAL, 1 if spec[L_FFN_OUT_NORM] != NO_PARAM and not is_moe(spec) else 0
    if step == S_INPUT_NORM or step == S_MERGE or step == S_POST_NORM:
        return (SERIAL if prefill else REPLICATED), 1
    if step == S_DOWN_INPUT:  # decode prepares the down projection's input vector; prefill quantizes it for
        if is_moe(spec):      # integer panels (gate/up left it transposed)
            return REPLICATED, 0
        if prefill:
            return TRANSPOSE, n_threads if reads_int8_tokens(step, spec, weights, dims) else 0
        return REPLICATED, 1
    if step == S_FINAL_NORM:  # a one-row LM head (decode, or prefill's last token) reads a prepared vector
        return (SERIAL if n_out > 1 else REPLICATED), 1 if run_head else 0
    if step == S_INPUT_T or step == S_ATTN_T or step == S_POST_T:
        return TRANSPOSE, n_threads if prefill else 0
    if step == S_HEAD_T:
        return TRANSPOSE, n_threads if run_head and n_out > 1 else 0
    if step == S_ATTEND:
        if prefill:
            return ATTEND, min(n_tokens * dims[M_KV_HEADS], TASKS_PER_THREAD * n_threads)
        return ATTEND, decode_splits(start + 1, spec[L_WINDOW])  # decode: one task per KV split, every head
    if step == S_QKV or step == S_O or step == S_GATE_UP or step == S_DOWN or step == S_HEAD:
        if (step == S_HEAD and not run_head) or (step == S_DOWN and is_moe(spec)):
            return PROJECT, 0
        tokens = n_out if step == S_HEAD else n_tokens
        rows = projection_rows(step, spec, weights, dims)
        return PROJECT, ceil_div(rows, rows_per_task(rows, tokens, n_threads))
    return SERIAL, 0  # not a step


@helper
def rows_per_task(rows, n_tokens, n_threads):
    if n_tokens > 1:
        return PREFILL_ROWS_PER_TASK
    per_task = max(DECODE_MIN_ROWS_PER_TASK, ceil_div(rows, DECODE_TASKS_PER_THREAD * n_threads))
    return ceil_div(per_task, MATVEC_BLOCK) * MATVEC_BLOCK


@helper
def projection_after(step):
    """The PROJECT step a decode REPLICATED step prepares the input of."""
    if step == S_INPUT_NORM:
        return S_QKV
    if step == S_MERGE:
        return S_O
    if step == S_POST_NORM:
        return S_GATE_UP
    if step == S_DOWN_INPUT:
        return S_DOWN
    return S_HEAD  # S_FINAL_NORM


@helper
def request_projection_head(step, spec, weights, dims, n_threads, thread):
    """Request the first rows of the decode PROJECT step `step` that this thread's task reads (a
    thread usually takes the task of its own index), while the replicated step before it runs."""
    rows = projection_rows(step, spec, weights, dims)
    per_task = rows_per_task(rows, 1, n_threads)
    begin = min(thread * per_task, rows)
    end = min(begin + per_task, rows)
    if step == S_QKV:  # the first of q | k | v the rows reach
        offset = 0
        for w_index in (spec[L_Q], spec[L_K], spec[L_V]):
            n = weights[w_index, W_ROWS]
            if begin < offset + n:
                prefetch_matvec_head(weights[w_index], begin - offset, min(end - offset, n))
                return
            offset += n
    elif step == S_O:
        prefetch_matvec_head(weights[spec[L_O]], begin, end)
    elif step == S_GATE_UP and not is_moe(spec):
        prefetch_matvec_head(weights[spec[L_GATE]], begin, end)
        prefetch_matvec_head(weights[spec[L_UP]], begin, end)
    elif step == S_DOWN:
        prefetch_matvec_head(weights[spec[L_DOWN]], begin, end)
    elif step == S_HEAD:
        prefetch_matvec_head(weights[dims[M_LM_HEAD]], begin, end)


@helper
def transpose_input(step, spec, weights, dims):
    """Input (0: normed, 1: attn, 2: gate_t, transposed already) and K_padded (rows of xt to fill) of
    the projection after a TRANSPOSE step."""
    if step == S_INPUT_T:
        k = max(weights[spec[L_Q], W_COLS_PADDED], weights[spec[L_K], W_COLS_PADDED], weights[spec[L_V], W_COLS_PADDED])
        return 0, k
    if step == S_ATTN_T:
        return 1, weights[spec[L_O], W_COLS_PADDED]
    if step == S_POST_T:
        if is_moe(spec):
            return 0, weights[spec[L_ROUTER], W_COLS_PADDED]
        return 0, max(weights[spec[L_GATE], W_COLS_PADDED], weights[spec[L_UP], W_COLS_PADDED])
    if step == S_DOWN_INPUT:
        return 2, weights[spec[L_DOWN], W_COLS_PADDED]
    return 0, weights[dims[M_LM_HEAD], W_COLS_PADDED]  # S_HEAD_T


@helper
def reads_int8_tokens(step, spec, weights, dims):
    """Whether a weight of the projection after TRANSPOSE step `step` multiplies int8-quantized
    tokens (integer panels, W_PREFILL_INT8): that step then quantizes what it transposes, once for
    every task of the projection."""
    if step == S_INPUT_T:
        return (weights[spec[L_Q], W_PREFILL_INT8] + weights[spec[L_K], W_PREFILL_INT8]
                + weights[spec[L_V], W_PREFILL_INT8]) > 0
    if step == S_ATTN_T:
        return weights[spec[L_O], W_PREFILL_INT8] > 0
    if step == S_POST_T:
        if is_moe(spec):
            return weights[spec[L_ROUTER], W_PREFILL_INT8] > 0
        return weights[spec[L_GATE], W_PREFILL_INT8] + weights[spec[L_UP], W_PREFILL_INT8] > 0
    if step == S_DOWN_INPUT:
        return weights[spec[L_DOWN], W_PREFILL_INT8] > 0
    return weights[dims[M_LM_HEAD], W_PREFILL_INT8] > 0  # S_HEAD_T


@helper
def store_kv_row(cache, element_bytes, offset, row):
    """cache[offset:offset + len(row)] = row, at the cache's address: f32, or f16 rounded to nearest even."""
    if element_bytes == 2:
        halves = numba.carray(uint16_pointer(cache), (offset + row.shape[0],))
        for i in range(row.shape[0]):
            halves[offset + i] = half_bits(row[i])
    else:
        floats = numba.carray(float32_pointer(cache), (offset + row.shape[0],))
        for i in range(row.shape[0]):
            floats[offset + i] = row[i]


@helper
def norm_and_rope_heads(row, first_head, end_head, n_heads, spec, params, eps, head_dim, cos, sin):
    """In place on a token's q|k|v row: heads [first_head, end_head) of its n_heads query heads and
    then KV heads get their per-head norm (q_norm / k_norm, Qwen3), then the rotary embedding."""
    for h in range(first_head, end_head):
        head = row[h * head_dim:(h + 1) * head_dim]
        if h < n_heads and spec[L_Q_NORM] != NO_PARAM:
            rms_norm_row(head, param(params, spec[L_Q_NORM], head_dim), eps, head)
        elif h >= n_heads and spec[L_K_NORM] != NO_PARAM:
            rms_norm_row(head, param(params, spec[L_K_NORM], head_dim), eps, head)
        rope_row(head, cos, sin)


@helper
def write_kv(row, keys, values, kv_bytes, position, q_width, kv_width):
    """A token's key and value (from its q|k|v row) into the cache at `position`."""
    store_kv_row(keys, kv_bytes, position * kv_width, row[q_width:q_width + kv_width])
    store_kv_row(values, kv_bytes, position * kv_width, row[q_width + kv_width:q_width + 2 * kv_width])


@helper
def run_serial(step, spec, weights, params, dims, eps, ids, start, n_tokens, first_token, cos, sin, keys, values,
               embed_scratch, peaks, totals, accs, hidden, normed, qkv, attn, branch):
    """A SERIAL step: the embedding and RoPE with the cache write in any call; prefill's norms and
    attention merge, whose outputs the next step transposes (decode replicates those instead)."""
    d_model, n_heads, n_kv, head_dim = dims[M_HIDDEN], dims[M_HEADS], dims[M_KV_HEADS], dims[M_HEAD_DIM]
    q_width, kv_width = n_heads * head_dim, n_kv * head_dim
    if step == S_EMBED:
        table = weights[dims[M_EMBED]]
        for t in range(n_tokens):
            embed_row(table, ids[t], embed_scratch, hidden[t])
        if dims[M_EMBED_SCALE] != NO_PARAM:  # Gemma: rows times sqrt(hidden size)
            scale = params[dims[M_EMBED_SCALE]]
            for t in range(n_tokens):
                for i in range(d_model):
                    hidden[t, i] *= scale
    elif step == S_ATTN_OUT_NORM or step == S_FFN_OUT_NORM:  # hidden += norm(branch)
        norm = param(params, spec[L_ATTN_OUT_NORM if step == S_ATTN_OUT_NORM else L_FFN_OUT_NORM], d_model)
        for t in range(n_tokens):
            rms_norm_row(branch[t], norm, eps, branch[t])
            for i in range(d_model):
                hidden[t, i] += branch[t, i]
    elif step == S_INPUT_NORM or step == S_POST_NORM:
        norm = param(params, spec[L_INPUT_NORM if step == S_INPUT_NORM else L_POST_NORM], d_model)
        for t in range(n_tokens):
            rms_norm_row(hidden[t], norm, eps, normed[t])
    elif step == S_ROPE:  # prefill: per-head q/k norm (Qwen3), rotary embedding, cache write
        for t in range(n_tokens):
            norm_and_rope_heads(qkv[t], 0, n_heads + n_kv, n_heads, spec, params, eps, head_dim, cos[t], sin[t])
            write_kv(qkv[t], keys, values, dims[M_KV_BYTES], start + t, q_width, kv_width)
    elif step == S_MERGE:  # prefill: one partial per (token, head)
        for t in range(n_tokens):
            for h in range(n_heads):
                at = t * n_heads + h
                merge_partials(peaks[at:at + 1], totals[at:at + 1], accs[at:at + 1],
                               attn[t, h * head_dim:(h + 1) * head_dim])
    elif step == S_FINAL_NORM:  # every token's logits: the head transposes them
        norm = param(params, dims[M_FINAL_NORM], d_model)
        for t in range(n_tokens - first_token):
            rms_norm_row(hidden[first_token + t], norm, eps, normed[t])


@helper
def run_replicated(step, spec, weights, params, dims, eps, start, first_token, thread, x_natural, x_pairs, x_sums,
                   replica, peaks, totals, accs, hidden, normed, gate):
    """A REPLICATED step for one token, done by every thread into its own `replica` row and prepared
    input (x_natural, x_pairs, x_sums); thread 0 also leaves a norm's output in `normed`, where the
    caller reads it (a MoE layer's experts take it as their input)."""
    d_model, n_heads, head_dim = dims[M_HIDDEN], dims[M_HEADS], dims[M_HEAD_DIM]
    # the vector is padded as wide as prefill's transpose fills xt for the same projection
    if step == S_INPUT_NORM or step == S_POST_NORM or step == S_FINAL_NORM:
        if step == S_FINAL_NORM:
            norm, fed, transposed = dims[M_FINAL_NORM], dims[M_LM_HEAD], S_HEAD_T
        elif step == S_INPUT_NORM:
            norm, fed, transposed = spec[L_INPUT_NORM], spec[L_Q], S_INPUT_T
        else:
            norm, fed, transposed = spec[L_POST_NORM], ffn_input_weight(spec), S_POST_T
        x = replica[:d_model]
        rms_norm_row(hidden[first_token], param(params, norm, d_model), eps, x)
        if thread == 0:
            normed[0, :d_model] = x
        k_fill = transpose_input(transposed, spec, weights, dims)[1]
        prepare_vector(x, x_natural[:k_fill], x_pairs, x_sums, weights[fed, W_ACTIVATIONS])
    elif step == S_MERGE:
        n_splits = decode_splits(start + 1, spec[L_WINDOW])
        for h in range(n_heads):
            at = h * n_splits
            merge_partials(peaks[at:at + n_splits], totals[at:at + n_splits], accs[at:at + n_splits],
                           replica[h * head_dim:(h + 1) * head_dim])
        k_fill = transpose_input(S_ATTN_T, spec, weights, dims)[1]
        prepare_vector(replica[:n_heads * head_dim], x_natural[:k_fill], x_pairs, x_sums,
                       weights[spec[L_O], W_ACTIVATIONS])
    else:  # S_DOWN_INPUT
        w = weights[spec[L_DOWN]]
        prepare_vector(gate[0], x_natural[:w[W_COLS_PADDED]], x_pairs, x_sums, w[W_ACTIVATIONS])


@helper
def project_rows(weights, w_index, bias_offset, params, row_begin, row_end, n_tokens, x_natural, x_pairs, x_sums, xt,
                 xq, tile, block, out, out_col, accumulate, row_scratch, transposed=False):
    """out[:T, out_col + r] (+)= x W[r]^T (+ bias[r]) for r in [row_begin, row_end) of one weight
    (transposed, prefill only: out[out_col + r, :T]). Prefill reads xt, or xq (xt quantized by the
    step before) where the weight reads int8 tokens."""
    if row_end <= row_begin:
        return
    w = weights[w_index]
    if transposed:
        gemm_rows(w, row_begin, row_end, xt, xq, n_tokens, tile, block, out, out_col + row_begin, accumulate, True)
        if bias_offset != NO_PARAM:
            for r in range(row_begin, row_end):
                for t in range(n_tokens):
                    out[out_col + r, t] += params[bias_offset + r]
        return
    if n_tokens == 1:
        if accumulate:
            matvec_rows(w, row_begin, row_end, x_natural, x_pairs, x_sums, row_scratch)
            for r in range(row_begin, row_end):
                out[0, out_col + r] += row_scratch[r]
        else:
            matvec_rows(w, row_begin, row_end, x_natural, x_pairs, x_sums, out[0, out_col:out_col + w[W_ROWS]])
    else:
        gemm_rows(w, row_begin, row_end, xt, xq, n_tokens, tile, block, out, out_col + row_begin, accumulate, False)
    if bias_offset != NO_PARAM:
        for t in range(n_tokens):
            for r in range(row_begin, row_end):
                out[t, out_col + r] += params[bias_offset + r]


@helper
def project_part(weights, params, w_index, bias_offset, offset, begin, end, n_tokens, x_natural, x_pairs, x_sums, xt,
                 xq, tile, block, out, out_col, accumulate, row_scratch):
    """The part of task rows [begin, end) (of a concatenated output space) that falls in the weight
    occupying [offset, offset + N)."""
    n_rows = weights[w_index, W_ROWS]
    lo, hi = max(begin, offset) - offset, min(end, offset + n_rows) - offset
    project_rows(weights, w_index, bias_offset, params, lo, hi, n_tokens, x_natural, x_pairs, x_sums, xt, xq, tile,
                 block, out, out_col, accumulate, row_scratch)
    return offset + n_rows


@helper
def run_task(kind, step, task, n_tasks, spec, weights, params, dims, eps, scale, start, n_tokens, first_token,
             n_threads, cos, sin, keys, values, key_positions, x_natural, x_pairs, x_sums, xt, xq, tile, block,
             row_scratch, scores, peaks, totals, accs, hidden, normed, qkv, attn, gate, up, gate_t, up_t,
             router_logits, logits, branch):
    n_heads, n_kv, head_dim = dims[M_HEADS], dims[M_KV_HEADS], dims[M_HEAD_DIM]
    if kind == TRANSPOSE:  # this task's chunks of the next projection's input, transposed and/or quantized
        source, k_fill = transpose_input(step, spec, weights, dims)
        chunks = ceil_div(k_fill, CHUNK)
        k_begin = min(chunks * task // n_tasks * CHUNK, k_fill)
        k_end = min(chunks * (task + 1) // n_tasks * CHUNK, k_fill)
        tokens = n_tokens - first_token if step == S_HEAD_T else n_tokens
        if step == S_HEAD_T:
            transpose_tokens(normed[:n_tokens - first_token], xt, k_begin, k_end)
        elif source == 0:
            transpose_tokens(normed[:n_tokens], xt, k_begin, k_end)
        elif source == 1:
            transpose_tokens(attn[:n_tokens], xt, k_begin, k_end)
        if reads_int8_tokens(step, spec, weights, dims):
            transposed = gate_t if source == 2 else xt
            quantize_tokens(transposed.ctypes.data, transposed.shape[1], k_begin // CHUNK, k_end // CHUNK,
                            padded_tokens_in_kernel(tokens), xq.ctypes.data, quantized_capacity(xq), tile.ctypes.data)
    elif kind == PROJECT:
        tokens = n_tokens - first_token if step == S_HEAD else n_tokens
        rows = projection_rows(step, spec, weights, dims)
        per_task = rows_per_task(rows, tokens, n_threads)
        begin = task * per_task
        end = min(begin + per_task, rows)
        if step == S_QKV:
            q_width = n_heads * head_dim
            offset = project_part(weights, params, spec[L_Q], spec[L_Q_BIAS], 0, begin, end, tokens, x_natural, x_pairs,
                                  x_sums, xt, xq, tile, block, qkv, 0, False, row_scratch)
            offset = project_part(weights, params, spec[L_K], spec[L_K_BIAS], offset, begin, end, tokens, x_natural,
                                  x_pairs, x_sums, xt, xq, tile, block, qkv, q_width, False, row_scratch)
            project_part(weights, params, spec[L_V], spec[L_V_BIAS], offset, begin, end, tokens, x_natural, x_pairs,
                         x_sums, xt, xq, tile, block, qkv, q_width + n_kv * head_dim, False, row_scratch)
        elif step == S_O:  # added to the residual stream, or into `branch` for its output norm
            sandwich = spec[L_ATTN_OUT_NORM] != NO_PARAM
            project_rows(weights, spec[L_O], spec[L_O_BIAS], params, begin, end, tokens, x_natural, x_pairs, x_sums,
                         xt, xq, tile, block, branch if sandwich else hidden, 0, not sandwich, row_scratch)
        elif step == S_GATE_UP and is_moe(spec):  # router logits [T, E] (prefill reads the transposed input)
            project_rows(weights, spec[L_ROUTER], spec[L_ROUTER_BIAS], params, begin, end, tokens, x_natural, x_pairs,
                         x_sums, xt, xq, tile, block, router_logits, 0, False, row_scratch)
        elif step == S_GATE_UP and tokens == 1:  # gate and up rows [begin, end), then silu(gate) * up
            project_rows(weights, spec[L_GATE], spec[L_GATE_BIAS], params, begin, end, tokens, x_natural, x_pairs,
                         x_sums, xt, xq, tile, block, gate, 0, False, row_scratch)
            project_rows(weights, spec[L_UP], spec[L_UP_BIAS], params, begin, end, tokens, x_natural, x_pairs, x_sums,
                         xt, xq, tile, block, up, 0, False, row_scratch)
            gated_in_place(spec, gate[0, begin:end], up[0, begin:end])
        elif step == S_GATE_UP:  # prefill: the same, transposed ([I, T]), so h^T is the down input
            project_rows(weights, spec[L_GATE], spec[L_GATE_BIAS], params, begin, end, tokens, x_natural, x_pairs,
                         x_sums, xt, xq, tile, block, gate_t, 0, False, row_scratch, True)
            project_rows(weights, spec[L_UP], spec[L_UP_BIAS], params, begin, end, tokens, x_natural, x_pairs, x_sums,
                         xt, xq, tile, block, up_t, 0, False, row_scratch, True)
            for r in range(begin, end):
                gated_in_place(spec, gate_t[r, :tokens], up_t[r, :tokens])
        elif step == S_DOWN:
            sandwich = spec[L_FFN_OUT_NORM] != NO_PARAM
            project_rows(weights, spec[L_DOWN], spec[L_DOWN_BIAS], params, begin, end, tokens, x_natural, x_pairs,
                         x_sums, gate_t if tokens > 1 else xt, xq, tile, block, branch if sandwich else hidden, 0,
                         not sandwich, row_scratch)
        else:  # S_HEAD
            project_rows(weights, dims[M_LM_HEAD], NO_PARAM, params, begin, end, tokens, x_natural, x_pairs, x_sums,
                         xt, xq, tile, block, logits, 0, False, row_scratch)
    else:  # ATTEND: prefill items (token, KV head), decode items (KV split), see attention.py
        window = spec[L_WINDOW]
        q_positions = key_positions[start:]  # key positions are cache indices; the new tokens' follow
        if n_tokens == 1:
            # the step before left q|k|v as projected: each split normalises and rotates the query
            # heads for itself, and the split that ends at the new token (the only one that reads
            # it) first does the same to its key and writes it and its value into the cache
            q_width, kv_width = n_heads * head_dim, n_kv * head_dim
            if task == n_tasks - 1:
                norm_and_rope_heads(qkv[0], n_heads, n_heads + n_kv, n_heads, spec, params, eps, head_dim, cos[0],
                                    sin[0])
                write_kv(qkv[0], keys, values, dims[M_KV_BYTES], start, q_width, kv_width)
            query = decode_query(scores, q_width)
            query[:] = qkv[0, :q_width]
            norm_and_rope_heads(query, 0, n_heads, n_heads, spec, params, eps, head_dim, cos[0], sin[0])
            decode_attention_item(task, n_tasks, n_heads, query.reshape((1, q_width)), keys, values, n_kv,
                                  dims[M_KV_BYTES], q_positions[0], key_positions, scale, window, scores, peaks,
                                  totals, accs)
        else:
            for item in range(task, n_tokens * n_kv, n_tasks):
                attention_item(item, 1, n_heads, n_kv, qkv, keys, values, dims[M_KV_BYTES], q_positions, key_positions,
                               scale, window, scores, peaks, totals, accs)


@helper
def gated_in_place(spec, gate, up):
    """gate = act(gate) * up, act the layer's: SiLU (SwiGLU) or GELU-tanh (Gemma)."""
    if spec[L_ACTIVATION] == GELU_TANH:
        gelu_tanh_times_in_place(gate, up)
    else:
        silu_times_in_place(gate, up)


@helper
def wait_for(address, target):
    """Wait until the int64 at `address` reaches target: spin first, then nap."""
    spins = 0
    while atomic_load(address) < target:
        if spins < SPINS_BEFORE_SLEEP:
            spin_pause()
            spins += 1
        else:
            sleep_microseconds(NAP_MICROSECONDS)


def _forward(weights, layers, params, dims, eps, scale, kv, ids, start, cos, sin, first, last,
             run_embedding, run_head, all_logits, n_threads, hidden, normed, qkv, attn, gate, up, gate_t, up_t, xt, xq,
             x_natural, x_pairs, x_sums, tiles, blocks, row_scratch, embed_scratch, scores, peaks, totals, accs,
             key_positions, sync, clock, router_logits, logits, replicas, branch):
    """cos / sin hold n_tokens rows per rotary table, the model's first, then (if any layer has one) the
    sliding layers' (L_ROPE_TABLE). clock [>= n_steps + 1] receives the call's start time (clock[0]) and the time each step's
    last task finished (clock[1 + step index]); 0 for skipped steps. A few clock reads per token."""
    n_tokens = ids.shape[0]
    first_token = 0 if all_logits else n_tokens - 1
    n_out = n_tokens - first_token
    visible_keys = key_positions[:start + n_tokens]
    n_steps = (1 if run_embedding else 0) + (last - first) * LAYER_STEPS + HEAD_STEPS
    # plain loops: in a parallel kernel a slice assignment is a parallel region of its own
    for index in range(n_steps):
        for counter in range(SYNC_STRIDE):
            sync[index, counter] = 0
        clock[1 + index] = 0.0
    clock[0] = monotonic_seconds()
    counters = sync.ctypes.data
    for thread in prange(n_threads):
        previous, previous_tasks = -1, 0
        x_natural_own, x_pairs_own, x_sums_own = x_natural[thread], x_pairs[thread], x_sums[thread]
        for index in range(n_steps):
            layer, step = step_of(index, first, last, run_embedding)
            spec = layers[max(layer, first)] if last > first else layers[0]
            kind, n_tasks = plan(step, spec, weights, dims, start, n_tokens, n_out, n_threads, run_head)
            if n_tasks == 0:
                continue
            if kind == REPLICATED:  # the projection after it: its first rows, requested before the wait
                request_projection_head(projection_after(step), spec, weights, dims, n_threads, thread)
            if previous >= 0:  # a step starts when every task of the one before has finished
                wait_for(counters + 8 * (previous * SYNC_STRIDE + DONE), previous_tasks)
            if kind == REPLICATED:  # every thread, for itself; the next step needs no barrier after it
                run_replicated(step, spec, weights, params, dims, eps, start, first_token, thread, x_natural_own,
                               x_pairs_own, x_sums_own, replicas[thread], peaks, totals, accs, hidden, normed, gate)
                if thread == 0:
                    clock[1 + index] = monotonic_seconds()
                continue
            kv_layer = max(layer, 0)
            keys, values = kv[kv_layer, 0], kv[kv_layer, 1]  # addresses of [capacity, Hkv, Dh] buffers
            table = spec[L_ROPE_TABLE] * n_tokens
            layer_cos, layer_sin = cos[table:table + n_tokens], sin[table:table + n_tokens]
            while True:
                task = atomic_add(counters + 8 * (index * SYNC_STRIDE + NEXT), 1)
                if task >= n_tasks:
                    break
                if kind == SERIAL:
                    run_serial(step, spec, weights, params, dims, eps, ids, start, n_tokens, first_token, layer_cos,
                               layer_sin, keys, values, embed_scratch, peaks, totals, accs, hidden, normed, qkv, attn,
                               branch)
                else:
                    run_task(kind, step, task, n_tasks, spec, weights, params, dims, eps, scale, start, n_tokens,
                             first_token, n_threads, layer_cos, layer_sin, keys, values, visible_keys, x_natural_own,
                             x_pairs_own, x_sums_own, xt, xq, tiles[thread], blocks[thread], row_scratch,
                             scores[thread], peaks, totals, accs, hidden, normed, qkv, attn, gate, up, gate_t, up_t,
                             router_logits, logits, branch)
                if atomic_add(counters + 8 * (index * SYNC_STRIDE + DONE), 1) == n_tasks - 1:
                    clock[1 + index] = monotonic_seconds()  # this was the step's last task
            previous, previous_tasks = index, n_tasks


_i64_2d_ro, _i64_1d_ro = readonly(types.int64, 2), readonly(types.int64, 1)
_f32_1d_ro, _f32_2d_ro = readonly(types.float32, 1), readonly(types.float32, 2)
_f32_1d, _f32_2d, _f32_3d = mutable(types.float32, 1), mutable(types.float32, 2), mutable(types.float32, 3)
FORWARD_SIGNATURE = types.void(
    _i64_2d_ro, _i64_2d_ro, _f32_1d_ro, _i64_1d_ro, types.float32, types.float32,  # weights .. scale
    _i64_2d_ro, _i64_1d_ro, types.int64, _f32_2d_ro, _f32_2d_ro,  # kv .. sin
    types.int64, types.int64, types.boolean, types.boolean, types.boolean, types.int64,  # first .. n_threads
    _f32_2d, _f32_2d, _f32_2d, _f32_2d, _f32_2d, _f32_2d, _f32_2d, _f32_2d, _f32_2d, _f32_2d,  # hidden .. xt xq
    _f32_2d, _f32_2d, _f32_2d, _f32_3d, _f32_2d, _f32_1d, _f32_2d,  # x_natural .. embed_scratch (x_*: per thread)
    _f32_2d, _f32_1d, _f32_1d, _f32_2d, _i64_1d_ro, mutable(types.int64, 2),  # scores .. sync
    mutable(types.float64, 1), _f32_2d, _f32_2d, _f32_2d, _f32_2d,  # clock, router_logits, logits, replicas, branch
)
forward_kernel = kernel(FORWARD_SIGNATURE, parallel=True)(_forward)


def sync_rows(n_layers: int) -> int:
    """Rows of the `sync` counter array a call over n_layers layers needs."""
    return 1 + n_layers * LAYER_STEPS + HEAD_STEPS


STEP_NAMES = {S_INPUT_NORM: "input norm", S_INPUT_T: "transpose (qkv input)", S_QKV: "q/k/v projection",
              S_ROPE: "q/k norm + rope + cache write", S_ATTEND: "attention", S_MERGE: "attention merge",
              S_ATTN_T: "transpose (o input)", S_O: "o projection", S_ATTN_OUT_NORM: "attention output norm",
              S_POST_NORM: "post-attention norm",
              S_POST_T: "transpose (mlp input)", S_GATE_UP: "gate/up projection + silu (MoE: router)",
              S_DOWN_INPUT: "down input", S_DOWN: "down projection", S_FFN_OUT_NORM: "feed-forward output norm",
              S_EMBED: "embedding", S_FINAL_NORM: "final norm", S_HEAD_T: "transpose (head input)",
              S_HEAD: "lm head"}


def step_durations(clock, first: int, last: int, run_embedding: bool) -> list[tuple[int, str, float]]:
    """(layer or -1, step name, seconds) of every step a call ran, from its clock array: a step
    lasts from the end of the step before it (or the call's start) to the end of its last task."""
    n_steps = (1 if run_embedding else 0) + (last - first) * LAYER_STEPS + HEAD_STEPS
    durations, previous_end = [], clock[0]
    for index in range(n_steps):
        end = clock[1 + index]
        if end == 0.0:
            continue
        if run_embedding and index == 0:
            layer, step = -1, S_EMBED
        else:
            i = index - (1 if run_embedding else 0)
            n_layer_steps = (last - first) * LAYER_STEPS
            layer, step = ((first + i // LAYER_STEPS, i % LAYER_STEPS) if i < n_layer_steps
                           else (-1, S_FINAL_NORM + i - n_layer_steps))
        durations.append((layer, STEP_NAMES[step], end - previous_end))
        previous_end = end
    return durations
