"""Saved sessions: a session's KV state, position and token history in one file, so that a later
session starts from the saved prefix without running its prefill.

File layout (little-endian):
    8 bytes   magic b"ZLLMSESS"
    4 bytes   format version (uint32)
    8 bytes   header length H (uint64)
    32 bytes  sha256 of everything after it (header and payload)
    H bytes   header, UTF-8 JSON: the model's identity (sha256 of its zllm.json, spec), the KV
              cache format and layout, capacity, length, tokens, and where each array lies in
              the payload, plus the payload's size
    payload   the cache arrays, as stored (quantized codes and scales stay quantized), for the
              positions each layer still holds (a ring-buffered layer: its last `window`)

Restoring writes the stored bytes back unchanged, so a session continued from a file computes
exactly what the saving session would have computed next.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct

import numpy as np

from devices.cache_buffers import CacheBuffer
from edge.core.arguments import integer, path_argument
from edge.core.errors import SessionError
from edge.core.files import write_atomically
from quant.checkpoint import MANIFEST, sha256_file

MAGIC = b"ZLLMSESS"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
_PREAMBLE = struct.Struct("<8sIQ32s")


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
        raise SessionError(f"cannot save the session to {path}: the directory {folder} does not exist; create it first")
    checksum = hashlib.sha256(header_bytes + payload).digest()

    def write(f) -> None:
        f.write(_PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header_bytes), checksum))
        f.write(header_bytes)
        f.write(payload)

    try:  # a crash mid-write never leaves a half-written session under `path`
        write_atomically(path, write, binary=True)
    except OSError as exc:
        raise SessionError(f"cannot save the session to {path}: {exc.strerror or exc}") from None


def read_session_file(path) -> tuple[dict, bytes]:
    """(header, payload) of a saved session, checked: magic, version, sizes and checksum. Lengths are
    checked against the file's size before anything is read, so that a damaged length field cannot
    ask for more memory than the file holds."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise SessionError(f"{path}: no saved session there; save one with session.save(path)")
    size = os.path.getsize(path)
    truncated = f"{path}: the saved session is truncated"
    with open(path, "rb") as f:
        preamble = f.read(_PREAMBLE.size)
        if not preamble:
            raise SessionError(f"{path} is empty, not a saved zllm session; save one with session.save(path)")
        if not preamble.startswith(MAGIC[:len(preamble)]):
            raise SessionError(f"{path} is not a saved zllm session (magic {preamble[:8]!r}, expected {MAGIC!r})")
        if len(preamble) < _PREAMBLE.size:
            raise SessionError(f"{truncated}: {size} bytes, fewer than its {_PREAMBLE.size}-byte preamble; "
                               "save the session again")
        _, version, header_length, checksum = _PREAMBLE.unpack(preamble)
        if version not in SUPPORTED_VERSIONS:
            raise SessionError(f"{path}: saved session format version {version} is not supported; supported: "
                               f"{', '.join(map(str, SUPPORTED_VERSIONS))}; save the session again with this version")
        if header_length > size - _PREAMBLE.size:
            raise SessionError(f"{truncated} (or its header length is damaged): the header should take "
                               f"{header_length} bytes but {size - _PREAMBLE.size} follow the preamble; "
                               "save the session again")
        header_bytes = f.read(header_length)
        payload = f.read()
    if hashlib.sha256(header_bytes + payload).digest() != checksum:
        try:
            expected = json.loads(header_bytes)["payload_bytes"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            expected = None
        if expected is not None and len(payload) != expected:
            raise SessionError(f"{path}: the saved session is truncated or padded: {len(payload)} bytes of KV data, "
                               f"expected {expected}; save the session again")
        raise SessionError(f"{path}: the saved session fails its sha256 checksum (the file is corrupted); "
                           f"save the session again")
    return json.loads(header_bytes), payload


def restore_session(model, path, capacity: int | None = None):
    """A new session of `model` holding the saved state (no prefill runs)."""
    if capacity is not None:  # checked before the file is read: "10" or 1.5 is a caller's mistake, not a file's
        capacity = integer("capacity", capacity, minimum=1)
    path = path_argument("path", path)
    header, payload = read_session_file(path)
    identity = model_identity(model)
    if header["model"] != identity:
        raise SessionError(
            f"{os.fspath(path)} was saved from a different model ({header['model']['model_type']}, manifest sha256 "
            f"{header['model']['manifest_sha256'][:12]}...), not {model.path} ({identity['model_type']}, manifest "
            f"sha256 {identity['manifest_sha256'][:12]}...); load it with the model that saved it"
        )
    kv_format = model.transformer.kv_format
    if header["kv_cache"] != kv_format:
        raise SessionError(f"{os.fspath(path)} holds a {header['kv_cache']} KV cache but the model was loaded with "
                           f"kv_cache={kv_format!r}; load the model with kv_cache={header['kv_cache']!r}")
    length = header["length"]
    capacity = header["capacity"] if capacity is None else capacity
    if capacity < length:
        raise SessionError(f"{os.fspath(path)} holds {length} positions, more than the capacity {capacity} asked for; "
                           f"pass capacity >= {length}")
    session = model.session(capacity)
    cache = session.cache
    by_part: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for entry in header["arrays"]:
        data = payload[entry["offset"]:entry["offset"] + entry["nbytes"]]
        array = np.frombuffer(data, dtype=np.dtype(entry["dtype"])).reshape(entry["shape"])
        by_part.setdefault((entry["layer"], entry["part"]), {})[entry["array"]] = array
    cache.length = length
    for layer, buffers in enumerate(cache.layers):
        positions = cache.held_positions(layer)
        rows = cache.rows_of(layer, positions)
        for part, buffer in zip(cache.slots[layer].parts, buffers):
            arrays = by_part.get((layer, part.name))
            expected = _stored_arrays(buffer, rows)
            if arrays is None or {k: a.shape for k, a in arrays.items()} != {k: a.shape for k, a in expected.items()}:
                raise SessionError(f"{os.fspath(path)}: layer {layer} {part.name} does not match this model's KV "
                                   f"layout; the file was saved with another layout, save the session again")
            _store_arrays(buffer, rows, arrays)
    session.tokens = list(header["tokens"])
    return session
