"""y = x W^T (+ bias) for every weight kind, dequantizing on the fly.

Decode (one token): a kind's `matvec` runs the hand-written row dot products of llvm_ir.py over
a range of rows, up to 4 rows at a time so that each load of x serves several rows. The input is
prepared once per vector (prepare_vector) in the weight's activation style: f32, or quantized to
int8 per block of 32 for integer dot products (the `cpu:int8` device variant, llvm_ir.ACT_INT8*).

Prefill (T tokens): `gemm` dequantizes TILE_ROWS weight rows once into a small f32 tile
and multiplies that tile by every token through a register-blocked micro-kernel (TILE_M rows x
TILE_T tokens), so dequantization is paid once per row, not once per token, and the loop is
bound by multiply-adds. The depth is walked in slices of K_SLICE that every micro-block of a tile
reads in turn, so that a token block's x stays in cache however long the prompt (xt's rows are a
prompt's length apart: over the whole depth, a long prompt's x came from memory). Its bf16 variant
(quantized weights, where the CPU runs AVX-512 BF16) dequantizes into bf16 tiles and multiplies
them by x rounded to bf16 pairs, sums in f32. Tokens are read from xt, the input transposed (tokens
minor) and zero-padded; each block of results is scattered into the output. Full f32 weight
matrices are never materialised: the largest dequantized piece is one tile.

Where the integer dot products beat f32 tiles (llvm_prefill.integer_prefill_runs), a quantized
weight's gemm multiplies panels of its own codes by the tokens rounded to int8 per block of 32
(quantize_tokens, the decode's rounding), PANEL_TOKENS tokens per micro-kernel call. The fused
forward, the MoE prefill and `linear` quantize each projection's input once, in the step that
transposes it (W_PREFILL_INT8 says which weights read it), and pass it to the gemm beside xt.

Each kind's three kernels (matvec, gemm, dequantize) are compiled separately as C callbacks,
only when a loaded model has a weight of that kind, and cached on disk; a weight's descriptor
carries their addresses (W_MATVEC_FN, W_GEMM_FN, W_DEQUANTIZE_FN) and the helpers below call
through them. Kernels that handle every kind are then compiled once and stay small.
"""
from __future__ import annotations

import threading

import numba
import numpy as np
from numba import prange, types

from kernels.cpu import formats as wf
from kernels.cpu.intrinsics import (call_dequantize, call_gemm, call_matvec, float32_pointer, int32_pointer,
                                    int64_pointer, prefetch_bytes, uint16_pointer, uint32_pointer)
from kernels.cpu.llvm_ir import (ACT_F32, CHUNK, LANES, PREFETCH_BLOCKS, Q8_SUPERBLOCK_BYTES, Q8_SUPERBLOCK_CHUNKS,
                                 make_dot_rows, quantize_chunk)
from kernels.cpu.llvm_prefill import (PANEL_ROWS, QUADS_PER_CHUNK, QUANTIZED_WORDS, RECORD_SCALE, RECORD_SUM,
                                      integer_prefill_runs, make_dequantize_rows, make_panel_times_tokens,
                                      make_tile_times_tokens, pack_panel, signed_panel_codes)
from kernels.cpu.runtime import cfunc, helper, kernel, mutable, readonly

TILE_M = 6  # weight rows per micro-kernel call
TILE_T = 32  # tokens per micro-kernel call (two vectors of 16)
TILE_ROWS = 48  # weight rows dequantized per tile: TILE_M * 8
BLOCK_FLOATS = TILE_ROWS * TILE_T  # one thread's results of a tile's rows for TILE_T tokens
K_SLICE = 256  # k per micro-kernel call: TILE_T tokens of x over K_SLICE k are 32 KB
MATVEC_BLOCK = 4  # decode row ranges are cut at multiples of this (a multiple of every row-dot block)

K_F32, K_F16 = wf.F32, wf.F16
W_KIND, W_ROWS, W_COLS, W_COLS_PADDED = wf.W_KIND, wf.W_ROWS, wf.W_COLS, wf.W_COLS_PADDED
W_DATA, W_ROW_BYTES, W_SCALES, W_OFFSETS = wf.W_DATA, wf.W_ROW_BYTES, wf.W_SCALES, wf.W_OFFSETS
W_GROUPS, W_CHUNKS_PER_GROUP, W_FIELDS = wf.W_GROUPS, wf.W_CHUNKS_PER_GROUP, wf.W_FIELDS
W_MATVEC_FN, W_GEMM_FN, W_DEQUANTIZE_FN = wf.W_MATVEC_FN, wf.W_GEMM_FN, wf.W_DEQUANTIZE_FN
W_ACTIVATIONS, W_DEQUANTIZE_BF16_FN, W_PREFILL_INT8 = wf.W_ACTIVATIONS, wf.W_DEQUANTIZE_BF16_FN, wf.W_PREFILL_INT8
W_SCALE_BYTES = wf.W_SCALE_BYTES

# Rows each decode row-dot reads together. More rows share each load of x, but each row is one
# more memory stream. Measured on Zen 4 (single thread, matrices past the L3 cache): int4 with
# K = 576 (288 B rows) streams best 4 rows at a time (14.8 Gw/s vs 13.2 with 2), int4 with
# K = 1536 (768 B rows) 2 at a time (14.6 vs 12.3 with 4), int8 with K = 576 (576 B rows) 2 at a
# time (16 Gw/s vs 6 with 4). So a block takes as many rows (4, 2 or 1) as fit in BLOCK_BYTES.
# The integer dot products of int8 activations do less arithmetic per byte and stream rows of
# 576 B or more best one at a time: int4 with K = 1536 25 us per 576 x 1536 matrix against 37 with
# 2 rows, int8 with K = 576 49 us per 1536 x 576 against 73 with 2; int4 rows of 288 B still go 4
# at a time (single thread, matrices past the L3 cache). So their blocks are 4 rows when those fit
# in INT8_BLOCK_BYTES, else 1.
BLOCK_BYTES = 2048
INT8_BLOCK_BYTES = 1280


# Row dot products of every kind and activation style, as module globals so that the per-kind
# callbacks below find them by name (Numba resolves globals as compile-time constants); the kind
# and style are literals of each callback, so each call compiles one format's loop.
dot_rows_4, dot_rows_2, dot_rows_1 = (make_dot_rows(n, wf.IR_FORMATS) for n in (4, 2, 1))
dequantize_tile_rows = make_dequantize_rows(wf.IR_FORMATS)
tile_times_tokens = make_tile_times_tokens(TILE_M, TILE_T // LANES)
# Short prompts (<= 16 tokens) take one vector of tokens per call: half the padding of TILE_T.
tile_times_16_tokens = make_tile_times_tokens(TILE_M, 1)
bf16_tile_times_tokens = make_tile_times_tokens(TILE_M, TILE_T // LANES, bf16=True)
bf16_tile_times_16_tokens = make_tile_times_tokens(TILE_M, 1, bf16=True)
PANEL_TOKENS = 4  # tokens per integer micro-kernel call (a divisor of TILE_T, the tokens' padding)
panel_times_tokens = make_panel_times_tokens(PANEL_TOKENS)


# --------------------------------------------------------------------------------------------
# Kernels of one kind (C callbacks; every argument an int64: address, size or flag)

_MATVEC_SIGNATURE = types.void(*([types.int64] * 7))
_DEQUANTIZE_SIGNATURE = types.void(*([types.int64] * 5))
_GEMM_SIGNATURE = types.void(*([types.int64] * 16))


def _matvec_for(kind: int, style: int):
    """out[r] = dot(W[r], x) for r in [row_begin, row_end), x prepared in activation style `style`."""

    def matvec(descriptor, row_begin, row_end, x, xp, xsum, out):
        w = numba.carray(int64_pointer(descriptor), (W_FIELDS,))
        data, row_bytes, scales, offsets = w[W_DATA], w[W_ROW_BYTES], w[W_SCALES], w[W_OFFSETS]
        n_groups, chunks, cols = w[W_GROUPS], w[W_CHUNKS_PER_GROUP], w[W_COLS]
        rows = block_rows(style, row_bytes)
        n_blocks = (row_end - row_begin) // rows
        prefetch_matvec_head(w, row_begin, row_end)
        for b in range(n_blocks):
            r = row_begin + rows * b
            if rows == 4:
                dot_rows_4(kind, style, data, row_bytes, scales, offsets, n_groups, chunks, cols, r, x, xp, xsum, out)
            elif rows == 2:
                dot_rows_2(kind, style, data, row_bytes, scales, offsets, n_groups, chunks, cols, r, x, xp, xsum, out)
            else:
                dot_rows_1(kind, style, data, row_bytes, scales, offsets, n_groups, chunks, cols, r, x, xp, xsum, out)
        for r in range(row_begin + n_blocks * rows, row_end):
            dot_rows_1(kind, style, data, row_bytes, scales, offsets, n_groups, chunks, cols, r, x, xp, xsum, out)

    return matvec


def _dequantize_for(kind: int, bf16: bool = False):
    """tile[r, :K_padded] = float32 values of W[row_begin + r] for r < n_rows (quantized padding as
    stored; float rows zero-filled from K to K_padded); bf16 (quantized kinds): those values rounded
    to bf16, tile_stride elements of two bytes apart."""
    to_bf16 = 1 if bf16 else 0

    def dequantize(descriptor, row_begin, n_rows, tile, tile_stride):
        w = numba.carray(int64_pointer(descriptor), (W_FIELDS,))
        data, row_bytes, scales, offsets = w[W_DATA], w[W_ROW_BYTES], w[W_SCALES], w[W_OFFSETS]
        n_groups, chunks, cols = w[W_GROUPS], w[W_CHUNKS_PER_GROUP], w[W_COLS]
        dequantize_tile_rows(kind, to_bf16, data, row_bytes, scales, offsets, n_groups, chunks, cols, row_begin,
                             n_rows, tile, tile_stride)
        if kind == K_F32 or kind == K_F16:
            padded = w[W_COLS_PADDED]
            rows = numba.carray(float32_pointer(tile), (n_rows, tile_stride))
            for r in range(n_rows):
                for k in range(padded - cols):
                    rows[r, cols + k] = 0.0

    return dequantize


def tile_scratch_rows(n_tokens: int) -> int:
    """Rows of K_max floats each thread's `tile` scratch needs for gemm over n_tokens: the f32 tile,
    or for bf16 prefill the bf16 tile (half as many rows) and x transposed into bf16 pairs."""
    return max(TILE_ROWS, TILE_ROWS // 2 + padded_tokens(n_tokens) // 2)


@helper
def bf16_bits(bits):
    """The bf16 nearest (ties to even) to the f32 with these bits, as the high half of its bits."""
    return (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


@helper
def pair_tokens(xt, xt_stride, depth, xp):
    """xp[i, t] = bf16(x[t, 2i]) | bf16(x[t, 2i + 1]) << 16 for 2i < depth and every column of xt
    (xt: f32 bits [>= depth, xt_stride] at address xt; xp: uint32 [depth / 2, xt_stride])."""
    values = numba.carray(uint32_pointer(xt), (depth, xt_stride))
    pairs = numba.carray(uint32_pointer(xp), (depth // 2, xt_stride))
    for i in range(depth // 2):
        for t in range(xt_stride):
            pairs[i, t] = bf16_bits(values[2 * i, t]) | (bf16_bits(values[2 * i + 1, t]) << np.uint32(16))


def _gemm_for(bf16: bool):
    """The gemm callback: f32 tiles and inputs, or (bf16) both rounded to bf16 with f32 sums."""

    def gemm(descriptor, row_begin, row_end, xt, xt_stride, xq, xq_chunks, n_tokens, tile, tile_stride, block, out,
             out_stride, out_col, accumulate, transposed):
        """out[t, out_col + r - row_begin] (+)= dot(W[r], x[t]) for r in [row_begin, row_end), t < n_tokens;
        with `transposed`, out[out_col + r - row_begin, t] instead (tokens minor: whole rows of a block
        are stored at once, and the result is already the next projection's xt).

        xt: x transposed, [>= K_padded rows, xt_stride (padded tokens) columns], zero-padded. xq,
        xq_chunks: x quantized for integer panels by the caller (quantize_tokens' records, for
        xq_chunks chunks); tiles read xt alone. tile:
        [tile_scratch_rows(n_tokens), tile_stride >= K_padded] and block: [BLOCK_FLOATS], both
        private to the caller's thread. out: [>= n_tokens, out_stride] (transposed: [>= out_col + rows,
        out_stride]). The same for every kind: the tile is filled by the kind's dequantize callback,
        found through the descriptor. bf16 dequantizes into bf16 tiles (8 significant bits) and rounds
        x to bf16 pairs once per call, sums in f32: the bf16 tile starts the tile scratch, the pairs
        follow it."""
        w = numba.carray(int64_pointer(descriptor), (W_FIELDS,))
        depth = w[W_COLS_PADDED]
        tiles = numba.carray(float32_pointer(tile), (TILE_ROWS, tile_stride))
        results = numba.carray(float32_pointer(block), (BLOCK_FLOATS,))
        out_rows = out_col + row_end - row_begin if transposed else n_tokens
        outputs = numba.carray(float32_pointer(out), (out_rows, out_stride))
        bf16_tile = tile  # uint16 [TILE_ROWS, tile_stride]
        x_pairs = tile + 2 * TILE_ROWS * tile_stride  # uint32 [depth / 2, xt_stride]
        if bf16:
            pair_tokens(xt, xt_stride, depth, x_pairs)
        for tile_begin in range(row_begin, row_end, TILE_ROWS):
            n_rows = min(TILE_ROWS, row_end - tile_begin)
            filled = -(-n_rows // TILE_M) * TILE_M
            if bf16:
                call_dequantize(w[W_DEQUANTIZE_BF16_FN], descriptor, tile_begin, n_rows, bf16_tile, tile_stride)
                rounded = numba.carray(uint16_pointer(bf16_tile), (TILE_ROWS, tile_stride))
                for r in range(filled - n_rows):  # rows of the last micro-block that W does not have
                    for k in range(depth):
                        rounded[n_rows + r, k] = 0
            else:
                call_dequantize(w[W_DEQUANTIZE_FN], descriptor, tile_begin, n_rows, tile, tile_stride)
                for r in range(filled - n_rows):
                    for k in range(depth):
                        tiles[n_rows + r, k] = 0.0
            short = n_tokens <= LANES
            block_stride = LANES if short else TILE_T
            for t_begin in range(0, n_tokens, TILE_T):
                n_t = min(TILE_T, n_tokens - t_begin)
                # depth in slices whose x stays in L1 while every micro-block of the tile reads it
                for k_begin in range(0, depth, K_SLICE):
                    k_count = min(K_SLICE, depth - k_begin)
                    resume = 1 if k_begin > 0 else 0
                    for m_begin in range(0, n_rows, TILE_M):
                        results_at = block + 4 * m_begin * block_stride
                        if bf16:  # k in pairs: the bf16 tile's row r holds k at 2 bytes each, x_pairs a row per pair
                            tile_at = bf16_tile + 2 * (m_begin * tile_stride + k_begin)
                            x_at = x_pairs + 4 * ((k_begin // 2) * xt_stride + t_begin)
                            if short:
                                bf16_tile_times_16_tokens(tile_at, tile_stride, x_at, xt_stride, k_count, results_at,
                                                          resume)
                            else:
                                bf16_tile_times_tokens(tile_at, tile_stride, x_at, xt_stride, k_count, results_at,
                                                       resume)
                        else:
                            tile_at = tile + 4 * (m_begin * tile_stride + k_begin)
                            x_at = xt + 4 * (k_begin * xt_stride + t_begin)
                            if short:
                                tile_times_16_tokens(tile_at, tile_stride, x_at, xt_stride, k_count, results_at, resume)
                            else:
                                tile_times_tokens(tile_at, tile_stride, x_at, xt_stride, k_count, results_at, resume)
                first_col = out_col + tile_begin - row_begin
                for m in range(n_rows):
                    col = first_col + m
                    if transposed:
                        destination = outputs[col, t_begin:t_begin + n_t]
                        if accumulate:
                            for t in range(n_t):
                                destination[t] += results[m * block_stride + t]
                        else:
                            for t in range(n_t):
                                destination[t] = results[m * block_stride + t]
                    elif accumulate:
                        for t in range(n_t):
                            outputs[t_begin + t, col] += results[m * block_stride + t]
                    else:
                        for t in range(n_t):
                            outputs[t_begin + t, col] = results[m * block_stride + t]

    return gemm


@helper
def quantize_tokens(xt, xt_stride, chunk_begin, chunk_end, columns, xq, capacity, peaks):
    """The first `columns` tokens (a multiple of PANEL_TOKENS) of xt (f32 [K, xt_stride], tokens
    minor), chunks [chunk_begin, chunk_end) of 32 k, quantized per token and chunk as decode's int8
    activations are (d = max|x| / 127, q = rint(x * 127 / max|x|), 0 for an all-zero chunk) into the
    integer prefill's records: xq holds [columns / PANEL_TOKENS, capacity (chunks), PANEL_TOKENS,
    QUANTIZED_WORDS] words (kernels/cpu/llvm_prefill.py). peaks: f32 scratch [2, columns]."""
    values = numba.carray(float32_pointer(xt), (chunk_end * CHUNK, xt_stride))
    shape = (columns // PANEL_TOKENS, capacity, PANEL_TOKENS, QUANTIZED_WORDS)
    words = numba.carray(uint32_pointer(xq), shape)
    scales = numba.carray(float32_pointer(xq), shape)
    sums = numba.carray(int32_pointer(xq), shape)
    peak = numba.carray(float32_pointer(peaks), (columns,))
    inverse = numba.carray(float32_pointer(peaks + 4 * columns), (columns,))
    for c in range(chunk_begin, chunk_end):
        for t in range(columns):
            peak[t] = 0.0
            sums[t // PANEL_TOKENS, c, t % PANEL_TOKENS, RECORD_SUM] = 0
        for i in range(CHUNK):
            for t in range(columns):
                peak[t] = max(peak[t], abs(values[CHUNK * c + i, t]))
        for t in range(columns):
            inverse[t] = np.float32(127.0) / peak[t] if peak[t] > 0 else np.float32(0.0)
            scales[t // PANEL_TOKENS, c, t % PANEL_TOKENS, RECORD_SCALE] = peak[t] / np.float32(127.0)
        for j in range(QUADS_PER_CHUNK):
            k = CHUNK * c + 4 * j
            for t in range(columns):
                word = np.uint32(0)
                for b in range(4):
                    q = np.int32(np.rint(values[k + b, t] * inverse[t]))
                    sums[t // PANEL_TOKENS, c, t % PANEL_TOKENS, RECORD_SUM] += q
                    word |= np.uint32(q & 0xFF) << np.uint32(8 * b)
                words[t // PANEL_TOKENS, c, t % PANEL_TOKENS, j] = word


def _integer_gemm_for(kind: int, style: int):
    """The gemm callback of a quantized kind prefilled on integer panels (llvm_prefill.py): the
    tokens quantized as decode quantizes its vector, each panel of 16 rows multiplied by
    PANEL_TOKENS tokens at a time with the style's byte dot products. Arguments and scratch as
    _gemm_for's gemm, xq as the caller quantized it; the tile scratch holds one panel."""
    bits, scale_bytes = wf.IR_FORMATS[kind].bits, wf.IR_FORMATS[kind].scale_bytes
    affine = 1 if wf.IR_FORMATS[kind].affine else 0
    signed = 1 if signed_panel_codes(bits, style) else 0
    zero_point = (0 if affine else wf.IR_FORMATS[kind].zero_point) - (128 if signed else 0)  # of the panel's codes

    def gemm(descriptor, row_begin, row_end, xt, xt_stride, xq, xq_chunks, n_tokens, tile, tile_stride, block, out,
             out_stride, out_col, accumulate, transposed):
        w = numba.carray(int64_pointer(descriptor), (W_FIELDS,))
        depth, n_groups, chunks_per_group = w[W_COLS_PADDED], w[W_GROUPS], w[W_CHUNKS_PER_GROUP]
        n_chunks = depth // CHUNK
        panel = tile  # the scratch, carved
        factors = panel + PANEL_ROWS * depth
        panel_offsets = factors + 4 * PANEL_ROWS * n_chunks
        group_bytes = 4 * QUANTIZED_WORDS * PANEL_TOKENS * xq_chunks  # one group of PANEL_TOKENS tokens' records
        panel_words = numba.carray(uint32_pointer(panel), (n_chunks * QUADS_PER_CHUNK, PANEL_ROWS))
        panel_scales = numba.carray(float32_pointer(factors), (2 * n_chunks, PANEL_ROWS))  # factors, then offsets
        results = numba.carray(float32_pointer(block), (BLOCK_FLOATS,))
        out_rows = out_col + row_end - row_begin if transposed else n_tokens
        outputs = numba.carray(float32_pointer(out), (out_rows, out_stride))
        for panel_begin in range(row_begin, row_end, PANEL_ROWS):
            n_rows = min(PANEL_ROWS, row_end - panel_begin)
            for r in range(n_rows, PANEL_ROWS):  # rows the weight does not have: codes and scales 0
                for quad in range(n_chunks * QUADS_PER_CHUNK):
                    panel_words[quad, r] = 0
                for c in range(2 * n_chunks):
                    panel_scales[c, r] = 0.0
            pack_panel(bits, signed, scale_bytes, w[W_DATA], w[W_ROW_BYTES], w[W_SCALES], w[W_OFFSETS], n_groups,
                       chunks_per_group, panel_begin, n_rows, panel, factors, panel_offsets)
            first_col = out_col + panel_begin - row_begin
            for t_begin in range(0, n_tokens, PANEL_TOKENS):
                panel_times_tokens(style, affine, signed, panel, factors, panel_offsets,
                                   xq + group_bytes * (t_begin // PANEL_TOKENS), n_chunks, zero_point, block)
                n_t = min(PANEL_TOKENS, n_tokens - t_begin)
                for i in range(n_rows if transposed else n_t):  # along each output row
                    row = outputs[first_col + i, t_begin:] if transposed else outputs[t_begin + i, first_col:]
                    for j in range(n_t if transposed else n_rows):
                        value = results[j * PANEL_ROWS + i] if transposed else results[i * PANEL_ROWS + j]
                        if accumulate:
                            row[j] += value
                        else:
                            row[j] = value

    return gemm


class _KindKernels:
    """The compiled callbacks of each kind, built (or loaded from Numba's cache) on first request."""

    def __init__(self):
        self._lock = threading.Lock()
        self._matvecs: dict[tuple[int, int], object] = {}  # (kind, activation style) -> cfunc
        self._dequantizers: dict[tuple[int, bool], object] = {}  # (kind, bf16) -> cfunc
        self._gemms: dict[bool, object] = {}  # bf16 -> cfunc
        self._integer_gemms: dict[tuple[int, int], object] = {}  # (kind, activation style) -> cfunc

    def addresses(self, kind: int, style: int, bf16_prefill: bool = False) -> tuple[int, int, int, int]:
        """(matvec, gemm, dequantize, bf16 dequantize or 0) addresses for a kind whose decode input is
        prepared in activation style `style` and whose prefill runs on f32 or bf16 tiles; the cfunc
        objects stay referenced here."""
        wanted = [(kind, False), (kind, True)] if bf16_prefill else [(kind, False)]
        with self._lock:
            if (kind, style) not in self._matvecs:
                self._matvecs[kind, style] = cfunc(_MATVEC_SIGNATURE, _matvec_for(kind, style))
            for key in wanted:
                if key not in self._dequantizers:
                    # ordered: a tile holds quant.dequantize's values, s * q and + o rounded apart
                    self._dequantizers[key] = cfunc(_DEQUANTIZE_SIGNATURE, _dequantize_for(*key), ordered=True)
            if kind in wf.QUANTIZED_KINDS.values() and integer_prefill_runs(style):
                if (kind, style) not in self._integer_gemms:
                    self._integer_gemms[kind, style] = cfunc(_GEMM_SIGNATURE, _integer_gemm_for(kind, style))
                gemm = self._integer_gemms[kind, style]
            else:
                if bf16_prefill not in self._gemms:
                    self._gemms[bf16_prefill] = cfunc(_GEMM_SIGNATURE, _gemm_for(bf16_prefill))
                gemm = self._gemms[bf16_prefill]
            return (self._matvecs[kind, style].address, gemm.address,
                    self._dequantizers[kind, False].address,
                    self._dequantizers[kind, True].address if bf16_prefill else 0)

    def compiled_kinds(self) -> list[str]:
        return [wf.KIND_NAMES[kind] for kind in sorted({kind for kind, _ in self._dequantizers})]


KIND_KERNELS = _KindKernels()


def attach_kernels(descriptor: np.ndarray, style: int = ACT_F32, bf16_prefill: bool = False) -> np.ndarray:
    """Fill a descriptor's activation style and kernel addresses (compiling its kind's kernels if
    needed). Float kinds read x as it is whatever the style; it still marks how the inputs of the
    model's decode steps are prepared (kernels/cpu/forward.py prepares one vector for q, k and v).
    `bf16_prefill` (AVX-512 BF16, checked by the caller) multiplies a quantized weight's prefill
    tiles in bf16; float weights keep f32 tiles."""
    kind = int(descriptor[W_KIND])
    descriptor[W_ACTIVATIONS] = style
    quantized = kind in wf.QUANTIZED_KINDS.values()
    (descriptor[W_MATVEC_FN], descriptor[W_GEMM_FN], descriptor[W_DEQUANTIZE_FN],
     descriptor[W_DEQUANTIZE_BF16_FN]) = KIND_KERNELS.addresses(kind, style if quantized else ACT_F32,
                                                                bf16_prefill and quantized)
    descriptor[W_PREFILL_INT8] = int(quantized and integer_prefill_runs(style))
    return descriptor


# --------------------------------------------------------------------------------------------
# Helpers that kernels call: inputs, and the kind's kernels through the descriptor


@helper
def prepare_vector(x, x_natural, x_pairs, x_sums, style):
    """x [K] -> the forms a decode dot product reads, for weights of activation style `style`
    (a descriptor's W_ACTIVATIONS):
        x_natural  x, zero-padded (its length fixes the padding: a multiple of 32)
        x_pairs    ACT_F32: per chunk of 32, the evens then the odds (the order of int4 nibbles);
                   int8 styles: x quantized to int8 per chunk, in llvm_ir's Q8 layout (its bytes)
        x_sums     three regions of x_sums.shape[0] // 3 values: the sums of x (int8 styles: of the
                   quantized x) over groups of 32, of 64 and of 128 (group_sums picks one)."""
    k = x.shape[0]
    padded = x_natural.shape[0]
    n_chunks = padded // CHUNK
    region = x_sums.shape[0] // 3
    for i in range(k):
        x_natural[i] = x[i]
    for i in range(padded - k):
        x_natural[k + i] = 0.0
    if style == ACT_F32:
        for chunk in range(n_chunks):
            base = chunk * CHUNK
            total = np.float32(0.0)
            for j in range(CHUNK // 2):
                even = x_natural[base + 2 * j]
                odd = x_natural[base + 2 * j + 1]
                x_pairs[base + j] = even
                x_pairs[base + CHUNK // 2 + j] = odd
                total += even + odd
            x_sums[chunk] = total
    else:
        quantize_activations(x_natural, x_pairs, x_sums)
    for pair in range(n_chunks // 2):
        x_sums[region + pair] = x_sums[2 * pair] + x_sums[2 * pair + 1]
    for quad in range(n_chunks // 4):
        x_sums[2 * region + quad] = x_sums[region + 2 * quad] + x_sums[region + 2 * quad + 1]


Q8_SUPERBLOCK_FLOATS = Q8_SUPERBLOCK_BYTES // 4


@helper
def quantize_activations(x_natural, q8, chunk_sums):
    """x_natural [K_padded] -> q8 (f32 storage of llvm_ir's Q8 layout: int8 q per chunk of 32 with
    d = max|x| / 127, q = round(x / d)) and chunk_sums[c] = d * sum(q over chunk c)."""
    for chunk in range(x_natural.shape[0] // CHUNK):
        chunk_sums[chunk] = quantize_chunk(x_natural.ctypes.data + 4 * CHUNK * chunk, q8.ctypes.data, chunk)


def pairs_length(padded_cols: int) -> int:
    """Length of prepare_vector's x_pairs for vectors of up to padded_cols values (either style)."""
    superblocks = -(-(padded_cols // CHUNK) // Q8_SUPERBLOCK_CHUNKS)
    return max(padded_cols, superblocks * Q8_SUPERBLOCK_FLOATS)


def sums_length(padded_cols: int) -> int:
    """Length of prepare_vector's x_sums for vectors of up to padded_cols values."""
    return 3 * (padded_cols // CHUNK)


@helper
def group_sums(x_sums, chunks_per_group):
    """prepare_vector's sums of x over groups of 32 * chunks_per_group (1, 2 or 4)."""
    region = x_sums.shape[0] // 3
    which = 0 if chunks_per_group == 1 else (1 if chunks_per_group == 2 else 2)
    return x_sums[which * region:(which + 1) * region]


@helper
def transpose_tokens(x, xt, k_begin, k_end):
    """xt[k, t] = x[t, k] for k in [k_begin, k_end): zero beyond x's columns and rows."""
    n_tokens, k = x.shape
    padded_tokens = xt.shape[1]
    for kk in range(k_end - k_begin):
        col = k_begin + kk
        row = xt[col]
        if col < k:
            for t in range(n_tokens):
                row[t] = x[t, col]
            for t in range(padded_tokens - n_tokens):
                row[n_tokens + t] = 0.0
        else:
            for t in range(padded_tokens):
                row[t] = 0.0


def padded_tokens(n_tokens: int) -> int:
    """Columns of x transposed for n_tokens tokens: whole vectors of TILE_T tokens."""
    return -(-n_tokens // TILE_T) * TILE_T


padded_tokens_in_kernel = helper(padded_tokens)  # the same, called from compiled code


def quantized_tokens_shape(depth: int, n_tokens: int) -> tuple[int, int]:
    """The f32 array that holds quantize_tokens' records of n_tokens tokens (padded) and K = depth:
    one row per group of PANEL_TOKENS tokens, so that its width tells its chunks (quantized_capacity)."""
    return padded_tokens(n_tokens) // PANEL_TOKENS, -(-depth // CHUNK) * PANEL_TOKENS * QUANTIZED_WORDS


@helper
def quantized_capacity(xq):
    """The chunks of 32 k an array of quantized_tokens_shape holds records for."""
    return xq.shape[1] // (PANEL_TOKENS * QUANTIZED_WORDS)


@helper
def matvec_rows(w, row_begin, row_end, x_natural, x_pairs, x_sums, out):
    """out[r] = dot(W[r], x) for r in [row_begin, row_end) (out indexed by weight row); x_natural,
    x_pairs and x_sums as prepare_vector made them."""
    if row_end > row_begin:
        sums = group_sums(x_sums, w[W_CHUNKS_PER_GROUP])
        call_matvec(w[W_MATVEC_FN], w.ctypes.data, row_begin, row_end, x_natural.ctypes.data, x_pairs.ctypes.data,
                    sums.ctypes.data, out.ctypes.data)


# A matvec's own prefetches run a few row blocks ahead (llvm_ir.PREFETCH_BLOCKS), so the first rows of
# a matrix wait for memory: for a small matrix (a MoE expert's) that is a good part of its time.
# A matvec requests its first blocks at once when it starts (SmolLM2 int4, 2 threads: ~3% faster
# decode; the fused forward requests them earlier still, before the replicated step that prepares
# the matvec's input), and while one expert is computed, the first HEAD_ROWS rows of the next one's
# matrices are requested (on the MoEfied SmolLM2 it took ~5% off the expert mixture's time).
HEAD_ROWS = 16


@helper
def prefetch_rows(w, row_begin, n_rows):
    """Request rows [row_begin, row_begin + n_rows) of a weight (its codes, scales and offsets) into L2."""
    rows = min(n_rows, w[W_ROWS] - row_begin)
    if rows <= 0:
        return
    prefetch_bytes(w[W_DATA] + row_begin * w[W_ROW_BYTES], rows * w[W_ROW_BYTES])
    group_bytes = w[W_SCALE_BYTES] * w[W_GROUPS]
    if w[W_SCALES] != 0:
        prefetch_bytes(w[W_SCALES] + row_begin * group_bytes, rows * group_bytes)
    if w[W_OFFSETS] != 0:
        prefetch_bytes(w[W_OFFSETS] + row_begin * group_bytes, rows * group_bytes)


@helper
def block_rows(style, row_bytes):
    """Rows a decode row dot reads together, for weights of activation style `style` and rows of
    row_bytes (the measurements above BLOCK_BYTES)."""
    if style == ACT_F32:
        return 4 if 4 * row_bytes <= BLOCK_BYTES else (2 if 2 * row_bytes <= BLOCK_BYTES else 1)
    return 4 if 4 * row_bytes <= INT8_BLOCK_BYTES else 1


@helper
def prefetch_matvec_head(w, row_begin, row_end):
    """Request the blocks a matvec of rows [row_begin, row_end) reads before its row dots' own
    requests (PREFETCH_BLOCKS ahead) take over: at once, so that their loads overlap instead of
    waiting one after another."""
    rows = block_rows(w[W_ACTIVATIONS], w[W_ROW_BYTES])
    prefetch_rows(w, row_begin, min(PREFETCH_BLOCKS * rows, row_end - row_begin))


@helper
def prefetch_head(w, row_begin):
    """Request the first HEAD_ROWS rows from row_begin of a weight."""
    prefetch_rows(w, row_begin, HEAD_ROWS)


@helper
def dequantize_rows(w, row_begin, n_rows, tile):
    """tile[r, :K_padded] = float32 values of W[row_begin + r]."""
    call_dequantize(w[W_DEQUANTIZE_FN], w.ctypes.data, row_begin, n_rows, tile.ctypes.data, tile.shape[1])


@helper
def gemm_rows(w, row_begin, row_end, xt, xq, n_tokens, tile, block, out, out_col, accumulate, transposed):
    """out[t, out_col + r - row_begin] (+)= dot(W[r], x[t]) for r in [row_begin, row_end), t < n_tokens
    (transposed: out[out_col + r - row_begin, t]). xq: xt quantized (quantized_tokens_shape) where the
    weight reads int8 tokens (W_PREFILL_INT8), else not read."""
    if row_end > row_begin:
        quantized_chunks = quantized_capacity(xq) if w[W_PREFILL_INT8] else 0
        call_gemm(w[W_GEMM_FN], w.ctypes.data, row_begin, row_end, xt.ctypes.data, xt.shape[1], xq.ctypes.data,
                  quantized_chunks, n_tokens,
                  tile.ctypes.data, tile.shape[1], block.ctypes.data, out.ctypes.data, out.shape[1], out_col,
                  1 if accumulate else 0, 1 if transposed else 0)


@helper
def add_bias(out, t_begin, t_end, col, bias):
    """out[t, col + i] += bias[i] for t in [t_begin, t_end)."""
    for t in range(t_begin, t_end):
        for i in range(bias.shape[0]):
            out[t, col + i] += bias[i]


@helper
def split(total, parts, part, align):
    """[begin, end) of part `part` of `parts` near-equal pieces of range(total), cut at multiples of align."""
    units = -(-total // align)
    begin = (units * part // parts) * align
    end = (units * (part + 1) // parts) * align
    return min(begin, total), min(end, total)


# --------------------------------------------------------------------------------------------
# Public kernel (op by op): the backend's `linear`

_f32_2d, _f32_1d, _f32_3d = mutable(types.float32, 2), mutable(types.float32, 1), mutable(types.float32, 3)
_LINEAR_SIGNATURE = types.void(readonly(types.int64, 1), readonly(types.float32, 2), readonly(types.float32, 1),
                               types.boolean, _f32_2d, types.int64, _f32_3d, _f32_2d, _f32_1d, _f32_1d, _f32_1d,
                               _f32_2d, _f32_2d, _f32_1d)


@kernel(_LINEAR_SIGNATURE, parallel=True)
def linear_kernel(w, x, bias, has_bias, out, n_threads, tiles, blocks, x_natural, x_pairs, x_sums, xt, xq, row_out):
    """out [T, N] = x [T, K] W^T (+ bias); W given by its descriptor; the rest is scratch.

    Decode runs one parallel stage (row dot products), prefill two (transpose x, then tiles)."""
    n_tokens = x.shape[0]
    n_rows = w[W_ROWS]
    if n_tokens == 1:
        prepare_vector(x[0], x_natural, x_pairs, x_sums, w[W_ACTIVATIONS])
    for stage in range(1 if n_tokens == 1 else 2):
        for part in prange(n_threads):
            if n_tokens == 1:
                begin, end = split(n_rows, n_threads, part, MATVEC_BLOCK)
                matvec_rows(w, begin, end, x_natural, x_pairs, x_sums, row_out)
            elif stage == 0:
                k_begin, k_end = split(xt.shape[0], n_threads, part, CHUNK)
                transpose_tokens(x, xt, k_begin, k_end)
                if w[W_PREFILL_INT8]:
                    quantize_tokens(xt.ctypes.data, xt.shape[1], k_begin // CHUNK, k_end // CHUNK, xt.shape[1],
                                    xq.ctypes.data, quantized_capacity(xq), tiles[part].ctypes.data)
            else:
                begin, end = split(n_rows, n_threads, part, TILE_M)
                gemm_rows(w, begin, end, xt, xq, n_tokens, tiles[part], blocks[part], out, begin, False, False)
    if n_tokens == 1:
        for r in range(n_rows):
            out[0, r] = row_out[r]
    if has_bias:
        add_bias(out, 0, n_tokens, 0, bias)


def linear(descriptor: np.ndarray, x: np.ndarray, bias: np.ndarray | None, n_threads: int) -> np.ndarray:
    """x [T, K] float32 times the weight described by `descriptor`, plus bias: -> [T, N] float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n_tokens, k = x.shape
    if k != descriptor[W_COLS]:
        raise ValueError(f"linear: x has {k} features, the weight expects {descriptor[W_COLS]}")
    n_rows, k_padded = int(descriptor[W_ROWS]), int(descriptor[W_COLS_PADDED])
    out = np.empty((n_tokens, n_rows), np.float32)
    prefill = n_tokens > 1
    tiles = np.empty((n_threads, tile_scratch_rows(n_tokens), k_padded) if prefill else (n_threads, 1, 1), np.float32)
    blocks = np.empty((n_threads, BLOCK_FLOATS), np.float32)
    vector_len = CHUNK if prefill else k_padded
    xt = np.empty((k_padded, padded_tokens(n_tokens)) if prefill else (1, 1), np.float32)
    bias_array = np.zeros(0, np.float32) if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
    linear_kernel(descriptor, x, bias_array, bias is not None, out, n_threads, tiles, blocks,
                  np.empty(vector_len, np.float32), np.empty(pairs_length(vector_len), np.float32),
                  np.empty(sums_length(vector_len), np.float32), xt,
                  np.empty(quantized_tokens_shape(k_padded, n_tokens) if prefill else (1, 1), np.float32),
                  np.empty(n_rows, np.float32))
    return out
