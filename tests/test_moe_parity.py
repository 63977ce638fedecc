"""Mixture-of-Experts models agree with transformers: the same experts per token per layer, and logits.

Protocol: prefill a 12-token random prompt (all positions' logits), then 4 decode steps fed
transformers' greedy tokens (torch float32, eager attention, its own KV cache). Metric per step:
max |ours - theirs| <= REL_TOL * max |theirs|. With f32 weights both sides compute the same f32
math in another order: measured <= 1e-6 relative, so REL_TOL = 1e-4 leaves two orders of margin.

Routes are discrete and compared exactly: transformers' chosen ids come from a forward hook on
each router module; ours from an ExpertSource wrapper that records every request.

T = tokens, E = experts, D = hidden size, A = active experts per token.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from tiny_models import MOE_CASE_NAMES, hf_logits, random_prompt

import edge
from converters.convert import QuantPlan, convert
from edge.core.moe import MoeConfig, route

PROMPT = random_prompt(12, seed=7)
N_DECODE = 4
REL_TOL = 1e-4
# reference vs cpu backend on the same checkpoint: same f32 math, other summation order (see
# tests/test_cpu_backend.py for the derivation of this bound)
BACKEND_REL_TOL = 1e-5
F32 = QuantPlan(weights="f32")
MIXED = QuantPlan(weights="int8", group_size=32, overrides={"experts": "int4"})
_ERRORS: dict[str, float] = {}  # case -> max relative error, printed with -s


class RouteRecorder:
    """An ExpertSource that records every route it serves, then delegates."""

    def __init__(self, inner):
        self.inner = inner
        self.routes: list[tuple[int, np.ndarray]] = []  # (layer, ids [T, A]) in request order

    def experts(self, layer, expert_ids, residual, router_logits=None):
        self.routes.append((layer, np.array(expert_ids)))
        return self.inner.experts(layer, expert_ids, residual, router_logits)

    def begin_token(self, embedding):
        self.inner.begin_token(embedding)

    def stats(self):
        return self.inner.stats()

    def close(self):
        self.inner.close()


def record_routes(model) -> RouteRecorder:
    recorder = RouteRecorder(model.transformer.experts)
    model.transformer.experts = recorder
    return recorder


def hf_routes(hf_model) -> tuple[list[tuple[int, np.ndarray]], list]:
    """Hooks recording transformers' chosen expert ids per router call: (layer, ids [T, A])."""
    routes, handles = [], []
    for index, layer in enumerate(hf_model.model.layers):
        router = getattr(layer.mlp, "gate", None)
        if isinstance(router, torch.nn.Module) and not isinstance(router, torch.nn.Linear):
            def hook(module, args, output, index=index):
                routes.append((index, output[2].reshape(-1, output[2].shape[-1]).numpy().copy()))
            handles.append(router.register_forward_hook(hook))
    return routes, handles


def run_ours(model, prompt: list[int], fed: list[int]) -> list[np.ndarray]:
    session = model.session(capacity=64)
    steps = [session.prefill(prompt, all_logits=True)]
    steps += [session.decode(token) for token in fed]
    return steps


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.fixture(scope="module", autouse=True)
def _print_errors():
    yield
    if _ERRORS:
        print("\nMoE parity with transformers (f32 weights), max relative logit error:")
        for case, error in sorted(_ERRORS.items()):
            print(f"  {case:24s} {error:.2e}")


@pytest.mark.parametrize("case", MOE_CASE_NAMES)
def test_moe_matches_transformers(tiny_zoo, case):
    hf = tiny_zoo.hf_model(case)
    theirs_routes, handles = hf_routes(hf)
    try:
        prefill, decode_steps, fed = hf_logits(hf, PROMPT, N_DECODE)
    finally:
        for handle in handles:
            handle.remove()
    model = edge.load(tiny_zoo.converted(case, F32), device="reference")
    ours_routes = record_routes(model).routes
    ours = run_ours(model, PROMPT, fed)

    assert [layer for layer, _ in ours_routes] == [layer for layer, _ in theirs_routes]
    for (layer, ids), (_, expected) in zip(ours_routes, theirs_routes):
        # each token's set of experts (DeepSeek's routers return them unordered: topk(sorted=False))
        np.testing.assert_array_equal(np.sort(ids, axis=-1), np.sort(expected, axis=-1), err_msg=f"layer {layer}")
    errors = [relative_error(a, b) for a, b in zip(ours, [prefill, *decode_steps])]
    _ERRORS[case] = max(errors)
    assert max(errors) <= REL_TOL, errors


@pytest.mark.parametrize("case, fused", [("qwen2_moe_shared", True), ("mixtral", True), ("olmoe", False)])
def test_cpu_backend_matches_reference_on_quantized_experts(tiny_zoo, case, fused):
    """int8 attention and shared experts, int4 routed experts: the CPU backend's fused executor runs
    the layers and mixes each MoE layer's experts between its calls; OLMoE's norm over the whole
    q/k projection runs op by op on the same kernels."""
    path = tiny_zoo.converted(case, MIXED)
    runs = {}
    for device in ("reference", "cpu:f32"):
        model = edge.load(path, device=device)
        if device != "reference":
            assert (model.transformer._fused_forward is not None) == fused
        routes = record_routes(model).routes
        session = model.session(capacity=64)
        logits = [session.prefill(PROMPT, all_logits=True)]
        for _ in range(N_DECODE):
            logits.append(session.decode(int(logits[-1].reshape(-1, logits[-1].shape[-1])[-1].argmax())))
        runs[device] = (logits, routes)
    (ref_logits, ref_routes), (cpu_logits, cpu_routes) = runs["reference"], runs["cpu:f32"]
    assert len(cpu_routes) == len(ref_routes)
    for (layer, ids), (_, expected) in zip(cpu_routes, ref_routes):
        np.testing.assert_array_equal(ids, expected, err_msg=f"layer {layer}")
    for a, b in zip(cpu_logits, ref_logits):
        assert relative_error(a, b) <= BACKEND_REL_TOL


# --- routing against transformers' DeepSeek routers (grouped selection, bias, scaling) -------------------

def _deepseek_router(version: int, **config):
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    if version == 2:
        return DeepseekV2TopkRouter(DeepseekV2Config(hidden_size=64, **config))
    return DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=64, **config))


@pytest.mark.parametrize("version, hf_config, ours", [
    (2, dict(n_routed_experts=16, num_experts_per_tok=3, topk_method="greedy", routed_scaling_factor=1.5),
     MoeConfig(16, 3, 8, scoring="softmax", routed_scaling_factor=1.5)),
    (2, dict(n_routed_experts=16, num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4,
             topk_group=2, routed_scaling_factor=2.0),
     MoeConfig(16, 3, 8, scoring="softmax", routed_scaling_factor=2.0, n_group=4, topk_group=2, group_score="max")),
    (3, dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
             routed_scaling_factor=2.5),
     MoeConfig(16, 4, 8, scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, n_group=4,
               topk_group=2, group_score="top2_sum", score_correction_bias=True)),
    (3, dict(n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=False,
             routed_scaling_factor=1.0),
     MoeConfig(8, 2, 8, scoring="sigmoid", score_correction_bias=True)),
], ids=["v2_greedy", "v2_group_limited", "v3_grouped_bias", "v3_one_group"])
def test_route_matches_deepseek_routers(version, hf_config, ours):
    router = _deepseek_router(version, **hf_config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
        if version == 3:  # a selection bias large enough to change choices
            router.e_score_correction_bias.copy_(0.3 * torch.randn(router.e_score_correction_bias.shape,
                                                                   generator=generator))
    x = torch.randn(64, 64, generator=generator)  # [T, D]
    with torch.no_grad():
        logits, weights, ids = router(x)
    bias = router.e_score_correction_bias.numpy() if version == 3 else None
    our_ids, our_weights = route(logits.numpy(), ours, bias)
    # DeepSeek's routers use topk(sorted=False): compare each token's chosen set, weights by id
    order, our_order = np.argsort(ids.numpy(), axis=-1), np.argsort(our_ids, axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(our_ids, our_order, -1),
                                  np.take_along_axis(ids.numpy(), order, -1))
    np.testing.assert_allclose(np.take_along_axis(our_weights, our_order, -1),
                               np.take_along_axis(weights.numpy(), order, -1), rtol=1e-6, atol=1e-7)


def test_route_ties_go_to_the_lowest_expert_id():
    logits = np.array([[1.0, 3.0, 3.0, 1.0, 3.0]], np.float32)
    ids, weights = route(logits, MoeConfig(5, 2, 4, scoring="unit"))
    assert ids.tolist() == [[1, 2]] and weights.tolist() == [[1.0, 1.0]]
    ids, _ = route(logits, MoeConfig(5, 4, 4, scoring="softmax"))
    assert ids.tolist() == [[1, 2, 4, 0]]


# --- llama_moe: a dense Llama whose FFN neurons are partitioned into experts -----------------------------

def write_llama_moe(dense_folder: str, out: str, num_experts: int, top_k: int, dense_layers: list[int],
                    seed: int = 0) -> dict[str, np.ndarray]:
    """An HF-style llama_moe folder from a dense tiny Llama: expert e of layer L owns the e-th block of
    the FFN's neurons; a random router with bias. Returns the routers {layer: (weight, bias)}."""
    from safetensors.numpy import load_file

    with open(os.path.join(dense_folder, "config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(dense_folder, "model.safetensors"))
    rng = np.random.default_rng(seed)
    size = config["intermediate_size"] // num_experts
    routers = {}
    for layer in range(config["num_hidden_layers"]):
        if layer in dense_layers:
            continue
        p = f"model.layers.{layer}.mlp."
        gate, up, down = (tensors.pop(p + f"{proj}.weight") for proj in ("gate_proj", "up_proj", "down_proj"))
        for e in range(num_experts):
            neurons = slice(e * size, (e + 1) * size)
            tensors[p + f"experts.{e}.gate_proj.weight"] = np.ascontiguousarray(gate[neurons])
            tensors[p + f"experts.{e}.up_proj.weight"] = np.ascontiguousarray(up[neurons])
            tensors[p + f"experts.{e}.down_proj.weight"] = np.ascontiguousarray(down[:, neurons])
        routers[layer] = (rng.standard_normal((num_experts, config["hidden_size"])).astype(np.float32),
                          rng.standard_normal(num_experts).astype(np.float32))
        tensors[p + "gate.weight"], tensors[p + "gate.bias"] = routers[layer]
    config.update(model_type="llama_moe", architectures=None, num_experts=num_experts, num_experts_per_tok=top_k,
                  moe_intermediate_size=size, dense_layers=dense_layers)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    return routers


def test_llama_moe_with_every_expert_active_is_the_dense_model(tiny_zoo, tmp_path):
    """Experts that partition the FFN's neurons, all chosen with weight 1: exactly the dense FFN."""
    dense = tiny_zoo.hf_model("llama_mha")
    write_llama_moe(tiny_zoo.hf_folder("llama_mha"), tmp_path / "hf", num_experts=4, top_k=4, dense_layers=[1])
    convert(os.fspath(tmp_path / "hf"), os.fspath(tmp_path / "zllm"), F32, progress=False)
    prefill, decode_steps, fed = hf_logits(dense, PROMPT, N_DECODE)
    model = edge.load(tmp_path / "zllm", device="cpu")
    assert [model.spec.moe_for_layer(i) is not None for i in range(2)] == [True, False]
    ours = run_ours(model, PROMPT, fed)
    assert max(relative_error(a, b) for a, b in zip(ours, [prefill, *decode_steps])) <= REL_TOL


def test_llama_moe_routes_top_k_of_its_router_logits(tiny_zoo, tmp_path):
    routers = write_llama_moe(tiny_zoo.hf_folder("llama_mha"), tmp_path / "hf", num_experts=4, top_k=2,
                              dense_layers=[])
    convert(os.fspath(tmp_path / "hf"), os.fspath(tmp_path / "zllm"), F32, progress=False)
    model = edge.load(tmp_path / "zllm", device="reference")
    routes = record_routes(model).routes
    ffn_inputs = {}

    def keep_input(layer, x):  # sees every FFN's input (after its norm), lets the block run
        ffn_inputs[layer] = x.copy()

    model.transformer.forward_ops(np.array(PROMPT), model.transformer.new_cache(64), True, ffn_hook=keep_input)
    for layer, ids in routes:
        weight, bias = routers[layer]
        logits = ffn_inputs[layer] @ weight.T + bias  # [T, E]
        expected = np.argsort(-logits, axis=-1, kind="stable")[:, :2]
        np.testing.assert_array_equal(ids, expected)


# --- the diff tool compares routes ----------------------------------------------------------------------

def test_diff_compares_moe_routes(tiny_zoo):
    from edge.diff import format_report, run_diff

    path = tiny_zoo.converted("qwen3_moe_norm", MIXED)
    report = run_diff(path, PROMPT, ["reference", "cpu"], decode_steps=2)
    assert report["first_divergence"] is None
    for p in report["passes"]:
        assert sorted(p["routing"]) == [0, 1] and "not_compared" not in p
        assert all(not r["tokens_with_other_experts"] and not r["exceeds"] for r in p["routing"].values())
    assert "moe 1 experts agree; weights rel max abs" in format_report(report)


def test_diff_names_the_layer_whose_experts_differ():
    from edge.diff import LayerRecorder, Tolerance, compare_extras

    tolerance = Tolerance(per_matmul=1e-6, matmul_inputs=64, weight_kinds=["f32"], sources={})
    reference, other = LayerRecorder(), LayerRecorder()
    weights = np.array([[0.7, 0.3], [0.6, 0.4]], np.float32)
    reference(0, np.ones((2, 4)), expert_ids=np.array([[1, 3], [0, 2]]), expert_weights=weights)
    # layer 0: the same sets, listed in another order; layer 1: token 1 chose expert 1, not 2
    other(0, np.ones((2, 4)), expert_ids=np.array([[3, 1], [0, 2]]),
          expert_weights=np.array([[0.3, 0.7], [0.6, 0.4]], np.float32))
    reference(1, np.ones((2, 4)), expert_ids=np.array([[1, 3], [0, 2]]), expert_weights=weights)
    other(1, np.ones((2, 4)), expert_ids=np.array([[1, 3], [0, 1]]), expert_weights=weights)
    routing = compare_extras(reference, other, tolerance)["routing"]
    assert routing[0]["tokens_with_other_experts"] == [] and routing[0]["weights_rel_max_abs"] == 0.0
    assert not routing[0]["exceeds"]
    assert routing[1]["tokens_with_other_experts"] == [1] and routing[1]["exceeds"]
