"""Model configs and tensor shapes: every malformed value is refused at convert time with its exact
message (a typed error naming the config, the field or tensor, and what it must be), nothing is written,
and a checkpoint whose manifest disagrees with its weights is refused at load.

The expected-shape table (edge/core/spec.py `spec_tensor_shapes`) is first proven right: for the tiny model
of every family (tests/tiny_models.py), its Hugging Face tensors, its GGUF tensors and its converted
checkpoint have exactly the shapes the table gives.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_files import write_hf_model_gguf
from safetensors.numpy import load_file, save_file
from test_bad_input import assert_nothing_written, run_cli
from test_moefy import char_tokenizer_json
from tiny_models import ATTENTION_CASE_NAMES, CASE_NAMES, MOE_CASE_NAMES, tiny_zoo  # noqa: F401

import edge
from converters.convert import QuantPlan, convert
from converters.gguf_source import GGUFSource
from converters.hf_source import HFSource
from edge.core.errors import CheckpointError, ConversionError, UnsupportedModelError
from edge.core.spec import SPEC_CLASSES, LlamaSpec, spec_from_dict, spec_tensor_shapes
from edge.core.spec_dense import ROPE_PARAMETERS
from edge.moefy import moefy_convert
from edge.rope import SUPPORTED_ROPE_TYPES
from quant.checkpoint import MANIFEST, open_checkpoint

F32 = QuantPlan(weights="f32")
EVERY_CASE = CASE_NAMES + MOE_CASE_NAMES + ATTENTION_CASE_NAMES
FIX = "; the config and the weights disagree: fix the config, or export the model again"
DAMAGED = "; the manifest's model spec and the weights disagree: the checkpoint is damaged, convert the model again"


# ------------------------------------------------------------------------------- helpers


def table_of(spec) -> dict[str, tuple[int, ...]]:
    return {name: expected.shape for name, expected in spec_tensor_shapes(spec).items()}


def checkpoint_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint by name, routed experts included (from the expert index's layouts)."""
    with open_checkpoint(path) as ckpt:
        shapes = {name: tuple(t.shape) for name, t in ckpt.tensors.items()}
        for layer, layer_experts in (ckpt.experts.layers.items() if ckpt.experts else ()):
            for expert in range(len(layer_experts.records)):
                for projection, layout in layer_experts.layout.projections.items():
                    shapes[f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"] = layout.shape
        return shapes


def source_shapes(source, spec) -> dict[str, tuple[int, ...]]:
    shapes = {t.name: tuple(t.shape) for t in source.tensors()}
    if spec.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # a tied checkpoint may carry a copy
    return shapes


def edited_hf_folder(tiny_zoo, case: str, folder: Path, config=None, tensors=None) -> Path:
    """A copy of the tiny case's HF folder; `config(dict)` and `tensors(dict of numpy arrays)` edit it in place."""
    shutil.copytree(tiny_zoo.hf_folder(case), folder)
    if config is not None:
        values = json.loads((folder / "config.json").read_text())
        config(values)
        (folder / "config.json").write_text(json.dumps(values))
    if tensors is not None:
        weights = load_file(folder / "model.safetensors")
        tensors(weights)
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def refused(src, tmp_path, error=ConversionError) -> str:
    """Convert SRC, expecting `error`; returns its message after checking that nothing was written."""
    out = tmp_path / "out" / "ckpt"
    with pytest.raises(error) as raised:
        convert(str(src), str(out), F32, progress=False)
    assert type(raised.value) is error
    assert_nothing_written(out)
    return str(raised.value)


# ------------------------------------------------------------------ the shape table is right


@pytest.mark.parametrize("case", EVERY_CASE)
def test_shape_table_matches_every_family_source_and_checkpoint(case, tiny_zoo):
    """Dense (MHA/GQA/MQA, biases, q/k norms, tied), MoE (Mixtral, Qwen2-MoE with its shared expert and
    gate, Qwen3-MoE, OLMoE), DeepSeek MLA with and without query LoRA, first_k_dense_replace."""
    source = HFSource(tiny_zoo.hf_folder(case))
    try:
        spec = spec_from_dict(source.config, strict=True)
        assert source_shapes(source, spec) == table_of(spec)
    finally:
        source.close()
    converted = tiny_zoo.converted(case, F32)
    assert checkpoint_shapes(converted) == table_of(spec_from_dict(json.loads(
        Path(converted, MANIFEST).read_text())["model"]))


GGUF_SHAPE_CASES = [("mistral_gqa", "llama"), ("qwen2_bias", "qwen2"), ("qwen3_qknorm", "qwen3"),
                    ("mixtral", "llama"), ("qwen2_moe_shared", "qwen2moe"), ("qwen3_moe_raw", "qwen3moe"),
                    ("olmoe", "olmoe")]


@pytest.mark.parametrize("case, arch", GGUF_SHAPE_CASES)
def test_shape_table_matches_gguf_sources_in_out_in_order(case, arch, tiny_zoo, tmp_path):
    """GGUF lists dimensions innermost first; the reader's [out, in] shapes (per expert for stacked
    experts) are the table's."""
    path = write_hf_model_gguf(tiny_zoo.hf_model(case), tmp_path / f"{case}.gguf", arch)
    source = GGUFSource(str(path))
    try:
        spec = spec_from_dict(source.config, strict=True)
        assert source_shapes(source, spec) == table_of(spec)
    finally:
        source.close()


def test_shape_table_matches_a_moefied_llama(tiny_zoo, tmp_path):
    """llama_moe (--moefy): layer 0 split into experts with a router and its bias, layer 1 kept dense."""
    folder = Path(shutil.copytree(tiny_zoo.hf_folder("llama_mha"), tmp_path / "llama"))
    (folder / "tokenizer.json").write_text(char_tokenizer_json(tiny_zoo.case("llama_mha").make_config().vocab_size))
    out = os.fspath(tmp_path / "moe")
    moefy_convert(os.fspath(folder), out, experts=4, top_k=2, dense_layers=(1,), plan=F32, progress=False,
                  calibration_tokens=512, heldout_tokens=128)
    spec = spec_from_dict(json.loads(Path(out, MANIFEST).read_text())["model"])
    assert spec.model_type == "llama_moe" and spec.moe_for_layer(0) is not None and spec.moe_for_layer(1) is None
    assert "model.layers.0.mlp.gate.bias" in table_of(spec)
    assert checkpoint_shapes(out) == table_of(spec)


def test_every_rope_type_the_spec_accepts_computes_from_its_required_parameters():
    from edge.rope import rope_inv_freq

    values = {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 16, "factors": [1.0] * 8, "short_factor": [1.0] * 8,
              "long_factor": [2.0] * 8}
    for rope_type, needed in ROPE_PARAMETERS.items():
        scaling = {"rope_type": rope_type, **{key: values[key] for key in needed}}
        spec = spec_from_dict(dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, vocab_size=32, rope_scaling=scaling))
        inv_freq, attention_factor = rope_inv_freq(spec)
        assert inv_freq.shape == (8,) and np.isfinite(inv_freq).all() and attention_factor > 0, rope_type
    assert SUPPORTED_ROPE_TYPES == tuple(ROPE_PARAMETERS)


# --------------------------------------------------------------------- bad config values

TOKEN_IDS = "a token id (a non-negative integer) or a list of them or null"
OUTSIDE_VOCAB = "is not a token of the model: vocab_size is 160; fix {0}_token_id (or vocab_size)"
AT_MOST, REAL = "must be at most", " (far above any real model's)"
# (case, config edit, exact message after "<src>/config.json: ")
BAD_VALUES = {
    "kv-heads-zero": ("llama_mha", {"num_key_value_heads": 0},
                      "num_key_value_heads must be a positive integer or null, got 0"),
    "heads-zero": ("llama_mha", {"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    "layers-string": ("llama_mha", {"num_hidden_layers": "2"}, 'num_hidden_layers must be a positive integer, got "2"'),
    "layers-float": ("llama_mha", {"num_hidden_layers": 2.0}, "num_hidden_layers must be a positive integer, got 2.0"),
    "heads-bool": ("llama_mha", {"num_attention_heads": True},
                   "num_attention_heads must be a positive integer, got true"),
    "hidden-string": ("llama_mha", {"hidden_size": "64"}, 'hidden_size must be a positive integer, got "64"'),
    "hidden-negative": ("llama_mha", {"hidden_size": -64}, "hidden_size must be a positive integer, got -64"),
    "vocab-negative": ("llama_mha", {"vocab_size": -1}, "vocab_size must be a positive integer, got -1"),
    "eps-string": ("llama_mha", {"rms_norm_eps": "abc"}, 'rms_norm_eps must be a positive number, got "abc"'),
    "theta-zero": ("llama_mha", {"rope_parameters": {"rope_type": "default", "rope_theta": 0}},
                   "rope_theta must be a positive number, got 0"),
    "head-dim-zero": ("llama_mha", {"head_dim": 0}, "head_dim must be a positive integer or null, got 0"),
    "head-dim-odd": ("llama_mha", {"head_dim": 15}, "head_dim must be even for rotary embeddings, got 15"),
    "context-zero": ("llama_mha", {"max_position_embeddings": 0},
                     "max_position_embeddings must be a positive integer, got 0"),
    "tie-string": ("llama_mha", {"tie_word_embeddings": "no"}, 'tie_word_embeddings must be true or false, got "no"'),
    "eos-string": ("llama_mha", {"eos_token_id": "abc"},
                   'eos_token_id must be a token id (a non-negative integer) or a list of them or null, got "abc"'),
    "eos-outside-vocab": ("llama_mha", {"eos_token_id": 99999},
                          "eos_token_id 99999 is not a token of the model: vocab_size is 160; fix eos_token_id "
                          "(or vocab_size)"),
    "kv-heads-not-dividing": ("llama_mha", {"num_key_value_heads": 3},
                              "num_attention_heads (4) is not a multiple of num_key_value_heads (3); each KV head "
                              "must serve a whole group of query heads: fix num_key_value_heads"),
    "hidden-not-multiple-of-heads": ("llama_mha", {"num_attention_heads": 6, "head_dim": None},
                                     "hidden_size 64 is not a multiple of num_attention_heads 6, and the config gives "
                                     "no head_dim; fix num_attention_heads, or give head_dim if the heads really are "
                                     "narrower"),
    "rope-parameters-list": ("llama_mha", {"rope_parameters": [1, 2]},
                             "rope_parameters must be an object or null, got [1, 2]"),
    "rope-llama3-incomplete": ("llama_mha", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
                               "rope_scaling of type 'llama3' needs low_freq_factor, high_freq_factor; add them to "
                               "the config's rope_scaling (or rope_parameters)"),
    "rope-yarn-no-factor": ("llama_mha", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0}},
                            "rope_scaling of type 'yarn' needs factor; add it to the config's rope_scaling "
                            "(or rope_parameters)"),
    "rope-linear-factor-string": ("llama_mha", {"rope_parameters": {"rope_type": "linear", "factor": "2"}},
                                  'rope_scaling.factor must be a positive number, got "2"'),
    "sliding-window-negative": ("mistral_gqa", {"sliding_window": -5},
                                "sliding_window must be a positive integer or null, got -5"),
    "qwen2-max-window-layers-negative": ("qwen2_bias", {"max_window_layers": -1},
                                         "max_window_layers must be a non-negative integer, got -1"),
    "mlp-only-layers-out-of-range": ("qwen2_moe_mlp_only", {"mlp_only_layers": [5]},
                                     "mlp_only_layers must be a list of at most num_hidden_layers layer indices in "
                                     "[0, num_hidden_layers), got [5]"),
    "top-k-beyond-experts": ("qwen3_moe_norm", {"num_experts_per_tok": 9},
                             "unsupported Mixture-of-Experts configuration: num_experts_per_tok 9 must be in [1, 8] "
                             "(the experts)"),
    "experts-string": ("mixtral", {"num_local_experts": "4"}, 'num_local_experts must be a positive integer, got "4"'),
    "clip-qkv-negative": ("olmoe", {"clip_qkv": -0.5}, "clip_qkv must be a positive number or null, got -0.5"),
    "deepseek-rope-dim-string": ("deepseek_v2_moe", {"qk_rope_head_dim": "8"},
                                 'qk_rope_head_dim must be a positive integer, got "8"'),
    "deepseek-dense-layers-negative": ("deepseek_v3_moe", {"first_k_dense_replace": -1},
                                       "first_k_dense_replace must be a non-negative integer, got -1"),
    # special token ids: an id or a list of ids of the vocabulary, nothing else
    "eos-float": ("llama_mha", {"eos_token_id": 2.0}, f"eos_token_id must be {TOKEN_IDS}, got 2.0"),
    "eos-nested-list": ("llama_mha", {"eos_token_id": [[1, 2]]}, f"eos_token_id must be {TOKEN_IDS}, got [[1, 2]]"),
    "eos-object": ("llama_mha", {"eos_token_id": {"id": 2}}, f'eos_token_id must be {TOKEN_IDS}, got {{"id": 2}}'),
    "eos-bool": ("llama_mha", {"eos_token_id": True}, f"eos_token_id must be {TOKEN_IDS}, got true"),
    "eos-list-with-bool": ("llama_mha", {"eos_token_id": [2, False]},
                           f"eos_token_id must be {TOKEN_IDS}, got [2, false]"),
    "bos-string": ("llama_mha", {"bos_token_id": "<s>"}, f'bos_token_id must be {TOKEN_IDS}, got "<s>"'),
    "bos-negative": ("llama_mha", {"bos_token_id": -1}, f"bos_token_id must be {TOKEN_IDS}, got -1"),
    "pad-string": ("llama_mha", {"pad_token_id": "x"}, f'pad_token_id must be {TOKEN_IDS}, got "x"'),
    "pad-float": ("llama_mha", {"pad_token_id": 0.5}, f"pad_token_id must be {TOKEN_IDS}, got 0.5"),
    "pad-outside-vocab": ("llama_mha", {"pad_token_id": 160}, f"pad_token_id 160 {OUTSIDE_VOCAB.format('pad')}"),
    "bos-list-outside-vocab": ("llama_mha", {"bos_token_id": [1, 500]},
                               f"bos_token_id 500 {OUTSIDE_VOCAB.format('bos')}"),
    # sizes beyond any real model's, which would loop or allocate until killed
    "layers-huge": ("llama_mha", {"num_hidden_layers": 10**9},
                    f"num_hidden_layers {AT_MOST} 1024{REAL}, got 1000000000"),
    "hidden-huge": ("llama_mha", {"hidden_size": 2**40}, f"hidden_size {AT_MOST} 262144{REAL}, got 1099511627776"),
    "intermediate-huge": ("llama_mha", {"intermediate_size": 10**9},
                          f"intermediate_size {AT_MOST} 262144{REAL}, got 1000000000"),
    "heads-huge": ("llama_mha", {"num_attention_heads": 10**6},
                   f"num_attention_heads {AT_MOST} 1024{REAL}, got 1000000"),
    "kv-heads-huge": ("llama_mha", {"num_key_value_heads": 10**6},
                      f"num_key_value_heads {AT_MOST} 1024{REAL}, got 1000000"),
    "head-dim-huge": ("llama_mha", {"head_dim": 10**8}, f"head_dim {AT_MOST} 262144{REAL}, got 100000000"),
    "vocab-huge": ("llama_mha", {"vocab_size": 10**12}, f"vocab_size {AT_MOST} 2097152{REAL}, got 1000000000000"),
    "context-huge": ("llama_mha", {"max_position_embeddings": 10**10},
                     f"max_position_embeddings {AT_MOST} 16777216{REAL}, got 10000000000"),
    "sliding-window-huge": ("mistral_gqa", {"sliding_window": 2**60},
                            f"sliding_window {AT_MOST} 16777216{REAL}, got 1152921504606846976"),
    "rope-original-context-huge": ("llama_mha", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4,
                                                                     "factor": 8.0, "low_freq_factor": 1.0,
                                                                     "high_freq_factor": 4.0,
                                                                     "original_max_position_embeddings": 10**12}},
                                   f"rope_scaling.original_max_position_embeddings {AT_MOST} 16777216{REAL}, "
                                   "got 1000000000000"),
    "mixtral-experts-huge": ("mixtral", {"num_local_experts": 10**6},
                             f"num_local_experts {AT_MOST} 4096{REAL}, got 1000000"),
    "qwen3-moe-experts-huge": ("qwen3_moe_norm", {"num_experts": 10**6},
                               f"num_experts {AT_MOST} 4096{REAL}, got 1000000"),
    "qwen2-moe-expert-width-huge": ("qwen2_moe_shared", {"shared_expert_intermediate_size": 10**9},
                                    f"shared_expert_intermediate_size {AT_MOST} 262144{REAL}, got 1000000000"),
    "qwen2-moe-sparse-step-huge": ("qwen2_moe_shared", {"decoder_sparse_step": 10**9},
                                   f"decoder_sparse_step {AT_MOST} 1024{REAL}, got 1000000000"),
    "deepseek-experts-huge": ("deepseek_v3_moe", {"n_routed_experts": 2**32},
                              f"n_routed_experts {AT_MOST} 4096{REAL}, got 4294967296"),
    "deepseek-latent-huge": ("deepseek_v2_moe", {"kv_lora_rank": 10**9},
                             f"kv_lora_rank {AT_MOST} 262144{REAL}, got 1000000000"),
    "deepseek-dense-layers-huge": ("deepseek_v3_moe", {"first_k_dense_replace": 10**9},
                                   f"first_k_dense_replace {AT_MOST} 1024{REAL}, got 1000000000"),
    "mlp-only-layers-repeated": ("qwen2_moe_mlp_only", {"mlp_only_layers": [0] * 10**6},
                                 "mlp_only_layers must be a list of at most num_hidden_layers layer indices in "
                                 f"[0, num_hidden_layers), got {'[' + '0, ' * 26 + '0...'}"),
    # float hyperparameters: finite, and rms_norm_eps in (0, 1] (real models use 1e-5 or 1e-6)
    "eps-huge": ("llama_mha", {"rms_norm_eps": 1e30}, f"rms_norm_eps {AT_MOST} 1.0{REAL}, got 1e+30"),
    "eps-just-above-one": ("llama_mha", {"rms_norm_eps": 1.5}, f"rms_norm_eps {AT_MOST} 1.0{REAL}, got 1.5"),
    "eps-nan": ("llama_mha", {"rms_norm_eps": float("nan")}, "rms_norm_eps must be a positive number, got NaN"),
    "eps-infinite": ("llama_mha", {"rms_norm_eps": float("inf")},
                     "rms_norm_eps must be a positive number, got Infinity"),
    "eps-negative": ("llama_mha", {"rms_norm_eps": -1e-6}, "rms_norm_eps must be a positive number, got -1e-06"),
    "theta-nan": ("llama_mha", {"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}},
                  "rope_theta must be a positive number, got NaN"),
    "theta-infinite": ("llama_mha", {"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}},
                       "rope_theta must be a positive number, got Infinity"),
    "theta-negative": ("llama_mha", {"rope_parameters": {"rope_type": "default", "rope_theta": -1e4}},
                       "rope_theta must be a positive number, got -10000.0"),
    "rope-factor-infinite": ("llama_mha", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4,
                                                               "factor": float("inf")}},
                             "rope_scaling.factor must be a positive number, got Infinity"),
    "routed-scaling-nan": ("deepseek_v3_moe", {"routed_scaling_factor": float("nan")},
                           "routed_scaling_factor must be a positive number, got NaN"),
    "clip-qkv-infinite": ("olmoe", {"clip_qkv": float("inf")},
                          "clip_qkv must be a positive number or null, got Infinity"),
}
# a value edited to None is removed from the config


@pytest.mark.parametrize("name", BAD_VALUES)
def test_bad_config_value_is_refused_at_convert(name, tiny_zoo, tmp_path):
    case, edit, message = BAD_VALUES[name]

    def apply(config):
        for key, value in edit.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value

    src = edited_hf_folder(tiny_zoo, case, tmp_path / case, config=apply)
    if message.startswith("unsupported"):  # the model's, not the file's: not prefixed with the config's path
        assert refused(src, tmp_path, UnsupportedModelError) == message
    else:
        assert refused(src, tmp_path) == f"{src / 'config.json'}: {message}"


# Sizes within the limits but beyond the tensors the source holds: refused before the converter lists the
# config's tensors (a list that grows with layers times experts). (case, config edit, exact problem after "<src>: ")
BEYOND_TENSORS = {
    "layers": ("llama_mha", {"num_hidden_layers": 1000},
               "num_hidden_layers is 1000, but the weights hold the tensors of 2 layers"),
    "most-layers-and-experts": ("qwen3_moe_norm", {"num_hidden_layers": 1024, "num_experts": 4096},
                                "num_hidden_layers is 1024, but the weights hold the tensors of 2 layers"),
    "mixtral-experts": ("mixtral", {"num_local_experts": 4096},
                        "num_local_experts is 4096, but the weights hold 4 routed experts for layer 0"),
    "qwen2-moe-experts": ("qwen2_moe_mlp_only", {"num_experts": 4000},
                          "num_experts is 4000, but the weights hold 4 routed experts for layer 1"),
    "deepseek-experts": ("deepseek_v3_moe", {"n_routed_experts": 4096},
                         "n_routed_experts is 4096, but the weights hold 8 routed experts for layer 1"),
}


@pytest.mark.parametrize("name", BEYOND_TENSORS)
def test_counts_beyond_the_tensors_are_refused_before_listing_them(name, tiny_zoo, tmp_path):
    case, edit, problem = BEYOND_TENSORS[name]
    src = edited_hf_folder(tiny_zoo, case, tmp_path / case, config=lambda c: c.update(edit))
    assert refused(src, tmp_path) == f"{src}: {problem}{FIX}"


def _gguf_metadata(path: Path, key: str, value) -> Path:
    """Overwrite the scalar GGUF metadata `key` of the file at `path` in place."""
    reader = gguf.GGUFReader(str(path), "r+")
    reader.fields[key].parts[-1][0] = value
    reader.data.flush()
    return path


GGUF_WHERE = " (its GGUF metadata, read as config.json fields): "


@pytest.mark.parametrize("key, value, message", [
    ("llama.block_count", 2**32 - 1, "num_hidden_layers must be at most 1024 (far above any real model's), "
                                     "got 4294967295"),
    ("llama.embedding_length", 2**31, "hidden_size must be at most 262144 (far above any real model's), "
                                      "got 2147483648"),
    ("llama.context_length", 2**32 - 1, "max_position_embeddings must be at most 16777216 (far above any real "
                                        "model's), got 4294967295"),
    ("llama.attention.layer_norm_rms_epsilon", float("nan"), "rms_norm_eps must be a positive number, got NaN"),
    ("llama.attention.layer_norm_rms_epsilon", 1e30, "rms_norm_eps must be at most 1.0 (far above any real model's), "
                                                     "got 1.0000000150474662e+30"),
    ("llama.rope.freq_base", float("inf"), "rope_theta must be a positive number, got Infinity"),
])
def test_gguf_metadata_beyond_the_limits_is_refused_by_the_spec(key, value, message, tiny_zoo, tmp_path):
    """GGUF keys become the spec's fields: the same limits refuse them."""
    path = _gguf_metadata(write_hf_model_gguf(tiny_zoo.hf_model("mistral_gqa"), tmp_path / "big.gguf", "llama"),
                          key, value)
    assert refused(path, tmp_path) == f"{path}{GGUF_WHERE}{message}"


def test_gguf_moe_block_count_beyond_the_limit_is_refused_before_looping_over_layers(tiny_zoo, tmp_path):
    path = _gguf_metadata(write_hf_model_gguf(tiny_zoo.hf_model("qwen3_moe_raw"), tmp_path / "moe.gguf", "qwen3moe"),
                          "qwen3moe.block_count", 2**32 - 1)
    assert refused(path, tmp_path) == (
        "GGUF key 'qwen3moe.block_count' is 4294967295; expected at most 1024 (far above any real model's)")


@pytest.mark.parametrize("rope_type", ["proportional", "ntk_by_parts"])
def test_unknown_rope_type_is_refused_at_convert(rope_type, tiny_zoo, tmp_path):
    src = edited_hf_folder(tiny_zoo, "llama_mha", tmp_path / "rope", config=lambda c: c.update(
        rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0}))
    assert refused(src, tmp_path, UnsupportedModelError) == (
        f'rope_scaling.rope_type "{rope_type}" is not supported; supported: default, linear, dynamic, llama3, yarn, '
        "longrope, freq_factors")


@pytest.mark.parametrize("case, field", [
    ("llama_mha", "num_attention_heads"), ("llama_mha", "hidden_size"), ("llama_mha", "vocab_size"),
    ("llama_mha", "intermediate_size"), ("mixtral", "num_local_experts"), ("qwen2_moe_shared", "moe_intermediate_size"),
    ("qwen2_moe_mlp_only", "intermediate_size"),  # its layer 0 is dense
    ("deepseek_v2_mla", "kv_lora_rank"), ("deepseek_v3_moe", "n_routed_experts"),
])
def test_missing_structural_field_is_refused_not_defaulted(case, field, tiny_zoo, tmp_path):
    """A default (transformers' or ours) would not match the weights, and the manifest would record it."""
    src = edited_hf_folder(tiny_zoo, case, tmp_path / case, config=lambda c: c.pop(field))
    family = tiny_zoo.case(case).family
    assert refused(src, tmp_path) == (
        f"{src / 'config.json'}: {field} is missing; a {family} config must give it: the weights' shapes depend on "
        "it, so no default can stand in")


def test_several_missing_fields_are_named_together(tiny_zoo, tmp_path):
    def drop(config):
        del config["hidden_size"], config["vocab_size"]

    src = edited_hf_folder(tiny_zoo, "llama_mha", tmp_path / "two", config=drop)
    assert refused(src, tmp_path) == (
        f"{src / 'config.json'}: vocab_size, hidden_size are missing; a llama config must give them: the weights' "
        "shapes depend on them, so no default can stand in")


def test_optional_fields_keep_their_defaults(tiny_zoo, tmp_path):
    def drop(config):
        for key in ("rms_norm_eps", "tie_word_embeddings", "max_position_embeddings", "num_key_value_heads",
                    "head_dim", "rope_parameters"):
            config.pop(key, None)

    src = edited_hf_folder(tiny_zoo, "llama_mha", tmp_path / "optional", config=drop)
    convert(str(src), str(tmp_path / "out"), F32, progress=False)
    model = json.loads((tmp_path / "out" / MANIFEST).read_text())["model"]
    assert (model["num_key_value_heads"], model["head_dim"], model["tie_word_embeddings"]) == (4, 16, False)


def test_cli_prints_one_line_for_a_bad_config_value(tiny_zoo, tmp_path, capsys):
    src = edited_hf_folder(tiny_zoo, "llama_mha", tmp_path / "kv0", config=lambda c: c.update(num_key_value_heads=0))
    out = tmp_path / "out"
    code, stdout, stderr = run_cli(capsys, "convert", src, out, "--quiet")
    assert (code, stdout, stderr) == (
        2, "", f"error: {src / 'config.json'}: num_key_value_heads must be a positive integer or null, got 0\n")
    assert_nothing_written(out)


def test_cli_prints_one_line_for_a_size_beyond_the_limits(tiny_zoo, tmp_path, capsys):
    src = edited_hf_folder(tiny_zoo, "llama_mha", tmp_path / "layers",
                           config=lambda c: c.update(num_hidden_layers=10**9))
    out = tmp_path / "out"
    code, stdout, stderr = run_cli(capsys, "convert", src, out, "--quiet")
    assert (code, stdout, stderr) == (
        2, "", f"error: {src / 'config.json'}: num_hidden_layers must be at most 1024 (far above any real model's), "
               "got 1000000000\n")
    assert_nothing_written(out)


@pytest.mark.parametrize("config, error, message", [
    ([1, 2], ConversionError, "config.json: the config must be a JSON object, got [1, 2]"),
    ({"model_type": ["llama"]}, ConversionError,
     'config.json: model_type must be a string, got ["llama"]; supported model types: deepseek_v2, deepseek_v3, gemma3_text, llama, '
     "llama_moe, mistral, mixtral, olmoe, qwen2, qwen2_moe, qwen3, qwen3_moe"),
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16,
      "rope_scaling": {"rope_type": "freq_factors", "factors": [1.0, 2.0]}}, ConversionError,
     "config.json: rope_scaling.factors must be 8 positive numbers (one per rotary pair of head_dim 16), got 2 values"),
    ({"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
      "layer_types": "sliding_attention"}, ConversionError,
     'config.json: layer_types must be a list of strings or null, got "sliding_attention"'),
])
def test_malformed_configs_are_refused_by_spec_from_dict(config, error, message):
    with pytest.raises(error) as raised:
        spec_from_dict(config, where="config.json")
    assert str(raised.value) == message


def test_real_models_sizes_are_within_the_limits():
    """The largest released models' sizes pass: Gemma 3's vocabulary, Qwen3-Next's 512 experts, Llama 3.1 405B's
    126 layers and FFN, Nemotron-4 340B's FFN, Llama 4 Scout's 10M-token context, DeepSeek-V3's routing."""
    LlamaSpec(vocab_size=262144, hidden_size=16384, intermediate_size=73728, num_hidden_layers=126,
              num_attention_heads=128, num_key_value_heads=8, max_position_embeddings=10485760, rms_norm_eps=1e-5,
              rope_theta=5e5)
    spec_from_dict(dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=4096, num_hidden_layers=94,
                        num_attention_heads=64, num_key_value_heads=4, num_experts=512, num_experts_per_tok=10,
                        moe_intermediate_size=1536, max_position_embeddings=262144, rms_norm_eps=1e-6,
                        rope_theta=1e7), strict=True)
    spec_from_dict(dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                        num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
                        n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=2048, n_group=8,
                        topk_group=4, first_k_dense_replace=3, max_position_embeddings=163840,
                        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
                   strict=True)


@pytest.mark.parametrize("family", sorted(SPEC_CLASSES))
def test_every_spec_class_checks_its_fields_when_built(family):
    with pytest.raises(ConversionError) as raised:
        SPEC_CLASSES[family](hidden_size="64")
    assert str(raised.value) == 'hidden_size must be a positive integer, got "64"'


def test_numpy_scalars_from_gguf_metadata_are_plain_values_in_the_spec():
    spec = LlamaSpec(hidden_size=np.int64(64), num_attention_heads=np.int32(4), num_hidden_layers=np.uint32(2),
                     rms_norm_eps=np.float32(1e-5))
    assert [type(v) for v in (spec.hidden_size, spec.num_attention_heads, spec.head_dim, spec.rms_norm_eps)] == [
        int, int, int, float]
    json.dumps(spec.to_dict())


# ------------------------------------------------------------------- tensor shapes at convert


def _set(name, make):
    return lambda weights: weights.__setitem__(name, make(weights[name]))


K0 = "model.layers.0.self_attn.k_proj.weight"
K0_NEEDS = "the config (hidden_size 64, 2 KV heads of 16) needs [32, 64]"
BAD_SHAPES = {
    "k-proj-transposed": ("mistral_gqa", _set(K0, lambda w: np.ascontiguousarray(w.T)),
                          f"tensor {K0} has shape [64, 32]; {K0_NEEDS}"),
    "k-proj-1d": ("mistral_gqa", _set(K0, lambda w: w.reshape(-1)), f"tensor {K0} has shape [2048]; {K0_NEEDS}"),
    "k-proj-one-head": ("mistral_gqa", _set(K0, lambda w: w[:16]), f"tensor {K0} has shape [16, 64]; {K0_NEEDS}"),
    "embeddings-short": ("llama_mha", _set("model.embed_tokens.weight", lambda w: w[:150]),
                         "tensor model.embed_tokens.weight has shape [150, 64]; the config (vocab_size 160, "
                         "hidden_size 64) needs [160, 64]"),
    "norm-2d": ("llama_mha", _set("model.norm.weight", lambda w: w[None, :]),
                "tensor model.norm.weight has shape [1, 64]; the config (hidden_size 64) needs [64]"),
    "q-bias-short": ("qwen2_bias", _set("model.layers.1.self_attn.q_proj.bias", lambda w: w[:48]),
                     "tensor model.layers.1.self_attn.q_proj.bias has shape [48]; the config (4 heads of 16) "
                     "needs [64]"),
    "qwen3-q-norm-whole-projection": ("qwen3_qknorm", _set("model.layers.0.self_attn.q_norm.weight",
                                                           lambda w: np.tile(w, 4)),
                                      "tensor model.layers.0.self_attn.q_norm.weight has shape [128]; the config "
                                      "(head_dim 32) needs [32]"),
    "down-proj-transposed": ("llama_mha", _set("model.layers.1.mlp.down_proj.weight",
                                               lambda w: np.ascontiguousarray(w.T)),
                             "tensor model.layers.1.mlp.down_proj.weight has shape [96, 64]; the config (hidden_size "
                             "64, intermediate_size 96) needs [64, 96]"),
    "expert-transposed": ("qwen3_moe_norm", _set("model.layers.1.mlp.experts.3.down_proj.weight",
                                                 lambda w: np.ascontiguousarray(w.T)),
                          "tensor model.layers.1.mlp.experts.3.down_proj.weight has shape [32, 64]; the config "
                          "(hidden_size 64, expert intermediate size 32) needs [64, 32]"),
    "router-short": ("mixtral", _set("model.layers.0.block_sparse_moe.gate.weight", lambda w: w[:3]),
                     "tensor model.layers.0.mlp.gate.weight has shape [3, 64]; the config (4 routed experts, "
                     "hidden_size 64) needs [4, 64]"),
    "shared-expert-gate-1d": ("qwen2_moe_shared", _set("model.layers.0.mlp.shared_expert_gate.weight",
                                                       lambda w: w.reshape(-1)),
                              "tensor model.layers.0.mlp.shared_expert_gate.weight has shape [64]; the config "
                              "(hidden_size 64) needs [1, 64]"),
    "mla-kv-b-wrong": ("deepseek_v2_mla", _set("model.layers.0.self_attn.kv_b_proj.weight", lambda w: w[:, :16]),
                       "tensor model.layers.0.self_attn.kv_b_proj.weight has shape [192, 16]; the config "
                       "(kv_lora_rank 32, 4 heads of qk_nope_head_dim 16 + v_head_dim 32) needs [192, 32]"),
    "mla-q-b-wrong": ("deepseek_v3_mla", _set("model.layers.1.self_attn.q_b_proj.weight", lambda w: w[:90]),
                      "tensor model.layers.1.self_attn.q_b_proj.weight has shape [90, 40]; the config (q_lora_rank "
                      "40, 4 heads of qk_nope_head_dim 16 + qk_rope_head_dim 8) needs [96, 40]"),
    "deepseek-shared-experts-wrong": ("deepseek_v2_moe",
                                      _set("model.layers.1.mlp.shared_experts.up_proj.weight", lambda w: w[:32]),
                                      "tensor model.layers.1.mlp.shared_experts.up_proj.weight has shape [32, 64]; "
                                      "the config (hidden_size 64, shared experts' intermediate size 64) "
                                      "needs [64, 64]"),
    "score-correction-bias-short": ("deepseek_v3_moe",
                                    _set("model.layers.1.mlp.gate.e_score_correction_bias", lambda w: w[:4]),
                                    "tensor model.layers.1.mlp.gate.e_score_correction_bias has shape [4]; the config "
                                    "(8 routed experts) needs [8]"),
}


@pytest.mark.parametrize("name", BAD_SHAPES)
def test_tensor_of_the_wrong_shape_is_refused_before_anything_is_written(name, tiny_zoo, tmp_path):
    case, edit, problem = BAD_SHAPES[name]
    src = edited_hf_folder(tiny_zoo, case, tmp_path / case, tensors=edit)
    assert refused(src, tmp_path) == f"{src}: {problem}{FIX}"


def test_a_wrong_hidden_size_names_the_first_tensor_and_counts_the_rest(tiny_zoo, tmp_path):
    src = edited_hf_folder(tiny_zoo, "llama_mha", tmp_path / "h128",
                           config=lambda c: c.update(hidden_size=128, head_dim=32))
    assert refused(src, tmp_path) == (
        f"{src}: tensor model.embed_tokens.weight has shape [160, 64]; the config (vocab_size 160, hidden_size 128) "
        f"needs [160, 128] (20 more tensors disagree too){FIX}")


def test_gguf_tensor_of_the_wrong_shape_is_refused_in_out_in_order(tiny_zoo, tmp_path):
    path = write_hf_model_gguf(tiny_zoo.hf_model("mistral_gqa"), tmp_path / "k.gguf", "llama",
                               edit=lambda t: t.update({"blk.0.attn_k.weight": t["blk.0.attn_k.weight"][:16]}))
    assert refused(path, tmp_path) == (
        f"{path}: tensor {K0} has shape [16, 64]; the config (hidden_size 64, 2 KV heads of 16) needs [32, 64] "
        f"(numpy order [out, in]; GGUF lists the dimensions reversed){FIX}")


@pytest.mark.parametrize("per_expert", [False, True])
def test_gguf_experts_of_the_wrong_shape_are_refused(per_expert, tiny_zoo, tmp_path):
    """Each routed expert is read as its own slice of the file; its shape is checked like any tensor's."""
    def transpose_down(tensors):
        if per_expert:
            tensors["blk.1.ffn_down.2.weight"] = np.ascontiguousarray(tensors["blk.1.ffn_down.2.weight"].T)
        else:
            tensors["blk.1.ffn_down_exps.weight"] = np.ascontiguousarray(
                tensors["blk.1.ffn_down_exps.weight"].transpose(0, 2, 1))

    path = write_hf_model_gguf(tiny_zoo.hf_model("mixtral"), tmp_path / "experts.gguf", "llama",
                               per_expert=per_expert, edit=transpose_down)
    expert = 2 if per_expert else 0
    more = "" if per_expert else " (3 more tensors disagree too)"
    assert refused(path, tmp_path) == (
        f"{path}: tensor model.layers.1.mlp.experts.{expert}.down_proj.weight has shape [96, 64]; the config "
        "(hidden_size 64, expert intermediate size 96) needs [64, 96] (numpy order [out, in]; GGUF lists the "
        f"dimensions reversed){more}{FIX}")


# ------------------------------------------------------------------------- tied embeddings


def _add_lm_head(values):
    def edit(weights):
        weights["lm_head.weight"] = values(weights["model.embed_tokens.weight"])
    return edit


def test_tied_config_with_a_different_lm_head_keeps_it_untied_as_transformers_does(tiny_zoo, tmp_path, caplog):
    """transformers 5 does not tie a checkpoint whose lm_head.weight differs from its embeddings (it warns);
    the checkpoint keeps the source's lm_head and records tie_word_embeddings false."""
    head = np.random.default_rng(0).normal(0, 0.1, (160, 64)).astype(np.float32)
    src = edited_hf_folder(tiny_zoo, "llama_gqa_tied", tmp_path / "tied", tensors=_add_lm_head(lambda e: head))
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING):
        convert(str(src), str(out), F32, progress=False)
    assert [r.getMessage() for r in caplog.records if r.name == "converters.convert"] == [
        f"{src}: the config says tie_word_embeddings true, but lm_head.weight differs from model.embed_tokens.weight; "
        "keeping them untied, as transformers does (the checkpoint records tie_word_embeddings false). If the model "
        "is meant to be tied, remove lm_head.weight from the source; if not, set tie_word_embeddings false in its "
        "config"]
    assert json.loads((out / MANIFEST).read_text())["model"]["tie_word_embeddings"] is False
    with open_checkpoint(str(out)) as ckpt:
        np.testing.assert_array_equal(ckpt.tensors["lm_head.weight"], head)


def test_tied_config_with_a_copy_of_the_embeddings_stays_tied(tiny_zoo, tmp_path, caplog):
    src = edited_hf_folder(tiny_zoo, "llama_gqa_tied", tmp_path / "copy", tensors=_add_lm_head(np.copy))
    with caplog.at_level(logging.WARNING):
        convert(str(src), str(tmp_path / "out"), F32, progress=False)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "tie_word_embeddings" in r.getMessage()]
    assert json.loads((tmp_path / "out" / MANIFEST).read_text())["model"]["tie_word_embeddings"] is True
    assert "lm_head.weight" not in checkpoint_shapes(os.fspath(tmp_path / "out"))


def test_untied_config_without_lm_head_says_to_tie(tiny_zoo, tmp_path):
    src = edited_hf_folder(tiny_zoo, "llama_gqa_tied", tmp_path / "untied",
                           config=lambda c: c.update(tie_word_embeddings=False))
    assert refused(src, tmp_path) == (
        f"{src} has no lm_head.weight, but its config says tie_word_embeddings false; if the model shares its "
        "embeddings with the LM head, set tie_word_embeddings true in the config")


# -------------------------------------------------------------------- damaged manifests at load


@pytest.fixture
def damaged(tiny_zoo, tmp_path):
    """damaged(case, edit): a private copy of the case's f32 checkpoint whose zllm.json `edit(manifest)` changed."""
    def make(case: str, edit) -> str:
        path = Path(shutil.copytree(tiny_zoo.converted(case, F32), tmp_path / case))
        manifest = json.loads((path / MANIFEST).read_text())
        edit(manifest)
        (path / MANIFEST).write_text(json.dumps(manifest))
        return os.fspath(path)
    return make


def test_manifest_spec_disagreeing_with_the_weights_is_a_checkpoint_error_at_load(damaged):
    path = damaged("mistral_gqa", lambda m: m["model"].update(num_key_value_heads=1))
    with pytest.raises(CheckpointError) as raised:
        edge.load(path)
    assert str(raised.value) == (
        f"{path}: tensor {K0} has shape [32, 64]; the config (hidden_size 64, 1 KV heads of 16) needs [16, 64] "
        f"(3 more tensors disagree too){DAMAGED}")


def test_manifest_with_an_invalid_spec_value_is_a_checkpoint_error_at_load(damaged):
    path = damaged("llama_mha", lambda m: m["model"].update(num_attention_heads=0))
    with pytest.raises(CheckpointError) as raised:
        edge.load(path)
    assert str(raised.value) == (f"{os.path.join(path, MANIFEST)}: model: num_attention_heads must be a positive "
                                 "integer, got 0; the checkpoint is damaged, convert the model again")


def test_manifest_expert_layout_disagreeing_with_the_spec_is_a_checkpoint_error_at_load(damaged):
    def swap_down(manifest):
        down = manifest["experts"]["layers"]["1"]["projections"]["down_proj"]
        down["shape"] = down["shape"][::-1]
        down["arrays"][""]["shape"] = down["arrays"][""]["shape"][::-1]

    path = damaged("qwen3_moe_norm", swap_down)
    with pytest.raises(CheckpointError) as raised:
        edge.load(path)
    assert str(raised.value) == (
        f"{path}: tensor model.layers.1.mlp.experts.0.down_proj.weight has shape [32, 64]; the config (hidden_size "
        f"64, expert intermediate size 32) needs [64, 32]{DAMAGED}")


def test_manifest_expert_arrays_disagreeing_with_their_shape_are_a_checkpoint_error(damaged):
    def shrink(manifest):
        manifest["experts"]["layers"]["0"]["projections"]["gate_proj"]["arrays"][""]["shape"] = [16, 64]

    path = damaged("mixtral", shrink)
    with pytest.raises(CheckpointError) as raised:
        edge.load(path)
    assert str(raised.value) == (
        f"{path}: layer 0's expert gate_proj is a f32 matrix of shape [96, 64], but the expert index stores it as "
        "arrays {'': [16, 64]}; the checkpoint is damaged, convert the model again")


def test_manifest_expert_count_disagreeing_with_the_spec_is_a_checkpoint_error(damaged):
    path = damaged("mixtral", lambda m: m["model"].update(num_local_experts=2))
    with pytest.raises(CheckpointError) as raised:
        edge.load(path)
    assert str(raised.value) == (
        f"{path}: the expert index holds 4 experts for layer 0, but the model spec gives that layer 2 routed experts; "
        "the checkpoint is damaged, convert the model again")


def test_manifest_naming_an_unsupported_rope_is_a_checkpoint_error_at_load(damaged):
    path = damaged("llama_mha", lambda m: m["model"].update(rope_scaling={"rope_type": "proportional", "factor": 2.0}))
    with pytest.raises(CheckpointError) as raised:
        edge.load(path)
    assert str(raised.value) == (
        f'{os.path.join(path, MANIFEST)}: model: rope_scaling.rope_type "proportional" is not supported; supported: '
        "default, linear, dynamic, llama3, yarn, longrope, freq_factors; the checkpoint is damaged, convert the model "
        "again")
