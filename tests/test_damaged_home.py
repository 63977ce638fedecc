"""What zllm-edge keeps in its home (kernels/cache_home.py) when it is damaged, read-only or full.

Damaged: each file is damaged for real in a temporary home (cut short, emptied, overwritten with
other bytes, removed while its index names it) and the next run must say so in one line on stderr,
rebuild it and compute what an undamaged run does: Numba's kernel cache (a small kernel of this file,
and a tiny model on device "cpu" in a child process), the NPU graph cache (a tiny model on "npu:cpu")
and a helper virtualenv (devices/helper_envs.py; its package is a wheel made here, installed offline).
The damaged model of the home and the damaged cpu-probe.json are tested in tests/test_random_moe.py and
tests/test_cpu_backend.py.

Read-only or full: every writer of the home (default-model conversion, the CPU probe's verdicts, the
NPU graph cache, helper virtualenvs) ends in a NotWritableError naming the path and the variable that
moves it; the Numba cache says so in a warning line and the kernel still computes. "chmod" makes the
home read-only for real, which root ignores (skipped there); "read-only" and "full" make every write
under the home fail with EROFS and ENOSPC (the fixture `unwritable`), so they run as root too.

Property-based (hypothesis, seeded as tests/test_fuzz_readers.py is): bits flipped, bytes zeroed or
replaced and files cut at random in a kernel cache file and in the graph cache; whatever changed is
said and rebuilt, and the result is the undamaged one's.
"""
from __future__ import annotations

import base64
import builtins
import errno
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numba import types
from tiny_models import random_prompt

import edge
from converters.convert import QuantPlan
from devices import helper_envs
from edge.core.files import NotWritableError
from kernels.cpu.runtime import Kernel, mutable, readonly

REPO = Path(__file__).resolve().parent.parent
GARBAGE = bytes(range(128, 256)) * 8  # not a pickle, not a zllm-edge cache file, not an ONNX graph
AGAIN = "; compiling the kernel again"
# Property-based damage, seeded like tests/test_fuzz_readers.py: ZLLM_EDGE_FUZZ_EXAMPLES=1000 for a long run.
EXAMPLES = int(os.environ.get("ZLLM_EDGE_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=30_000,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# each example of the graph cache exports the model's graphs again, far slower than compiling _affine
FUZZ_GRAPHS = settings(FUZZ, max_examples=max(EXAMPLES // 5, 5))


def damages(hot_bytes: int):
    """Lists of (kind, position, value): bits flipped, bytes zeroed or replaced, the file cut; positions
    mostly inside the first `hot_bytes` (headers) or anywhere (a fraction of the size)."""
    position = st.one_of(st.integers(0, hot_bytes - 1), st.floats(0.0, 1.0))
    kind = st.sampled_from(["flip", "zeros", "bytes", "cut"])
    return st.lists(st.tuples(kind, position, st.integers(0, 255)), min_size=1, max_size=3)


def damaged(data: bytes, edits) -> bytes:
    data = bytearray(data)
    for kind, position, value in edits:
        if not data:
            break
        at = min(position if isinstance(position, int) else int(position * len(data)), len(data) - 1)
        if kind == "flip":
            data[at] ^= 1 << (value % 8)
        elif kind == "zeros":
            data[at:at + value + 1] = bytes(len(data[at:at + value + 1]))
        elif kind == "bytes":
            data[at:at + 16] = bytes((value + i * 37) % 256 for i in range(len(data[at:at + 16])))
        else:
            del data[at:]
    return bytes(data)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A fresh ZLLM_EDGE_HOME; numba.config.CACHE_DIR, which a kernel created here moves, is restored."""
    folder = tmp_path / "home"
    folder.mkdir()
    monkeypatch.setenv("ZLLM_EDGE_HOME", str(folder))
    monkeypatch.setattr(numba.config, "CACHE_DIR", numba.config.CACHE_DIR)
    return folder


# ----------------------------------------------------------------------------- a home that refuses writes

WRITE_MODE_LETTERS = set("wax+")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


class Unwritable:
    """Makes folders refuse writes: "chmod" for real (mode 0o555), "read-only" and "full" by making
    every write of this process under them fail with EROFS or ENOSPC (creating a file or folder is what
    fails, as when no block or inode is left; a full disk still lets files be removed)."""

    ERRNOS = {"read-only": errno.EROFS, "full": errno.ENOSPC}
    REASONS = {"chmod": "permission denied", "read-only": "read-only file system",
               "full": "no space left on device"}

    def __init__(self, kind: str, monkeypatch):
        self.kind = kind
        self.monkeypatch = monkeypatch
        self.folders: list[str] = []
        self.chmodded: list[Path] = []

    def apply(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        if self.kind == "chmod":
            folder.chmod(0o555)
            self.chmodded.append(folder)
            return
        if not self.folders:
            self._patch()
        self.folders.append(os.path.abspath(folder))

    def message(self, path, variable: str = "ZLLM_EDGE_HOME") -> str:
        """The NotWritableError's message for a write into `path`."""
        advice = (f"free some space there or set {variable} to a folder on another disk" if self.kind == "full"
                  else f"set {variable} to a writable folder")
        return f"cannot write {path}: {self.REASONS[self.kind]}; {advice}"

    def restore(self) -> None:
        for folder in self.chmodded:
            folder.chmod(0o755)

    def _under(self, path) -> bool:
        try:
            name = os.path.abspath(os.fsdecode(os.fspath(path)))
        except TypeError:  # a file descriptor
            return False
        return any(name == folder or name.startswith(folder + os.sep) for folder in self.folders)

    def _refuse(self, path):
        number = self.ERRNOS[self.kind]
        raise OSError(number, os.strerror(number), os.fspath(path))

    def _patch(self) -> None:
        real_open, real_os_open, real_mkdir = builtins.open, os.open, os.mkdir
        real = {name: getattr(os, name) for name in ("replace", "rename", "symlink", "remove", "unlink", "rmdir",
                                                      "truncate")}

        def fake_open(file, mode="r", *args, **kwargs):
            if isinstance(file, (str, bytes, os.PathLike)) and set(mode) & WRITE_MODE_LETTERS and self._under(file):
                self._refuse(file)
            return real_open(file, mode, *args, **kwargs)

        def fake_os_open(path, flags, *args, **kwargs):
            if flags & WRITE_FLAGS and kwargs.get("dir_fd") is None and self._under(path):
                self._refuse(path)
            return real_os_open(path, flags, *args, **kwargs)

        def fake_mkdir(path, *args, **kwargs):
            if kwargs.get("dir_fd") is None and self._under(path):
                if os.path.exists(path):  # (Linux says EEXIST before EROFS)
                    raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(path))
                self._refuse(path)
            return real_mkdir(path, *args, **kwargs)

        def refusing(name: str, *checked: int):  # checked: the positions of the paths written
            def fake(*args, **kwargs):
                if kwargs.get("dir_fd") is None:
                    for path in (args[i] for i in checked if i < len(args)):
                        if self._under(path):
                            self._refuse(path)
                return real[name](*args, **kwargs)
            return fake

        self.monkeypatch.setattr(builtins, "open", fake_open)
        self.monkeypatch.setattr(io, "open", fake_open)
        self.monkeypatch.setattr(os, "open", fake_os_open)
        self.monkeypatch.setattr(os, "mkdir", fake_mkdir)
        for name in ("replace", "rename"):
            self.monkeypatch.setattr(os, name, refusing(name, 0, 1))
        self.monkeypatch.setattr(os, "symlink", refusing("symlink", 1))
        self.monkeypatch.setattr(os, "truncate", refusing("truncate", 0))
        if self.kind == "read-only":
            for name in ("remove", "unlink", "rmdir"):
                self.monkeypatch.setattr(os, name, refusing(name, 0))


def chmod_stops_writes(folder: Path) -> bool:
    """Whether a folder of mode 0o555 refuses a new file: not for root, which writes anywhere unless
    it has given up that capability (capsh --drop=cap_dac_override)."""
    folder.mkdir()
    folder.chmod(0o555)
    try:
        (folder / "probe").write_text("")
    except PermissionError:
        return True
    finally:
        folder.chmod(0o755)
    return False


@pytest.fixture(params=["chmod", "read-only", "full"])
def unwritable(request, monkeypatch, tmp_path):
    if request.param == "chmod" and not chmod_stops_writes(tmp_path / "chmod-probe"):
        pytest.skip("root writes into a folder of mode 0o555 all the same; 'read-only' and 'full' simulate it")
    refusal = Unwritable(request.param, monkeypatch)
    yield refusal
    refusal.restore()


def test_the_simulated_home_refuses_what_a_read_only_one_does(tmp_path, monkeypatch):
    refusal = Unwritable("read-only", monkeypatch)
    (tmp_path / "home" / "kept").mkdir(parents=True)
    (tmp_path / "home" / "kept" / "file").write_text("kept")
    refusal.apply(tmp_path / "home")
    kept = tmp_path / "home" / "kept" / "file"
    for write in (lambda: open(tmp_path / "home" / "new", "w"), lambda: (tmp_path / "home" / "new").write_text(""),
                  lambda: os.makedirs(tmp_path / "home" / "a" / "b"), lambda: os.remove(kept),
                  lambda: os.open(tmp_path / "home" / "new", os.O_CREAT | os.O_WRONLY),
                  lambda: os.replace(kept, tmp_path / "elsewhere")):
        with pytest.raises(OSError) as raised:
            write()
        assert raised.value.errno == errno.EROFS
    os.makedirs(tmp_path / "home" / "kept", exist_ok=True)  # an existing folder is no write
    assert kept.read_text() == "kept"
    (tmp_path / "outside").write_text("written")  # nothing else is refused


# ------------------------------------------------------------------------------------- Numba's cache

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


def cut_to_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def overwrite_middle(path: Path) -> None:
    content = bytearray(path.read_bytes())
    middle = len(content) // 2
    content[middle:middle + 64] = GARBAGE[:64]  # (a kernel's machine code there: plain Numba loads and runs it)
    path.write_bytes(bytes(content))


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
    home = tmp_path_factory.mktemp("home")
    shutil.copytree(pristine, home, dirs_exist_ok=True)
    (index,), (data,) = home.glob("numba-cache/*/*/*.nbi"), home.glob("numba-cache/*/*/*.nbc")
    target = index if which == "index" else data
    before = target.read_bytes()
    after = damaged(before, edits)
    target.write_bytes(after)
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ZLLM_EDGE_HOME", str(home))
        patch.setattr(numba.config, "CACHE_DIR", numba.config.CACHE_DIR)
        _, out = run_affine()
    np.testing.assert_array_equal(out, expected)
    err = capsys.readouterr().err
    if after == before:
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


# ------------------------------------------------------------------------------------ the CPU probe


def test_a_probe_verdict_the_home_cannot_take_is_an_error_naming_the_file(home, monkeypatch, unwritable):
    from kernels.cpu import cpu_probe

    monkeypatch.setattr(cpu_probe, "_verdicts", {})
    monkeypatch.setattr(cpu_probe, "target_features", lambda: {"avx2": True})
    monkeypatch.setattr(cpu_probe.subprocess, "run", lambda *args, **kwargs: subprocess.CompletedProcess(
        args, 0, stdout="avx2 ok\n", stderr=""))
    unwritable.apply(home)
    for _ in range(2):  # not kept in the process either: every load says it
        with pytest.raises(NotWritableError) as raised:
            cpu_probe.runs("avx2")
        assert str(raised.value) == unwritable.message(home / "cpu-probe.json")
    assert not (home / "cpu-probe.json").exists()


# ----------------------------------------------------------------------------- the default model


@pytest.fixture
def tiny_default_model(tiny_zoo, monkeypatch) -> str:
    """The default model's source replaced by a tiny model (its conversion takes a second)."""
    import edge.home

    source = tiny_zoo.hf_folder("llama_mha")
    monkeypatch.setattr(edge.home, "default_model_gguf", lambda: source)
    return source


def test_the_default_model_in_a_home_that_refuses_writes_is_an_error_naming_the_folder(
        home, tiny_default_model, unwritable, capsys):
    import edge.cli
    from edge.home import DEFAULT_MODEL_NAME, default_model_checkpoint

    unwritable.apply(home)
    checkpoint = home / "models" / DEFAULT_MODEL_NAME
    with pytest.raises(NotWritableError) as raised:
        default_model_checkpoint(progress=False)
    assert str(raised.value) == unwritable.message(checkpoint)
    capsys.readouterr()
    assert edge.cli.main(["generate", "hello", "--max-new-tokens", "1"]) == 2
    assert capsys.readouterr().err == f"error: {unwritable.message(checkpoint)}\n"


def test_a_disk_that_fills_up_while_the_default_model_converts_is_an_error_and_leaves_nothing(
        home, tiny_default_model, monkeypatch):
    from converters.safetensors_io import SafetensorsWriter
    from edge.home import DEFAULT_MODEL_NAME, default_model_checkpoint

    real_write, calls = SafetensorsWriter.write, []

    def write_until_full(self, name, array):
        calls.append(name)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(self, name, array)

    monkeypatch.setattr(SafetensorsWriter, "write", write_until_full)
    checkpoint = home / "models" / DEFAULT_MODEL_NAME
    with pytest.raises(NotWritableError) as raised:
        default_model_checkpoint(progress=False)
    assert str(raised.value) == (f"cannot write {checkpoint}: no space left on device; free some space there or "
                                 f"set ZLLM_EDGE_HOME to a folder on another disk")
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == [f"{DEFAULT_MODEL_NAME}.lock"]
    monkeypatch.setattr(SafetensorsWriter, "write", real_write)  # space again: it converts
    assert default_model_checkpoint(progress=False) == str(checkpoint)


# ---------------------------------------------------------------------------------- the NPU graph cache

NPU_DEVICE = "npu:cpu,accuracy_level=0,layers_per_graph=1"


@pytest.fixture
def npu_model(tiny_zoo):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    return tiny_zoo.converted("llama_mha", QuantPlan(weights="int8", group_size=32, symmetric=True))


def npu_run(path: str) -> tuple[np.ndarray, dict]:
    with edge.load(path, device=NPU_DEVICE) as model:
        return model.session(capacity=8).prefill([3, 4, 5, 6]), model.device_info()


GRAPH_DAMAGE = {
    "cut short": cut_to_half,
    "zero bytes": lambda path: path.write_bytes(b""),
    "other bytes": lambda path: path.write_bytes(GARBAGE),
    "overwritten in the middle": overwrite_middle,
}


@pytest.mark.parametrize("damage", list(GRAPH_DAMAGE))
def test_a_damaged_graph_is_said_and_exported_again(home, npu_model, capsys, damage):
    expected, info = npu_run(npu_model)
    folder, graphs = Path(info["graph_cache"]), sorted(info["graphs_built"])
    assert folder.is_relative_to(home / "onnx") and len(graphs) == 2
    GRAPH_DAMAGE[damage](folder / graphs[1])
    capsys.readouterr()
    logits, info = npu_run(npu_model)
    np.testing.assert_array_equal(logits, expected)
    assert info["graphs_built"] == [graphs[1]]
    assert capsys.readouterr().err == (f"{folder / graphs[1]} is damaged (its sha256 differs from the one weights.json "
                                       f"records: cut short or overwritten); exporting it again\n")
    assert npu_run(npu_model)[1]["graphs_built"] == []


def move_an_offset(index_path: Path) -> None:
    """Point an entry at other bytes of weights.bin, in JSON as good as before: graphs exported later
    would read those bytes."""
    index = json.loads(index_path.read_text())
    entry = next(iter(index["entries"].values()))
    entry["offset"] = 0 if entry["offset"] else 4096
    index_path.write_text(json.dumps(index))


WEIGHT_DAMAGE = {  # what is done to weights.bin or weights.json; what is said (format: the folder)
    "weights cut short": ("weights.bin", cut_to_half, "{bin} is damaged ({size} bytes; {json} records {recorded})"),
    "weights overwritten": ("weights.bin", overwrite_middle,
                            "{bin} is damaged (its sha256 differs from the one {json} records: overwritten)"),
    "weights replaced by other bytes of their size": (
        "weights.bin", lambda path: path.write_bytes(np.random.default_rng(0).bytes(path.stat().st_size)),
        "{bin} is damaged (its sha256 differs from the one {json} records: overwritten)"),
    "weights removed": ("weights.bin", Path.unlink, "{bin} is damaged (missing; {json} records {recorded})"),
    "index of other bytes": ("weights.json", lambda path: path.write_bytes(GARBAGE),
                             "{json} is damaged ('utf-8' codec can't decode byte 0x80 in position 0: invalid start "
                             "byte)"),
    "index cut short": ("weights.json", lambda path: os.truncate(path, 40),
                        "{json} is damaged (Unterminated string starting at: line 1 column 28 (char 27))"),
    "index emptied": ("weights.json", lambda path: path.write_bytes(b""),
                      "{json} is damaged (Expecting value: line 1 column 1 (char 0))"),
    "index of another form": ("weights.json", lambda path: path.write_text('{"fingerprint": {}, "entries": []}'),
                              "{json} is damaged (its sha256 does not match its contents)"),
    "an offset in the index moved": ("weights.json", move_an_offset,
                                     "{json} is damaged (its sha256 does not match its contents)"),
    "index removed": ("weights.json", Path.unlink, "{json} is missing beside {bin} (an interrupted export)"),
}


@pytest.mark.parametrize("damage", list(WEIGHT_DAMAGE))
def test_damaged_graph_weights_are_said_and_every_graph_exported_again(home, npu_model, capsys, damage):
    expected, info = npu_run(npu_model)
    folder, graphs = Path(info["graph_cache"]), sorted(info["graphs_built"])
    recorded = json.loads((folder / "weights.json").read_text())["data"]["size"]
    name, damage_file, said = WEIGHT_DAMAGE[damage]
    damage_file(folder / name)
    size = (folder / "weights.bin").stat().st_size if (folder / "weights.bin").exists() else None
    capsys.readouterr()
    logits, info = npu_run(npu_model)
    np.testing.assert_array_equal(logits, expected)
    assert sorted(info["graphs_built"]) == graphs
    said = said.format(bin=folder / "weights.bin", json=folder / "weights.json", size=size, recorded=recorded)
    assert capsys.readouterr().err == f"{said}; exporting every graph of the model again\n"
    assert npu_run(npu_model)[1]["graphs_built"] == []


@pytest.fixture
def pristine_graph_cache(home, npu_model) -> tuple[Path, np.ndarray, list[str]]:
    """A home whose graph cache holds the model's graphs: (the home, the logits, the graphs)."""
    expected, info = npu_run(npu_model)
    return home, expected, sorted(info["graphs_built"])


@FUZZ_GRAPHS
@given(which=st.sampled_from(["graph", "weights.bin", "weights.json"]), edits=damages(256))
def test_any_damage_to_the_graph_cache_is_said_and_the_model_still_computes(
        pristine_graph_cache, npu_model, tmp_path_factory, capsys, which, edits):
    pristine, expected, graphs = pristine_graph_cache
    home = tmp_path_factory.mktemp("home")
    shutil.copytree(pristine, home, dirs_exist_ok=True)
    folder = next(home.glob("onnx/*/*"))
    target = folder / (graphs[0] if which == "graph" else which)
    before = target.read_bytes()
    after = damaged(before, edits)
    target.write_bytes(after)
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ZLLM_EDGE_HOME", str(home))
        logits, info = npu_run(npu_model)
    np.testing.assert_array_equal(logits, expected)
    err = capsys.readouterr().err
    if after == before:
        assert err == "" and info["graphs_built"] == []
    else:
        again = "it" if which == "graph" else "every graph of the model"
        assert re.fullmatch(rf"{re.escape(str(target))} is [^\n]+; exporting {again} again\n", err), err
        assert sorted(info["graphs_built"]) == ([graphs[0]] if which == "graph" else graphs)


def test_a_graph_cache_the_home_cannot_take_is_an_error_naming_the_folder(home, npu_model, unwritable):
    unwritable.apply(home)
    with pytest.raises(NotWritableError) as raised:
        npu_run(npu_model)
    folder = re.fullmatch(r"cannot write (\S+): .*", str(raised.value)).group(1)
    assert re.fullmatch(rf"{re.escape(str(home / 'onnx'))}/[0-9a-f]{{32}}/v\d+-\w+", folder)
    assert str(raised.value) == unwritable.message(folder)


def test_a_disk_that_fills_up_while_weights_are_exported_is_an_error_and_the_next_load_recovers(
        home, npu_model, monkeypatch, capsys):
    from devices.npu.onnx_weights import ExternalWeightFile

    real_append = ExternalWeightFile._append

    def append_until_full(self, array):
        if len(self.entries) >= 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_append(self, array)

    monkeypatch.setattr(ExternalWeightFile, "_append", append_until_full)
    with pytest.raises(NotWritableError, match=r"^cannot write .*/onnx/[0-9a-f]{32}/v\d+-\w+: no space left on "
                                               r"device; free some space there or set ZLLM_EDGE_HOME to a folder "
                                               r"on another disk$"):
        npu_run(npu_model)
    monkeypatch.setattr(ExternalWeightFile, "_append", real_append)
    capsys.readouterr()
    _, info = npu_run(npu_model)
    assert len(info["graphs_built"]) == 2 and "Traceback" not in capsys.readouterr().err


# ------------------------------------------------------------------------------ helper virtualenvs

PACKAGE_SOURCE = b"VALUE = 42\n"


def write_wheel(folder: Path) -> Path:
    """A wheel of the package zllm_probe_pkg (one module), for pip to install without a network."""
    files = {"zllm_probe_pkg/__init__.py": PACKAGE_SOURCE,
             "zllm_probe_pkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: zllm-probe-pkg\nVersion: 1.0\n",
             "zllm_probe_pkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                                                   b"Tag: py3-none-any\n"}

    def record(name: str, data: bytes) -> str:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        return f"{name},sha256={digest},{len(data)}"

    wheel = folder / "zllm_probe_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        lines = [*(record(name, data) for name, data in files.items()), "zllm_probe_pkg-1.0.dist-info/RECORD,,"]
        archive.writestr("zllm_probe_pkg-1.0.dist-info/RECORD", "\n".join(lines))
    return wheel


@pytest.fixture(scope="module")
def built_env(tmp_path_factory) -> tuple[helper_envs.HelperEnv, Path]:
    """A helper environment built by ensure_env (pip installs the wheel offline), once for the module:
    (its spec, the folder of environments it is in)."""
    venvs = tmp_path_factory.mktemp("built-venvs")
    spec = helper_envs.HelperEnv(name="probe-env", requirements=(str(write_wheel(venvs)),),
                                 pip_args=("--no-index", "--no-deps"), import_check="import zllm_probe_pkg")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(helper_envs.VENVS_VARIABLE, str(venvs))
        helper_envs.ensure_env(spec)
    return spec, venvs


@pytest.fixture
def env_copy(built_env, tmp_path, monkeypatch) -> tuple[helper_envs.HelperEnv, Path]:
    """A copy of the built environment of this test's own (spec, its folder)."""
    spec, venvs = built_env
    monkeypatch.setenv(helper_envs.VENVS_VARIABLE, str(tmp_path / "venvs"))
    folder = helper_envs.env_folder(spec)
    shutil.copytree(venvs / folder.name, folder, symlinks=True)
    assert helper_envs.is_ready(spec) and helper_envs.env_damage(spec) is None
    return spec, folder


def package_file(folder: Path) -> Path:
    return helper_envs.site_packages_in(folder) / "zllm_probe_pkg" / "__init__.py"


def replace_python(folder: Path, mode: int | None) -> None:
    """Remove the environment's python (a link to this interpreter: never chmod it), or put a file of
    `mode` in its place."""
    python = helper_envs.python_in(folder)
    python.unlink()
    if mode is not None:
        python.write_text("")
        python.chmod(mode)


ENV_DAMAGE = {
    "python missing": (lambda folder: replace_python(folder, None), "its python {python} is missing"),
    "python not executable": (lambda folder: replace_python(folder, 0o644), "its python {python} is not executable"),
    "a package file cut short": (lambda folder: os.truncate(package_file(folder), 3),
                                 "package zllm_probe_pkg-1.0 is half-installed: {module} has 3 bytes, its RECORD says "
                                 f"{len(PACKAGE_SOURCE)}"),
    "a package file missing": (lambda folder: package_file(folder).unlink(),
                               "package zllm_probe_pkg-1.0 is half-installed: {module} is missing"),
    "a package without its RECORD": (
        lambda folder: (helper_envs.site_packages_in(folder) / "zllm_probe_pkg-1.0.dist-info" / "RECORD").unlink(),
        "package zllm_probe_pkg-1.0 is half-installed: {site}/zllm_probe_pkg-1.0.dist-info/RECORD is missing"),
    "a RECORD of other bytes": (
        lambda folder: (helper_envs.site_packages_in(folder) / "zllm_probe_pkg-1.0.dist-info" / "RECORD").write_bytes(
            GARBAGE),
        "package zllm_probe_pkg-1.0 is damaged: {site}/zllm_probe_pkg-1.0.dist-info/RECORD cannot be read ('utf-8' "
        "codec can't decode byte 0x80 in position 0: invalid start byte)"),
    "the inheriting .pth missing": (
        lambda folder: (helper_envs.site_packages_in(folder) / helper_envs.INHERIT_PTH).unlink(),
        "{site}/" + helper_envs.INHERIT_PTH + " is missing or does not say what this interpreter's environment "
                                              "inherits"),
    "marker missing": (lambda folder: (folder / helper_envs.MARKER).unlink(),
                       f"its build did not finish: {helper_envs.MARKER} is missing"),
    "marker of other bytes": (lambda folder: (folder / helper_envs.MARKER).write_bytes(b"{\"requirements"),
                              "{marker} cannot be read (Unterminated string starting at: line 1 column 2 (char 1))"),
}


@pytest.mark.parametrize("damage", list(ENV_DAMAGE))
def test_a_damaged_helper_env_is_found_before_it_is_used(env_copy, damage):
    spec, folder = env_copy
    damage_env, said = ENV_DAMAGE[damage]
    damage_env(folder)
    site = helper_envs.site_packages_in(folder)
    assert not helper_envs.is_ready(spec)
    assert helper_envs.env_damage(spec) == said.format(python=helper_envs.python_in(folder), site=site,
                                                       module=package_file(folder), marker=folder / helper_envs.MARKER)


def test_a_damaged_helper_env_is_said_and_built_again(env_copy, capsys):
    spec, folder = env_copy
    os.truncate(package_file(folder), 3)
    capsys.readouterr()
    python = helper_envs.ensure_env(spec)
    assert capsys.readouterr().err == (
        f"helper environment {folder} is damaged (package zllm_probe_pkg-1.0 is half-installed: {package_file(folder)} "
        f"has 3 bytes, its RECORD says {len(PACKAGE_SOURCE)}); building it again\n")
    assert helper_envs.is_ready(spec)
    result = subprocess.run([str(python), "-c", "import zllm_probe_pkg; print(zllm_probe_pkg.VALUE)"],
                            capture_output=True, text=True)
    assert result.stdout == "42\n", result.stderr


def test_an_env_built_from_another_spec_is_stale_not_damaged(env_copy):
    spec, folder = env_copy
    changed = helper_envs.HelperEnv(name=spec.name, requirements=spec.requirements, pip_args=("--no-index",))
    assert helper_envs.env_damage(changed) is None and not helper_envs.is_ready(changed)


def test_a_venvs_folder_that_refuses_writes_is_an_error_naming_it_and_its_variable(tmp_path, monkeypatch, unwritable):
    venvs = tmp_path / "venvs"
    monkeypatch.setenv(helper_envs.VENVS_VARIABLE, str(venvs))
    unwritable.apply(venvs)
    spec = helper_envs.HelperEnv(name="probe-env", requirements=("zllm-probe-pkg==1.0",))
    with pytest.raises(helper_envs.HelperEnvNotWritable) as raised:
        helper_envs.ensure_env(spec)
    assert str(raised.value) == unwritable.message(helper_envs.env_folder(spec), helper_envs.VENVS_VARIABLE)
    assert isinstance(raised.value, NotWritableError) and isinstance(raised.value, helper_envs.HelperEnvUnavailable)


def test_a_provider_env_in_a_home_that_refuses_writes_is_an_error_naming_the_home(home, monkeypatch, unwritable):
    from devices.npu import provider_envs

    monkeypatch.delenv(helper_envs.VENVS_VARIABLE, raising=False)
    unwritable.apply(home)
    with pytest.raises(provider_envs.ProviderEnvNotWritable) as raised:
        provider_envs.provider_env_python("openvino")
    assert str(raised.value) == unwritable.message(provider_envs.provider_env_folder("openvino"))
    assert isinstance(raised.value, NotWritableError)


def test_a_peer_env_that_cannot_be_written_is_reported_as_an_unavailable_peer(tmp_path, monkeypatch, unwritable):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_envs
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    venvs = tmp_path / "venvs"
    monkeypatch.setenv(helper_envs.VENVS_VARIABLE, str(venvs))
    unwritable.apply(venvs)
    with pytest.raises(bench_envs.PeerUnavailable) as raised:
        bench_envs.ensure_env(bench_envs.ORT_GENAI, progress=None)
    assert isinstance(raised.value, NotWritableError)
    assert str(raised.value) == unwritable.message(helper_envs.env_folder(bench_envs.ORT_GENAI),
                                                   helper_envs.VENVS_VARIABLE)
