"""The instruction set the CPU kernels are compiled for: the host's, or a lower level asked for.

By default the kernels target every feature LLVM finds on this host. ZLLM_EDGE_ISA=<level> caps
them at a lower instruction-set level, so that the code a smaller CPU would run (an AVX2-only
laptop on an AVX-512 server, say) is compiled, run and tested here:

    x86_64   sse4 < avx2 < avxvnni < avx512     (avx2 = x86-64-v3: AVX2, FMA, F16C, BMI)
    aarch64  neon < dotprod < i8mm

On Linux/aarch64 the dot-product and i8mm extensions, which LLVM's host detection misses, come
from the kernel's hardware capabilities (getauxval). A cap switches off every LLVM feature of the
levels above it, both for Numba's code generator (numba.config.CPU_NAME / CPU_FEATURES, set before
the first kernel compiles) and for the choice of hand-written instructions (cpu_probe.py asks `target_features()`, never the raw host). Numba's cache
keys each kernel by the features it was compiled for, so capped and uncapped kernels never mix.
A level above what the host has is refused: those instructions would not run here.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass

ISA_ENV = "ZLLM_EDGE_ISA"


class IsaError(ValueError):
    """ZLLM_EDGE_ISA names a level this machine does not have or does not know."""


@dataclass(frozen=True)
class Level:
    name: str
    marker: str  # the LLVM feature whose presence puts a host at this level ("" for the base level)
    owns: tuple[str, ...]  # LLVM features (names or "prefix*") that belong to this level and above it


# Each architecture's levels, lowest first. A feature belongs to the first level (from the top) whose
# `owns` matches it; features no level owns belong to the base level and are never switched off.
LEVELS: dict[str, tuple[Level, ...]] = {
    "x86_64": (
        Level("sse4", "", ()),
        Level("avx2", "avx2", ("avx", "avx2", "fma", "f16c", "bmi", "bmi2", "lzcnt", "movbe", "vaes",
                                        "vpclmulqdq")),
        # with the later VEX-encoded extensions of client CPUs that have no AVX-512
        Level("avxvnni", "avxvnni", ("avxvnni*", "avxifma", "avxneconvert")),
        Level("avx512", "avx512f", ("avx512*", "avx10*", "evex512", "amx*")),
    ),
    "aarch64": (
        Level("neon", "", ()),
        Level("dotprod", "dotprod", ("dotprod",)),
        Level("i8mm", "i8mm", ("i8mm", "bf16", "sve*", "sme*", "f32mm", "f64mm")),
    ),
}
ARCH_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}


def architecture() -> str:
    machine = platform.machine().lower()
    return ARCH_ALIASES.get(machine, machine)


def _matches(feature: str, pattern: str) -> bool:
    return feature.startswith(pattern[:-1]) if pattern.endswith("*") else feature == pattern


def _level_of(levels: tuple[Level, ...], feature: str) -> int:
    for index in range(len(levels) - 1, 0, -1):
        if any(_matches(feature, pattern) for pattern in levels[index].owns):
            return index
    return 0


# LLVM's host detection on Linux/aarch64 reads only some of /proc/cpuinfo's words (asimd, fp, crc32,
# atomics, sve...) and never reports the dot-product or int8-matrix extensions, which every recent
# ARM core has; the kernel says so in the auxiliary vector: (AT_HWCAP or AT_HWCAP2, bit) -> LLVM name.
AT_HWCAP, AT_HWCAP2 = 16, 26
# (NEON and FP too, for a /proc/cpuinfo that is missing or another machine's, as under qemu-user.)
ARM_HWCAPS = {"fp-armv8": (AT_HWCAP, 0), "neon": (AT_HWCAP, 1), "fullfp16": (AT_HWCAP, 10), "dotprod": (AT_HWCAP, 20),
              "i8mm": (AT_HWCAP2, 13)}


def llvm_host_features() -> dict[str, bool]:
    import llvmlite.binding as llvm

    return dict(llvm.get_host_cpu_features())


def auxiliary_vector(kind: int) -> int:
    """getauxval(kind) of this process (0 where the C library has none)."""
    import ctypes

    try:
        getauxval = ctypes.CDLL(None).getauxval
    except (OSError, AttributeError):
        return 0
    getauxval.restype, getauxval.argtypes = ctypes.c_ulong, [ctypes.c_ulong]
    return int(getauxval(kind))


def host_features() -> dict[str, bool]:
    """The CPU features of this host, uncapped: LLVM's, with the ARM extensions it does not detect
    taken from the kernel's hardware capabilities (ARM_HWCAPS)."""
    features = llvm_host_features()
    if architecture() == "aarch64":
        for name, (kind, bit) in ARM_HWCAPS.items():
            if not features.get(name) and auxiliary_vector(kind) >> bit & 1:
                features[name] = True
    return features


def host_level(features: dict[str, bool] | None = None) -> str | None:
    """The highest level whose marker feature the host has (None on an architecture without levels)."""
    levels = LEVELS.get(architecture())
    if not levels:
        return None
    features = host_features() if features is None else features
    reached = [level.name for level in levels if not level.marker or features.get(level.marker)]
    return reached[-1]


def requested_level() -> str | None:
    """The cap ZLLM_EDGE_ISA asks for, checked against this architecture and host (None: no cap)."""
    wanted = os.environ.get(ISA_ENV, "").strip().lower()
    if not wanted or wanted == "native":
        return None
    arch = architecture()
    levels = LEVELS.get(arch, ())
    names = [level.name for level in levels]
    if wanted not in names:
        known = ", ".join(names) if names else "none"
        raise IsaError(f"{ISA_ENV}={wanted!r} is not an instruction-set level of {arch} (levels: {known}, or "
                       f"native); unset it to use everything this CPU has")
    host = host_level()
    if names.index(wanted) > names.index(host):
        raise IsaError(f"{ISA_ENV}={wanted!r} asks for more than this CPU has (its level is {host}); "
                       f"choose one of {', '.join(names[:names.index(host) + 1])}")
    return wanted


def target_features() -> dict[str, bool]:
    """The features the kernels are compiled for: the host's, less those above the requested level."""
    features = host_features()
    wanted = requested_level()
    if wanted is None:
        return features
    levels = LEVELS[architecture()]
    cap = [level.name for level in levels].index(wanted)
    return {name: on and _level_of(levels, name) <= cap for name, on in features.items()}


def target_level() -> str | None:
    """The level the kernels run at: the requested cap, else the host's."""
    return requested_level() or host_level()


def vector_registers() -> tuple[int, int]:
    """(count, bits) of the vector registers the kernels' target has: what a register-blocked
    micro-kernel may keep its accumulators in."""
    features = target_features()
    if architecture() == "aarch64":
        return 32, 128  # NEON (SVE's may be wider, the kernels use NEON's)
    if features.get("avx512f"):
        return 32, 512
    return 16, 256 if features.get("avx") else 128


def feature_string(features: dict[str, bool]) -> str:
    """LLVM's attribute string of a feature set ("+avx2,-avx512f,...")."""
    return ",".join(("+" if on else "-") + name for name, on in sorted(features.items()))


# Without F16C, LLVM converts between half and float through compiler-rt's helpers, which the JIT
# does not have: they are taken from GCC's runtime (libgcc_s, GCC 12 and later), which has them
# with the calling convention LLVM uses (the half value in an xmm register).
HALF_HELPERS = ("__extendhfsf2", "__truncsfhf2", "__truncdfhf2")


def _provide_half_helpers() -> None:
    import ctypes
    import ctypes.util

    import llvmlite.binding as llvm

    name = ctypes.util.find_library("gcc_s") or "libgcc_s.so.1"
    try:
        runtime = ctypes.CDLL(name)
        addresses = {helper: ctypes.cast(getattr(runtime, helper), ctypes.c_void_p).value for helper in HALF_HELPERS}
    except (OSError, AttributeError) as exc:
        raise IsaError(f"the kernels' target has no F16C, and GCC's runtime ({name}) does not provide the half "
                       f"conversions LLVM then calls ({exc}); install GCC 12's libgcc-s1 or later, or run on a "
                       f"CPU with F16C") from None
    for helper, address in addresses.items():
        llvm.add_symbol(helper, address)


_configuration_error: IsaError | None = None  # what configure_codegen met, raised by check_configuration


def configure_codegen() -> None:
    """Point Numba's code generator at the capped feature set (no-op without a cap), and give the JIT
    the half-conversion helpers a target without F16C needs.

    Numba reads these when it creates its CPU code generator, at the first compilation: this must
    run before any kernel compiles, and does when kernels/cpu is imported. Importing must not fail
    (the reference device imports kernels/ too): a bad ZLLM_EDGE_ISA or missing helpers are kept
    and raised by check_configuration() when the cpu device is created."""
    global _configuration_error
    import llvmlite.binding as llvm
    import numba

    try:
        level, features = requested_level(), target_features()
        if architecture() == "x86_64" and not features.get("f16c"):
            _provide_half_helpers()
    except IsaError as exc:
        _configuration_error = exc
        return
    if level is None and features == llvm_host_features():
        return  # Numba's own host detection targets the same
    numba.config.CPU_NAME = llvm.get_host_cpu_name()
    numba.config.CPU_FEATURES = feature_string(features)


def check_configuration() -> None:
    """Raise what configure_codegen met, or IsaError if Numba's code generator targets other
    features than the cap asks for."""
    if _configuration_error is not None:
        raise _configuration_error
    check_codegen()


def check_codegen() -> None:
    """Raise if Numba's code generator was created before the cap was set (it would emit the host's
    instructions while the kernels chose a lower level's)."""
    from numba.core.registry import cpu_target

    if requested_level() is None and target_features() == llvm_host_features():
        return
    features = cpu_target.target_context.codegen()._tm_features
    if features != feature_string(target_features()):
        raise IsaError(f"{ISA_ENV}={requested_level()} was set after Numba compiled its first function in this "
                       f"process; set it before importing numba (or anything that compiles with it)")
