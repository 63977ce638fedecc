"""A bounded walk over a GGUF file's header, metadata and tensor table, before gguf.GGUFReader reads it.

GGUFReader trusts every count it reads. An array that claims more items than the file holds makes
it loop while memory grows (past the end each item is an empty view, so its offset stops moving),
and even a count the bytes can hold costs it about 1 KB of numpy views per array item. This walk
checks every count, length, dimension and offset against the bytes that follow and against limits
real files stay far below, allocating nothing per item, and refuses a damaged file with a
ConversionError that says what the file claims.

GGUF layout (gguf-py constants.py; all integers in the file's byte order):
    header   magic "GGUF" | version u32 | tensor count u64 | key/value count u64
    key      name (u64 length + UTF-8) | value type u32 | value
    value    a scalar | a string (u64 length + bytes) | an array: item type u32 | count u64 | items
    tensor   name | n_dims u32 | dims u64[n_dims], innermost first | GGML type u32 | data offset u64
    data     at the first multiple of general.alignment after the tensor table; offsets count from there
"""
from __future__ import annotations

import math
import mmap
import os
from typing import NoReturn

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFReader, GGUFValueType, Keys
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

from edge.core.errors import ConversionError

GGUF_MAGIC = b"GGUF"
GGML_MAX_DIMS = 4  # ggml.h; llama.cpp refuses a tensor with more dimensions
MAX_ARRAY_DEPTH = 4  # arrays of arrays; GGUFReader recurses once per level, llama.cpp reads none
# Keys plus array items, nested ones included: GGUFReader's memory and time grow with this count. The
# largest real vocabularies (262144 tokens, with scores and token types or merges) need under 10**6.
MAX_METADATA_VALUES = 2**21
MAX_TENSORS = 2**20  # real files hold a few thousand; each costs GGUFReader several numpy views

_SCALAR_SIZES = {value_type: np.dtype(numpy_type).itemsize
                 for value_type, numpy_type in GGUFReader.gguf_scalar_to_np.items()}
# The fewest bytes a value of each type takes: a string its length, an array its item type and count.
_MIN_SIZES = {**_SCALAR_SIZES, GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 4 + 8}
_MIN_KEY_SIZE = 8 + 4 + 1  # an empty name, the value type, a one-byte value
_MIN_TENSOR_SIZE = 8 + 4 + 4 + 8  # an empty name, n_dims, the GGML type, the data offset (no dimensions)
_SHOWN_NAME_BYTES = 120  # of a damaged name, in a message


def check_gguf(path: str) -> None:
    """Refuse, with a ConversionError naming the file and what it claims, a GGUF file whose header,
    metadata or tensor table does not fit its bytes; return quietly for a file GGUFReader can read."""
    name, size = os.path.basename(path), os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if head[:4] != GGUF_MAGIC:
            raise ConversionError(f"{name} is not a GGUF file: expected magic b'GGUF', found {head[:4]!r}")
        if len(head) < 8:
            raise ConversionError(f"{name} is truncated: {size} bytes, too short for a GGUF header")
        byteorder = "little"
        version = int.from_bytes(head[4:8], byteorder)
        if version & 0xFFFF == 0:  # written on a machine of the other byte order; GGUFReader swaps it
            byteorder = "big"
            version = int.from_bytes(head[4:8], byteorder)
        if version not in READER_SUPPORTED_VERSIONS:
            raise ConversionError(f"{name} is GGUF version {version}; supported GGUF versions: "
                                  f"{', '.join(str(v) for v in READER_SUPPORTED_VERSIONS)}")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            _Walk(data, name, byteorder).check()


class _Walk:
    def __init__(self, data: mmap.mmap, name: str, byteorder: str):
        self.data, self.name, self.byteorder = data, name, byteorder
        self.pos = 8  # after the magic and the version
        self.values = 0  # keys and array items read so far
        self.alignment = GGUF_DEFAULT_ALIGNMENT

    def refuse(self, finding: str) -> NoReturn:
        raise ConversionError(f"{self.name}: {finding}; the file is truncated or damaged, download or export it again")

    def skip(self, n_bytes: int, claim: str) -> None:
        """Step over `n_bytes`, which `claim` says come next."""
        left = len(self.data) - self.pos
        if n_bytes > left:
            self.refuse(f"{claim} but only {left} bytes follow")
        self.pos += n_bytes

    def uint(self, size: int, what: str) -> int:
        start = self.pos
        self.skip(size, f"{what} takes {size} bytes")
        return int.from_bytes(self.data[start:self.pos], self.byteorder)

    def text(self, what: str) -> str:
        """A string's text (shortened for messages), after checking its length against the file."""
        length = self.uint(8, f"the length of {what}")
        start = self.pos
        self.skip(length, f"{what} claims {length} bytes")
        shown = self.data[start:start + min(length, _SHOWN_NAME_BYTES)].decode("utf-8", errors="replace")
        return shown + ("…" if length > _SHOWN_NAME_BYTES else "")

    def value_type(self, key: str) -> GGUFValueType:
        raw = self.uint(4, f"the value type of metadata key {key!r}")
        if raw not in _MIN_SIZES:
            self.refuse(f"metadata key {key!r} has value type {raw}, which GGUF does not define")
        return GGUFValueType(raw)

    def check(self) -> None:
        n_tensors = self.uint(8, "the tensor count in the header")
        n_keys = self.uint(8, "the metadata key count in the header")
        left = len(self.data) - self.pos
        for count, what, least, limit in ((n_tensors, "tensors", _MIN_TENSOR_SIZE, MAX_TENSORS),
                                          (n_keys, "metadata keys", _MIN_KEY_SIZE, MAX_METADATA_VALUES)):
            if count * least > left:
                self.refuse(f"the header claims {count} {what} (at least {count * least} bytes) "
                            f"but only {left} bytes follow it")
            if count > limit:
                self.refuse(f"the header claims {count} {what}, more than the {limit} this reader accepts")
        self.values = n_keys
        for index in range(n_keys):
            self.key(self.text(f"the name of metadata key #{index}"))
        self.tensors([self.tensor_info(index) for index in range(n_tensors)])

    def key(self, key: str) -> None:
        value_type = self.value_type(key)
        if key != Keys.General.ALIGNMENT:
            self.value(key, value_type, depth=0)
            return
        if value_type != GGUFValueType.UINT32:  # as GGUFReader requires
            self.refuse(f"metadata key {key!r} is stored as {value_type.name}; expected a UINT32 power of two")
        alignment = self.uint(4, f"the value of metadata key {key!r}")
        if alignment == 0 or alignment & (alignment - 1):
            self.refuse(f"metadata key {key!r} is {alignment}; expected a power of two")
        self.alignment = alignment

    def value(self, key: str, value_type: GGUFValueType, depth: int) -> None:
        if value_type == GGUFValueType.STRING:
            length = self.uint(8, f"a string length in metadata key {key!r}")
            self.skip(length, f"metadata key {key!r} claims a string of {length} bytes")
        elif value_type == GGUFValueType.ARRAY:
            if depth == MAX_ARRAY_DEPTH:
                self.refuse(f"metadata key {key!r} nests arrays more than {MAX_ARRAY_DEPTH} deep")
            item_type = self.value_type(key)
            count = self.uint(8, f"the array length of metadata key {key!r}")
            fixed = item_type in _SCALAR_SIZES
            least = count * _MIN_SIZES[item_type]
            claim = f"metadata key {key!r} claims {count} {item_type.name} array items"
            if least > len(self.data) - self.pos:  # before walking the items: refused in constant time
                self.skip(least, f"{claim} ({'' if fixed else 'at least '}{least} bytes)")
            self.values += count
            if self.values > MAX_METADATA_VALUES:
                self.refuse(f"{claim}, which brings the metadata to {self.values} values (keys and array items), "
                            f"more than the {MAX_METADATA_VALUES} this reader accepts")
            if fixed:
                self.pos += least
            else:
                for _ in range(count):
                    self.value(key, item_type, depth + 1)
        else:
            self.skip(_SCALAR_SIZES[value_type], f"the {value_type.name} value of metadata key {key!r} "
                      f"takes {_SCALAR_SIZES[value_type]} bytes")

    def tensor_info(self, index: int) -> tuple[str, list[int], int, int]:
        """(name, GGUF dims innermost first, raw GGML type, data offset) of the index-th tensor."""
        name = self.text(f"the name of tensor #{index}")
        n_dims = self.uint(4, f"the dimension count of tensor {name!r}")
        if n_dims > GGML_MAX_DIMS:
            self.refuse(f"tensor {name!r} claims {n_dims} dimensions; a GGML tensor has at most {GGML_MAX_DIMS}")
        dims = [self.uint(8, f"dimension {axis} of tensor {name!r}") for axis in range(n_dims)]
        ggml_type = self.uint(4, f"the GGML type of tensor {name!r}")
        return name, dims, ggml_type, self.uint(8, f"the data offset of tensor {name!r}")

    def tensors(self, infos: list[tuple[str, list[int], int, int]]) -> None:
        """Each tensor's data lies inside the data section, aligned, and apart from the others'."""
        data_start = -(-self.pos // self.alignment) * self.alignment
        data_size = max(len(self.data) - data_start, 0)
        previous_name, previous_end = None, 0
        for name, dims, raw_type, offset in sorted(infos, key=lambda info: info[3]):
            if raw_type not in GGML_QUANT_SIZES:
                self.refuse(f"tensor {name!r} has GGML type {raw_type}, which the gguf package does not define")
            ggml_type = GGMLQuantizationType(raw_type)
            block_size, block_bytes = GGML_QUANT_SIZES[ggml_type]
            if 0 in dims:  # an empty axis would let the others claim any length for free
                self.refuse(f"tensor {name!r} has GGUF shape {dims}, with an empty dimension")
            row = dims[0] if dims else 1
            if row % block_size:
                self.refuse(f"tensor {name!r} ({ggml_type.name}) has rows of {row} values, not a multiple of "
                            f"its block size {block_size}")
            n_bytes = math.prod(dims) * block_bytes // block_size  # Python ints: no overflow
            if offset + n_bytes > data_size:
                self.refuse(f"tensor {name!r} ({ggml_type.name}, GGUF shape {dims}) claims {n_bytes} bytes at data "
                            f"offset {offset} but the data section holds only {data_size} bytes")
            if offset % self.alignment:
                raise ConversionError(
                    f"{self.name}: tensor {name!r} starts at data offset {offset}, not a multiple of the file's "
                    f"alignment {self.alignment}; the file is corrupt, download or export it again")
            if previous_name is not None and offset < previous_end:
                raise ConversionError(
                    f"{self.name}: the data of tensors {previous_name!r} and {name!r} overlap; the file is corrupt, "
                    "download or export it again")
            if offset + n_bytes > previous_end:
                previous_name, previous_end = name, offset + n_bytes
