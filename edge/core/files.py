"""Files written all at once or not at all, and folders built by one process at a time."""
from __future__ import annotations

import fcntl
import os
import secrets
import sys
from contextlib import contextmanager
from typing import Callable


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


def built_once(path: str, is_built: Callable[[str], bool], build: Callable[[], None], what: str) -> str:
    """`path`, built by `build()` unless `is_built(path)`. Processes asking at once build it once: one
    builds under `path`.lock while the others wait, then find it built. `build` must create `path`
    whole or not at all (convert writes beside it and renames), so nobody sees a half-built one."""
    if is_built(path):
        return path
    with exclusive(path + ".lock", f"{what} into {path}"):
        if not is_built(path):  # (built by the process this one waited for)
            build()
    return path
