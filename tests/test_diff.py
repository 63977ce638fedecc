"""`zllm-edge diff`: reference against itself is exact, and a backend perturbed from layer k on is
named at layer k - on a tiny model and on SmolLM2's 30 layers.

The perturbed backend is the reference with noise added to the MLP down-projection of every layer
from k on (so layers before k are computed by the very same code, and must agree exactly). It is
registered in devices.base.BACKENDS for the duration of one test only.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from tiny_models import random_prompt

import edge.cli
from converters.convert import QuantPlan
from devices.base import BACKENDS
from devices.reference import ReferenceBackend, as_float32
from edge.diff import (
    DEVICE_ARITHMETIC,
    F16_UNIT,
    F32_UNIT,
    INT8_ACTIVATION_UNIT,
    MATMULS_IN_SERIES,
    SAFETY,
    DiffError,
    LayerRecorder,
    compare_extras,
    derive_tolerance,
    format_report,
    run_diff,
)

PROMPT = "The capital of France is"


class NoisyFromLayer(ReferenceBackend):
    """device "noisy:K" or "noisy:K:SCALE": the reference, with noise of SCALE x each weight's std added
    to mlp.down_proj of layers K, K+1, ... It describes itself as an f32 device."""

    name = "noisy"

    def __init__(self, threads=None, variant=None):
        super().__init__(threads)
        first, _, scale = (variant or "0").partition(":")
        self.first_layer, self.scale = int(first), float(scale or 1e-2)

    def compile_forward(self, transformer):
        rng = np.random.default_rng(0)
        for layer in transformer.layers[self.first_layer:]:
            down = as_float32(layer.down)
            layer.down = down + np.float32(self.scale * down.std()) * rng.standard_normal(down.shape, np.float32)
        return None, "ops"  # run edge's op-by-op composition on the perturbed weights

    def info(self):
        return {**super().info(), "device": "noisy", "arithmetic": {"accumulation": F32_UNIT}}


@pytest.fixture
def noisy_device(monkeypatch):
    monkeypatch.setitem(BACKENDS, "noisy", f"{__name__}:NoisyFromLayer")


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_zoo):
    return tiny_zoo.converted("llama_gqa_tied", QuantPlan(weights="int4", group_size=32, symmetric=False))


def all_metrics(report):
    for p in report["passes"]:
        for d in [*p["layers"], p["logits"]]:
            yield p["name"], d


@pytest.mark.parametrize("case", ["llama_mha", "qwen2_bias", "qwen3_qknorm", "mistral_swa4"])
def test_reference_against_itself_is_exact(tiny_zoo, case):
    path = tiny_zoo.converted(case, QuantPlan(weights="int8", group_size=32))
    report = run_diff(path, random_prompt(10), ["reference", "reference"], decode_steps=3)
    assert report["first_divergence"] is None
    assert report["tolerance"]["per_matmul"] == 0.0
    assert [p["name"] for p in report["passes"]] == ["prefill", "decode 1", "decode 2", "decode 3"]
    assert all(len(p["layers"]) == 2 for p in report["passes"])
    for _, d in all_metrics(report):
        assert (d["max_abs"], d["rel_max_abs"], d["rel_rms"], d["tolerance"], d["min_cosine"]) == (0, 0, 0, 0, 1)
        assert d["reference_max_abs"] > 0
    assert all(p["argmax_mismatch_positions"] == [] for p in report["passes"])


@pytest.mark.parametrize("first_layer", [0, 1])
def test_names_the_first_perturbed_layer_of_a_tiny_model(tiny_checkpoint, noisy_device, first_layer):
    report = run_diff(tiny_checkpoint, random_prompt(8), ["reference", f"noisy:{first_layer}"], decode_steps=2)
    assert report["first_divergence"] == {"pass": "prefill", "layer": first_layer}
    for p in report["passes"]:
        assert p["first_divergent_layer"] == first_layer
        for index, layer in enumerate(p["layers"]):
            assert layer["exceeds"] == (index >= first_layer)
            if index < first_layer:
                assert layer["max_abs"] == 0.0  # the same code on the same weights


def test_names_layer_17_of_smollm2(smollm2_checkpoint, noisy_device):
    with edge.load(smollm2_checkpoint) as model:
        ids = model.encode(PROMPT)
    report = run_diff(str(smollm2_checkpoint), ids, ["reference", "noisy:17"], decode_steps=1)
    assert report["first_divergence"] == {"pass": "prefill", "layer": 17}
    prefill = report["passes"][0]
    assert [layer["max_abs"] for layer in prefill["layers"][:17]] == [0.0] * 17
    assert prefill["layers"][17]["exceeds"] and prefill["logits"]["max_abs"] > 0
    assert report["passes"][1]["first_divergent_layer"] == 17


def test_a_perturbation_within_tolerance_is_measured_but_not_flagged(tiny_checkpoint, noisy_device):
    # noise of 1e-6 x the weights' std: about f32 rounding, far below the budget of an f32 device
    report = run_diff(tiny_checkpoint, random_prompt(8), ["reference", "noisy:1:1e-6"], decode_steps=1)
    assert report["first_divergence"] is None
    layer = report["passes"][0]["layers"][1]
    assert 0 < layer["rel_max_abs"] < layer["tolerance"]
    assert report["passes"][0]["layers"][0]["max_abs"] == 0.0


def test_tolerance_follows_the_devices_and_the_checkpoint_schemes(tiny_checkpoint):
    from quant.checkpoint import read_manifest

    manifest = read_manifest(tiny_checkpoint)  # int4 matrices; hidden 64, ffn 96, 4 heads x 24
    inputs = 96
    reference = {"device": "reference"}
    assert derive_tolerance(["reference", "reference"], [reference] * 2, manifest).per_matmul == 0.0
    cpu = derive_tolerance(["reference", "cpu"], [reference, {}], manifest)
    assert cpu.per_matmul == F32_UNIT * math.sqrt(inputs)
    assert cpu.relative(3) == SAFETY * MATMULS_IN_SERIES * math.sqrt(3) * F32_UNIT * math.sqrt(inputs)
    npu = derive_tolerance(["reference", "npu"], [reference, {}], manifest)
    assert npu.per_matmul == INT8_ACTIVATION_UNIT + F16_UNIT + F32_UNIT * math.sqrt(inputs)
    assert npu.sources["npu"]["source"] == "assumed for device kind 'npu' (edge.diff.DEVICE_ARITHMETIC)"
    npu_cpu_provider = derive_tolerance(["reference", "npu"], [reference, {"accuracy_level": 4, "provider": "cpu"}],
                                        manifest)
    assert npu_cpu_provider.per_matmul == INT8_ACTIVATION_UNIT + F32_UNIT * math.sqrt(inputs)
    assert npu_cpu_provider.sources["npu"]["source"] == "MatMulNBits accuracy_level 4 (info()), provider 'cpu'"
    cpu_reported = derive_tolerance(["reference", "cpu"], [reference, {"activations": "float32"}], manifest)
    assert cpu_reported.per_matmul == F32_UNIT * math.sqrt(inputs)
    assert cpu_reported.sources["cpu"]["source"] == "f32 sums, float32 matmul inputs (info()['activations'])"
    declared = derive_tolerance(["reference", "cpu"], [reference, {"arithmetic": {"accumulation": 0.5}}], manifest)
    assert declared.per_matmul == 0.5 * math.sqrt(inputs)
    assert declared.sources["cpu"]["source"] == "declared by the backend's info()"
    assert set(DEVICE_ARITHMETIC) >= {"reference", "cpu", "gpu", "npu"}
    with pytest.raises(DiffError, match=r"device 'tpu' does not describe its arithmetic, so no tolerance can be derived"):
        derive_tolerance(["reference", "tpu"], [reference, {}], manifest)


def test_observer_extras_are_kept_and_reported_as_not_compared():
    reference, other = LayerRecorder(), LayerRecorder()
    reference(0, np.ones((2, 4)), routing=np.array([[1, 3], [0, 2]]))
    other(0, np.ones((2, 4)), routing=np.array([[1, 3], [0, 2]]))
    assert compare_extras(reference, other) == {"not_compared": ["routing"]}
    assert compare_extras(LayerRecorder(), LayerRecorder()) == {}


def run_cli(capsys, *argv):
    capsys.readouterr()
    code = edge.cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_exit_status_and_json(tiny_checkpoint, noisy_device, capsys):
    ids = ",".join(map(str, random_prompt(6)))
    code, out, err = run_cli(capsys, "diff", tiny_checkpoint, ids, "--ids", "--decode-steps", 1)
    assert (code, err) == (0, "")
    assert out.rstrip().endswith("no divergence: every layer and the logits are within tolerance")
    code, out, err = run_cli(capsys, "diff", tiny_checkpoint, ids, "--ids", "--devices", "reference,noisy:1", "--json")
    assert (code, err) == (1, "")
    report = json.loads(out)
    assert report["first_divergence"] == {"pass": "prefill", "layer": 1}
    assert report["devices"] == {"reference": "reference", "compared": "noisy:1"}
    code, out, err = run_cli(capsys, "diff", tiny_checkpoint, ids, "--ids", "--devices", "reference,noisy:0")
    assert code == 1 and out.rstrip().endswith("first divergence: prefill, layer 0")
    code, _, err = run_cli(capsys, "diff", tiny_checkpoint, "hello")
    assert (code, err) == (2, f"error: {tiny_checkpoint} has no tokenizer; pass token ids with --ids 1,2,3\n")
    code, _, err = run_cli(capsys, "diff", tiny_checkpoint, ids, "--ids", "--devices", "reference")
    assert (code, err) == (2, "error: diff compares exactly two devices, got 1: reference\n")


def test_cli_on_smollm2_text_prompt(smollm2_checkpoint, capsys):
    code, out, err = run_cli(capsys, "diff", smollm2_checkpoint, PROMPT, "--decode-steps", 0)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    with edge.load(smollm2_checkpoint) as model:
        n_tokens = len(model.encode(PROMPT))
    assert lines[0] == (f"zllm-edge diff {smollm2_checkpoint}: reference against reference, prompt of {n_tokens} tokens, "
                        "0 greedy decode steps (tokens from reference)")
    assert sum(line.startswith("prefill ") for line in lines) == 31  # 30 layers + logits


def test_cpu_device_agrees_with_the_reference_within_its_tolerance(tiny_zoo):
    if "cpu" not in BACKENDS:
        pytest.skip("the cpu backend is not registered in devices.base.BACKENDS")
    path = tiny_zoo.converted("llama_gqa_tied", QuantPlan(weights="int4", group_size=32, symmetric=False))
    report = run_diff(path, random_prompt(12), ["reference", "cpu"], decode_steps=2)
    assert report["first_divergence"] is None
    assert report["tolerance"]["per_matmul"] > 0  # an f32 device that sums in another order is not held to 0


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe_shared"])
def test_cpu_device_agrees_with_the_reference_on_moe_layers(tiny_zoo, case):
    """The fused executor's MoE path with an observer: one call per layer, routes reported and equal."""
    if "cpu" not in BACKENDS:
        pytest.skip("the cpu backend is not registered in devices.base.BACKENDS")
    path = tiny_zoo.converted(case, QuantPlan(weights="int8", group_size=32))
    report = run_diff(path, random_prompt(10), ["reference", "cpu:f32"], decode_steps=2)
    assert report["first_divergence"] is None
    for p in report["passes"]:  # every MoE layer's route was recorded on both devices and agrees
        assert p["routing"] and all(route["tokens_with_other_experts"] == [] for route in p["routing"].values())


class LastLayerOnly(ReferenceBackend):
    """device "fused": the reference, whose executor (like npu's one graph for the whole model) shows
    the observer only the last layer's output."""

    name = "fused"

    def compile_forward(self, transformer):
        last = transformer.spec.num_hidden_layers - 1

        def forward(ids, cache, all_logits, observer=None):
            shown = None if observer is None else (
                lambda layer, hidden, **extras: observer(layer, hidden, **extras) if layer == last else None)
            return transformer.forward_ops(ids, cache, all_logits, shown)

        return forward, "fused"

    def info(self):
        return {**super().info(), "device": "fused", "arithmetic": {"accumulation": F32_UNIT}}


def test_a_device_that_shows_only_some_layers_is_compared_where_it_does(tiny_checkpoint, monkeypatch, capsys):
    monkeypatch.setitem(BACKENDS, "fused", f"{__name__}:LastLayerOnly")
    report = run_diff(tiny_checkpoint, random_prompt(8), ["reference", "fused"], decode_steps=1)
    assert report["first_divergence"] is None
    for p in report["passes"]:
        assert p["layers"][0] is None
        assert p["layers"][1]["max_abs"] == 0.0 and p["logits"]["max_abs"] == 0.0
    text = format_report(report)
    assert "prefill         0 not shown by fused (inside a fused graph)" in text
    assert "decode 1       w1" in text
