"""Physical KV cache buffers in a storage format (quant/kv_formats.py): quantize on write,
dequantize on read.

A buffer holds `rows` x `heads` x `dim` values and is indexed like the float32 array it stands
for: `buffer[rows] = x` stores x [n, H, D] (rounding it to the format), `buffer[rows]` returns
float32 [n, H, D]. For "f32" a slice reads back a view, with no copy. The reference and CPU
backends share this class and differ only in the codec that does the arithmetic (numpy or Numba).

N = rows, H = heads, D = values per head, G = int8 group size.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from edge.core.kv import KV_FORMATS, kv_bytes_per_row, kv_group_size


class KvCodec(NamedTuple):
    """A backend's implementation of the formats' arithmetic (the same results on every backend)."""

    quantize: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]  # x [N,H,D] -> int8 codes, f16 scales
    dequantize: Callable[[np.ndarray, np.ndarray, int], np.ndarray]       # codes, scales -> f32
    widen_halves: Callable[[np.ndarray], np.ndarray]                       # f16 -> f32


class StoredRows(NamedTuple):
    """Rows of a cache buffer as stored, for kernels that read the format directly: `data` is the
    f32 or f16 values [N, H, D], or the int8 codes [N, H, D] with f16 `scales` [N, H, D/G]."""

    format: str
    group: int
    data: np.ndarray
    scales: np.ndarray | None = None


def concat_stored(first: StoredRows, second: StoredRows) -> StoredRows:
    """The rows of `first` followed by those of `second` (one format)."""
    scales = None if first.scales is None else np.concatenate([first.scales, second.scales])
    return StoredRows(first.format, first.group, np.concatenate([first.data, second.data]), scales)


def decode_stored(rows: StoredRows, codec: KvCodec) -> np.ndarray:
    """float32 [N, H, D] of stored rows (an f32 buffer's rows come back as they are)."""
    if rows.format == "int8":
        return codec.dequantize(np.ascontiguousarray(rows.data), np.ascontiguousarray(rows.scales), rows.group)
    return rows.data if rows.format == "f32" else codec.widen_halves(rows.data)


class CacheBuffer:
    def __init__(self, rows: int, heads: int, dim: int, fmt: str, codec: KvCodec):
        if fmt not in KV_FORMATS:
            raise ValueError(f"KV cache format {fmt!r} is unknown; known formats: {', '.join(KV_FORMATS)}")
        self.shape = (rows, heads, dim)
        self.format = fmt
        self.group = kv_group_size(dim)
        self._codec = codec
        # np.zeros maps pages lazily: memory grows with the rows written, not with `rows`
        if fmt == "int8":
            self.storage = {"codes": np.zeros(self.shape, np.int8),
                            "scales": np.zeros((rows, heads, dim // self.group), np.float16)}
        else:
            self.storage = {"values": np.zeros(self.shape, np.float32 if fmt == "f32" else np.float16)}

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def bytes_per_row(self) -> int:
        return kv_bytes_per_row(self.format, self.shape[1], self.shape[2])

    def __setitem__(self, index, x: np.ndarray) -> None:
        x = np.asarray(x, dtype=np.float32)
        if self.format == "int8":
            codes, scales = self._codec.quantize(np.ascontiguousarray(x), self.group)
            self.storage["codes"][index] = codes
            self.storage["scales"][index] = scales
        else:
            self.storage["values"][index] = x  # f16: numpy rounds to nearest even

    def __getitem__(self, index) -> np.ndarray:
        if self.format == "int8":
            return self._codec.dequantize(np.ascontiguousarray(self.storage["codes"][index]),
                                          np.ascontiguousarray(self.storage["scales"][index]), self.group)
        values = self.storage["values"][index]
        return values if self.format == "f32" else self._codec.widen_halves(values)

    def stored(self, index) -> StoredRows:
        """The rows at `index` as stored (views for a slice, no dequantization)."""
        if self.format == "int8":
            return StoredRows("int8", self.group, self.storage["codes"][index], self.storage["scales"][index])
        return StoredRows(self.format, self.group, self.storage["values"][index])

    def encode(self, x: np.ndarray) -> StoredRows:
        """x [n, H, D] in this buffer's format, without storing it."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if self.format == "int8":
            return StoredRows("int8", self.group, *self._codec.quantize(x, self.group))
        return StoredRows(self.format, self.group, x if self.format == "f32" else x.astype(np.float16))

    def decode(self, rows: StoredRows) -> np.ndarray:
        return decode_stored(rows, self._codec)

    def round_trip(self, x: np.ndarray) -> np.ndarray:
        """What storing x [n, H, D] and reading it back gives, without storing it."""
        x = np.asarray(x, dtype=np.float32)
        if self.format == "f32":
            return x
        if self.format == "f16":
            return self._codec.widen_halves(x.astype(np.float16))
        return self._codec.dequantize(*self._codec.quantize(np.ascontiguousarray(x), self.group), self.group)
