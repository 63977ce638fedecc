"""What the tests of a damaged, read-only or full home share (tests/test_damaged_*.py,
tests/test_unwritable_home.py): the property-based damage of a file, a fresh home, and homes that refuse
writes.

Read-only or full: "chmod" makes a folder read-only for real, which root ignores (skipped there);
"read-only" and "full" make every write under it fail with EROFS and ENOSPC (the fixture `unwritable`),
so they run as root too. Property-based damage is seeded as tests/test_fuzz_readers.py is:
ZLLM_EDGE_FUZZ_EXAMPLES=1000 for a long run."""
from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
from pathlib import Path

import numba
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st


REPO = Path(__file__).resolve().parent.parent
GARBAGE = bytes(range(128, 256)) * 8  # not a pickle, not a zllm-edge cache file, not an ONNX graph
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


def damage(target: Path, edits) -> bool:
    """Apply `edits` (damages()) to a file; whether they changed it."""
    before = target.read_bytes()
    after = damaged(before, edits)
    target.write_bytes(after)
    return after != before


def copy_of(pristine: Path, tmp_path_factory) -> Path:
    """A new home holding what `pristine` holds."""
    home = tmp_path_factory.mktemp("home")
    shutil.copytree(pristine, home, dirs_exist_ok=True)
    return home


def cut_to_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def overwrite_middle(path: Path) -> None:
    content = bytearray(path.read_bytes())
    middle = len(content) // 2
    content[middle:middle + 64] = GARBAGE[:64]  # (a kernel's machine code there: plain Numba loads and runs it)
    path.write_bytes(bytes(content))


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
