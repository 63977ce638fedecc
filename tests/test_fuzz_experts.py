"""Property-based fuzzing of a MoE checkpoint's expert file (experts.bin) and its index (zllm.json's
"experts" entry): records' offsets, lengths and crc32s, layer keys, entries swapped, dropped or
duplicated, the layouts' schemes, dtypes, shapes and offsets, and experts.bin's bytes (flips, zeroed
runs, truncations, appended bytes, one record copied over another).

Every case, on `reference` and `cpu`, with every expert resident and with experts streamed under a
memory budget, either computes exactly the intact checkpoint's logits (the damage is in nothing the
prompt uses) or is refused with a typed error, at load or at the call that needs the damaged expert.
Never another exception, never other logits. A checkpoint written before the index carried its
sha256 is fuzzed too: there only the structural checks stand, so it must be refused or run to finite
logits.

Seeded (`derandomize`) and bounded like tests/test_fuzz_readers.py; a longer local run:
ZLLM_EDGE_FUZZ_EXAMPLES=1000 python -m pytest tests/test_fuzz_experts.py.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tiny_models import random_prompt, tiny_zoo  # noqa: F401

import edge
from converters.convert import QuantPlan
from edge.core.errors import CheckpointError, ZllmError
from quant.checkpoint import MANIFEST, MANIFEST_SHA256
from quant.expert_file import EXPERTS_FILE, INDEX_SHA256, PROJECTIONS, index_sha256

EXAMPLES = int(os.environ.get("ZLLM_EDGE_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=10_000,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
PLAN = QuantPlan(weights="int8", group_size=32, overrides={"experts": "int4"})
PROMPT = random_prompt(12, seed=5)
DEVICES = ("reference", "cpu")
# expert strategy -> memory budget: every expert resident, or streamed through a cache of half of them
STRATEGIES = {"resident": None, "predictive": "50%", "ondemand": "50%", "mmap": "50%"}
COMPRESSIONS = (None, "zstd")
LOADS = [(device, strategy) for device in DEVICES for strategy in STRATEGIES]


def loads(compression: str | None) -> list[tuple[str, str]]:
    """(device, strategy) pairs that read a checkpoint of this compression: "mmap" uses records in place,
    so it reads uncompressed ones only."""
    return [(device, strategy) for device, strategy in LOADS if compression is None or strategy != "mmap"]


def load(path, device: str, strategy: str, verify: bool = False):
    return edge.load(path, device=device, expert_strategy=strategy, memory_budget=STRATEGIES[strategy], verify=verify)


def prefill_logits(path, device: str, strategy: str, verify: bool = False) -> np.ndarray:
    with load(path, device, strategy, verify) as model:
        return model.session(capacity=16).prefill(PROMPT)


@pytest.fixture(scope="module")
def checkpoints(tiny_zoo) -> dict[str | None, str]:
    return {compression: tiny_zoo.converted("qwen3_moe_norm", PLAN, compress_experts=compression == "zstd")
            for compression in COMPRESSIONS}


class IntactLogits(dict):
    """(compression, device, strategy) -> the intact checkpoint's prefill logits; shown short in a
    falsifying example."""

    def __repr__(self) -> str:
        return f"IntactLogits({len(self)} runs)"


@pytest.fixture(scope="module")
def intact(checkpoints) -> IntactLogits:
    return IntactLogits({(compression, device, strategy): prefill_logits(path, device, strategy)
                         for compression, path in checkpoints.items() for device, strategy in loads(compression)})


def damaged_copy(checkpoint: str, folder: str, entry: dict | None = None, expert_bytes: bytes | None = None,
                 before_digests: bool = False) -> Path:
    """A copy of `checkpoint` under `folder` with the experts entry and/or experts.bin replaced; with
    `before_digests`, a manifest as written before it carried its own sha256."""
    target = Path(folder, "ckpt")
    shutil.copytree(checkpoint, target)
    if entry is not None:
        manifest = json.loads((target / MANIFEST).read_text())
        manifest["experts"] = entry
        if before_digests:
            del manifest[MANIFEST_SHA256]
        (target / MANIFEST).write_text(json.dumps(manifest))
    if expert_bytes is not None:
        (target / EXPERTS_FILE).write_bytes(expert_bytes)
    return target


def computes_as_intact_or_is_refused(path: Path, intact: IntactLogits, compression: str | None,
                                     verify: bool = False) -> None:
    """Every (device, strategy) loads `path` and prefills the intact logits exactly, or refuses it
    with a ZllmError, at load or at the prefill."""
    for device, strategy in loads(compression):
        try:
            logits = prefill_logits(path, device, strategy, verify)
        except ZllmError:
            continue
        assert np.array_equal(logits, intact[compression, device, strategy]), (device, strategy)


def runs_or_is_refused(path: Path, compression: str | None) -> None:
    """Every (device, strategy) refuses `path` with a ZllmError or prefills finite logits."""
    for device, strategy in loads(compression):
        try:
            logits = prefill_logits(path, device, strategy)
        except ZllmError:
            continue
        assert np.isfinite(logits).all(), (device, strategy)


# ------------------------------------------------------------------------------ the index


def _records(entry: dict) -> list[tuple[str, int]]:
    return [(layer, expert) for layer, info in entry["layers"].items() for expert in range(len(info["records"]))]


def _arrays(entry: dict) -> list[tuple[str, str, str]]:
    return [(layer, projection, key) for layer, info in entry["layers"].items()
            for projection, p in info["projections"].items() for key in p["arrays"]]


def lying(value, others: list):
    """A value to put where `value` was: another entry's, a near one, an extreme one, or one of another type."""
    near = [value + d for d in (-4096, -64, -1, 1, 64, 4096)] if isinstance(value, int) else []
    return st.one_of(st.sampled_from(others or [value]), st.sampled_from(near or [0]),
                     st.sampled_from([0, -1, 2**31, 2**32, 2**63, 2**64]),
                     st.sampled_from([float(value) if isinstance(value, int) else 1.5, str(value), None, True,
                                      [value], {}]))


def mutated_shape(shape):
    if not (isinstance(shape, list) and shape and all(isinstance(d, int) for d in shape)):
        return st.sampled_from([[1, 1], [], None])  # an earlier edit left no shape to vary
    return st.sampled_from([shape[::-1], shape[:-1], shape + [1], [shape[0] + 1] + shape[1:],
                            [shape[0] // 2] + shape[1:], [0] + shape[1:], [-shape[0]] + shape[1:],
                            [str(shape[0])] + shape[1:], []])


def edit_index(entry: dict, data, keep_digest: bool = True) -> None:
    """One edit of the experts entry, in place, drawn from what a hand or a broken tool could change."""
    layers = sorted(entry["layers"])
    records, arrays = _records(entry), _arrays(entry)
    kinds = ["top field"] + (["digest"] if keep_digest else [])
    if len(records) > 1 and len(arrays) > 1:  # earlier edits may have left a single layer of experts
        kinds += ["record field", "swap records", "swap a field", "drop or duplicate", "layer key", "array field",
                  "swap projections", "swap array offsets", "projection field", "layer field"]
    kind = data.draw(st.sampled_from(kinds))
    if kind == "record field":
        layer, expert = data.draw(st.sampled_from(records))
        field = data.draw(st.integers(0, 2))
        record = entry["layers"][layer]["records"][expert]
        others = [entry["layers"][l]["records"][e][field] for l, e in records]
        record[field] = data.draw(lying(record[field], others))
    elif kind == "swap records":  # whole entries, crc32 included: every record stays self-consistent
        (l1, e1), (l2, e2) = data.draw(st.lists(st.sampled_from(records), min_size=2, max_size=2, unique=True))
        a, b = entry["layers"][l1]["records"], entry["layers"][l2]["records"]
        a[e1], b[e2] = b[e2], a[e1]
    elif kind == "swap a field":
        (l1, e1), (l2, e2) = data.draw(st.lists(st.sampled_from(records), min_size=2, max_size=2, unique=True))
        field = data.draw(st.integers(0, 2))
        a, b = entry["layers"][l1]["records"][e1], entry["layers"][l2]["records"][e2]
        a[field], b[field] = b[field], a[field]
    elif kind == "drop or duplicate":
        layer, expert = data.draw(st.sampled_from(records))
        info = entry["layers"][layer]
        if data.draw(st.booleans()):
            del info["records"][expert]
        else:
            info["records"].insert(expert, list(info["records"][expert]))
        if data.draw(st.booleans()):  # and the count told the same story
            info["num_experts"] = len(info["records"])
    elif kind == "layer key":
        layer = data.draw(st.sampled_from(layers))
        how = data.draw(st.sampled_from(["rename", "swap", "delete"]))
        if how == "swap" and len(layers) > 1:
            a, b = layers[0], layers[1]
            entry["layers"][a], entry["layers"][b] = entry["layers"][b], entry["layers"][a]
        elif how == "delete":
            del entry["layers"][layer]
        else:
            new = data.draw(st.sampled_from(["0", "1", "2", "7", "-1", "00", " 1", "x", "", "1.0"]))
            entry["layers"][new] = entry["layers"].pop(layer)
    elif kind == "array field":
        layer, projection, key = data.draw(st.sampled_from(arrays))
        array = entry["layers"][layer]["projections"][projection]["arrays"][key]
        field = data.draw(st.sampled_from(["dtype", "shape", "offset"]))
        if field == "dtype":
            array["dtype"] = data.draw(st.sampled_from(
                ["uint8", "int8", "float16", "float32", "float64", "bool", ">f2", "<u4", "object", "V4", "U1", "x",
                 "", 1, None]))
        elif field == "shape":
            array["shape"] = data.draw(mutated_shape(array["shape"]))
        else:
            others = [entry["layers"][l]["projections"][p]["arrays"][k]["offset"] for l, p, k in arrays]
            array["offset"] = data.draw(lying(array["offset"], others))
    elif kind == "swap projections":  # gate_proj and up_proj have one shape: the layout stays plausible
        layer = data.draw(st.sampled_from(layers))
        a, b = data.draw(st.lists(st.sampled_from(PROJECTIONS), min_size=2, max_size=2, unique=True))
        projections = entry["layers"][layer]["projections"]
        projections[a], projections[b] = projections[b], projections[a]
    elif kind == "swap array offsets":
        (l1, p1, k1), (l2, p2, k2) = data.draw(st.lists(st.sampled_from(arrays), min_size=2, max_size=2, unique=True))
        a = entry["layers"][l1]["projections"][p1]["arrays"][k1]
        b = entry["layers"][l2]["projections"][p2]["arrays"][k2]
        a["offset"], b["offset"] = b["offset"], a["offset"]
    elif kind == "projection field":
        layer = data.draw(st.sampled_from(layers))
        projection = entry["layers"][layer]["projections"][data.draw(st.sampled_from(PROJECTIONS))]
        if data.draw(st.booleans()):
            projection["scheme"] = data.draw(st.sampled_from(
                ["int4_sym_g32", "int4_asym_g32", "int8_sym_g32", "int4_sym_g64", "int4_sym_g128", "f16", "f32",
                 "q4_0", "x", "", None]))
        else:
            projection["shape"] = data.draw(mutated_shape(projection["shape"]))
    elif kind == "layer field":
        info = entry["layers"][data.draw(st.sampled_from(layers))]
        field = data.draw(st.sampled_from(["num_experts", "raw_length"]))
        info[field] = data.draw(lying(info[field], [entry["layers"][l][field] for l in layers]))
    elif kind == "top field":
        field = data.draw(st.sampled_from(["file", "alignment", "compression"]))
        entry[field] = data.draw(st.sampled_from({
            "file": [EXPERTS_FILE, "model.safetensors", "zllm.json", "missing.bin", "", None],
            "alignment": [4096, 512, 8192, 0, 4096.0, "4096", None],
            "compression": [None, "zstd", "lz4", "", 1]}[field]))
    else:  # the digest itself
        digest = entry[INDEX_SHA256] if isinstance(entry[INDEX_SHA256], str) and entry[INDEX_SHA256] else "0" * 64
        entry[INDEX_SHA256] = data.draw(st.sampled_from(
            [digest[:-1] + ("0" if digest[-1] != "0" else "1"), digest.upper(), digest[:32], "", None, 0,
             index_sha256({})]))


@FUZZ
@given(data=st.data())
@example(data=None)  # the index as written: every load computes the intact logits
def test_expert_index(checkpoints, intact, data):
    compression = None if data is None else data.draw(st.sampled_from(COMPRESSIONS))
    entry = json.loads(Path(checkpoints[compression], MANIFEST).read_text())["experts"]
    for _ in range(0 if data is None else data.draw(st.integers(1, 3))):
        edit_index(entry, data)
    with tempfile.TemporaryDirectory() as folder:
        computes_as_intact_or_is_refused(damaged_copy(checkpoints[compression], folder, entry), intact, compression)


@FUZZ
@given(data=st.data())
@example(data=None)  # written before the digest, unedited: it computes the intact logits
def test_expert_index_without_its_digest(checkpoints, intact, data):
    """A checkpoint written before the index carried its sha256, edited: the structural checks and the
    records' crc32s refuse what they can see; what they cannot see must still run to finite logits."""
    compression = None if data is None else data.draw(st.sampled_from(COMPRESSIONS))
    entry = json.loads(Path(checkpoints[compression], MANIFEST).read_text())["experts"]
    del entry[INDEX_SHA256]
    edits = 0 if data is None else data.draw(st.integers(1, 3))
    for _ in range(edits):
        edit_index(entry, data, keep_digest=False)
    with tempfile.TemporaryDirectory() as folder:
        path = damaged_copy(checkpoints[compression], folder, entry, before_digests=True)
        if edits:
            runs_or_is_refused(path, compression)
        else:
            computes_as_intact_or_is_refused(path, intact, compression)


# ------------------------------------------------------------------------------ experts.bin


def damaged_bytes(data_bytes: bytes, records: list[list[int]], data) -> bytes:
    """experts.bin with one drawn kind of damage, mostly inside records (what the model reads)."""
    damaged = bytearray(data_bytes)
    if not damaged:  # truncated to nothing by an earlier edit
        return data_bytes
    # a changed size is refused before anything is read: most draws damage bytes in place
    kind = data.draw(st.sampled_from(["flip", "zeros", "copy a record", "flip", "zeros", "truncate", "append"]))
    offset, length, _ = data.draw(st.sampled_from(records))
    at = data.draw(st.one_of(st.integers(offset, offset + length - 1), st.integers(0, len(damaged) - 1)))
    at = min(at, len(damaged) - 1)
    if kind == "flip":
        damaged[at] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "zeros":
        run = data.draw(st.sampled_from([1, 2, 4, 16, 64, 4096]))
        damaged[at:at + run] = bytes(len(damaged[at:at + run]))
    elif kind == "truncate":
        del damaged[at:]
    elif kind == "append":
        damaged += bytes([data.draw(st.integers(0, 255))]) * data.draw(st.sampled_from([1, 7, 4096, 8192]))
    else:  # another record's stored bytes over this one's (as many as fit): its crc32 no longer matches
        source_offset, source_length, _ = data.draw(st.sampled_from(records))
        count = min(length, source_length)
        damaged[offset:offset + count] = data_bytes[source_offset:source_offset + count]
    return bytes(damaged)


@FUZZ
@given(data=st.data())
@example(data=None)  # the file as written
def test_expert_file_bytes(checkpoints, intact, data):
    compression = None if data is None else data.draw(st.sampled_from(COMPRESSIONS))
    checkpoint = checkpoints[compression]
    expert_bytes = Path(checkpoint, EXPERTS_FILE).read_bytes()
    records = [record for info in json.loads(Path(checkpoint, MANIFEST).read_text())["experts"]["layers"].values()
               for record in info["records"]]
    edits = 0 if data is None else data.draw(st.integers(1, 3))
    for _ in range(edits):
        expert_bytes = damaged_bytes(expert_bytes, records, data)
    verify = data is not None and data.draw(st.booleans())  # verify: the whole file's sha256 too, at load
    with tempfile.TemporaryDirectory() as folder:
        path = damaged_copy(checkpoint, folder, expert_bytes=expert_bytes)
        computes_as_intact_or_is_refused(path, intact, compression, verify)


# ------------------------------------------------------------------------------ exact messages


def _swap_experts_1_and_2_of_layer_0(entry: dict) -> None:
    records = entry["layers"]["0"]["records"]
    records[1], records[2] = records[2], records[1]


def _swap_gate_and_up_layouts_of_layer_1(entry: dict) -> None:
    projections = entry["layers"]["1"]["projections"]
    projections["gate_proj"], projections["up_proj"] = projections["up_proj"], projections["gate_proj"]


@pytest.mark.parametrize("edit", [_swap_experts_1_and_2_of_layer_0, _swap_gate_and_up_layouts_of_layer_1])
@pytest.mark.parametrize("device, strategy", LOADS)
def test_an_index_edited_consistently_is_refused_at_load(checkpoints, tmp_path, edit, device, strategy):
    """Edits that every record's crc32 and the layouts' checks pass (the entries of two experts swapped
    with their crc32s; gate_proj and up_proj, of one shape, exchanged) computed with the wrong weights
    before the index carried its sha256."""
    entry = json.loads(Path(checkpoints[None], MANIFEST).read_text())["experts"]
    edit(entry)
    path = damaged_copy(checkpoints[None], tmp_path, entry)
    with pytest.raises(CheckpointError) as raised:
        load(path, device, strategy)
    assert str(raised.value) == (f"{path}: the expert index fails its sha256 check (index_sha256): its records or "
                                 "layouts were edited or damaged after conversion; convert the model again")


def test_a_digest_that_is_not_one_is_refused(checkpoints, tmp_path):
    entry = json.loads(Path(checkpoints[None], MANIFEST).read_text())["experts"]
    entry[INDEX_SHA256] = entry[INDEX_SHA256].upper()
    path = damaged_copy(checkpoints[None], tmp_path, entry)
    with pytest.raises(CheckpointError) as raised:
        load(path, "reference", "resident")
    assert str(raised.value) == (f'{path}: the experts entry\'s index_sha256 is "{entry[INDEX_SHA256]}", not a sha256 '
                                 "digest (64 lowercase hexadecimal digits); the checkpoint is damaged, convert the "
                                 "model again")


def test_the_converter_seals_the_index_with_its_sha256(checkpoints):
    for checkpoint in checkpoints.values():
        entry = json.loads(Path(checkpoint, MANIFEST).read_text())["experts"]
        assert entry[INDEX_SHA256] == index_sha256(entry)
        assert index_sha256(copy.deepcopy(entry) | {INDEX_SHA256: "anything"}) == index_sha256(entry)


@pytest.mark.parametrize("compression, device, strategy",
                         [(compression, *load) for compression in COMPRESSIONS for load in loads(compression)])
def test_a_checkpoint_written_before_the_digest_still_loads(checkpoints, intact, tmp_path, compression, device,
                                                            strategy):
    entry = json.loads(Path(checkpoints[compression], MANIFEST).read_text())["experts"]
    del entry[INDEX_SHA256]
    path = damaged_copy(checkpoints[compression], tmp_path, entry, before_digests=True)
    assert np.array_equal(prefill_logits(path, device, strategy, verify=True), intact[compression, device, strategy])
