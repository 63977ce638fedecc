"""GGUF tensors in, zllm quantized tensors (or float32 arrays) out.

Six GGUF block types map onto a zllm scheme exactly, so they are repacked without
requantization; dequantizing the result gives the values gguf.quants.dequantize gives,
bit for bit. All six use blocks of 32 elements along K with a float16 scale d first
(little-endian, as every GGUF field; layouts in gguf_blocks.py):

    Q4_0  18 bytes: d f16 | qs[16]          element i in the low nibble of qs[i],
                                            element i+16 in the high nibble;  w = d * (q - 8)
          -> int4_sym_g32: same d and q, nibbles reordered to zllm's pairwise layout
             (code 2j low, code 2j+1 high in byte j).
    Q4_1  20 bytes: d f16 | m f16 | qs[16]  nibbles as Q4_0;                  w = d * q + m
          -> int4_affine_g32: scale d, offset m, nibbles reordered.
    Q8_0  34 bytes: d f16 | qs[32] int8                                       w = d * q
          -> int8_sym_g32: scale d, code q + 128 (so w = d * (code - 128)). GGUF allows
             q = -128, which becomes code 0; zllm's own quantizer never emits code 0.
    Q5_0  22 bytes: d f16 | qh u32 | qs[16] 5-bit q                           w = d * (q - 16)
          -> int8_sym_g32: scale d, code q + 112 (w = d * (code - 128)).
    Q5_1  24 bytes: d f16 | m f16 | qh u32 | qs[16]                          w = d * q + m
          -> int8_affine_g32: scale d, offset m, code q.
    IQ4_NL 18 bytes: d f16 | qs[16] nibbles indexing a table of 16 int8 values w = d * table[q]
          -> int8_sym_g32: scale d, code table[q] + 128.

Three super-block types of 256 elements have sub-blocks of 32 whose scale (and minimum) is a
float16 times a 6-bit integer: exact in float32, not in float16. They become schemes with float32
scales (offsets), sub-block for group:

    Q4_K  144 bytes: d, dmin f16 | 12 B 6-bit scales sc and mins m | 128 B nibbles
                                                            w = (d * sc) * q - dmin * m
          -> int4_affine_g32_f32scale: scale d * sc, offset -(dmin * m), code q.
    Q5_K  176 bytes: as Q4_K plus 32 B of fifth bits        q in 0..31
          -> int8_affine_g32_f32scale: the same scale and offset, code q.
    IQ4_XS 136 bytes: d f16 | 6-bit scales ls | nibbles indexing the IQ4_NL table
                                                            w = (d * (ls - 32)) * table[q]
          -> int8_sym_g32_f32scale: scale d * (ls - 32), code table[q] + 128.

Every other quantized type (Q6_K, Q2_K, Q3_K: sub-blocks of 16 values, ...) is dequantized to
float32 with gguf.quants and must be requantized by the caller. F32/F16/BF16 tensors and
1-D tensors (norm weights) come back as float32 arrays.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from edge.core.errors import ConversionError
from quant import gguf_blocks
from quant.formats import CODECS, FORMATS, FormatInfo, QuantizedTensor, Scheme


def _float16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """The little-endian float16 at byte `start` of every block: uint8 [..., bytes] -> float16 [...]."""
    field_bytes = np.ascontiguousarray(blocks[..., start : start + 2])
    return field_bytes.view("<f2")[..., 0].astype(np.float16)


def _ggml_nibbles_to_codes(qs: np.ndarray) -> np.ndarray:
    """uint8 [..., 16] in GGML order (element i low nibble, i+16 high) -> codes uint8 [..., 32]."""
    first_half = qs & np.uint8(0x0F)
    second_half = qs >> np.uint8(4)
    return np.concatenate([first_half, second_half], axis=-1)


class Q4_0Blocks:
    ggml_type = GGMLQuantizationType.Q4_0
    info: FormatInfo = FORMATS["Q4_0"]
    scheme = Scheme("int4", 32, symmetric=True)

    @staticmethod
    def split(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
        """uint8 [N, G, 18] -> (codes uint8 [N, G, 32], scales float16 [N, G], no offsets)."""
        return _ggml_nibbles_to_codes(blocks[..., 2:]), _float16_field(blocks, 0), None


class Q4_1Blocks:
    ggml_type = GGMLQuantizationType.Q4_1
    info: FormatInfo = FORMATS["Q4_1"]
    scheme = Scheme("int4", 32, symmetric=False)

    @staticmethod
    def split(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """uint8 [N, G, 20] -> (codes uint8 [N, G, 32], scales float16 [N, G], offsets float16 [N, G])."""
        return _ggml_nibbles_to_codes(blocks[..., 4:]), _float16_field(blocks, 0), _float16_field(blocks, 2)


class Q8_0Blocks:
    ggml_type = GGMLQuantizationType.Q8_0
    info: FormatInfo = FORMATS["Q8_0"]
    scheme = Scheme("int8", 32, symmetric=True)

    @staticmethod
    def split(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
        """uint8 [N, G, 34] -> (codes uint8 [N, G, 32], scales float16 [N, G], no offsets)."""
        signed = blocks[..., 2:].view(np.int8).astype(np.int16)
        codes = (signed + 128).astype(np.uint8)  # zero point 128: w = d * (code - 128)
        return codes, _float16_field(blocks, 0), None


def _int8_codes(block_format: type[gguf_blocks.BlockFormat], blocks: np.ndarray, zero_point: int) -> np.ndarray:
    """uint8 [N, G, bytes] of a 32-value block format whose unpacked values v fit int8 codes v + zero_point
    -> codes uint8 [N, G, 32]."""
    values = block_format.unpack(blocks).values + zero_point
    return values.astype(np.uint8).reshape(blocks.shape[:-1] + (32,))


class Q5_0Blocks:
    ggml_type = GGMLQuantizationType.Q5_0
    info: FormatInfo = FORMATS["Q5_0"]
    scheme = Scheme("int8", 32, symmetric=True)

    @staticmethod
    def split(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
        """uint8 [N, G, 22] -> (codes uint8 [N, G, 32], scales float16 [N, G], no offsets)."""
        return _int8_codes(gguf_blocks.Q5_0, blocks, 128), _float16_field(blocks, 0), None  # values q - 16


class Q5_1Blocks:
    ggml_type = GGMLQuantizationType.Q5_1
    info: FormatInfo = FORMATS["Q5_1"]
    scheme = Scheme("int8", 32, symmetric=False)

    @staticmethod
    def split(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """uint8 [N, G, 24] -> (codes uint8 [N, G, 32], scales float16 [N, G], offsets float16 [N, G])."""
        return _int8_codes(gguf_blocks.Q5_1, blocks, 0), _float16_field(blocks, 0), _float16_field(blocks, 2)


class IQ4_NLBlocks:
    ggml_type = GGMLQuantizationType.IQ4_NL
    info: FormatInfo = FORMATS["IQ4_NL"]
    scheme = Scheme("int8", 32, symmetric=True)

    @staticmethod
    def split(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
        """uint8 [N, G, 18] -> (codes uint8 [N, G, 32], scales float16 [N, G], no offsets)."""
        # values table[q] in [-127, 113]
        return _int8_codes(gguf_blocks.IQ4_NL, blocks, 128), _float16_field(blocks, 0), None


class _SuperBlocks:
    """A super-block type whose unpacked values fit the codes of `scheme` as v + zero_point, with float32
    sub-block scales (and offsets) of 32 values (gguf_blocks.Unpacked)."""
    block_format: type[gguf_blocks.BlockFormat]
    zero_point: int

    @classmethod
    def split(cls, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """uint8 [N, B, bytes] -> (codes uint8 [N, 8B, 32], scales float32 [N, 8B], offsets float32 or None)."""
        unpacked = cls.block_format.unpack(blocks)
        n_rows, n_groups = unpacked.scales.shape
        codes = (unpacked.values + cls.zero_point).astype(np.uint8).reshape(n_rows, n_groups, 32)
        return codes, unpacked.scales, unpacked.offsets


class Q4_KBlocks(_SuperBlocks):
    ggml_type = GGMLQuantizationType.Q4_K
    info: FormatInfo = FORMATS["Q4_K"]
    scheme = Scheme("int4", 32, symmetric=False, scale_dtype="f32")
    block_format, zero_point = gguf_blocks.Q4_K, 0


class Q5_KBlocks(_SuperBlocks):
    ggml_type = GGMLQuantizationType.Q5_K
    info: FormatInfo = FORMATS["Q5_K"]
    scheme = Scheme("int8", 32, symmetric=False, scale_dtype="f32")
    block_format, zero_point = gguf_blocks.Q5_K, 0


class IQ4_XSBlocks(_SuperBlocks):
    ggml_type = GGMLQuantizationType.IQ4_XS
    info: FormatInfo = FORMATS["IQ4_XS"]
    scheme = Scheme("int8", 32, symmetric=True, scale_dtype="f32")
    block_format, zero_point = gguf_blocks.IQ4_XS, 128  # values table[q] in [-127, 113]


LOSSLESS_BLOCKS = {blocks.ggml_type: blocks
                   for blocks in (Q4_0Blocks, Q4_1Blocks, Q8_0Blocks, Q5_0Blocks, Q5_1Blocks, IQ4_NLBlocks,
                                  Q4_KBlocks, Q5_KBlocks, IQ4_XSBlocks)}


def is_lossless_gguf_type(ggml_type) -> bool:
    """True when a 2-D tensor of this type imports as a QuantizedTensor with identical values."""
    try:
        return GGMLQuantizationType(ggml_type) in LOSSLESS_BLOCKS
    except ValueError:
        return False


def from_gguf(raw: np.ndarray, ggml_type, shape: tuple[int, ...]) -> QuantizedTensor | np.ndarray:
    """Import one GGUF tensor.

    raw: GGUFReader(...).tensors[i].data (uint8 [N, bytes_per_row] for quantized types).
    shape: the logical numpy shape, i.e. the GGUF ne reversed: (N, K) for a matrix.
    Returns a QuantizedTensor for 2-D Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/IQ4_NL/Q4_K/Q5_K/IQ4_XS, a float32 array
    otherwise.
    """
    try:
        ggml_type = GGMLQuantizationType(ggml_type)
    except ValueError:
        raise ConversionError(f"unknown GGML tensor type {ggml_type!r}; this gguf package does not define it") from None
    shape = tuple(int(dim) for dim in shape)
    blocks_format = LOSSLESS_BLOCKS.get(ggml_type)
    if blocks_format is None or len(shape) == 1:
        return _dequantize_to_float(raw, ggml_type, shape)
    if len(shape) != 2:
        raise ConversionError(
            f"GGUF {ggml_type.name} tensor of shape {shape}: only 2-D matrices import as quantized "
            f"tensors; import a stacked tensor one matrix at a time, e.g. from_gguf(raw[e], ggml_type, shape[1:])"
        )
    return _repack(raw, blocks_format, shape)


def _repack(raw: np.ndarray, blocks_format, shape: tuple[int, int]) -> QuantizedTensor:
    n_rows, k = shape
    info = blocks_format.info
    if k % info.block_size != 0:
        raise ConversionError(f"GGUF {info.name} row length {k} is not a multiple of its block size {info.block_size}")
    n_blocks = k // info.block_size
    raw = np.asarray(raw).view(np.uint8)
    if raw.size != n_rows * n_blocks * info.bytes_per_block:
        raise ConversionError(
            f"GGUF {info.name} tensor of shape {shape} needs {n_rows * n_blocks * info.bytes_per_block} bytes, "
            f"got {raw.size}"
        )
    blocks = raw.reshape(n_rows, n_blocks, info.bytes_per_block)
    codes, scales, offsets = blocks_format.split(blocks)
    qweight = CODECS[blocks_format.scheme.bits].pack(codes)
    return QuantizedTensor(blocks_format.scheme, shape, qweight, scales, offsets)


def _dequantize_to_float(raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    try:
        values = gguf_quants.dequantize(np.asarray(raw), ggml_type)
    except NotImplementedError:
        raise ConversionError(
            f"GGUF tensor type {ggml_type.name} is not supported: the gguf package cannot dequantize it"
        ) from None
    values = np.asarray(values).astype(np.float32, copy=False)
    if values.size != int(np.prod(shape)):
        raise ConversionError(
            f"GGUF {ggml_type.name} tensor holds {values.size} values but its shape {shape} needs {int(np.prod(shape))}"
        )
    return values.reshape(shape)
