"""The NPU graph cache in the home (a tiny model on "npu:cpu") when it is damaged, read-only or full:
a damaged graph or weights file is said on stderr, exported again, and the model computes what an undamaged
one does (also under random damage, hypothesis); a home that cannot take the cache is a NotWritableError
naming the folder, and a disk that fills up mid-export leaves a cache the next load recovers."""
from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from home_damage import (FUZZ_GRAPHS, GARBAGE, copy_of, cut_to_half, damage, damages, home, overwrite_middle,
                         unwritable)
from hypothesis import given
from hypothesis import strategies as st

import edge
from converters.convert import QuantPlan
from edge.core.files import NotWritableError


NPU_DEVICE = "npu:cpu,accuracy_level=0,layers_per_graph=1"


@pytest.fixture
def npu_model(tiny_zoo):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    return tiny_zoo.converted("llama_mha", QuantPlan(weights="int8", group_size=32, symmetric=True))


def npu_run(path: str) -> tuple[np.ndarray, dict]:
    with edge.load(path, device=NPU_DEVICE) as model:
        return model.session(capacity=8).prefill([3, 4, 5, 6]), model.device_info()


GRAPH_DAMAGE = {
    "cut short": cut_to_half,
    "zero bytes": lambda path: path.write_bytes(b""),
    "other bytes": lambda path: path.write_bytes(GARBAGE),
    "overwritten in the middle": overwrite_middle,
}


@pytest.mark.parametrize("damage", list(GRAPH_DAMAGE))
def test_a_damaged_graph_is_said_and_exported_again(home, npu_model, capsys, damage):
    expected, info = npu_run(npu_model)
    folder, graphs = Path(info["graph_cache"]), sorted(info["graphs_built"])
    assert folder.is_relative_to(home / "onnx") and len(graphs) == 2
    GRAPH_DAMAGE[damage](folder / graphs[1])
    capsys.readouterr()
    logits, info = npu_run(npu_model)
    np.testing.assert_array_equal(logits, expected)
    assert info["graphs_built"] == [graphs[1]]
    assert capsys.readouterr().err == (f"{folder / graphs[1]} is damaged (its sha256 differs from the one weights.json "
                                       f"records: cut short or overwritten); exporting it again\n")
    assert npu_run(npu_model)[1]["graphs_built"] == []


def move_an_offset(index_path: Path) -> None:
    """Point an entry at other bytes of weights.bin, in JSON as good as before: graphs exported later
    would read those bytes."""
    index = json.loads(index_path.read_text())
    entry = next(iter(index["entries"].values()))
    entry["offset"] = 0 if entry["offset"] else 4096
    index_path.write_text(json.dumps(index))


WEIGHT_DAMAGE = {  # what is done to weights.bin or weights.json; what is said (format: the folder)
    "weights cut short": ("weights.bin", cut_to_half, "{bin} is damaged ({size} bytes; {json} records {recorded})"),
    "weights overwritten": ("weights.bin", overwrite_middle,
                            "{bin} is damaged (its sha256 differs from the one {json} records: overwritten)"),
    "weights replaced by other bytes of their size": (
        "weights.bin", lambda path: path.write_bytes(np.random.default_rng(0).bytes(path.stat().st_size)),
        "{bin} is damaged (its sha256 differs from the one {json} records: overwritten)"),
    "weights removed": ("weights.bin", Path.unlink, "{bin} is damaged (missing; {json} records {recorded})"),
    "index of other bytes": ("weights.json", lambda path: path.write_bytes(GARBAGE),
                             "{json} is damaged ('utf-8' codec can't decode byte 0x80 in position 0: invalid start "
                             "byte)"),
    "index cut short": ("weights.json", lambda path: os.truncate(path, 40),
                        "{json} is damaged (Unterminated string starting at: line 1 column 28 (char 27))"),
    "index emptied": ("weights.json", lambda path: path.write_bytes(b""),
                      "{json} is damaged (Expecting value: line 1 column 1 (char 0))"),
    "index of another form": ("weights.json", lambda path: path.write_text('{"fingerprint": {}, "entries": []}'),
                              "{json} is damaged (its sha256 does not match its contents)"),
    "an offset in the index moved": ("weights.json", move_an_offset,
                                     "{json} is damaged (its sha256 does not match its contents)"),
    "index removed": ("weights.json", Path.unlink, "{json} is missing beside {bin} (an interrupted export)"),
}


@pytest.mark.parametrize("damage", list(WEIGHT_DAMAGE))
def test_damaged_graph_weights_are_said_and_every_graph_exported_again(home, npu_model, capsys, damage):
    expected, info = npu_run(npu_model)
    folder, graphs = Path(info["graph_cache"]), sorted(info["graphs_built"])
    recorded = json.loads((folder / "weights.json").read_text())["data"]["size"]
    name, damage_file, said = WEIGHT_DAMAGE[damage]
    damage_file(folder / name)
    size = (folder / "weights.bin").stat().st_size if (folder / "weights.bin").exists() else None
    capsys.readouterr()
    logits, info = npu_run(npu_model)
    np.testing.assert_array_equal(logits, expected)
    assert sorted(info["graphs_built"]) == graphs
    said = said.format(bin=folder / "weights.bin", json=folder / "weights.json", size=size, recorded=recorded)
    assert capsys.readouterr().err == f"{said}; exporting every graph of the model again\n"
    assert npu_run(npu_model)[1]["graphs_built"] == []


@pytest.fixture
def pristine_graph_cache(home, npu_model) -> tuple[Path, np.ndarray, list[str]]:
    """A home whose graph cache holds the model's graphs: (the home, the logits, the graphs)."""
    expected, info = npu_run(npu_model)
    return home, expected, sorted(info["graphs_built"])


@FUZZ_GRAPHS
@given(which=st.sampled_from(["graph", "weights.bin", "weights.json"]), edits=damages(256))
def test_any_damage_to_the_graph_cache_is_said_and_the_model_still_computes(
        pristine_graph_cache, npu_model, tmp_path_factory, capsys, which, edits):
    pristine, expected, graphs = pristine_graph_cache
    home = copy_of(pristine, tmp_path_factory)
    folder = next(home.glob("onnx/*/*"))
    target = folder / (graphs[0] if which == "graph" else which)
    changed = damage(target, edits)
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ZLLM_EDGE_HOME", str(home))
        logits, info = npu_run(npu_model)
    np.testing.assert_array_equal(logits, expected)
    err = capsys.readouterr().err
    if not changed:
        assert err == "" and info["graphs_built"] == []
    else:
        again = "it" if which == "graph" else "every graph of the model"
        assert re.fullmatch(rf"{re.escape(str(target))} is [^\n]+; exporting {again} again\n", err), err
        assert sorted(info["graphs_built"]) == ([graphs[0]] if which == "graph" else graphs)


def test_a_graph_cache_the_home_cannot_take_is_an_error_naming_the_folder(home, npu_model, unwritable):
    unwritable.apply(home)
    with pytest.raises(NotWritableError) as raised:
        npu_run(npu_model)
    folder = re.fullmatch(r"cannot write (\S+): .*", str(raised.value)).group(1)
    assert re.fullmatch(rf"{re.escape(str(home / 'onnx'))}/[0-9a-f]{{32}}/v\d+-\w+", folder)
    assert str(raised.value) == unwritable.message(folder)


def test_a_disk_that_fills_up_while_weights_are_exported_is_an_error_and_the_next_load_recovers(
        home, npu_model, monkeypatch, capsys):
    from devices.npu.onnx_weights import ExternalWeightFile

    real_append = ExternalWeightFile._append

    def append_until_full(self, array):
        if len(self.entries) >= 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_append(self, array)

    monkeypatch.setattr(ExternalWeightFile, "_append", append_until_full)
    with pytest.raises(NotWritableError, match=r"^cannot write .*/onnx/[0-9a-f]{32}/v\d+-\w+: no space left on "
                                               r"device; free some space there or set ZLLM_EDGE_HOME to a folder "
                                               r"on another disk$"):
        npu_run(npu_model)
    monkeypatch.setattr(ExternalWeightFile, "_append", real_append)
    capsys.readouterr()
    _, info = npu_run(npu_model)
    assert len(info["graphs_built"]) == 2 and "Traceback" not in capsys.readouterr().err
