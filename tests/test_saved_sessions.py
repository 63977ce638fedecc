"""Saved sessions: `session.save(path)` and `model.load_session(path)`.

A session continued from a file computes exactly (bit for bit) what the saving session computes
next, on every device that can save and for every cache layout (f32/f16/int8 K/V, ring-buffered
sliding layers, MLA latents); prefix reuse skips the prefix's prefill and agrees with one full
prefill: bit for bit on the CPU backend, to f32 rounding on the reference (numpy's matrix
products sum in an order that depends on the number of tokens). Files
from another model, another KV format, or damaged ones (also ones whose header was edited and
checksummed again, or whose payload holds NaN) are refused with a SessionError.
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
        "future": "saved session format version 99 is not supported; supported: 1, 2; save the session again with "
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


def _rewritten(data: bytes, edit=None, payload_edit=None, version: int = 2) -> bytes:
    """The saved session `data` with its header edited by edit(header) and its payload by
    payload_edit(bytearray), written back with a checksum that matches (as a careful forger would)."""
    import hashlib
    import json

    _, _, header_length, _ = struct.unpack("<8sIQ32s", data[:52])
    header = json.loads(data[52:52 + header_length])
    payload = bytearray(data[52 + header_length:])
    if edit is not None:
        edit(header)
    if payload_edit is not None:
        payload_edit(payload)
    header_bytes = json.dumps(header).encode()
    covered = b"" if version == 1 else struct.pack("<IQ", version, len(header_bytes))
    checksum = hashlib.sha256(covered + header_bytes + bytes(payload)).digest()
    return struct.pack("<8sIQ32s", b"ZLLMSESS", version, len(header_bytes), checksum) + header_bytes + bytes(payload)


def test_a_version_1_file_still_loads(saved, tmp_path):
    model, path = saved
    old = tmp_path / "v1.zsession"
    old.write_bytes(_rewritten(path.read_bytes(), version=1))
    assert np.array_equal(model.load_session(old).decode(3), model.load_session(path).decode(3))


def test_a_damaged_header_length_is_refused(saved, tmp_path):
    """The checksum covers the header length: moving the header's end is a checksum failure, not a
    header that no longer parses."""
    model, path = saved
    data = path.read_bytes()
    header_length = struct.unpack("<Q", data[12:20])[0]
    for length in (header_length - 1, header_length + 1, header_length ^ 2, 0):
        damaged = tmp_path / f"length{length}"
        damaged.write_bytes(data[:12] + struct.pack("<Q", length) + data[20:])
        with pytest.raises(SessionError) as error:
            model.load_session(damaged)
        assert str(error.value) == (f"{damaged}: the saved session fails its sha256 checksum (the file is "
                                    f"corrupted); save the session again")


def _set(key, value):
    return lambda header: header.__setitem__(key, value)


def _set_in_array(key, value, index=0):
    return lambda header: header["arrays"][index].__setitem__(key, value)


@pytest.mark.parametrize("edit, complaint", [
    (lambda header: header.clear(), "header field 'model' should be the model's identity, got None"),
    (_set("model", "llama"), "header field 'model' should be the model's identity, got 'llama'"),
    (_set("kv_cache", 8), "header field 'kv_cache' should be a KV cache format, got 8"),
    (_set("capacity", "16"), "header field 'capacity' should be a positive integer, got '16'"),
    (_set("capacity", 0), "header field 'capacity' should be a positive integer, got 0"),
    (_set("length", 17), "header field 'length' should be an integer in [0, capacity 16], got 17"),
    (_set("length", -1), "header field 'length' should be an integer in [0, capacity 16], got -1"),
    (_set("length", 6.0), "header field 'length' should be an integer in [0, capacity 16], got 6.0"),
    (_set("tokens", [1, 2]), "header field 'tokens' should be 6 token ids below the vocabulary's 160, got [1, 2]"),
    (_set("tokens", [1, 2, 3, 4, 5, 160]), "header field 'tokens' should be 6 token ids below the vocabulary's 160"),
    (_set("tokens", [[1], 2, 3, 4, 5, 6]), "header field 'tokens' should be 6 token ids below the vocabulary's 160"),
    (_set("payload_bytes", 7), "header field 'payload_bytes' should be the payload's size, 6144, got 7"),
    (_set("arrays", {}), "header field 'arrays' should be a list of arrays"),
    (_set_in_array("offset", 10 ** 9), "header field 'arrays' should be a list of arrays"),
    (_set_in_array("offset", -8), "header field 'arrays' should be a list of arrays"),
    (_set_in_array("nbytes", 0), "header field 'arrays' should be a list of arrays"),
    (_set_in_array("dtype", "<f8"), "header field 'arrays' should be a list of arrays"),
    (_set_in_array("dtype", "object"), "header field 'arrays' should be a list of arrays"),
    (_set_in_array("shape", [6, 2, -16]), "header field 'arrays' should be a list of arrays"),
    (_set_in_array("shape", [12, 2, 16]), "layer 0 keys does not match this model's KV layout"),
    (_set_in_array("layer", 7), "layer 0 keys does not match this model's KV layout"),
    (_set_in_array("part", "q"), "layer 0 keys does not match this model's KV layout"),
    (lambda header: header["arrays"].append(dict(header["arrays"][0], layer=9)),
     "layer 9 keys is not part of this model's KV cache"),
])
def test_an_edited_header_with_a_matching_checksum_is_refused(saved, tmp_path, edit, complaint):
    model, path = saved
    damaged = tmp_path / "edited"
    damaged.write_bytes(_rewritten(path.read_bytes(), edit))
    sessions = len(model._sessions)
    with pytest.raises(SessionError) as error:
        model.load_session(damaged)
    message = str(error.value)
    assert message.startswith(f"{damaged}") and complaint in message, message
    assert message.endswith("save the session again")
    assert len(model._sessions) == sessions  # a refused file holds no session open


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_non_finite_payload_is_refused(saved, tmp_path, value):
    model, path = saved
    damaged = tmp_path / "nan"
    damaged.write_bytes(_rewritten(path.read_bytes(),
                                   payload_edit=lambda payload: payload.__setitem__(slice(8, 12),
                                                                                    np.float32(value).tobytes())))
    with pytest.raises(SessionError) as error:
        model.load_session(damaged)
    assert str(error.value) == (f"{damaged}: layer 0 keys (values array) holds NaN or infinite values; the file is damaged, "
                                f"save the session again")
