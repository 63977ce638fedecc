"""How close the CPU prefill gemm comes to the core's multiply-add peak, one thread.

    python benchmarks/prefill_peak.py [--tokens 32,128,512] [--json FILE]
    ZLLM_EDGE_ISA=avx2 python benchmarks/prefill_peak.py      # the AVX2 level on a wider CPU

Three figures, in GMAC/s (billions of multiply-adds per second) at the kernels' vector width
(kernels/cpu/isa.py vector_registers; capped by ZLLM_EDGE_ISA like the kernels):
  peak          independent f32 FMA chains, nothing loaded: what one core can do at all
  micro-kernel  the prefill micro-kernel (kernels/cpu/llvm_prefill.py, TILE_M rows x 32 tokens) on a
                tile and inputs that stay in L1
  gemm          kernels/cpu/linear.py `linear` on INT4 and INT8 weights of SmolLM2's projection shapes
                (1536 x 576 and 576 x 1536), dequantization, depth slices and scatter included, per
                prompt length: on f32 tiles (cpu:f32), and on integer panels (int8 activations, the
                default variant's prefill where kernels/cpu/llvm_prefill.py integer_prefill_runs)
Each is the best of a few repeats; the gemm rows give their fraction of the f32 peak (integer panels
can pass it: a byte dot product does 4 multiply-adds per 32-bit lane).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import numpy as np

from report import publish

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHAINS = 12  # independent accumulators: enough to cover the FMA latency on every x86 and ARM core
PEAK_STEPS = 20_000_000


def _best(function, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best


def fma_peak(bits: int) -> float:
    """GMAC/s of CHAINS independent <bits / 32 x float> FMA chains, compiled for this CPU at that width."""
    import llvmlite.binding as llvm

    from kernels.cpu import isa

    lanes = bits // 32
    vector = f"<{lanes} x float>"
    fma = f"@llvm.fma.v{lanes}f32"
    phis = "\n".join(f"  %a{i} = phi {vector} [zeroinitializer, %entry], [%b{i}, %loop]" for i in range(CHAINS))
    steps = "\n".join(f"  %b{i} = call {vector} {fma}({vector} %a{i}, {vector} %m, {vector} %c)" for i in range(CHAINS))
    sums = "\n".join(f"  %s{i} = fadd {vector} %b{i}, {'%s' + str(i - 1) if i else 'zeroinitializer'}"
                     for i in range(CHAINS))
    text = f"""
declare {vector} {fma}({vector}, {vector}, {vector})
define float @peak(i64 %n, float %x) {{
entry:
  %m0 = insertelement {vector} undef, float %x, i32 0
  %m = shufflevector {vector} %m0, {vector} undef, <{lanes} x i32> zeroinitializer
  %c = fadd {vector} %m, %m
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%next, %loop]
{phis}
{steps}
  %next = add i64 %i, 1
  %done = icmp eq i64 %next, %n
  br i1 %done, label %exit, label %loop
exit:
{sums}
  %r = extractelement {vector} %s{CHAINS - 1}, i32 0
  ret float %r
}}"""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    machine = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=isa.feature_string(isa.target_features()), opt=3)
    module = llvm.parse_assembly(text)
    engine = llvm.create_mcjit_compiler(module, machine)
    engine.finalize_object()
    peak = ctypes.CFUNCTYPE(ctypes.c_float, ctypes.c_int64, ctypes.c_float)(engine.get_function_address("peak"))
    peak(1000, 1.0)
    seconds = _best(lambda: peak(PEAK_STEPS, 0.999), 5)
    return PEAK_STEPS * CHAINS * lanes / seconds / 1e9


def micro_kernel_rate() -> float:
    import numba

    from kernels.cpu.linear import TILE_M, TILE_T
    from kernels.cpu.llvm_ir import LANES
    from kernels.cpu.llvm_prefill import make_tile_times_tokens

    kernel = make_tile_times_tokens(TILE_M, TILE_T // LANES)

    @numba.njit
    def repeat(tile, xt, block, depth, times):
        for _ in range(times):
            kernel(tile.ctypes.data, tile.shape[1], xt.ctypes.data, xt.shape[1], depth, block.ctypes.data, 0)

    depth, times = 256, 20_000
    rng = np.random.default_rng(0)
    tile = rng.random((TILE_M, depth), dtype=np.float32)
    xt = rng.random((depth, TILE_T), dtype=np.float32)
    block = np.zeros(TILE_M * TILE_T, np.float32)
    repeat(tile, xt, block, depth, 10)
    seconds = _best(lambda: repeat(tile, xt, block, depth, times), 5)
    return TILE_M * TILE_T * depth * times / seconds / 1e9


def gemm_rates(token_counts: list[int]) -> list[dict]:
    from kernels.cpu import formats as wf
    from kernels.cpu.cpu_probe import best_int8_dot
    from kernels.cpu.linear import attach_kernels, linear
    from kernels.cpu.llvm_ir import ACT_F32, INT8_DOTS
    from kernels.cpu.llvm_prefill import integer_prefill_runs

    int8_style = best_int8_dot()
    rng = np.random.default_rng(0)
    rows = []
    for kind, (n, k) in [(wf.INT4_SYM, (1536, 576)), (wf.INT4_SYM, (576, 1536)),
                         (wf.INT8_SYM, (1536, 576)), (wf.INT8_SYM, (576, 1536))]:
        group = 32
        codes = rng.integers(0, 256, (n, k // group, group // 2 if kind == wf.INT4_SYM else group), dtype=np.uint8)
        scales = (rng.random((n, k // group)) * 0.01).astype(np.float16).view(np.uint16)
        paths = {"f32 tiles": ACT_F32}
        if integer_prefill_runs(int8_style):
            paths[f"integer ({INT8_DOTS[int8_style].name})"] = int8_style
        for path, style in paths.items():
            descriptor = attach_kernels(wf.describe_quantized(kind, (n, k), group, codes, scales, None), style)
            for tokens in token_counts:
                x = rng.standard_normal((tokens, k)).astype(np.float32)
                linear(descriptor, x, None, 1)
                seconds = _best(lambda: linear(descriptor, x, None, 1), 7)
                rows.append({"kind": wf.KIND_NAMES[kind], "path": path, "rows": n, "cols": k, "tokens": tokens,
                             "gmac_per_second": n * k * tokens / seconds / 1e9})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="32,128,512", help="prompt lengths of the gemm rows")
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args()
    from kernels.cpu import isa

    count, bits = isa.vector_registers()
    peak = fma_peak(bits)
    micro = micro_kernel_rate()
    gemms = gemm_rates([int(t) for t in args.tokens.split(",")])
    for row in gemms:
        row["fraction_of_peak"] = row["gmac_per_second"] / peak
    print(f"level {isa.target_level()}: {count} vector registers of {bits} bits, one thread")
    print(f"f32 FMA peak     {peak:6.1f} GMAC/s")
    print(f"micro-kernel L1  {micro:6.1f} GMAC/s ({micro / peak:.2f} of the peak)")
    print("kind       path                            rows x cols   tokens  GMAC/s  of peak")
    for row in gemms:
        print(f"{row['kind']:<10} {row['path']:<31} {row['rows']:>4} x {row['cols']:<4}  {row['tokens']:>6}  "
              f"{row['gmac_per_second']:6.1f}  {row['fraction_of_peak']:7.2f}")
    publish({"level": isa.target_level(), "vector_bits": bits, "fma_peak_gmac_per_second": peak,
             "micro_kernel_gmac_per_second": micro, "gemm": gemms}, args.json)


if __name__ == "__main__":
    main()
