"""Gemma 3 (transformers' Gemma3TextConfig) against transformers on the reference and the cpu device's fused
executor, and where it does not run.

Its decoder layer differs from the Llama lineage's in each part: embeddings scaled by sqrt(hidden),
RMSNorm by (1 + w), the attention's and the feed-forward's outputs normalised before each residual
add, q/k norms, scores scaled by query_pre_attn_scalar ** -0.5, a GELU-tanh gated feed-forward, and
sliding layers with a rotary base of their own. Protocol and tolerance as
tests/test_parity_transformers.py: a 12-token prefill with every position's logits, then decode steps
fed transformers' greedy tokens, each within 1e-4 of the largest logit (f32 weights); prompts run past
the windows (4 and 6)."""
from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch
import gguf
from gguf_files import finish, write_hf_model_gguf
from tiny_models import (
    GEMMA_CASE_NAMES,
    build_hf_model,
    checkpoint_float_weights,
    hf_logits,
    hf_model_with_weights,
    random_prompt,
    tiny_zoo,  # noqa: F401
)

import edge
from converters.convert import QuantPlan, convert
from devices.base import DeviceUnavailableError, check_llama_layers
from edge.core.errors import ConversionError, UnsupportedModelError
from edge.core.spec import spec_from_dict

PROMPT = random_prompt(12, seed=7)
N_DECODE = 6
REL_TOL = 1e-4
F32 = QuantPlan(weights="f32")


def worst(ours, theirs) -> float:
    return max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(ours, theirs))


def run(path: str, device: str, fed: list[int]) -> list[np.ndarray]:
    with edge.load(path, device=device) as model:
        if device.startswith("cpu"):  # the whole forward in one compiled call, as for the Llama lineage
            assert model.device_info()["forward"] == "fused"
        session = model.session(capacity=32)
        return [session.prefill(PROMPT, all_logits=True)] + [session.decode(token) for token in fed]


@pytest.mark.parametrize("device", ["reference", "cpu", "cpu:f32"])
@pytest.mark.parametrize("case", GEMMA_CASE_NAMES)
def test_logits_match_transformers(case, device, tiny_zoo):
    prefill, steps, fed = hf_logits(tiny_zoo.hf_model(case), PROMPT, N_DECODE)
    assert worst(run(tiny_zoo.converted(case, F32), device, fed), [prefill] + steps) <= REL_TOL


def test_int4_checkpoint_computes_the_model_it_stores(tiny_zoo):
    """transformers given the checkpoint's dequantized weights agrees with the cpu device on it."""
    path = tiny_zoo.converted("gemma3_swa", QuantPlan(weights="int4", group_size=32, symmetric=True))
    hf = hf_model_with_weights(tiny_zoo.hf_model("gemma3_swa"), checkpoint_float_weights(path))
    prefill, steps, fed = hf_logits(hf, PROMPT, N_DECODE)
    assert worst(run(path, "cpu:f32", fed), [prefill] + steps) <= REL_TOL


@pytest.mark.parametrize("change", [{"sliding_window": 64}, {"query_pre_attn_scalar": 32},
                                    {"rope_parameters": {"sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10000.0},
                                                         "full_attention": {"rope_type": "default",
                                                                            "rope_theta": 10000.0}}}],
                         ids=["window", "query_scale", "local_rope_base"])
def test_each_gemma_setting_changes_transformers_logits(change, tiny_zoo):
    """The case's window, query scale and local rotary base each change transformers' logits (so the
    parity above proves that each is honoured), the window only once keys fall out of it."""
    tiny = tiny_zoo.case("gemma3_swa")
    changed = build_hf_model(dataclasses.replace(tiny, config={**tiny.config, **change}))
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        a = tiny_zoo.hf_model("gemma3_swa")(ids).logits[0].numpy()
        b = changed(ids).logits[0].numpy()
    errors = np.abs(a - b).max(axis=1) / np.abs(a).max(axis=1)
    # position 0 attends to itself alone at angle 0, so neither scale nor rotation changes it
    first = 4 if "sliding_window" in change else 1
    assert errors[:first].max() <= 1e-6
    assert errors[first:].max() >= 1e-2


@pytest.mark.parametrize("pattern", ["per_layer_flags", "period"])
def test_a_gguf_written_as_llama_cpp_writes_gemma3_matches_transformers(pattern, tiny_zoo, tmp_path):
    """llama.cpp's names (ffn_norm is the feed-forward's input norm, post_ffw_norm its output's), its
    1 + w norm gains, its global rope in the metadata and linear scaling on the global layers only; the
    sliding pattern as gguf-py writes it (a flag per layer), or as a period."""
    hf = tiny_zoo.hf_model("gemma3_pattern_linear")
    path = write_hf_model_gguf(hf, tmp_path / "gemma3.gguf", "gemma3")
    if pattern == "period":
        reader = gguf.GGUFReader(path)
        writer = gguf.GGUFWriter(str(tmp_path / "period.gguf"), "gemma3")
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name in ("general.architecture",
                                                                 "gemma3.attention.sliding_window_pattern"):
                continue
            writer.add_key_value(field.name, field.contents(), field.types[0],
                                 field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
        writer.add_uint32("gemma3.attention.sliding_window_pattern", 3)
        for tensor in reader.tensors:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_shape=list(reversed(tensor.shape.tolist())),
                              raw_dtype=tensor.tensor_type)
        finish(writer)
        path = tmp_path / "period.gguf"
    out = tmp_path / "converted"
    convert(str(path), str(out), F32, progress=False)
    prefill, steps, fed = hf_logits(hf, PROMPT, N_DECODE)
    assert worst(run(str(out), "cpu", fed), [prefill] + steps) <= REL_TOL


def spec_of(**fields):
    base = dict(model_type="gemma3_text", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=7,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return spec_from_dict({**base, **fields})


def test_layer_types_follow_the_sliding_window_pattern():
    spec = spec_of(sliding_window=8, _sliding_window_pattern=3)
    assert [spec.sliding_window_for_layer(i) for i in range(7)] == [8, 8, None, 8, 8, None, 8]
    assert [spec.rope_theta_for_layer(i) for i in range(7)] == [10000.0, 10000.0, 1e6, 10000.0, 10000.0, 1e6, 10000.0]
    assert spec_of().attention_scale == 256 ** -0.5  # query_pre_attn_scalar's default, not head_dim's


@pytest.mark.parametrize("fields, error, words", [
    ({"final_logit_softcapping": 30.0}, UnsupportedModelError, "soft-capping"),
    ({"attn_logit_softcapping": 50.0}, UnsupportedModelError, "soft-capping"),
    ({"hidden_activation": "relu"}, UnsupportedModelError, "gelu_pytorch_tanh"),
    ({"use_bidirectional_attention": True}, UnsupportedModelError, "causal"),
    ({"layer_types": ["sliding_attention"] * 3}, UnsupportedModelError, "num_hidden_layers"),
    ({"query_pre_attn_scalar": 0}, ConversionError, "positive"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
     UnsupportedModelError, "sliding layers"),
])
def test_what_is_not_implemented_is_refused_by_name(fields, error, words):
    with pytest.raises(error, match=words):
        spec_of(**fields)


def test_the_multimodal_config_is_refused_with_what_to_convert():
    with pytest.raises(UnsupportedModelError, match="gemma3_text"):
        spec_from_dict({"model_type": "gemma3", "text_config": {}})


@pytest.mark.parametrize("device", ["gpu", "npu"])
def test_devices_without_gemma_layers_refuse_them(device):
    """The gpu and npu executors compose Llama-form layers only: a Gemma model is refused at load, by name."""
    with pytest.raises(DeviceUnavailableError, match="gemma3_text's decoder layer.*use device 'cpu'"):
        check_llama_layers(types.SimpleNamespace(spec=spec_of()), device)
    check_llama_layers(types.SimpleNamespace(spec=spec_from_dict(dict(
        model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2))), device)
