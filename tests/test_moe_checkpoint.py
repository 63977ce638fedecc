"""The MoE checkpoint: experts.bin written and indexed by the converter, read back exactly, errors typed.

Bit-identity claims (compressed vs not) compare logits with ==, since the same bytes decode to the
same weights and the MoE block sums experts in a fixed order.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from tiny_models import random_prompt

import edge
from converters.convert import QuantPlan, convert, tensor_class
from edge.cli import main
from edge.core.errors import CheckpointError, ConversionError, UnsupportedModelError
from quant.checkpoint import open_checkpoint
from quant.expert_file import ALIGNMENT, EXPERTS_FILE

PROMPT = random_prompt(10, seed=11)
MIXED = QuantPlan(weights="int8", group_size=32, overrides={"experts": "int4"})


def decode_logits(path, device="reference", n_decode=3) -> list[np.ndarray]:
    session = edge.load(path, device=device).session(capacity=64)
    logits = [session.prefill(PROMPT, all_logits=True)]
    for _ in range(n_decode):
        logits.append(session.decode(int(logits[-1].reshape(-1, logits[-1].shape[-1])[-1].argmax())))
    return logits


def test_manifest_indexes_every_expert_in_aligned_records(tiny_zoo):
    path = tiny_zoo.converted("qwen2_moe_shared", MIXED)
    with open(os.path.join(path, "zllm.json")) as f:
        manifest = json.load(f)
    entry = manifest["experts"]
    assert entry["file"] == EXPERTS_FILE and entry["compression"] is None
    assert sorted(entry["layers"]) == ["0", "1"]
    for info in entry["layers"].values():
        assert info["num_experts"] == 8 and len(info["records"]) == 8
        assert all(offset % ALIGNMENT == 0 for offset, _, _ in info["records"])
        assert {p: v["scheme"] for p, v in info["projections"].items()} == {
            "gate_proj": "int4_sym_g32", "up_proj": "int4_sym_g32", "down_proj": "int4_sym_g32"}
    assert manifest["files"][EXPERTS_FILE]["bytes"] == os.path.getsize(os.path.join(path, EXPERTS_FILE))
    # routed experts live in experts.bin only; router f32, shared expert with the ffn class (int8)
    tensors = manifest["tensors"]
    assert not any(".mlp.experts." in name for name in tensors)
    assert tensors["model.layers.0.mlp.gate.weight"]["scheme"] == "f32"
    assert tensors["model.layers.0.mlp.shared_expert.up_proj.weight"]["scheme"] == "int8_sym_g32"
    assert tensors["model.layers.0.mlp.shared_expert_gate.weight"]["class"] == "router"
    with open_checkpoint(path, verify=True) as ckpt:
        assert ckpt.experts is not None and len(ckpt.experts.layers) == 2


def test_compressed_experts_give_bit_identical_logits(tiny_zoo):
    plain = tiny_zoo.converted("qwen3_moe_norm", MIXED)
    packed = tiny_zoo.converted("qwen3_moe_norm", MIXED, compress_experts=True)
    with open_checkpoint(packed, verify=True) as ckpt:
        assert ckpt.experts.compression == "zstd"
        assert ckpt.experts.total_stored_bytes < ckpt.experts.total_raw_bytes
    for a, b in zip(decode_logits(plain), decode_logits(packed)):
        assert np.array_equal(a, b)


def test_mixed_scheme_int8_attention_int4_experts(tiny_zoo):
    path = tiny_zoo.converted("mixtral", QuantPlan(weights="int4", group_size=32,
                                                   overrides={"attention": "int8", "experts": "int4"}))
    model = edge.load(path, device="reference")
    q = model.checkpoint.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert str(q.scheme) == "int8_sym_g32"
    layout = model.checkpoint.experts.layout(1)
    assert {str(p.scheme) for p in layout.projections.values()} == {"int4_sym_g32"}
    assert model.stats()["expert_source"] == "resident"
    logits = decode_logits(path)
    assert all(np.isfinite(step).all() for step in logits)


def test_corrupted_expert_record_names_layer_and_expert(tiny_zoo, tmp_path):
    path = tmp_path / "damaged"
    shutil.copytree(tiny_zoo.converted("olmoe", MIXED), path)
    with open(path / "zllm.json") as f:
        offset, length, _ = json.load(f)["experts"]["layers"]["1"]["records"][5]
    with open(path / EXPERTS_FILE, "r+b") as f:
        f.seek(offset + length // 2)
        byte = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError) as info:
        edge.load(path, device="reference", verify=True)
    assert str(info.value) == (f"{path / EXPERTS_FILE}: layer 1 expert 5 fails its crc32 check; "
                               "the checkpoint is damaged, convert it again")


def _flip_a_byte_of(path, layer: int, expert: int) -> None:
    with open(path / "zllm.json") as f:
        offset, length, _ = json.load(f)["experts"]["layers"][str(layer)]["records"][expert]
    with open(path / EXPERTS_FILE, "r+b") as f:
        f.seek(offset + length // 2)
        byte = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("device", ["reference", "cpu"])
def test_a_corrupted_expert_is_refused_without_verify_when_every_expert_is_resident(tiny_zoo, tmp_path, device):
    path = tmp_path / "damaged"
    shutil.copytree(tiny_zoo.converted("olmoe", MIXED), path)
    _flip_a_byte_of(path, 1, 5)
    with pytest.raises(CheckpointError) as info:
        edge.load(path, device=device)
    assert str(info.value) == (f"{path / EXPERTS_FILE}: layer 1 expert 5 fails its crc32 check; "
                               "the checkpoint is damaged, convert it again")


def test_a_corrupted_expert_is_refused_in_place_when_it_is_used(tiny_zoo, tmp_path):
    path = tmp_path / "damaged"
    shutil.copytree(tiny_zoo.converted("olmoe", MIXED), path)
    with open(path / "zllm.json") as f:
        experts = len(json.load(f)["experts"]["layers"]["1"]["records"])
    for expert in range(experts):  # every expert of layer 1: the route cannot avoid them
        _flip_a_byte_of(path, 1, expert)
    with edge.load(path, device="cpu", expert_strategy="mmap", memory_budget="50%") as model:
        with pytest.raises(CheckpointError) as info:
            model.session(capacity=16).prefill(PROMPT)
    message = str(info.value)
    assert message.startswith(f"{path / EXPERTS_FILE}: layer 1 expert ")
    assert message.endswith(" fails its crc32 check; the checkpoint is damaged, convert it again")


def _edit_record(layer: int, expert: int, field: int, value):
    def edit(experts: dict) -> None:
        experts["layers"][str(layer)]["records"][expert][field] = value
    return edit


def _point_at_another_record(experts: dict) -> None:
    records = experts["layers"]["1"]["records"]
    records[2] = list(records[3])


@pytest.mark.parametrize("edit, complaint", [
    (_edit_record(1, 2, 0, -4096), "the index of layer 1 expert 2 is damaged: offset -4096 is not a multiple of 4096"),
    (_edit_record(1, 2, 0, 100), "the index of layer 1 expert 2 is damaged: offset 100 is not a multiple of 4096"),
    (_edit_record(1, 2, 0, 1 << 50), "the index of layer 1 expert 2 is damaged: its {length} bytes at offset "
                                     f"{1 << 50} end past the file's {{size}} bytes"),
    (_edit_record(1, 2, 1, 0), "the index of layer 1 expert 2 is damaged: length 0 does not fit its {raw}-byte layout"),
    (_edit_record(1, 2, 1, 1 << 40), f"the index of layer 1 expert 2 is damaged: length {1 << 40} does not fit its "
                                     "{raw}-byte layout"),
    (_edit_record(1, 2, 2, -1), "the index of layer 1 expert 2 is damaged: crc32 -1 is not a 32-bit value"),
    (_edit_record(1, 2, 0, 4096.0), "the manifest's experts entry is malformed (index values are integers, found "
                                    "4096.0)"),
    (_edit_record(1, 2, 1, "4096"), "the manifest's experts entry is malformed (index values are integers, found "
                                    "'4096')"),
    (_point_at_another_record, "the index is damaged: the records of layer 1 expert 2 and layer 1 expert 3 share "
                               "bytes"),
])
def test_an_edited_expert_index_is_refused_at_load(tiny_zoo, tmp_path, edit, complaint):
    path = tmp_path / "edited"
    shutil.copytree(tiny_zoo.converted("olmoe", MIXED), path)
    manifest = json.loads((path / "zllm.json").read_text())
    raw = manifest["experts"]["layers"]["1"]["raw_length"]
    length = manifest["experts"]["layers"]["1"]["records"][2][1]
    edit(manifest["experts"])
    (path / "zllm.json").write_text(json.dumps(manifest))
    for strategy in ("resident", "predictive"):
        with pytest.raises(CheckpointError) as info:
            edge.load(path, device="reference", expert_strategy=strategy, memory_budget=None
                      if strategy == "resident" else "50%")
        expected = complaint.format(raw=raw, length=length, size=os.path.getsize(path / EXPERTS_FILE))
        assert str(info.value) == f"{path}: {expected}; convert the model again"


@pytest.mark.parametrize("edit, complaint", [  # found by tests/test_fuzz_readers.py
    (lambda experts: experts["layers"]["1"]["projections"]["down_proj"]["shape"].__setitem__(1, ""),
     "the manifest's experts entry is malformed (expected a list of non-negative integers, found [{rows}, ''])"),
    (lambda experts: experts.__setitem__("file", []),
     "the experts entry does not name a file the manifest lists; the checkpoint is damaged"),
])
def test_wrong_types_in_the_expert_index_are_refused(tiny_zoo, tmp_path, edit, complaint):
    path = tmp_path / "edited"
    shutil.copytree(tiny_zoo.converted("olmoe", MIXED), path)
    manifest = json.loads((path / "zllm.json").read_text())
    rows = manifest["experts"]["layers"]["1"]["projections"]["down_proj"]["shape"][0]
    edit(manifest["experts"])
    (path / "zllm.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as info:
        edge.load(path, device="reference")
    assert complaint.format(rows=rows) in str(info.value)
    assert str(info.value).endswith("convert the model again")


def test_truncated_expert_file_is_refused(tiny_zoo, tmp_path):
    path = tmp_path / "truncated"
    shutil.copytree(tiny_zoo.converted("olmoe", MIXED), path)
    size = os.path.getsize(path / EXPERTS_FILE)
    with open(path / EXPERTS_FILE, "r+b") as f:
        f.truncate(size - ALIGNMENT)
    with pytest.raises(CheckpointError) as info:
        edge.load(path, device="reference")
    assert str(info.value) == (f"{path}: {EXPERTS_FILE} has {size - ALIGNMENT} bytes, the manifest says {size}; "
                               "the checkpoint is damaged, convert it again")


def test_mixtral_names_are_mapped(tiny_zoo):
    hf = load_file(os.path.join(tiny_zoo.hf_folder("mixtral"), "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in hf  # what the source calls them
    path = tiny_zoo.converted("mixtral", QuantPlan(weights="f32"))
    with open_checkpoint(path) as ckpt:
        assert "model.layers.0.mlp.gate.weight" in ckpt.tensors
        assert not any("block_sparse_moe" in name for name in ckpt.tensors)
        layout = ckpt.experts.layout(0)
        stored = layout.decode(np.fromfile(ckpt.experts.path, np.uint8, layout.raw_length,
                                           offset=ckpt.experts.record(0, 3).offset))
    np.testing.assert_array_equal(stored["down_proj"], hf["model.layers.0.block_sparse_moe.experts.3.w2.weight"])
    np.testing.assert_array_equal(stored["gate_proj"], hf["model.layers.0.block_sparse_moe.experts.3.w1.weight"])
    np.testing.assert_array_equal(stored["up_proj"], hf["model.layers.0.block_sparse_moe.experts.3.w3.weight"])


def test_missing_expert_tensor_is_a_conversion_error(tiny_zoo, tmp_path):
    source = tmp_path / "hf"
    shutil.copytree(tiny_zoo.hf_folder("qwen3_moe_raw"), source)
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.6.up_proj.weight"]
    save_file(tensors, source / "model.safetensors")
    with pytest.raises(ConversionError) as info:
        convert(os.fspath(source), os.fspath(tmp_path / "out"), progress=False)
    assert str(info.value) == (f"{source} lacks 1 tensors the qwen3_moe config requires, "
                               "e.g. ['model.layers.1.mlp.experts.6.up_proj.weight']")
    assert not (tmp_path / "out").exists()


def test_unsupported_router_is_refused(tmp_path):
    source = tmp_path / "hf"
    source.mkdir()
    config = {"model_type": "deepseek_v2", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
              "vocab_size": 160, "intermediate_size": 96, "n_routed_experts": 4, "num_experts_per_tok": 2,
              "topk_method": "noaux_tc"}
    (source / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": np.zeros((160, 64), np.float32)}, source / "model.safetensors")
    with pytest.raises(UnsupportedModelError) as info:
        convert(os.fspath(source), os.fspath(tmp_path / "out"), progress=False)
    assert str(info.value) == ("topk_method 'noaux_tc' is not supported for deepseek_v2; "
                               "supported: greedy, group_limited_greedy")


def test_tensor_classes_of_moe_names():
    assert tensor_class("model.layers.3.mlp.experts.7.down_proj.weight") == "experts"
    assert tensor_class("model.layers.3.mlp.gate.weight") == "router"
    assert tensor_class("model.layers.3.mlp.shared_expert_gate.weight") == "router"
    assert tensor_class("model.layers.3.mlp.shared_experts.up_proj.weight") == "ffn"
    assert tensor_class("model.layers.3.mlp.gate_proj.weight") == "ffn"


def test_cli_converts_with_compression_and_inspect_shows_experts(tiny_zoo, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["convert", tiny_zoo.hf_folder("olmoe"), os.fspath(out), "--weights", "int8", "--experts", "int4",
                 "--compress-experts", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["inspect", os.fspath(out)]) == 0
    printed = capsys.readouterr().out
    assert "experts: experts.bin, 2 MoE layers, compression zstd, records aligned to 4096 bytes" in printed
    assert "layer   1: 8 experts" in printed and "gate/up/down int4_sym_g32/int4_sym_g32/int4_sym_g32" in printed


def test_impossible_moe_configuration_is_refused(tmp_path):
    from edge.core.spec import spec_from_dict, spec_tensor_names

    spec = spec_from_dict({"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "num_experts": 4, "num_experts_per_tok": 6,
                           "moe_intermediate_size": 32})
    with pytest.raises(UnsupportedModelError) as info:
        spec_tensor_names(spec)
    assert str(info.value) == ("unsupported Mixture-of-Experts configuration: "
                               "num_experts_per_tok 6 must be in [1, 4] (the experts)")


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe_shared"])
def test_stacked_expert_checkpoints_convert_like_per_expert_ones(tiny_zoo, tmp_path, case):
    """transformers 5 saving with save_original_format=False keeps experts stacked (mlp.experts.gate_up_proj
    [E, 2I, D], mlp.experts.down_proj [E, D, I]); the converter splits them into the same expert records."""
    tiny_zoo.hf_model(case).save_pretrained(tmp_path / "hf", save_original_format=False)
    stacked_names = load_file(tmp_path / "hf" / "model.safetensors").keys()
    assert "model.layers.0.mlp.experts.gate_up_proj" in stacked_names
    convert(os.fspath(tmp_path / "hf"), os.fspath(tmp_path / "zllm"), QuantPlan(weights="f32"), progress=False)
    per_expert = tiny_zoo.converted(case, QuantPlan(weights="f32"))
    with open(os.path.join(per_expert, EXPERTS_FILE), "rb") as a, open(tmp_path / "zllm" / EXPERTS_FILE, "rb") as b:
        assert a.read() == b.read()
