"""The expert file of a MoE checkpoint: one record per (layer, expert), so one read fetches one expert.

    experts.bin   record after record, each starting at a multiple of ALIGNMENT (4 KiB) so that
                  reads can bypass the page cache (O_DIRECT needs aligned offsets)

A record's raw form is the expert's stored arrays (gate_proj, up_proj, down_proj; for each the
arrays `stored_arrays` names: qweight/scales/offsets, or one float array) back to back, each at a
multiple of ARRAY_ALIGNMENT inside the record. With compression, the record on disk is the zstd
frame of that raw form. Every record carries the crc32 of its bytes on disk.

The manifest's "experts" entry indexes every record:

    "experts": {"file": "experts.bin", "alignment": 4096, "compression": null | "zstd",
                "layers": {"<layer>": {"num_experts": E, "raw_length": bytes of one raw record,
                                       "projections": {"gate_proj": {"scheme": ..., "shape": [I, D],
                                                                      "arrays": {"qweight": {"dtype", "shape", "offset"}, ...}},
                                                       "up_proj": ..., "down_proj": ...},
                                       "records": [[offset, length, crc32], ...]}}},
                "index_sha256": "<64 hex digits>"}

A record's crc32 says its bytes are whole, not whose they are: two index entries swapped together
with their crcs would pass it, and so would plausible edits of a layout (two arrays' offsets
exchanged). index_sha256, the sha256 of the entry's canonical JSON without that key (`index_sha256`
below), is written by the converter and verified at load once the index's own checks have passed,
so that any edit of the index is refused. It was added within format version 1: a checkpoint
written before it has no index_sha256 and loads as before, with only the structural checks and
the records' crc32s.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import zstandard

# crc32 of the zlib polynomial, 15-20x faster than zlib's on 100 KB records (SIMD carry-less multiply);
# expert loads verify every record, so this sits on the streaming path
from isal.isal_zlib import crc32

from edge.core.errors import CheckpointError
from quant import QuantizedTensor, Scheme
from quant.checkpoint import canonical_sha256, check_canonical_sha256, stored_arrays

EXPERTS_FILE = "experts.bin"
ALIGNMENT = 4096
ARRAY_ALIGNMENT = 64
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
COMPRESSIONS = (None, "zstd")
INDEX_SHA256 = "index_sha256"  # the key of the experts entry's digest


def expert_tensor_name(layer: int, expert: int, projection: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"


def align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclass(frozen=True)
class StoredArray:
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the raw record

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize  # math.prod: decode runs per expert load


@dataclass(frozen=True)
class ProjectionLayout:
    scheme: Scheme
    shape: tuple[int, int]
    arrays: dict[str, StoredArray]  # suffix ("qweight", "scales", "offsets", or "" for a float matrix)


class ExpertLayout:
    """Where each array of one expert lies inside its raw record (the same for every expert of a layer)."""

    def __init__(self, projections: dict[str, ProjectionLayout]):
        self.projections = projections
        self.raw_length = max((a.offset + a.nbytes for p in projections.values() for a in p.arrays.values()),
                              default=0)

    @property
    def signature(self) -> tuple:
        """Equal for layouts that place the same arrays at the same offsets (layers of one shape and scheme)."""
        return tuple((name, str(p.scheme), p.shape, tuple((key, a.dtype.str, a.shape, a.offset)
                                                          for key, a in p.arrays.items()))
                     for name, p in self.projections.items())

    @classmethod
    def plan(cls, schemes: dict[str, Scheme], shapes: dict[str, tuple[int, int]]) -> "ExpertLayout":
        """Lay the projections' stored arrays out back to back, each aligned."""
        offset, projections = 0, {}
        for projection in PROJECTIONS:
            arrays = {}
            for key, (dtype, shape) in stored_arrays("", schemes[projection], shapes[projection]).items():
                arrays[key.lstrip(".")] = StoredArray(np.dtype(dtype), tuple(shape), offset)
                offset = align(offset + arrays[key.lstrip(".")].nbytes, ARRAY_ALIGNMENT)
            projections[projection] = ProjectionLayout(schemes[projection], tuple(shapes[projection]), arrays)
        return cls(projections)

    def encode(self, weights: dict[str, np.ndarray | QuantizedTensor]) -> bytes:
        """The raw record of one expert whose weights are already in this layout's schemes."""
        record = np.zeros(self.raw_length, np.uint8)
        for projection, layout in self.projections.items():
            value = weights[projection]
            arrays = value.to_arrays("") if isinstance(value, QuantizedTensor) else {"": value}
            for key, array in arrays.items():
                slot = layout.arrays[key.lstrip(".")]
                array = np.ascontiguousarray(array, dtype=slot.dtype)
                if array.shape != slot.shape:
                    raise ValueError(f"{projection}{key}: shape {array.shape}, layout expects {slot.shape}")
                record[slot.offset: slot.offset + slot.nbytes] = array.reshape(-1).view(np.uint8)
        return record.tobytes()

    def decode(self, raw: np.ndarray, name: str = "expert") -> dict[str, np.ndarray | QuantizedTensor]:
        """Zero-copy views of one expert's weights inside `raw` (a uint8 buffer of raw_length bytes)."""
        weights = {}
        for projection, layout in self.projections.items():
            views = {key: raw[a.offset: a.offset + a.nbytes].view(a.dtype).reshape(a.shape)
                     for key, a in layout.arrays.items()}
            if layout.scheme.is_quantized:
                label = f"{name}.{projection}"  # from_arrays takes the arrays under "<name>.qweight", ...
                weights[projection] = QuantizedTensor.from_arrays(
                    layout.scheme, layout.shape, {f"{label}.{key}": view for key, view in views.items()}, label)
            else:
                weights[projection] = views[""]
        return weights

    def to_manifest(self) -> dict:
        return {projection: {"scheme": str(p.scheme), "shape": list(p.shape),
                             "arrays": {key: {"dtype": a.dtype.name, "shape": list(a.shape), "offset": a.offset}
                                        for key, a in p.arrays.items()}}
                for projection, p in self.projections.items()}

    @classmethod
    def from_manifest(cls, entry: dict) -> "ExpertLayout":
        """The layout a manifest entry describes; ValueError or TypeError when its values are not
        counts (the checkpoint reader reports either as a damaged expert index)."""
        projections = {}
        for projection in PROJECTIONS:
            p = entry[projection]
            arrays = {key: StoredArray(np.dtype(a["dtype"]), _counts(a["shape"]), _counts([a["offset"]])[0])
                      for key, a in p["arrays"].items()}
            shape = _counts(p["shape"])
            if len(shape) != 2:
                raise ValueError(f"{projection} has shape {list(shape)}, not a matrix's")
            projections[projection] = ProjectionLayout(Scheme.parse(p["scheme"]), shape, arrays)
        return cls(projections)


def _counts(values) -> tuple[int, ...]:
    """values as a tuple of non-negative ints (not bools, floats or strings)."""
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                               for v in values):
        raise ValueError(f"expected a list of non-negative integers, found {values!r:.60}")
    return tuple(values)


def zstd_bound(raw_length: int) -> int:
    """The most bytes zstd's frame of raw_length bytes can take (ZSTD_COMPRESSBOUND)."""
    return raw_length + (raw_length >> 8) + ((128 << 10) - raw_length >> 11 if raw_length < 128 << 10 else 0)


def index_sha256(entry: dict) -> str:
    """The sha256 of an experts entry's canonical JSON, its own INDEX_SHA256 key left out."""
    return canonical_sha256(entry, INDEX_SHA256)


def check_index_sha256(path: str, entry: dict) -> None:
    """Refuse an experts entry that is not the one the converter wrote: its index_sha256 is not a
    digest, or not the digest of the rest of the entry. An entry without the key (a checkpoint
    written before it existed) passes."""
    check_canonical_sha256(path, entry, INDEX_SHA256, "the experts entry's",
                           f"the expert index fails its sha256 check ({INDEX_SHA256}): its records or layouts were "
                           "edited or damaged after conversion")


def _index_integer(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"index values are integers, found {value!r}")
    return value


@dataclass(frozen=True)
class ExpertRecord:
    offset: int  # in the expert file, a multiple of ALIGNMENT
    length: int  # bytes on disk (compressed length when compressed)
    crc32: int   # of the bytes on disk


@dataclass
class LayerExperts:
    layout: ExpertLayout
    records: list[ExpertRecord]


class ExpertIndex:
    """The manifest's "experts" entry, parsed: every record of every MoE layer."""

    def __init__(self, path: str, entry: dict):
        self.path = os.path.join(path, entry["file"])
        self.compression = entry.get("compression")
        if self.compression not in COMPRESSIONS:
            raise CheckpointError(f"{path}: expert compression {self.compression!r} is not supported "
                                  f"(supported: none, zstd); convert the model again")
        self.alignment = int(entry.get("alignment", ALIGNMENT))
        if self.alignment != ALIGNMENT:
            raise CheckpointError(f"{path}: expert records aligned to {self.alignment} bytes; this zllm-edge reads "
                                  f"records aligned to {ALIGNMENT}; convert the model again")
        self.layers: dict[int, LayerExperts] = {}
        for layer, info in entry["layers"].items():
            layout = ExpertLayout.from_manifest(info["projections"])
            if layout.raw_length != info["raw_length"]:
                raise CheckpointError(f"{path}: layer {layer} experts: layout gives {layout.raw_length} bytes, "
                                      f"the manifest says {info['raw_length']}; convert the model again")
            records = [ExpertRecord(*(_index_integer(value) for value in record)) for record in info["records"]]
            if len(records) != info["num_experts"]:
                raise CheckpointError(f"{path}: layer {layer} indexes {len(records)} experts, "
                                      f"expected {info['num_experts']}; convert the model again")
            self.layers[int(layer)] = LayerExperts(layout, records)
        self._check_records(path)

    def _check_records(self, path: str) -> None:
        """Every record lies inside the expert file at an aligned offset, has the length its layout
        gives (uncompressed) or can give (compressed), and no two share bytes: an edited index entry
        is refused here, before any read, instead of reading another expert's bytes or past the end."""
        size = os.path.getsize(self.path) if os.path.isfile(self.path) else None
        spans = []
        for layer, experts in self.layers.items():
            raw_length = experts.layout.raw_length
            longest = raw_length if self.compression is None else zstd_bound(raw_length)
            for expert, record in enumerate(experts.records):
                problem = None
                if record.offset < 0 or record.offset % self.alignment:
                    problem = f"offset {record.offset} is not a multiple of {self.alignment}"
                elif not (0 < record.length <= longest) or (self.compression is None and record.length != raw_length):
                    problem = f"length {record.length} does not fit its {raw_length}-byte layout"
                elif not 0 <= record.crc32 < 1 << 32:
                    problem = f"crc32 {record.crc32} is not a 32-bit value"
                elif size is not None and record.offset + record.length > size:
                    problem = f"its {record.length} bytes at offset {record.offset} end past the file's {size} bytes"
                if problem is not None:
                    raise CheckpointError(f"{path}: the index of layer {layer} expert {expert} is damaged: {problem}; "
                                          "convert the model again")
                spans.append((record.offset, record.offset + record.length, layer, expert))
        spans.sort()
        for (_, end, layer, expert), (start, _, other_layer, other) in zip(spans, spans[1:]):
            if start < end:
                raise CheckpointError(f"{path}: the index is damaged: the records of layer {layer} expert {expert} "
                                      f"and layer {other_layer} expert {other} share bytes; convert the model again")

    def record(self, layer: int, expert: int) -> ExpertRecord:
        return self.layers[layer].records[expert]

    def layout(self, layer: int) -> ExpertLayout:
        return self.layers[layer].layout

    @property
    def total_stored_bytes(self) -> int:
        return sum(r.length for layer in self.layers.values() for r in layer.records)

    @property
    def total_raw_bytes(self) -> int:
        return sum(layer.layout.raw_length * len(layer.records) for layer in self.layers.values())

    @property
    def largest_raw_record(self) -> int:
        return max((layer.layout.raw_length for layer in self.layers.values()), default=0)


class ExpertChecksumError(CheckpointError):
    """An expert's bytes on disk do not match its checksum (truncated or corrupted file)."""


def read_expert_bytes(fd: int, index: ExpertIndex, layer: int, expert: int, verify: bool = True) -> bytes:
    """One record's bytes on disk by a positional read, checked against its crc32 when `verify`."""
    record = index.record(layer, expert)
    stored = os.pread(fd, record.length, record.offset)
    check_stored_record(index, layer, expert, stored, verify)
    return stored


def check_stored_record(index: ExpertIndex, layer: int, expert: int, stored: bytes | memoryview | np.ndarray,
                        verify: bool = True) -> None:
    """Raise ExpertChecksumError when a record's bytes as read from disk are short or fail their crc32."""
    record = index.record(layer, expert)
    if len(stored) != record.length:
        raise ExpertChecksumError(
            f"{index.path}: layer {layer} expert {expert} is truncated ({len(stored)} of {record.length} bytes "
            f"at offset {record.offset}); the checkpoint is damaged, convert it again")
    if verify and crc32(stored) != record.crc32:
        raise ExpertChecksumError(
            f"{index.path}: layer {layer} expert {expert} fails its crc32 check; the checkpoint is damaged, "
            "convert it again")


def raw_record(index: ExpertIndex, layer: int, expert: int, stored: bytes | memoryview, out: np.ndarray) -> np.ndarray:
    """Fill `out` (uint8, at least raw_length bytes) with expert (layer, expert)'s raw record from its
    bytes on disk."""
    raw_length = index.layout(layer).raw_length
    target = out[:raw_length]
    if index.compression == "zstd":
        try:
            raw = zstandard.ZstdDecompressor().decompress(bytes(stored), max_output_size=raw_length)
        except zstandard.ZstdError as exc:  # without verify, damage shows up here first
            raise ExpertChecksumError(f"{index.path}: layer {layer} expert {expert} fails to decompress ({exc}); "
                                      "the checkpoint is damaged, convert the model again") from None
        if len(raw) != raw_length:
            raise ExpertChecksumError(f"{index.path}: layer {layer} expert {expert} decompresses to {len(raw)} "
                                      f"bytes, expected {raw_length}; the checkpoint is damaged")
        target[:] = np.frombuffer(raw, np.uint8)
    else:
        target[:] = np.frombuffer(stored, np.uint8, count=raw_length)
    return target
