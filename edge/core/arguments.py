"""Checks of caller-supplied arguments, shared by the Python API and the CLI, so that the CLI can run
them before it converts or loads a model and the API still refuses the same values on its own.

Each check returns the value normalised (a Python int or float) or raises InvalidArgumentError that
names the argument, what it got and what it accepts."""
from __future__ import annotations

import math
import numbers
import os
import re

from edge.core.errors import InvalidArgumentError

SHOWN_CHARACTERS = 80  # of a caller's value in a message


def _bounds(minimum, maximum, above) -> str:
    low = f"({above}" if above is not None else (f"[{minimum}" if minimum is not None else None)
    high = f"{maximum}]" if maximum is not None else None
    if low and high:
        return f" in {low}, {high}"
    if low:
        return f" > {above}" if above is not None else f" >= {minimum}"
    return f" <= {maximum}" if high else ""


def is_integer(value, minimum: int | None = None) -> bool:
    """An int (numpy integers too), not a bool (an int to Python, never a count) nor a float, >= minimum."""
    return (isinstance(value, numbers.Integral) and not isinstance(value, bool)
            and (minimum is None or value >= minimum))


def is_number(value) -> bool:
    """A finite real number, not a bool (nan and infinities are refused)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def shown(value) -> str:
    """repr(value) for a message, on one line (a numpy array's repr spans several) and cut short: a
    caller's megabyte string must not become a megabyte message."""
    text = re.sub(r"\s*\n\s*", " ", repr(value))
    return text if len(text) <= SHOWN_CHARACTERS else text[:SHOWN_CHARACTERS] + "..."


def printable(text: str) -> str:
    """A path or name for a message: as written, or as its repr when it holds a line break, a control
    character or a byte that is not UTF-8, which would split or garble the message's one line."""
    return text if text.isprintable() else repr(text)


def integer(name: str, value, minimum: int | None = None, maximum: int | None = None, note: str = "") -> int:
    """An int (numpy integers too; not a bool, a float or a string) within [minimum, maximum]."""
    kind = "a positive integer" if minimum == 1 and maximum is None else f"an integer{_bounds(minimum, maximum, None)}"
    wanted = f"{name} must be {kind}{note}"
    if not is_integer(value):
        raise InvalidArgumentError(f"{wanted}, got {shown(value)}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise InvalidArgumentError(f"{wanted}, got {value}")
    return value


def number(name: str, value, minimum: float | None = None, maximum: float | None = None,
           above: float | None = None, note: str = "") -> float:
    """A finite real number within the bounds: nan passes every comparison, so it is refused by name."""
    wanted = f"{name} must be a finite number{_bounds(minimum, maximum, above)}{note}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{wanted}, got {shown(value)}")
    value = float(value)
    if (not math.isfinite(value) or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum) or (above is not None and value <= above)):
        raise InvalidArgumentError(f"{wanted}, got {value}")
    return value


def choice(name: str, value, choices: tuple[str, ...]) -> str:
    """One of the names in `choices` (a str: a list or a number is not a name, and None is the
    caller's to allow before asking)."""
    if not isinstance(value, str) or value not in choices:
        raise InvalidArgumentError(f"{name} {shown(value)} is not known; choose one of {', '.join(choices)}")
    return value


def flag(name: str, value) -> bool:
    """True or False (numpy's bool too): a string, a number or None is not a yes or no ("False" is true)."""
    if isinstance(value, bool) or (getattr(value, "dtype", None) is not None and value.dtype.kind == "b"
                                   and getattr(value, "shape", None) == ()):
        return bool(value)
    raise InvalidArgumentError(f"{name} must be True or False, got {shown(value)}")


def path_argument(name: str, value) -> str:
    """A file system path (a str or os.PathLike, not empty) as a str that the operating system can
    name: not a NUL character, and no lone surrogate other than the U+DC80-U+DCFF that stand for a
    command line's bytes that are not UTF-8 (os.fsencode gives those bytes back)."""
    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(path, str) or not path:
        raise InvalidArgumentError(f"{name} must be a file path (a str or os.PathLike), got {shown(value)}")
    if "\x00" in path:
        raise InvalidArgumentError(f"{name} {shown(path)} holds a NUL character, which no file name can; "
                                   "give a path without it")
    try:
        os.fsencode(path)
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(f"{name} {shown(path)} cannot be a file name: character {exc.start} is the lone "
                                   f"surrogate U+{ord(path[exc.start]):04X}; give a path the file system can "
                                   "encode") from None
    return path


def writable_file(option: str, path: str | None, suffix: str | None = None) -> None:
    """Refuse an output path that cannot be written (missing directory, a directory, no permission, or a
    name without `suffix`, e.g. ".png" for a plot) before the work whose result it would receive runs;
    None and "-" (stdout) pass."""
    if path is None or path == "-" and suffix is None:
        return
    if path == "":
        raise InvalidArgumentError(f"{option} needs a file name, got an empty one")
    path_argument(option, path)
    if suffix is not None and not path.lower().endswith(suffix):
        raise InvalidArgumentError(f"{option} {printable(path)}: the file is written as {suffix[1:].upper()}; "
                                   f"name a {suffix} file")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        problem = "that is a directory"
    elif not os.path.isdir(folder):
        problem = f"the directory {printable(folder)} does not exist"
    elif not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        problem = "permission denied"
    else:
        # a trial of the hidden file the output is written through (edge/core/files.py write_atomically,
        # whose name is longer than the file's): a name too long, or a read-only file system, fails here
        trial = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}-00000000.partial")
        try:
            with open(trial, "x"):
                pass
            os.remove(trial)
            return
        except OSError as exc:
            problem = (exc.strerror or str(exc)).lower()
    raise InvalidArgumentError(f"{option} {printable(path)}: cannot write there, {problem}; choose a file in an "
                               "existing, writable directory")


SIZE_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}
_SIZE = re.compile(r"\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMG]I?B|B)?\s*", re.IGNORECASE)


def parse_size(text: str) -> float | None:
    """A size written as people write it: 512, 1.5e9, 512MB, 2GiB, 64kb (decimal KB/MB/GB, binary
    KiB/MiB/GiB, case-insensitive) -> bytes (a float, not rounded, sign kept); None if it is not one.
    Callers say what they wanted in their own error message."""
    match = _SIZE.fullmatch(text)
    if not match:
        return None
    number, unit = match.groups()
    return float(number) * SIZE_UNITS[(unit or "").upper()]
