"""CPU attention that reads f16 / int8 KV caches as stored (kernels/cpu/attention_stored.py).

The oracle is "dequantize, then the f32 reference attention" (devices/reference.py). The kernel
widens each stored row to exactly the values the numpy dequantization gives, so the two differ by
f32 summation order only: outputs are softmax averages of values ~N(0, 1), and over thousands of
keys that rounding stays below 1e-5.
"""
from __future__ import annotations

import numpy as np
import pytest
from test_kv_cache_formats import LOGIT_GAIN
from tiny_models import random_prompt, tiny_zoo  # noqa: F401

import edge
from converters.convert import QuantPlan
from devices.cache_buffers import CacheBuffer, StoredRows
from devices.cpu import CpuBackend
from devices.reference import ReferenceBackend
from devices.reference import attention as reference_attention
from edge.attention import attend_stored
from edge.core.contract import Capabilities
from edge.core.errors import ZllmError
from kernels.cpu.attention_stored import stored_attention
from quant import kv_formats

F32 = QuantPlan(weights="f32")
ATOL = 1e-5


def stored(fmt: str, x: np.ndarray) -> StoredRows:
    group = kv_formats.kv_group_size(x.shape[-1])
    if fmt == "int8":
        return StoredRows("int8", group, *kv_formats.quantize_int8(x, group))
    return StoredRows("f16", group, x.astype(np.float16))


def dequantized(rows: StoredRows) -> np.ndarray:
    if rows.format == "int8":
        return kv_formats.dequantize_int8(rows.data, rows.scales, rows.group)
    return rows.data.astype(np.float32)


# (query heads, KV heads, head dim): GQA, MQA, MHA; head dims with groups of 32 and a whole-row group
SHAPES = [(8, 2, 64), (4, 1, 24), (3, 3, 32)]


@pytest.mark.parametrize("fmt", ["f16", "int8"])
@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
@pytest.mark.parametrize("n_tokens,n_keys,window", [(1, 3001, None), (1, 2500, 700), (7, 300, None), (5, 97, 16)])
def test_stored_attention_matches_dequantize_then_reference(fmt, heads, kv_heads, dim, n_tokens, n_keys, window):
    rng = np.random.default_rng(n_keys + dim)
    q = rng.standard_normal((n_tokens, heads, dim)).astype(np.float32)
    keys = stored(fmt, rng.standard_normal((n_keys, kv_heads, dim)).astype(np.float32))
    values = stored(fmt, rng.standard_normal((n_keys, kv_heads, dim)).astype(np.float32))
    k_positions = np.arange(n_keys)
    q_positions = np.arange(n_keys - n_tokens, n_keys)
    expected = reference_attention(q, dequantized(keys), dequantized(values), q_positions, k_positions, 0.2, window)
    for n_threads in (1, 3):
        ours = stored_attention(q, fmt, keys.group, keys.data, keys.scales, values.data, values.scales, q_positions,
                                k_positions, 0.2, window, n_threads)
        assert ours.dtype == np.float32 and ours.shape == (n_tokens, heads, dim)
        np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("fmt", ["f16", "int8"])
def test_ring_buffer_positions_out_of_order(fmt):
    """A ring slot hands rows in storage order (p % W), not position order: the kernel masks by the
    positions themselves, whatever their order."""
    rng = np.random.default_rng(3)
    window, end = 64, 1000
    held = np.arange(end - window + 1, end - 3)
    fresh = np.arange(end - 3, end)
    k_positions = np.concatenate([np.roll(held, 17), fresh])
    n_keys = len(k_positions)
    q = rng.standard_normal((3, 4, 32)).astype(np.float32)
    keys = stored(fmt, rng.standard_normal((n_keys, 2, 32)).astype(np.float32))
    values = stored(fmt, rng.standard_normal((n_keys, 2, 32)).astype(np.float32))
    expected = reference_attention(q, dequantized(keys), dequantized(values), fresh, k_positions, 0.3, window)
    ours = CpuBackend(threads=2).attention_over_cache(q, keys, values, fresh, k_positions, 0.3, window)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    reference = ReferenceBackend().attention_over_cache(q, keys, values, fresh, k_positions, 0.3, window)
    np.testing.assert_array_equal(reference, expected)


def test_stored_attention_refuses_mismatched_inputs():
    q = np.zeros((1, 4, 32), np.float32)
    keys = stored("int8", np.ones((10, 2, 32), np.float32))
    with pytest.raises(ValueError) as error:
        stored_attention(q, "int8", 32, keys.data, keys.scales[:5], keys.data, keys.scales, np.array([9]),
                         np.arange(10), 1.0, None, 2)
    assert str(error.value) == ("stored attention: int8 scales [5, 2, 1] / [10, 2, 1] do not match groups of 32 "
                                "over keys [10, 2, 32]")
    with pytest.raises(ValueError) as error:
        stored_attention(q, "q4", 32, keys.data, None, keys.data, None, np.array([9]), np.arange(10), 1.0, None, 2)
    assert str(error.value) == "stored attention: KV format 'q4' is not one of f16, int8"


def test_backends_without_stored_attention_refuse_compressed_rows():
    class Float32Only:
        name = "f32only"
        capabilities = Capabilities()  # nothing beyond the operations every backend has

    keys = stored("f16", np.ones((4, 1, 8), np.float32))
    with pytest.raises(ZllmError) as error:
        attend_stored(Float32Only(), np.zeros((1, 1, 8), np.float32), keys, keys, np.array([3]), np.arange(4), 1.0,
                      None)
    assert str(error.value) == ("device 'f32only' cannot attend over a f16 KV cache; it reads float32 K/V only; "
                                "use kv_cache='f32' or device 'cpu' / 'reference'")


@pytest.mark.parametrize("fmt", ["f16", "int8"])
@pytest.mark.parametrize("case", ["llama_mha", "qwen2_layer_types"])
def test_cpu_decode_never_dequantizes_the_cache(fmt, case, tiny_zoo, monkeypatch):
    """Full slots are attended through views of the stored arrays; the only rows widened in numpy are
    a ring slot's window. Prefill, chunked prefill and decode agree with the reference backend within
    the format's bound: both store K/V rounded from f32 values computed in different orders (the
    summation order of each instruction set's kernels), so an element that straddles a rounding
    boundary is stored one step apart (test_kv_cache_formats.LOGIT_GAIN x the format's bound)."""
    path = tiny_zoo.converted(case, F32)
    prompt = random_prompt(12, seed=5)
    reference = edge.load(path, device="reference", kv_cache=fmt).session(capacity=32)
    expected = [reference.prefill(prompt[:9], all_logits=True), reference.prefill(prompt[9:], all_logits=True)]
    expected += [reference.decode(token) for token in (5, 7, 11)]

    # attention reads f16 / int8 rows as stored: widening the cache in numpy would fail the test
    monkeypatch.setattr(CacheBuffer, "decode", lambda self, rows: pytest.fail("the cache was widened to f32"))
    monkeypatch.setattr(CacheBuffer, "__getitem__", lambda self, index: pytest.fail("the cache was read as f32"))
    session = edge.load(path, device="cpu", kv_cache=fmt).session(capacity=32)
    ours = [session.prefill(prompt[:9], all_logits=True), session.prefill(prompt[9:], all_logits=True)]
    ours += [session.decode(token) for token in (5, 7, 11)]
    for a, b in zip(ours, expected):
        np.testing.assert_allclose(a, b, rtol=0, atol=LOGIT_GAIN * kv_formats.kv_relative_error_bound(fmt) * np.abs(b).max())
    cache = session.cache
    for layer, slot in enumerate(cache.slots):
        keys = slot.parts[0]
        new = np.zeros((1, keys.heads, keys.dim), np.float32)
        (stored_keys, _), positions = cache.append_stored(layer, cache.length, (new, new))
        assert stored_keys.format == fmt and len(stored_keys.data) == len(positions)
        if not slot.ring:  # a full slot hands out views of its buffers: nothing is copied
            storage = cache.layers[layer][0].storage["codes" if fmt == "int8" else "values"]
            assert np.shares_memory(stored_keys.data, storage)
