"""Hand-written LLVM IR for the inner loops that Numba's auto-vectoriser does not produce well.

Each function here is a Numba `@intrinsic`: its IR is emitted into the calling kernel, so it is
compiled, optimised and cached together with that kernel. The arithmetic uses LLVM's generic
vector types (<16 x float>, <64 x i8>)
and generic intrinsics (llvm.vector.reduce.fadd, llvm.prefetch, llvm.masked.load, llvm.cttz), so
LLVM lowers it to whatever the target has (kernels/cpu/isa.py): zmm registers with AVX-512, pairs of
ymm with AVX2, NEON quads on ARM. Target-specific instructions are few: the spin-wait hint of
`spin_pause`, chosen by the architecture; the integer dot products of int8 activations (INT8_DOTS:
AVX-512 VNNI or AVX-VNNI vpdpbusd, AVX2 or SSSE3 pmaddubsw + pmaddwd, ARM sdot or usdot), each emitted
only into the kernels of its activation style; and AVX-512 BF16's vdpbf16ps for prefill's bf16 tiles
(llvm_prefill.py). The CPU backend picks each only after a child process has run it on known
data (cpu_probe.py): feature flags alone are not trusted (a CPU can advertise extensions it cannot
run).

Arguments are int64 byte addresses and sizes; the calling kernel owns the arrays (and their
lifetime) and passes `array.ctypes.data`. Layouts (quant/formats.py):

    int4: a chunk of 32 weights is 16 bytes; byte j holds weight 2j (low nibble) and 2j+1 (high).
    int8: a chunk of 32 weights is 32 bytes, one code per byte.
    A group (one f16 scale, one f16 offset if affine; f32 ones in the formats with
    scale_bytes 4) is 1, 2 or 4 chunks (group size 32/64/128).

Dot products with x use x prepared once per input vector (kernels/cpu/linear.py):
    x     f32 [K_pad]   natural order, zero beyond K
    xp    f32 [K_pad]   int4 order: per chunk of 32, the 16 even elements then the 16 odd ones
                        (int8 activations: the Q8 layout below instead)
    xsum  f32 [K_pad/group size]  sum of x over each group (of the weight's group size)

so that a row's dot product is, per group g with scale s and offset o,
    affine:    s * sum(q * x) + o * sum(x)
    symmetric: s * sum(q * x) - z * s * sum(x)      (z = 8 for int4, 128 for int8)
and the codes q never need their zero point subtracted inside the loop.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir
from numba import types
from numba.core import cgutils, errors
from numba.extending import intrinsic

from kernels.cpu.runtime import IR_FASTMATH

LANES = 16  # f32 lanes per vector: one zmm on AVX-512, two ymm elsewhere (LLVM splits it)
CHUNK = 32  # weights per chunk: the smallest group size
# How a decode dot product takes its input vector (make_dot_rows): as f32 values, or quantized to
# int8 per chunk with integer dot products summed by one of INT8_DOTS' instructions.
(ACT_F32, ACT_INT8, ACT_INT8_SSSE3, ACT_INT8_AVX2, ACT_INT8_AVXVNNI, ACT_INT8_VNNI, ACT_INT8_DOTPROD,
 ACT_INT8_I8MM) = range(8)

F32, F16 = ir.FloatType(), ir.HalfType()
I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
V16F = ir.VectorType(F32, LANES)
V16I8, V32I8 = ir.VectorType(I8, 16), ir.VectorType(I8, 32)
V16I16 = ir.VectorType(I16, 16)
V16I32 = ir.VectorType(I32, 16)
V16H = ir.VectorType(F16, 16)


@dataclass(frozen=True)
class IrFormat:
    """How a weight row is stored, as far as the emitted IR cares."""

    name: str
    bits: int  # 4, 8 (codes) or 16, 32 (floats)
    affine: bool = False
    scale_bytes: int = 2  # of each group scale and offset: 2 (f16) or 4 (f32)

    @property
    def is_float(self) -> bool:
        return self.bits >= 16

    @property
    def zero_point(self) -> int:
        return 1 << (self.bits - 1)


class Emitter:
    """Small helpers over an llvmlite IRBuilder: addresses, vectors, fast-math arithmetic."""

    def __init__(self, builder: ir.IRBuilder):
        self.b = builder

    @staticmethod
    def i64(value: int) -> ir.Constant:
        return ir.Constant(I64, value)

    def address(self, base, *terms):
        """base + sum(terms), each term an i64 value or an (i64 value, int scale) pair."""
        result = base
        for term in terms:
            if isinstance(term, tuple):
                value, scale = term
                term = self.b.mul(value, self.i64(scale)) if isinstance(scale, int) else self.b.mul(value, scale)
            result = self.b.add(result, term)
        return result

    def load(self, ty, address, align: int):
        return self.b.load(self.b.inttoptr(address, ty.as_pointer()), align=align)

    def store(self, value, address, align: int) -> None:
        self.b.store(value, self.b.inttoptr(address, value.type.as_pointer()), align=align)

    def half(self, address):
        return self.b.fpext(self.load(F16, address, 2), F32)

    def scale(self, scale_bytes: int, base, index):
        """Element `index` of a group scale (or offset) array at `base`, f16 or f32 by its width, as f32."""
        if scale_bytes == 4:
            return self.load(F32, self.address(base, (index, 4)), 4)
        return self.half(self.address(base, (index, 2)))

    def scales(self, scale_bytes: int, base, index, count: int):
        """Elements index .. index + count - 1 of a group scale (or offset) array, as <count x float>."""
        if scale_bytes == 4:
            return self.load(ir.VectorType(F32, count), self.address(base, (index, 4)), 4)
        halves = self.load(ir.VectorType(I16, count), self.address(base, (index, 2)), 2)
        return self.b.fpext(self.b.bitcast(halves, ir.VectorType(F16, count)), ir.VectorType(F32, count))

    def half_splat(self, address):
        """<16 x float> of one f16 value: broadcast as f16, then one vector conversion (two
        instructions instead of load, convert, broadcast)."""
        return self.b.fpext(self.splat(self.load(F16, address, 2)), V16F)

    def splat(self, scalar, lanes: int = LANES):
        vec_type = ir.VectorType(scalar.type, lanes)
        vec = self.b.insert_element(ir.Constant(vec_type, ir.Undefined), scalar, ir.Constant(I32, 0))
        lane_zero = ir.Constant(ir.VectorType(I32, lanes), [0] * lanes)
        return self.b.shuffle_vector(vec, ir.Constant(vec_type, ir.Undefined), lane_zero)

    def fmul(self, a, b):
        return self.b.fmul(a, b, flags=IR_FASTMATH)

    def fadd(self, a, b):
        return self.b.fadd(a, b, flags=IR_FASTMATH)

    def fma(self, a, b, c):
        """a * b + c; with 'contract' LLVM fuses it into one instruction."""
        return self.fadd(self.fmul(a, b), c)

    def fma_in_order(self, a, b, c):
        """a * b + c, fused where the target fuses, never reassociated: a loop summing with it sums in
        its own order, which a vectorised reduction would change with the trip count."""
        return self.b.fadd(self.b.fmul(a, b, flags=("contract",)), c, flags=("contract",))

    def intrinsic(self, name: str, result_type, operands, **call_options):
        """A call of the LLVM intrinsic `name` (declared on first use, typed by its operands)."""
        function = cgutils.get_or_insert_function(self.b.module,
                                                  ir.FunctionType(result_type, [o.type for o in operands]), name)
        return self.b.call(function, operands, **call_options)

    def hsum(self, vector):
        return self.intrinsic(f"llvm.vector.reduce.fadd.v{vector.type.count}f32", F32,
                              [ir.Constant(F32, 0.0), vector], fastmath=IR_FASTMATH)

    def variable(self, initial):
        """A mutable local (an alloca in the entry block; mem2reg turns it into a register)."""
        return cgutils.alloca_once_value(self.b, initial)

    def loop(self, count):
        return cgutils.for_range(self.b, count)

    def prefetch_range(self, begin, n_bytes):
        """Hint the lines of [begin, begin + n_bytes) into L2 (llvm.prefetch never faults, so
        addresses past the end of a matrix are harmless). Locality 2, x86's prefetcht1: L2 keeps
        more misses in flight than L1's few miss buffers, so a stream of requests runs faster."""
        n_lines = self.b.udiv(self.b.add(n_bytes, self.i64(63)), self.i64(64))
        with self.loop(n_lines) as line_loop:
            address = self.address(begin, (line_loop.index, 64))
            self.intrinsic("llvm.prefetch.p0", ir.VoidType(), [self.b.inttoptr(address, I8.as_pointer()),
                                                                ir.Constant(I32, 0), ir.Constant(I32, 2),
                                                                ir.Constant(I32, 1)])

    def unpack_int4(self, packed):
        """<16 x i8> bytes -> (low nibbles, high nibbles): weights 2j and 2j+1 of the chunk."""
        low = self.b.and_(packed, ir.Constant(V16I8, [0x0F] * 16))
        high = self.b.lshr(packed, ir.Constant(V16I8, [4] * 16))
        return low, high

    def codes_to_float(self, codes):
        return self.b.uitofp(codes, ir.VectorType(F32, codes.type.count))

    def halves(self, vector32):
        """<32 x T> -> its two <16 x T> halves."""
        first = self.b.shuffle_vector(vector32, vector32, ir.Constant(ir.VectorType(I32, 16), list(range(16))))
        second = self.b.shuffle_vector(vector32, vector32, ir.Constant(ir.VectorType(I32, 16), list(range(16, 32))))
        return first, second


INT64_ARGS = types.int64


# --------------------------------------------------------------------------------------------
# Decode: dot products of weight rows with one input vector


def _quantized_chunk_dot(e: Emitter, fmt: IrFormat, row_data, chunk, x, xp):
    """sum over one chunk of 32 weights of q * x, as a <16 x float> of partial sums."""
    if fmt.bits == 4:
        # widen the 16 bytes once, then split the nibbles in 32-bit lanes: one zero-extension
        # instead of two, and the nibble masks become plain integer ops
        packed = e.b.zext(e.load(V16I8, e.address(row_data, (chunk, 16)), 1), V16I32)
        low = e.b.and_(packed, ir.Constant(V16I32, [0x0F] * 16))
        high = e.b.lshr(packed, ir.Constant(V16I32, [4] * 16))
        x_even = e.load(V16F, e.address(xp, (chunk, 128)), 4)
        x_odd = e.load(V16F, e.address(xp, (chunk, 128), e.i64(64)), 4)
        return e.fma(e.b.uitofp(low, V16F), x_even, e.fmul(e.b.uitofp(high, V16F), x_odd))
    codes = e.load(V32I8, e.address(row_data, (chunk, 32)), 1)
    first, second = e.halves(codes)
    x_first = e.load(V16F, e.address(x, (chunk, 128)), 4)
    x_second = e.load(V16F, e.address(x, (chunk, 128), e.i64(64)), 4)
    return e.fma(e.codes_to_float(first), x_first, e.fmul(e.codes_to_float(second), x_second))


# Decode streams the weights once per token: while one block of rows is multiplied, the block
# PREFETCH_BLOCKS ahead is requested (into L2, prefetch_range), so that memory
# latency overlaps the arithmetic. Measured on Zen 4 (matrices past the L3 cache, int8
# activations): requests into L1 (prefetcht0) held one thread to 15-20 GB/s, into L2 18-26, and
# 8 blocks ahead rather than 4 gained another few percent (2 threads: 31-36 GB/s of a ~36 GB/s
# read bandwidth).
PREFETCH_BLOCKS = 8


def _prefetch_rows_ahead(e: Emitter, n_rows: int, row0, row_bytes, arrays_and_row_sizes):
    ahead = e.b.add(row0, e.i64(PREFETCH_BLOCKS * n_rows))
    for base, bytes_per_row in arrays_and_row_sizes:
        e.prefetch_range(e.address(base, (ahead, bytes_per_row)), e.b.mul(bytes_per_row, e.i64(n_rows)))


def _quantized_rows(e: Emitter, fmt: IrFormat, n_rows: int, args):
    """Prefetch the rows PREFETCH_BLOCKS blocks ahead; (row indices, and the addresses of each row's
    codes, scales and offsets)."""
    data, row_bytes, scales, offsets, n_groups, _cpg, _cols, row0, _x, _xp, _xsum, _out = args
    group_bytes = e.b.mul(n_groups, e.i64(fmt.scale_bytes))
    _prefetch_rows_ahead(e, n_rows, row0, row_bytes,
                         [(data, row_bytes), (scales, group_bytes)] + ([(offsets, group_bytes)] if fmt.affine else []))
    rows = [e.b.add(row0, e.i64(r)) for r in range(n_rows)]
    return (rows, [e.address(data, (row, row_bytes)) for row in rows],
            [e.address(scales, (row, group_bytes)) for row in rows],
            [e.address(offsets, (row, group_bytes)) for row in rows])


def _group_shift(e: Emitter, chunks_per_group):
    """log2(chunks per group): a group is 32 << shift values."""
    return e.intrinsic("llvm.cttz.i64", I64, [chunks_per_group, ir.Constant(ir.IntType(1), 1)])


def _emit_quantized_dot_rows(e: Emitter, fmt: IrFormat, n_rows: int, args):
    _data, _row_bytes, _scales, _offsets, n_groups, chunks_per_group, _cols, _row0, x, xp, group_sums, out = args
    rows, row_data, row_scales, row_offsets = _quantized_rows(e, fmt, n_rows, args)
    zero = ir.Constant(V16F, [0.0] * LANES)

    # sum over chunks c of s[group(c)] * sum(q * x) over the chunk; one flat loop, group = c >> shift
    shift = _group_shift(e, chunks_per_group)
    accumulators = [e.variable(zero) for _ in range(n_rows)]
    with e.loop(e.b.shl(n_groups, shift)) as chunk_loop:
        chunk = chunk_loop.index
        group = e.b.lshr(chunk, shift)
        for r in range(n_rows):
            if fmt.scale_bytes == 4:
                scale = e.splat(e.scale(4, row_scales[r], group))
            else:
                scale = e.half_splat(e.address(row_scales[r], (group, 2)))
            partial = _quantized_chunk_dot(e, fmt, row_data[r], chunk, x, xp)
            e.b.store(e.fma(partial, scale, e.b.load(accumulators[r])), accumulators[r])

    _store_row_totals(e, fmt, n_rows, rows, accumulators, row_scales, row_offsets, n_groups, group_sums, out)


def _store_row_totals(e: Emitter, fmt: IrFormat, n_rows: int, rows, accumulators, row_scales, row_offsets, n_groups,
                      group_sums, out, zero_point_applied: bool = False):
    """out[row] = hsum(accumulator) + the zero point / offset term of each row (unless the
    accumulators already subtracted a symmetric zero point).

    That term is sum over groups of (o or s)[g] * sum(x over group g), as a vector dot product over
    16 groups at a time (group_sums: the sums of x over groups of this weight's size)."""
    if zero_point_applied and not fmt.affine:
        for r in range(n_rows):
            e.store(e.hsum(e.b.load(accumulators[r])), e.address(out, (rows[r], 4)), 4)
        return
    zero = ir.Constant(V16F, [0.0] * LANES)
    weights_of_sums = row_offsets if fmt.affine else row_scales
    corrections = [e.variable(zero) for _ in range(n_rows)]
    n_vectors = e.b.udiv(n_groups, e.i64(LANES))
    with e.loop(n_vectors) as vector_loop:
        v = vector_loop.index
        sums = e.load(V16F, e.address(group_sums, (v, 4 * LANES)), 4)
        for r in range(n_rows):
            w = e.scales(fmt.scale_bytes, weights_of_sums[r], e.b.mul(v, e.i64(LANES)), LANES)
            e.b.store(e.fma(w, sums, e.b.load(corrections[r])), corrections[r])
    # The last n_groups % 16 groups, summed one after the other: the same sum as a row that goes on with
    # groups of zero weight times zero input
    group_tails = [e.variable(ir.Constant(F32, 0.0)) for _ in range(n_rows)]
    first_tail = e.b.mul(n_vectors, e.i64(LANES))
    with e.loop(e.b.sub(n_groups, first_tail)) as tail_loop:
        g = e.b.add(first_tail, tail_loop.index)
        total = e.load(F32, e.address(group_sums, (g, 4)), 4)
        for r in range(n_rows):
            w = e.scale(fmt.scale_bytes, weights_of_sums[r], g)
            e.b.store(e.fma_in_order(w, total, e.b.load(group_tails[r])), group_tails[r])

    for r in range(n_rows):
        correction = e.fadd(e.hsum(e.b.load(corrections[r])), e.b.load(group_tails[r]))
        if not fmt.affine:
            correction = e.fmul(correction, ir.Constant(F32, -float(fmt.zero_point)))
        total = e.fadd(e.hsum(e.b.load(accumulators[r])), correction)
        e.store(total, e.address(out, (rows[r], 4)), 4)


# --------------------------------------------------------------------------------------------
# Decode with int8 activations: integer dot products, as llama.cpp's q8 path does
#
# The input vector is quantized per chunk of 32 values (kernels/cpu/linear.py quantize_activations):
# d = max|x| / 127 and q = round(x / d) in [-127, 127], so x is taken as x^ = d * q and the error
# is at most d / 2 per value. A row's dot product is then exactly (up to f32 rounding) W . x^:
#     sum over chunks c of  s[group(c)] * d[c] * sum(codes * q)   + the zero point / offset term
# with the integer sums computed 64 byte products at a time (codes x signed q, summed in fours into
# 32-bit lanes by the style's INT8_DOTS instructions; every style gives the same integers).
#
# Q8 layout (bytes from xp), per superblock of 4 chunks (128 values), Q8_SUPERBLOCK_BYTES apart:
#     [0, 128)    q in natural order (the int8 weights' order)
#     [128, 256)  q in int4 order: the 16 even values of each of the 4 chunks (64 bytes), then
#                 their 16 odd values (64 bytes); a chunk the vector does not have is left unset
#     [256, 272)  d of the 4 chunks (f32)
#     [272, 336)  int4 zero-point lanes: 16 i32, lane i = -8 * the sum of the q that lane i of a byte
#                 dot over [128, 256) meets (q at natural positions 8i .. 8i + 7)
#     [336, 464)  int8 zero-point lanes: 2 x 16 i32, lane i of half h = -128 * the sum of natural
#                 q at 64h + 4i .. 64h + 4i + 3
# Every address depends on the chunk index only, so weights of different group sizes (different
# padded K) read one prepared vector. The zero-point lanes start the integer sums of symmetric
# weights, which then come out as sums of (code - zero point) * q: no correction term per row.

Q8_SUPERBLOCK_CHUNKS = 4
Q8_SUPERBLOCK_BYTES = 464
Q8_INT4_ORDER, Q8_SCALES, Q8_INT4_ZERO_LANES, Q8_INT8_ZERO_LANES = 128, 256, 272, 336
Q8_INT4_ZERO_POINT, Q8_INT8_ZERO_POINT = 8, 128  # the symmetric codes' zero points the lanes fold in
V64I8, V64I16, V64I32 = ir.VectorType(I8, 64), ir.VectorType(I16, 64), ir.VectorType(I32, 64)


@dataclass(frozen=True)
class Int8Dot:
    """An instruction sequence that sums byte products four at a time into 32-bit lanes."""

    name: str  # as device_info() shows it
    probe: str | None  # the cpu_probe.py probe that must pass before it is emitted (None: generic IR)
    # True where the instruction multiplies signed bytes by signed bytes (or saturates on unsigned
    # bytes above 127): int8 weight codes then enter as code - 128, by flipping their top bit
    signed_codes: bool = False


INT8_DOTS = {
    ACT_INT8: Int8Dot("generic LLVM IR", None),
    ACT_INT8_SSSE3: Int8Dot("ssse3 pmaddubsw", "ssse3", signed_codes=True),
    ACT_INT8_AVX2: Int8Dot("avx2 vpmaddubsw", "avx2", signed_codes=True),
    ACT_INT8_AVXVNNI: Int8Dot("avx-vnni vpdpbusd", "avxvnni"),
    ACT_INT8_VNNI: Int8Dot("avx512 vnni vpdpbusd", "vnni"),
    ACT_INT8_DOTPROD: Int8Dot("neon sdot", "dotprod", signed_codes=True),
    ACT_INT8_I8MM: Int8Dot("neon i8mm usdot", "i8mm"),
}


def _pieces(e: Emitter, vector, width: int):
    """A vector cut into consecutive pieces of `width` lanes."""
    count = vector.type.count
    return [e.b.shuffle_vector(vector, vector, ir.Constant(ir.VectorType(I32, width), list(range(start, start + width))))
            for start in range(0, count, width)]


def _joined(e: Emitter, pieces):
    """The consecutive pieces of a vector joined back into one."""
    while len(pieces) > 1:
        width = pieces[0].type.count
        pieces = [e.b.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, 2 * width), list(range(2 * width))))
                  for a, b in zip(pieces[::2], pieces[1::2])]
    return pieces[0]


def _generic_byte_dot(e: Emitter, acc, a, b, a_signed: bool):
    n = a.type.count
    i16s, i32s = ir.VectorType(I16, n), ir.VectorType(I32, n // 2)
    # each product is exact in 16 bits; pairs are summed in 32 (the vpmaddwd idiom)
    products = e.b.mul(e.b.sext(a, i16s) if a_signed else e.b.zext(a, i16s), e.b.sext(b, i16s))

    def every_other(vector, first):
        count = vector.type.count // 2
        return e.b.shuffle_vector(vector, vector, ir.Constant(ir.VectorType(I32, count),
                                                              list(range(first, 2 * count, 2))))

    pairs = e.b.add(e.b.sext(every_other(products, 0), i32s), e.b.sext(every_other(products, 1), i32s))
    return e.b.add(acc, e.b.add(every_other(pairs, 0), every_other(pairs, 1)))


# x86's multiply-add of unsigned by signed bytes, by register width: (bytes per register, pmaddubsw,
# pmaddwd, psignb) of SSSE3's xmm and AVX2's ymm forms
_MADD = {ACT_INT8_SSSE3: (16, "llvm.x86.ssse3.pmadd.ub.sw.128", "llvm.x86.sse2.pmadd.wd", "llvm.x86.ssse3.psign.b.128"),
         ACT_INT8_AVX2: (32, "llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd", "llvm.x86.avx2.psign.b")}


def _pair_sums(e: Emitter, style: int, unsigned_bytes, signed_bytes):
    """<n x i8> u, s -> <n/2 x i16>: u[2i] * s[2i] + u[2i + 1] * s[2i + 1] (pmaddubsw, saturating:
    exact while each pair's sum stays within int16)."""
    width, madd_bytes, _, _ = _MADD[style]
    return e.intrinsic(madd_bytes, ir.VectorType(I16, width // 2), [unsigned_bytes, signed_bytes])


def _widen_pairs(e: Emitter, style: int, pair_sums):
    """<n x i16> -> <n/2 x i32>: sums of neighbouring pairs (pmaddwd by ones)."""
    width, _, madd_words, _ = _MADD[style]
    return e.intrinsic(madd_words, ir.VectorType(I32, width // 4),
                       [pair_sums, ir.Constant(ir.VectorType(I16, width // 2), [1] * (width // 2))])


def byte_dot(e: Emitter, acc, codes, q, style: int, signed: bool = False):
    """acc (<n/4 x i32>) + the sums of each 4 consecutive products codes[i] * q[i]: q signed bytes,
    codes unsigned bytes, or signed ones with `signed` (the styles whose Int8Dot has signed_codes).
    For unsigned codes the AVX2 and sdot styles need codes below 128 (int4 codes)."""
    if style == ACT_INT8:
        return _generic_byte_dot(e, acc, codes, q, signed)
    if style == ACT_INT8_VNNI:
        return e.intrinsic("llvm.x86.avx512.vpdpbusd.512", V16I32,
                           [acc, e.b.bitcast(codes, V16I32), e.b.bitcast(q, V16I32)])
    if style == ACT_INT8_AVXVNNI:
        v8i32 = ir.VectorType(I32, 8)
        return _joined(e, [e.intrinsic("llvm.x86.avx512.vpdpbusd.256", v8i32,
                                       [a, e.b.bitcast(c, v8i32), e.b.bitcast(x, v8i32)])
                           for a, c, x in zip(_pieces(e, acc, 8), _pieces(e, codes, 32), _pieces(e, q, 32))])
    if style in _MADD:
        width, _, _, sign = _MADD[style]
        sums = []
        for c, x in zip(_pieces(e, codes, width), _pieces(e, q, width)):
            if signed:  # |c| * (q with c's sign): each product c * q, |c| <= 128 keeps pairs within int16
                magnitude = e.intrinsic(f"llvm.abs.v{width}i8", c.type, [c, ir.Constant(ir.IntType(1), 0)])
                c, x = magnitude, e.intrinsic(sign, c.type, [x, c])
            sums.append(_widen_pairs(e, style, _pair_sums(e, style, c, x)))
        return e.b.add(acc, _joined(e, sums))
    if style in (ACT_INT8_DOTPROD, ACT_INT8_I8MM):
        name = "usdot" if style == ACT_INT8_I8MM and not signed else "sdot"
        v4i32 = ir.VectorType(I32, 4)
        return _joined(e, [e.intrinsic(f"llvm.aarch64.neon.{name}.v4i32.v16i8", v4i32, [a, c, x])
                           for a, c, x in zip(_pieces(e, acc, 4), _pieces(e, codes, 16), _pieces(e, q, 16))])
    raise ValueError(f"no int8 dot product for activation style {style}")


def nibble_pair_dot(e: Emitter, acc, low, q_even, high, q_odd, style: int):
    """byte_dot(byte_dot(acc, low, q_even), high, q_odd) for int4 codes (below 16): with pmaddubsw the
    two pair sums are added in int16 (at most 2 * 2 * 15 * 127) before one widening, as llama.cpp does."""
    if style not in _MADD:
        return byte_dot(e, byte_dot(e, acc, low, q_even, style), high, q_odd, style)
    width = _MADD[style][0]
    sums = [_widen_pairs(e, style, e.b.add(_pair_sums(e, style, lo, qe), _pair_sums(e, style, hi, qo)))
            for lo, qe, hi, qo in zip(*(_pieces(e, v, width) for v in (low, q_even, high, q_odd)))]
    return e.b.add(acc, _joined(e, sums))


def _chunk_scales(e: Emitter, fmt: IrFormat, row_scales, first_chunk, n_chunks: int, shift: int):
    """<n_chunks x float>: the weight scale of each of n_chunks consecutive chunks (groups of
    32 << shift values; first_chunk is a multiple of n_chunks, so whole groups are read)."""
    n_groups = max(1, n_chunks >> shift)
    first_group = e.b.lshr(first_chunk, e.i64(shift))
    if fmt.scale_bytes == 4:
        if n_groups == 1:
            return e.splat(e.scale(4, row_scales, first_group), n_chunks)
        scales = e.scales(4, row_scales, first_group, n_groups)
        return e.b.shuffle_vector(scales, scales, ir.Constant(ir.VectorType(I32, n_chunks),
                                                              [j >> shift for j in range(n_chunks)]))
    if n_groups == 1:
        return e.b.fpext(e.splat(e.load(F16, e.address(row_scales, (first_group, 2)), 2), n_chunks),
                         ir.VectorType(F32, n_chunks))
    halves = e.load(ir.VectorType(F16, n_groups), e.address(row_scales, (first_group, 2)), 2)
    spread = e.b.shuffle_vector(halves, halves, ir.Constant(ir.VectorType(I32, n_chunks),
                                                            [j >> shift for j in range(n_chunks)]))
    return e.b.fpext(spread, ir.VectorType(F32, n_chunks))


def _lanes_per_chunk(e: Emitter, per_chunk, lanes: int = LANES):
    """<c x float> -> <lanes x float> holding each chunk's value in its lanes / c lanes of a byte dot."""
    count = per_chunk.type.count
    return e.b.shuffle_vector(per_chunk, per_chunk,
                              ir.Constant(ir.VectorType(I32, lanes), [lane * count // lanes for lane in range(lanes)]))


def accumulator_lanes() -> int:
    """Lanes of a row's f32 accumulator in the int8 row dots. A step's sums fill LANES lanes; where the
    target has only 16 vector registers (x86 below AVX-512), each row adds them into 8 lanes, half after
    half, so that four rows' accumulators stay in registers beside the step's shared inputs instead of
    being spilled and reloaded every step."""
    from kernels.cpu.isa import vector_registers

    count, _ = vector_registers()
    return LANES // 2 if count <= 16 else LANES


def _emit_int8_dot_rows(e: Emitter, fmt: IrFormat, n_rows: int, args, style: int):
    _data, _row_bytes, _scales, _offsets, n_groups, chunks_per_group, _cols, _row0, _x, xq, group_sums, out = args
    rows, row_data, row_scales, row_offsets = _quantized_rows(e, fmt, n_rows, args)
    signed_codes = INT8_DOTS[style].signed_codes
    acc_lanes = accumulator_lanes()
    accumulators = [e.variable(ir.Constant(ir.VectorType(F32, acc_lanes), [0.0] * acc_lanes)) for _ in range(n_rows)]
    shift = _group_shift(e, chunks_per_group)
    n_chunks = e.b.shl(n_groups, shift)
    # chunks per 64-byte step: 4 of int4 (64 bytes of codes, 128 values), 2 of int8
    step = 4 if fmt.bits == 4 else 2
    n_steps = e.b.udiv(n_chunks, e.i64(step))

    def chunk_base(chunk):  # the superblock of a chunk and the chunk's place in it
        superblock = e.b.udiv(chunk, e.i64(Q8_SUPERBLOCK_CHUNKS))
        return (e.address(xq, (superblock, Q8_SUPERBLOCK_BYTES)),
                e.b.urem(chunk, e.i64(Q8_SUPERBLOCK_CHUNKS)))

    def step_codes(address, mask=None):
        if mask is None:
            return e.load(V64I8, address, 1)
        # masked by 4-byte words (a chunk's codes are whole words): AVX2's vpmaskmovd and AVX-512's
        # vmovdqu32 load them in one instruction, where a byte mask has no AVX2 form and LLVM would
        # load the 64 bytes one by one
        words = e.intrinsic("llvm.masked.load.v16i32.p0", V16I32, [e.b.inttoptr(address, I32.as_pointer()),
                                                                   ir.Constant(I32, 1), mask,
                                                                   ir.Constant(V16I32, [0] * LANES)])
        return e.b.bitcast(words, V64I8)

    def accumulate_step(first_chunk, step_index, row_factors, mask=None, lanes=LANES):
        """Every row's integer sums over the step's 64 bytes of codes, scaled into its accumulator.
        With lanes = LANES / 2 (int4 only) the step's first half: 32 bytes of codes, chunks
        first_chunk and first_chunk + 1, with the lanes, sums and products the whole step gives those
        two chunks: into the accumulator's first lanes, or (an accumulator of LANES / 2) as the whole
        step's first half is added, its second half then being zeros."""
        assert lanes == LANES or fmt.bits == 4, "half a step is defined for int4 codes only"
        codes_type, sums_type = ir.VectorType(I8, 4 * lanes), ir.VectorType(I32, lanes)
        block, place = chunk_base(first_chunk)
        if fmt.bits == 4:
            q_even = e.load(codes_type, e.address(block, e.i64(Q8_INT4_ORDER)), 1)
            q_odd = e.load(codes_type, e.address(block, e.i64(Q8_INT4_ORDER + 64)), 1)
            zero_lanes = e.address(block, e.i64(Q8_INT4_ZERO_LANES))
        else:
            q = e.load(V64I8, e.address(block, (place, CHUNK)), 1)
            zero_lanes = e.address(block, e.i64(Q8_INT8_ZERO_LANES), (place, 32))
        # Symmetric codes start from the zero-point lanes (-z * sums of q), so that the sums are of
        # (code - z) * q. Int8 codes that enter signed (code - 128) need the opposite: nothing for
        # symmetric codes, and +128 * sums of q for affine ones, whose sums are of code * q.
        zero = ir.Constant(sums_type, [0] * lanes)
        if fmt.bits == 8 and signed_codes:
            start = e.b.sub(zero, e.load(V16I32, zero_lanes, 4)) if fmt.affine else zero
        else:
            start = zero if fmt.affine else e.load(sums_type, zero_lanes, 4)
        for r in range(n_rows):
            address = e.address(row_data[r], (step_index, 64))
            codes = step_codes(address, mask) if lanes == LANES else e.load(codes_type, address, 1)
            if fmt.bits == 4:
                low = e.b.and_(codes, ir.Constant(codes_type, [0x0F] * (4 * lanes)))
                high = e.b.lshr(codes, ir.Constant(codes_type, [4] * (4 * lanes)))
                dot = nibble_pair_dot(e, start, low, q_even, high, q_odd, style)
            elif signed_codes:
                dot = byte_dot(e, start, e.b.xor(codes, ir.Constant(V64I8, [-128] * 64)), q, style, signed=True)
            else:
                dot = byte_dot(e, start, codes, q, style)
            factors = _lanes_per_chunk(e, row_factors(r, block, place), lanes)
            # the step's lanes are added a piece of at most the accumulator's width at a time, in
            # order, each into the accumulator's first lanes
            width = min(lanes, acc_lanes)
            products = e.b.sitofp(dot, ir.VectorType(F32, lanes))
            total = _pieces(e, e.b.load(accumulators[r]), width)
            for piece, factor in zip(_pieces(e, products, width), _pieces(e, factors, width)):
                total[0] = e.fma(piece, factor, total[0])
            e.b.store(_joined(e, total), accumulators[r])

    def step_factors(first_chunk, n_chunks, group_shift):
        """row_factors of a step of n_chunks whole chunks: each chunk's weight scale times its Q8 d."""
        def factors(r, block, place):
            d = e.load(ir.VectorType(F32, n_chunks), e.address(block, e.i64(Q8_SCALES), (place, 4)), 4)
            return e.fmul(_chunk_scales(e, fmt, row_scales[r], first_chunk, n_chunks, group_shift), d)
        return factors

    for group_shift in range(3):  # one loop per group size, chosen once (scales are read per step)
        with e.b.if_then(e.b.icmp_unsigned("==", shift, e.i64(group_shift))):
            with e.loop(n_steps) as step_loop:
                first_chunk = e.b.mul(step_loop.index, e.i64(step))
                accumulate_step(first_chunk, step_loop.index, step_factors(first_chunk, step, group_shift))

    # the chunks past the last whole step (at most 3 of int4, 1 of int8)
    first_tail = e.b.mul(n_steps, e.i64(step))
    n_tail = e.b.sub(n_chunks, first_tail)
    # Two int4 chunks (rows of 64 mod 128 values: K = 576, 960, 2880...) take half a step of plain loads.
    # Otherwise one more step whose codes are loaded under a mask (zeros past the row) and whose missing
    # chunks get a factor of 0 (their Q8 scales are unset, and their weight scales may lie past the
    # array): per row it costs about two whole steps.
    half_step = fmt.bits == 4 and style != ACT_INT8_VNNI  # (VNNI's vpdpbusd here is the 512-bit one)
    masked = e.b.icmp_unsigned(">", n_tail, e.i64(0))
    if half_step:
        two_left = e.b.icmp_unsigned("==", n_tail, e.i64(2))
        masked = e.b.and_(masked, e.b.not_(two_left))
        for group_shift in range(3):
            with e.b.if_then(e.b.and_(two_left, e.b.icmp_unsigned("==", shift, e.i64(group_shift)))):
                accumulate_step(first_tail, n_steps, step_factors(first_tail, 2, group_shift), lanes=LANES // 2)
    with e.b.if_then(masked):
        valid_words = e.b.trunc(e.b.mul(n_tail, e.i64(16 // step)), I32)
        mask = e.b.icmp_unsigned("<", ir.Constant(V16I32, list(range(LANES))), e.splat(valid_words, LANES))

        def tail_factors(r, block, place):
            factors = ir.Constant(ir.VectorType(F32, step), [0.0] * step)
            for j in range(step):
                present = e.b.icmp_unsigned("<", e.i64(j), n_tail)
                chunk = e.b.select(present, e.b.add(first_tail, e.i64(j)), first_tail)
                scale = e.scale(fmt.scale_bytes, row_scales[r], e.b.lshr(chunk, shift))
                d = e.load(F32, e.address(block, e.i64(Q8_SCALES), (e.b.add(place, e.i64(j)), 4)), 4)
                factor = e.b.select(present, e.fmul(scale, d), ir.Constant(F32, 0.0))
                factors = e.b.insert_element(factors, factor, ir.Constant(I32, j))
            return factors

        accumulate_step(first_tail, n_steps, tail_factors, mask)

    _store_row_totals(e, fmt, n_rows, rows, accumulators, row_scales, row_offsets, n_groups, group_sums, out,
                      zero_point_applied=True)


@intrinsic
def quantize_chunk(typingctx, values, q8, chunk):
    """Quantize the 32 f32 values at `values` into chunk `chunk` of the Q8 layout at `q8` (module
    notes above): d = max|x| / 127, codes round(x * (127 / max|x|)) (0 for an all-zero chunk) in
    natural and int4 order, d, and the zero-point lanes. Returns d * sum(codes), the chunk's sum
    of the quantized x. Plain IEEE arithmetic (no fast-math): the codes are those numpy gives."""
    signature = types.float32(INT64_ARGS, INT64_ARGS, INT64_ARGS)

    def codegen(context, builder, sig, args):
        values, q8, chunk = args
        e = Emitter(builder)
        b = e.b
        superblock = b.udiv(chunk, e.i64(Q8_SUPERBLOCK_CHUNKS))
        place = b.urem(chunk, e.i64(Q8_SUPERBLOCK_CHUNKS))
        block = e.address(q8, (superblock, Q8_SUPERBLOCK_BYTES))
        low, high = e.load(V16F, values, 4), e.load(V16F, e.address(values, e.i64(64)), 4)

        magnitudes = e.intrinsic("llvm.maxnum.v16f32", V16F, [e.intrinsic("llvm.fabs.v16f32", V16F, [low]),
                                                                e.intrinsic("llvm.fabs.v16f32", V16F, [high])])
        peak = e.intrinsic("llvm.vector.reduce.fmax.v16f32", F32, [magnitudes])
        positive = b.fcmp_ordered(">", peak, ir.Constant(F32, 0.0))
        inverse = b.select(positive, b.fdiv(ir.Constant(F32, 127.0), peak), ir.Constant(F32, 0.0))
        codes = [b.fptosi(e.intrinsic("llvm.rint.v16f32", V16F, [b.fmul(half, e.splat(inverse))]), V16I32)
                 for half in (low, high)]
        all_codes = b.shuffle_vector(codes[0], codes[1], ir.Constant(ir.VectorType(I32, 32), list(range(32))))
        bytes_ = b.trunc(all_codes, V32I8)
        e.store(bytes_, e.address(block, (place, CHUNK)), 1)
        int4_order = e.address(block, e.i64(Q8_INT4_ORDER), (place, CHUNK // 2))
        for parity in (0, 1):  # the 16 even values, then 64 bytes on the 16 odd ones
            picked = b.shuffle_vector(bytes_, bytes_, ir.Constant(ir.VectorType(I32, 16), list(range(parity, 32, 2))))
            e.store(picked, e.address(int4_order, e.i64(64 * parity)), 1)

        def sums_of(vector, width):  # <n x i32> -> <n / width x i32>: sums of `width` neighbours
            count = vector.type.count // width
            terms = [b.shuffle_vector(vector, vector, ir.Constant(ir.VectorType(I32, count),
                                                                  list(range(k, vector.type.count, width))))
                     for k in range(width)]
            total = terms[0]
            for term in terms[1:]:
                total = b.add(total, term)
            return total

        fours = sums_of(all_codes, 4)  # <8 x i32>: an int8 lane's natural values
        eights = sums_of(fours, 2)  # <4 x i32>: an int4 lane's
        int8_zero = ir.Constant(ir.VectorType(I32, 8), [-Q8_INT8_ZERO_POINT] * 8)
        int4_zero = ir.Constant(ir.VectorType(I32, 4), [-Q8_INT4_ZERO_POINT] * 4)
        e.store(b.mul(fours, int8_zero), e.address(block, e.i64(Q8_INT8_ZERO_LANES), (place, 32)), 4)
        e.store(b.mul(eights, int4_zero), e.address(block, e.i64(Q8_INT4_ZERO_LANES), (place, 16)), 4)
        scale = b.fdiv(peak, ir.Constant(F32, 127.0))
        e.store(scale, e.address(block, e.i64(Q8_SCALES), (place, 4)), 4)
        total = e.intrinsic("llvm.vector.reduce.add.v8i32", I32, [fours])
        return b.fmul(scale, b.sitofp(total, F32))

    return signature, codegen


def load_float_weights(e: Emitter, fmt: IrFormat, address):
    if fmt.bits == 32:
        return e.load(V16F, address, 4)
    return e.b.fpext(e.b.bitcast(e.load(V16I16, address, 2), V16H), V16F)


def load_float_weight(e: Emitter, fmt: IrFormat, address):
    return e.load(F32, address, 4) if fmt.bits == 32 else e.half(address)


def emit_float_dots(e: Emitter, fmt: IrFormat, row_data, vectors, cols, store) -> None:
    """The dot products of float rows (addresses of cols values in fmt, f32 or f16) with f32 vectors
    (addresses): each in 16-lane multiply-adds, the columns past the last whole vector one by one,
    then the lanes' sum. The sums run in order (never reassociated: LLVM would otherwise split or
    vectorise a chain that has too little parallelism of its own, differently with the number of
    rows and vectors, and without FMA), so a product's bits do not depend on how many share the loop.
    store(r, j, total) receives row r's product with vector j. Each row's values are loaded (and
    widened) once for all the vectors, each vector's once for all the rows."""
    width = fmt.bits // 8
    zero = ir.Constant(V16F, [0.0] * LANES)
    pairs = [(r, j) for j in range(len(vectors)) for r in range(len(row_data))]
    accumulators = {pair: e.variable(zero) for pair in pairs}
    tails = {pair: e.variable(ir.Constant(F32, 0.0)) for pair in pairs}
    n_vectors = e.b.udiv(cols, e.i64(LANES))
    with e.loop(n_vectors) as vector_loop:
        v = vector_loop.index
        rows = [load_float_weights(e, fmt, e.address(row, (v, width * LANES))) for row in row_data]
        xs = [e.load(V16F, e.address(x, (v, 4 * LANES)), 4) for x in vectors]
        for r, j in pairs:
            e.b.store(e.fma_in_order(rows[r], xs[j], e.b.load(accumulators[r, j])), accumulators[r, j])
    first_tail = e.b.mul(n_vectors, e.i64(LANES))
    with e.loop(e.b.sub(cols, first_tail)) as tail_loop:
        k = e.b.add(first_tail, tail_loop.index)
        rows = [load_float_weight(e, fmt, e.address(row, (k, width))) for row in row_data]
        xs = [e.load(F32, e.address(x, (k, 4)), 4) for x in vectors]
        for r, j in pairs:
            e.b.store(e.fma_in_order(rows[r], xs[j], e.b.load(tails[r, j])), tails[r, j])
    for r, j in pairs:
        store(r, j, e.fadd(e.hsum(e.b.load(accumulators[r, j])), e.b.load(tails[r, j])))


def _emit_float_dot_rows(e: Emitter, fmt: IrFormat, n_rows: int, args):
    data, row_bytes, _scales, _offsets, _n_groups, _cpg, cols, row0, x, _xp, _xsum, out = args
    _prefetch_rows_ahead(e, n_rows, row0, row_bytes, [(data, row_bytes)])
    rows = [e.b.add(row0, e.i64(r)) for r in range(n_rows)]
    emit_float_dots(e, fmt, [e.address(data, (row, row_bytes)) for row in rows], [x], cols,
                    lambda r, _, total: e.store(total, e.address(out, (rows[r], 4)), 4))


def make_dot_rows(n_rows: int, formats: dict[int, IrFormat]):
    """Intrinsic: out[row0 + r] = dot(weight row row0 + r, x) for r < n_rows (no bias).

    Arguments: kind (a key of `formats`) and activation style (ACT_*), both compile-time constants
    (Numba passes a closure's integer constants as literals), then the int64 data, row_bytes,
    scales, offsets, n_groups, chunks_per_group, cols, row0, x, xp, xsum, out. Reading n_rows rows
    together shares each load of x between them.

    ACT_F32: xp holds x in int4 order and xsum the group sums of x. The int8 styles (INT8_DOTS,
    quantized kinds only): xp holds x quantized to int8 per chunk of 32 (the Q8 layout below) and
    xsum the group sums of that quantized x."""

    @intrinsic
    def dot_rows(typingctx, kind, style, data, row_bytes, scales, offsets, n_groups, chunks_per_group, cols, row0,
                 x, xp, xsum, out):
        for name, literal in (("kind", kind), ("style", style)):
            if not isinstance(literal, types.IntegerLiteral):
                raise errors.TypingError(f"dot_rows: {name} must be a compile-time integer constant, got {literal}")
        fmt, activation_style = formats[kind.literal_value], style.literal_value
        signature = types.void(kind, style, *([INT64_ARGS] * 12))

        def codegen(context, builder, sig, args):
            e = Emitter(builder)
            if fmt.is_float:
                _emit_float_dot_rows(e, fmt, n_rows, args[2:])
            elif activation_style == ACT_F32:
                _emit_quantized_dot_rows(e, fmt, n_rows, args[2:])
            else:
                _emit_int8_dot_rows(e, fmt, n_rows, args[2:], activation_style)
            return context.get_dummy_value()

        return signature, codegen

    dot_rows.__name__ = f"dot_rows_{n_rows}"
    return dot_rows
