"""Quantization formats: schemes, per-group INT8/INT4 packing, quantize and dequantize.

A weight matrix W is float32 [N, K]: N output rows, K input features. It is quantized
in groups of B = group_size consecutive elements along K (B is 32, 64 or 128). When K is
not a multiple of B the last group is padded with zeros; n_groups = ceil(K / B). Each
group has one scale (and, for affine schemes, one offset), both stored as float16, or as
float32 in the schemes named with "_f32scale": those hold the sub-block scales of GGUF's
K-quants (a float16 super-block scale times a 6-bit integer), which float16 cannot.

Arrays of a QuantizedTensor (the layout of ONNX Runtime `com.microsoft::MatMulNBits`):

    qweight  uint8   [N, n_groups, B * bits // 8]   the codes q, packed low-first
    scales   float16 [N, n_groups]                  (float32 with f32 scales)
    offsets  float16 [N, n_groups]                  affine schemes only, dtype of the scales

Packing of the codes inside one group (j counts bytes of the group):

    int8:  byte j holds code j.
    int4:  byte j holds code 2j in its LOW nibble and code 2j+1 in its HIGH nibble:
               byte j = q[2j] | (q[2j+1] << 4)
           (GGUF Q4_0/Q4_1 blocks order nibbles differently; gguf_import.py repacks them.)

Value of code q in a group with scale s (and offset o). The arithmetic is done in
float32 in exactly this order, because that order is what the gguf package uses and
is what makes GGUF import bit-exact:

    int4 symmetric:  w = s * (q - 8)      q in 0..15     (GGUF Q4_0; MatMulNBits default zero point 8)
    int8 symmetric:  w = s * (q - 128)    q in 0..255    (GGUF Q8_0 stored as q + 128;
                                                          MatMulNBits default zero point 128)
    int4 affine:     w = s * q + o        q in 0..15     (GGUF Q4_1)
    int8 affine:     w = s * q + o        q in 0..255

MatMulNBits writes the affine form as (q - z) * s with a float zero point z = -o / s;
an ONNX export converts (that conversion, unlike GGUF import, is not bit-exact).

How quantize() chooses scales and codes (per group x of B values):

    int4 symmetric (GGUF Q4_0 rule): m = the signed value of largest |x|, s = m / -8,
        so m lands exactly on code 0 and the whole range [-8, 7] steps is used on m's side.
    int8 symmetric (GGUF Q8_0 rule): s = max|x| / 127, codes clipped to 1..255
        (-127..127 steps) so the range is symmetric.
    affine: o = min(x), s = (max(x) - min(x)) / levels, levels = 15 or 255.

s and o are rounded to their stored dtype first and the codes are computed from the rounded values,
so storage rounding is absorbed by the choice of q. Codes round half to even. A group of
zeros gets s = 0 and the code of zero. Error per element is at most s/2 inside the
representable range; the one exception is int4 symmetric, whose range [-8s, 7s] is
lopsided, so a value of magnitude |m| on the side opposite m is off by up to |s|.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from edge.core.errors import CheckpointError, ConversionError
from quant import gguf_blocks

FLOAT_DTYPES = ("f32", "f16")
QUANTIZED_DTYPES = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = ("f16", "f32")

_BITS = {"f32": 32, "f16": 16, "int8": 8, "int4": 4}

# quantize() works through the rows in chunks of about this many elements, so that its
# float32 temporaries stay bounded (tens of MB) whatever the size of the matrix.
_ELEMENTS_PER_CHUNK = 1 << 22


# ---------------------------------------------------------------------------------------
# Schemes


@dataclass(frozen=True)
class Scheme:
    """How one tensor is stored: a float dtype, or INT8/INT4 in groups along K.

    str(scheme) is its name in zllm.json: "f32", "f16", "int4_sym_g32", "int8_affine_g128", and
    "int4_affine_g32_f32scale" for scales (and offsets) stored as float32.
    """

    dtype: str
    group_size: int | None = None
    symmetric: bool = True
    scale_dtype: str = "f16"

    def __post_init__(self) -> None:
        if self.dtype in FLOAT_DTYPES:
            if self.group_size is not None:
                raise ValueError(f"float scheme {self.dtype!r} takes no group size, got {self.group_size}")
            # Symmetry and scales mean nothing for floats; normalise them so equal schemes compare equal.
            object.__setattr__(self, "symmetric", True)
            object.__setattr__(self, "scale_dtype", "f16")
        elif self.dtype in QUANTIZED_DTYPES:
            if self.group_size not in GROUP_SIZES:
                raise ValueError(
                    f"{self.dtype} group size must be one of {GROUP_SIZES}, got {self.group_size}"
                )
            if self.scale_dtype not in SCALE_DTYPES:
                raise ValueError(f"scales are stored as one of {SCALE_DTYPES}, got {self.scale_dtype!r}")
        else:
            raise ValueError(f"unknown dtype {self.dtype!r}: expected one of {FLOAT_DTYPES + QUANTIZED_DTYPES}")

    def __str__(self) -> str:
        if not self.is_quantized:
            return self.dtype
        kind = "sym" if self.symmetric else "affine"
        wide = "_f32scale" if self.scale_dtype == "f32" else ""
        return f"{self.dtype}_{kind}_g{self.group_size}{wide}"

    @classmethod
    def parse(cls, text: str) -> Scheme:
        """Inverse of str(): "f16" -> Scheme("f16"), "int4_sym_g32" -> Scheme("int4", 32, True)."""
        if text in FLOAT_DTYPES:
            return cls(text)
        match = re.fullmatch(r"(int4|int8)_(sym|affine)_g(\d+)(_f32scale)?", text)
        if match is None:
            raise ValueError(
                f"unknown quantization scheme {text!r}: expected 'f32', 'f16' or "
                f"'int4|int8' + '_sym|_affine' + '_g32|_g64|_g128' (+ '_f32scale'), e.g. 'int4_sym_g32'"
            )
        dtype, kind, group_size, wide = match.groups()
        return cls(dtype, int(group_size), kind == "sym", "f32" if wide else "f16")

    @property
    def is_quantized(self) -> bool:
        return self.dtype in QUANTIZED_DTYPES

    @property
    def bits(self) -> int:
        return _BITS[self.dtype]

    @property
    def scale_numpy_dtype(self) -> np.dtype:
        """The dtype of the stored scales and offsets."""
        return np.dtype(np.float32 if self.scale_dtype == "f32" else np.float16)


# ---------------------------------------------------------------------------------------
# Code packing: one small class per code width, registered by bits.


class Int8Codes:
    """One code per byte; packing is the identity."""

    bits = 8

    @staticmethod
    def pack(codes: np.ndarray) -> np.ndarray:
        """uint8 [..., B] codes -> uint8 [..., B] bytes."""
        return codes

    @staticmethod
    def unpack(packed: np.ndarray) -> np.ndarray:
        return packed


class Int4Codes:
    """Two codes per byte: code 2j in the low nibble of byte j, code 2j+1 in the high nibble."""

    bits = 4

    @staticmethod
    def pack(codes: np.ndarray) -> np.ndarray:
        """uint8 [..., B] codes in 0..15 -> uint8 [..., B/2] bytes."""
        even, odd = codes[..., 0::2], codes[..., 1::2]
        return even | (odd << np.uint8(4))

    @staticmethod
    def unpack(packed: np.ndarray) -> np.ndarray:
        """uint8 [..., B/2] bytes -> uint8 [..., B] codes."""
        low = packed & np.uint8(0x0F)
        high = packed >> np.uint8(4)
        return np.stack([low, high], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


CODECS: dict[int, type[Int8Codes] | type[Int4Codes]] = {8: Int8Codes, 4: Int4Codes}


def symmetric_zero_point(bits: int) -> int:
    """The code that means 0 in a symmetric scheme: 8 for int4, 128 for int8 (MatMulNBits default)."""
    return 1 << (bits - 1)


# ---------------------------------------------------------------------------------------
# The format table: sizes of every format zllm stores or imports.


@dataclass(frozen=True)
class FormatInfo:
    """Sizes of one storage format. A block is the unit that carries its own scale."""

    name: str
    block_size: int  # elements per block
    bytes_per_block: int  # codes + scale + offset of one block
    bits: int  # bits per stored code (or per float)
    description: str

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.bytes_per_block / self.block_size


def _scheme_format(scheme: Scheme) -> FormatInfo:
    if not scheme.is_quantized:
        return FormatInfo(str(scheme), 1, scheme.bits // 8, scheme.bits, f"IEEE float{scheme.bits}")
    code_bytes = scheme.group_size * scheme.bits // 8
    scale_bytes, scale = scheme.scale_numpy_dtype.itemsize, scheme.scale_dtype
    if scheme.symmetric:
        zero = symmetric_zero_point(scheme.bits)
        return FormatInfo(
            str(scheme), scheme.group_size, code_bytes + scale_bytes, scheme.bits,
            f"{scale} scale s per {scheme.group_size}; w = s * (q - {zero})",
        )
    return FormatInfo(
        str(scheme), scheme.group_size, code_bytes + 2 * scale_bytes, scheme.bits,
        f"{scale} scale s and {scale} offset o per {scheme.group_size}; w = s * q + o",
    )


ALL_SCHEMES: tuple[Scheme, ...] = (
    Scheme("f32"),
    Scheme("f16"),
    *(
        Scheme(dtype, group_size, symmetric)
        for dtype in QUANTIZED_DTYPES
        for symmetric in (True, False)
        for group_size in GROUP_SIZES
    ),
)
# f32 scales exist for the K-quants, whose sub-blocks are 32 values: those are the schemes listed.
WIDE_SCALE_SCHEMES: tuple[Scheme, ...] = tuple(
    Scheme(dtype, 32, symmetric, "f32") for dtype in QUANTIZED_DTYPES for symmetric in (True, False))

# GGUF block types that import without requantization (gguf_import.py unpacks them; their layouts:
# gguf_blocks.py).
_GGUF_SOURCE_FORMATS = tuple(FormatInfo(f.name, f.block_size, f.block_bytes, f.bits, f"GGUF: {f.description}")
                             for f in (gguf_blocks.Q4_0, gguf_blocks.Q4_1, gguf_blocks.Q8_0, gguf_blocks.Q5_0,
                                       gguf_blocks.Q5_1, gguf_blocks.IQ4_NL, gguf_blocks.Q4_K,
                                       gguf_blocks.Q5_K, gguf_blocks.IQ4_XS))

FORMATS: dict[str, FormatInfo] = {
    info.name: info for info in (*map(_scheme_format, ALL_SCHEMES + WIDE_SCALE_SCHEMES), *_GGUF_SOURCE_FORMATS)
}


# ---------------------------------------------------------------------------------------
# Quantized tensors


class QuantizedArraysError(CheckpointError, ValueError):
    """Arrays do not have the shapes or dtypes that their scheme and logical shape require."""


@dataclass(eq=False, repr=False)
class QuantizedTensor:
    """A weight [N, K] stored as per-group codes and float16 (or float32) scales (layout: module docstring).

    The arrays may be read-only views of a memory-mapped checkpoint; nothing here writes them.
    """

    scheme: Scheme
    shape: tuple[int, int]  # logical (N, K)
    qweight: np.ndarray  # uint8 [N, n_groups, group_size * bits // 8]
    scales: np.ndarray  # float16 [N, n_groups] (float32 with f32 scales)
    offsets: np.ndarray | None = field(default=None)  # as scales, affine only

    def __post_init__(self) -> None:
        self.shape = tuple(int(dim) for dim in self.shape)
        _check_layout(self.scheme, self.shape, self.qweight, self.scales, self.offsets)

    def __repr__(self) -> str:
        return f"QuantizedTensor({self.scheme}, shape={self.shape}, nbytes={self.nbytes})"

    @property
    def n_groups(self) -> int:
        return self.qweight.shape[1]

    @property
    def nbytes(self) -> int:
        offset_bytes = 0 if self.offsets is None else self.offsets.nbytes
        return self.qweight.nbytes + self.scales.nbytes + offset_bytes

    def dequantize(self) -> np.ndarray:
        """float32 [N, K]."""
        return _dequantize(self.scheme, self.shape[1], self.qweight, self.scales, self.offsets)

    def dequantize_rows(self, rows: np.ndarray) -> np.ndarray:
        """float32 [*rows.shape, K]: only the requested rows (embedding lookup of token ids)."""
        rows = np.asarray(rows)
        flat_rows = rows.ravel()
        offsets = None if self.offsets is None else self.offsets[flat_rows]
        values = _dequantize(self.scheme, self.shape[1], self.qweight[flat_rows], self.scales[flat_rows], offsets)
        return values.reshape(*rows.shape, self.shape[1])

    def take_rows(self, rows) -> QuantizedTensor:
        """The tensor made of rows `rows` (a subset or permutation), codes and scales copied unchanged."""
        rows = np.asarray(rows, dtype=np.intp)
        if rows.ndim != 1:
            raise ValueError(f"take_rows expects a 1-D array of row indices, got shape {rows.shape}")
        offsets = None if self.offsets is None else self.offsets[rows]
        return QuantizedTensor(self.scheme, (len(rows), self.shape[1]), self.qweight[rows], self.scales[rows], offsets)

    def to_arrays(self, name: str) -> dict[str, np.ndarray]:
        """The arrays to store under `name`: name.qweight, name.scales and (affine) name.offsets."""
        arrays = {f"{name}.qweight": self.qweight, f"{name}.scales": self.scales}
        if self.offsets is not None:
            arrays[f"{name}.offsets"] = self.offsets
        return arrays

    @classmethod
    def from_arrays(
        cls, scheme: Scheme, shape: tuple[int, int], arrays: dict[str, np.ndarray], name: str
    ) -> QuantizedTensor:
        """Inverse of to_arrays. The arrays are used as they are (mmap views stay views)."""
        missing = [key for key in (f"{name}.qweight", f"{name}.scales") if key not in arrays]
        if not scheme.symmetric and f"{name}.offsets" not in arrays:
            missing.append(f"{name}.offsets")
        if missing:
            raise QuantizedArraysError(f"{name}: scheme {scheme} needs arrays {missing}, which are missing")
        if scheme.symmetric and f"{name}.offsets" in arrays:
            raise QuantizedArraysError(
                f"{name}: found {name}.offsets but scheme {scheme} is symmetric and has no offsets"
            )
        try:
            return cls(
                scheme, shape, arrays[f"{name}.qweight"], arrays[f"{name}.scales"], arrays.get(f"{name}.offsets")
            )
        except QuantizedArraysError as error:
            raise QuantizedArraysError(f"{name}: {error}") from None


def first_non_finite(values: np.ndarray) -> tuple[int, ...] | None:
    """The index of the first NaN or infinity in a float array, or None when every value is finite.

    A chunk at a time, so that the temporaries stay small whatever the array's size. float16 (every
    stored scale) is checked on its bits, an all-ones exponent: ten times faster than np.isfinite,
    which converts each value to float32 first, and loading checks every scale of a checkpoint."""
    values = np.asarray(values)
    flat = values.reshape(-1)
    for start in range(0, flat.size, _ELEMENTS_PER_CHUNK):
        chunk = flat[start:start + _ELEMENTS_PER_CHUNK]
        if chunk.dtype == np.float16:
            finite = (chunk.view(np.uint16) & 0x7FFF).max() < 0x7C00
        else:
            finite = np.isfinite(chunk).all()
        if not finite:
            first = start + int(np.argmin(np.isfinite(chunk)))
            return tuple(int(i) for i in np.unravel_index(first, values.shape))
    return None


def describe_non_finite(tensor: QuantizedTensor | np.ndarray) -> str | None:
    """Where a tensor's first NaN or infinity is: "scale (nan) at row 3, group 0" for a quantized tensor
    (its scales and offsets; its codes are integers, so with finite scales every value is finite),
    "value (inf) at index [3, 5]" for a float one; None when there is none."""
    if isinstance(tensor, QuantizedTensor):
        for role, array in (("scale", tensor.scales), ("offset", tensor.offsets)):
            where = None if array is None else first_non_finite(array)
            if where is not None:
                return f"{role} ({array[where]}) at row {where[0]}, group {where[1]}"
        return None
    where = first_non_finite(tensor)
    return None if where is None else f"value ({tensor[where]}) at index {list(where)}"


def _check_layout(
    scheme: Scheme, shape: tuple[int, ...], qweight: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None
) -> None:
    if not scheme.is_quantized:
        raise QuantizedArraysError(f"scheme {scheme} is not quantized; a float tensor is a plain array")
    if len(shape) != 2 or shape[0] < 0 or shape[1] < 1:
        raise QuantizedArraysError(f"logical shape must be (N, K) with K >= 1, got {shape}")
    n_rows, k = shape
    n_groups = math.ceil(k / scheme.group_size)
    expected = {
        "qweight": (np.dtype(np.uint8), (n_rows, n_groups, scheme.group_size * scheme.bits // 8)),
        "scales": (scheme.scale_numpy_dtype, (n_rows, n_groups)),
    }
    found = {"qweight": qweight, "scales": scales}
    if scheme.symmetric:
        if offsets is not None:
            raise QuantizedArraysError(f"scheme {scheme} is symmetric but offsets were given")
    else:
        if offsets is None:
            raise QuantizedArraysError(f"scheme {scheme} is affine and needs offsets")
        expected["offsets"] = expected["scales"]
        found["offsets"] = offsets
    for role, (dtype, array_shape) in expected.items():
        array = found[role]
        if not isinstance(array, np.ndarray) or array.dtype != dtype or array.shape != array_shape:
            what = f"{array.dtype}{list(array.shape)}" if isinstance(array, np.ndarray) else type(array).__name__
            raise QuantizedArraysError(
                f"{role} is {what}, expected {dtype}{list(array_shape)} for {scheme} weight of shape {tuple(shape)}"
            )


# ---------------------------------------------------------------------------------------
# Quantize / dequantize


def quantize(weight: np.ndarray, scheme: Scheme) -> QuantizedTensor:
    """Quantize float weight [N, K] to `scheme` (rules in the module docstring)."""
    if not scheme.is_quantized:
        raise ValueError(
            f"quantize() needs an int4/int8 scheme, got {scheme}; store float weights as arrays "
            f"(weight.astype(np.float16))"
        )
    weight = np.asarray(weight)
    if weight.ndim != 2 or weight.shape[1] == 0:
        raise ValueError(f"quantize() expects a 2-D weight [N, K] with K >= 1, got shape {weight.shape}")
    n_rows, k = weight.shape
    group_size, bits = scheme.group_size, scheme.bits
    n_groups = math.ceil(k / group_size)

    qweight = np.empty((n_rows, n_groups, group_size * bits // 8), dtype=np.uint8)
    scales = np.empty((n_rows, n_groups), dtype=scheme.scale_numpy_dtype)
    offsets = None if scheme.symmetric else np.empty((n_rows, n_groups), dtype=scheme.scale_numpy_dtype)

    rows_per_chunk = max(1, _ELEMENTS_PER_CHUNK // k)
    for start in range(0, n_rows, rows_per_chunk):
        chunk = slice(start, start + rows_per_chunk)
        groups = _split_into_groups(weight[chunk], group_size, first_row=start)  # [n, G, B]
        if scheme.symmetric:
            scales[chunk], codes = _quantize_symmetric(groups, bits, scales.dtype)
        else:
            scales[chunk], offsets[chunk], codes = _quantize_affine(groups, bits, scales.dtype)
        qweight[chunk] = CODECS[bits].pack(codes)
    return QuantizedTensor(scheme, (n_rows, k), qweight, scales, offsets)


def dequantize(qt: QuantizedTensor | np.ndarray) -> np.ndarray:
    """float32 values of a QuantizedTensor; a float array is returned as float32 unchanged."""
    if isinstance(qt, QuantizedTensor):
        return qt.dequantize()
    return np.asarray(qt).astype(np.float32, copy=False)


def _split_into_groups(rows: np.ndarray, group_size: int, first_row: int) -> np.ndarray:
    """float [n, K] -> float32 [n, n_groups, group_size], the last group padded with zeros."""
    n_rows, k = rows.shape
    n_groups = math.ceil(k / group_size)
    padded = np.zeros((n_rows, n_groups * group_size), dtype=np.float32)
    padded[:, :k] = rows
    if not np.isfinite(padded).all():
        row, column = np.argwhere(~np.isfinite(padded))[0]
        raise ConversionError(
            f"weight holds a non-finite value ({padded[row, column]}) at row {first_row + row}, "
            f"column {column}; a quantized format cannot store it"
        )
    return padded.reshape(n_rows, n_groups, group_size)


def _quantize_symmetric(groups: np.ndarray, bits: int, scale_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """float32 [n, G, B] -> (scales [n, G] of scale_dtype, uint8 codes [n, G, B])."""
    zero_point = symmetric_zero_point(bits)
    if bits == 4:
        # GGUF Q4_0: the extreme value maps onto code 0, i.e. -8 steps.
        extreme_index = np.abs(groups).argmax(axis=-1, keepdims=True)
        extreme = np.take_along_axis(groups, extreme_index, axis=-1)[..., 0]
        scales = _to_scale_dtype(extreme / -8, scale_dtype, "group scale")
        lowest_code, highest_code = 0, 15
    else:
        # GGUF Q8_0: +-127 steps; code 0 (-128 steps) is left unused so the range is symmetric.
        scales = _to_scale_dtype(np.abs(groups).max(axis=-1) / 127, scale_dtype, "group scale")
        lowest_code, highest_code = 1, 255
    steps = _divide_or_zero(groups, scales.astype(np.float32)[..., None])
    codes = np.clip(np.rint(steps) + zero_point, lowest_code, highest_code).astype(np.uint8)
    return scales, codes


def _quantize_affine(groups: np.ndarray, bits: int, scale_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 [n, G, B] -> (scales [n, G], offsets [n, G], both of scale_dtype, uint8 codes [n, G, B])."""
    levels = (1 << bits) - 1
    low, high = groups.min(axis=-1), groups.max(axis=-1)
    offsets = _to_scale_dtype(low, scale_dtype, "group minimum")
    scales = _to_scale_dtype((high - low) / levels, scale_dtype, "group scale")
    steps = _divide_or_zero(groups - offsets.astype(np.float32)[..., None], scales.astype(np.float32)[..., None])
    codes = np.clip(np.rint(steps), 0, levels).astype(np.uint8)
    return scales, offsets, codes


def _to_scale_dtype(values: np.ndarray, scale_dtype: np.dtype, what: str) -> np.ndarray:
    if scale_dtype == np.float32:
        return values.astype(np.float32)  # the values come from float32 groups: finite
    with np.errstate(over="ignore"):
        rounded = values.astype(np.float16)
    if not np.isfinite(rounded).all():
        largest = np.abs(values).max()
        raise ConversionError(
            f"a {what} of magnitude {largest:.6g} exceeds the float16 range (65504) of stored "
            f"scales/offsets; this weight cannot be quantized, keep it as f32"
        )
    return rounded


def _divide_or_zero(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """numerator / denominator, and 0 where the denominator is 0 (a group of equal values)."""
    quotient = np.zeros(np.broadcast_shapes(numerator.shape, denominator.shape), dtype=np.float32)
    np.divide(numerator, denominator, out=quotient, where=denominator != 0)
    return quotient


def _dequantize(
    scheme: Scheme, k: int, qweight: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None
) -> np.ndarray:
    """uint8 qweight [n, G, bytes] + scales (+ offsets) -> float32 [n, K]."""
    codes = CODECS[scheme.bits].unpack(qweight).astype(np.float32)  # [n, G, B]
    if scheme.symmetric:
        zero_point = np.float32(symmetric_zero_point(scheme.bits))
        values = scales.astype(np.float32)[..., None] * (codes - zero_point)
    else:
        values = scales.astype(np.float32)[..., None] * codes + offsets.astype(np.float32)[..., None]
    n_rows = qweight.shape[0]
    values = values.reshape(n_rows, -1)
    if values.shape[1] == k:
        return values
    return np.ascontiguousarray(values[:, :k])  # drop the zero padding of the last group
