"""Where zllm-edge keeps what it builds: converted models, compiled kernels, exported graphs.

The one rule, shared by edge/, devices/ and kernels/ (it lives here, the lowest package, because
devices/ and kernels/ may not import edge/): ZLLM_EDGE_HOME, else $XDG_CACHE_HOME/zllm-edge,
else ~/.cache/zllm-edge. It is read at each call, so a changed environment takes effect.
"""
from __future__ import annotations

import os


def zllm_home() -> str:
    explicit = os.environ.get("ZLLM_EDGE_HOME")
    if explicit:
        return os.path.abspath(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "zllm-edge")
