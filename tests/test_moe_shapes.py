"""Mixture-of-Experts models of shapes and configs the family cases (tests/tiny_models.py MOE_CASES) do not show.

Each parity case is a transformers config (vocab 160, random weights as in tiny_models) converted with
f32 weights and compared with transformers on devices "reference" and "cpu" (test_moe_parity's
protocol): the same experts per token per layer, every prefill row and decode step within REL_TOL of
the largest logit. The shapes: top-1 and top-all routing, expert counts that are not powers of two,
expert widths other than the dense FFN's, hidden sizes and head_dims off the 32/64 grid, several
layers mixing dense and sparse blocks (mlp_only_layers, decoder_sparse_step, first_k_dense_replace),
DeepSeek's grouped routing with topk_group < n_group and routed_scaling_factor != 1, prompts of one
token and of many.

A block a config sizes to nothing (n_shared_experts 0, shared_expert_intermediate_size 0) is saved by
transformers as zero-size tensors (and Qwen2-MoE's gate of the empty shared expert): nothing to store.

Configs whose keys a family's transformers model reads differently from its neighbours':
  - DeepSeek-V3's MLP never has biases: an mlp_bias key is ignored;
  - DeepSeek-V2's mlp_bias also gives the MoE layers' shared experts biases: refused by name;
  - sigmoid router logits below -88 (exp overflows float32) route without a numpy warning.

T = tokens, E = experts, A = active experts per token.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from gguf_files import write_hf_model_gguf
from test_moe_parity import hf_routes, record_routes, relative_error
from tiny_models import TinyCase, greedy_decode, hf_logits, random_prompt

import edge
from converters.convert import QuantPlan, convert
from edge.core.errors import UnsupportedModelError
from edge.core.moe import MoeConfig, route
from edge.core.spec import spec_from_dict

REL_TOL = 1e-4  # as tests/test_moe_parity.py: f32 against f32
F32 = QuantPlan(weights="f32")
N_DECODE = 3
_GQA = dict(num_attention_heads=4, num_key_value_heads=2)
_MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=6,
            v_head_dim=10, q_lora_rank=None, hidden_size=48, intermediate_size=56)

CASES = {c.name: c for c in (
    TinyCase("mixtral_top_all_of_5", "mixtral",
             dict(_GQA, hidden_size=48, head_dim=20, intermediate_size=40, num_hidden_layers=2, num_local_experts=5,
                  num_experts_per_tok=5),
             "every expert chosen (top-5 of 5), hidden 48, head_dim 20 != 48/4"),
    TinyCase("qwen2_moe_step2_mlp_only", "qwen2_moe",
             dict(_GQA, hidden_size=40, head_dim=16, intermediate_size=56, num_hidden_layers=4, num_experts=7,
                  num_experts_per_tok=3, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                  decoder_sparse_step=2, mlp_only_layers=[3]),
             "7 experts, top-3; decoder_sparse_step 2 and mlp_only_layers [3]: only layer 1 sparse"),
    TinyCase("qwen3_moe_top1_of_3", "qwen3_moe",
             dict(_GQA, intermediate_size=56, num_hidden_layers=3, num_experts=3, num_experts_per_tok=1,
                  moe_intermediate_size=20, mlp_only_layers=[0, 2], norm_topk_prob=False),
             "top-1 of 3 not renormalised; layers 0 and 2 dense"),
    TinyCase("deepseek_v2_one_of_three_groups", "deepseek_v2",
             dict(_MLA, num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=9, num_experts_per_tok=3,
                  moe_intermediate_size=20, n_shared_experts=2, routed_scaling_factor=1.3,
                  topk_method="group_limited_greedy", n_group=3, topk_group=1, q_lora_rank=24),
             "9 experts in 3 groups, the best group's 3 experts; query LoRA; x1.3"),
    TinyCase("deepseek_v3_twelve_in_four_groups", "deepseek_v3",
             dict(_MLA, num_hidden_layers=2, first_k_dense_replace=0, n_routed_experts=12, num_experts_per_tok=3,
                  moe_intermediate_size=20, n_shared_experts=2, routed_scaling_factor=2.5, n_group=4,
                  topk_group=2, norm_topk_prob=True),
             "12 experts in 4 groups of 3 (top-2 sums), 2 groups kept, top-3 renormalised, x2.5"),
    TinyCase("deepseek_v3_mlp_bias_key", "deepseek_v3",
             dict(_MLA, num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=20, n_shared_experts=1, n_group=2, topk_group=1, norm_topk_prob=False,
                  routed_scaling_factor=0.5, mlp_bias=True),
             "mlp_bias true, which transformers' DeepseekV3MLP ignores; not renormalised, x0.5"),
    TinyCase("qwen2_moe_no_shared_expert", "qwen2_moe",
             dict(_GQA, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                  shared_expert_intermediate_size=0),
             "shared_expert_intermediate_size 0: transformers saves zero-size shared weights and their gate"),
    TinyCase("deepseek_v3_no_shared_experts", "deepseek_v3",
             dict(_MLA, num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=20, n_shared_experts=0, n_group=1, topk_group=1, norm_topk_prob=True),
             "n_shared_experts 0: zero-size shared weights in the file, nothing to store"),
)}
PROMPT_LENGTHS = (1, 17)


def _transformers_run(model, prompt: list[int]):
    """transformers' logits (prefill rows, then each decode step) and its routes [(layer, ids [T, A])]."""
    routes, handles = hf_routes(model)
    try:
        prefill, decode_steps, fed = hf_logits(model, prompt, N_DECODE)
    finally:
        for handle in handles:
            handle.remove()
    return [prefill, *decode_steps], fed, routes


def _assert_matches_transformers(path: str, device: str, prompt: list[int], expected, fed, expected_routes):
    with edge.load(path, device=device) as model:
        routes = record_routes(model).routes
        session = model.session(capacity=len(prompt) + N_DECODE)
        ours = [session.prefill(prompt, all_logits=True)] + [session.decode(token) for token in fed]
    assert [layer for layer, _ in routes] == [layer for layer, _ in expected_routes]
    for (layer, ids), (_, theirs) in zip(routes, expected_routes):
        # each token's set of experts (DeepSeek's routers return them unordered: topk(sorted=False))
        np.testing.assert_array_equal(np.sort(ids, axis=-1), np.sort(theirs, axis=-1),
                                      err_msg=f"{device}, layer {layer}")
    errors = [relative_error(a.reshape(b.shape), b) for a, b in zip(ours, expected)]
    assert max(errors) <= REL_TOL, (device, errors)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op:UserWarning")  # torch, the empty shared experts
@pytest.mark.parametrize("name", list(CASES))
def test_moe_shape_matches_transformers(tiny_zoo, name):
    model, path = tiny_zoo.converted_case(CASES[name], F32)
    for length in PROMPT_LENGTHS:
        prompt = random_prompt(length, seed=length)
        expected, fed, expected_routes = _transformers_run(model, prompt)
        for device in ("reference", "cpu"):
            _assert_matches_transformers(path, device, prompt, expected, fed, expected_routes)


def test_deepseek_v3_ignores_an_mlp_bias_key():
    """transformers' DeepseekV3MLP has no biases: the spec expects none, whatever mlp_bias says."""
    config = CASES["deepseek_v3_mlp_bias_key"].make_config().to_dict()
    assert config["mlp_bias"] is True
    spec = spec_from_dict(config, strict=True)
    assert spec.mlp_bias is False


def test_deepseek_v2_shared_expert_biases_are_refused_by_name():
    """DeepSeek-V2's mlp_bias gives the shared experts of MoE layers biases a MoE block cannot hold."""
    case = TinyCase("v2_mlp_bias", "deepseek_v2",
                    dict(_MLA, num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=20, n_shared_experts=1, mlp_bias=True))
    config = case.make_config().to_dict()
    with pytest.raises(UnsupportedModelError) as raised:
        spec_from_dict(config, strict=True)
    assert str(raised.value) == (
        "deepseek_v2 with mlp_bias true gives the shared experts of its MoE layers biases "
        "(mlp.shared_experts.*.bias), which are not supported; supported: mlp_bias false, or mlp_bias "
        "true with every layer dense (first_k_dense_replace >= num_hidden_layers)")
    # the dense layers' MLP biases alone are supported
    dense = spec_from_dict(dict(config, first_k_dense_replace=2), strict=True)
    assert dense.mlp_bias and all(dense.moe_for_layer(layer) is None for layer in range(2))


def test_sigmoid_routing_of_very_negative_logits_is_warning_free():
    """exp(-x) overflows float32 below x = -88; the score is then 0, as torch.sigmoid rounds it."""
    logits = np.array([[-120.0, -95.0, 3.0, 0.5, -200.0, 1.5]], np.float32)  # [T, E]
    bias = np.array([0.0, 0.2, 0.0, 0.1, 0.0, 0.0], np.float32)
    config = MoeConfig(6, 3, 8, scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, n_group=2,
                       topk_group=2, group_score="top2_sum", score_correction_bias=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ids, weights = route(logits, config, bias)
    scores = torch.sigmoid(torch.from_numpy(logits)).numpy()
    expected_ids = np.argsort(-(scores + bias), axis=-1, kind="stable")[:, :3]
    np.testing.assert_array_equal(ids, expected_ids)
    chosen = np.take_along_axis(scores, expected_ids, axis=-1)
    np.testing.assert_allclose(weights, 2.5 * chosen / (chosen.sum(axis=-1, keepdims=True) + 1e-20), rtol=1e-6)


# --- streaming at the minimum budget ---------------------------------------------------------------------

@pytest.mark.parametrize("device", ["reference", "cpu"])
@pytest.mark.parametrize("name", ["mixtral_top_all_of_5", "deepseek_v3_twelve_in_four_groups"])
def test_minimum_budget_streams_bit_identically(tiny_zoo, name, device):
    """A route needing every expert (top-5 of 5), grouped routing after no dense layer: streamed
    through the smallest cache the budget allows, the tokens and logits equal the all-resident run's."""
    _, path = tiny_zoo.converted_case(CASES[name], F32)
    prompt = random_prompt(17, seed=3)
    with edge.load(path, device=device) as model:
        resident = greedy_decode(model, prompt, N_DECODE, capacity=32)
    with edge.load(path, device=device, expert_strategy="predictive", memory_budget="100%") as model:
        minimum = model.memory.minimum_bytes  # with the runtime a streamed load of it brings in
    with edge.load(path, device=device, memory_budget=minimum) as model:
        streamed = greedy_decode(model, prompt, N_DECODE, capacity=32)
        assert model.stats()["expert_misses"] > 0
    assert streamed[0] == resident[0]
    assert all(np.array_equal(a, b) for a, b in zip(streamed[1], resident[1]))


# --- GGUF --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, arch", [("qwen2_moe_step2_mlp_only", "qwen2moe"), ("mixtral_top_all_of_5", "llama")])
def test_gguf_of_an_odd_shape_matches_transformers(tiny_zoo, tmp_path, name, arch):
    """llama.cpp's layout of the same model (dense layers without a router keep their FFN, experts
    stacked) converts into a checkpoint that routes and computes as transformers does."""
    model, _ = tiny_zoo.converted_case(CASES[name], F32)
    source = write_hf_model_gguf(model, tmp_path / f"{name}.gguf", arch)
    convert(str(source), str(tmp_path / "zllm"), F32, progress=False)
    prompt = random_prompt(17, seed=17)
    expected, fed, expected_routes = _transformers_run(model, prompt)
    _assert_matches_transformers(str(tmp_path / "zllm"), "reference", prompt, expected, fed, expected_routes)
