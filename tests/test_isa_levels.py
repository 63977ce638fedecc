"""Every instruction-set level the kernels can be compiled for runs them correctly, not only the
host's: the CPU kernel tests and SmolLM2's golden tests run again in a child pytest with the kernels
capped at each level below the host's (ZLLM_EDGE_ISA, kernels/cpu/isa.py). On an AVX-512 machine
that covers AVX-VNNI, AVX2 (16 ymm: other micro-kernel passes, vpmaddubsw) and SSE4 (no F16C: half
conversions through libgcc_s; SSSE3 pmaddubsw); on an AVX2 laptop, SSE4; on ARM, NEON below dotprod.

The levels above the host's cannot run here (their instructions would fault): the suite passes on
such a machine without them, and says so in the skip.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.cpu import isa
from tiny_models import tiny_zoo  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
LEVEL_TESTS = (
    "tests/test_cpu_kernels.py",
    "tests/test_isa_levels.py::test_the_kernels_target_the_level_asked_for",
    "tests/test_cpu_backend.py::test_smollm2_capital_of_france_begins_with_paris",
    "tests/test_cpu_backend.py::test_smollm2_greedy_ids_match_the_reference_up_to_first_near_tie",
)


def lower_levels() -> list[str]:
    levels = [level.name for level in isa.LEVELS.get(isa.architecture(), ())]
    host = isa.host_level()
    return levels[:levels.index(host)] if host in levels else []


def test_the_kernels_target_the_level_asked_for():
    """device_info() names the level the kernels are compiled for, and the cap when one is set; Numba's
    code generator targets exactly the capped features."""
    from devices.cpu import CpuBackend

    info = CpuBackend(threads=1).info()
    assert info["isa"] == isa.target_level()
    assert info["isa_capped"] == (isa.requested_level() is not None)
    if os.environ.get(isa.ISA_ENV):
        assert info["isa"] == os.environ[isa.ISA_ENV]
        isa.check_codegen()  # raises if Numba's code generator targets other features


@pytest.mark.parametrize("level", lower_levels() or [pytest.param(None, marks=pytest.mark.skip(
    reason=f"this CPU's level ({isa.host_level()}) is the lowest the kernels know on {isa.architecture()}"))])
def test_cpu_kernels_pass_at_every_lower_level(level, tmp_path):
    env = {**os.environ, isa.ISA_ENV: level, "PYTHONPATH": str(REPO)}
    env.pop("ZLLM_EDGE_HOME", None)  # the child's conftest makes its own
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                             str(tmp_path / "child"), *LEVEL_TESTS], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=1800)
    assert result.returncode == 0, f"at {isa.ISA_ENV}={level}:\n{result.stdout[-4000:]}\n{result.stderr[-2000:]}"
    assert " passed" in result.stdout.splitlines()[-1]


def test_levels_are_checked_against_the_architecture_and_the_host(monkeypatch):
    monkeypatch.setattr(isa, "architecture", lambda: "x86_64")
    monkeypatch.setattr(isa, "host_features", lambda: {"avx": True, "avx2": True, "fma": True, "f16c": True,
                                                       "sse4.2": True, "avx512f": False})
    monkeypatch.setenv(isa.ISA_ENV, "avx512")
    with pytest.raises(isa.IsaError) as error:
        isa.requested_level()
    assert str(error.value) == ("ZLLM_EDGE_ISA='avx512' asks for more than this CPU has (its level is avx2); "
                                "choose one of sse4, avx2")
    monkeypatch.setenv(isa.ISA_ENV, "neon")
    with pytest.raises(isa.IsaError) as error:
        isa.requested_level()
    assert str(error.value) == ("ZLLM_EDGE_ISA='neon' is not an instruction-set level of x86_64 (levels: sse4, "
                                "avx2, avxvnni, avx512, or native); unset it to use everything this CPU has")
    monkeypatch.setenv(isa.ISA_ENV, "sse4")
    features = isa.target_features()
    assert features["sse4.2"] and not any(features[name] for name in ("avx", "avx2", "fma", "f16c"))
    assert isa.target_level() == "sse4" and isa.vector_registers() == (16, 128)
    monkeypatch.setenv(isa.ISA_ENV, "native")
    assert isa.target_level() == "avx2" and isa.target_features()["fma"]


@pytest.mark.parametrize("style, features, instructions", [
    ("dotprod", "+neon,+dotprod", {"sdot"}),
    ("i8mm", "+neon,+dotprod,+i8mm", {"usdot", "sdot"}),
])
def test_the_arm_int8_dots_lower_to_sdot_and_usdot(style, features, instructions):
    """The ARM styles' IR is legal for AArch64 and lowers to the dot-product instructions, checked by
    compiling it for an aarch64 target machine (their sums are checked where the suite runs on ARM,
    by test_cpu_kernels and the probes): 16 lanes of a 64-byte step in 4 instructions each."""
    import llvmlite.binding as llvm
    from llvmlite import ir

    from kernels.cpu import llvm_ir as L

    styles = {dot.probe: s for s, dot in L.INT8_DOTS.items() if dot.probe}
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    module = ir.Module(name=f"int8_dot_{style}")
    module.triple = "aarch64-unknown-linux-gnu"
    function = ir.Function(module, ir.FunctionType(ir.VoidType(), [L.I64] * 4), name="dots")
    builder = ir.IRBuilder(function.append_basic_block())
    e = L.Emitter(builder)
    codes, q, high = (e.load(L.V64I8, address, 1) for address in function.args[:3])
    zero = ir.Constant(L.V16I32, [0] * 16)
    signed = L.byte_dot(e, zero, codes, q, styles[style], signed=True)  # int8 codes, as code - 128
    nibbles = L.nibble_pair_dot(e, signed, codes, q, high, q, styles[style])  # int4 codes
    e.store(nibbles, function.args[3], 4)
    builder.ret_void()
    parsed = llvm.parse_assembly(str(module))
    parsed.verify()
    machine = llvm.Target.from_triple(module.triple).create_target_machine(cpu="generic", features=features, opt=2)
    assembly = machine.emit_assembly(parsed)
    counts = {name: assembly.count(f"\t{name}\t") for name in ("sdot", "usdot")}
    assert sum(counts.values()) == 12 and {name for name, n in counts.items() if n} == instructions, counts


def test_a_bad_level_is_refused_by_the_cpu_device_alone(tiny_zoo):
    """ZLLM_EDGE_ISA is read when kernels/ is imported, which every device does: a value that is not a
    level, or above the host's, fails the cpu device's load with the level check's message (the CLI's
    one error line), and leaves the reference device alone."""
    from converters.convert import QuantPlan

    path = tiny_zoo.converted("llama_mha", QuantPlan(weights="f32"))
    script = ("import sys, edge\n"
              "from edge.core.errors import ZllmError\n"
              "print(edge.load(sys.argv[1], device='reference').session(capacity=8).prefill([5, 6]).shape)\n"
              "try:\n"
              "    edge.load(sys.argv[1], device='cpu')\n"
              "except ZllmError as exc:\n"
              "    print(exc)\n")
    env = {**os.environ, isa.ISA_ENV: "avx9", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", script, path], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    shape, message = result.stdout.strip().splitlines()[-2:]
    assert shape == "(160,)"
    assert message.endswith(f"ZLLM_EDGE_ISA='avx9' is not an instruction-set level of {isa.architecture()} (levels: "
                            + ", ".join(level.name for level in isa.LEVELS.get(isa.architecture(), ()))
                            + ", or native); unset it to use everything this CPU has")


def test_arm_extensions_llvm_does_not_detect_come_from_the_hardware_capabilities(monkeypatch):
    """LLVM's host detection on Linux/aarch64 never reports dotprod or i8mm (seen under qemu-user with
    an aarch64 /proc/cpuinfo listing asimddp and i8mm), nor anything without a readable cpuinfo: the
    kernel's AT_HWCAP / AT_HWCAP2 bits add them, so that sdot and usdot are chosen, and Numba's code
    generator is then told the same features."""
    monkeypatch.delenv(isa.ISA_ENV, raising=False)
    monkeypatch.setattr(isa, "architecture", lambda: "aarch64")
    monkeypatch.setattr(isa, "llvm_host_features", lambda: {"fp-armv8": True, "dotprod": False})
    hwcaps = {isa.AT_HWCAP: 1 << 20 | 1 << 1, isa.AT_HWCAP2: 1 << 13}  # dotprod, asimd; i8mm
    monkeypatch.setattr(isa, "auxiliary_vector", lambda kind: hwcaps.get(kind, 0))
    features = isa.host_features()
    assert features["dotprod"] and features["i8mm"] and features["neon"] and not features.get("fullfp16")
    assert isa.host_level() == "i8mm"
    monkeypatch.setenv(isa.ISA_ENV, "dotprod")
    assert isa.target_level() == "dotprod"
    assert isa.target_features()["dotprod"] and not isa.target_features()["i8mm"]
    monkeypatch.setattr(isa, "auxiliary_vector", lambda kind: 0)  # a NEON-only core
    monkeypatch.delenv(isa.ISA_ENV)
    assert isa.host_level() == "neon"
