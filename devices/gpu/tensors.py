"""Weights and KV caches in GPU buffers.

A weight matrix [N, K] is uploaded in the bytes it is stored in (quant/formats.py): INT4/INT8
codes as u32 words, f16 scales and offsets as pairs of halves in u32 words, f16/f32 floats as
they are (rows padded to a multiple of 8 inputs, the kernels' unit). A matrix whose bytes
exceed the device's largest storage binding (or whose rows exceed one dispatch) is split into
chunks of whole rows, each in its own buffers; kernels run once per chunk.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from quant import QuantizedTensor

WEIGHT_KINDS = {"int4": 0, "int8": 1, "f16": 2, "f32": 3}
UNIT = 8  # inputs decoded together by weights.wgsl


@dataclass
class MatrixChunk:
    first_row: int
    rows: int
    words: object    # buffer: the rows' codes or floats
    scales: object   # buffer: f16 pairs (a 16-byte placeholder for float weights)
    offsets: object  # buffer: f16 pairs (a placeholder unless affine)


def _buffer_bytes(nbytes: int) -> int:
    """What ctx.storage allocates for nbytes (rounded up to 16, never empty)."""
    return max(16, (int(nbytes) + 15) // 16 * 16)


def rows_per_chunk(ctx, n_rows: int, row_bytes: int) -> int:
    """A chunk fits one storage binding, and its rows fit one dispatch's grid (a workgroup per row at most)."""
    return max(1, min(n_rows, ctx.max_binding_bytes // row_bytes, ctx.max_workgroups))


def matrix_device_bytes(ctx, scheme, shape: tuple[int, int]) -> int:
    """The bytes a GpuMatrix of this quant.Scheme and shape [N, K] holds on the device (every chunk's
    codes or floats, scales and offsets): what an expert costs in the GPU expert cache."""
    n_rows, k = shape
    if scheme.is_quantized:
        n_groups = math.ceil(k / scheme.group_size)
        row_bytes = n_groups * scheme.group_size * scheme.bits // 8
        group_bytes = 2 * n_groups  # f16 per group
    else:
        row_bytes = math.ceil(k / UNIT) * UNIT * (2 if scheme.dtype == "f16" else 4)
        group_bytes = 0
    per_chunk = rows_per_chunk(ctx, n_rows, row_bytes)
    total = 0
    for first in range(0, n_rows, per_chunk):
        rows = min(per_chunk, n_rows - first)
        total += _buffer_bytes(rows * row_bytes)
        total += _buffer_bytes(rows * group_bytes) if group_bytes else 16
        total += _buffer_bytes(rows * group_bytes) if group_bytes and not scheme.symmetric else 16
    return total


class GpuMatrix:
    """A weight [N, K] resident on the device, as row chunks."""

    def __init__(self, ctx, weight):
        self.ctx = ctx
        if isinstance(weight, QuantizedTensor):
            self.shape = weight.shape
            self.dtype, self.symmetric = weight.scheme.dtype, weight.scheme.symmetric
            self.group_size = weight.scheme.group_size
            self.groups = weight.n_groups
            self.scales_f32 = weight.scheme.scale_dtype == "f32"
            rows = weight.qweight.reshape(self.shape[0], -1)  # [N, K_padded * bits / 8] bytes
            scales, offsets = weight.scales, weight.offsets
        else:
            weight = np.asarray(weight)
            if weight.ndim != 2 or weight.dtype not in (np.float32, np.float16):
                raise ValueError(
                    f"a GPU weight matrix is f32/f16 [N, K] or a QuantizedTensor, got {weight.dtype}{list(weight.shape)}"
                )
            self.shape = tuple(weight.shape)
            self.dtype, self.symmetric, self.group_size, self.groups = (
                "f16" if weight.dtype == np.float16 else "f32", True, UNIT, 0)
            self.scales_f32 = False
            padded_k = math.ceil(self.shape[1] / UNIT) * UNIT
            rows = weight if padded_k == self.shape[1] else np.pad(weight, ((0, 0), (0, padded_k - self.shape[1])))
            scales = offsets = None
        n_rows = self.shape[0]
        self.row_bytes = rows.shape[1] * rows.itemsize
        self.row_words = self.row_bytes // 4
        per_chunk = rows_per_chunk(ctx, n_rows, self.row_bytes)
        self.nbytes = 0
        self.chunks: list[MatrixChunk] = []
        for first in range(0, n_rows, per_chunk):
            part = slice(first, min(n_rows, first + per_chunk))
            words = ctx.upload(rows[part], "weight")
            chunk_scales = ctx.upload(scales[part]) if scales is not None else ctx.storage(16)
            chunk_offsets = ctx.upload(offsets[part]) if offsets is not None else ctx.storage(16)
            self.nbytes += words.size + chunk_scales.size + chunk_offsets.size
            self.chunks.append(MatrixChunk(first, part.stop - first, words, chunk_scales, chunk_offsets))

    def release(self) -> None:
        """Free the matrix's device memory now (an evicted expert), not when Python collects it."""
        for chunk in self.chunks:
            for buffer in (chunk.words, chunk.scales, chunk.offsets):
                self.ctx.release(buffer)
        self.chunks = []

    @property
    def constants(self) -> dict:
        """The compile-time constants weights.wgsl needs for this matrix."""
        return {"WEIGHT_KIND": WEIGHT_KINDS[self.dtype], "SYMMETRIC": self.symmetric, "GROUP_SIZE": self.group_size,
                "SCALES_F32": self.scales_f32}

    def __repr__(self) -> str:
        kind = "sym" if self.symmetric else "affine"
        scheme = self.dtype if self.groups == 0 else f"{self.dtype}_{kind}_g{self.group_size}"
        return f"GpuMatrix({scheme}, shape={self.shape}, chunks={len(self.chunks)})"


class GpuVector:
    """A 1-D weight (norm gain, bias) resident on the device as f32."""

    def __init__(self, ctx, values):
        values = np.asarray(values, dtype=np.float32)
        if values.ndim != 1:
            raise ValueError(f"a GPU vector is 1-D, got shape {values.shape}")
        self.shape = values.shape
        self.buffer = ctx.upload(values, "vector")
        self.nbytes = self.buffer.size


class GpuKV:
    """One layer's keys or values, [capacity, Hkv, Dh] f32, in a device buffer.

    The fused executor reads and writes it in place. For edge's op-by-op composition it also
    behaves like the array the contract describes: `kv[a:b] = array` uploads those positions and
    `kv[:end]` downloads them.
    """

    def __init__(self, ctx, capacity: int, kv_heads: int, head_dim: int):
        self.ctx = ctx
        self.shape = (capacity, kv_heads, head_dim)
        self.dtype = np.dtype(np.float32)
        self.row_bytes = kv_heads * head_dim * 4
        self.nbytes = capacity * self.row_bytes
        if self.nbytes > ctx.max_binding_bytes:
            raise ValueError(
                f"a KV cache of {capacity} positions needs {self.nbytes} bytes per layer, above this GPU's largest "
                f"storage binding of {ctx.max_binding_bytes} bytes; open the session with a capacity of at most "
                f"{ctx.max_binding_bytes // self.row_bytes}"
            )
        self.buffer = ctx.storage(self.nbytes, "kv", copy_src=True)

    def __len__(self) -> int:
        return self.shape[0]

    def _rows(self, index) -> range:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError(f"a GPU KV buffer is indexed by contiguous position slices, got {index!r}")
        return range(*index.indices(self.shape[0]))

    def __setitem__(self, index, values) -> None:
        rows = self._rows(index)
        values = np.asarray(values, dtype=np.float32)
        if values.shape != (len(rows), *self.shape[1:]):
            raise ValueError(f"cannot write {values.shape} into positions {rows.start}:{rows.stop} of {self.shape}")
        if len(rows):
            self.ctx.write(self.buffer, values, rows.start * self.row_bytes)

    def __getitem__(self, index) -> np.ndarray:
        rows = self._rows(index)
        if not len(rows):
            return np.zeros((0, *self.shape[1:]), np.float32)
        data = self.ctx.download(self.buffer, len(rows) * self.row_bytes, np.float32, rows.start * self.row_bytes)
        return data.reshape(len(rows), *self.shape[1:])
