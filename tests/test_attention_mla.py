"""Multi-head latent attention (DeepSeek-V2/V3) against transformers, in both forms.

Protocol as tests/test_parity_transformers.py: a 12-token prompt with all logits, then 4 decode
steps fed transformers' greedy tokens; per step max |ours - theirs| <= REL_TOL * max |theirs|.
Models: tiny random DeepSeek configs with dense feed-forward blocks (tests/tiny_models.py
ATTENTION_CASES), f32 weights.

The naive form (per-head K/V rebuilt from the latent) and the absorbed form (queries moved into
latent space) compute the same sums in a different order: they agree with each other to f32
rounding, and each with transformers to REL_TOL.
"""
from __future__ import annotations

import numpy as np
import pytest
from tiny_models import hf_logits, random_prompt, tiny_zoo  # noqa: F401

import edge
from converters.convert import QuantPlan
from edge.core.errors import ZllmError
from edge.core.kv import cache_slots
from edge.core.spec import spec_from_dict

MLA_CASES = ("deepseek_v2_mla", "deepseek_v2_qlora_yarn", "deepseek_v3_mla", "deepseek_v3_halfsplit")
PROMPT = random_prompt(12, seed=7)
N_DECODE = 4
REL_TOL = 1e-4
# the two forms on one backend: same f32 inputs, sums reordered (C = 32 latent terms instead of
# Dn = 16 per-head terms): measured <= 2e-6 of the largest logit
FORMS_TOL = 1e-5
F32 = QuantPlan(weights="f32")


@pytest.fixture(scope="module")
def expected(tiny_zoo):
    cache = {}

    def get(case):
        if case not in cache:
            cache[case] = hf_logits(tiny_zoo.hf_model(case), PROMPT, N_DECODE)
        return cache[case]

    return get


def run(model, fed, form=None):
    model.transformer.mla_form = form
    session = model.session(capacity=32)
    return [session.prefill(PROMPT, all_logits=True)] + [session.decode(token) for token in fed]


def worst(ours, theirs) -> float:
    return max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("device", ["reference", "cpu"])
@pytest.mark.parametrize("case", MLA_CASES)
def test_mla_matches_transformers_in_both_forms(case, device, tiny_zoo, expected):
    prefill, steps, fed = expected(case)
    model = edge.load(tiny_zoo.converted(case, F32), device=device)
    runs = {form: run(model, fed, form) for form in (None, "naive", "absorbed")}
    for form, logits in runs.items():
        assert worst(logits, [prefill] + steps) <= REL_TOL, (case, device, form)
    assert worst(runs["naive"], runs["absorbed"]) <= FORMS_TOL
    # the default prefills in the naive form (decode is absorbed: test_absorbed_decode_never_...)
    assert np.array_equal(runs[None][0], runs["naive"][0])


def test_absorbed_decode_never_rebuilds_per_head_keys(tiny_zoo, expected):
    """Decode reads only the cached latent rows: kv_b_proj (the per-head K/V expansion) is unused."""
    _, _, fed = expected("deepseek_v3_mla")
    model = edge.load(tiny_zoo.converted("deepseek_v3_mla", F32), device="reference")
    session = model.session(capacity=32)
    session.prefill(PROMPT)
    backend = model.backend
    expanding = {id(layer.mla.kv_b) for layer in model.transformer.layers}
    calls = []
    original = backend.linear

    def spy(x, weight, bias=None):
        calls.append(id(weight) in expanding)
        return original(x, weight, bias)

    backend.linear = spy
    try:
        session.decode(fed[0])
    finally:
        del backend.linear
    assert calls and not any(calls)


def test_mla_cache_holds_latent_and_rope_only(tiny_zoo):
    model = edge.load(tiny_zoo.converted("deepseek_v2_mla", F32), device="reference", kv_cache="int8")
    spec = model.spec
    session = model.session(capacity=16)
    session.prefill(PROMPT[:5])
    for slot, buffers in zip(session.cache.slots, session.cache.layers):
        assert [(p.name, p.heads, p.dim, p.format) for p in slot.parts] == [
            ("latent", 1, spec.kv_lora_rank, "int8"), ("rope", 1, spec.qk_rope_head_dim, "f16")]
        assert buffers[0].shape == (16, 1, 32) and buffers[1].shape == (16, 1, 8)
    # latent: 32 int8 codes + one f16 scale; rope part: 8 f16 values
    assert session.cache.bytes_per_token == spec.num_hidden_layers * ((32 + 2) + 8 * 2)
    assert session.cache.nbytes_used == 5 * session.cache.bytes_per_token


DEEPSEEK_V2_LITE = dict(model_type="deepseek_v2", hidden_size=2048, num_hidden_layers=27, num_attention_heads=16,
                        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1)


def test_mla_bytes_per_token_against_gqa_and_mha():
    """Per layer: MLA caches C + R values per position; MHA with the same heads would cache
    H (Dn + R) key values and H Dv value values."""
    spec = spec_from_dict(DEEPSEEK_V2_LITE)
    per_layer = {fmt: cache_slots(spec, fmt, 64, True)[0].bytes_per_token for fmt in ("f32", "f16", "int8")}
    assert per_layer == {"f32": (512 + 64) * 4, "f16": (512 + 64) * 2, "int8": 512 + 2 * 16 + 64 * 2}
    mha_f16 = 16 * (128 + 64) * 2 + 16 * 128 * 2  # keys [H, Dn + R] and values [H, Dv], f16
    assert (mha_f16, per_layer["f16"]) == (10240, 1152)  # DeepSeek-V2-Lite: MLA caches 8.9x less than MHA


@pytest.mark.parametrize("config, message", [
    (dict(DEEPSEEK_V2_LITE, topk_method="noaux_tc"),
     "topk_method 'noaux_tc' is not supported for deepseek_v2; supported: greedy, group_limited_greedy"),
    (dict(DEEPSEEK_V2_LITE, model_type="deepseek_v3", scoring_func="softmax"),
     "scoring_func 'softmax' is not supported for deepseek_v3; supported: sigmoid"),
    (dict(DEEPSEEK_V2_LITE, qk_rope_head_dim=63), "qk_rope_head_dim must be even for rotary embeddings, got 63"),
])
def test_bad_deepseek_configs_are_refused(config, message):
    with pytest.raises(ZllmError) as error:
        spec_from_dict(config)
    assert str(error.value) == message


def test_deepseek_moe_config_follows_transformers():
    v2 = spec_from_dict(dict(DEEPSEEK_V2_LITE, topk_method="group_limited_greedy", n_group=8, topk_group=3,
                             n_shared_experts=2, moe_intermediate_size=1408, routed_scaling_factor=1.0))
    assert v2.moe_for_layer(0) is None
    moe = v2.moe_for_layer(1)
    assert (moe.scoring, moe.group_score, moe.n_group, moe.topk_group, moe.top_k) == ("softmax", "max", 8, 3, 6)
    assert moe.shared_intermediate_size == 2816 and not moe.score_correction_bias
    v3 = spec_from_dict(dict(DEEPSEEK_V2_LITE, model_type="deepseek_v3", n_group=8, topk_group=4,
                             n_routed_experts=64, first_k_dense_replace=3, n_shared_experts=1,
                             moe_intermediate_size=2048, routed_scaling_factor=2.5, norm_topk_prob=True))
    assert v3.moe_for_layer(2) is None
    moe = v3.moe_for_layer(3)
    assert (moe.scoring, moe.group_score, moe.score_correction_bias, moe.norm_topk_prob) == (
        "sigmoid", "top2_sum", True, True)
    assert moe.routed_scaling_factor == 2.5 and moe.shared_intermediate_size == 2048
