"""Where zllm-edge keeps what it builds: converted models, compiled kernels, exported graphs.

The one rule, shared by edge/, devices/ and kernels/ (it lives here, the lowest package, because
devices/ and kernels/ may import no more of edge/ than edge/core): ZLLM_EDGE_HOME, else $XDG_CACHE_HOME/zllm-edge,
else ~/.cache/zllm-edge. It is read at each call, so a changed environment takes effect.

Whatever cannot be written there (a read-only file system, a full disk) is said naming the path
and ZLLM_EDGE_HOME: home_not_writable() makes that error.
"""
from __future__ import annotations

import os

from edge.core.files import NotWritableError, not_writable

HOME_VARIABLE = "ZLLM_EDGE_HOME"


def zllm_home() -> str:
    explicit = os.environ.get(HOME_VARIABLE)
    if explicit:
        return os.path.abspath(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "zllm-edge")


def home_not_writable(path, error: OSError) -> NotWritableError:
    """The error for a write into the home at `path` that failed with `error`."""
    return not_writable(path, error, HOME_VARIABLE)
