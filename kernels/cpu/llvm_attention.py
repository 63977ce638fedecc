"""Hand-written LLVM IR for attention (kernels/cpu/attention.py): the dot products of query heads with
cached keys, and the softmax-weighted sum of value rows.

Like kernels/cpu/llvm_ir.py (whose Emitter and vector types it uses): Numba intrinsics whose IR is
emitted into the calling kernel, int64 addresses and sizes as arguments, generic vector types that
LLVM lowers to the host's registers.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from kernels.cpu.isa import vector_registers
from kernels.cpu.formats import F16 as K_F16, F32 as K_F32, IR_FORMATS
from kernels.cpu.llvm_ir import F32, INT64_ARGS, LANES, V16F, Emitter, emit_float_dots, load_float_weight, \
    load_float_weights

PANEL_VECTORS = 4  # columns per pass over the rows: 64 floats, one cache line per vector


def row_streams() -> int:
    """Rows per step, each into its own accumulators, so that consecutive multiply-adds do not wait
    on each other: two where a panel's accumulators for two rows take at most half the vector
    registers (AVX-512), else one (a panel is already 8 independent sums on AVX2 and 16 on NEON,
    and a second set would spill)."""
    count, bits = vector_registers()
    registers_per_vector = max(1, LANES * 32 // bits)
    return 2 if 2 * PANEL_VECTORS * registers_per_vector <= count // 2 else 1


def make_weighted_row_sum(half: bool, n_heads: int):
    """The weighted_row_sum intrinsic for rows of f32 or (half) f16 values and n_heads sets of weights."""
    fmt = IR_FORMATS[K_F16 if half else K_F32]
    element = fmt.bits // 8
    panel_vectors = max(1, PANEL_VECTORS // n_heads)  # the heads' accumulators within a panel's registers

    @intrinsic
    def weighted_row_sum(typingctx, rows, row_bytes, n_rows, weights, weight_bytes, width, out, out_bytes):
        """out_g[d] = sum over i < n_rows of weights_g[i] * rows[i][d] for d < width and g < n_heads:
        rows of f32, or of f16 in the half variant, row_bytes apart (e.g. one KV head's value rows in
        the cache); head g's weights (f32) at weights + g * weight_bytes, its out (f32) at out + g *
        out_bytes. Arguments are int64 addresses and sizes.

        Columns are taken in panels of vectors of 16 (PANEL_VECTORS for one head: whole cache lines of
        each row; fewer for several, whose accumulators share the registers), then one vector at a
        time, then one column at a time; each pass reads the rows in order, row_streams() rows per
        step into separate accumulators, so that consecutive multiply-adds do not wait on each other.
        A row's values are loaded (and widened from f16) once for all the heads. A column's sum is
        the same sequence of operations in every pass and for any n_heads: the bits do not depend on
        the panel or on how many heads share the rows."""
        signature = types.void(*([INT64_ARGS] * 8))

        def codegen(context, builder, sig, args):
            rows, row_bytes, n_rows, weights, weight_bytes, width, out, out_bytes = args
            e = Emitter(builder)
            streams = row_streams()
            n_steps = e.b.udiv(n_rows, e.i64(streams))
            last_row = e.b.mul(n_steps, e.i64(streams))
            heads = range(n_heads)
            head_weights = [e.address(weights, (e.i64(g), weight_bytes)) for g in heads]
            head_out = [e.address(out, (e.i64(g), out_bytes)) for g in heads]

            def column_pass(first_column, vector_type, n_vectors: int):
                """out_g[first_column + 16 v] for v < n_vectors (vector_type: <16 x float> or float)."""
                zero = ir.Constant(vector_type, [0.0] * LANES if vector_type is V16F else 0.0)
                width_bytes = element * LANES if vector_type is V16F else element
                sums = [[[e.variable(zero) for _ in range(n_vectors)] for _ in heads] for _ in range(streams)]

                def add_row(row, stream):
                    row_start = e.address(rows, (row, row_bytes), (first_column, element))
                    load = load_float_weights if vector_type is V16F else load_float_weight
                    values = [load(e, fmt, e.address(row_start, e.i64(width_bytes * v)))
                              for v in range(n_vectors)]
                    # in order, never reassociated: LLVM would otherwise vectorise the one-column
                    # sums over the rows, or split a chain, differently for each number of heads
                    for g in heads:
                        weight = e.load(F32, e.address(head_weights[g], (row, 4)), 4)
                        if vector_type is V16F:
                            weight = e.splat(weight)
                        for v in range(n_vectors):
                            e.b.store(e.fma_in_order(weight, values[v], e.b.load(sums[stream][g][v])),
                                      sums[stream][g][v])

                with e.loop(n_steps) as step_loop:
                    for stream in range(streams):
                        add_row(e.b.add(e.b.mul(step_loop.index, e.i64(streams)), e.i64(stream)), stream)
                with e.loop(e.b.sub(n_rows, last_row)) as tail_loop:
                    add_row(e.b.add(last_row, tail_loop.index), 0)
                for g in heads:
                    for v in range(n_vectors):
                        total = e.b.load(sums[0][g][v])
                        for stream in range(1, streams):
                            total = e.fadd(total, e.b.load(sums[stream][g][v]))
                        e.store(total, e.address(head_out[g], (first_column, 4),
                                                 e.i64(4 * LANES * v if vector_type is V16F else 4 * v)), 4)

            panel = panel_vectors * LANES
            n_panels = e.b.udiv(width, e.i64(panel))
            with e.loop(n_panels) as panel_loop:
                column_pass(e.b.mul(panel_loop.index, e.i64(panel)), V16F, panel_vectors)
            after_panels = e.b.mul(n_panels, e.i64(panel))
            n_vectors = e.b.udiv(e.b.sub(width, after_panels), e.i64(LANES))
            with e.loop(n_vectors) as vector_loop:
                column_pass(e.b.add(after_panels, e.b.mul(vector_loop.index, e.i64(LANES))), V16F, 1)
            after_vectors = e.b.add(after_panels, e.b.mul(n_vectors, e.i64(LANES)))
            with e.loop(e.b.sub(width, after_vectors)) as column_loop:
                column_pass(e.b.add(after_vectors, column_loop.index), F32, 1)
            return context.get_dummy_value()

        return signature, codegen

    weighted_row_sum.__name__ = f"weighted_{'half_' if half else ''}row_sum_{n_heads}"
    return weighted_row_sum


def make_key_dots(fmt, n_heads: int, n_keys: int):
    """Intrinsic key_dots(keys, row_bytes, head_dim, s, queries, scores, n): for g < n_heads and
    i < n_keys, scores[g * n + s + i] = queries[g] . key row s + i (keys in `fmt`, f32 or f16, rows
    row_bytes apart: one KV head's keys in the cache; queries [n_heads, head_dim] f32; int64
    addresses and sizes).

    Each key row is loaded (and widened from f16) once for all the heads of a tile: where the query
    heads of a GQA group share their KV head. The sums are llvm_ir.emit_float_dots', so a tile's
    shape never changes a score's bits. No software prefetch: the caller requests the rows ahead."""

    @intrinsic
    def key_dots(typingctx, keys, row_bytes, head_dim, s, queries, scores, n):
        signature = types.void(*([INT64_ARGS] * 7))

        def codegen(context, builder, sig, args):
            keys, row_bytes, head_dim, s, queries, scores, n = args
            e = Emitter(builder)
            key_rows = [e.address(keys, (e.b.add(s, e.i64(i)), row_bytes)) for i in range(n_keys)]
            query_rows = [e.address(queries, (e.i64(g), e.b.mul(head_dim, e.i64(4)))) for g in range(n_heads)]

            def store(i, g, total):
                e.store(total, e.address(scores, (e.b.add(e.b.mul(e.i64(g), n), e.b.add(s, e.i64(i))), 4)), 4)

            emit_float_dots(e, fmt, key_rows, query_rows, head_dim, store)
            return context.get_dummy_value()

        return signature, codegen

    key_dots.__name__ = f"key_dots_{fmt.name}_{n_heads}x{n_keys}"
    return key_dots
