"""GGUF block formats kept as they are (quant/gguf_blocks.py): unpacking and dequantizing each type
gives the gguf package's dequantization bit for bit."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from quant.gguf_blocks import BLOCK_FORMATS, block_format


def random_blocks(fmt, n_rows: int, n_blocks: int, seed: int) -> np.ndarray:
    """Random bytes with finite float16 scales (random bytes there would give NaN and inf scales)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n_rows, n_blocks, fmt.block_bytes), dtype=np.uint8)
    for start in fmt.float16_fields:
        scales = (rng.standard_normal((n_rows, n_blocks)) * 0.01).astype("<f2")
        blocks[..., start:start + 2] = scales.view(np.uint8).reshape(n_rows, n_blocks, 2)
    return blocks


@pytest.mark.parametrize("name", sorted(BLOCK_FORMATS))
def test_dequantize_equals_the_gguf_package_bit_for_bit(name):
    fmt = block_format(name)
    ggml_type = gguf.GGMLQuantizationType[name]
    assert gguf.GGML_QUANT_SIZES[ggml_type] == (fmt.block_size, fmt.block_bytes)
    blocks = random_blocks(fmt, 5, 3, seed=sum(map(ord, name)))
    ours = fmt.dequantize(blocks)
    theirs = gguf.quants.dequantize(blocks.reshape(5, -1), ggml_type)
    assert ours.shape == theirs.shape == (5, 3 * fmt.block_size) and ours.dtype == np.float32
    assert np.array_equal(ours.view(np.uint32), theirs.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("name", sorted(BLOCK_FORMATS))
def test_unpacked_values_and_scales_are_exact(name):
    """Each sub-block scale and offset is a float16 times a small integer (exact in float32), and the
    values are integers in the type's range: unpacking loses nothing."""
    fmt = block_format(name)
    unpacked = fmt.unpack(random_blocks(fmt, 2, 4, seed=1))
    assert unpacked.values.shape == (2, 4 * fmt.block_size)
    assert unpacked.scales.shape == (2, 4 * fmt.block_size // unpacked.sub_block)
    assert np.abs(unpacked.values).max() <= 128  # (Q8_0 allows -128)
    assert np.all(np.isfinite(unpacked.scales))


def test_an_unknown_type_is_refused():
    with pytest.raises(ValueError, match="GGUF block type 'Q7_K' is not one of ours; known: Q4_0, "):
        block_format("Q7_K")


def test_a_real_files_tensors_dequantize_as_the_gguf_package_does(smollm2_gguf):
    """SmolLM2's published GGUF (Q4_1 and Q8_0 tensors): a few rows of each quantized tensor type."""
    reader = gguf.GGUFReader(str(smollm2_gguf))
    seen = set()
    for tensor in reader.tensors:
        name = tensor.tensor_type.name
        if name not in BLOCK_FORMATS or name in seen:
            continue
        seen.add(name)
        fmt = block_format(name)
        rows = np.asarray(tensor.data[:8])  # uint8 [rows, bytes per row]
        ours = fmt.dequantize(rows.reshape(rows.shape[0], -1, fmt.block_bytes))
        theirs = gguf.quants.dequantize(rows, tensor.tensor_type)
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), tensor.name
    assert seen == {"Q4_1", "Q8_0"}
