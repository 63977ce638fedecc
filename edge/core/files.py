"""Files written all at once or not at all."""
from __future__ import annotations

import os
import secrets


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

