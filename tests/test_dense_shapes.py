"""Dense models of shapes and sources the family cases (tests/tiny_models.py CASES) do not show.

Each parity case is a transformers config (1 layer, hidden 64, vocab 160, context 64, random
weights as in tiny_models) converted with f32 weights and compared with transformers on device
"reference": every prefill row and every decode step within REL_TOL of the largest logit, greedy
tokens identical. The cpu device reads the same RopeTable through cos_sin_span, checked against
cos_sin here; these cases were also run on "cpu" by hand (it agrees to ~1e-6), but a test session
compiles the Numba kernels afresh (isolated ZLLM_EDGE_HOME), ~60 s on this machine.

  - rope "dynamic" (within the context it is the default rope) and "longrope" (short factors for a
    call that stays within original_max_position_embeddings, long factors for one that reaches
    past it: a decode crossing the boundary, a prefill longer than it);
  - config keys a family's transformers model ignores: attention_bias / mlp_bias on Mistral and
    Qwen2 (Qwen2's o_proj and MLP never have biases), mlp_bias on Qwen3;
  - Qwen3's head_dim defaulting to 128 when config.json leaves it out;
  - a Llama GGUF with MLP biases; a sharded safetensors index that disagrees with its shards;
  - a bare bit width ("int4", "int8") keeps GGUF Q4_0 / Q4_1 / Q8_0 tensors of that width as they
    are, instead of rounding them onto a second grid; on the real SmolLM2 Q4_1 file the int4
    conversion then still says "Paris".
"""
from __future__ import annotations

import json
import os
import shutil

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf_files import write_hf_model_gguf
from tiny_models import TinyCase, build_hf_model, checkpoint_float_weights, hf_logits, random_prompt

import edge
from converters.convert import QuantPlan, convert
from converters.source import SourceTensor
from edge.core.errors import ConversionError
from edge.core.spec import spec_from_dict
from edge.rope import RopeTable

REL_TOL = 1e-4  # as tests/test_parity_transformers.py: f32 against f32
F32 = QuantPlan(weights="f32")
_ONE_LAYER = dict(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
SHORT = [1.0, 1.5, 2.0, 3.0, 1.2, 1.0, 4.0, 1.0]  # head_dim 16: 8 rotary pairs
LONG = [2.0, 3.0, 5.0, 8.0, 1.0, 1.5, 2.0, 9.0]


def _longrope(original: int, **extra) -> dict:
    return {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT,
                                "long_factor": LONG, "original_max_position_embeddings": original, **extra}}


# (case, prompt length, decode steps)
PARITY = [
    (TinyCase("llama_rope_dynamic", "llama",
              dict(_ONE_LAYER, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})), 12, 4),
    (TinyCase("llama_longrope_short", "llama", dict(_ONE_LAYER, **_longrope(64))), 12, 4),
    (TinyCase("llama_longrope_decode_crosses", "llama", dict(_ONE_LAYER, **_longrope(16))), 12, 8),
    (TinyCase("qwen2_longrope_long_prefill", "qwen2", dict(_ONE_LAYER, **_longrope(16, attention_factor=1.3))), 20, 3),
    (TinyCase("mistral_bias_keys", "mistral",
              dict(_ONE_LAYER, attention_bias=True, mlp_bias=True, sliding_window=5)), 12, 4),
    (TinyCase("qwen2_bias_keys", "qwen2", dict(_ONE_LAYER, attention_bias=True, mlp_bias=True)), 12, 4),
    (TinyCase("qwen3_mlp_bias_key", "qwen3", dict(_ONE_LAYER, head_dim=16, attention_bias=True, mlp_bias=True)), 12, 4),
]


def _ours(path: str, device: str, prompt: list[int], fed: list[int]) -> np.ndarray:
    model = edge.load(path, device=device)
    try:
        session = model.session()
        rows = [session.prefill(prompt, all_logits=True)] + [session.decode(t)[None] for t in fed]
    finally:
        model.close()
    return np.concatenate(rows)


def _assert_agrees(ours: np.ndarray, theirs: np.ndarray) -> None:
    rel = np.abs(ours - theirs).max(axis=-1) / np.abs(theirs).max(axis=-1)
    assert rel.max() <= REL_TOL, f"worst step {int(rel.argmax())}: {rel.max():.2e} > {REL_TOL:.0e}"
    assert np.array_equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("case, prompt_length, n_decode", PARITY, ids=[c.name for c, _, _ in PARITY])
def test_agrees_with_transformers(case, prompt_length, n_decode, tiny_zoo):
    hf, path = tiny_zoo.converted_case(case, F32)
    prompt = random_prompt(prompt_length, seed=7)
    prefill, steps, fed = hf_logits(hf, prompt, n_decode)
    _assert_agrees(_ours(path, "reference", prompt, fed), np.concatenate([prefill, np.stack(steps)]))


def test_longrope_spans_pick_the_factors_by_the_call_end():
    """One call's positions rotate with the long factors iff the call reaches past the original
    context; the growing table gives what cos_sin gives for the same call."""
    spec = spec_from_dict(dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                               num_attention_heads=4, vocab_size=32, max_position_embeddings=64,
                               **_longrope(16)))
    table = RopeTable(spec)
    short_row, _ = table.cos_sin(np.arange(10, 11))
    long_row, _ = table.cos_sin(np.arange(10, 17))  # ends at 17 > 16: long factors for every position
    assert not np.allclose(short_row[0], long_row[0])
    for start, n in ((0, 16), (10, 7), (16, 1), (3, 20), (0, 1)):
        cos, sin = table.cos_sin_span(start, n)
        expected_cos, expected_sin = table.cos_sin(np.arange(start, start + n))
        np.testing.assert_array_equal(cos, expected_cos)
        np.testing.assert_array_equal(sin, expected_sin)


@pytest.mark.parametrize("device", ["cpu", "gpu", "npu"])
def test_longrope_on_every_device_follows_the_whole_call(device, tiny_zoo, monkeypatch):
    """A prompt crossing the original context rotates with the long factors as one call on every
    device: the gpu splits it into submissions (4 tokens here) and the npu pads it, neither of which
    may decide the factors by its own piece."""
    if device == "gpu":
        from gpu_support import open_gpu

        import devices.gpu.forward

        open_gpu()  # skips where there is no Vulkan device
        monkeypatch.setattr(devices.gpu.forward, "MAX_TOKENS_PER_SUBMISSION", 4)
    case = next(c for c, _, _ in PARITY if c.name == "qwen2_longrope_long_prefill")
    _, path = tiny_zoo.converted_case(case, F32)
    prompt, fed = random_prompt(18, seed=7), random_prompt(3, seed=8)  # 18 > the original 16
    expected = _ours(path, "reference", prompt, fed)
    ours = _ours(path, f"{device}:f32" if device == "cpu" else device, prompt, fed)
    rel = np.abs(ours - expected).max() / np.abs(expected).max()
    assert rel <= 1e-4, f"{device}: {rel:.2e}"


def test_longrope_factors_must_cover_every_rotary_pair():
    config = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                  num_attention_heads=4, vocab_size=32, **_longrope(16))
    config["rope_parameters"]["long_factor"] = [1.0] * 3
    with pytest.raises(ConversionError) as raised:
        spec_from_dict(config)
    assert str(raised.value) == ("rope_scaling.long_factor must be 8 positive numbers (one per rotary pair of "
                                 "head_dim 16), got 3 values")


@pytest.mark.parametrize("rope", [
    dict(rope_scaling={"type": "yarn", "factor": 2.0}, original_max_position_embeddings=16),  # top-level key ignored
    dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                          "original_max_position_embeddings": 32}, original_max_position_embeddings=16),
    dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                          "long_factor": [2.0] * 8}),  # no original: max_position_embeddings stands in
], ids=["yarn-top-level", "yarn-both", "longrope-default"])
def test_original_context_is_read_as_transformers_reads_it(rope):
    from transformers import LlamaConfig

    fields = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, vocab_size=32,
                  max_position_embeddings=64)
    ours = spec_from_dict(dict(model_type="llama", **fields, **rope)).rope_scaling
    theirs = LlamaConfig(**fields, **rope).rope_parameters
    assert ours["original_max_position_embeddings"] == theirs["original_max_position_embeddings"]


def test_qwen3_head_dim_defaults_to_128_as_in_transformers():
    from transformers import Qwen3Config

    fields = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, vocab_size=32)
    assert spec_from_dict(dict(model_type="qwen3", **fields)).head_dim == Qwen3Config(**fields).head_dim == 128
    assert spec_from_dict(dict(model_type="llama", **fields)).head_dim == 16


# --------------------------------------------------------------------------------- sources

def test_llama_gguf_with_mlp_biases(tiny_zoo, tmp_path):
    hf = build_hf_model(TinyCase("llama_mlp_bias", "llama", dict(_ONE_LAYER, mlp_bias=True)))
    path = write_hf_model_gguf(hf, tmp_path / "model.gguf", "llama")
    convert(os.fspath(path), os.fspath(tmp_path / "zllm"), F32, progress=False)
    prompt = random_prompt(8, seed=3)
    prefill, steps, fed = hf_logits(hf, prompt, 2)
    _assert_agrees(_ours(os.fspath(tmp_path / "zllm"), "reference", prompt, fed),
                   np.concatenate([prefill, np.stack(steps)]))


@pytest.fixture()
def sharded_folder(tiny_zoo, tmp_path):
    folder = tmp_path / "sharded"
    build_hf_model(tiny_zoo.case("llama_mha")).save_pretrained(folder, max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    return folder, index


def _write_index(folder, index) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_folder_converts_to_the_same_weights(sharded_folder, tiny_zoo, tmp_path):
    folder, _ = sharded_folder
    convert(os.fspath(folder), os.fspath(tmp_path / "zllm"), F32, progress=False)
    weights = checkpoint_float_weights(tmp_path / "zllm")
    for name, param in tiny_zoo.hf_model("llama_mha").named_parameters():
        assert np.array_equal(weights[name], param.detach().numpy()), name


@pytest.mark.parametrize("edit", ["tensor absent from every shard", "tensor in another shard"])
def test_index_that_disagrees_with_its_shards_is_refused(edit, sharded_folder, tmp_path):
    folder, index = sharded_folder
    shards = sorted(set(index["weight_map"].values()))
    if edit == "tensor absent from every shard":
        name, shard = "model.layers.0.self_attn.extra.weight", shards[0]
    else:
        name = "model.layers.0.self_attn.q_proj.weight"
        shard = next(s for s in shards if s != index["weight_map"][name])
    index["weight_map"][name] = shard
    _write_index(folder, index)
    with pytest.raises(ConversionError) as raised:
        convert(os.fspath(folder), os.fspath(tmp_path / "zllm"), F32, progress=False)
    assert str(raised.value) == (
        f"{folder / 'model.safetensors.index.json'} maps tensor {name!r} to shard {shard}, but that shard does not "
        "hold it; the index and the shards disagree: download the model again (every shard and the index from "
        "one revision)")


def test_index_naming_a_missing_shard_is_refused(sharded_folder, tmp_path):
    folder, index = sharded_folder
    shard = sorted(set(index["weight_map"].values()))[1]
    os.remove(folder / shard)
    with pytest.raises(ConversionError) as raised:
        convert(os.fspath(folder), os.fspath(tmp_path / "zllm"), F32, progress=False)
    assert str(raised.value) == f"model.safetensors.index.json names shards that are missing from {folder}: {[shard]}"


# ------------------------------------------------------------- bit widths on quantized GGUF tensors

@pytest.mark.parametrize("source_format, plan, expected", [
    ("Q4_1", QuantPlan(weights="int4"), "int4_affine_g32"),  # kept: already 4 bits
    ("Q4_0", QuantPlan(weights="int4", group_size=128), "int4_sym_g32"),
    ("Q8_0", QuantPlan(weights="int8", group_size=64, symmetric=False), "int8_sym_g32"),
    ("Q8_0", QuantPlan(weights="int4"), "int4_sym_g32"),  # 8 bits asked down to 4: requantized
    ("Q4_1", QuantPlan(weights="int8"), "int8_sym_g32"),  # a wider grid holds the 4-bit values nearly exactly
    ("Q4_1", QuantPlan(weights="int4_sym_g32"), "int4_sym_g32"),  # a full scheme is what was asked
    ("F32", QuantPlan(weights="int4", group_size=64), "int4_sym_g64"),
    ("Q6_K", QuantPlan(weights="int4"), "int4_sym_g32"),
    ("Q4_1", QuantPlan(weights="int8", overrides={"ffn": "int4"}), "int4_affine_g32"),
])
def test_a_bare_bit_width_keeps_gguf_tensors_of_that_width(source_format, plan, expected):
    tensor = SourceTensor("model.layers.0.mlp.up_proj.weight", (64, 64), source_format, 0)
    assert str(plan.scheme_for(tensor)) == expected


def test_int4_conversion_of_a_q4_gguf_keeps_its_values(tiny_zoo, tmp_path):
    hf = tiny_zoo.hf_model("llama_mha")
    path = write_hf_model_gguf(hf, tmp_path / "model.gguf", "llama",
                               qtype_for=lambda name, values: Q.Q4_1 if "ffn" in name else Q.Q8_0)
    convert(os.fspath(path), os.fspath(tmp_path / "zllm"), QuantPlan(weights="int4"), progress=False)
    manifest = json.loads((tmp_path / "zllm" / "zllm.json").read_text())
    ours = checkpoint_float_weights(tmp_path / "zllm")
    down = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_down.weight")  # Q4_1
    name = "model.layers.1.mlp.down_proj.weight"
    assert manifest["tensors"][name]["scheme"] == "int4_affine_g32"
    assert np.array_equal(ours[name], gguf.quants.dequantize(down.data, down.tensor_type).reshape(ours[name].shape))
    # a Q8_0 tensor asked down to 4 bits is requantized, in the scheme the plan names
    assert manifest["tensors"]["model.layers.0.self_attn.o_proj.weight"]["scheme"] == "int4_sym_g32"


def test_smollm2_int4_still_knows_the_capital_of_france(smollm2_gguf, tmp_path):
    out = tmp_path / "int4"
    convert(os.fspath(smollm2_gguf), os.fspath(out), QuantPlan(weights="int4"), progress=False)
    model = edge.load(os.fspath(out), device="reference")
    try:
        text = "".join(model.generate("The capital of France is", max_new_tokens=3))
    finally:
        model.close()
    assert "Paris" in text
    shutil.rmtree(out)
