"""Virtual environments for the peer engines of benchmarks/peers.py.

Each peer that needs packages we do not want in the project's environment (a llama.cpp compiled
for one instruction set, onnxruntime-genai and its model builder) gets a helper virtualenv of its own
(devices/helper_envs.py: where it lives, what it inherits from the interpreter that creates it, the
marker that decides when it is rebuilt, and the check that rebuilds a damaged one). A failed build, or
a built one whose import check fails, raises PeerUnavailable with the reason, so the benchmark can
report why; a folder of environments that cannot be written raises PeerEnvNotWritable, a
PeerUnavailable that is also the ZllmError naming the folder and the variable that moves it.

llama.cpp is compiled for the instruction-set level zllm-edge's kernels run at (kernels/cpu/isa.py:
the host's, or the lower one ZLLM_EDGE_ISA asks for), one venv per level, named after it
(llama-cpp-0.3.36-avx2-noamx). Always -DGGML_NATIVE=OFF and AMX off; each ggml switch is ON exactly
when the kernels' target has its features and, where cpu_probe.py has a probe for its instruction,
a child process ran it:

    x86_64   sse4     GGML_SSE42 (AVX ... BMI2 OFF: with GGML_NATIVE=OFF they default to ON)
             avx2     + GGML_AVX GGML_AVX2 GGML_FMA GGML_F16C GGML_BMI2
             avxvnni  + GGML_AVX_VNNI
             avx512   + GGML_AVX512 (F, CD, VL, DQ, BW) GGML_AVX512_VBMI GGML_AVX512_VNNI GGML_AVX512_BF16
    aarch64  GGML_CPU_ARM_ARCH=armv8-a (neon), armv8.2-a+dotprod(+fp16) (dotprod), ...+i8mm (i8mm)

A switch that the level has but whose probe failed is OFF and named in the venv's name
(...-avx512-no-avx512_vnni-noamx). llama_print_system_info() lists what the library was compiled
with; LlamaCppBuild.check_system_info compares it with the switches.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

if __name__ == "__main__":  # run as a script: the project's packages from this checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from devices.helper_envs import HelperEnv, HelperEnvBroken, HelperEnvNotWritable, HelperEnvUnavailable  # noqa: E402
from devices.helper_envs import ensure_env as ensure_helper_env  # noqa: E402
from edge.core.files import NotWritableError  # noqa: E402


class PeerUnavailable(RuntimeError):
    """A peer engine cannot be set up or run here; the message says why."""


class PeerEnvNotWritable(PeerUnavailable, NotWritableError):
    """The folder of helper environments cannot be written: a peer reported unavailable like any other,
    and the ZllmError that names the folder and the variable that moves it."""


LLAMA_CPP_VERSION = "0.3.36"
# No -march=native: it compiles in whatever the build machine has. No AMX: its kernels crash on
# machines that advertise AMX without the kernel enabling it.
LLAMA_CPP_FIXED_ARGS = ("-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")


@dataclass(frozen=True)
class GgmlSwitch:
    """One instruction-set switch of ggml's CPU backend."""

    name: str  # x86: the CMake option; ARM: the extension appended to GGML_CPU_ARM_ARCH
    features: tuple[str, ...]  # the LLVM features it compiles in (isa.target_features() names)
    probe: str = ""  # the cpu_probe.PROBES entry that must also run here
    reports: str = ""  # its name in llama_print_system_info() ("" where that does not list it)


# The options of ggml/CMakeLists.txt and ggml/src/ggml-cpu/CMakeLists.txt in the llama.cpp that
# llama-cpp-python 0.3.36 vendors. With GGML_NATIVE=OFF, SSE42, AVX, AVX2, FMA, F16C and BMI2 default
# to ON, so every option is passed, ON or OFF.
GGML_X86 = (
    GgmlSwitch("GGML_SSE42", ("sse4.2",)),
    GgmlSwitch("GGML_AVX", ("avx",), reports="AVX"),
    GgmlSwitch("GGML_AVX2", ("avx2",), "avx2", "AVX2"),
    GgmlSwitch("GGML_FMA", ("fma",), reports="FMA"),
    GgmlSwitch("GGML_F16C", ("f16c",), reports="F16C"),
    GgmlSwitch("GGML_BMI2", ("bmi2",), reports="BMI2"),
    GgmlSwitch("GGML_AVX_VNNI", ("avxvnni",), "avxvnni", "AVX_VNNI"),
    GgmlSwitch("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"), reports="AVX512"),
    GgmlSwitch("GGML_AVX512_VBMI", ("avx512f", "avx512vbmi"), reports="AVX512_VBMI"),
    GgmlSwitch("GGML_AVX512_VNNI", ("avx512f", "avx512vnni"), "vnni", "AVX512_VNNI"),
    GgmlSwitch("GGML_AVX512_BF16", ("avx512f", "avx512bf16"), "bf16", "AVX512_BF16"),
)
# SVE and SME stay off: zllm-edge's kernels have no such level.
GGML_ARM = (
    GgmlSwitch("dotprod", ("dotprod",), "dotprod", "DOTPROD"),
    GgmlSwitch("fp16", ("fullfp16",), reports="FP16_VA"),
    GgmlSwitch("i8mm", ("i8mm",), "i8mm", "MATMUL_INT8"),
)
GGML_SWITCHES = {"x86_64": GGML_X86, "aarch64": GGML_ARM}
# llama_print_system_info() names that no build of ours may report
GGML_NEVER = {"x86_64": ("AMX_INT8",), "aarch64": ("SVE", "SME")}


@dataclass(frozen=True)
class LlamaCppBuild:
    """llama.cpp compiled for the instruction-set level zllm-edge's kernels target here."""

    level: str  # isa.target_level()
    vetoed: tuple[str, ...]  # switches the level has whose probe instruction did not run here
    cmake_args: str
    expected: frozenset[str]  # what llama_print_system_info() must list, of `checked`
    checked: frozenset[str]

    @property
    def env(self) -> HelperEnv:
        # It inherits nothing: llama-cpp-python brings its own numpy. Compiling takes about 10 minutes;
        # --no-cache-dir keeps pip from reusing a wheel built with other flags.
        vetoed = "".join(f"-no-{name.removeprefix('GGML_').lower()}" for name in self.vetoed)
        return HelperEnv(
            name=f"llama-cpp-{LLAMA_CPP_VERSION}-{self.level}{vetoed}-noamx",
            requirements=(f"llama-cpp-python=={LLAMA_CPP_VERSION}",),
            build_env={"CMAKE_ARGS": self.cmake_args, "FORCE_CMAKE": "1"},
            pip_args=("--no-binary", "llama-cpp-python", "--no-cache-dir"),
            inherit=False,
            import_check="import llama_cpp; print(llama_cpp.__version__)",
            pip_timeout_s=3600.0,
        )

    def record(self) -> dict:
        """What a benchmark report keeps of the build."""
        return {"isa": self.level, "env": self.env.name, "cmake_args": self.cmake_args,
                "probe_vetoed": list(self.vetoed)}

    def check_system_info(self, system_info: str) -> None:
        """Raise PeerUnavailable unless llama_print_system_info() lists exactly the switches' features
        (a compiler default or a build script that overrode CMAKE_ARGS would show here)."""
        from devices.helper_envs import env_folder

        listed = {name for name, value in re.findall(r"(\w+) = (\w+)", system_info) if value == "1"}
        compiled = listed & self.checked
        if compiled != self.expected:
            raise PeerUnavailable(
                f"llama.cpp in {self.env.name} was compiled with {sorted(compiled)}, expected {sorted(self.expected)} "
                f"for {self.level} (CMAKE_ARGS {self.cmake_args}); see install.log in its venv "
                f"({env_folder(self.env)}) and delete the venv to rebuild it")


def llama_cpp_build() -> LlamaCppBuild:
    """The llama.cpp build for the level the kernels run at here (runs cpu_probe's probes the first time)."""
    from kernels.cpu import cpu_probe, isa

    arch, level = isa.architecture(), isa.target_level()
    if arch not in GGML_SWITCHES or level is None:
        raise PeerUnavailable(f"kernels/cpu/isa.py has no instruction-set levels for {arch}, so llama.cpp cannot "
                              f"be built for the level zllm-edge's kernels run at")
    for variable in ("CFLAGS", "CXXFLAGS"):
        if re.search(r"-m(arch|cpu)=", os.environ.get(variable, "")):
            raise PeerUnavailable(f"{variable}={os.environ[variable]!r} chooses a CPU for the compiler, which would "
                                  f"override the {level} flags of the llama.cpp build; unset it")
    features = isa.target_features()
    switches, vetoed = [], []
    for switch in GGML_SWITCHES[arch]:
        targeted = all(features.get(name) for name in switch.features)
        runs = targeted and (not switch.probe or cpu_probe.runs(switch.probe))
        switches.append((switch.name, runs))
        if targeted and not runs:
            vetoed.append(switch.name)
    if arch == "x86_64":
        arch_args = [f"-D{name}={'ON' if on else 'OFF'}" for name, on in switches]
    else:  # every CPU with one of these extensions is armv8.2-a; a NEON-only one may be armv8.0-a
        extensions = "".join(f"+{name}" for name, on in switches if on)
        arch_args = [f"-DGGML_CPU_ARM_ARCH={'armv8.2-a' if extensions else 'armv8-a'}{extensions}"]
    on = dict(switches)
    return LlamaCppBuild(
        level=level, vetoed=tuple(vetoed),
        cmake_args=" ".join([*LLAMA_CPP_FIXED_ARGS, *arch_args]),
        expected=frozenset(switch.reports for switch in GGML_SWITCHES[arch] if switch.reports and on[switch.name]),
        checked=frozenset([*(switch.reports for switch in GGML_SWITCHES[arch] if switch.reports), *GGML_NEVER[arch]]))


def llama_cpp_spec() -> HelperEnv:
    """The helper venv of llama.cpp for the level the kernels run at here."""
    return llama_cpp_build().env


# onnxruntime-genai and its model builder (also the peer of tests/test_npu_peer_ort_genai.py). The
# builder imports torch and transformers, which it inherits from the project's interpreter instead of
# installing them again.
ORT_GENAI = HelperEnv(
    name="onnxruntime-genai-0.18.0",
    requirements=("onnxruntime-genai==0.18.0", "onnx", "onnx-ir"),
    import_check="import onnxruntime_genai as og; import onnxruntime_genai.models.builder; print(og.__version__)",
)


def ensure_env(spec: HelperEnv, progress=print) -> str:
    """The venv's python, building the venv first if it is missing or was built differently."""
    try:
        return str(ensure_helper_env(spec, progress))
    except HelperEnvNotWritable as exc:
        raise PeerEnvNotWritable(str(exc)) from None
    except (HelperEnvUnavailable, HelperEnvBroken) as exc:  # either way the peer's column says why
        raise PeerUnavailable(str(exc)) from exc


if __name__ == "__main__":
    # Build every peer venv ahead of a benchmark run: python benchmarks/bench_envs.py [llama|ort]
    wanted = set(sys.argv[1:]) or {"llama", "ort"}
    for key, make_spec in (("llama", llama_cpp_spec), ("ort", lambda: ORT_GENAI)):  # (llama's probes the CPU)
        if key in wanted:
            try:
                print(ensure_env(make_spec(), progress=lambda m: print(m, file=sys.stderr)))
            except PeerUnavailable as exc:
                print(f"{key}: {exc}", file=sys.stderr)
