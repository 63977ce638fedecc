"""Hand-written LLVM IR for prefill: dequantize a block of weight rows into an f32 (or bf16) tile,
then multiply the tile by many tokens in a register-blocked micro-kernel (kernels/cpu/linear.py gemm).

Like llvm_ir.py (whose Emitter, layouts and vector types it uses): Numba intrinsics whose IR is
emitted into the calling kernel, int64 addresses and sizes as arguments, generic vector types that
LLVM lowers to the target's registers; AVX-512 BF16's vdpbf16ps is the one target-specific
instruction, emitted only into the bf16 kernels (cpu_probe.py decides where they run).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import errors
from numba.extending import intrinsic

from kernels.cpu.llvm_ir import (_MADD, ACT_F32, ACT_INT8, CHUNK, F32, I32, INT8_DOTS, INT64_ARGS, LANES, V16F, V16I8,
                                V16I32, V32I8, V64I8, Emitter, IrFormat, _joined, _pair_sums, _pieces, _widen_pairs,
                                byte_dot, load_float_weight, load_float_weights)


class _BFloat(ir.types.Type):
    """LLVM's bfloat, which llvmlite has no class for; only ever a vector element here, bitcast
    from 32-bit lanes that each hold a pair of bf16 values."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


V16BF, V32BF = ir.VectorType(_BFloat(), 16), ir.VectorType(_BFloat(), 32)




def _emit_dequantize_rows(e: Emitter, fmt: IrFormat, args, bf16: bool = False):
    data, row_bytes, scales, offsets, n_groups, chunks_per_group, cols, row0, n_rows, tile, tile_stride = args
    with e.loop(n_rows) as row_loop:
        row = e.b.add(row0, row_loop.index)
        row_data = e.address(data, (row, row_bytes))
        tile_row = e.address(tile, (row_loop.index, e.b.mul(tile_stride, e.i64(2 if bf16 else 4))))
        if fmt.is_float:
            _emit_float_row_copy(e, fmt, row_data, cols, tile_row)
        else:
            _emit_quantized_row(e, fmt, row_data, row, scales, offsets, n_groups, chunks_per_group, tile_row, bf16)


def _emit_quantized_row(e: Emitter, fmt: IrFormat, row_data, row, scales, offsets, n_groups, chunks_per_group,
                        tile_row, bf16: bool = False):
    row_scales = e.address(scales, (row, e.b.mul(n_groups, e.i64(fmt.scale_bytes))))
    row_offsets = e.address(offsets, (row, e.b.mul(n_groups, e.i64(fmt.scale_bytes))))
    zero_point = ir.Constant(V16F, [float(fmt.zero_point)] * LANES)
    with e.loop(n_groups) as group_loop:
        group = group_loop.index
        scale = e.splat(e.scale(fmt.scale_bytes, row_scales, group))
        offset = e.splat(e.scale(fmt.scale_bytes, row_offsets, group)) if fmt.affine else None
        with e.loop(chunks_per_group) as chunk_loop:
            chunk = e.b.add(e.b.mul(group, chunks_per_group), chunk_loop.index)
            if fmt.bits == 4:
                low, high = e.unpack_int4(e.load(V16I8, e.address(row_data, (chunk, 16)), 1))
                # interleave back to natural order: weight 2j = low[j], weight 2j+1 = high[j]
                codes = e.b.shuffle_vector(low, high, ir.Constant(
                    ir.VectorType(I32, 32), [i // 2 + (16 if i % 2 else 0) for i in range(32)]))
            else:
                codes = e.load(V32I8, e.address(row_data, (chunk, 32)), 1)
            for half_index, half_codes in enumerate(e.halves(codes)):
                q = e.codes_to_float(half_codes)
                # The reference's arithmetic, without fused multiply-add, so that the tile holds exactly
                # quant.dequantize's values: s * q + o (affine) or s * (q - z) (symmetric).
                if fmt.affine:
                    value = e.b.fadd(e.b.fmul(scale, q), offset)
                else:
                    value = e.b.fmul(scale, e.b.fsub(q, zero_point))
                if bf16:  # rounded to the nearest bf16, ties to even (vcvtneps2bf16)
                    destination = e.address(tile_row, (chunk, 2 * CHUNK), e.i64(2 * LANES * half_index))
                    e.store(e.b.fptrunc(value, V16BF), destination, 2)
                else:
                    destination = e.address(tile_row, (chunk, 4 * CHUNK), e.i64(4 * LANES * half_index))
                    e.store(value, destination, 4)


def _emit_float_row_copy(e: Emitter, fmt: IrFormat, row_data, cols, tile_row):
    width = fmt.bits // 8
    n_vectors = e.b.udiv(cols, e.i64(LANES))
    with e.loop(n_vectors) as vector_loop:
        v = vector_loop.index
        e.store(load_float_weights(e, fmt, e.address(row_data, (v, width * LANES))),
                e.address(tile_row, (v, 4 * LANES)), 4)
    first_tail = e.b.mul(n_vectors, e.i64(LANES))
    with e.loop(e.b.sub(cols, first_tail)) as tail_loop:
        k = e.b.add(first_tail, tail_loop.index)
        e.store(load_float_weight(e, fmt, e.address(row_data, (k, width))), e.address(tile_row, (k, 4)), 4)


def make_dequantize_rows(formats: dict[int, IrFormat]):
    """Intrinsic: tile[r, :] = float32 values of weight row row0 + r, for r < n_rows (bf16, quantized
    formats only: the same values rounded to bf16, two bytes each).

    Arguments: kind (a key of `formats`) and bf16 (0 or 1), both compile-time constants, then the
    int64 data, row_bytes, scales, offsets, n_groups, chunks_per_group, cols, row0, n_rows, tile,
    tile_stride (elements between tile rows). Quantized rows are written in full groups (n_groups *
    group_size values, padding included); float rows write `cols` values."""

    @intrinsic
    def dequantize_rows(typingctx, kind, bf16, data, row_bytes, scales, offsets, n_groups, chunks_per_group, cols,
                        row0, n_rows, tile, tile_stride):
        for name, literal in (("kind", kind), ("bf16", bf16)):
            if not isinstance(literal, types.IntegerLiteral):
                raise errors.TypingError(f"dequantize_rows: {name} must be a compile-time integer constant, "
                                         f"got {literal}")
        fmt, to_bf16 = formats[kind.literal_value], bool(bf16.literal_value)
        if to_bf16 and fmt.is_float:
            raise errors.TypingError(f"bf16 tiles are for quantized weights; {fmt.name} rows are copied as f32")
        signature = types.void(kind, bf16, *([INT64_ARGS] * 11))

        def codegen(context, builder, sig, args):
            _emit_dequantize_rows(Emitter(builder), fmt, args[2:], to_bf16)
            return context.get_dummy_value()

        return signature, codegen

    return dequantize_rows


def bf16_pair_dot(e: Emitter, acc, pairs_a, pairs_b):
    """acc (<16 x float>) + a[2i] * b[2i] + a[2i + 1] * b[2i + 1] in lane i, where a and b are
    <16 x i32> whose lanes each hold two bf16 values (the lower address first): vdpbf16ps."""
    return e.intrinsic("llvm.x86.avx512bf16.dpbf16ps.512", V16F,
                       [acc, e.b.bitcast(pairs_a, V32BF), e.b.bitcast(pairs_b, V32BF)])


def make_tile_times_tokens(rows: int, token_vectors: int, bf16: bool = False):
    """Intrinsic: block[r, t] = sum_k tile[r, k] * xt[k, t] for r < rows, t < 16 * token_vectors,
    or with `resume` block[r, t] + that sum (the same multiply-adds in the same order as one call
    over the whole depth, so a depth cut into slices gives the same bits).

    Arguments (all int64): tile (f32, rows apart by tile_stride elements), tile_stride, xt (f32
    tokens-minor: xt[k, t] at xt + 4 * (k * xt_stride + t)), xt_stride, depth (number of k), block
    (f32 [rows, 16 * token_vectors], written), resume (0 or 1). The register block holds rows * token_vectors
    accumulators; each k costs token_vectors loads of x, `rows` broadcasts of a weight and
    rows * token_vectors fused multiply-adds, so the loop is bound by multiply-adds, not loads.

    bf16 (AVX-512 BF16 only): the same on bf16 inputs with f32 sums, twice the multiply-adds per
    instruction. tile holds bf16 bits (uint16, rows apart by tile_stride elements) and xt is x
    transposed into pairs: the 32-bit word at xt + 4 * (i * xt_stride + t) holds x[t, 2i] in its low
    half and x[t, 2i + 1] in its high half; depth is even, and each pair of k costs token_vectors
    loads of x pairs, `rows` broadcasts of a weight pair and rows * token_vectors vdpbf16ps."""
    element, x_type, w_type, w_align = (2, V16I32, I32, 2) if bf16 else (4, V16F, F32, 4)

    @intrinsic
    def tile_times_tokens(typingctx, tile, tile_stride, xt, xt_stride, depth, block, resume):
        signature = types.void(*([INT64_ARGS] * 7))

        def codegen(context, builder, sig, args):
            tile, tile_stride, xt, xt_stride, depth, block, resume = args
            e = Emitter(builder)
            zero = ir.Constant(V16F, [0.0] * LANES)
            tile_rows = [e.address(tile, (e.b.mul(tile_stride, e.i64(r)), element)) for r in range(rows)]
            steps = e.b.sdiv(depth, e.i64(2)) if bf16 else depth  # (bf16: pairs of k)
            pass_rows, pass_vectors = micro_kernel_pass(rows, token_vectors)
            resuming = builder.icmp_signed("!=", resume, e.i64(0))

            def block_vector(r, j):  # address of block[r, 16 j : 16 j + 16]
                return e.address(block, e.i64(4 * (r * token_vectors * LANES + j * LANES)))

            # one pass over k per part of the block whose accumulators fit the registers
            for first_row in range(0, rows, pass_rows):
                for first_vector in range(0, token_vectors, pass_vectors):
                    pass_rows_here = range(first_row, min(rows, first_row + pass_rows))
                    vectors = range(first_vector, min(token_vectors, first_vector + pass_vectors))
                    accumulators = {}
                    for r in pass_rows_here:
                        for j in vectors:
                            stored = e.load(V16F, block_vector(r, j), 4)
                            accumulators[r, j] = e.variable(builder.select(resuming, stored, zero))
                    with e.loop(steps) as step_loop:
                        k = step_loop.index
                        x_row = e.address(xt, (e.b.mul(k, xt_stride), 4))
                        xs = {j: e.load(x_type, e.address(x_row, e.i64(4 * LANES * j)), 4) for j in vectors}
                        for r in pass_rows_here:
                            w = e.splat(e.load(w_type, e.address(tile_rows[r], (k, 4)), w_align))
                            for j in vectors:
                                acc = accumulators[r, j]
                                total = bf16_pair_dot(e, builder.load(acc), xs[j], w) if bf16 else \
                                    e.fma(w, xs[j], builder.load(acc))
                                builder.store(total, acc)
                    for (r, j), acc in accumulators.items():
                        e.store(builder.load(acc), block_vector(r, j), 4)
            return context.get_dummy_value()

        return signature, codegen

    tile_times_tokens.__name__ = f"{'bf16_' if bf16 else ''}tile_times_tokens_{rows}x{16 * token_vectors}"
    return tile_times_tokens


def micro_kernel_pass(rows: int, token_vectors: int) -> tuple[int, int]:
    """(rows, token vectors) of a rows x token_vectors register block that one pass over k keeps in
    registers, for the vector registers of the kernels' target (isa.vector_registers): every
    accumulator in a register, with 4 left for the inputs (x and a broadcast weight). AVX-512's 32
    zmm hold 6 x 2 vectors of 16 tokens at once; AVX2's 16 ymm, 6 x 1 (each vector two ymm)."""
    from kernels.cpu.isa import vector_registers

    count, bits = vector_registers()
    per_vector = max(1, LANES * 32 // bits)  # registers one <16 x float> takes
    budget = max(per_vector, count - 4)
    vectors = token_vectors if rows * token_vectors * per_vector <= budget else 1
    fitting = [r for r in range(rows, 0, -1) if rows % r == 0 and r * vectors * per_vector <= budget]
    return (fitting[0] if fitting else 1), vectors


# --------------------------------------------------------------------------------------------
# Integer prefill: int8 activations times the weight's own codes, the decode's int8 arithmetic
# applied to a block of tokens
#
# A panel holds PANEL_ROWS weight rows as codes, four consecutive k of every row side by side:
# quad j (k = 4j .. 4j + 3) is 64 bytes, row r's four codes at bytes 4r .. 4r + 3. One <64 x i8>
# load of a quad then meets a token's four quantized inputs broadcast to every row, and one
# byte_dot (vpdpbusd, pmaddubsw + pmaddwd, sdot...) adds each row's four products into its own
# 32-bit lane: the lanes are rows, so a chunk of 32 k needs no horizontal sum, only one scale per
# row and token. Inputs come quantized per token and chunk of 32 (the decode's rounding), as a record
# of QUANTIZED_WORDS 32-bit words per chunk c and token t:
#     words 0 .. 7  the codes of k = 32c .. 32c + 31 as int8, in k order (word j: k = 32c + 4j ..)
#     word 8        f32 d = max|x| / 127 of the chunk
#     word 9        i32 the sum of the chunk's codes
# Tokens go in groups of G (the micro-kernel's tokens per call), each group's records chunk by chunk:
# record (c, t) is number (t // G) * C * G + c * G + t % G of a buffer of C chunks. A call then reads
# its tokens' inputs in order, every one at a constant offset from its chunk's first record.
# Symmetric codes start their lanes at -z * sum(q), so that the lanes sum (code - z) * q; affine
# ones add o * d * sum(q) per chunk: w = s (code - z) or s code + o, and x^ = d q.

PANEL_ROWS = 16
QUADS_PER_CHUNK = CHUNK // 4
RECORD_SCALE, RECORD_SUM = QUADS_PER_CHUNK, QUADS_PER_CHUNK + 1  # words of a chunk's record
QUANTIZED_WORDS = QUADS_PER_CHUNK + 2


def integer_prefill_runs(style: int) -> bool:
    """Whether quantized weights (int4 and int8 codes alike) prefill on integer panels in activation
    style `style`: with every int8 instruction. Generic IR keeps f32 tiles: nothing here has
    measured it faster."""
    return style not in (ACT_F32, ACT_INT8)


def signed_panel_codes(bits: int, style: int) -> bool:
    """Whether a panel holds int8 codes as signed bytes (code - 128): for the instructions that multiply
    signed bytes (sdot) or saturate on unsigned ones above 127 (pmaddubsw, which then takes |code - 128|
    times q with the code's sign, as decode does)."""
    return bits == 8 and INT8_DOTS[style].signed_codes


def _int16_pairs_fit(style: int, signed: bool) -> bool:
    """pmaddubsw's int16 pair sums of a whole chunk (8 quads of int4 codes <= 15 times |q| <= 127:
    at most 8 * 2 * 15 * 127 = 30480) are added in int16 and widened once per chunk; int8 codes'
    pairs (up to 2 * 128 * 127) are widened at once."""
    return style in _MADD and not signed


@intrinsic
def pack_panel(typingctx, bits, signed, scale_bytes, data, row_bytes, scales, offsets, n_groups, chunks_per_group,
               row0, n_rows, panel, factors, panel_offsets):
    """Rows row0 .. row0 + n_rows of a quantized weight into a panel (layout above): their codes
    (int4 unpacked to bytes; int8 ones as code - 128 where `signed`, signed_panel_codes), and per chunk
    and row the f32 scale (factors [K / 32, 16]) and, for affine weights (offsets != 0), the f32 offset
    (panel_offsets [K / 32, 16]). `bits` (4 or 8), `signed` (0 or 1) and `scale_bytes` (2: f16 scales and
    offsets, 4: f32) are compile-time constants; the rest are int64. Rows past n_rows are left as they are."""
    for name, literal in (("bits", bits), ("signed", signed), ("scale_bytes", scale_bytes)):
        if not isinstance(literal, types.IntegerLiteral):
            raise errors.TypingError(f"pack_panel: {name} must be a compile-time integer constant, got {literal}")
    code_bits, signed_codes, width = bits.literal_value, bool(signed.literal_value), scale_bytes.literal_value
    signature = types.void(bits, signed, scale_bytes, *([INT64_ARGS] * 11))

    def codegen(context, builder, sig, args):
        (_, _, _, data, row_bytes, scales, offsets, n_groups, chunks_per_group, row0, n_rows, panel, factors,
         panel_offsets) = args
        e = Emitter(builder)
        n_chunks = e.b.mul(n_groups, chunks_per_group)
        affine = e.b.icmp_unsigned("!=", offsets, e.i64(0))
        natural_order = ir.Constant(ir.VectorType(I32, 32), [i // 2 + (16 if i % 2 else 0) for i in range(32)])
        with e.loop(n_rows) as row_loop:
            r = row_loop.index
            row = e.b.add(row0, r)
            row_data = e.address(data, (row, row_bytes))
            row_scales = e.address(scales, (row, e.b.mul(n_groups, e.i64(width))))
            row_offsets = e.address(offsets, (row, e.b.mul(n_groups, e.i64(width))))
            with e.loop(n_chunks) as chunk_loop:
                c = chunk_loop.index
                if code_bits == 4:
                    low, high = e.unpack_int4(e.load(V16I8, e.address(row_data, (c, 16)), 1))
                    codes = e.b.shuffle_vector(low, high, natural_order)
                else:
                    codes = e.load(V32I8, e.address(row_data, (c, 32)), 1)
                    if signed_codes:
                        codes = e.b.xor(codes, ir.Constant(V32I8, [-128] * 32))
                words = e.b.bitcast(codes, ir.VectorType(I32, QUADS_PER_CHUNK))
                for j in range(QUADS_PER_CHUNK):
                    quad = e.b.add(e.b.mul(c, e.i64(QUADS_PER_CHUNK)), e.i64(j))
                    e.store(e.b.extract_element(words, ir.Constant(I32, j)),
                            e.address(panel, (quad, 4 * PANEL_ROWS), (r, 4)), 4)
                group = e.b.udiv(c, chunks_per_group)
                at = e.address(e.i64(0), (c, 4 * PANEL_ROWS), (r, 4))
                e.store(e.scale(width, row_scales, group), e.b.add(factors, at), 4)
                with e.b.if_then(affine):
                    e.store(e.scale(width, row_offsets, group), e.b.add(panel_offsets, at), 4)
        return context.get_dummy_value()

    return signature, codegen


def make_panel_times_tokens(n_tokens: int):
    """Intrinsic: block[t, r] = sum_k w[r, k] * x^[t, k] for the panel's 16 rows r and n_tokens
    tokens t, w the panel's weights and x^ the quantized inputs (layouts above).

    Arguments: style (an int8 activation style, llvm_ir.ACT_INT8_*), affine (0 or 1) and signed (1:
    the panel's codes are signed bytes, signed_panel_codes), compile-time constants, then the int64
    panel, factors, panel_offsets, xq (the quantized tokens: the records of the block's group of
    n_tokens tokens), n_chunks, zero (the zero point of the panel's codes: the symmetric codes' one,
    0 for affine ones, less 128 where signed) and block (f32 [n_tokens, 16], written).
    Per chunk the integer sums are exact; each row and token adds sum * s * d (+ o * d * sum(q)) in
    f32, chunk after chunk, so the bits depend on the inputs alone."""

    @intrinsic
    def panel_times_tokens(typingctx, style, affine, signed, panel, factors, panel_offsets, xq, n_chunks, zero,
                           block):
        for name, literal in (("style", style), ("affine", affine), ("signed", signed)):
            if not isinstance(literal, types.IntegerLiteral):
                raise errors.TypingError(f"panel_times_tokens: {name} must be a compile-time integer constant")
        activation_style, has_offsets = style.literal_value, bool(affine.literal_value)
        signed_codes = bool(signed.literal_value)
        signature = types.void(style, affine, signed, *([INT64_ARGS] * 7))

        def codegen(context, builder, sig, args):
            _, _, _, panel, factors, panel_offsets, xq, n_chunks, zero, block = args
            e = Emitter(builder)
            tokens = range(n_tokens)
            totals = [e.variable(ir.Constant(V16F, [0.0] * LANES)) for _ in tokens]
            minus_zero = e.b.trunc(e.b.sub(e.i64(0), zero), I32)
            with e.loop(n_chunks) as chunk_loop:
                c = chunk_loop.index
                records = e.address(xq, (c, 4 * QUANTIZED_WORDS * n_tokens))

                def word(t, index):  # the address of word `index` of token t's record of this chunk
                    return e.address(records, e.i64(4 * (QUANTIZED_WORDS * t + index)))

                code_sums = [e.load(I32, word(t, RECORD_SUM), 4) for t in tokens]
                starts = [e.splat(e.b.mul(minus_zero, total)) for total in code_sums]

                def quad_data(j):
                    quad = e.b.add(e.b.mul(c, e.i64(QUADS_PER_CHUNK)), e.i64(j))
                    codes = e.load(V64I8, e.address(panel, (quad, 4 * PANEL_ROWS)), 4)
                    inputs = [e.b.bitcast(e.splat(e.load(I32, word(t, j), 4)), V64I8) for t in tokens]
                    return codes, inputs

                if _int16_pairs_fit(activation_style, signed_codes):
                    width = _MADD[activation_style][0]
                    pairs = [None] * n_tokens
                    for j in range(QUADS_PER_CHUNK):
                        codes, inputs = quad_data(j)
                        code_pieces = _pieces(e, codes, width)
                        for t in tokens:
                            sums = [_pair_sums(e, activation_style, a, b)
                                    for a, b in zip(code_pieces, _pieces(e, inputs[t], width))]
                            pairs[t] = sums if j == 0 else [e.b.add(p, s) for p, s in zip(pairs[t], sums)]
                    lanes = [e.b.add(starts[t], _joined(e, [_widen_pairs(e, activation_style, p) for p in pairs[t]]))
                             for t in tokens]
                else:
                    lanes = list(starts)
                    for j in range(QUADS_PER_CHUNK):
                        codes, inputs = quad_data(j)
                        lanes = [byte_dot(e, lanes[t], codes, inputs[t], activation_style, signed_codes)
                                 for t in tokens]
                scale = e.load(V16F, e.address(factors, (c, 4 * PANEL_ROWS)), 4)
                offset = e.load(V16F, e.address(panel_offsets, (c, 4 * PANEL_ROWS)), 4) if has_offsets else None
                for t in tokens:
                    d = e.load(F32, word(t, RECORD_SCALE), 4)
                    total = e.fma(e.b.sitofp(lanes[t], V16F), e.fmul(scale, e.splat(d)), builder.load(totals[t]))
                    if has_offsets:
                        total = e.fma(offset, e.splat(e.fmul(d, e.b.sitofp(code_sums[t], F32))), total)
                    builder.store(total, totals[t])
            for t in tokens:
                e.store(builder.load(totals[t]), e.address(block, e.i64(4 * LANES * t)), 4)
            return context.get_dummy_value()

        return signature, codegen

    panel_times_tokens.__name__ = f"panel_times_{n_tokens}_tokens"
    return panel_times_tokens
