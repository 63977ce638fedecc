"""The KV cache's logical layout: its storage formats by name, what a cached row costs in each, and
which parts every layer caches per position (keys and values per KV head, or MLA's latent and rotary
key), so that a memory plan and a device agree on the cache's size without building one. The math
of each format (rounding, codes, error bounds) lives in quant/kv_formats.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from edge.core.errors import InvalidArgumentError

KV_FORMATS = ("f32", "f16", "int8")


KV_INT8_GROUP = 32


def kv_group_size(dim: int) -> int:
    """Group length of the int8 format along a row of `dim` values: 32, or the whole row when 32
    does not divide it (small test heads such as 24 or 8)."""
    return KV_INT8_GROUP if dim % KV_INT8_GROUP == 0 else dim


def kv_bytes_per_row(fmt: str, heads: int, dim: int) -> int:
    """Bytes one cached position takes in one buffer of `heads` x `dim` values."""
    if fmt == "f32":
        return 4 * heads * dim
    if fmt == "f16":
        return 2 * heads * dim
    if fmt == "int8":
        return heads * dim + 2 * heads * (dim // kv_group_size(dim))  # codes + f16 scales
    raise ValueError(f"KV cache format {fmt!r} is unknown; known formats: {', '.join(KV_FORMATS)}")



@dataclass(frozen=True)
class CachePart:
    name: str     # "keys", "values" (GQA) or "latent", "rope" (MLA)
    heads: int
    dim: int
    format: str   # one of KV_FORMATS

    @property
    def bytes_per_row(self) -> int:
        return kv_bytes_per_row(self.format, self.heads, self.dim)


@dataclass(frozen=True)
class SlotLayout:
    parts: tuple[CachePart, ...]
    window: int | None  # a sliding layer's window (queries see keys less than `window` behind)
    ring: bool          # keep only the window's rows

    def rows(self, capacity: int) -> int:
        return self.window if self.ring else capacity

    @property
    def bytes_per_token(self) -> int:
        return sum(part.bytes_per_row for part in self.parts)

    @property
    def full_kv(self) -> bool:
        """Keys and values over every position (no ring buffer, no MLA latent): what fused executors take."""
        return not self.ring and all(p.name in ("keys", "values") for p in self.parts)

    @property
    def plain(self) -> bool:
        """Float32 K/V over every position: the layout of a backend's allocate_kv."""
        return self.full_kv and all(p.format == "f32" for p in self.parts)


def check_kv_format_name(kv_format: str) -> None:
    """A KV cache format's name (InvalidArgumentError, also a ZllmError and a ValueError, for any other value)."""
    if not isinstance(kv_format, str) or kv_format not in KV_FORMATS:
        raise InvalidArgumentError(f"kv_cache {kv_format!r} is unknown; choose one of {', '.join(KV_FORMATS)}")



# --- cache layouts ------------------------------------------------------------------------------
def rope_part_format(kv_format: str) -> str:
    """MLA keeps the rotary key part in f16 whenever the latent is compressed (f16 or int8):
    quantizing it would perturb every position's phase."""
    return "f32" if kv_format == "f32" else "f16"


def cache_slots(spec, kv_format: str, capacity: int, ring_buffers: bool) -> list[SlotLayout]:
    """The logical cache layout of every layer: what is cached per position, in which format, and
    whether a sliding layer keeps only its window (ring buffer)."""
    check_kv_format_name(kv_format)
    slots = []
    for layer in range(spec.num_hidden_layers):
        if spec.attention_kind == "mla":
            parts = (CachePart("latent", 1, spec.kv_lora_rank, kv_format),
                     CachePart("rope", 1, spec.qk_rope_head_dim, rope_part_format(kv_format)))
            slots.append(SlotLayout(parts, window=None, ring=False))
            continue
        window = spec.sliding_window_for_layer(layer)
        parts = (CachePart("keys", spec.num_key_value_heads, spec.head_dim, kv_format),
                 CachePart("values", spec.num_key_value_heads, spec.head_dim, kv_format))
        ring = ring_buffers and window is not None and window < capacity
        slots.append(SlotLayout(parts, window=window, ring=ring))
    return slots


def kv_bytes_per_token(spec, kv_format: str = "f32") -> int:
    """Bytes one more position adds to the cache over all layers, before any ring buffer fills."""
    return sum(slot.bytes_per_token for slot in cache_slots(spec, kv_format, spec.max_position_embeddings, False))

