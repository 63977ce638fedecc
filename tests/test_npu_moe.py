"""device="npu" on Mixture-of-Experts models: graphs on ONNX Runtime's CPU provider for attention,
norms, dense FFNs, router logits, shared experts and the LM head; routed experts on the CPU backend,
from the model's expert source (resident or streamed).

Protocol: prefill a 12-token prompt with all_logits, then 3 decode steps of fixed tokens, session
capacity 32; the same on device="reference". Checkpoints: int8 attention / dense / shared experts,
int4 routed experts, f32 routers (the converter's default for routers).

Routes are discrete and compared exactly, through two records: the observer's expert_ids keyword
after each MoE layer (what the parity tests read), and every request the expert source serves
(RouteRecorder from test_moe_parity.py), which also covers decode steps.

Logit bound: at accuracy_level 0 both sides compute float32 math in different orders (onnxruntime's
fused kernels and MatMulNBits dequantization, Numba's expert kernels); measured <= 1e-6 relative to
max |ref| on these models, bound REL_TOL = 1e-4 as in test_npu_model.py. A streamed run on npu is
compared with the all-resident run on npu bit for bit: the experts are added in ascending id order
whichever source supplied them, and the graphs are the same.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from test_moe_parity import record_routes, write_llama_moe  # noqa: E402
from tiny_models import greedy_decode, random_prompt  # noqa: E402

import edge  # noqa: E402
from converters.convert import (
    QuantPlan,  # noqa: E402
    convert,  # noqa: E402
)
from edge.core.errors import ZllmError  # noqa: E402

REL_TOL = 1e-4
PROMPT = random_prompt(12, seed=7)
DECODE = [5, 9, 11]
CAPACITY = 32
MIXED = QuantPlan(weights="int8", group_size=32, overrides={"experts": "int4"})
NPU = "npu:cpu,accuracy_level=0"
# static prefill chunks of 5 tokens: the last chunk is padded, routes are concatenated over chunks
NPU_STATIC = "npu:cpu,accuracy_level=0,attention=standard,static=1,prefill_chunk=5"
FAMILIES = ["mixtral", "qwen2_moe_shared", "qwen3_moe_norm", "olmoe"]


def run_protocol(model):
    """Logits of every step, the observer's routes per MoE layer of the prefill, the source's routes."""
    served = record_routes(model).routes
    observed = {}

    def observer(layer, hidden, **route):
        if "expert_ids" in route:
            observed[layer] = route["expert_ids"].copy()

    session = model.session(capacity=CAPACITY)
    steps = [session.prefill(PROMPT, all_logits=True, observer=observer)]
    steps += [session.decode(t)[None] for t in DECODE]
    return steps, observed, served


def worst_relative_error(ours, theirs) -> float:
    return max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(ours, theirs))


_REFERENCE: dict[str, tuple] = {}


def reference_run(path: str):
    if path not in _REFERENCE:
        with edge.load(path, device="reference") as model:
            _REFERENCE[path] = run_protocol(model)
    return _REFERENCE[path]


def assert_same_routes(observed, served, expected_observed, expected_served):
    assert sorted(observed) == sorted(expected_observed)
    for layer, ids in observed.items():
        np.testing.assert_array_equal(ids, expected_observed[layer], err_msg=f"layer {layer}")
    # the source sees one request per MoE layer per graph piece; a static prefill asks per chunk
    by_layer = {}
    for layer, ids in served:
        by_layer.setdefault(layer, []).append(ids)
    expected_by_layer = {}
    for layer, ids in expected_served:
        expected_by_layer.setdefault(layer, []).append(ids)
    assert sorted(by_layer) == sorted(expected_by_layer)
    for layer in by_layer:
        np.testing.assert_array_equal(np.concatenate(by_layer[layer]), np.concatenate(expected_by_layer[layer]),
                                      err_msg=f"layer {layer}")


@pytest.mark.parametrize("case", FAMILIES)
def test_routes_and_logits_match_reference(tiny_zoo, case):
    path = tiny_zoo.converted(case, MIXED)
    expected, expected_observed, expected_served = reference_run(path)
    with edge.load(path, device=NPU) as model:
        steps, observed, served = run_protocol(model)
        placement = model.device_info()["placement"]
    moe_layers = [i for i in range(model.spec.num_hidden_layers) if model.spec.moe_for_layer(i) is not None]
    assert sorted(observed) == moe_layers == [0, 1]
    assert_same_routes(observed, served, expected_observed, expected_served)
    assert worst_relative_error(steps, expected) <= REL_TOL
    assert {ep for graph in placement.values() for ep in graph} == {"CPUExecutionProvider"}


@pytest.mark.parametrize("case", ["qwen2_moe_shared", "qwen3_moe_raw"])
def test_static_chunks_and_standard_attention(tiny_zoo, case):
    """Fixed-shape graphs: padded rows are never routed; qwen3_moe_raw's layer 0 is dense (in the graph)."""
    path = tiny_zoo.converted(case, MIXED)
    expected, expected_observed, expected_served = reference_run(path)
    with edge.load(path, device=NPU_STATIC) as model:
        steps, observed, served = run_protocol(model)
    assert_same_routes(observed, served, expected_observed, expected_served)
    assert worst_relative_error(steps, expected) <= REL_TOL


def test_llama_moe_router_bias_and_unit_weights(tiny_zoo, tmp_path):
    """A MoEfied Llama (router with bias, weight 1 per chosen expert), layer 1 keeping its dense FFN."""
    write_llama_moe(tiny_zoo.hf_folder("llama_mha"), tmp_path / "hf", num_experts=4, top_k=2, dense_layers=[1])
    path = str(tmp_path / "zllm")
    convert(str(tmp_path / "hf"), path, MIXED, progress=False)
    expected, expected_observed, expected_served = reference_run(path)
    with edge.load(path, device=NPU) as model:
        steps, observed, served = run_protocol(model)
        parts = model.device_info()["parts"]
    assert sorted(observed) == [0]
    assert_same_routes(observed, served, expected_observed, expected_served)
    assert worst_relative_error(steps, expected) <= REL_TOL
    assert parts["routed_experts"].endswith("layers 0") and "dense_ffn" in parts and "shared_experts" not in parts


def greedy(model, n_decode: int = 6):
    return (*greedy_decode(model, PROMPT, n_decode, CAPACITY), model.stats())


def test_streamed_experts_are_bit_identical_to_resident(tiny_zoo):
    path = tiny_zoo.converted("qwen2_moe_shared", MIXED)
    with edge.load(path, device="npu:cpu") as model:
        tokens, logits, resident = greedy(model)
    with edge.load(path, device="npu:cpu", memory_budget="50%") as model:
        streamed_tokens, streamed_logits, stats = greedy(model)
        info = model.device_info()
    assert resident["expert_source"] == "resident"
    assert stats["expert_source"] == "predictive" and stats["expert_misses"] > 0
    assert stats["expert_cache_peak_bytes"] <= stats["expert_cache_bytes"]
    assert streamed_tokens == tokens
    assert all(np.array_equal(a, b) for a, b in zip(streamed_logits, logits))
    assert info["parts"]["routed_experts"].startswith("cpu backend")


def test_device_info_names_the_placement(tiny_zoo):
    path = tiny_zoo.converted("qwen2_moe_shared", MIXED)
    with edge.load(path, device="npu:cpu", threads=1) as model:
        model.session(capacity=8).prefill([3, 4, 5])
        info = json.loads(json.dumps(model.device_info()))  # what `generate --json` prints as "device"
    graphs = "onnxruntime graphs on CPUExecutionProvider"
    assert info["parts"] == {
        "embedding": graphs, "attention": graphs, "norms": graphs, "lm_head": graphs,
        "router_logits": graphs, "shared_experts": graphs,
        "routing": "host (edge's top-k and the family's scoring)",
        "routed_experts": "cpu backend (Numba kernels, 1 threads), layers 0, 1",
    }
    assert info["expert_backend"]["device"] == "cpu" and info["expert_backend"]["threads"] == 1
    # one graph per layer part between MoE blocks, and one for the head after the last MoE layer, on disk
    graphs = sorted(name for name in os.listdir(info["graph_cache"]) if name.startswith("contrib-acc4-"))
    assert graphs == ["contrib-acc4-L0-1_E_MoEout_Sdyn_Cdyn.onnx", "contrib-acc4-L1-2_MoEin_MoEout_Sdyn_Cdyn.onnx",
                      "contrib-acc4-L2-2_H_MoEin_Sdyn_Cdyn_Rdyn.onnx"]
    assert set(info["placement"]) == {name[len("contrib-acc4-"):-len(".onnx")] for name in graphs}
    with edge.load(path, device="npu:cpu") as model:
        assert model.device_info()["graphs_built"] == []  # the MoE graphs came from the cache


def test_dense_model_reports_no_expert_backend(tiny_zoo):
    with edge.load(tiny_zoo.converted("llama_mha", MIXED), device="npu:cpu") as model:
        info = model.device_info()
    assert "expert_backend" not in info and "routed_experts" not in info["parts"]
    assert model.backend._expert_backend is None  # the CPU backend was never started


def test_mla_models_are_refused(tiny_zoo):
    with pytest.raises(ZllmError) as error:
        edge.load(tiny_zoo.converted("deepseek_v2_moe", MIXED), device="npu:cpu")
    assert str(error.value).endswith(
        "device 'npu' does not implement MLA attention (it runs MHA/GQA/MQA with float32 K/V caches); "
        "use device 'cpu' or 'reference'")


def test_fused_and_op_by_op_paths_agree_below_edge_load(tiny_zoo):
    """The Transformer built directly on the npu backend, experts prepared for its expert backend: the
    fused graphs and the op-by-op composition (single-op graphs; experts through NpuBackend.expert_mixture,
    i.e. the CPU backend) route alike and agree within REL_TOL."""
    from devices.base import create_backend
    from edge.core.spec import spec_from_dict
    from edge.model import Transformer
    from quant.checkpoint import open_checkpoint
    from streaming.resident import ResidentExperts

    backend = create_backend("npu:cpu,accuracy_level=0")
    with open_checkpoint(tiny_zoo.converted("qwen2_moe_shared", MIXED)) as ckpt:
        experts = ResidentExperts(ckpt.experts, backend.expert_backend.prepare_weight)
        model = Transformer(spec_from_dict(ckpt.model_config), ckpt.tensors, backend, experts=experts)
        runs = []
        for forward in (model.forward, model.forward_ops):
            routes = {}
            logits = forward(np.array(PROMPT), model.new_cache(CAPACITY), True,
                             lambda layer, hidden, **route: routes.__setitem__(layer, route["expert_ids"]))
            runs.append((logits, routes))
    (fused, fused_routes), (ops, ops_routes) = runs
    assert sorted(fused_routes) == sorted(ops_routes) == [0, 1]
    for layer in fused_routes:
        np.testing.assert_array_equal(fused_routes[layer], ops_routes[layer])
    assert worst_relative_error([fused], [ops]) <= REL_TOL
