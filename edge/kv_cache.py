"""The KV cache: logical layout in edge/, physical buffers from the backend.

One (keys, values) pair per layer, each [capacity, Hkv, Dh]; positions 0..length-1 are valid.
"""
from __future__ import annotations

import numpy as np

from edge.errors import SessionError


class KVCache:
    def __init__(self, backend, n_layers: int, kv_heads: int, head_dim: int, capacity: int):
        self.capacity = capacity
        self.length = 0
        self.layers = [backend.allocate_kv(capacity, kv_heads, head_dim) for _ in range(n_layers)]

    def check_room(self, n_new: int, context_limit: int) -> None:
        end = self.length + n_new
        if end > context_limit:
            raise SessionError(
                f"the sequence would grow from {self.length} to {end} tokens, beyond the model's context of "
                f"{context_limit} tokens; start a new session or shorten the input"
            )
        if end > self.capacity:
            raise SessionError(
                f"the sequence would grow from {self.length} to {end} tokens, beyond this session's KV cache "
                f"capacity of {self.capacity}; open the session with model.session(capacity=...) up to {context_limit}"
            )

    def write(self, layer: int, start: int, keys: np.ndarray, values: np.ndarray) -> None:
        k_cache, v_cache = self.layers[layer]
        k_cache[start : start + len(keys)] = keys
        v_cache[start : start + len(values)] = values

    def view(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        k_cache, v_cache = self.layers[layer]
        return k_cache[:end], v_cache[:end]

    @property
    def nbytes_used(self) -> int:
        return sum(k[: self.length].nbytes + v[: self.length].nbytes for k, v in self.layers)
