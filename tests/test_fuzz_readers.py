"""Property-based fuzzing of every file reader: a valid file with a few random mutations (byte flips,
truncations, lying 64-bit numbers, zeroed runs) either reads into a working model or is refused with
the project's typed error. Never another exception, a hang (each example has a deadline), or NaN
logits: a mutated file that converts or loads must also run.

Seeded (`derandomize`) and bounded, so CI runs the same examples every time in well under a minute;
a longer local run: ZLLM_EDGE_FUZZ_EXAMPLES=2000 python -m pytest tests/test_fuzz_readers.py.
Cases that once broke a reader stay as explicit `@example`s (the regression corpus), or as exact-message
tests beside the reader's other damage tests (test_bad_gguf_counts, test_bad_sources, test_saved_sessions,
test_moe_checkpoint).
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_bad_input import write_tiny_gguf
from tiny_models import random_prompt, tiny_zoo  # noqa: F401

import edge
from converters.convert import QuantPlan, convert
from edge.core.errors import ZllmError

EXAMPLES = int(os.environ.get("ZLLM_EDGE_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=10_000,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
LYING_NUMBERS = [0, 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**63 - 1, 2**64 - 1]


def mutations(hot_bytes: int):
    """Lists of (kind, position, value): positions mostly inside the first `hot_bytes` (headers, metadata)."""
    position = st.one_of(st.integers(0, hot_bytes - 1), st.floats(0.0, 1.0))
    kind = st.sampled_from(["flip", "truncate", "number", "zeros"])
    return st.lists(st.tuples(kind, position, st.integers(0, len(LYING_NUMBERS) - 1)), min_size=1, max_size=3)


def mutated(data: bytes, edits) -> bytes:
    data = bytearray(data)
    for kind, position, value in edits:
        at = position if isinstance(position, int) else int(position * len(data))
        at = min(at, max(len(data) - 1, 0))
        if kind == "flip":
            data[at] ^= 1 << (value % 8)
        elif kind == "truncate":
            del data[at:]
        elif kind == "number":
            data[at:at + 8] = struct.pack("<Q", LYING_NUMBERS[value])
        else:
            data[at:at + 4 * (value + 1)] = bytes(len(data[at:at + 4 * (value + 1)]))
        if not data:
            break
    return bytes(data)


def runs_or_is_refused(load) -> None:
    """load() -> a model, or a typed error; a model that loads must run one prefill to finite logits
    (or refuse it with a typed error, such as NumericalError)."""
    try:
        model = load()
    except ZllmError:
        return
    try:
        with model:
            logits = model.session(capacity=8).prefill([1, 2, 3])
            assert np.isfinite(logits).all()
    except ZllmError:
        pass


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[bytes, int]:
    path = write_tiny_gguf(tmp_path_factory.mktemp("fuzz") / "tiny.gguf")
    return path.read_bytes(), gguf.GGUFReader(str(path)).data_offset


@FUZZ
@given(data=st.data())
@example(data=None)  # the file as written converts and runs
def test_gguf(tiny_gguf, data):
    source, metadata_bytes = tiny_gguf
    edits = [] if data is None else data.draw(mutations(metadata_bytes))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "model.gguf")
        path.write_bytes(mutated(source, edits))
        out = Path(folder, "out")
        try:
            convert(str(path), str(out), QuantPlan(weights="source"), progress=False)
        except ZllmError:
            assert not out.exists()  # nothing half-written
            return
        runs_or_is_refused(lambda: edge.load(out, device="reference"))


@pytest.fixture(scope="module")
def checkpoint(tiny_zoo) -> str:
    return tiny_zoo.converted("qwen3_moe_norm", QuantPlan(weights="int8", group_size=32, overrides={"experts": "int4"}))


def _copy(checkpoint: str, folder: str) -> Path:
    target = Path(folder, "ckpt")
    shutil.copytree(checkpoint, target)
    return target


@FUZZ
@given(data=st.data())
def test_manifest(checkpoint, data):
    text = Path(checkpoint, "zllm.json").read_bytes()
    edits = data.draw(mutations(len(text)))
    with tempfile.TemporaryDirectory() as folder:
        copy = _copy(checkpoint, folder)
        (copy / "zllm.json").write_bytes(mutated(text, edits))
        strategy = data.draw(st.sampled_from(["resident", "predictive"]))
        runs_or_is_refused(lambda: edge.load(copy, device="reference", expert_strategy=strategy,
                                             memory_budget=None if strategy == "resident" else "50%"))


@FUZZ
@given(data=st.data())
def test_manifest_values(checkpoint, data):
    """The manifest as valid JSON whose numbers and strings are replaced (what byte flips rarely reach)."""
    manifest = json.loads(Path(checkpoint, "zllm.json").read_text())
    leaves = []

    def collect(node, path):
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in items:
            if isinstance(child, (dict, list)):
                collect(child, path + [key])
            else:
                leaves.append(path + [key])

    collect(manifest, [])
    odd = st.one_of(st.sampled_from([-1, 0, 2**63, 1e308, float("nan"), "", "x", None, True, [], {}, [[1]]]),
                    st.integers(-2**70, 2**70))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(leaves))
        node = manifest
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = data.draw(odd)
    with tempfile.TemporaryDirectory() as folder:
        copy = _copy(checkpoint, folder)
        (copy / "zllm.json").write_text(json.dumps(manifest))
        runs_or_is_refused(lambda: edge.load(copy, device="reference"))


@FUZZ
@given(data=st.data())
def test_safetensors_header(checkpoint, data):
    weights = Path(checkpoint, "model.safetensors").read_bytes()
    header = 8 + struct.unpack("<Q", weights[:8])[0]
    edits = [(kind, at, value) for kind, at, value in data.draw(mutations(header)) if kind != "truncate"]
    with tempfile.TemporaryDirectory() as folder:
        copy = _copy(checkpoint, folder)
        (copy / "model.safetensors").write_bytes(mutated(weights, edits)[:len(weights)].ljust(len(weights), b"\0"))
        runs_or_is_refused(lambda: edge.load(copy, device="reference"))


@pytest.fixture(scope="module")
def saved_session(tiny_zoo, tmp_path_factory):
    model = edge.load(tiny_zoo.converted("llama_gqa_tied", QuantPlan(weights="int8", group_size=32)),
                      device="reference", kv_cache="int8")
    path = tmp_path_factory.mktemp("fuzz") / "s.zsession"
    session = model.session(capacity=16)
    session.prefill(random_prompt(6, seed=3))
    session.save(path)
    return model, path.read_bytes()


@FUZZ
@given(data=st.data())
def test_saved_session(saved_session, data):
    model, saved = saved_session
    header = 52 + struct.unpack("<Q", saved[12:20])[0]
    edits = data.draw(mutations(header))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "s.zsession")
        path.write_bytes(mutated(saved, edits))
        try:
            session = model.load_session(path)
        except ZllmError:
            return
        try:
            assert np.isfinite(session.decode(1)).all()
        except ZllmError:
            pass
        finally:
            session.close()


@FUZZ
@given(data=st.data())
def test_hugging_face_config(tiny_zoo, data):
    source = Path(tiny_zoo.hf_folder("llama_gqa_tied"))
    config = (source / "config.json").read_bytes()
    edits = data.draw(mutations(len(config)))
    with tempfile.TemporaryDirectory() as folder:
        copy = Path(folder, "hf")
        shutil.copytree(source, copy)
        (copy / "config.json").write_bytes(mutated(config, edits))
        out = Path(folder, "out")
        try:
            convert(str(copy), str(out), QuantPlan(weights="int8", group_size=32), progress=False)
        except ZllmError:
            assert not out.exists()
            return
        runs_or_is_refused(lambda: edge.load(out, device="reference"))
