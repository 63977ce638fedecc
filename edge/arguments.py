"""Checks of caller-supplied arguments, shared by the Python API and the CLI, so that the CLI can run
them before it converts or loads a model and the API still refuses the same values on its own.

Each check returns the value normalised (a Python int or float) or raises InvalidArgumentError that
names the argument, what it got and what it accepts."""
from __future__ import annotations

import math
import numbers
import os

from edge.errors import InvalidArgumentError


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


def integer(name: str, value, minimum: int | None = None, maximum: int | None = None, note: str = "") -> int:
    """An int (numpy integers too; not a bool, a float or a string) within [minimum, maximum]."""
    kind = "a positive integer" if minimum == 1 and maximum is None else f"an integer{_bounds(minimum, maximum, None)}"
    wanted = f"{name} must be {kind}{note}"
    if not is_integer(value):
        raise InvalidArgumentError(f"{wanted}, got {value!r}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise InvalidArgumentError(f"{wanted}, got {value}")
    return value


def number(name: str, value, minimum: float | None = None, maximum: float | None = None,
           above: float | None = None, note: str = "") -> float:
    """A finite real number within the bounds: nan passes every comparison, so it is refused by name."""
    wanted = f"{name} must be a finite number{_bounds(minimum, maximum, above)}{note}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{wanted}, got {value!r}")
    value = float(value)
    if (not math.isfinite(value) or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum) or (above is not None and value <= above)):
        raise InvalidArgumentError(f"{wanted}, got {value}")
    return value


def writable_file(option: str, path: str | None) -> None:
    """Refuse an output path that cannot be written (missing directory, a directory, no permission)
    before the work whose result it would receive runs; None and "-" (stdout) pass."""
    if path is None or path == "-":
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        problem = "that is a directory"
    elif not os.path.isdir(folder):
        problem = f"the directory {folder} does not exist"
    elif not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        problem = "permission denied"
    else:
        return
    raise InvalidArgumentError(f"{option} {path}: cannot write there, {problem}; choose a file in an existing, "
                               "writable directory")
