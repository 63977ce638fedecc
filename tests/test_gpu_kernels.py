"""Every WGSL kernel of the gpu device against its numpy reference (devices/reference.py).

Bounds are derived per op from f32 rounding (u = 2^-24) and WGSL's stated accuracy of exp
(3 + 2|x| ULP), never one loose global tolerance; discrete results (argmax ids) are exact.
The inputs are small so that the whole file runs in seconds on lavapipe.
"""
from __future__ import annotations

import numpy as np
import pytest

from devices import reference
from gpu_support import UNIT_ROUNDOFF, assert_within, dot_error_bound, open_gpu
from quant.formats import ALL_SCHEMES, WIDE_SCALE_SCHEMES, QuantizedTensor, Scheme, quantize

ULP_OF_ONE = 2.0**-23  # ULP of a value in [1, 2): a relative error of one ULP is at most this
QUANTIZED_SCHEMES = [s for s in ALL_SCHEMES + WIDE_SCALE_SCHEMES if s.is_quantized]
FLOAT_SCHEMES = [Scheme("f16"), Scheme("f32")]


@pytest.fixture(scope="module")
def gpu():
    return open_gpu()


def term_magnitude(stored, values: np.ndarray) -> np.ndarray:
    """|w| per element, or |s q| + |o| for affine weights: a kernel may sum s * sum(q x) + o * sum(x)
    (the CPU kernel does), whose rounding scales with the parts, not with their (cancelling) sum."""
    if isinstance(stored, QuantizedTensor) and not stored.scheme.symmetric:
        offsets = np.repeat(stored.offsets.astype(np.float32), stored.scheme.group_size, axis=1)[:, : values.shape[1]]
        return np.abs(values - offsets) + np.abs(offsets)
    return np.abs(values)


def random_weight(rng, n: int, k: int, scheme: Scheme):
    """A weight [n, k] in `scheme` (QuantizedTensor or float array) and its float32 values."""
    dense = rng.standard_normal((n, k)).astype(np.float32)
    if scheme.is_quantized:
        stored = quantize(dense, scheme)
        return stored, stored.dequantize()
    stored = dense.astype(np.float16 if scheme.dtype == "f16" else np.float32)
    return stored, stored.astype(np.float32)


# --- linear: matrix-vector (T = 1) and matrix-matrix (T > 1) ----------------------------------------
@pytest.mark.parametrize("scheme", QUANTIZED_SCHEMES + FLOAT_SCHEMES, ids=str)
@pytest.mark.parametrize("n_tokens", [1, 3, 19])
def test_linear_matches_reference(gpu, scheme, n_tokens):
    rng = np.random.default_rng(n_tokens)
    # K = 200 is a multiple of no group size (the last group is padded) and 100 is not a multiple
    # of 8, the inputs decoded together: both tails are exercised.
    for k in (200, 100):
        stored, values = random_weight(rng, 37, k, scheme)
        x = rng.standard_normal((n_tokens, k)).astype(np.float32)
        ours = gpu.linear(x, gpu.prepare_weight(stored))
        bound = dot_error_bound(x, term_magnitude(stored, values))
        assert_within(ours, reference.linear(x, stored), bound, f"{scheme} K={k} T={n_tokens}")


@pytest.mark.parametrize("n_tokens", [1, 5])
def test_linear_bias_and_inputs_longer_than_one_staged_tile(gpu, n_tokens):
    # the kernel stages 4096 inputs per tile for one token and 512 per token for eight
    rng = np.random.default_rng(7)
    k = 4100 if n_tokens == 1 else 1100
    stored, values = random_weight(rng, 9, k, Scheme("int4", 64, False))
    bias = rng.standard_normal(9).astype(np.float32)
    x = rng.standard_normal((n_tokens, k)).astype(np.float32)
    ours = gpu.linear(x, gpu.prepare_weight(stored), gpu.prepare_weight(bias))
    expected = reference.linear(x, stored, bias)
    bound = dot_error_bound(x, term_magnitude(stored, values)) + UNIT_ROUNDOFF * np.abs(expected)
    assert_within(ours, expected, bound, f"K={k}")


def test_weights_larger_than_one_binding_are_split_into_row_chunks():
    small = open_gpu(max_binding_bytes=1024)
    rng = np.random.default_rng(3)
    stored, values = random_weight(rng, 45, 192, Scheme("int8", 32, True))  # 192 bytes per row: 5 rows per chunk
    weight = small.prepare_weight(stored)
    assert len(weight.chunks) == 9
    assert [c.first_row for c in weight.chunks] == list(range(0, 45, 5))
    x = rng.standard_normal((4, 192)).astype(np.float32)
    assert_within(small.linear(x, weight), reference.linear(x, stored), dot_error_bound(x, values), "split linear")
    ids = np.array([44, 0, 7, 5, 4, 23])
    np.testing.assert_array_equal(small.embed(weight, ids), reference.embed(stored, ids))


# --- embedding lookup ---------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", QUANTIZED_SCHEMES + FLOAT_SCHEMES, ids=str)
def test_embedding_rows_decode_exactly(gpu, scheme):
    rng = np.random.default_rng(11)
    stored, _ = random_weight(rng, 50, 72, scheme)
    ids = np.array([3, 49, 0, 3, 17])
    ours = gpu.embed(gpu.prepare_weight(stored), ids)
    expected = reference.embed(stored, ids)
    if scheme.is_quantized and not scheme.symmetric:
        # w = s * q + o: the device may fuse the multiply-add (one rounding instead of two)
        bound = 2 * UNIT_ROUNDOFF * term_magnitude(stored, stored.dequantize())[ids]
        assert_within(ours, expected, bound, f"{scheme} rows")
    else:  # s * (q - zero) and plain floats: one rounding or none, the same on both sides
        np.testing.assert_array_equal(ours, expected)


# --- normalisation, rotation, activation ---------------------------------------------------------------
@pytest.mark.parametrize("shape", [(5, 64), (3, 576), (4, 3, 24)], ids=["rows", "wide", "per-head"])
def test_rms_norm(gpu, shape):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    gain = (1 + 0.1 * rng.standard_normal(shape[-1])).astype(np.float32)
    expected = reference.rms_norm(x, gain, 1e-6)
    # mean of squares: D-term sum (D u each side); sqrt and division: WGSL allows 2.5-4 ULP each
    bound = (2 * shape[-1] + 16) * UNIT_ROUNDOFF * np.abs(expected)
    assert_within(gpu.rms_norm(x, gpu.prepare_weight(gain), 1e-6), expected, bound, f"rms_norm {shape}")


@pytest.mark.parametrize("head_dim", [8, 64, 256])
def test_rope_half_split(gpu, head_dim):
    rng = np.random.default_rng(head_dim)
    x = rng.standard_normal((6, 3, head_dim)).astype(np.float32)
    angles = rng.uniform(0, 50, (6, head_dim // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    half = head_dim // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = np.abs(cos[:, None, :]), np.abs(sin[:, None, :])
    magnitude = np.concatenate([np.abs(x1) * c + np.abs(x2) * s, np.abs(x2) * c + np.abs(x1) * s], axis=-1)
    assert_within(gpu.rope(x, cos, sin), reference.rope(x, cos, sin), 4 * UNIT_ROUNDOFF * magnitude, f"Dh={head_dim}")


def test_swiglu_including_overflowing_gates(gpu):
    rng = np.random.default_rng(9)
    gate = (rng.standard_normal((4, 96)) * 8).astype(np.float32)
    gate[0, :4] = [-120.0, -89.0, 89.0, 120.0]  # exp(-g) overflows for g < -88.7
    up = rng.standard_normal((4, 96)).astype(np.float32)
    expected = reference.swiglu(gate, up)
    bound = ((3 + 2 * np.abs(gate)) * ULP_OF_ONE + 4 * UNIT_ROUNDOFF) * np.abs(expected)
    assert_within(gpu.swiglu(gate, up), expected, bound, "swiglu")


# --- attention --------------------------------------------------------------------------------------------
def attention_bound(q, k, v, q_positions, k_positions, scale, window):
    """|ours - reference| for softmax(q k^T scale) v: each probability may be off by the relative
    error of WGSL's exp (3 + 2|x| ULP, x = score - max) plus the error of its score (a Dh-term dot
    product); normalising doubles it; the weighted sums add 2 S u. All times max|v|."""
    group = q.shape[1] // k.shape[1]
    k_full, v_full = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("thd,shd->hts", q, k_full) * scale
    visible = reference.causal_mask(q_positions, k_positions, window)[None]
    magnitude = np.einsum("thd,shd->hts", np.abs(q), np.abs(k_full)) * scale
    spread = np.where(visible, scores, np.inf).min(-1) - np.where(visible, scores, -np.inf).max(-1)  # [H, T]
    head_dim, n_keys = q.shape[2], k.shape[0]
    exp_error = (3 + 2 * np.abs(spread)) * ULP_OF_ONE
    score_error = 2 * head_dim * UNIT_ROUNDOFF * np.where(visible, magnitude, 0).max(-1)
    per_query = 2 * (exp_error + score_error) + 2 * n_keys * UNIT_ROUNDOFF  # [H, T]
    return per_query.T[:, :, None] * np.abs(v_full).max()


ATTENTION_CASES = {
    # name: (T, S, Hq, Hkv, Dh, window)
    "decode-gqa": (1, 70, 4, 2, 24, None),
    "prefill-mha": (7, 7, 4, 4, 64, None),
    "append-mqa-many-tiles": (9, 130, 8, 1, 128, None),
    "prefill-window4": (16, 16, 4, 2, 16, 4),
    "decode-window-dh256": (3, 200, 2, 2, 256, 50),
}


@pytest.mark.parametrize("case", ATTENTION_CASES.values(), ids=ATTENTION_CASES.keys())
def test_attention_causal_gqa_window(gpu, case):
    n_tokens, n_keys, q_heads, kv_heads, head_dim, window = case
    rng = np.random.default_rng(n_keys)
    q = rng.standard_normal((n_tokens, q_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((n_keys, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((n_keys, kv_heads, head_dim)).astype(np.float32)
    q_positions, k_positions = np.arange(n_keys - n_tokens, n_keys), np.arange(n_keys)
    scale = 1 / np.sqrt(head_dim)
    expected = reference.attention(q, k, v, q_positions, k_positions, scale, window)
    ours = gpu.attention(q, k, v, q_positions, k_positions, scale, window)
    assert_within(ours, expected, attention_bound(q, k, v, q_positions, k_positions, scale, window), str(case))


def test_attention_reads_positions_not_indices(gpu):
    # keys stored out of order with gaps: visibility follows the positions given
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 2, 16)).astype(np.float32)
    k = rng.standard_normal((6, 1, 16)).astype(np.float32)
    v = rng.standard_normal((6, 1, 16)).astype(np.float32)
    q_positions, k_positions = np.array([10, 20]), np.array([21, 3, 15, 9, 20, 11])
    expected = reference.attention(q, k, v, q_positions, k_positions, 0.25, 8)
    ours = gpu.attention(q, k, v, q_positions, k_positions, 0.25, 8)
    assert_within(ours, expected, attention_bound(q, k, v, q_positions, k_positions, 0.25, 8), "positions")


# --- the sampler's reductions -------------------------------------------------------------------------
def test_softmax_rows(gpu):
    rng = np.random.default_rng(2)
    logits = (rng.standard_normal((3, 1000)) * 5).astype(np.float32)
    expected = reference.softmax(logits)
    spread = logits.max(-1, keepdims=True) - logits.min(-1, keepdims=True)
    bound = (2 * (3 + 2 * spread) * ULP_OF_ONE + 2 * logits.shape[1] * UNIT_ROUNDOFF) * expected
    assert_within(gpu.softmax(logits), expected, bound, "softmax")


def test_argmax_exact_with_ties_and_infinities(gpu):
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((4, 49152)).astype(np.float32)
    logits[1, [77, 30000]] = 9.0  # a tie: the lower index wins, as in numpy
    logits[2, :] = -np.inf
    logits[2, 12345] = -1e30
    logits[3, 49151] = 50.0  # the very last column
    np.testing.assert_array_equal(gpu.argmax(logits), logits.argmax(-1))


# --- KV buffers used by edge's op-by-op composition ---------------------------------------------------
def test_kv_buffer_writes_and_reads_positions(gpu):
    keys, values = gpu.allocate_kv(10, 2, 8)
    rng = np.random.default_rng(6)
    block = rng.standard_normal((4, 2, 8)).astype(np.float32)
    keys[3:7] = block
    values[0:4] = block
    np.testing.assert_array_equal(keys[3:7], block)
    np.testing.assert_array_equal(values[:4], block)
    assert keys[:0].shape == (0, 2, 8)
    with pytest.raises(ValueError, match=r"cannot write \(4, 2, 8\) into positions 0:3"):
        keys[0:3] = block


# --- the kernels shaped for real GPUs, run here too ---------------------------------------------------
def test_gpu_shaped_linear_kernels_on_this_device():
    # A discrete GPU gets 32 threads per row with a reduction in workgroup memory, and no uniform
    # input windows; on lavapipe that shape is not the default, so run it explicitly.
    from devices.gpu.launches import Tuning

    shaped = open_gpu(tuning=Tuning.for_device(is_cpu=False))
    rng = np.random.default_rng(12)
    for scheme in (Scheme("int4", 32, False), Scheme("int8", 128, True), Scheme("f16")):
        stored, values = random_weight(rng, 70, 1100, scheme)  # 1100 > 512: two staged tiles for 8 tokens
        weight = shaped.prepare_weight(stored)
        for n_tokens in (1, 11):
            x = rng.standard_normal((n_tokens, 1100)).astype(np.float32)
            bound = dot_error_bound(x, term_magnitude(stored, values))
            assert_within(shaped.linear(x, weight), reference.linear(x, stored), bound, f"{scheme} T={n_tokens}")
