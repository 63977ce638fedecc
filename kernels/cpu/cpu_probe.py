"""Which SIMD instructions this CPU really runs: the integer dot products of int8 activations
(AVX-512 VNNI, AVX-VNNI, AVX2's and SSSE3's pmaddubsw, ARM's sdot and i8mm's usdot) and AVX-512 BF16.

A CPU's feature flags are not proof that an instruction runs: a virtual machine can advertise
extensions its host does not pass through (this is how llama.cpp's AMX path crashes on machines
that list AMX). So each instruction is used only when the kernels' target has its features
(isa.py: the host's, or a lower level asked for) *and* a child process has run it on known data and
got the right sums; an illegal instruction kills the child, not the caller. The verdicts are kept
per CPU (name, target features, LLVM version) in <ZLLM_EDGE_HOME>/cpu-probe.json, so only the first
load on a machine pays the ~2 s per instruction. A damaged file is said and the CPU probed again; a
home that cannot take a new verdict is an error naming the file and ZLLM_EDGE_HOME.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from edge.core.files import write_atomically
from kernels.cache_home import home_not_writable, zllm_home

PROBE_TIMEOUT_SECONDS = 300


@dataclass(frozen=True)
class Probe:
    features: tuple[str, ...]  # the LLVM features it needs
    name: str  # in messages
    fallback: str  # what runs instead when it does not

    def passed(self, key: str) -> str:
        """What the child prints when the instruction summed right."""
        return f"{key} ok"


INT8_FALLBACK = "int8 dot products use the next instruction set down, or generic vector code"
PROBES = {"vnni": Probe(("avx512vnni", "avx512bw"), "AVX-512 VNNI", INT8_FALLBACK),
          "avxvnni": Probe(("avxvnni", "avx2"), "AVX-VNNI", INT8_FALLBACK),
          "avx2": Probe(("avx2",), "AVX2 vpmaddubsw", INT8_FALLBACK),
          "ssse3": Probe(("ssse3",), "SSSE3 pmaddubsw", INT8_FALLBACK),
          "dotprod": Probe(("neon", "dotprod"), "NEON sdot", INT8_FALLBACK),
          "i8mm": Probe(("neon", "i8mm"), "NEON i8mm usdot", INT8_FALLBACK),
          "bf16": Probe(("avx512bf16",), "AVX-512 BF16", "prefill multiplies f32 tiles"),
          # not an instruction: whether bf16 prefill tiles beat f32 ones on this CPU (they need not:
          # dequantizing to bf16 and pairing the tokens cost more than the second multiply-add gains
          # on some), measured on a SmolLM2-sized projection once and kept like a verdict
          "bf16_faster": Probe(("avx512bf16",), "bf16 prefill speed", "prefill multiplies f32 tiles")}
# bf16_faster: a 576 x 576 int4 weight times 128 tokens, best of this many alternating calls
PREFILL_TIMING_CALLS = 7
_verdicts: dict[str, bool] = {}
_lock = threading.Lock()


def target_features() -> dict[str, bool]:
    """The CPU features the kernels are compiled for (isa.py: the host's, or a lower level's)."""
    from kernels.cpu import isa

    return isa.target_features()


def _cpu_key(probe: str) -> str:
    import llvmlite
    import llvmlite.binding as llvm

    enabled = ",".join(sorted(name for name, on in target_features().items() if on))
    key = f"{llvm.get_host_cpu_name()}|{enabled}|llvmlite {llvmlite.__version__}"
    return key if probe == "vnni" else f"{key}|{probe}"  # (VNNI's verdicts predate the others)


def _probe_file() -> str:
    return os.path.join(zllm_home(), "cpu-probe.json")


def _read_verdicts(report: bool = True) -> dict:
    """The kept verdicts, {} when there are none; a damaged file is said so (`report`) and probed again."""
    try:
        with open(_probe_file()) as handle:
            data = json.load(handle)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as exc:
        if report:
            print(f"{_probe_file()} cannot be read ({exc}); probing the CPU again", file=sys.stderr)
        return {}
    if not isinstance(data, dict) or not all(isinstance(v, bool) for v in data.values()):
        if report:
            print(f"{_probe_file()} is damaged (not an object of true/false verdicts); probing the CPU again",
                  file=sys.stderr)
        return {}
    return data


def _remember(key: str, verdict: bool) -> None:
    """Keep a verdict in the probe file; a home that cannot take it is a NotWritableError (probing
    again at every load instead would make every load pay for the probes, unsaid)."""
    verdicts = {**_read_verdicts(report=False), key: verdict}
    path = _probe_file()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomically(path, lambda handle: json.dump(verdicts, handle, indent=1))
    except OSError as exc:
        raise home_not_writable(path, exc) from None


def _run_child(probe: str) -> bool | None:
    """The child's verdict: True (the instruction ran and summed right), False (it was an illegal
    instruction, or the sums were wrong), None (the child could not say: it did not start, timed
    out or failed otherwise; such a verdict is not kept, the next load asks again)."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    name, fallback, expected = PROBES[probe].name, PROBES[probe].fallback, PROBES[probe].passed(probe)
    try:
        command = f"from kernels.cpu.cpu_probe import child_main; child_main({probe!r})"
        result = subprocess.run([sys.executable, "-c", command], env=env, capture_output=True, text=True,
                                timeout=PROBE_TIMEOUT_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as exc:
        warnings.warn(f"could not probe {name} in a child process ({exc}); {fallback} in this process",
                      RuntimeWarning, stacklevel=4)
        return None
    if result.returncode == -signal.SIGILL:
        return False
    if result.returncode == 0:
        return result.stdout.strip().endswith(expected)
    warnings.warn(f"the {name} probe failed (exit status {result.returncode}: {result.stderr.strip()[-300:]}); "
                  f"{fallback} in this process", RuntimeWarning, stacklevel=4)
    return None


def _runs(probe: str) -> bool:
    """True when this process may emit the probe's instruction: LLVM targets it here and a child
    process ran it correctly."""
    features = target_features()
    if not all(features.get(name) for name in PROBES[probe].features):
        return False
    key = _cpu_key(probe)
    with _lock:
        if key not in _verdicts:
            stored = _read_verdicts().get(key)
            if isinstance(stored, bool):
                _verdicts[key] = stored
            else:
                verdict = _run_child(probe)
                if verdict is not None:
                    _remember(key, verdict)
                _verdicts[key] = bool(verdict)
        return _verdicts[key]


def probe_first_needs() -> None:
    """Run side by side the probes a backend asks first on a new machine: the widest int8 dot product the
    target has, and AVX-512 BF16. Each is a child process that starts an interpreter and Numba; asked one
    after another, the first load waits for them in turn. Verdicts already kept are not asked again; a probe
    alone is left to be run when it is asked for."""
    from kernels.cpu.llvm_ir import INT8_DOTS

    features = target_features()
    has = lambda probe: all(features.get(name) for name in PROBES[probe].features)  # noqa: E731
    int8 = next((INT8_DOTS[style].probe for style in int8_dot_order() if has(INT8_DOTS[style].probe)), None)
    wanted = [probe for probe in (int8, "bf16") if probe is not None and has(probe)]
    with _lock:
        stored = _read_verdicts()
        pending = [probe for probe in wanted
                   if _cpu_key(probe) not in _verdicts and not isinstance(stored.get(_cpu_key(probe)), bool)]
        if len(pending) < 2:
            return
        with ThreadPoolExecutor(len(pending)) as pool:
            verdicts = list(pool.map(_run_child, pending))
        for probe, verdict in zip(pending, verdicts):
            if verdict is not None:
                _remember(_cpu_key(probe), verdict)
            _verdicts[_cpu_key(probe)] = bool(verdict)


def runs(probe: str) -> bool:
    """True when this process may emit the instruction of PROBES[probe]."""
    return _runs(probe)


def runs_bf16() -> bool:
    """True when this process may emit AVX-512 BF16's vdpbf16ps."""
    return _runs("bf16")


def bf16_prefill_is_faster() -> bool:
    """True when vdpbf16ps runs here and bf16 prefill tiles were measured faster than f32 ones."""
    return _runs("bf16") and _runs("bf16_faster")


def best_int8_dot() -> int:
    """The activation style (llvm_ir.ACT_INT8*) whose dot-product instructions run here, the widest
    first; generic vector IR (ACT_INT8) where none does."""
    from kernels.cpu.llvm_ir import ACT_INT8, INT8_DOTS

    for style in int8_dot_order():
        if _runs(INT8_DOTS[style].probe):
            return style
    return ACT_INT8


def int8_dot_order() -> tuple[int, ...]:
    """The int8 activation styles (llvm_ir.ACT_INT8_*) with an instruction of their own, the widest first."""
    from kernels.cpu.llvm_ir import (ACT_INT8_AVX2, ACT_INT8_AVXVNNI, ACT_INT8_DOTPROD, ACT_INT8_I8MM, ACT_INT8_SSSE3,
                                     ACT_INT8_VNNI)

    return ACT_INT8_VNNI, ACT_INT8_AVXVNNI, ACT_INT8_AVX2, ACT_INT8_SSSE3, ACT_INT8_I8MM, ACT_INT8_DOTPROD


def _time_prefill_tiles() -> None:
    """bf16_faster's child: print its passed() message when the bf16 gemm beats the f32 one."""
    import time

    import numpy as np

    from kernels.cpu import formats as wf
    from kernels.cpu.linear import attach_kernels, linear
    from kernels.cpu.llvm_ir import ACT_INT8

    rng = np.random.default_rng(0)
    rows, cols, group = 576, 576, 32
    codes = rng.integers(0, 256, (rows, cols // group, group // 2), dtype=np.uint8)
    scales = (rng.random((rows, cols // group)) * 0.01).astype(np.float16).view(np.uint16)
    x = rng.standard_normal((128, cols)).astype(np.float32)
    descriptors = {bf16: attach_kernels(wf.describe_quantized(wf.INT4_SYM, (rows, cols), group, codes, scales, None),
                                        ACT_INT8, bf16) for bf16 in (False, True)}
    best = {False: float("inf"), True: float("inf")}
    for _ in range(PREFILL_TIMING_CALLS):
        for bf16, descriptor in descriptors.items():
            started = time.perf_counter()
            linear(descriptor, x, None, 1)
            best[bf16] = min(best[bf16], time.perf_counter() - started)
    print(f"f32 {best[False] * 1e3:.3f} ms, bf16 {best[True] * 1e3:.3f} ms")
    if best[True] < best[False]:
        print(PROBES["bf16_faster"].passed("bf16_faster"))


def child_main(probe: str) -> None:
    """Run the probe's instruction on known data and print its passed() message if the sums are right."""
    if probe == "bf16_faster":
        _time_prefill_tiles()
        return
    import numba
    import numpy as np
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    from kernels.cpu import llvm_ir
    from kernels.cpu.llvm_ir import V16F, V16I32, V64I8, Emitter, byte_dot, nibble_pair_dot
    from kernels.cpu.llvm_prefill import bf16_pair_dot

    styles = {dot.probe: style for style, dot in llvm_ir.INT8_DOTS.items() if dot.probe}

    def compiled(form: int):
        """A jitted run(a, b, c, d, out) of the instruction: `form` 0 the nibble pairs (a, b) and
        (c, d) of int4 codes, 1 unsigned codes a times b, 2 signed codes a times b (bf16: a . b)."""

        @intrinsic
        def instruction(typingctx, a, b, c, d, out):
            def codegen(context, builder, sig, args):
                e = Emitter(builder)
                zero = ir.Constant(V16I32, [0] * 16)
                if probe == "bf16":
                    result = bf16_pair_dot(e, ir.Constant(V16F, [0.0] * 16), e.load(V16I32, args[0], 4),
                                           e.load(V16I32, args[1], 4))
                else:
                    style = styles[probe]
                    a_bytes, b_bytes, c_bytes, d_bytes = (e.load(V64I8, address, 1) for address in args[:4])
                    if form == 0:
                        result = nibble_pair_dot(e, zero, a_bytes, b_bytes, c_bytes, d_bytes, style)
                    else:
                        result = byte_dot(e, zero, a_bytes, b_bytes, style, signed=form == 2)
                e.store(result, args[4], 4)
                return context.get_dummy_value()

            return types.void(*([types.int64] * 5)), codegen

        @numba.njit(cache=False)
        def run(a, b, c, d, out):
            instruction(a.ctypes.data, b.ctypes.data, c.ctypes.data, d.ctypes.data, out.ctypes.data)

        return run

    rng = np.random.default_rng(0)

    def lanes(products):  # sums of 4 neighbours
        return products.astype(np.int64).reshape(16, 4).sum(axis=1)

    if probe == "bf16":  # small integers: exact in bf16 and in the f32 sums
        a_values, b_values = (rng.integers(-100, 100, 32).astype(np.float32) for _ in range(2))
        a, b = ((values.view(np.uint32) >> 16).astype(np.uint16) for values in (a_values, b_values))
        out = np.zeros(16, np.float32)
        compiled(0)(a, b, a, b, out)
        right = np.array_equal(out, (a_values * b_values).reshape(16, 2).sum(axis=1))
    else:
        q = [rng.integers(-127, 128, 64, dtype=np.int8) for _ in range(2)]
        nibbles = [rng.integers(0, 16, 64, dtype=np.uint8) for _ in range(2)]
        out = np.zeros(16, np.int32)
        compiled(0)(nibbles[0], q[0], nibbles[1], q[1], out)
        right = np.array_equal(out, lanes(nibbles[0] * q[0].astype(np.int64) + nibbles[1] * q[1].astype(np.int64)))
        if llvm_ir.INT8_DOTS[styles[probe]].signed_codes:
            codes, form = rng.integers(-128, 128, 64, dtype=np.int8), 2
            codes[:4] = -128  # the extremes: |code| = 128 and the largest pair sums
        else:
            codes, form = rng.integers(0, 256, 64, dtype=np.uint8), 1
            codes[:4] = 255
        q[0][:4] = -127
        compiled(form)(codes, q[0], codes, q[0], out)
        right = right and np.array_equal(out, lanes(codes.astype(np.int64) * q[0]))
    if right:
        print(PROBES[probe].passed(probe))
