"""Saved sessions: a session's KV state, position and token history in one file, so that a later
session starts from the saved prefix without running its prefill.

File layout (little-endian):
    8 bytes   magic b"ZLLMSESS"
    4 bytes   format version (uint32)
    8 bytes   header length H (uint64)
    32 bytes  sha256 of the version, the header length, the header and the payload (version 1
              files, still read: of the header and payload only)
    H bytes   header, UTF-8 JSON: the model's identity (sha256 of its zllm.json, spec), the KV
              cache format and layout, capacity, length, tokens, and where each array lies in
              the payload, plus the payload's size
    payload   the cache arrays, as stored (quantized codes and scales stay quantized), for the
              positions each layer still holds (a ring-buffered layer: its last `window`)

Restoring writes the stored bytes back unchanged, so a session continued from a file computes
exactly what the saving session would have computed next. Everything a file says is checked before
it is used: its header's fields and their types, every array's place in the payload against the
model's KV layout, the token ids against the vocabulary, and float arrays for NaN and infinity;
a file that fails any check is a SessionError naming what is wrong.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct

import numpy as np

from devices.cache_buffers import CacheBuffer
from edge.core.arguments import integer, is_integer, path_argument, printable
from edge.core.errors import SessionError
from edge.core.files import write_atomically
from quant.checkpoint import MANIFEST, sha256_file
from quant.formats import first_non_finite

MAGIC = b"ZLLMSESS"
FORMAT_VERSION = 2
SUPPORTED_VERSIONS = (1, 2)
_PREAMBLE = struct.Struct("<8sIQ32s")
_CHECKED_FIELDS = struct.Struct("<IQ")  # version and header length, covered by the checksum from version 2
STORED_DTYPES = ("<f4", "<f2", "|i1")  # what KV caches store (values, codes, scales)


def _checksum(version: int, header_bytes: bytes, payload: bytes) -> bytes:
    covered = b"" if version == 1 else _CHECKED_FIELDS.pack(version, len(header_bytes))
    return hashlib.sha256(covered + header_bytes + payload).digest()


def model_identity(model) -> dict:
    """What a saved session must match: the checkpoint's manifest (it lists every tensor's sha256)."""
    identity = getattr(model, "_session_identity", None)
    if identity is None:
        identity = {"manifest_sha256": sha256_file(os.path.join(model.path, MANIFEST)),
                    "model_type": model.spec.model_type}
        model._session_identity = identity
    return identity


def _stored_arrays(buffer, rows: np.ndarray) -> dict[str, np.ndarray]:
    if isinstance(buffer, CacheBuffer):
        return {key: array[rows] for key, array in buffer.storage.items()}
    if isinstance(buffer, np.ndarray):
        return {"values": buffer[rows]}
    raise SessionError(f"this device's KV buffers ({type(buffer).__name__}) cannot be saved; "
                       f"save sessions from device 'cpu' or 'reference'")


def _store_arrays(buffer, rows: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
    targets = buffer.storage if isinstance(buffer, CacheBuffer) else {"values": buffer}
    for key, array in arrays.items():
        targets[key][rows] = array


def save_session(session, path) -> None:
    path = path_argument("path", path)
    cache = session.cache
    model = session.model
    entries, chunks, offset = [], [], 0
    for layer, buffers in enumerate(cache.layers):
        positions = cache.held_positions(layer)
        rows = cache.rows_of(layer, positions)
        for part, buffer in zip(cache.slots[layer].parts, buffers):
            for key, array in _stored_arrays(buffer, rows).items():
                data = np.ascontiguousarray(array).tobytes()
                entries.append({"layer": layer, "part": part.name, "array": key, "dtype": array.dtype.str,
                                "shape": list(array.shape), "positions": [int(positions[0]), int(positions[-1]) + 1]
                                if len(positions) else [0, 0], "offset": offset, "nbytes": len(data)})
                chunks.append(data)
                offset += len(data)
    payload = b"".join(chunks)
    header = {
        "format_version": FORMAT_VERSION,
        "model": model_identity(model),
        "kv_cache": model.transformer.kv_format,
        "layout": cache.describe()["layers"],
        "capacity": cache.capacity,
        "length": cache.length,
        "tokens": list(session.tokens),
        "arrays": entries,
        "payload_bytes": len(payload),
    }
    header_bytes = json.dumps(header).encode()
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise SessionError(f"cannot save the session to {printable(path)}: the directory {printable(folder)} does not "
                           "exist; create it first")
    checksum = _checksum(FORMAT_VERSION, header_bytes, payload)

    def write(f) -> None:
        f.write(_PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header_bytes), checksum))
        f.write(header_bytes)
        f.write(payload)

    try:  # a crash mid-write never leaves a half-written session under `path`
        write_atomically(path, write, binary=True)
    except OSError as exc:
        raise SessionError(f"cannot save the session to {printable(path)}: {exc.strerror or exc}") from None


def read_session_file(path) -> tuple[dict, bytes]:
    """(header, payload) of a saved session, checked: magic, version, sizes and checksum. Lengths are
    checked against the file's size before anything is read, so that a damaged length field cannot
    ask for more memory than the file holds."""
    path = os.fspath(path)
    name = printable(path)  # in messages
    if not os.path.isfile(path):
        raise SessionError(f"{name}: no saved session there; save one with session.save(path)")
    size = os.path.getsize(path)
    truncated = f"{name}: the saved session is truncated"
    with open(path, "rb") as f:
        preamble = f.read(_PREAMBLE.size)
        if not preamble:
            raise SessionError(f"{name} is empty, not a saved zllm session; save one with session.save(path)")
        if not preamble.startswith(MAGIC[:len(preamble)]):
            raise SessionError(f"{name} is not a saved zllm session (magic {preamble[:8]!r}, expected {MAGIC!r})")
        if len(preamble) < _PREAMBLE.size:
            raise SessionError(f"{truncated}: {size} bytes, fewer than its {_PREAMBLE.size}-byte preamble; "
                               "save the session again")
        _, version, header_length, checksum = _PREAMBLE.unpack(preamble)
        if version not in SUPPORTED_VERSIONS:
            raise SessionError(f"{name}: saved session format version {version} is not supported; supported: "
                               f"{', '.join(map(str, SUPPORTED_VERSIONS))}; save the session again with this version")
        if header_length > size - _PREAMBLE.size:
            raise SessionError(f"{truncated} (or its header length is damaged): the header should take "
                               f"{header_length} bytes but {size - _PREAMBLE.size} follow the preamble; "
                               "save the session again")
        header_bytes = f.read(header_length)
        payload = f.read()
    if _checksum(version, header_bytes, payload) != checksum:
        try:
            expected = json.loads(header_bytes)["payload_bytes"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            expected = None
        if expected is not None and len(payload) != expected:
            raise SessionError(f"{name}: the saved session is truncated or padded: {len(payload)} bytes of KV data, "
                               f"expected {expected}; save the session again")
        raise SessionError(f"{name}: the saved session fails its sha256 checksum (the file is corrupted); "
                           f"save the session again")
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise SessionError(f"{name}: the saved session's header is not valid JSON ({exc}); save the session again") \
            from None
    return header, payload


def _field(path, header: dict, key: str, check, wanted: str):
    value = header.get(key) if isinstance(header, dict) else None
    if not check(value):
        raise SessionError(f"{path}: the saved session's header field {key!r} should be {wanted}, got "
                           f"{_shown(value)}; save the session again")
    return value


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _checked_header(path, header, payload: bytes, vocab_size: int) -> dict:
    """The header's fields, each checked for its type and range and every array's extent against the
    payload (a header edited and checksummed again must still not index past it or mislabel it)."""
    if not isinstance(header, dict):
        raise SessionError(f"{path}: the saved session's header is a JSON {type(header).__name__}, not an object; "
                           "save the session again")
    model = _field(path, header, "model", lambda v: isinstance(v, dict) and all(
        isinstance(v.get(k), str) for k in ("manifest_sha256", "model_type")), "the model's identity")
    kv_cache = _field(path, header, "kv_cache", lambda v: isinstance(v, str), "a KV cache format")
    capacity = _field(path, header, "capacity", lambda v: is_integer(v, 1), "a positive integer")
    length = _field(path, header, "length", lambda v: is_integer(v, 0) and v <= capacity,
                    f"an integer in [0, capacity {capacity}]")
    tokens = _field(path, header, "tokens", lambda v: isinstance(v, list) and len(v) == length and all(
        is_integer(t, 0) and t < vocab_size for t in v), f"{length} token ids below the vocabulary's {vocab_size}")
    _field(path, header, "payload_bytes", lambda v: v == len(payload), f"the payload's size, {len(payload)}")

    def array_entry(entry) -> bool:
        if not isinstance(entry, dict) or not all(is_integer(entry.get(k), 0) for k in ("layer", "offset", "nbytes")):
            return False
        if not (isinstance(entry.get("part"), str) and isinstance(entry.get("array"), str)
                and entry.get("dtype") in STORED_DTYPES):
            return False
        shape = entry.get("shape")
        if not (isinstance(shape, list) and all(is_integer(n, 0) for n in shape)):
            return False
        return (entry["offset"] + entry["nbytes"] <= len(payload)
                and entry["nbytes"] == math.prod(shape) * np.dtype(entry["dtype"]).itemsize)

    arrays = _field(path, header, "arrays", lambda v: isinstance(v, list) and all(array_entry(e) for e in v),
                    "a list of arrays (layer, part, array, a KV dtype, shape, and an offset and size inside the "
                    "payload that agree with them)")
    return {"model": model, "kv_cache": kv_cache, "capacity": capacity, "length": length, "tokens": tokens,
            "arrays": arrays}


def restore_session(model, path, capacity: int | None = None):
    """A new session of `model` holding the saved state (no prefill runs)."""
    if capacity is not None:  # checked before the file is read: "10" or 1.5 is a caller's mistake, not a file's
        capacity = integer("capacity", capacity, minimum=1)
    path = path_argument("path", path)
    header, payload = read_session_file(path)
    shown = printable(path)  # in messages
    header = _checked_header(shown, header, payload, model.spec.vocab_size)
    identity = model_identity(model)
    if header["model"] != identity:
        raise SessionError(
            f"{shown} was saved from a different model ({header['model']['model_type']}, manifest sha256 "
            f"{header['model']['manifest_sha256'][:12]}...), not {model.path} ({identity['model_type']}, manifest "
            f"sha256 {identity['manifest_sha256'][:12]}...); load it with the model that saved it"
        )
    kv_format = model.transformer.kv_format
    if header["kv_cache"] != kv_format:
        raise SessionError(f"{shown} holds a {header['kv_cache']} KV cache but the model was loaded with "
                           f"kv_cache={kv_format!r}; load the model with kv_cache={header['kv_cache']!r}")
    length = header["length"]
    capacity = header["capacity"] if capacity is None else capacity
    if capacity < length:
        raise SessionError(f"{shown} holds {length} positions, more than the capacity {capacity} asked for; "
                           f"pass capacity >= {length}")
    by_part: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for entry in header["arrays"]:
        data = payload[entry["offset"]:entry["offset"] + entry["nbytes"]]
        array = np.frombuffer(data, dtype=np.dtype(entry["dtype"])).reshape(entry["shape"])
        if array.dtype.kind == "f" and first_non_finite(array) is not None:
            raise SessionError(f"{shown}: layer {entry['layer']} {entry['part']} ({entry['array']} array) holds "
                               "NaN or infinite values; the file is damaged, save the session again")
        by_part.setdefault((entry["layer"], entry["part"]), {})[entry["array"]] = array
    session = model.session(capacity)
    try:
        cache = session.cache
        cache.length = length
        for layer, buffers in enumerate(cache.layers):
            positions = cache.held_positions(layer)
            rows = cache.rows_of(layer, positions)
            for part, buffer in zip(cache.slots[layer].parts, buffers):
                arrays = by_part.pop((layer, part.name), None)
                expected = _stored_arrays(buffer, rows)
                if arrays is None or _kinds(arrays) != _kinds(expected):
                    raise SessionError(f"{shown}: layer {layer} {part.name} does not match this model's KV "
                                       f"layout; the file was saved with another layout, save the session again")
                _store_arrays(buffer, rows, arrays)
        if by_part:
            layer, part = next(iter(by_part))
            raise SessionError(f"{shown}: layer {layer} {part} is not part of this model's KV cache; the file was "
                               "saved with another layout, save the session again")
    except BaseException:
        session.close()
        raise
    session.tokens = list(header["tokens"])
    return session


def _kinds(arrays: dict[str, np.ndarray]) -> dict[str, tuple]:
    """What a layer part's arrays must agree on: name -> (shape, dtype)."""
    return {key: (array.shape, array.dtype.str) for key, array in arrays.items()}
