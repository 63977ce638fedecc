"""Reading and writing safetensors files through mmap, one tensor at a time.

File layout (https://github.com/huggingface/safetensors): an 8-byte little-endian header
length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}},
then the data buffer; offsets are relative to the buffer's start.

The reader validates the header against the file before handing out any view, so that a
truncated or corrupt file is reported by name instead of surfacing as a numpy error. The
writer takes the full list of tensor shapes first (the header precedes the data), then
streams tensors in, so a converter never holds more than the tensor it is writing.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from edge.core.arguments import is_integer
from edge.core.errors import ZllmError
from edge.core.json_text import parse_json

# safetensors dtype name -> numpy dtype. BF16 has no numpy dtype: it is read as uint16 bits.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
NUMPY_TO_SAFETENSORS = {
    np.dtype("<f4"): "F32",
    np.dtype("<f2"): "F16",
    np.dtype("u1"): "U8",
    np.dtype("i1"): "I8",
    np.dtype("<i4"): "I32",
}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's limit


class SafetensorsFormatError(ZllmError):
    """A safetensors file is truncated or its header does not describe its contents."""


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset
    end: int


class SafetensorsFile:
    """A validated, mmap-backed safetensors file. Views it returns are read-only and zero-copy."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.entries, self.metadata = _read_header(self.path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if os.path.getsize(self.path) else None

    def keys(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def raw(self, name: str) -> np.ndarray:
        """The stored array as written (BF16 comes back as its uint16 bit pattern)."""
        entry = self.entries[name]
        view = self._map[entry.begin : entry.end].view(DTYPES[entry.dtype])
        return view.reshape(entry.shape)

    def float32(self, name: str, index: tuple | None = None) -> np.ndarray:
        """The tensor, or its part `raw[index]`, as float32 (a copy unless it is stored as F32)."""
        entry = self.entries[name]
        raw = self.raw(name) if index is None else self.raw(name)[index]
        if entry.dtype == "BF16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        if entry.dtype == "F32":
            return raw
        return raw.astype(np.float32)

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process's memory (they stay in the OS page cache).

        Converters call this after each tensor so that resident memory tracks the tensor in
        flight, not everything read so far."""
        entry = self.entries[name]
        release_pages(self._map, entry.begin, entry.end)

    def close(self) -> None:
        if self._map is not None:
            self._map._mmap.close()
            self._map = None

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def release_pages(mapped: np.memmap | None, begin: int, end: int) -> None:
    """madvise(DONTNEED) the whole pages inside [begin, end) of a read-only file mapping."""
    if mapped is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    first = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE
    last = end // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        mapped._mmap.madvise(mmap.MADV_DONTNEED, first, last - first)


def release_view(array: np.ndarray) -> None:
    """release_pages for the bytes of `array` when it is a view of a file mapping (an np.memmap or a
    view of one); a no-op for any other array."""
    mapped = array
    while isinstance(mapped, np.ndarray) and getattr(mapped, "_mmap", None) is None:
        mapped = mapped.base
    mapping = getattr(mapped, "_mmap", None)
    if mapping is None or mapping.closed:
        return
    begin = array.ctypes.data - np.frombuffer(mapping, np.uint8).ctypes.data  # offset in the mapping
    release_pages(mapped, begin, begin + array.nbytes)


def _read_header(path: str) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    name = os.path.basename(path)
    file_size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise SafetensorsFormatError(
                f"{name}: file is {file_size} bytes, too short for a safetensors header; the file is truncated"
            )
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
            raise SafetensorsFormatError(
                f"{name}: header length {header_len} exceeds the file size {file_size}; "
                "the file is truncated or not a safetensors file"
            )
        try:
            header = parse_json(f.read(header_len))
        except ValueError as exc:
            raise SafetensorsFormatError(f"{name}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsFormatError(f"{name}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise SafetensorsFormatError(f"{name}: header's __metadata__ is not a JSON object: {metadata!r}")
    data_start = 8 + header_len
    data_size = file_size - data_start
    entries: dict[str, TensorEntry] = {}
    for tensor_name, info in header.items():
        fields = _entry_fields(info)
        if fields is None:
            raise SafetensorsFormatError(
                f"{name}: header entry for {tensor_name!r} is malformed: {info!r}; expected dtype, shape "
                "(non-negative integers) and data_offsets (two non-negative integers)"
            )
        dtype, shape, begin, end = fields
        if dtype not in DTYPES:
            raise SafetensorsFormatError(f"{name}: tensor {tensor_name!r} has unsupported dtype {dtype}")
        expected = math.prod(shape) * DTYPES[dtype].itemsize  # Python ints: no int64 overflow
        if not (0 <= begin <= end) or end - begin != expected:
            raise SafetensorsFormatError(
                f"{name}: tensor {tensor_name!r} has offsets [{begin}, {end}] that do not match "
                f"its shape {list(shape)} and dtype {dtype} ({expected} bytes)"
            )
        if end > data_size:
            raise SafetensorsFormatError(
                f"{name}: tensor {tensor_name!r} ends at byte {end} of the data buffer but the file holds "
                f"only {data_size} data bytes; the file is truncated or its header is corrupt"
            )
        entries[tensor_name] = TensorEntry(dtype, shape, data_start + begin, data_start + end)
    _check_layout(name, entries, data_start, data_size)
    return entries, metadata


def _check_layout(name: str, entries: dict[str, TensorEntry], data_start: int, data_size: int) -> None:
    """The tensors lie back to back and fill the data buffer, as the reference implementation requires:
    an overlap would hand two tensors the same bytes, and a gap or trailing bytes mean shifted offsets."""
    corrupt = "the file is corrupt or its header was edited, download or export it again"
    end, previous = 0, None
    for tensor_name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end, item[0])):
        begin = entry.begin - data_start
        if begin < end:
            raise SafetensorsFormatError(
                f"{name}: the data of tensors {previous!r} (bytes [{entries[previous].begin - data_start}, {end}) of "
                f"the data buffer) and {tensor_name!r} (bytes [{begin}, {entry.end - data_start})) overlap; {corrupt}")
        if begin > end:
            raise SafetensorsFormatError(
                f"{name}: tensor {tensor_name!r} starts at byte {begin} of the data buffer, but the tensors before "
                f"it end at byte {end}; safetensors tensors lie back to back, so its offsets are shifted: {corrupt}")
        end, previous = entry.end - data_start, tensor_name
    if end != data_size:
        raise SafetensorsFormatError(
            f"{name}: the tensors' data ends at byte {end} of the data buffer, but the file holds {data_size} data "
            f"bytes; {corrupt}")


def _entry_fields(info) -> tuple[str, tuple[int, ...], int, int] | None:
    """(dtype, shape, begin, end) of a header entry, or None when it is malformed.

    JSON lets a corrupt header hold strings, floats, negative numbers or nested lists anywhere;
    only exact non-negative integers describe bytes that exist."""
    if not isinstance(info, dict):
        return None
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if (not isinstance(dtype, str) or not isinstance(shape, list) or not all(is_integer(d, 0) for d in shape)
            or not isinstance(offsets, list) or len(offsets) != 2 or not all(is_integer(o, 0) for o in offsets)):
        return None
    return dtype, tuple(shape), offsets[0], offsets[1]


