"""KV cache storage formats (f32, f16, int8 per group): the codecs, the error they add to logits,
their memory per token, split-KV decode at long context, and the devices that refuse them.

Error model. A stored element x comes back as x + e with |e| <= eps * m, where m is |x| (f16,
eps = 2^-11) or its group's max |x| (int8: half a code step, eps = 1/254, plus the f16 scale's
rounding); `quant.kv_formats.kv_relative_error_bound`. Attention scores move by about eps |q| |k|
and outputs by eps |v|, so logits move in proportion to eps; the gain through the network is not
bounded a priori, and it grows with the context (more keys, more rounding in every softmax).
Measured gains (max logit change / max |logit|, divided by eps): f16 <= 1.1 and int8 <= 3 on the
tiny models at 20-23 positions, int8 4.7 on SmolLM2 over a 40-token prompt; at 256 tokens SmolLM2
reaches 11 (int8, 4.8e-2) and 5 (f16), see benchmarks/kv_context.py. The tests, at the lengths
they use, allow LOGIT_GAIN = 8.
"""
from __future__ import annotations

import numpy as np
import pytest
from tiny_models import CASE_NAMES, random_prompt, tiny_zoo  # noqa: F401

import edge
from converters.convert import QuantPlan
from devices.cache_buffers import CacheBuffer
from devices.cpu import CpuBackend
from devices.reference import ReferenceBackend
from devices.reference import attention as reference_attention
from edge.core.errors import ZllmError
from kernels.cpu import attention as cpu_attention
from kernels.cpu import kv_quant
from quant import kv_formats

LOGIT_GAIN = 8.0
F32 = QuantPlan(weights="f32")


def rows(n=40, heads=3, dim=64, seed=0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, heads, dim)).astype(np.float32)
    x[1, 0, :32] = 0.0  # an all-zero group
    x[2] *= 1000.0      # a large row
    return x


@pytest.mark.parametrize("fmt", ["f16", "int8"])
@pytest.mark.parametrize("backend", [ReferenceBackend(), CpuBackend()], ids=["reference", "cpu"])
def test_stored_values_stay_within_the_format_bound(fmt, backend):
    x = rows()
    buffer = backend.allocate_cache(64, 3, 64, fmt)
    buffer[5:45] = x
    back = buffer[5:45]
    assert back.dtype == np.float32 and back.shape == x.shape
    bound = kv_formats.kv_relative_error_bound(fmt)
    if fmt == "f16":
        reach = np.abs(x)
    else:
        group = kv_formats.kv_group_size(64)
        reach = np.repeat(np.abs(x.reshape(40, 3, -1, group)).max(-1), group, axis=-1)
    assert np.all(np.abs(back - x) <= bound * reach)
    assert np.array_equal(back[1, 0, :32], np.zeros(32))
    np.testing.assert_array_equal(buffer.round_trip(x), back)


def test_cpu_and_reference_int8_codes_are_identical():
    x = rows(n=200, heads=2, dim=96, seed=3)
    codes, scales = kv_formats.quantize_int8(x, 32)
    cpu_codes, cpu_scales = kv_quant.quantize_int8(x, 32)
    np.testing.assert_array_equal(cpu_codes, codes)
    np.testing.assert_array_equal(cpu_scales, scales)
    np.testing.assert_array_equal(kv_quant.dequantize_int8(codes, scales, 32),
                                  kv_formats.dequantize_int8(codes, scales, 32))


def test_cpu_widens_every_half_like_numpy():
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16).reshape(256, 256)  # every bit pattern
    ours, expected = kv_quant.widen_halves(halves), halves.astype(np.float32)
    np.testing.assert_array_equal(ours, expected)  # nan == nan here; signed zeros below
    assert np.array_equal(np.signbit(ours), np.signbit(expected))


def test_bytes_per_token_of_each_format():
    assert [kv_formats.kv_bytes_per_row(fmt, 3, 64) for fmt in kv_formats.KV_FORMATS] == [768, 384, 192 + 12]
    assert kv_formats.kv_group_size(24) == 24 and kv_formats.kv_bytes_per_row("int8", 2, 24) == 48 + 4
    with pytest.raises(ValueError, match="KV cache format 'bf16' is unknown; known formats: f32, f16, int8"):
        CacheBuffer(4, 1, 32, "bf16", None)


@pytest.mark.parametrize("fmt", ["f16", "int8"])
@pytest.mark.parametrize("device", ["reference", "cpu"])
@pytest.mark.parametrize("case", ["llama_gqa_tied", "qwen3_qknorm", "deepseek_v2_mla"])
def test_logit_error_follows_the_format(case, device, fmt, tiny_zoo):
    prompt = random_prompt(20, seed=5)
    path = tiny_zoo.converted(case, F32)
    exact = edge.load(path, device=device).session(32)
    lossy = edge.load(path, device=device, kv_cache=fmt).session(32)
    expected = [exact.prefill(prompt, all_logits=True)] + [exact.decode(t) for t in (7, 11, 13)]
    ours = [lossy.prefill(prompt, all_logits=True)] + [lossy.decode(t) for t in (7, 11, 13)]
    error = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(ours, expected))
    assert 0 < error <= LOGIT_GAIN * kv_formats.kv_relative_error_bound(fmt)
    assert lossy.cache.bytes_per_token < exact.cache.bytes_per_token


@pytest.mark.parametrize("case", [*CASE_NAMES, "mixtral", "qwen2_moe_shared"])
def test_cpu_fused_executor_reads_an_f16_cache_as_the_op_by_op_path_does(case, tiny_zoo):
    # every head size and grouping of the dense families (head_dim 8 to 64, MQA, MHA), MoE layers;
    # a sliding layer's ring buffer still runs op by op
    prompt = random_prompt(20, seed=9)
    model = edge.load(tiny_zoo.converted(case, F32), device="cpu:f32", kv_cache="f16")
    transformer = model.transformer
    assert transformer._fused_forward is not None  # f16 K/V no longer sends the model op by op
    fused, ops = transformer.new_cache(32), transformer.new_cache(32)
    steps = [(np.asarray(prompt), True)] + [(np.array([t]), False) for t in (7, 11, 13)]
    for ids, all_logits in steps:
        ours = transformer.forward(ids, fused, all_logits)
        expected = transformer.forward_ops(ids, ops, all_logits)
        # the same kernels up to their summation order; an f16 rounding that flips on that noise
        # changes a value by one f16 step, within the format's bound
        assert np.abs(ours - expected).max() <= LOGIT_GAIN * kv_formats.kv_relative_error_bound("f16") * \
            np.abs(expected).max()
    assert fused.length == ops.length == len(prompt) + 3
    # the first layer's keys and values come from identical inputs: the same f16 bits, written by
    # the fused kernel's rounding and by numpy's
    for ours, expected in zip(fused.layers[0], ops.layers[0]):
        np.testing.assert_array_equal(ours.storage["values"][:fused.length].view(np.uint16),
                                      expected.storage["values"][:ops.length].view(np.uint16))


def test_int8_kv_on_smollm2(smollm2_checkpoint):
    # cpu:f32, so that the difference is the cache's alone: the default variant also rounds every
    # matmul input to int8, and a cache's small change then flips whole steps of that rounding
    model = edge.load(smollm2_checkpoint, device="cpu:f32")
    quantized = edge.load(smollm2_checkpoint, device="cpu:f32", kv_cache="int8")
    ids = model.encode("The history of the printing press begins in the fifteenth century, when Johannes "
                       "Gutenberg combined movable metal type, oil-based ink and a wooden press.")
    expected = model.session(64).prefill(ids, all_logits=True)
    session = quantized.session(64)
    ours = session.prefill(ids, all_logits=True)
    error = np.abs(ours - expected).max(axis=1) / np.abs(expected).max(axis=1)
    assert error.max() <= LOGIT_GAIN * kv_formats.kv_relative_error_bound("int8")
    assert np.array_equal(ours.argmax(axis=1), expected.argmax(axis=1))
    # 30 layers x (K + V) x 3 KV heads x 64: 184 bytes per head row (64 codes + 2 f16 scales)
    assert session.cache.bytes_per_token == 30 * 2 * 3 * (64 + 2 * 2)


@pytest.mark.parametrize("n_splits", [2, 3, 8])
def test_split_kv_decode_is_exact_at_long_context(n_splits):
    """One query token over 4096 keys (GQA 8/2), keys split n_splits ways and merged by log-sum-exp,
    against the single pass and against the numpy reference."""
    rng = np.random.default_rng(0)
    n_keys, heads, kv_heads, dim = 4096, 8, 2, 64
    q = rng.standard_normal((1, heads, dim)).astype(np.float32)
    k = rng.standard_normal((n_keys, kv_heads, dim)).astype(np.float32)
    v = rng.standard_normal((n_keys, kv_heads, dim)).astype(np.float32)
    q_positions, k_positions = np.array([n_keys - 1]), np.arange(n_keys)
    for window in (None, 1000):
        single = cpu_attention.attention(q, k, v, q_positions, k_positions, 0.125, window, 1)
        split = cpu_attention.attention(q, k, v, q_positions, k_positions, 0.125, window, n_splits)
        reference = reference_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                        q_positions, k_positions, 0.125, window)
        # outputs are softmax averages of values ~N(0, 1): f32 rounding over 4096 terms stays < 1e-5
        np.testing.assert_allclose(split, single, rtol=0, atol=2e-6)
        np.testing.assert_allclose(split, reference, rtol=0, atol=1e-5)


def test_unknown_kv_format_is_refused(tiny_zoo):
    with pytest.raises(ZllmError) as error:
        edge.load(tiny_zoo.converted("llama_mha", F32), kv_cache="q4")
    assert str(error.value) == "kv_cache 'q4' is unknown; choose one of f32, f16, int8"


def test_npu_refuses_what_it_does_not_implement(tiny_zoo):
    pytest.importorskip("onnxruntime")
    with pytest.raises(ZllmError) as error:
        edge.load(tiny_zoo.converted("llama_mha", F32), device="npu", kv_cache="int8")
    assert str(error.value) == ("device 'npu' does not implement the int8 KV cache (it has f32); use kv_cache='f32' "
                                "or device 'cpu' / 'reference'")
    path = tiny_zoo.converted("deepseek_v2_mla", F32)
    with pytest.raises(ZllmError) as error:
        edge.load(path, device="npu")
    assert str(error.value) == (f"{path}: device 'npu' does not implement MLA attention (it runs MHA/GQA/MQA with "
                                f"float32 K/V caches); use device 'cpu' or 'reference'")


def test_gpu_refuses_what_it_does_not_implement(tiny_zoo):
    from gpu_support import open_gpu

    open_gpu()  # skips where no Vulkan driver is installed
    path = tiny_zoo.converted("deepseek_v3_mla", F32)
    with pytest.raises(ZllmError) as error:
        edge.load(path, device="gpu")
    assert str(error.value) == (f"{path}: device 'gpu' does not implement MLA attention (it runs MHA/GQA/MQA with "
                                f"float32 K/V caches); use device 'cpu' or 'reference'")
    with pytest.raises(ZllmError) as error:
        edge.load(tiny_zoo.converted("llama_mha", F32), device="gpu", kv_cache="f16")
    assert str(error.value) == ("device 'gpu' does not implement the f16 KV cache (it has f32); use kv_cache='f32' "
                                "or device 'cpu' / 'reference'")
