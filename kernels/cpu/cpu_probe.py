"""Which SIMD extensions this CPU really runs: AVX-512 VNNI (int8 dot products) and AVX-512 BF16.

A CPU's feature flags are not proof that an instruction runs: a virtual machine can advertise
extensions its host does not pass through (this is how llama.cpp's AMX path crashes on machines
that list AMX). So VNNI's vpdpbusd and BF16's vdpbf16ps are used only when LLVM knows the feature
for this host *and* a child process has run the instruction on known data and got the right sums;
an illegal instruction kills the child, not the caller. The verdicts are kept per CPU (name,
features, LLVM version) in <ZLLM_EDGE_HOME>/cpu-probe.json, so only the first load on a machine
pays the ~2 s per instruction.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import warnings

from kernels.cache_home import zllm_home

PROBE_TIMEOUT_SECONDS = 300
# probe -> (the LLVM features it needs, what its child prints when the instruction summed right,
# its name in messages, what runs instead when it does not)
PROBES = {"vnni": (("avx512vnni", "avx512bw"), "vpdpbusd ok", "AVX-512 VNNI",
                   "int8 dot products use generic vector code"),
          "bf16": (("avx512bf16",), "vdpbf16ps ok", "AVX-512 BF16", "prefill multiplies f32 tiles")}
_verdicts: dict[str, bool] = {}
_lock = threading.Lock()


def host_features() -> dict[str, bool]:
    """The CPU features LLVM targets on this host (what a compiled kernel may use)."""
    import llvmlite.binding as llvm

    return dict(llvm.get_host_cpu_features())


def _cpu_key(probe: str) -> str:
    import llvmlite
    import llvmlite.binding as llvm

    enabled = ",".join(sorted(name for name, on in host_features().items() if on))
    key = f"{llvm.get_host_cpu_name()}|{enabled}|llvmlite {llvmlite.__version__}"
    return key if probe == "vnni" else f"{key}|{probe}"  # (VNNI's verdicts predate the others)


def _probe_file() -> str:
    return os.path.join(zllm_home(), "cpu-probe.json")


def _read_verdicts() -> dict:
    try:
        with open(_probe_file()) as handle:
            data = json.load(handle)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _remember(key: str, verdict: bool) -> None:
    verdicts = {**_read_verdicts(), key: verdict}
    path = _probe_file()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w") as handle:
            json.dump(verdicts, handle, indent=1)
        os.replace(temporary, path)
    except OSError:
        pass  # a read-only home: probe again next time rather than fail the load


def _run_child(probe: str) -> bool | None:
    """The child's verdict: True (the instruction ran and summed right), False (it was an illegal
    instruction, or the sums were wrong), None (the child could not say: it did not start, timed
    out or failed otherwise; such a verdict is not kept, the next load asks again)."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    _, expected, name, fallback = PROBES[probe]
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
    features = host_features()
    if not all(features.get(name) for name in PROBES[probe][0]):
        return False
    key = _cpu_key(probe)
    with _lock:
        if key not in _verdicts:
            stored = _read_verdicts().get(key)
            if isinstance(stored, bool):
                _verdicts[key] = stored
            else:
                verdict = _run_child(probe)
                _verdicts[key] = bool(verdict)
                if verdict is not None:
                    _remember(key, verdict)
        return _verdicts[key]


def runs_vnni() -> bool:
    """True when this process may emit AVX-512 VNNI's vpdpbusd."""
    return _runs("vnni")


def runs_bf16() -> bool:
    """True when this process may emit AVX-512 BF16's vdpbf16ps."""
    return _runs("bf16")


def child_main(probe: str = "vnni") -> None:
    """Run the probe's instruction once on known data and print its PROBES message if the sums are right."""
    import numba
    import numpy as np
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    from kernels.cpu.llvm_ir import V16F, V16I32, V64I8, Emitter, bf16_pair_dot, byte_dot

    @intrinsic
    def native_dot(typingctx, a, b, out):
        def codegen(context, builder, sig, args):
            e = Emitter(builder)
            if probe == "vnni":
                dot = byte_dot(e, ir.Constant(V16I32, [0] * 16), e.load(V64I8, args[0], 1), e.load(V64I8, args[1], 1),
                               native=True)
            else:
                dot = bf16_pair_dot(e, ir.Constant(V16F, [0.0] * 16), e.load(V16I32, args[0], 4),
                                    e.load(V16I32, args[1], 4))
            e.store(dot, args[2], 4)
            return context.get_dummy_value()

        return types.void(types.int64, types.int64, types.int64), codegen

    @numba.njit(cache=False)
    def run(a, b, out):
        native_dot(a.ctypes.data, b.ctypes.data, out.ctypes.data)

    rng = np.random.default_rng(0)
    if probe == "vnni":
        a = rng.integers(0, 256, 64, dtype=np.uint8)
        b = rng.integers(-127, 128, 64, dtype=np.int8)
        out = np.zeros(16, np.int32)
        expected = (a.astype(np.int32) * b.astype(np.int32)).reshape(16, 4).sum(axis=1)
    else:  # small integers: exact in bf16 and in the f32 sums
        a_values, b_values = (rng.integers(-100, 100, 32).astype(np.float32) for _ in range(2))
        a, b = ((values.view(np.uint32) >> 16).astype(np.uint16) for values in (a_values, b_values))
        out = np.zeros(16, np.float32)
        expected = (a_values * b_values).reshape(16, 2).sum(axis=1)
    run(a, b, out)
    if np.array_equal(out, expected):
        print(PROBES[probe][1])
