"""CPU kernels (kernels/cpu, through devices/cpu's backend) against their references: the numpy
oracle in devices/reference.py and quant's dequantize.

Tolerances are f32 rounding bounds, derived per test:
- linear: any summation order of a K-term dot product errs by at most K*eps*sum|terms|; decode
  computes a quantized row as s*sum(q*x) + o*sum(x) (or s*sum(q*x) - z*s*sum(x)) rather than
  sum((s*q + o)*x), so its terms are |x|*(|s*q| + |o|) (or |x|*(|s*q| + |s*z|)) and each weight
  value is one rounding away: bound = (K + 2) * eps * sum_k |x_k| * (|s*q_k| + |o or s*z|).
- dequantization (tile and embedding rows) is exact: the kernels use the reference's arithmetic.
- norms, softmax: relative (n + 4) * eps for sums of n terms; RoPE and SiLU: a few ulp.
- attention: the scores' dot products err by Dh*eps*|scale*q.k|, the softmax and the weighted
  sum of S values by S*eps; the output by their sum times max|v| (constant 4 for slack in the
  max-shift and merge).
Numba compiles into the session's temporary ZLLM_EDGE_HOME (conftest.isolated_home), so no cache
from an earlier run can hide a bug; kernels are imported inside fixtures, after that is set.
"""
from __future__ import annotations

import numpy as np
import pytest

from devices import reference
from quant.formats import (ALL_SCHEMES, WIDE_SCALE_SCHEMES, Int4Codes, Int8Codes, QuantizedTensor, quantize,
                           symmetric_zero_point)

EPS = float(np.finfo(np.float32).eps)
SCHEMES = list(ALL_SCHEMES + WIDE_SCALE_SCHEMES)  # f16 scales, and f32 ones (GGUF's K-quants)
QUANTIZED = [s for s in SCHEMES if s.is_quantized]
# (N, K): N = 1, K off the group grid, tiny and larger, and K over several of the prefill's depth slices (K_SLICE)
SHAPES = [(1, 40), (7, 100), (50, 256), (130, 70), (20, 300)]


@pytest.fixture(scope="module")
def backend():
    """f32 activations: decode computes W x up to f32 rounding, the bounds below."""
    from devices.cpu import CpuBackend

    return CpuBackend(threads=2, variant="f32")


def make_weight(scheme, shape, seed):
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal(shape).astype(np.float32) + np.float32(0.3)  # a mean, so offsets matter
    if scheme.is_quantized:
        return quantize(dense, scheme)
    return dense.astype(np.float16 if scheme.dtype == "f16" else np.float32)


def term_magnitudes(weight) -> np.ndarray:
    """|w| as each kernel's terms see it: |s*q| + |o| (affine), |s*q| + |s*z| (symmetric), |w| (float)."""
    if not isinstance(weight, QuantizedTensor):
        return np.abs(weight.astype(np.float32))
    codec = Int4Codes if weight.scheme.bits == 4 else Int8Codes
    codes = codec.unpack(weight.qweight).astype(np.float32)
    scales = weight.scales.astype(np.float32)[..., None]
    if weight.offsets is None:
        other = np.abs(scales) * symmetric_zero_point(weight.scheme.bits)
    else:
        other = np.abs(weight.offsets.astype(np.float32))[..., None]
    magnitude = (np.abs(scales * codes) + other).reshape(weight.shape[0], -1)
    return magnitude[:, : weight.shape[1]]


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
@pytest.mark.parametrize("n_tokens", [1, 3, 37])
def test_linear_matches_reference(backend, scheme, n_tokens):
    for index, (n, k) in enumerate(SHAPES):
        weight = make_weight(scheme, (n, k), seed=index)
        x = np.random.default_rng(100 + index).standard_normal((n_tokens, k)).astype(np.float32)
        bias = np.random.default_rng(200 + index).standard_normal(n).astype(np.float32)
        ours = backend.linear(x, backend.prepare_weight(weight), bias)
        expected = reference.linear(x, weight, bias)
        bound = (k + 2) * EPS * (np.abs(x) @ term_magnitudes(weight).T + np.abs(bias))
        assert ours.shape == expected.shape == (n_tokens, n)
        assert np.all(np.abs(ours - expected) <= bound), f"{scheme} N={n} K={k} T={n_tokens}"


def quantized_input(x: np.ndarray) -> np.ndarray:
    """x [T, K] as int8 activations take it: per block of 32 values d = max|x| / 127, x^ = d * round(x / d)."""
    t, k = x.shape
    padded = np.zeros((t, -(-k // 32) * 32), np.float32)
    padded[:, :k] = x
    blocks = padded.reshape(t, -1, 32)
    peak = np.abs(blocks).max(axis=2, keepdims=True)
    inverse = np.divide(np.float32(127.0), peak, out=np.zeros_like(peak), where=peak > 0)
    codes = np.rint(blocks * inverse)
    return (codes * (peak / np.float32(127.0))).reshape(t, -1)[:, :k].astype(np.float32)


def int8_dot_probe(style: int) -> str | None:
    from kernels.cpu.llvm_ir import INT8_DOTS

    return INT8_DOTS[style].probe


INT8_SHAPES = SHAPES + [(9, 32), (5, 96), (11, 160), (64, 576), (6, 1536)]  # 1, 3, 5, 18, 48 blocks of 32


def int8_styles():
    from kernels.cpu.llvm_ir import INT8_DOTS

    return list(INT8_DOTS)


@pytest.mark.parametrize("scheme", QUANTIZED, ids=str)
@pytest.mark.parametrize("style", int8_styles(), ids=lambda style: int8_dot_probe(style) or "generic")
def test_decode_with_int8_activations_multiplies_the_quantized_input(scheme, style):
    """Decode in an int8 variant computes W x^ (x^: the input rounded to int8 per block of 32) up to
    f32 rounding, by each int8 dot-product instruction this CPU runs (generic IR everywhere), and
    W x within x^'s rounding: |W (x^ - x)|. The integer sums are exact, so every instruction gives
    the generic IR's bits."""
    from devices.cpu import CpuBackend
    from devices.cpu.weights import prepare_weight
    from kernels.cpu.cpu_probe import runs
    from kernels.cpu.llvm_ir import ACT_INT8, INT8_DOTS

    probe = INT8_DOTS[style].probe
    if probe is not None and not runs(probe):
        pytest.skip(f"the kernels' target here does not run {INT8_DOTS[style].name}")
    backend = CpuBackend(threads=2, variant="int8")
    for index, (n, k) in enumerate(INT8_SHAPES):
        weight = make_weight(scheme, (n, k), seed=index)
        rng = np.random.default_rng(300 + index)
        x = (rng.standard_normal((1, k)) * rng.uniform(0.01, 10.0, k)).astype(np.float32)  # uneven magnitudes
        bias = rng.standard_normal(n).astype(np.float32)
        ours = backend.linear(x, prepare_weight(weight, style), bias)
        np.testing.assert_array_equal(ours, backend.linear(x, prepare_weight(weight, ACT_INT8), bias))
        x_hat = quantized_input(x)
        expected = reference.linear(x_hat, weight, bias)
        magnitudes = np.abs(x_hat) @ term_magnitudes(weight).T + np.abs(bias)
        assert np.all(np.abs(ours - expected) <= (k + 2) * EPS * magnitudes), f"{scheme} N={n} K={k}"
        rounding = np.abs(x_hat - x) @ np.abs(weight.dequantize()).T
        exact = reference.linear(x, weight, bias)
        assert np.all(np.abs(ours - exact) <= rounding + 2 * (k + 2) * EPS * magnitudes), f"{scheme} N={n} K={k}"


@pytest.mark.parametrize("scheme", [s for s in QUANTIZED if s.bits == 4 and s.group_size <= 64], ids=str)
@pytest.mark.parametrize("style", int8_styles(), ids=lambda style: int8_dot_probe(style) or "generic")
def test_an_int4_rows_last_two_chunks_give_the_bits_of_a_whole_step(scheme, style):
    """Rows of 64 mod 128 values end in two chunks of 32 that the decode kernel takes in half a step;
    the same rows with 64 more values of zero weight times zero input end in a whole step. Both give
    the same bits: the half step adds those chunks' products into the lanes a whole step adds them to."""
    from devices.cpu import CpuBackend
    from devices.cpu.weights import prepare_weight
    from kernels.cpu.cpu_probe import runs
    from kernels.cpu.llvm_ir import INT8_DOTS

    probe = INT8_DOTS[style].probe
    if probe is not None and not runs(probe):
        pytest.skip(f"the kernels' target here does not run {INT8_DOTS[style].name}")
    backend = CpuBackend(threads=2, variant="int8")
    rng = np.random.default_rng(7)
    for n, k in [(9, 64), (13, 192), (64, 576)]:  # the half step alone, after one whole step, after four
        dense = rng.standard_normal((n, k)).astype(np.float32) + np.float32(0.3)
        x = (rng.standard_normal((1, k)) * rng.uniform(0.01, 10.0, k)).astype(np.float32)
        widened = quantize(np.concatenate([dense, np.zeros((n, 64), np.float32)], axis=1), scheme)
        x_widened = np.concatenate([x, np.zeros((1, 64), np.float32)], axis=1)
        half = backend.linear(x, prepare_weight(quantize(dense, scheme), style))
        whole = backend.linear(x_widened, prepare_weight(widened, style))
        np.testing.assert_array_equal(half, whole, err_msg=f"{scheme} N={n} K={k}")


@pytest.mark.parametrize("k", [32, 70, 576, 1536])
def test_prepared_int8_vector_holds_the_q8_layout_exactly(k):
    """prepare_vector's int8 form, byte for byte against llvm_ir's Q8 layout built in numpy: per chunk
    of 32 the codes round(x * 127 / max|x|) in natural and int4 order, d = max|x| / 127, the
    zero-point lanes (-128 x sums of 4 natural codes, -8 x sums of 8), and the group sums of d * codes
    (an all-zero chunk gives zero codes and d = 0). Codes and lanes are exact; d and the sums are
    within an ulp of numpy's (fast-math lets LLVM divide by 127 as a multiplication by 1/127)."""
    from kernels.cpu.linear import pairs_length, prepare_vector, sums_length
    from kernels.cpu.llvm_ir import (ACT_INT8_VNNI, Q8_INT4_ORDER, Q8_INT4_ZERO_LANES, Q8_INT8_ZERO_LANES,
                                     Q8_SCALES, Q8_SUPERBLOCK_BYTES, Q8_SUPERBLOCK_CHUNKS)

    rng = np.random.default_rng(k)
    x = (rng.standard_normal(k) * rng.uniform(0.01, 10.0, k)).astype(np.float32)
    x[: min(k, 32)] = 0.0 if k > 32 else x[:32]  # an all-zero chunk first (when there are others)
    padded = -(-k // 32) * 32
    x_natural, x_pairs = np.full(padded, np.nan, np.float32), np.zeros(pairs_length(padded), np.float32)
    x_sums = np.full(sums_length(padded), np.nan, np.float32)
    prepare_vector(x, x_natural, x_pairs, x_sums, ACT_INT8_VNNI)

    chunks = np.zeros(padded, np.float32)
    chunks[:k] = x
    chunks = chunks.reshape(-1, 32)
    q8 = x_pairs.view(np.uint8)
    expected_sums = []
    for c, values in enumerate(chunks):
        peak = np.abs(values).max()
        inverse = np.float32(127.0) / peak if peak > 0 else np.float32(0.0)
        codes = np.rint(values * inverse).astype(np.int32)
        d = peak / np.float32(127.0)
        block, place = (c // Q8_SUPERBLOCK_CHUNKS) * Q8_SUPERBLOCK_BYTES, c % Q8_SUPERBLOCK_CHUNKS

        def at(offset, n_bytes, dtype):
            return q8[block + offset:block + offset + n_bytes].view(dtype)

        np.testing.assert_array_equal(at(32 * place, 32, np.int8), codes)
        np.testing.assert_array_equal(at(Q8_INT4_ORDER + 16 * place, 16, np.int8), codes[0::2])
        np.testing.assert_array_equal(at(Q8_INT4_ORDER + 64 + 16 * place, 16, np.int8), codes[1::2])
        np.testing.assert_array_max_ulp(at(Q8_SCALES + 4 * place, 4, np.float32)[0], d, maxulp=1)
        np.testing.assert_array_equal(at(Q8_INT4_ZERO_LANES + 16 * place, 16, np.int32),
                                      -8 * codes.reshape(4, 8).sum(axis=1))
        np.testing.assert_array_equal(at(Q8_INT8_ZERO_LANES + 32 * place, 32, np.int32),
                                      -128 * codes.reshape(8, 4).sum(axis=1))
        expected_sums.append(d * np.float32(codes.sum()))
    np.testing.assert_array_equal(x_natural, chunks.reshape(-1))
    n = len(chunks)
    np.testing.assert_array_max_ulp(x_sums[:n], np.array(expected_sums, np.float32), maxulp=2)


def bf16_rounded(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), as float32."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("n_tokens", [3, 17, 40])  # one short block, one block of 32, two blocks
@pytest.mark.parametrize("scheme", QUANTIZED, ids=str)
def test_int8_variant_prefill_multiplies_bf16_tiles(backend, scheme, n_tokens):
    """The default variant's prefill of a weight that integer panels do not take (below), on a CPU
    that runs AVX-512 BF16: the weight's tile and the input rounded to bf16, products summed in f32
    (kernels/cpu/linear.py gemm); elsewhere the f32 tiles of cpu:f32, bit for bit. One token
    (decode) takes the int8 path either way."""
    from devices.cpu import CpuBackend

    int8_backend = CpuBackend(threads=2, variant="int8")
    if int8_backend.integer_prefill:
        pytest.skip(f"{scheme} prefills on integer panels here")
    weight = make_weight(scheme, (100, 70), seed=5)  # 100 rows: three tiles of 48
    x = np.random.default_rng(6).standard_normal((n_tokens, 70)).astype(np.float32)
    prefill = int8_backend.linear(x, int8_backend.prepare_weight(weight))
    f32_prefill = backend.linear(x, backend.prepare_weight(weight))
    if int8_backend.bf16_prefill:
        expected = bf16_rounded(x).astype(np.float64) @ bf16_rounded(weight.dequantize()).astype(np.float64).T
        np.testing.assert_allclose(prefill, expected, rtol=0, atol=2e-6 * np.abs(expected).max())
        assert not np.array_equal(prefill, f32_prefill)
        assert np.abs(prefill - f32_prefill).max() <= 2.0 ** -7 * np.abs(f32_prefill).max()
    else:
        np.testing.assert_array_equal(prefill, f32_prefill)
    assert not np.array_equal(int8_backend.linear(x[:1], int8_backend.prepare_weight(weight)), prefill[:1])


INTEGER_PREFILL_SHAPES = [(100, 70), (16, 32), (33, 576), (7, 1536)]  # panels of 16 with and without a tail


@pytest.mark.parametrize("scheme", QUANTIZED, ids=str)
@pytest.mark.parametrize("style", int8_styles(), ids=lambda style: int8_dot_probe(style) or "generic")
def test_integer_prefill_multiplies_the_quantized_tokens(scheme, style):
    """Prefill on integer panels (kernels/cpu/llvm_prefill.py) computes x^ W^T, x^ each token rounded
    to int8 per block of 32 as decode rounds its vector: up to f32 rounding of the per-block terms
    (the integer sums are exact, then one f32 multiply-add per block and row: (K / 32 + 2) * eps of
    the terms' magnitudes), and with the same bits by every instruction that runs here (the sums are
    exact and the f32 steps run in one order)."""
    from devices.cpu.weights import prepare_weight
    from kernels.cpu import linear as linear_kernels
    from kernels.cpu.cpu_probe import runs
    from kernels.cpu.llvm_ir import INT8_DOTS
    from kernels.cpu.llvm_prefill import integer_prefill_runs

    probe = INT8_DOTS[style].probe
    if probe is not None and not runs(probe):
        pytest.skip(f"the kernels' target here does not run {INT8_DOTS[style].name}")
    if not integer_prefill_runs(style):
        pytest.skip(f"{scheme} keeps float tiles with {INT8_DOTS[style].name}")
    runs_here = [s for s in INT8_DOTS if (INT8_DOTS[s].probe is None or runs(INT8_DOTS[s].probe))
                 and integer_prefill_runs(s)]
    for index, (n, k) in enumerate(INTEGER_PREFILL_SHAPES):
        weight = make_weight(scheme, (n, k), seed=index)
        rng = np.random.default_rng(400 + index)
        for n_tokens in (2, 5, 37):
            x = (rng.standard_normal((n_tokens, k)) * rng.uniform(0.01, 10.0, k)).astype(np.float32)
            ours = linear_kernels.linear(prepare_weight(weight, style).descriptor, x, None, 2)
            x_hat = quantized_input(x).astype(np.float64)
            expected = x_hat @ weight.dequantize().astype(np.float64).T
            magnitudes = np.abs(x_hat) @ term_magnitudes(weight).T.astype(np.float64)
            assert np.all(np.abs(ours - expected) <= (k / 32 + 2) * EPS * magnitudes), f"{scheme} N={n} K={k}"
            for other in runs_here:
                np.testing.assert_array_equal(
                    linear_kernels.linear(prepare_weight(weight, other).descriptor, x, None, 1), ours)


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_embedding_rows_are_dequantized_exactly(backend, scheme):
    table = make_weight(scheme, (50, 100), seed=3)
    ids = np.array([0, 49, 7, 7, 23])
    ours = backend.embed(backend.prepare_weight(table), ids)
    np.testing.assert_array_equal(ours, reference.embed(table, ids))


@pytest.mark.parametrize("scheme", QUANTIZED, ids=str)
def test_prefill_tiles_hold_the_dequantized_weight(backend, scheme):
    """A one-hot token through the prefill path returns a weight column exactly (tile = dequantize)."""
    weight = make_weight(scheme, (20, 70), seed=5)
    eye = np.eye(70, dtype=np.float32)[:40]  # 40 tokens: more than one block of 32
    ours = backend.linear(eye, backend.prepare_weight(weight))
    np.testing.assert_array_equal(ours, weight.dequantize()[:, :40].T)


def test_rms_norm_matches_reference(backend):
    rng = np.random.default_rng(0)
    for shape in [(1, 7), (5, 64), (3, 4, 32)]:  # 3-D: the per-head norm of Qwen3
        x = rng.standard_normal(shape).astype(np.float32) * 3
        gain = rng.standard_normal(shape[-1]).astype(np.float32)
        ours, expected = backend.rms_norm(x, gain, 1e-6), reference.rms_norm(x, gain, 1e-6)
        np.testing.assert_allclose(ours, expected, rtol=(shape[-1] + 4) * EPS, atol=(shape[-1] + 4) * EPS * np.abs(gain).max())


def test_rope_matches_reference(backend):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 3, 16)).astype(np.float32)
    angles = rng.uniform(-7, 7, (6, 8))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    ours, expected = backend.rope(x, cos, sin), reference.rope(x, cos, sin)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=4 * EPS * np.abs(x).max())
    assert not np.shares_memory(ours, x)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}])
def test_rope_table_spans_equal_the_direct_cos_sin(scaling):
    """The CPU executor's RoPE rows come from a table grown on demand (cos_sin_span): the same values
    as cos_sin of those positions, before and after the table grows, and read-only."""
    from types import SimpleNamespace

    from edge.rope import RopeTable

    table = RopeTable(SimpleNamespace(head_dim=16, rope_theta=10000.0, rope_scaling=scaling))
    for start, n in [(0, 5), (3, 1), (250, 20), (1000, 1), (0, 1500), (1499, 1)]:
        cos, sin = table.cos_sin_span(start, n)
        expected_cos, expected_sin = table.cos_sin(np.arange(start, start + n))
        np.testing.assert_array_equal(cos, expected_cos)
        np.testing.assert_array_equal(sin, expected_sin)
        assert not cos.flags.writeable and not sin.flags.writeable


def test_swiglu_and_softmax_match_reference(backend):
    rng = np.random.default_rng(2)
    gate, up = (rng.standard_normal((4, 33)).astype(np.float32) * 5 for _ in range(2))
    np.testing.assert_allclose(backend.swiglu(gate, up), reference.swiglu(gate, up), rtol=8 * EPS, atol=8 * EPS)
    scores = rng.standard_normal((3, 5, 41)).astype(np.float32) * 4
    scores[0, 0, 3:] = -np.inf  # a masked row
    np.testing.assert_allclose(backend.softmax(scores), reference.softmax(scores), rtol=45 * EPS, atol=45 * EPS)


ATTENTION_CASES = [  # (tokens, cached before them, Hq, Hkv, Dh, window)
    (1, 37, 4, 4, 8, None),  # MHA decode
    (1, 100, 9, 3, 64, None),  # GQA decode, SmolLM2's heads
    (1, 50, 8, 1, 16, 8),  # MQA decode in a window
    (6, 0, 4, 2, 24, None),  # GQA prefill
    (7, 10, 4, 2, 16, 3),  # append-prefill in a window of 3
    (16, 0, 8, 1, 8, 4),  # MQA prefill in a window
]


def attention_bound(q, k, v, scale, n_keys):
    head_dim = q.shape[-1]
    score_magnitude = scale * np.abs(q).max() * np.abs(k).max() * head_dim
    return 4 * (head_dim * EPS * score_magnitude + n_keys * EPS) * np.abs(v).max()


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "T{}_S{}_H{}/{}_D{}_w{}".format(*c))
def test_attention_matches_reference(backend, case):
    n_tokens, n_cached, n_heads, n_kv, head_dim, window = case
    rng = np.random.default_rng(n_tokens * 1000 + n_cached)
    n_keys = n_cached + n_tokens
    q = rng.standard_normal((n_tokens, n_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((n_keys, n_kv, head_dim)).astype(np.float32)
    v = rng.standard_normal((n_keys, n_kv, head_dim)).astype(np.float32)
    q_positions, k_positions = np.arange(n_cached, n_keys), np.arange(n_keys)
    scale = 1 / np.sqrt(head_dim)
    ours = backend.attention(q, k, v, q_positions, k_positions, scale, window)
    expected = reference.attention(q, k, v, q_positions, k_positions, scale, window)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=attention_bound(q, k, v, scale, n_keys))


def test_decode_attention_split_across_threads_equals_one_pass():
    """Splitting a long KV sequence into parts and merging them through their log-sum-exp equals
    one pass over all keys, to f32 rounding (same bound as above)."""
    from kernels.cpu.attention import attention

    rng = np.random.default_rng(7)
    n_keys, n_heads, n_kv, head_dim = 3001, 9, 3, 64
    q = rng.standard_normal((1, n_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((n_keys, n_kv, head_dim)).astype(np.float32)
    v = rng.standard_normal((n_keys, n_kv, head_dim)).astype(np.float32)
    positions = np.arange(n_keys)
    scale = 1 / np.sqrt(head_dim)
    one_pass = attention(q, k, v, positions[-1:], positions, scale, None, n_threads=1)
    bound = attention_bound(q, k, v, scale, n_keys)
    for parts in (2, 3, 7):
        split = attention(q, k, v, positions[-1:], positions, scale, None, n_threads=parts)
        np.testing.assert_allclose(split, one_pass, rtol=0, atol=bound)
    windowed = attention(q, k, v, positions[-1:], positions, scale, 1000, n_threads=5)
    np.testing.assert_allclose(windowed, reference.attention(q, k, v, positions[-1:], positions, scale, 1000),
                               rtol=0, atol=bound)


@pytest.mark.parametrize("element", [np.float32, np.float16])
def test_attention_tiles_give_the_bits_of_one_head_at_a_time(element):
    """The query heads of a GQA group share each load of a key and of a value (tiles of up to 4
    heads, or 4 keys of one head): every score and every weighted sum of values has the bits of one
    head against one key (one head's sum), for any group size and head dim, and is the exact
    product to f32 rounding."""
    import numba

    from kernels.cpu.attention import key_scores, sum_values

    @numba.njit
    def attend(keys, values, row_bytes, head_dim, queries, weights, n_heads, n, one_at_a_time, scores, sums):
        element_bytes, q, w = keys.itemsize, queries.ctypes.data, weights.ctypes.data
        if not one_at_a_time:
            key_scores(element_bytes, keys.ctypes.data, row_bytes, head_dim, 0, n, q, n_heads, scores.ctypes.data, n)
            sum_values(element_bytes, values.ctypes.data, row_bytes, n, w, 4 * n, head_dim, sums.ctypes.data,
                       4 * head_dim, n_heads)
            return
        for g in range(n_heads):
            for s in range(n):
                key_scores(element_bytes, keys.ctypes.data, row_bytes, head_dim, s, s + 1, q + 4 * g * head_dim, 1,
                           scores.ctypes.data + 4 * g * n, n)
            sum_values(element_bytes, values.ctypes.data, row_bytes, n, w + 4 * g * n, 0, head_dim,
                       sums.ctypes.data + 4 * g * head_dim, 0, 1)

    rng = np.random.default_rng(11)
    for n_heads, head_dim, n_keys in ((1, 64, 13), (2, 72, 9), (3, 64, 37), (4, 80, 6), (5, 72, 11), (8, 128, 7),
                                      (9, 8, 5), (7, 24, 33), (1, 24, 50), (3, 72, 70)):
        n_kv = 2  # the rows hold a second KV head, which must be skipped
        keys, values = (rng.standard_normal((n_keys, n_kv, head_dim)).astype(element) for _ in range(2))
        queries = rng.standard_normal((n_heads, head_dim)).astype(np.float32)
        weights = rng.random((n_heads, n_keys)).astype(np.float32)
        stored = [a.view(np.uint16) if element == np.float16 else a for a in (keys, values)]
        results = []
        for one_at_a_time in (False, True):
            scores = np.full((n_heads, n_keys), np.nan, np.float32)
            sums = np.full((n_heads, head_dim), np.nan, np.float32)
            attend(*stored, keys.itemsize * n_kv * head_dim, head_dim, queries, weights, n_heads, n_keys,
                   one_at_a_time, scores, sums)
            results.append((scores, sums))
        for tiled, single in zip(*results):
            np.testing.assert_array_equal(tiled.view(np.uint32), single.view(np.uint32))
        scores, sums = results[0]
        k, v = (a[:, 0].astype(np.float64) for a in (keys, values))
        np.testing.assert_array_less(np.abs(scores - queries @ k.T), head_dim * EPS * (np.abs(queries) @ np.abs(k).T))
        np.testing.assert_array_less(np.abs(sums - weights @ v), n_keys * EPS * (weights @ np.abs(v)) + 1e-30)


def test_weights_stay_views_of_the_checkpoint_arrays(backend):
    """prepare_weight keeps the mmap'd arrays (no copy, no f32 expansion) and accepts read-only ones."""
    weight = make_weight(QUANTIZED[0], (16, 64), seed=9)
    for array in (weight.qweight, weight.scales):
        array.flags.writeable = False
    prepared = backend.prepare_weight(weight)
    assert np.shares_memory(prepared.arrays[0], weight.qweight)
    assert np.shares_memory(prepared.arrays[1], weight.scales)
    assert all(a is None or a.dtype != np.float32 for a in prepared.arrays)
    x = np.ones((1, 64), np.float32)
    np.testing.assert_allclose(backend.linear(x, prepared), reference.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_unsupported_weight_is_refused_with_a_message(backend):
    from devices.base import DeviceUnavailableError

    with pytest.raises(DeviceUnavailableError, match=r"device 'cpu' has no kernel for a float64 array of shape \(4, 8\)"):
        backend.prepare_weight(np.zeros((4, 8), np.float64))
