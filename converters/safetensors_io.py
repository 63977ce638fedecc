"""The safetensors writer of the checkpoint converter (the reader is quant/safetensors_io.py)."""
from __future__ import annotations

import json
import os
import struct
from typing import BinaryIO

import numpy as np

from quant.safetensors_io import NUMPY_TO_SAFETENSORS


class SafetensorsWriter:
    """Writes a safetensors file whose tensor list is known up front, tensor by tensor.

    Tensors are laid out widest dtype first so that every view is aligned to its itemsize.
    """

    def __init__(self, path: str | os.PathLike, layout: dict[str, tuple[np.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = os.fspath(path)
        order = sorted(layout, key=lambda n: -np.dtype(layout[n][0]).itemsize)
        header: dict[str, object] = {}
        self._offsets: dict[str, tuple[int, int, np.dtype, tuple[int, ...]]] = {}
        offset = 0
        for name in order:
            dtype, shape = np.dtype(layout[name][0]), tuple(int(d) for d in layout[name][1])
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            header[name] = {"dtype": NUMPY_TO_SAFETENSORS[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self._offsets[name] = (offset, offset + nbytes, dtype, shape)
            offset += nbytes
        if metadata:
            header["__metadata__"] = metadata
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-(len(encoded)) % 8)  # data starts 8-byte aligned
        self._data_start = 8 + len(encoded)
        self.nbytes = self._data_start + offset
        self._file: BinaryIO = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)
        self._file.truncate(self.nbytes)
        self._written: set[str] = set()

    def write(self, name: str, array: np.ndarray) -> None:
        begin, end, dtype, shape = self._offsets[name]
        if array.dtype != dtype or tuple(array.shape) != shape:
            raise ValueError(f"{name}: planned {dtype}{list(shape)}, got {array.dtype}{list(array.shape)}")
        self._file.seek(self._data_start + begin)
        self._file.write(np.ascontiguousarray(array).data)
        self._written.add(name)

    def close(self) -> None:
        missing = set(self._offsets) - self._written
        self._file.close()
        if missing:
            raise ValueError(f"{self.path}: tensors planned but never written: {sorted(missing)[:5]}")

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()

