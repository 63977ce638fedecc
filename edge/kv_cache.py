"""The KV cache: logical layout in edge/, physical buffers from the backend.

Per layer a slot (SlotLayout): the parts cached per position (K and V per KV head, or MLA's latent
and rotary key), their storage format (quant/kv_formats.py), and, for a sliding-window layer, a
ring buffer that holds only the window: position p lives at row p % window. Positions
0..length-1 have been written; a full slot holds all of them, a ring slot the last `window`.

Buffers come from the backend: `allocate_kv(capacity, Hkv, Dh)` for plain float32 K/V (the
layout fused executors read), `allocate_cache(rows, heads, dim, format)` for everything else.
Both are indexed like arrays: `buffer[rows] = x` stores (rounding to the format), `buffer[rows]`
reads float32. `append_stored` hands attention the rows as stored (f16 values, int8 codes and
scales) so that a backend's kernel reads the format directly; `append` reads them back as float32.
"""
from __future__ import annotations

import numpy as np

from devices.cache_buffers import CacheBuffer, StoredRows, concat_stored
from edge.core.errors import SessionError, ZllmError
from edge.core.kv import SlotLayout, check_kv_format_name


class KVCache:
    def __init__(self, backend, slots: list[SlotLayout], capacity: int):
        self.capacity = capacity
        self.length = 0
        self.slots = slots
        self.layers = [self._allocate(backend, slot) for slot in slots]
        # every layer keeps its keys and values over every position, in the model's format (asked on
        # every forward call, so settled once: a cache's layout never changes)
        self.full_kv = all(slot.full_kv for slot in slots)

    def _allocate(self, backend, slot: SlotLayout) -> tuple:
        if slot.plain:
            keys, values = slot.parts
            return tuple(backend.allocate_kv(self.capacity, keys.heads, keys.dim))
        capabilities = backend.capabilities
        for part in slot.parts:
            if part.format not in capabilities.kv_formats or not capabilities.cache_buffers:
                what = "a ring buffer" if slot.ring else f"a {part.format} {part.name} cache"
                raise ZllmError(
                    f"device {backend.name!r} cannot hold {what}; it keeps float32 K/V caches only "
                    f"(kv_cache='f32', no MLA); use device 'cpu' or 'reference'"
                )
        return tuple(backend.allocate_cache(slot.rows(self.capacity), p.heads, p.dim, p.format) for p in slot.parts)

    def kept_prefix(self, length: int) -> int:
        """How many of the first `length` positions this cache can go back to and continue from: all of
        them, unless a ring slot has wrapped (its window then no longer holds the positions before)."""
        if length >= self.length:
            return self.length
        wrapped = any(slot.ring and self.length > slot.window for slot in self.slots)
        return 0 if wrapped else length

    def check_room(self, n_new: int, context_limit: int, ceiling: int | None = None) -> None:
        """Refuse n_new more tokens beyond the context or this cache's capacity. `ceiling`: the most
        positions any session of the model may hold (a memory budget's KV reservation; default: the
        context), so that the advice names a capacity that can actually be opened."""
        end = self.length + n_new
        if end > context_limit:
            raise SessionError(
                f"the sequence would grow from {self.length} to {end} tokens, beyond the model's context of "
                f"{context_limit} tokens; start a new session or shorten the input"
            )
        if end > self.capacity:
            ceiling = context_limit if ceiling is None else min(ceiling, context_limit)
            if self.capacity >= ceiling:
                advice = (f"the memory budget reserves {ceiling} KV positions; start a new session, or load the "
                          f"model with a larger kv_capacity (--kv-capacity) and memory_budget")
            else:
                budget = " (the KV positions the memory budget reserves)" if ceiling < context_limit else ""
                advice = (f"open the session with model.session(capacity=...) (a saved one: model.load_session(path, "
                          f"capacity=...)) up to {ceiling}{budget}")
            raise SessionError(
                f"the sequence would grow from {self.length} to {end} tokens, beyond this session's KV cache "
                f"capacity of {self.capacity}; {advice}"
            )

    def append(self, layer: int, start: int, new: tuple[np.ndarray, ...]) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
        """Store the parts of positions start..start+T-1 (each [T, H, dim]) and return what attention
        for those T queries reads: every part at the held positions that the first new query may
        see, then the new ones ([S, H, dim] float32, as stored), and their positions [S]."""
        rows, positions = self.append_stored(layer, start, new)
        return tuple(r.data if r.format == "f32" else buffer.decode(r)
                     for r, buffer in zip(rows, self.layers[layer])), positions

    def append_stored(self, layer: int, start: int,
                      new: tuple[np.ndarray, ...]) -> tuple[tuple[StoredRows, ...], np.ndarray]:
        """As `append`, but each part comes back as stored (f32 / f16 values, or int8 codes and
        scales) for kernels that read the format directly. A full slot returns views of its buffers
        (rows 0..end-1, nothing copied); a ring slot returns its held window rows followed by the
        new rows encoded (at most window - 1 + T rows, since a prefill longer than the window
        overwrites rows that its own first queries still see)."""
        slot, buffers = self.slots[layer], self.layers[layer]
        n_new = len(new[0])
        end = start + n_new
        if not slot.ring:
            for buffer, x in zip(buffers, new):
                buffer[start:end] = x
            return tuple(buffer.stored(slice(0, end)) if isinstance(buffer, CacheBuffer)
                         else StoredRows("f32", 0, buffer[:end]) for buffer in buffers), np.arange(end)
        window = slot.window
        held = np.arange(max(0, start - window + 1), start)  # older positions the first query sees
        fresh = np.arange(start, end)
        kept = fresh[-window:]  # a prefill longer than the window leaves only its last `window` rows
        parts = []
        for buffer, x in zip(buffers, new):
            history = buffer.stored(held % window)
            encoded = buffer.encode(x)
            buffer[kept % window] = x[n_new - len(kept):]
            parts.append(concat_stored(history, encoded))
        return tuple(parts), np.concatenate([held, fresh])

    def held_positions(self, layer: int) -> np.ndarray:
        """Positions whose entries the layer's slot still holds (all, or a ring's last window)."""
        slot = self.slots[layer]
        first = max(0, self.length - slot.window) if slot.ring else 0
        return np.arange(first, self.length)

    def rows_of(self, layer: int, positions: np.ndarray) -> np.ndarray:
        slot = self.slots[layer]
        return positions % slot.window if slot.ring else positions

    @property
    def bytes_per_token(self) -> int:
        """Bytes one more position costs while every layer still grows (rings stop at the window)."""
        return sum(slot.bytes_per_token for slot in self.slots)

    @property
    def nbytes_used(self) -> int:
        return sum(slot.bytes_per_token * len(self.held_positions(i)) for i, slot in enumerate(self.slots))

    def describe(self) -> dict:
        return {
            "capacity": self.capacity,
            "length": self.length,
            "bytes_per_token": self.bytes_per_token,
            "layers": [
                {"parts": [(p.name, p.heads, p.dim, p.format) for p in slot.parts],
                 "window": slot.window, "ring": slot.ring}
                for slot in self.slots
            ],
        }


def check_kv_format(kv_format: str, backend) -> None:
    check_kv_format_name(kv_format)
    supported = backend.capabilities.kv_formats
    if kv_format not in supported:
        raise ZllmError(
            f"device {backend.name!r} does not implement the {kv_format} KV cache (it has {', '.join(supported)}); "
            f"use kv_cache='f32' or device 'cpu' / 'reference'"
        )
