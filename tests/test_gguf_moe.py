"""Mixture-of-Experts GGUF files convert into the same checkpoint as the Hugging Face folder they came from.

Each tiny transformers MoE model (tests/tiny_models.py) is written as a GGUF the way llama.cpp's
convert_hf_to_gguf.py writes it (tests/gguf_files.py: stacked experts, q/k rows permuted for the
llama architecture, `{arch}.expert_*` metadata), converted, and compared with the conversion of its
Hugging Face folder: f32 weights bit-identical, logits within 1e-5 relative (the same f32 math),
expert ids per token and layer identical, and with transformers within test_moe_parity's 1e-4.
Quantized experts (Q4_0 / Q4_1 / Q8_0 stacks) import bit-exactly: each stored expert dequantizes
to gguf.quants.dequantize of its slice of the stack.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants
from gguf_files import gguf_tensors_from_hf, write_hf_model_gguf
from test_moe_parity import hf_routes, record_routes, relative_error, run_ours
from tiny_models import (checkpoint_expert_weights, checkpoint_float_weights, hf_logits, random_prompt,  # noqa: F401
                         tiny_zoo)

import edge
from converters.convert import QuantPlan, convert
from converters.gguf_moe import moe_config_fields
from edge.cli import main
from edge.core.errors import ConversionError
from edge.core.spec import spec_from_dict

PROMPT = random_prompt(10, seed=5)
N_DECODE = 3
SAME_MATH_REL_TOL = 1e-5  # GGUF vs HF-folder checkpoint: identical f32 weights, same backend
TRANSFORMERS_REL_TOL = 1e-4  # as tests/test_moe_parity.py
F32 = QuantPlan(weights="f32")

# (tiny case, GGUF architecture, experts as one 2-D tensor each like older Mixtral files)
GGUF_CASES = {
    "mixtral": ("mixtral", "llama", False),
    "mixtral_per_expert": ("mixtral", "llama", True),
    "qwen2_moe_shared": ("qwen2_moe_shared", "qwen2moe", False),
    "qwen2_moe_mlp_only": ("qwen2_moe_mlp_only", "qwen2moe", False),
    "qwen3_moe_raw": ("qwen3_moe_raw", "qwen3moe", False),
    "olmoe": ("olmoe", "olmoe", False),
}


def run_with_routes(path: str, fed: list[int]) -> tuple[list[np.ndarray], list[tuple[int, np.ndarray]]]:
    model = edge.load(path, device="reference")
    routes = record_routes(model).routes
    return run_ours(model, PROMPT, fed), routes


@pytest.mark.parametrize("variant", list(GGUF_CASES))
def test_f32_gguf_moe_equals_hf_folder_conversion_and_transformers(tiny_zoo, tmp_path, variant, capsys):
    case, arch, per_expert = GGUF_CASES[variant]
    hf = tiny_zoo.hf_model(case)
    source = write_hf_model_gguf(hf, tmp_path / f"{variant}.gguf", arch, per_expert=per_expert)
    ours_path = tmp_path / "zllm"
    if variant == "mixtral":  # the user's path, once: `zllm-edge convert SRC OUT --weights f32`
        assert main(["convert", str(source), str(ours_path), "--weights", "f32"]) == 0
        capsys.readouterr()
    else:
        convert(str(source), str(ours_path), F32, progress=False)
    reference_path = tiny_zoo.converted(case, F32)

    ours_spec = json.loads((ours_path / "zllm.json").read_text())["model"]
    reference_spec = json.loads(Path(reference_path, "zllm.json").read_text())["model"]
    moe_fields = ("model_type", "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "clip_qkv", "qkv_bias")
    assert {k: ours_spec.get(k) for k in moe_fields} == {k: reference_spec.get(k) for k in moe_fields}
    layers = range(reference_spec["num_hidden_layers"])
    assert ([spec_from_dict(ours_spec).moe_for_layer(i) for i in layers]
            == [spec_from_dict(reference_spec).moe_for_layer(i) for i in layers])

    ours_weights = {**checkpoint_float_weights(ours_path), **checkpoint_expert_weights(str(ours_path))}
    reference_weights = {**checkpoint_float_weights(reference_path), **checkpoint_expert_weights(reference_path)}
    assert sorted(ours_weights) == sorted(reference_weights)
    for name, value in reference_weights.items():
        np.testing.assert_array_equal(ours_weights[name], value, err_msg=name)

    theirs_routes, handles = hf_routes(hf)
    try:
        prefill, decode_steps, fed = hf_logits(hf, PROMPT, N_DECODE)
    finally:
        for handle in handles:
            handle.remove()
    ours, ours_routes = run_with_routes(str(ours_path), fed)
    reference, reference_routes = run_with_routes(reference_path, fed)
    assert [layer for layer, _ in ours_routes] == [layer for layer, _ in reference_routes]
    for (layer, ids), (_, expected) in zip(ours_routes, reference_routes):
        np.testing.assert_array_equal(ids, expected, err_msg=f"layer {layer}")
    for (layer, ids), (_, expected) in zip(ours_routes, theirs_routes):
        np.testing.assert_array_equal(np.sort(ids, axis=-1), np.sort(expected, axis=-1), err_msg=f"layer {layer}")
    assert max(relative_error(a, b) for a, b in zip(ours, reference)) <= SAME_MATH_REL_TOL
    assert max(relative_error(a, b) for a, b in zip(ours, [prefill, *decode_steps])) <= TRANSFORMERS_REL_TOL


EXPERT_TYPES = {"ffn_gate_exps": Q.Q4_0, "ffn_up_exps": Q.Q4_1, "ffn_down_exps": Q.Q8_0}


def quantized_experts(name: str, values: np.ndarray) -> Q:
    """Experts in Q4_0 / Q4_1 / Q8_0 by projection, attention in Q8_0, the rest F32."""
    kind = name.split(".")[-2]  # blk.L.KIND.weight
    if kind in EXPERT_TYPES:
        return EXPERT_TYPES[kind]
    return Q.Q8_0 if kind.startswith("attn_") else Q.F32


@pytest.mark.parametrize("case, arch", [("qwen3_moe_norm", "qwen3moe"), ("mixtral", "llama")])
def test_quantized_gguf_experts_import_bit_exact(tiny_zoo, tmp_path, case, arch):
    hf = tiny_zoo.hf_model(case)
    source = write_hf_model_gguf(hf, tmp_path / "q.gguf", arch, qtype_for=quantized_experts)
    out = tmp_path / "zllm"
    summary = convert(str(source), str(out), QuantPlan(weights="source"), progress=False)
    reports = {r.name: r for r in summary.tensors}

    reader = gguf.GGUFReader(str(source))
    stacks = {t.name: t for t in reader.tensors if t.name.split(".")[-2] in EXPERT_TYPES}
    stored = checkpoint_expert_weights(str(out))
    projection_of = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
    assert len(stored) == sum(int(t.shape[-1]) for t in stacks.values())
    for gguf_name, tensor in stacks.items():
        _, layer, kind, _ = gguf_name.split(".")
        expected = gguf_quants.dequantize(tensor.data, tensor.tensor_type)  # [E, rows, K]
        for expert, values in enumerate(expected):
            name = f"model.layers.{layer}.mlp.experts.{expert}.{projection_of[kind]}.weight"
            assert reports[name].lossless and reports[name].source_format == EXPERT_TYPES[kind].name
            np.testing.assert_array_equal(stored[name].view(np.uint32), values.astype(np.float32).view(np.uint32),
                                          err_msg=name)
    # the quantized model still routes and runs
    logits = edge.load(str(out), device="reference").session(capacity=32).prefill(PROMPT, all_logits=True)
    assert np.isfinite(logits).all()


def test_other_gguf_types_dequantize_one_expert_at_a_time(tiny_zoo, tmp_path):
    """Q5_0 stacks (repacked into int8) and F16 ones (no lossless scheme): each expert's slice imports as the
    gguf package dequantizes it."""
    types = {"ffn_gate_exps": Q.Q5_0, "ffn_up_exps": Q.F16, "ffn_down_exps": Q.Q5_0}
    source = write_hf_model_gguf(tiny_zoo.hf_model("olmoe"), tmp_path / "q5.gguf", "olmoe",
                                 qtype_for=lambda name, values: types.get(name.split(".")[-2], Q.F32))
    out = tmp_path / "zllm"
    convert(str(source), str(out), F32, progress=False)
    stored = checkpoint_expert_weights(str(out))
    projection_of = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
    for tensor in gguf.GGUFReader(str(source)).tensors:
        kind, layer = tensor.name.split(".")[-2], tensor.name.split(".")[1]
        if kind in types:
            expected = gguf_quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)  # [E, rows, K]
            for expert, values in enumerate(expected):
                name = f"model.layers.{layer}.mlp.experts.{expert}.{projection_of[kind]}.weight"
                np.testing.assert_array_equal(stored[name], values, err_msg=name)


def test_expert_weights_norm_defaults_to_llama_cpp_per_architecture():
    """Without {arch}.expert_weights_norm, top-k weights are renormalised as llama.cpp hard-codes it."""
    config = {"intermediate_size": 96, "num_hidden_layers": 2}
    meta = {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32}
    fields = {arch: moe_config_fields(model_type, arch, lambda key, default=None: meta.get(key, default), config,
                                      lambda name: ".mlp.gate." in name)
              for arch, model_type in (("qwen2moe", "qwen2_moe"), ("qwen3moe", "qwen3_moe"), ("olmoe", "olmoe"))}
    assert {arch: f["norm_topk_prob"] for arch, f in fields.items()} == {
        "qwen2moe": False, "qwen3moe": True, "olmoe": False}


# ------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("key, value, expected", [
    ("expert_used_count", "two", "an integer >= 1"),
    ("expert_used_count", 0, "an integer >= 1"),
    ("expert_feed_forward_length", 3.5, "an integer >= 1"),
    ("expert_count", True, "an integer >= 0"),
])
def test_mistyped_moe_metadata_is_named(key, value, expected):
    config = {"intermediate_size": 96, "num_hidden_layers": 2}
    meta = {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32, key: value}
    with pytest.raises(ConversionError) as raised:
        moe_config_fields("qwen3_moe", "qwen3moe", lambda k, default=None: meta.get(k, default), config,
                          lambda name: ".mlp.gate." in name)
    assert str(raised.value) == f"GGUF key 'qwen3moe.{key}' is {value!r}; expected {expected}"



def write_edited(tiny_zoo, path, edit) -> str:
    write_hf_model_gguf(tiny_zoo.hf_model("qwen3_moe_norm"), path, "qwen3moe", edit=edit)
    return str(path)


def test_missing_stacked_expert_tensor_is_a_conversion_error(tiny_zoo, tmp_path):
    source = write_edited(tiny_zoo, tmp_path / "no-down.gguf", lambda t: t.pop("blk.1.ffn_down_exps.weight"))
    with pytest.raises(ConversionError) as info:
        convert(source, str(tmp_path / "out"), F32, progress=False)
    assert str(info.value) == (
        "no-down.gguf: MoE layer 1 lacks 8 expert weights, e.g. model.layers.1.mlp.experts.0.down_proj.weight; "
        "a MoE layer needs the stacked experts blk.1.ffn_gate_exps.weight, blk.1.ffn_up_exps.weight, "
        "blk.1.ffn_down_exps.weight (or blk.1.ffn_gate.E.weight, ffn_up.E, ffn_down.E for every expert E)")
    assert not (tmp_path / "out").exists()


def test_missing_per_expert_tensor_is_a_conversion_error(tiny_zoo, tmp_path):
    source = tmp_path / "mixtral-no-up3.gguf"
    write_hf_model_gguf(tiny_zoo.hf_model("mixtral"), source, "llama", per_expert=True,
                        edit=lambda t: t.pop("blk.0.ffn_up.3.weight"))
    with pytest.raises(ConversionError) as info:
        convert(str(source), str(tmp_path / "out"), F32, progress=False)
    assert str(info.value) == (
        "mixtral-no-up3.gguf: MoE layer 0 lacks 1 expert weights, e.g. model.layers.0.mlp.experts.3.up_proj.weight; "
        "a MoE layer needs the stacked experts blk.0.ffn_gate_exps.weight, blk.0.ffn_up_exps.weight, "
        "blk.0.ffn_down_exps.weight (or blk.0.ffn_gate.E.weight, ffn_up.E, ffn_down.E for every expert E)")


def test_expert_count_disagreeing_with_the_stacks_is_a_conversion_error(tiny_zoo, tmp_path):
    def drop_last_expert(tensors):
        tensors["blk.0.ffn_up_exps.weight"] = tensors["blk.0.ffn_up_exps.weight"][:7]

    source = write_edited(tiny_zoo, tmp_path / "seven.gguf", drop_last_expert)
    with pytest.raises(ConversionError) as info:
        convert(source, str(tmp_path / "out"), F32, progress=False)
    assert str(info.value) == (
        "seven.gguf: blk.0.ffn_up_exps.weight stacks 7 experts (GGUF shape [64, 32, 7]) but qwen3moe.expert_count "
        "is 8; the metadata and the tensors disagree, export the GGUF file again")


def test_router_disagreeing_with_expert_count_is_a_conversion_error(tiny_zoo, tmp_path):
    def drop_router_row(tensors):
        tensors["blk.1.ffn_gate_inp.weight"] = tensors["blk.1.ffn_gate_inp.weight"][:6]

    source = write_edited(tiny_zoo, tmp_path / "router6.gguf", drop_router_row)
    with pytest.raises(ConversionError) as info:
        convert(source, str(tmp_path / "out"), F32, progress=False)
    assert str(info.value) == (
        "router6.gguf: blk.1.ffn_gate_inp.weight routes to 6 experts but qwen3moe.expert_count is 8; "
        "the metadata and the tensors disagree, export the GGUF file again")


def test_gguf_writer_stacks_experts_as_llama_cpp(tiny_zoo):
    """The test writer's layout: gate/up [E, I, D], down [E, D, I] per layer, router [E, D]."""
    tensors = gguf_tensors_from_hf(tiny_zoo.hf_model("qwen3_moe_norm"), "qwen3moe")
    assert tensors["blk.0.ffn_gate_exps.weight"].shape == (8, 32, 64)
    assert tensors["blk.0.ffn_up_exps.weight"].shape == (8, 32, 64)
    assert tensors["blk.0.ffn_down_exps.weight"].shape == (8, 64, 32)
    assert tensors["blk.0.ffn_gate_inp.weight"].shape == (8, 64)
