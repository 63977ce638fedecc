"""Writing a zllm checkpoint safely: the output directory is checked before any work, and the files
are staged beside it and moved into place only when all of them are written (the reader is
quant/checkpoint.py)."""
from __future__ import annotations

import os
import shutil
import tempfile

from edge.core.errors import CheckpointError, ConversionError
from quant.checkpoint import MANIFEST


def check_source_named(src) -> None:
    """An empty SRC would name the working directory: refused by name."""
    if isinstance(src, str) and not src.strip():
        raise ConversionError("SRC is empty; name a Hugging Face model folder or a .gguf file")


def check_output(out: str, force: bool, sources: tuple[str, ...] = ()) -> str:
    """OUT as an absolute path, once it is safe to write: refused (ConversionError) when it exists
    and `force` is not given, when it lies inside a source folder, when replacing it would delete a
    source or the directory we run in,
    or when it is a directory holding something other than a zllm checkpoint (--force replaces a
    checkpoint, a file or an empty directory, never a directory of other data)."""
    for src in sources:
        check_source_named(src)
    if not str(out).strip():
        raise ConversionError("OUT is empty; name the directory the checkpoint should be written to")
    out = os.path.abspath(out)
    for src in sources:
        src = os.path.abspath(src)
        if src == out or src.startswith(out.rstrip(os.sep) + os.sep):
            raise ConversionError(f"{out}: writing the checkpoint there would replace the source {src}; "
                                  "choose another OUT")
        if os.path.isdir(src) and out.startswith(src.rstrip(os.sep) + os.sep):
            raise ConversionError(f"{out} lies inside the source folder {src}; the checkpoint would be written into "
                                  "the model it is converted from: choose an OUT outside it")
    if not os.path.lexists(out):
        return out
    if not force:
        raise ConversionError(f"{out} already exists; pass --force to replace it")
    if os.path.isdir(out) and not os.path.islink(out):
        if os.getcwd().startswith(out.rstrip(os.sep) + os.sep) or os.getcwd() == out:
            raise ConversionError(f"{out}: --force would replace the current directory; choose another OUT")
        if os.listdir(out) and not os.path.isfile(os.path.join(out, MANIFEST)):
            raise ConversionError(f"{out} is a directory that is not a zllm checkpoint; --force replaces only a "
                                  "checkpoint, a file or an empty directory: remove it yourself or choose another OUT")
    return out


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class StagingDirectory:
    """A temporary directory beside `destination` that becomes it on `commit()`, or vanishes (with the
    parent directories it had to create)."""

    def __init__(self, destination: str, force: bool = False):
        self.destination = os.path.abspath(destination)
        self.force = force
        parent = os.path.dirname(self.destination)
        self._created = _first_missing_ancestor(parent)  # removed again if the conversion fails
        try:
            os.makedirs(parent, exist_ok=True)
            self._sweep_dead_stagings(parent)
            self.path = tempfile.mkdtemp(prefix=f"{self._prefix}{os.getpid()}-", dir=parent)
        except OSError as exc:
            self._remove_created()
            raise ConversionError(f"cannot write the checkpoint {self.destination}: {exc.strerror or exc} "
                                  f"({exc.filename or parent}); choose an OUT in a writable directory") from None

    @property
    def _prefix(self) -> str:
        return f".{os.path.basename(self.destination)}.partial-"

    def _sweep_dead_stagings(self, parent: str) -> None:
        """Remove what a killed conversion to the same destination left (SIGKILL or a power cut skip
        every clean-up): staging directories whose process is gone. A live one's stays."""
        for name in os.listdir(parent):
            pid = name[len(self._prefix):].partition("-")[0]
            if not (name.startswith(self._prefix) and pid.isdigit()) or _process_alive(int(pid)):
                continue
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)

    def commit(self) -> None:
        if os.path.lexists(self.destination):
            if not self.force:
                raise CheckpointError(f"{self.destination} already exists; pass --force to replace it")
            doomed = self.destination + ".old-" + os.path.basename(self.path)
            os.rename(self.destination, doomed)
            os.rename(self.path, self.destination)
            if os.path.isdir(doomed) and not os.path.islink(doomed):
                shutil.rmtree(doomed, ignore_errors=True)
            else:
                os.unlink(doomed)
        else:
            os.rename(self.path, self.destination)
        self._created = None

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self._remove_created()

    def _remove_created(self) -> None:
        """Remove the directories made for the destination, innermost first, if still empty."""
        if self._created is None:
            return
        directory = os.path.dirname(self.destination)
        while True:
            try:
                os.rmdir(directory)
            except OSError:
                return  # not empty (or not ours to remove): stop
            if directory == self._created:
                return
            directory = os.path.dirname(directory)

    def __enter__(self) -> "StagingDirectory":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.discard()


def _first_missing_ancestor(directory: str) -> str | None:
    """The outermost directory on the way to `directory` that does not exist yet (None: it exists)."""
    missing = None
    while not os.path.lexists(directory):
        missing = directory
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    return missing

