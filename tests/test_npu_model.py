"""device="npu" on ONNX Runtime's CPU provider against device="reference": tiny Llama/Qwen/Mistral
models, session semantics, observer granularity, the graph cache and device errors.

Protocol: prefill a 12-token prompt with all_logits, append-prefill 3 tokens, then 3 decode steps,
on a session of capacity 24; the same on the reference backend. Metric per step: max |ours - ref|
over the vocabulary, relative to max |ref|.

Bounds: at accuracy_level 0 both sides compute the same float32 math in different orders (fused
kernels, GroupQueryAttention's own softmax), measured <= 4e-6 relative, bound REL_TOL = 1e-4 (the
parity suite's f32 bound). accuracy_level 4 (the CPU default) quantizes activations to int8 per block
of the weight's group (scale max|x|/127): measured 0.019-0.022 relative on these random 2-layer
models with symmetric weights and 0.022-0.032 with affine ones (their codes centred: 0.044-0.065 when
they were not), bound INT8_ACTIVATION_TOL = 0.04.
"""
from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from tiny_models import random_prompt  # noqa: E402

import edge  # noqa: E402
from converters.convert import QuantPlan  # noqa: E402
from edge.core.errors import SessionError, ZllmError  # noqa: E402

REL_TOL = 1e-4
INT8_ACTIVATION_TOL = 0.04
PROMPT = random_prompt(12, seed=7)
APPEND = [17, 29, 41]
DECODE = [5, 9, 11]
CAPACITY = 24

PLANS = {
    "f32": QuantPlan(weights="f32"),
    "int4_affine_g32": QuantPlan(weights="int4", group_size=32, symmetric=False),
    "int8_sym_g32": QuantPlan(weights="int8", group_size=32, symmetric=True),
    "int8_affine_g64": QuantPlan(weights="int8", group_size=64, symmetric=False),
}
# (case, why it is here): GroupQueryAttention needs head_dim % 16 == 0, the others take the standard form
CASES = ["llama_mha", "llama_gqa_tied", "qwen3_qknorm", "mistral_swa4", "qwen2_swa_layer1"]
VARIANTS = {
    "contrib": "npu:cpu,accuracy_level=0",
    "standard_per_layer": "npu:cpu,accuracy_level=0,attention=standard,layers_per_graph=1",
    "static_chunks": "npu:cpu,accuracy_level=0,static=1,prefill_chunk=5",
}


def run_protocol(model, observer=None):
    session = model.session(capacity=CAPACITY)
    steps = [session.prefill(PROMPT, all_logits=True, observer=observer)]
    steps.append(session.prefill(APPEND, all_logits=True))
    steps += [session.decode(t)[None] for t in DECODE]
    return steps, session


def worst_relative_error(ours, theirs) -> float:
    return max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(ours, theirs))


@pytest.fixture(scope="module")
def reference_runs(tiny_zoo):
    runs = {}

    def get(case, plan_name):
        if (case, plan_name) not in runs:
            path = tiny_zoo.converted(case, PLANS[plan_name])
            with edge.load(path, device="reference") as model:
                hidden = {}
                steps, session = run_protocol(model, observer=lambda layer, h: hidden.__setitem__(layer, h.copy()))
                # a sliding layer's ring buffer holds only its window: keep (positions, keys) held
                cache = session.cache
                keys = [(cache.held_positions(i), k[cache.rows_of(i, cache.held_positions(i))].copy())
                        for i, (k, _) in enumerate(cache.layers)]
            runs[(case, plan_name)] = (path, steps, hidden, keys)
        return runs[(case, plan_name)]

    return get


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("plan_name", PLANS)
@pytest.mark.parametrize("case", CASES)
def test_logits_match_reference(case, plan_name, variant, reference_runs):
    path, expected, _, expected_keys = reference_runs(case, plan_name)
    with edge.load(path, device=VARIANTS[variant]) as model:
        steps, session = run_protocol(model)
        assert session.position == session.cache.length == len(PROMPT) + len(APPEND) + len(DECODE)
        assert [s.shape for s in steps] == [e.shape for e in expected]
        assert worst_relative_error(steps, expected) <= REL_TOL
        # keys written at exactly positions 0..length-1 (after RoPE), nothing beyond
        for (keys, _), (positions, reference_keys) in zip(session.cache.layers, expected_keys):
            np.testing.assert_allclose(keys[positions], reference_keys, atol=1e-5 * np.abs(reference_keys).max())
            assert not keys[session.position:].any()
        placement = model.device_info()["placement"]
        assert {ep for graph in placement.values() for ep in graph} == {"CPUExecutionProvider"}


@pytest.mark.parametrize("plan_name", ["int4_affine_g32", "int8_affine_g64", "int8_sym_g32"])
@pytest.mark.parametrize("case", ["llama_mha", "qwen3_qknorm", "llama_gqa_tied"])
def test_default_int8_activations_within_bound(case, plan_name, reference_runs):
    path, expected, _, _ = reference_runs(case, plan_name)
    with edge.load(path, device="npu:cpu") as model:
        assert model.device_info()["accuracy_level"] == 4
        steps, _ = run_protocol(model)
    assert worst_relative_error(steps, expected) <= INT8_ACTIVATION_TOL


@pytest.mark.parametrize("layers_per_graph,observed_layers", [(1, [0, 1]), (0, [1])])
def test_observer_sees_chunk_boundaries(layers_per_graph, observed_layers, reference_runs):
    path, _, reference_hidden, _ = reference_runs("llama_mha", "int4_affine_g32")
    seen = {}
    with edge.load(path, device=f"npu:cpu,accuracy_level=0,layers_per_graph={layers_per_graph}") as model:
        run_protocol(model, observer=lambda layer, h: seen.__setitem__(layer, h.copy()))
    assert sorted(seen) == observed_layers
    for layer, hidden in seen.items():
        expected = reference_hidden[layer]
        assert hidden.shape == expected.shape == (len(PROMPT), 64)
        assert np.abs(hidden - expected).max() <= REL_TOL * np.abs(expected).max()


def test_capacity_is_enforced_like_the_reference(tiny_zoo):
    with edge.load(tiny_zoo.converted("llama_mha", PLANS["f32"]), device="npu:cpu") as model:
        session = model.session(capacity=4)
        session.prefill([5, 6, 7])
        with pytest.raises(SessionError, match="beyond this session's KV cache capacity of 4"):
            session.prefill([8, 9])
        assert session.position == 3
        session.decode(8)
        assert session.position == 4


def test_graphs_are_cached_and_stale_ones_rebuilt(tiny_zoo):
    path = tiny_zoo.converted("qwen3_qknorm", PLANS["int8_sym_g32"])
    device = "npu:cpu,layers_per_graph=1"
    with edge.load(path, device=device) as model:
        info = model.device_info()
        expected = model.session(capacity=8).prefill([3, 4, 5])
    folder = info["graph_cache"]
    assert folder.startswith(os.path.join(os.environ["ZLLM_EDGE_HOME"], "onnx"))
    graphs = sorted(info["graphs_built"])
    assert len(graphs) == 2 and all(os.path.isfile(os.path.join(folder, g)) for g in graphs)
    with edge.load(path, device=device) as model:
        assert model.device_info()["graphs_built"] == []  # both came from the cache
    with open(os.path.join(folder, graphs[0]), "r+b") as f:  # damage one graph
        f.truncate(100)
    index_path = os.path.join(folder, "weights.json")
    with open(index_path) as f:
        index = json.load(f)
    with edge.load(path, device=device) as model:
        assert model.device_info()["graphs_built"] == [graphs[0]]
        np.testing.assert_array_equal(model.session(capacity=8).prefill([3, 4, 5]), expected)
    index["fingerprint"]["exporter_version"] = -1  # a weight file from another exporter
    with open(index_path, "w") as f:
        json.dump(index, f)
    with edge.load(path, device=device) as model:
        assert sorted(model.device_info()["graphs_built"]) == graphs
        np.testing.assert_array_equal(model.session(capacity=8).prefill([3, 4, 5]), expected)


def test_automatic_choice_warns_when_only_the_cpu_provider_exists(tiny_zoo, caplog):
    import onnxruntime

    from devices.npu.providers import PROVIDERS, available_providers

    present = set(available_providers(onnxruntime))
    if present - {"CPUExecutionProvider"}:
        pytest.skip(f"this onnxruntime has NPU providers: {sorted(present)}")
    with caplog.at_level(logging.WARNING, logger="zllm.npu"):
        model = edge.load(tiny_zoo.converted("llama_mha", PLANS["f32"]), device="npu")
    message = ("device 'npu': no NPU execution provider in onnxruntime "
               f"{onnxruntime.__version__} (looked for qnn, openvino, vitisai, coreml, directml); "
               "running on ONNX Runtime's CPU provider")
    assert message in caplog.messages
    info = model.device_info()
    assert info["provider"] == "CPUExecutionProvider" and info["warnings"] == [message]
    assert [p.key for p in PROVIDERS] == info["provider_priority"]
    model.close()


def test_missing_or_unknown_provider_is_an_error(tiny_zoo):
    import onnxruntime

    path = tiny_zoo.converted("llama_mha", PLANS["f32"])
    if "VitisAIExecutionProvider" not in onnxruntime.get_available_providers():
        with pytest.raises(ZllmError) as error:
            edge.load(path, device="npu:vitisai")
        assert str(error.value) == (
            "device 'npu:vitisai' needs onnxruntime's VitisAIExecutionProvider, which this installation "
            f"(onnxruntime {onnxruntime.__version__}) does not have (it has: cpu); "
            "to get it: AMD Ryzen AI Software (its onnxruntime-vitisai build)")
    with pytest.raises(ZllmError, match="unknown NPU provider 'tpu'"):
        edge.load(path, device="npu:tpu")
    with pytest.raises(ZllmError, match="must be 0 or 1, got 'yes'"):
        edge.load(path, device="npu:cpu,static=yes")
