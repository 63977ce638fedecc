"""Numba's kernel cache in the home (kernels/cpu/runtime.py) when it is damaged or cannot be written.

Each file is damaged for real in a temporary home (cut short, emptied, overwritten with other bytes,
removed while its index names it) and the next run must say so in one line on stderr, compile the kernel
again and compute what an undamaged run does: a small kernel of this file, and a tiny model on device
"cpu" in a child process; bits flipped, bytes zeroed or replaced and files cut at random (hypothesis). A
cache that cannot be written is said in a warning line and the kernel still computes."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
from home_damage import (FUZZ, GARBAGE, REPO, copy_of, cut_to_half, damage, damages, home,
                         overwrite_middle, unwritable)
from hypothesis import given
from hypothesis import strategies as st
from numba import types
from tiny_models import random_prompt

import edge
from converters.convert import QuantPlan
from kernels.cpu.runtime import Kernel, mutable, readonly


AGAIN = "; compiling the kernel again"
SIGNATURE = types.void(readonly(types.float32, 1), mutable(types.float32, 1))


def _affine(x, out):
    for i in range(x.shape[0]):
        out[i] = 3.0 * x[i] + 1.0


def run_affine() -> tuple[Kernel, np.ndarray]:
    """A new Kernel of _affine (compiled, or loaded from the home's cache, here) and what it computed."""
    affine = Kernel(_affine, [SIGNATURE])
    x = np.linspace(-2.0, 2.0, 37, dtype=np.float32)
    x.setflags(write=False)
    out = np.zeros_like(x)
    affine(x, out)
    np.testing.assert_allclose(out, 3.0 * x + 1.0, rtol=1e-6, atol=1e-6)  # (a fused multiply-add rounds once)
    return affine, out


def cache_hits(affine: Kernel) -> int:
    return sum(affine.dispatcher.stats.cache_hits.values())


DAMAGE = {  # what is done to the file, what the line on stderr says about it
    "cut short": (cut_to_half, "is damaged (its contents do not match their sha256: cut short or overwritten)"),
    "cut inside its header": (lambda path: os.truncate(path, 20), "is damaged (cut short at 20 bytes)"),
    "zero bytes": (lambda path: path.write_bytes(b""), "is damaged (empty)"),
    "other bytes": (lambda path: path.write_bytes(GARBAGE), "is damaged (not a zllm-edge kernel cache file)"),
    "overwritten in the middle": (overwrite_middle,
                                  "is damaged (its contents do not match their sha256: cut short or overwritten)"),
}


@pytest.mark.parametrize("which", ["index", "data"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_kernel_cache_file_is_said_and_the_kernel_compiled_again(home, capsys, which, damage):
    first, expected = run_affine()
    folder = Path(first.dispatcher.stats.cache_path)
    assert folder.is_relative_to(home / "numba-cache")
    (index,), (data,) = folder.glob("*.nbi"), folder.glob("*.nbc")
    target = index if which == "index" else data
    damage_file, said = DAMAGE[damage]
    damage_file(target)
    capsys.readouterr()

    second, out = run_affine()
    np.testing.assert_array_equal(out, expected)
    assert cache_hits(second) == 0
    assert capsys.readouterr().err == f"the kernel cache file {target} {said}{AGAIN}\n"

    third, out = run_affine()  # the damaged file was replaced by a good one
    np.testing.assert_array_equal(out, expected)
    assert cache_hits(third) == 1 and capsys.readouterr().err == ""


def test_an_index_naming_a_missing_data_file_is_said_and_the_kernel_compiled_again(home, capsys):
    first, expected = run_affine()
    folder = Path(first.dispatcher.stats.cache_path)
    (index,), (data,) = folder.glob("*.nbi"), folder.glob("*.nbc")
    data.unlink()
    capsys.readouterr()
    second, out = run_affine()
    np.testing.assert_array_equal(out, expected)
    assert capsys.readouterr().err == (f"the kernel cache file {data} is missing, though its index {index} "
                                       f"names it{AGAIN}\n")
    third, out = run_affine()
    assert cache_hits(third) == 1 and capsys.readouterr().err == ""


def test_a_kernel_cache_that_cannot_be_written_is_said_once_and_kernels_still_compute(home, capsys, unwritable):
    unwritable.apply(home)
    first, expected = run_affine()
    folder = first.dispatcher.stats.cache_path
    assert capsys.readouterr().err == (f"warning: {unwritable.message(folder)} (until then each process compiles "
                                       f"its kernels anew)\n")
    second, out = run_affine()  # nothing was kept, nothing is said twice
    np.testing.assert_array_equal(out, expected)
    assert cache_hits(second) == 0 and capsys.readouterr().err == ""


@pytest.fixture
def pristine_kernel_cache(home) -> tuple[Path, np.ndarray]:
    """A home whose cache holds _affine, and what _affine computes."""
    _, expected = run_affine()
    return home, expected


@FUZZ
@given(which=st.sampled_from(["index", "data"]), edits=damages(96))
def test_any_damage_to_a_kernel_cache_file_is_said_and_the_kernel_still_computes(
        pristine_kernel_cache, tmp_path_factory, capsys, which, edits):
    pristine, expected = pristine_kernel_cache
    home = copy_of(pristine, tmp_path_factory)
    (index,), (data,) = home.glob("numba-cache/*/*/*.nbi"), home.glob("numba-cache/*/*/*.nbc")
    target = index if which == "index" else data
    changed = damage(target, edits)
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ZLLM_EDGE_HOME", str(home))
        patch.setattr(numba.config, "CACHE_DIR", numba.config.CACHE_DIR)
        _, out = run_affine()
    np.testing.assert_array_equal(out, expected)
    err = capsys.readouterr().err
    if not changed:
        assert err == ""
    else:
        assert re.fullmatch(rf"the kernel cache file {re.escape(str(target))} is damaged \([^\n]+\){AGAIN}\n", err), err


CHILD_MODEL_RUN = """
import json, sys
import numpy as np
import edge
with edge.load(sys.argv[1], device="cpu", threads=1) as model:
    np.save(sys.argv[3], model.session(capacity=16).prefill(json.loads(sys.argv[2])))
"""


def run_model_in_child(path: str, prompt: list[int], home: Path, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, ZLLM_EDGE_HOME=str(home), NUMBA_DEBUG_CACHE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", CHILD_MODEL_RUN, path, json.dumps(prompt), str(out)], env=env,
                            capture_output=True, text=True, timeout=900, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return result


def seed_kernel_cache(home: Path) -> None:
    """Copy this process's kernel cache into `home`: the session home's, and the fused forward kernel's
    from wherever it was first compiled (a test that set another home may have done that), so that a
    child process loads, not compiles, what this process compiled."""
    from kernels.cpu.forward import forward_kernel

    session_home = Path(os.environ["ZLLM_EDGE_HOME"])
    if (session_home / "numba-cache").is_dir():
        shutil.copytree(session_home / "numba-cache", home / "numba-cache", dirs_exist_ok=True)
    if (session_home / "cpu-probe.json").is_file():
        shutil.copy(session_home / "cpu-probe.json", home / "cpu-probe.json")
    if not forward_kernel.is_compiled:
        return
    forward_folder = Path(forward_kernel.dispatcher.stats.cache_path)
    target = home / forward_folder.relative_to(forward_folder.parents[2])
    target.mkdir(parents=True, exist_ok=True)
    for file in forward_folder.glob("forward._forward-*"):
        shutil.copy(file, target / file.name)


def test_a_model_whose_kernel_files_are_damaged_computes_the_logits_of_an_undamaged_one(tiny_zoo, tmp_path):
    """Real damage to the kernel files a tiny model loads, in a child process with a home of its own:
    one data file overwritten, one index cut short, one data file removed. The child says each in one
    line, compiles those kernels again, and its logits are those of this process, bit for bit."""
    path = tiny_zoo.converted("llama_mha", QuantPlan(weights="f32"))
    prompt = random_prompt(6, seed=11)
    with edge.load(path, device="cpu", threads=1) as model:
        expected = model.session(capacity=16).prefill(prompt)
    home = tmp_path / "home"
    seed_kernel_cache(home)

    undamaged = run_model_in_child(path, prompt, home, tmp_path / "undamaged.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "undamaged.npy"), expected)
    assert "kernel cache file" not in undamaged.stderr
    used = sorted(set(re.findall(r"\[cache\] data (?:loaded from|saved to) '([^']+\.nbc)'", undamaged.stdout)))
    cheap = [Path(file) for file in used if "forward._forward" not in file]  # (the fused kernel is slow to compile)

    def kernel_of(data: Path) -> str:
        return data.name.split(".py")[0]

    def index_of(data: Path) -> Path:
        return data.with_name(kernel_of(data) + f".py{sys.version_info.major}{sys.version_info.minor}.nbi")

    kernels = sorted({kernel_of(file) for file in cheap})
    assert len(kernels) >= 3, used
    overwritten, cut, removed = (next(f for f in cheap if kernel_of(f) == kernel) for kernel in kernels[:3])
    overwritten.write_bytes(GARBAGE)
    cut_to_half(index_of(cut))
    removed.unlink()

    damaged = run_model_in_child(path, prompt, home, tmp_path / "damaged.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "damaged.npy"), expected)
    said = sorted(line for line in damaged.stderr.splitlines() if "kernel cache file" in line)
    assert said == sorted([
        f"the kernel cache file {overwritten} is damaged (not a zllm-edge kernel cache file){AGAIN}",
        f"the kernel cache file {index_of(cut)} is damaged (its contents do not match their sha256: cut short or "
        f"overwritten){AGAIN}",
        f"the kernel cache file {removed} is missing, though its index {index_of(removed)} names it{AGAIN}"])
