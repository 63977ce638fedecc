"""Files written all at once or not at all, folders built by one process at a time, and the error a
folder that cannot be written gives."""
from __future__ import annotations

import errno
import fcntl
import os
import secrets
import sys
from contextlib import contextmanager
from typing import Callable

from edge.core.arguments import printable
from edge.core.errors import ZllmError

# What a write fails with when the folder cannot take it (as opposed to a damaged source or a bug):
# a read-only file system, no permission, a full disk or quota.
NOT_WRITABLE_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT})
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class NotWritableError(ZllmError):
    """A folder zllm-edge keeps what it builds in cannot be written (a read-only file system, no
    permission, a full disk); the message names the path and the variable that moves the folder."""


def is_not_writable(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in NOT_WRITABLE_ERRNOS


def not_writable(path, error: OSError, variable: str) -> NotWritableError:
    """The typed error for a write into `path` that failed with `error`; `variable` names the
    environment variable that puts the folder elsewhere."""
    reason = _reason(error)
    if error.errno in FULL_ERRNOS:
        advice = f"free some space there or set {variable} to a folder on another disk"
    else:
        advice = f"set {variable} to a writable folder"
    return NotWritableError(f"cannot write {path}: {reason}; {advice}")


def write_failure(error: BaseException) -> OSError | None:
    """The failed write behind `error`: itself, or the OSError a typed error was raised from (a
    converter says "converting ... failed: No space left on device" and raises from None, which
    keeps the OSError as the error's context)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if is_not_writable(error):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def write_atomically(path, write, binary: bool = False) -> None:
    """Write `path` through `write(f)`, all of it or nothing: into a hidden file beside it (the same file
    system), flushed to the disk and renamed over `path` once `write` returns, removed if anything fails.
    A reader sees the old file or the new one, never a part; an interrupted write leaves the old one."""
    folder, name = os.path.split(os.path.abspath(path))
    temporary = os.path.join(folder, f".{name}.{os.getpid()}-{secrets.token_hex(4)}.partial")
    try:
        with open(temporary, "xb" if binary else "x") as f:  # an ordinary file's mode (umask), never an existing file
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def write_output(path, write, binary: bool = False,
                 advice: str = "choose a file in a writable folder with free space") -> None:
    """write_atomically for a file a command was asked to write (a report, a plot, a checkpoint's own
    predictor.json): a folder that cannot take it (read-only, no permission, full) is a NotWritableError
    naming the file and what to do instead, not an OSError's traceback."""
    try:
        write_atomically(path, write, binary)
    except OSError as exc:
        if not is_not_writable(exc):
            raise
        raise NotWritableError(f"cannot write {printable(os.fsdecode(path))}: {_reason(exc)}; {advice}") from None


def _reason(error: OSError) -> str:
    reason = error.strerror or str(error)
    return reason[:1].lower() + reason[1:]


@contextmanager
def exclusive(lock_path: str, what: str):
    """Hold an exclusive lock on `lock_path` (created if missing) for the block: other processes wait.
    The lock is the kernel's (flock), so a holder that dies releases it and no stale lock remains;
    the holder's pid is written into the file so that a waiter can say whom it waits for."""
    os.makedirs(os.path.dirname(os.path.abspath(lock_path)), exist_ok=True)
    with open(lock_path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            print(f"waiting for process {holder}, which is {what}", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            lock.seek(0)
            lock.truncate()
            lock.write(str(os.getpid()))
            lock.flush()
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def built_once(path: str, is_built: Callable[[str], bool], build: Callable[[], None], what: str,
               variable: str = "ZLLM_EDGE_HOME") -> str:
    """`path`, built by `build()` unless `is_built(path)`. Processes asking at once build it once: one
    builds under `path`.lock while the others wait, then find it built. `build` must create `path`
    whole or not at all (convert writes beside it and renames), so nobody sees a half-built one.

    A folder that cannot take the lock or the build (read-only, full) is a NotWritableError naming
    `path` and `variable`, the environment variable that moves it."""
    if is_built(path):
        return path
    try:
        with exclusive(path + ".lock", f"{what} into {path}"):
            if not is_built(path):  # (built by the process this one waited for)
                build()
    except (OSError, ZllmError) as exc:
        failed = write_failure(exc)
        if failed is None or not _on_the_way_to(failed.filename, path):
            raise
        raise not_writable(path, failed, variable) from None
    return path


def _on_the_way_to(filename, path: str) -> bool:
    """Whether a failed write's file is a folder above `path` or a file beside or under it (the lock,
    the build's staging folder). A write without a file name, as a full disk's write() is, counts;
    a source the build could not read does not."""
    if not isinstance(filename, (str, bytes, os.PathLike)):
        return True
    failed, target = os.path.abspath(os.fsdecode(filename)), os.path.abspath(path)
    return (target.startswith(failed.rstrip(os.sep) + os.sep)
            or failed.startswith(os.path.dirname(target) + os.sep))
