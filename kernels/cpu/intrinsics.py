"""Small LLVM intrinsics the CPU kernels call: scalars Numba has no type for, typed pointers at
raw addresses, calls through a weight descriptor's kernel addresses, and the atomics, waits and
clock of the fused forward's task counters (kernels/cpu/forward.py).

Arguments are int64 byte addresses and sizes, as in llvm_ir.py; the calling kernel owns the memory.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.cpu.llvm_ir import F32, I32, I64, INT64_ARGS, Emitter


# --------------------------------------------------------------------------------------------
# Pointers and calls at raw addresses


def _pointer_intrinsic(numba_type, llvm_type, purpose: str):
    """Intrinsic: a typed pointer at an int64 address, for numba.carray views of buffers the caller owns."""

    @intrinsic
    def pointer(typingctx, address):
        signature = types.CPointer(numba_type)(types.int64)

        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], llvm_type.as_pointer())

        return signature, codegen

    pointer.__name__ = f"{numba_type}_pointer"
    pointer.__doc__ = f"A {numba_type} pointer at an int64 address ({purpose})."
    return pointer


float32_pointer = _pointer_intrinsic(types.float32, F32, "views of scratch and KV buffers")
int64_pointer = _pointer_intrinsic(types.int64, I64, "a weight descriptor row, read by a kind's kernels")
uint16_pointer = _pointer_intrinsic(types.uint16, ir.IntType(16), "f16 KV buffers and bf16 tiles (their bit patterns)")
uint32_pointer = _pointer_intrinsic(types.uint32, I32, "f32 values as bit patterns, and pairs of bf16")
int32_pointer = _pointer_intrinsic(types.int32, I32, "sums of quantized inputs")


def _indirect_call(n_args: int):
    """Codegen of a void call to the C function at an int64 address with n_args int64 arguments."""

    def codegen(context, builder, sig, llvm_args):
        function_type = ir.FunctionType(ir.VoidType(), [I64] * n_args)
        target = builder.inttoptr(llvm_args[0], function_type.as_pointer())
        builder.call(target, llvm_args[1:])
        return context.get_dummy_value()

    return types.void(*([INT64_ARGS] * (n_args + 1))), codegen


# The kernels of each weight kind are compiled separately, as C callbacks, and found through the
# addresses in the weight's descriptor (kernels/cpu/linear.py); these intrinsics call them.


@intrinsic
def call_matvec(typingctx, function, descriptor, row_begin, row_end, x, xp, xsum, out):
    return _indirect_call(7)


@intrinsic
def call_dequantize(typingctx, function, descriptor, row_begin, n_rows, tile, tile_stride):
    return _indirect_call(5)


@intrinsic
def call_gemm(typingctx, function, descriptor, row_begin, row_end, xt, xt_stride, xq, xq_stride, n_tokens, tile,
              tile_stride, block, out, out_stride, out_col, accumulate, transposed):
    return _indirect_call(16)


# --------------------------------------------------------------------------------------------
# Atomics for the task counters of the fused forward (kernels/cpu/forward.py)


@intrinsic
def atomic_add(typingctx, address, value):
    """Atomically add `value` to the int64 at `address`; returns the previous value (sequentially
    consistent: a full barrier, so everything written before it is visible to whoever reads it)."""
    signature = types.int64(types.int64, types.int64)

    def codegen(context, builder, sig, args):
        pointer = builder.inttoptr(args[0], I64.as_pointer())
        return builder.atomic_rmw("add", pointer, args[1], "seq_cst")

    return signature, codegen


@intrinsic
def atomic_load(typingctx, address):
    """The int64 at `address`, loaded with acquire ordering."""
    signature = types.int64(types.int64)

    def codegen(context, builder, sig, args):
        pointer = builder.inttoptr(args[0], I64.as_pointer())
        return builder.load_atomic(pointer, "acquire", 8)

    return signature, codegen


@intrinsic
def prefetch_bytes(typingctx, address, n_bytes):
    """Hint the cache lines of [address, address + n_bytes) into L2 (llvm.prefetch: never faults).
    L2, not L1: a burst of requests (a block of KV rows, a matrix's first rows) would overflow L1 and
    its few miss buffers, while L2 keeps more misses in flight."""
    signature = types.void(types.int64, types.int64)

    def codegen(context, builder, sig, args):
        Emitter(builder).prefetch_range(*args)
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def spin_pause(typingctx):
    """One iteration's pause of a spin-wait: the instruction that tells the core a thread is
    spinning (x86 `pause`, ARM `yield`; it frees resources for a sibling hyperthread). Chosen by the
    architecture this process runs on; elsewhere the loop spins without a hint."""
    from llvmlite import binding

    signature = types.void()
    arch = binding.get_process_triple().split("-")[0]

    def codegen(context, builder, sig, args):
        if arch in ("x86_64", "i386", "i686"):
            hint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                  "llvm.x86.sse2.pause")
            builder.call(hint, [])
        elif arch in ("aarch64", "arm64"):
            hint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [I32]),
                                                  "llvm.aarch64.hint")
            builder.call(hint, [ir.Constant(I32, 1)])  # 1 = YIELD
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def sleep_microseconds(typingctx, microseconds):
    """usleep(): block this thread, giving its core away (POSIX; in every libc Numba runs on)."""
    signature = types.void(types.int64)

    def codegen(context, builder, sig, args):
        function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I32, [I32]), "usleep")
        builder.call(function, [builder.trunc(args[0], I32)])
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def monotonic_seconds(typingctx):
    """clock_gettime(CLOCK_MONOTONIC) in seconds (float64), for the fused forward's step timer."""
    import time

    signature = types.float64()
    clock_id = time.CLOCK_MONOTONIC  # the constant of the platform this compiles on

    def codegen(context, builder, sig, args):
        timespec = ir.LiteralStructType([I64, I64])
        slot = cgutils.alloca_once(builder, timespec)
        function = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(I32, [I32, timespec.as_pointer()]), "clock_gettime")
        builder.call(function, [ir.Constant(I32, clock_id), slot])
        seconds = builder.load(builder.gep(slot, [ir.Constant(I32, 0), ir.Constant(I32, 0)]))
        nanoseconds = builder.load(builder.gep(slot, [ir.Constant(I32, 0), ir.Constant(I32, 1)]))
        f64 = ir.DoubleType()
        return builder.fadd(builder.sitofp(seconds, f64),
                            builder.fmul(builder.sitofp(nanoseconds, f64), ir.Constant(f64, 1e-9)))

    return signature, codegen


@intrinsic
def float_from_bits(typingctx, bits):
    """The float32 whose IEEE bit pattern is the int32 `bits` (a bitcast; Numba has no scalar view)."""
    signature = types.float32(types.int32)

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], F32)

    return signature, codegen


@intrinsic
def half_bits(typingctx, value):
    """The IEEE half bit pattern (uint16) nearest the float32 `value`, ties to even: LLVM's
    float -> half truncation, what numpy's astype(float16) gives (the f16 KV cache's rounding)."""
    signature = types.uint16(types.float32)

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return signature, codegen
