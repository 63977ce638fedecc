"""Which int8 dot product this CPU really runs.

A CPU's feature flags are not proof that an instruction runs: a virtual machine can advertise
extensions its host does not pass through (this is how llama.cpp's AMX path crashes on machines
that list AMX). So AVX-512 VNNI (vpdpbusd) is used only when LLVM knows the feature for this host
*and* a child process has run the instruction on known data and got the right sums; an illegal
instruction kills the child, not the caller. The verdict is kept per CPU (name, features, LLVM
version) in <ZLLM_EDGE_HOME>/cpu-probe.json, so only the first load on a machine pays the ~2 s.
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

VNNI_FEATURES = ("avx512vnni", "avx512bw")
PROBE_TIMEOUT_SECONDS = 300
_PROBE_OK = "vpdpbusd ok"
_verdicts: dict[str, bool] = {}
_lock = threading.Lock()


def host_features() -> dict[str, bool]:
    """The CPU features LLVM targets on this host (what a compiled kernel may use)."""
    import llvmlite.binding as llvm

    return dict(llvm.get_host_cpu_features())


def _cpu_key() -> str:
    import llvmlite
    import llvmlite.binding as llvm

    enabled = ",".join(sorted(name for name, on in host_features().items() if on))
    return f"{llvm.get_host_cpu_name()}|{enabled}|llvmlite {llvmlite.__version__}"


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


def _run_child() -> bool | None:
    """The child's verdict: True (vpdpbusd ran and summed right), False (it was an illegal
    instruction, or the sums were wrong), None (the child could not say: it did not start, timed
    out or failed otherwise; such a verdict is not kept, the next load asks again)."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    try:
        result = subprocess.run([sys.executable, "-c", "from kernels.cpu.cpu_probe import child_main; child_main()"],
                                env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as exc:
        warnings.warn(f"could not probe AVX-512 VNNI in a child process ({exc}); int8 dot products use generic "
                      "vector code in this process", RuntimeWarning, stacklevel=3)
        return None
    if result.returncode == -signal.SIGILL:
        return False
    if result.returncode == 0:
        return result.stdout.strip().endswith(_PROBE_OK)
    warnings.warn(f"the AVX-512 VNNI probe failed (exit status {result.returncode}: {result.stderr.strip()[-300:]}); "
                  "int8 dot products use generic vector code in this process", RuntimeWarning, stacklevel=3)
    return None


def runs_vnni() -> bool:
    """True when this process may emit vpdpbusd: LLVM targets it here and a child process ran it correctly."""
    features = host_features()
    if not all(features.get(name) for name in VNNI_FEATURES):
        return False
    key = _cpu_key()
    with _lock:
        if key not in _verdicts:
            stored = _read_verdicts().get(key)
            if isinstance(stored, bool):
                _verdicts[key] = stored
            else:
                verdict = _run_child()
                _verdicts[key] = bool(verdict)
                if verdict is not None:
                    _remember(key, verdict)
        return _verdicts[key]


def child_main() -> None:
    """Run vpdpbusd once on known bytes and print _PROBE_OK if its sums are right."""
    import numba
    import numpy as np
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    from kernels.cpu.llvm_ir import V16I32, V64I8, Emitter, byte_dot

    @intrinsic
    def native_byte_dot(typingctx, unsigned_bytes, signed_bytes, out):
        def codegen(context, builder, sig, args):
            e = Emitter(builder)
            dot = byte_dot(e, ir.Constant(V16I32, [0] * 16), e.load(V64I8, args[0], 1), e.load(V64I8, args[1], 1),
                            native=True)
            e.store(dot, args[2], 4)
            return context.get_dummy_value()

        return types.void(types.int64, types.int64, types.int64), codegen

    @numba.njit(cache=False)
    def run(a, b, out):
        native_byte_dot(a.ctypes.data, b.ctypes.data, out.ctypes.data)

    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, 64, dtype=np.uint8)
    b = rng.integers(-127, 128, 64, dtype=np.int8)
    out = np.zeros(16, np.int32)
    run(a, b, out)
    expected = (a.astype(np.int32) * b.astype(np.int32)).reshape(16, 4).sum(axis=1)
    if np.array_equal(out, expected):
        print(_PROBE_OK)
