"""GGUF block formats as they are stored: layout, unpacking and dequantization, bit for bit.

Every GGUF block type here stores a run of `block_size` values along K in `block_bytes` bytes. Each
one unpacks into the same three things: integer values v (one per element), and per sub-block of
`sub_block` elements a float32 scale s and, for the types with a minimum, a float32 offset o; then

    w = s * v + o        (or w = s * v)

in float32, the product rounded first, as gguf.quants.dequantize computes it. Every s and o is a
float16 super-block scale times a small integer, which float32 holds exactly, so unpacking loses
nothing and the one product (and one sum) is the only rounding: the result equals the `gguf`
package's dequantization bit for bit (tests/test_gguf_blocks.py, on random blocks of every type).

    type    block  bytes  sub-block  fields (little-endian)                                    v
    Q4_0       32     18         32  d f16, 16 B nibbles (element i low, i+16 high)             q - 8
    Q4_1       32     20         32  d f16, m f16, 16 B nibbles                                 q (o = m)
    Q5_0       32     22         32  d f16, qh u32 (5th bit of element i: bit i), 16 B nibbles  q - 16
    Q5_1       32     24         32  d f16, m f16, qh u32, 16 B nibbles                         q (o = m)
    Q8_0       32     34         32  d f16, 32 int8                                             q
    Q2_K      256     84         16  16 B scale|min nibbles, 64 B 2-bit q, d f16, dmin f16      q (o = -dmin m)
    Q3_K      256    110         16  32 B high-bit mask, 64 B 2-bit q, 12 B 6-bit scales, d f16 q - 4 (mask 0)
    Q4_K      256    144         32  d f16, dmin f16, 12 B 6-bit scales and mins, 128 B nibbles q (o = -dmin m)
    Q5_K      256    176         32  d f16, dmin f16, 12 B scales/mins, 32 B high bits, 128 B   q (o = -dmin m)
    Q6_K      256    210         16  128 B low nibbles, 64 B high 2 bits, 16 int8 scales, d f16 q - 32
    IQ4_NL     32     18         32  d f16, 16 B nibbles indexing a 16-value table              table[q]
    IQ4_XS    256    136         32  d f16, 2 B high scale bits, 4 B low scale nibbles, 128 B   table[q]

(a K-quant's sub-block scale is d times its 4- or 6-bit scale; Q3_K's, IQ4_XS's and Q6_K's scales
are signed.) Layouts follow ggml (ggml-common.h) and the gguf package (gguf/quants.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256  # a K-quant super-block
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int16)


@dataclass(frozen=True)
class Unpacked:
    """A tensor's blocks unpacked: w[..., j] = scales[..., j // sub_block] * values[..., j] (+ offsets)."""
    values: np.ndarray           # int16 [..., n_blocks * block_size]
    scales: np.ndarray           # float32 [..., n_blocks * block_size / sub_block]
    offsets: np.ndarray | None   # float32, as scales; None for the types without a minimum
    sub_block: int

    def dequantize(self) -> np.ndarray:
        """float32 [..., n_blocks * block_size]."""
        shape = self.values.shape
        grouped = self.values.reshape(shape[:-1] + (-1, self.sub_block)).astype(np.float32)
        w = self.scales[..., None] * grouped
        if self.offsets is not None:
            w = w + self.offsets[..., None]
        return w.reshape(shape)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, as float32: uint8 [..., B] -> float32 [..., 1]."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """Bytes [..., n] holding runs of `run` low nibbles then the same bytes' high nibbles (ggml's
    order: element i of a 2*run run in the low nibble of byte i, element i + run in the high one)."""
    grouped = qs.reshape(qs.shape[:-1] + (-1, 1, run))
    return (grouped >> np.array([0, 4], np.uint8).reshape(2, 1) & 0x0F).reshape(qs.shape[:-1] + (-1,))


def _bits(packed: np.ndarray, run: int, width: int) -> np.ndarray:
    """Bytes [..., n] whose `width`-bit fields, lowest first, hold consecutive runs of `run` elements
    (field f of byte i is element f * run + i of its 8 / width * run group)."""
    shifts = np.arange(0, 8, width, dtype=np.uint8).reshape(-1, 1)
    grouped = packed.reshape(packed.shape[:-1] + (-1, 1, run))
    return (grouped >> shifts & ((1 << width) - 1)).reshape(packed.shape[:-1] + (-1,))


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    grouped = packed.reshape(packed.shape[:-1] + (3, 4))
    d, m, m_d = grouped[..., 0, :], grouped[..., 1, :], grouped[..., 2, :]
    scales = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales, mins


def _k_scales_offsets(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 8 sub-block scales d * sc and offsets -dmin * m, flat: float32 [..., n_blocks * 8]."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = _k_scales_mins(blocks[..., 4:16])
    return _flat(d * scales.astype(np.float32)), _flat(-(dmin * mins.astype(np.float32)))


def _flat(array: np.ndarray) -> np.ndarray:
    """[..., n_blocks, k] -> [..., n_blocks * k]."""
    return array.reshape(array.shape[:-2] + (-1,))


class BlockFormat:
    name: str
    block_size: int     # values per block
    block_bytes: int
    bits: int           # per stored code
    float16_fields: tuple[int, ...]  # byte offsets of the block's float16 scales
    description: str

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Unpacked:
        """uint8 [..., n_blocks, block_bytes] -> Unpacked over [..., n_blocks * block_size]."""
        raise NotImplementedError

    @classmethod
    def dequantize(cls, blocks: np.ndarray) -> np.ndarray:
        return cls.unpack(blocks).dequantize()


class Q4_0(BlockFormat):
    name, block_size, block_bytes, bits = "Q4_0", 32, 18, 4
    float16_fields = (0,)
    description = "f16 d, 16 bytes of nibbles (element i low, i+16 high); w = d * (q - 8)"

    @classmethod
    def unpack(cls, blocks):
        values = _nibbles(blocks[..., 2:], 16).astype(np.int16) - 8
        return Unpacked(_flat(values), _flat(_f16(blocks, 0)), None, 32)


class Q4_1(BlockFormat):
    name, block_size, block_bytes, bits = "Q4_1", 32, 20, 4
    float16_fields = (0, 2)
    description = "f16 d, f16 m, 16 bytes of nibbles (element i low, i+16 high); w = d * q + m"

    @classmethod
    def unpack(cls, blocks):
        values = _nibbles(blocks[..., 4:], 16).astype(np.int16)
        return Unpacked(_flat(values), _flat(_f16(blocks, 0)), _flat(_f16(blocks, 2)), 32)


def _fifth_bits(blocks: np.ndarray, start: int) -> np.ndarray:
    """Q5_0/Q5_1's u32 of fifth bits at byte `start`: bit i is element i's -> uint8 [..., 32]."""
    qh = np.ascontiguousarray(blocks[..., start:start + 4]).view("<u4")
    return ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


class Q5_0(BlockFormat):
    name, block_size, block_bytes, bits = "Q5_0", 32, 22, 5
    float16_fields = (0,)
    description = "d f16, u32 fifth bits, nibbles; w = d * (q - 16)"

    @classmethod
    def unpack(cls, blocks):
        q = _nibbles(blocks[..., 6:], 16) | (_fifth_bits(blocks, 2) << 4)
        return Unpacked(_flat(q.astype(np.int16) - 16), _flat(_f16(blocks, 0)), None, 32)


class Q5_1(BlockFormat):
    name, block_size, block_bytes, bits = "Q5_1", 32, 24, 5
    float16_fields = (0, 2)
    description = "d f16, m f16, u32 fifth bits, nibbles; w = d * q + m"

    @classmethod
    def unpack(cls, blocks):
        q = _nibbles(blocks[..., 8:], 16) | (_fifth_bits(blocks, 4) << 4)
        return Unpacked(_flat(q.astype(np.int16)), _flat(_f16(blocks, 0)), _flat(_f16(blocks, 2)), 32)


class Q8_0(BlockFormat):
    name, block_size, block_bytes, bits = "Q8_0", 32, 34, 8
    float16_fields = (0,)
    description = "f16 d, 32 int8 q; w = d * q"

    @classmethod
    def unpack(cls, blocks):
        values = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).astype(np.int16)
        return Unpacked(_flat(values), _flat(_f16(blocks, 0)), None, 32)


class Q2_K(BlockFormat):
    name, block_size, block_bytes, bits = "Q2_K", QK_K, 84, 2
    float16_fields = (80, 82)
    description = "16 scale|min nibbles, 2-bit q, d f16, dmin f16; w = d sc * q - dmin m per 16"

    @classmethod
    def unpack(cls, blocks):
        packed = blocks[..., :16]
        d, dmin = _f16(blocks, 80), _f16(blocks, 82)
        values = _bits(blocks[..., 16:80], 32, 2).astype(np.int16)
        scales = d * (packed & 0x0F).astype(np.float32)
        offsets = -(dmin * (packed >> 4).astype(np.float32))
        return Unpacked(_flat(values), _flat(scales), _flat(offsets), 16)


class Q3_K(BlockFormat):
    name, block_size, block_bytes, bits = "Q3_K", QK_K, 110, 3
    float16_fields = (108,)
    description = "high-bit mask, 2-bit q, 6-bit signed scales, d f16; w = d (sc - 32) * (q - 4 [mask 0]) per 16"

    @classmethod
    def unpack(cls, blocks):
        d = _f16(blocks, 108)
        low = _bits(blocks[..., 32:96], 32, 2).astype(np.int16)
        high = _bits(blocks[..., :32], 32, 1).astype(np.int16)
        packed = blocks[..., 96:108]
        low_scales = _nibbles(packed[..., :8], 8)
        high_scales = _bits(packed[..., 8:12], 4, 2)
        scales = ((low_scales | (high_scales << 4)).astype(np.int16) - 32).astype(np.float32)
        return Unpacked(_flat(low - 4 * (1 - high)), _flat(d * scales), None, 16)


class Q4_K(BlockFormat):
    name, block_size, block_bytes, bits = "Q4_K", QK_K, 144, 4
    float16_fields = (0, 2)
    description = "d f16, dmin f16, 6-bit scales and mins, nibbles; w = d sc * q - dmin m per 32"

    @classmethod
    def unpack(cls, blocks):
        values = _nibbles(blocks[..., 16:], 32).astype(np.int16)
        return Unpacked(_flat(values), *_k_scales_offsets(blocks), 32)


class Q5_K(BlockFormat):
    name, block_size, block_bytes, bits = "Q5_K", QK_K, 176, 5
    float16_fields = (0, 2)
    description = "d f16, dmin f16, 6-bit scales and mins, 32 B fifth bits, nibbles; w = d sc * q - dmin m per 32"

    @classmethod
    def unpack(cls, blocks):
        low = _nibbles(blocks[..., 48:], 32)
        high = _bits(blocks[..., 16:48], 32, 1)
        values = (low | (high << 4)).astype(np.int16)
        return Unpacked(_flat(values), *_k_scales_offsets(blocks), 32)


class Q6_K(BlockFormat):
    name, block_size, block_bytes, bits = "Q6_K", QK_K, 210, 6
    float16_fields = (208,)
    description = "low nibbles, high 2 bits, 16 int8 scales, d f16; w = d sc * (q - 32) per 16"

    @classmethod
    def unpack(cls, blocks):
        d = _f16(blocks, 208)
        low = _nibbles(blocks[..., :128], 64)
        high = _bits(blocks[..., 128:192], 32, 2)
        values = (low | (high << 4)).astype(np.int16) - 32
        scales = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
        return Unpacked(_flat(values), _flat(d * scales), None, 16)


class IQ4_NL(BlockFormat):
    name, block_size, block_bytes, bits = "IQ4_NL", 32, 18, 4
    float16_fields = (0,)
    description = "d f16, nibbles indexing a 16-value table; w = d * table[q]"

    @classmethod
    def unpack(cls, blocks):
        values = IQ4_VALUES[_nibbles(blocks[..., 2:], 16)]
        return Unpacked(_flat(values), _flat(_f16(blocks, 0)), None, 32)


class IQ4_XS(BlockFormat):
    name, block_size, block_bytes, bits = "IQ4_XS", QK_K, 136, 4
    float16_fields = (0,)
    description = "d f16, 6-bit signed scales, nibbles indexing a 16-value table; w = d (sc - 32) * table[q] per 32"

    @classmethod
    def unpack(cls, blocks):
        d = _f16(blocks, 0)
        high_bits = np.ascontiguousarray(blocks[..., 2:4]).view("<u2")
        high = ((high_bits >> np.arange(0, 16, 2, dtype=np.uint16)) & 3).astype(np.uint8)
        low = _nibbles(blocks[..., 4:8], 4)
        low = low.reshape(low.shape[:-1] + (2, 4)).swapaxes(-1, -2).reshape(low.shape)  # byte j: sub-blocks 2j, 2j+1
        scales = ((low | (high << 4)).astype(np.int16) - 32).astype(np.float32)
        values = IQ4_VALUES[_nibbles(blocks[..., 8:], 16)]
        return Unpacked(_flat(values), _flat(d * scales), None, 32)


BLOCK_FORMATS: dict[str, type[BlockFormat]] = {
    cls.name: cls for cls in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS)
}


def block_format(name: str) -> type[BlockFormat]:
    try:
        return BLOCK_FORMATS[name]
    except KeyError:
        raise ValueError(f"GGUF block type {name!r} is not one of ours; known: {', '.join(BLOCK_FORMATS)}") from None
