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

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, numpy_helper

from quant import QuantizedTensor

AFFINE_INT4_MODES = ("zero_point", "group_offset")
_ALIGNMENT = 4096  # byte alignment of each array in the weight file (page-aligned for mmap readers)
_HASH_BLOCK = 1 << 24  # bytes read at a time when the weight file is hashed

_ONNX_TYPES = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.int32): TensorProto.INT32,
}


_DTYPE_NAMES = {dtype.name for dtype in _ONNX_TYPES}


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


def file_sha256(path: str, size: int) -> str:
    """The sha256 of the first `size` bytes of the file at `path`."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        left = size
        while left:
            block = f.read(min(left, _HASH_BLOCK))
            if not block:
                break
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


def index_sha256(index: dict) -> str:
    """The sha256 an index records of itself: of its fields but "sha256", as canonical JSON."""
    fields = {key: value for key, value in index.items() if key != "sha256"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def index_problem(index) -> str | None:
    """What is wrong with a parsed weight index (None: nothing): its own sha256 (an offset changed in
    place would otherwise point new graphs at other bytes), every field the cache reads, of its type,
    and every entry inside the data size it records."""
    if not isinstance(index, dict) or not isinstance(index.get("fingerprint"), dict):
        return "not an object with a fingerprint"
    if index.get("sha256") != index_sha256(index):
        return "its sha256 does not match its contents"
    data, entries, graphs = index.get("data"), index.get("entries"), index.get("graphs")
    if not (isinstance(data, dict) and type(data.get("size")) is int and data["size"] >= 0
            and isinstance(data.get("sha256"), str)):
        return "no size and sha256 of the weight file"
    if not isinstance(graphs, dict) or not all(isinstance(v, str) for v in graphs.values()):
        return "no sha256 of each graph"
    if not isinstance(entries, dict):
        return "no entries"
    for name, raw in entries.items():
        if not (isinstance(raw, dict) and set(raw) == {"offset", "length", "dtype", "shape"}
                and type(raw["offset"]) is int and type(raw["length"]) is int and raw["offset"] >= 0
                and raw["length"] >= 0 and raw["offset"] + raw["length"] <= data["size"]
                and raw["dtype"] in _DTYPE_NAMES and isinstance(raw["shape"], list)
                and all(type(d) is int and d >= 0 for d in raw["shape"])):
            return f"entry {name!r} is malformed or lies outside the {data['size']} bytes recorded"
    return None


class ExternalWeightFile:
    """Append-only weight file shared by every cached graph of one model: `weights.bin` + `weights.json`.

    `tensor(name, make_array)` returns an initializer that points into the file (ONNX external
    data, location relative to the graph), writing the array the first time its name is asked for.
    make_array is called only then, so a weight already in the file costs nothing to reference.

    The index records, beside each array's place, the size and sha256 of the data it covers, the
    sha256 of each graph (`record_graph`) and its own sha256, so that a reader can tell a damaged file
    from a good one.
    """

    DATA = "weights.bin"
    INDEX = "weights.json"

    def __init__(self, folder: str, fingerprint: dict):
        self.folder = folder
        self.fingerprint = fingerprint
        self.data_path = os.path.join(folder, self.DATA)
        self.index_path = os.path.join(folder, self.INDEX)
        self.entries: dict[str, _Entry] = {}
        self.graphs: dict[str, str] = {}  # graph file name -> sha256
        self.data = {"size": 0, "sha256": hashlib.sha256().hexdigest()}
        self._dirty = False
        self._appended = False
        if os.path.isfile(self.index_path):
            self._load_index()
        self._file = open(self.data_path, "ab")

    def _load_index(self) -> None:
        with open(self.index_path, encoding="utf-8") as f:
            index = json.load(f)
        problem = index_problem(index)
        if problem is not None:
            raise WeightFileError(f"{self.index_path} is damaged: {problem}")
        if index["fingerprint"] != self.fingerprint:
            raise WeightFileError(f"{self.index_path} was written for {index['fingerprint']}, "
                                  f"expected {self.fingerprint}")
        size = os.path.getsize(self.data_path) if os.path.isfile(self.data_path) else 0
        if size < index["data"]["size"]:
            raise WeightFileError(f"{self.data_path} is shorter ({size} bytes) than its index records "
                                  f"({index['data']['size']})")
        self.entries = {name: _Entry(**raw) for name, raw in index["entries"].items()}
        self.graphs = dict(index["graphs"])
        self.data = dict(index["data"])

    def tensor(self, name: str, make_array) -> TensorProto:
        entry = self.entries.get(name)
        if entry is None:
            entry = self._append(np.ascontiguousarray(make_array()))
            self.entries[name] = entry
            self._dirty = self._appended = True
        tensor = TensorProto()
        tensor.name = name
        tensor.data_type = onnx_type(entry.dtype)
        tensor.dims.extend(entry.shape)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.DATA), ("offset", str(entry.offset)), ("length", str(entry.length))):
            item = tensor.external_data.add()
            item.key, item.value = key, value
        return tensor

    def record_graph(self, name: str, sha256: str) -> None:
        """Record the sha256 of a graph about to be published beside the file."""
        self.graphs[name] = sha256
        self._dirty = True

    def _append(self, array: np.ndarray) -> _Entry:
        self._file.seek(0, os.SEEK_END)
        position = self._file.tell()
        padding = -position % _ALIGNMENT
        if padding:
            self._file.write(b"\0" * padding)
        offset = position + padding
        self._file.write(memoryview(array.reshape(-1)).cast("B"))
        return _Entry(offset, array.nbytes, array.dtype.name, list(array.shape))

    def index(self) -> dict:
        """The index as the file holds it once flushed."""
        index = {"fingerprint": self.fingerprint, "data": dict(self.data), "graphs": dict(self.graphs),
                 "entries": {name: vars(entry) for name, entry in self.entries.items()}}
        return {**index, "sha256": index_sha256(index)}

    def flush(self) -> None:
        """Make the data durable, then publish the index that points into it (atomic replace)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        if not self._dirty:
            return
        if self._appended:  # (appends go at the end: what lies before them was hashed when written)
            size = self._file.tell()
            self.data = {"size": size, "sha256": file_sha256(self.data_path, size)}
        temporary = self.index_path + ".tmp"
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump(self.index(), f)
        os.replace(temporary, self.index_path)
        self._dirty = self._appended = False

    def close(self) -> None:
        if not self._file.closed:
            try:
                self.flush()
            finally:
                self._file.close()
