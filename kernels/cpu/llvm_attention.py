"""Hand-written LLVM IR for attention: the softmax-weighted sum of value rows (kernels/cpu/attention.py).

Like kernels/cpu/llvm_ir.py (whose Emitter and vector types it uses): Numba intrinsics whose IR is
emitted into the calling kernel, int64 addresses and sizes as arguments, generic vector types that
LLVM lowers to the host's registers.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from kernels.cpu.isa import vector_registers
from kernels.cpu.llvm_ir import F32, INT64_ARGS, LANES, V16F, V16H, V16I16, Emitter

PANEL_VECTORS = 4  # columns per pass over the rows: 64 floats, one cache line per vector


def row_streams() -> int:
    """Rows per step, each into its own accumulators, so that consecutive multiply-adds do not wait
    on each other: two where a panel's accumulators for two rows take at most half the vector
    registers (AVX-512), else one (a panel is already 8 independent sums on AVX2 and 16 on NEON,
    and a second set would spill)."""
    count, bits = vector_registers()
    registers_per_vector = max(1, LANES * 32 // bits)
    return 2 if 2 * PANEL_VECTORS * registers_per_vector <= count // 2 else 1


def _make_weighted_row_sum(half: bool):
    """The weighted_row_sum intrinsic for rows of f32 or (half) f16 values."""
    element = 2 if half else 4

    @intrinsic
    def weighted_row_sum(typingctx, rows, row_bytes, n_rows, weights, width, out):
        """out[d] = sum over i < n_rows of weights[i] * rows[i][d] for d < width (rows of f32, or of
        f16 in the half variant, row_bytes apart: e.g. one KV head's value rows in the cache; weights
        and out f32). Arguments are int64 addresses and sizes.

        Columns are taken in panels of PANEL_VECTORS vectors of 16 (whole cache lines of each row),
        then one vector at a time, then one column at a time; each pass reads the rows in order,
        row_streams() rows per step into separate accumulators, so that consecutive multiply-adds do
        not wait on each other."""
        signature = types.void(*([INT64_ARGS] * 6))

        def codegen(context, builder, sig, args):
            rows, row_bytes, n_rows, weights, width, out = args
            e = Emitter(builder)
            streams = row_streams()
            n_steps = e.b.udiv(n_rows, e.i64(streams))
            last_row = e.b.mul(n_steps, e.i64(streams))

            def load_values(vector_type, address):
                if vector_type is V16F:
                    if half:
                        return e.b.fpext(e.b.bitcast(e.load(V16I16, address, 2), V16H), V16F)
                    return e.load(V16F, address, 4)
                return e.half(address) if half else e.load(F32, address, 4)

            def column_pass(first_column, vector_type, n_vectors: int):
                """out[first_column + 16 v] for v < n_vectors (vector_type: <16 x float> or float)."""
                zero = ir.Constant(vector_type, [0.0] * LANES if vector_type is V16F else 0.0)
                width_bytes = element * LANES if vector_type is V16F else element
                sums = [[e.variable(zero) for _ in range(n_vectors)] for _ in range(streams)]

                def add_row(row, stream):
                    weight = e.load(F32, e.address(weights, (row, 4)), 4)
                    if vector_type is V16F:
                        weight = e.splat(weight)
                    row_start = e.address(rows, (row, row_bytes), (first_column, element))
                    for v in range(n_vectors):
                        value = load_values(vector_type, e.address(row_start, e.i64(width_bytes * v)))
                        e.b.store(e.fma(weight, value, e.b.load(sums[stream][v])), sums[stream][v])

                with e.loop(n_steps) as step_loop:
                    for stream in range(streams):
                        add_row(e.b.add(e.b.mul(step_loop.index, e.i64(streams)), e.i64(stream)), stream)
                with e.loop(e.b.sub(n_rows, last_row)) as tail_loop:
                    add_row(e.b.add(last_row, tail_loop.index), 0)
                for v in range(n_vectors):
                    total = e.b.load(sums[0][v])
                    for stream in range(1, streams):
                        total = e.fadd(total, e.b.load(sums[stream][v]))
                    e.store(total, e.address(out, (first_column, 4), e.i64(4 * LANES * v if vector_type is V16F
                                                                            else 4 * v)), 4)

            panel = PANEL_VECTORS * LANES
            n_panels = e.b.udiv(width, e.i64(panel))
            with e.loop(n_panels) as panel_loop:
                column_pass(e.b.mul(panel_loop.index, e.i64(panel)), V16F, PANEL_VECTORS)
            after_panels = e.b.mul(n_panels, e.i64(panel))
            n_vectors = e.b.udiv(e.b.sub(width, after_panels), e.i64(LANES))
            with e.loop(n_vectors) as vector_loop:
                column_pass(e.b.add(after_panels, e.b.mul(vector_loop.index, e.i64(LANES))), V16F, 1)
            after_vectors = e.b.add(after_panels, e.b.mul(n_vectors, e.i64(LANES)))
            with e.loop(e.b.sub(width, after_vectors)) as column_loop:
                column_pass(e.b.add(after_vectors, column_loop.index), F32, 1)
            return context.get_dummy_value()

        return signature, codegen

    weighted_row_sum.__name__ = "weighted_half_row_sum" if half else "weighted_row_sum"
    return weighted_row_sum


weighted_row_sum, weighted_half_row_sum = _make_weighted_row_sum(False), _make_weighted_row_sum(True)
