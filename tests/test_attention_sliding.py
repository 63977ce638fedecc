"""Sliding-window attention with ring-buffer caches, and per-layer `layer_types`, against
transformers on prompts longer than the window.

A sliding layer of window W keeps only W rows: position p at row p % W. A prefill longer than W
attends over its own keys and keeps the last W; a prefill in chunks reads the held rows back.
Protocol and tolerance as tests/test_parity_transformers.py (f32, 1e-4 of the largest logit).
"""
from __future__ import annotations

import numpy as np
import pytest
from tiny_models import hf_logits, random_prompt, tiny_zoo  # noqa: F401

import edge
from converters.convert import QuantPlan
from edge.core.errors import UnsupportedModelError
from edge.core.spec import spec_from_dict

SLIDING_CASES = ("mistral_swa4", "qwen2_swa_layer1", "qwen2_layer_types", "qwen3_layer_types", "qwen3_moe_swa",
                 "gemma3_swa", "gemma3_pattern_linear")
PROMPT = random_prompt(12, seed=7)  # windows are 4 to 6: the prompt is 2-3 windows long
N_DECODE = 6
REL_TOL = 1e-4
F32 = QuantPlan(weights="f32")


def worst(ours, theirs) -> float:
    return max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("device", ["reference", "cpu"])
@pytest.mark.parametrize("case", SLIDING_CASES)
def test_ring_buffers_match_transformers_past_the_window(case, device, tiny_zoo):
    prefill, steps, fed = hf_logits(tiny_zoo.hf_model(case), PROMPT, N_DECODE)
    model = edge.load(tiny_zoo.converted(case, F32), device=device)
    session = model.session(capacity=32)
    ours = [session.prefill(PROMPT, all_logits=True)] + [session.decode(token) for token in fed]
    assert worst(ours, [prefill] + steps) <= REL_TOL
    windows = [model.spec.sliding_window_for_layer(i) for i in range(model.spec.num_hidden_layers)]
    assert any(windows)
    for window, slot, (keys, values) in zip(windows, session.cache.slots, session.cache.layers):
        assert slot.ring == (window is not None)
        assert len(keys) == len(values) == (window or 32)
    # chunks shorter and longer than the window read the held rows back
    chunked = model.session(capacity=32)
    pieces = [chunked.prefill(PROMPT[:3], all_logits=True), chunked.prefill(PROMPT[3:9], all_logits=True),
              chunked.prefill(PROMPT[9:], all_logits=True)]
    assert worst([np.concatenate(pieces)], [prefill]) <= REL_TOL


def test_ring_cache_memory_stops_at_the_window(tiny_zoo):
    model = edge.load(tiny_zoo.converted("qwen2_layer_types", F32), device="reference")
    session = model.session(capacity=64)
    per_position = [slot.bytes_per_token for slot in session.cache.slots]
    session.prefill(PROMPT)
    session.prefill(PROMPT)
    # layer 0 slides over 4 positions, layer 1 holds all 24
    assert session.cache.nbytes_used == per_position[0] * 4 + per_position[1] * 24
    assert [list(session.cache.held_positions(i)) for i in range(2)] == [list(range(20, 24)), list(range(24))]


QWEN2 = dict(model_type="qwen2", hidden_size=64, num_attention_heads=4, num_hidden_layers=3)


def test_layer_types_choose_the_sliding_layers():
    spec = spec_from_dict(dict(QWEN2, use_sliding_window=True, sliding_window=8, max_window_layers=0,
                               layer_types=["full_attention", "sliding_attention", "full_attention"]))
    assert [spec.sliding_window_for_layer(i) for i in range(3)] == [None, 8, None]
    # without layer_types, layers at index >= max_window_layers slide
    spec = spec_from_dict(dict(QWEN2, use_sliding_window=True, sliding_window=8, max_window_layers=2))
    assert [spec.sliding_window_for_layer(i) for i in range(3)] == [None, None, 8]
    # transformers ignores the window (and layer_types' sliding entries) without use_sliding_window
    spec = spec_from_dict(dict(QWEN2, sliding_window=8, layer_types=["sliding_attention"] * 3))
    assert [spec.sliding_window_for_layer(i) for i in range(3)] == [None, None, None]


@pytest.mark.parametrize("model_type, extra", [
    ("qwen2", {}), ("qwen3", {}),
    ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=16)),
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)),
])
@pytest.mark.parametrize("max_window_layers", [0, 2, 3, 5])
def test_sliding_layers_without_layer_types_follow_transformers(model_type, extra, max_window_layers):
    """Each family derives its sliding layers its own way when config.json has no layer_types (older
    exports); the windows must be the ones transformers' config class derives."""
    from transformers import AutoConfig

    fields = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=5,
                  intermediate_size=32, use_sliding_window=True, sliding_window=8,
                  max_window_layers=max_window_layers, **extra)
    theirs = AutoConfig.for_model(model_type, **fields)
    ours = spec_from_dict(dict(fields, model_type=model_type))
    layer_types = getattr(theirs, "layer_types", None) or ["sliding_attention"] * 5  # qwen3_moe: every layer
    expected = [8 if kind == "sliding_attention" else None for kind in layer_types]
    assert [ours.sliding_window_for_layer(i) for i in range(5)] == expected


@pytest.mark.parametrize("config, message", [
    (dict(QWEN2, layer_types=["full_attention"] * 2),
     "layer_types lists 2 layers but num_hidden_layers is 3; the config is inconsistent, fix layer_types"),
    (dict(QWEN2, layer_types=["full_attention", "chunked_attention", "full_attention"]),
     "layer_types ['chunked_attention'] are not supported for qwen2; supported: full_attention, sliding_attention"),
    (dict(model_type="gpt_oss", hidden_size=64),
     "model_type 'gpt_oss' is not supported: its attention sinks (a learned per-head logit in every softmax) are "
     "not implemented; supported model types: deepseek_v2, deepseek_v3, gemma3_text, llama, llama_moe, mistral, mixtral, "
     "olmoe, qwen2, qwen2_moe, qwen3, qwen3_moe"),
])
def test_unsupported_layer_types_and_sinks_are_refused(config, message):
    with pytest.raises(UnsupportedModelError) as error:
        spec_from_dict(config)
    assert str(error.value) == message
