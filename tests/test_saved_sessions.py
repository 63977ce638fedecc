"""Saved sessions: `session.save(path)` and `model.load_session(path)`.

A session continued from a file computes exactly (bit for bit) what the saving session computes
next, on every device that can save and for every cache layout (f32/f16/int8 K/V, ring-buffered
sliding layers, MLA latents); prefix reuse skips the prefix's prefill and agrees with one full
prefill: bit for bit on the CPU backend, to f32 rounding on the reference (numpy's matrix
products sum in an order that depends on the number of tokens). Files
from another model, another KV format, or damaged ones are refused with a SessionError.
"""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from tiny_models import random_prompt, tiny_zoo  # noqa: F401

import edge
from converters.convert import QuantPlan
from edge.core.errors import SessionError

F32 = QuantPlan(weights="f32")
PROMPT = random_prompt(20, seed=11)
PREFIX = 12
FULL_PREFILL_TOL = 1e-5  # relative to the largest logit: f32 rounding of reordered sums


@pytest.mark.parametrize("case, device, kv_cache", [
    ("llama_gqa_tied", "reference", "f32"),
    ("llama_gqa_tied", "cpu", "f32"),
    ("qwen2_bias", "cpu", "int8"),
    ("qwen2_layer_types", "reference", "f16"),
    ("qwen2_layer_types", "cpu", "int8"),
    ("deepseek_v2_mla", "reference", "int8"),
    ("deepseek_v3_mla", "cpu", "f16"),
])
def test_a_restored_session_continues_bit_for_bit(case, device, kv_cache, tiny_zoo, tmp_path):
    model = edge.load(tiny_zoo.converted(case, F32), device=device, kv_cache=kv_cache)
    saving = model.session(capacity=32)
    saving.prefill(PROMPT[:PREFIX])
    path = tmp_path / "prefix.zsession"
    saving.save(path)
    continued = [saving.prefill(PROMPT[PREFIX:], all_logits=True), saving.decode(5), saving.decode(9)]

    restored = model.load_session(path)
    assert restored.position == PREFIX and restored.tokens == PROMPT[:PREFIX] and restored.capacity == 32
    resumed = [restored.prefill(PROMPT[PREFIX:], all_logits=True), restored.decode(5), restored.decode(9)]
    for a, b in zip(continued, resumed):
        assert np.array_equal(a, b)
    assert restored.tokens == saving.tokens

    full = model.session(capacity=32).prefill(PROMPT, all_logits=True)
    error = np.abs(full[PREFIX:] - resumed[0]).max() / np.abs(full).max()
    assert error <= FULL_PREFILL_TOL
    if device == "cpu":  # the CPU kernels sum each token's row in an order independent of T
        assert np.array_equal(full[PREFIX:], resumed[0])


def test_restoring_into_a_larger_capacity(tiny_zoo, tmp_path):
    model = edge.load(tiny_zoo.converted("mistral_swa4", F32), device="reference")
    session = model.session(capacity=16)
    session.prefill(PROMPT[:10])  # longer than the window of 4: the ring holds positions 6..9
    session.save(tmp_path / "s")
    expected = session.decode(3)
    restored = model.load_session(tmp_path / "s", capacity=32)
    assert restored.capacity == 32
    assert np.array_equal(restored.decode(3), expected)
    with pytest.raises(SessionError) as error:
        model.load_session(tmp_path / "s", capacity=8)
    assert str(error.value) == (f"{tmp_path / 's'} holds 10 positions, more than the capacity 8 asked for; "
                                f"pass capacity >= 10")


@pytest.fixture
def saved(tiny_zoo, tmp_path):
    model = edge.load(tiny_zoo.converted("llama_mha", F32), device="reference")
    session = model.session(capacity=16)
    session.prefill(PROMPT[:6])
    path = tmp_path / "six.zsession"
    session.save(path)
    return model, path


def test_another_model_is_refused(saved, tiny_zoo):
    _, path = saved
    other = edge.load(tiny_zoo.converted("llama_mqa", F32), device="reference")
    with pytest.raises(SessionError) as error:
        other.load_session(path)
    message = str(error.value)
    assert message.startswith(f"{path} was saved from a different model (llama, manifest sha256 ")
    assert message.endswith("...); load it with the model that saved it")
    assert other.path in message


def test_another_kv_format_is_refused(saved, tiny_zoo):
    _, path = saved
    int8 = edge.load(tiny_zoo.converted("llama_mha", F32), device="reference", kv_cache="int8")
    with pytest.raises(SessionError) as error:
        int8.load_session(path)
    assert str(error.value) == (f"{path} holds a f32 KV cache but the model was loaded with kv_cache='int8'; "
                                f"load the model with kv_cache='f32'")


def test_damaged_files_are_refused(saved, tmp_path):
    model, path = saved
    data = path.read_bytes()
    cases = {
        "corrupted": data[:-100] + bytes([data[-100] ^ 1]) + data[-99:],
        "truncated": data[:-40],
        "foreign": b"PK\x03\x04" + data[4:],
        "future": data[:8] + struct.pack("<I", 99) + data[12:],
    }
    messages = {
        "corrupted": "the saved session fails its sha256 checksum (the file is corrupted); save the session again",
        "truncated": "the saved session is truncated or padded: {n} bytes of KV data, expected {m}; save the "
                     "session again",
        "foreign": "is not a saved zllm session (magic b'PK\\x03\\x04SESS', expected b'ZLLMSESS')",
        "future": "saved session format version 99 is not supported; supported: 1; save the session again with "
                  "this version",
    }
    for name, content in cases.items():
        damaged = tmp_path / name
        damaged.write_bytes(content)
        with pytest.raises(SessionError) as error:
            model.load_session(damaged)
        expected = messages[name]
        if name == "truncated":
            payload = 6 * 2 * 2 * 4 * 16 * 4  # positions x layers x (K, V) x heads x head_dim x 4 bytes
            expected = expected.format(n=payload - 40, m=payload)
        separator = " " if name == "foreign" else ": "
        assert str(error.value) == f"{damaged}{separator}{expected}"
    with pytest.raises(SessionError) as error:
        model.load_session(tmp_path / "missing")
    assert str(error.value) == f"{tmp_path / 'missing'}: no saved session there; save one with session.save(path)"
    assert os.path.exists(path) and not os.path.exists(str(path) + ".partial")
