"""Weights of a zllm model as ONNX initializers: the arrays MatMulNBits, MatMul and Gather consume.

A quantized weight W [N, K] reaches `com.microsoft::MatMulNBits` as stored: its `qweight` bytes
[N, K/g, g*bits/8] (low nibble first) are the input B unchanged, with no requantization. What
changes is only the form of the per-group constants, because MatMulNBits computes
w = (q - z) * s with s of the activation's type (float32 here):

    symmetric        s = scales as float32 (exact); z left out: the op's default is 8 / 128,
                     our symmetric zero point, so w = s * (q - z) exactly as quant/ defines it.
    affine, int4     "zero_point" (optional): z = -o / s as float32 (the op takes float zero points
                     for 4 bits, but onnxruntime's CPU kernel runs them 16-35x slower than uint8 ones).
                     Rounding: z carries one float32 rounding (relative 2^-24), so each weight moves
                     by at most |o| * 2^-24 beyond the float32 rounding of (q - z) * s itself; a group
                     with s = 0 (all weights equal to o) cannot be written this way and is rewritten
                     exactly as codes 0, s' = o, z' = -1 (its codes carry no information when s = 0).
    affine, int8     the CPU kernel refuses float zero points for 8 bits, so the affine part is
    (and int4 in     computed dequantize-free: with m the codes' midpoint (8 / 128), w = s * q + o =
     "group_offset",   s * (q - m) + (o + m * s) gives
     the default)      x . w = MatMulNBits(x; q, s, z = m) + groupsum(x) @ (o + m s)^T,
                     where groupsum(x) [.., K/g] sums x over each group; o + m s is fed as float32
                     [K/g, N] (one float32 rounding of each group's midpoint value). Centring the codes
                     matters where MatMulNBits rounds x to int8 (accuracy_level 4): that error
                     multiplies (q - z), and with z = 0 the uncentred codes 0..15 turned it into
                     errors several times those of a symmetric weight.

Float weights [N, K] become MatMul's right-hand side [K, N] (transposed once at export);
float16 stays float16 and is cast in the graph. Norm gains and biases are float32 vectors.

Two stores hold these arrays: `ExternalWeightFile`, an append-only file beside the cached
graphs (every graph of a model shares it, so a weight is written once), and `InlineWeights`,
which embeds them in the model (small graphs built on the fly).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, numpy_helper

from quant import QuantizedTensor

AFFINE_INT4_MODES = ("zero_point", "group_offset")
_ALIGNMENT = 4096  # byte alignment of each array in the weight file (page-aligned for mmap readers)

_ONNX_TYPES = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.int32): TensorProto.INT32,
}


def onnx_type(dtype) -> int:
    return _ONNX_TYPES[np.dtype(dtype)]


# --- lowering: one weight -> the arrays a graph feeds ---------------------------------------------

def matmul_nbits_arrays(weight: QuantizedTensor, affine_int4: str = "zero_point") -> dict[str, np.ndarray]:
    """The inputs of MatMulNBits (and of the group-offset term) for a quantized weight, by role.

    Roles: "qweight" (as stored), "scales" float32 [N, G], and for affine schemes either
    "zero_points" float32 [N, G], or "zero_points_u8" (packed zeros) plus "offsets_t" float32 [G, N].
    """
    if affine_int4 not in AFFINE_INT4_MODES:
        raise ValueError(f"affine_int4 must be one of {AFFINE_INT4_MODES}, got {affine_int4!r}")
    scheme = weight.scheme
    arrays = {"qweight": np.ascontiguousarray(weight.qweight), "scales": weight.scales.astype(np.float32)}
    if scheme.symmetric:
        return arrays
    if uses_group_offset(weight, affine_int4):
        n_rows, n_groups = weight.scales.shape
        packed_groups = -(-n_groups * scheme.bits // 8)  # ceil(G * bits / 8): zero points are bit-packed
        midpoint = 1 << (scheme.bits - 1)
        packed_midpoints = 0x88 if scheme.bits == 4 else midpoint  # two 4-bit zero points per byte
        arrays["zero_points_u8"] = np.full((n_rows, packed_groups), packed_midpoints, np.uint8)
        midpoint_values = weight.offsets.astype(np.float64) + midpoint * weight.scales.astype(np.float64)
        arrays["offsets_t"] = np.ascontiguousarray(midpoint_values.astype(np.float32).T)
        return arrays
    scales = arrays["scales"]
    offsets = weight.offsets.astype(np.float32)
    degenerate = scales == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        zero_points = (-offsets.astype(np.float64) / scales.astype(np.float64)).astype(np.float32)
    if degenerate.any():
        # w = o for every code of the group: codes 0, scale o, zero point -1 gives (0 + 1) * o = o.
        qweight = arrays["qweight"].copy()
        qweight[degenerate] = 0
        arrays["qweight"] = qweight
        scales = scales.copy()
        scales[degenerate] = offsets[degenerate]
        arrays["scales"] = scales
        zero_points[degenerate] = -1.0
    arrays["zero_points"] = zero_points
    return arrays


def uses_group_offset(weight: QuantizedTensor, affine_int4: str) -> bool:
    """True when the affine part of `weight` is the exact group-offset matmul (see module docstring)."""
    return not weight.scheme.symmetric and (weight.scheme.bits == 8 or affine_int4 == "group_offset")


def embedding_arrays(table) -> dict[str, np.ndarray]:
    """Arrays for the in-graph embedding lookup: the table itself, or codes + float32 scales (+ offsets)."""
    if isinstance(table, QuantizedTensor):
        arrays = {"qweight": np.ascontiguousarray(table.qweight), "scales": table.scales.astype(np.float32)}
        if table.offsets is not None:
            arrays["offsets"] = table.offsets.astype(np.float32)
        return arrays
    table = np.asarray(table)
    return {"table": table if table.dtype in (np.float32, np.float16) else table.astype(np.float32)}


def float_matrix_t(matrix) -> np.ndarray:
    """MatMul's right-hand side [K, N] of a float weight [N, K]; float16 stays float16."""
    matrix = np.asarray(matrix)
    dtype = matrix.dtype if matrix.dtype in (np.float32, np.float16) else np.float32
    return np.ascontiguousarray(matrix.T, dtype=dtype)


def float_vector(vector) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(vector), dtype=np.float32)


# --- stores ---------------------------------------------------------------------------------------

class InlineWeights:
    """Arrays embedded in the model itself (for small graphs built and run on the fly)."""

    def tensor(self, name: str, make_array) -> TensorProto:
        return numpy_helper.from_array(np.ascontiguousarray(make_array()), name)

    def close(self) -> None:
        pass


@dataclass
class _Entry:
    offset: int
    length: int
    dtype: str
    shape: list[int]


class WeightFileError(RuntimeError):
    """The weight file beside cached graphs does not match its index (interrupted or damaged)."""


class ExternalWeightFile:
    """Append-only weight file shared by every cached graph of one model: `weights.bin` + `weights.json`.

    `tensor(name, make_array)` returns an initializer that points into the file (ONNX external
    data, location relative to the graph), writing the array the first time its name is asked for.
    make_array is called only then, so a weight already in the file costs nothing to reference.
    """

    DATA = "weights.bin"
    INDEX = "weights.json"

    def __init__(self, folder: str, fingerprint: dict):
        self.folder = folder
        self.fingerprint = fingerprint
        self.data_path = os.path.join(folder, self.DATA)
        self.index_path = os.path.join(folder, self.INDEX)
        self.entries: dict[str, _Entry] = {}
        self._dirty = False
        if os.path.isfile(self.index_path):
            self._load_index()
        self._file = open(self.data_path, "ab")

    def _load_index(self) -> None:
        with open(self.index_path, encoding="utf-8") as f:
            index = json.load(f)
        if index.get("fingerprint") != self.fingerprint:
            raise WeightFileError(f"{self.index_path} was written for {index.get('fingerprint')}, expected {self.fingerprint}")
        size = os.path.getsize(self.data_path) if os.path.isfile(self.data_path) else 0
        for name, raw in index["entries"].items():
            entry = _Entry(**raw)
            if entry.offset + entry.length > size:
                raise WeightFileError(f"{self.data_path} is shorter ({size} bytes) than its index says for {name}")
            self.entries[name] = entry

    def tensor(self, name: str, make_array) -> TensorProto:
        entry = self.entries.get(name)
        if entry is None:
            entry = self._append(np.ascontiguousarray(make_array()))
            self.entries[name] = entry
            self._dirty = True
        tensor = TensorProto()
        tensor.name = name
        tensor.data_type = onnx_type(entry.dtype)
        tensor.dims.extend(entry.shape)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.DATA), ("offset", str(entry.offset)), ("length", str(entry.length))):
            item = tensor.external_data.add()
            item.key, item.value = key, value
        return tensor

    def _append(self, array: np.ndarray) -> _Entry:
        self._file.seek(0, os.SEEK_END)
        position = self._file.tell()
        padding = -position % _ALIGNMENT
        if padding:
            self._file.write(b"\0" * padding)
        offset = position + padding
        self._file.write(memoryview(array.reshape(-1)).cast("B"))
        return _Entry(offset, array.nbytes, array.dtype.name, list(array.shape))

    def flush(self) -> None:
        """Make the data durable, then publish the index that points into it (atomic replace)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        if not self._dirty:
            return
        index = {"fingerprint": self.fingerprint,
                 "entries": {name: vars(entry) for name, entry in self.entries.items()}}
        temporary = self.index_path + ".tmp"
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump(index, f)
        os.replace(temporary, self.index_path)
        self._dirty = False

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()
