"""Mixture-of-Experts models on the gpu device: routes and logits against the reference, streamed and
cache-bounded runs bit-identical to the all-resident one, the GPU expert cache's counters and limits.

Protocol: prefill a 12-token random prompt (all logits), then 3 greedy steps, each as a one-token
prefill with all logits, with an observer that receives every MoE layer's expert ids.

Expert ids are discrete and must equal the reference's exactly: the host routes from the router
logits the GPU computed, through the same edge.core.moe.route the reference uses.

Bound for logits: 1e-5 of the largest logit, the bound of tests/test_gpu_models.py and for the same
reason: both backends compute the same f32 math (INT4/INT8 codes and f16 scales dequantized exactly
into f32) in different orders, dot products of K <= 64 terms, plus WGSL's exp in SiLU, softmax and
the shared expert's sigmoid gate. Measured: at most 7.2e-7.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from gpu_support import open_gpu
from tiny_models import random_prompt

import edge
from converters.convert import QuantPlan, convert
from edge.core.errors import ExpertCacheError, ZllmError

LOGIT_REL_TOL = 1e-5
PROMPT = random_prompt(12, seed=7)
N_STEPS = 3
MIXED = QuantPlan(weights="int8", group_size=32, overrides={"experts": "int4"})
F32 = QuantPlan(weights="f32")
F16 = QuantPlan(weights="f16")
CASES = [
    pytest.param("mixtral", MIXED, id="mixtral-int8-int4experts"),
    pytest.param("qwen2_moe_shared", MIXED, id="qwen2_moe_shared-int8-int4experts"),
    pytest.param("qwen3_moe_norm", MIXED, id="qwen3_moe-int8-int4experts"),
    pytest.param("olmoe", MIXED, id="olmoe-int8-int4experts"),
    pytest.param("qwen2_moe_mlp_only", F32, id="qwen2_moe_dense_layer0-f32"),
    pytest.param("qwen3_moe_raw", F16, id="qwen3_moe_sparse_step2-f16"),
]


@pytest.fixture(scope="module")
def gpu_available():
    open_gpu()  # skips the module, with the reason, where there is no Vulkan device at all


def observed_run(model) -> tuple[list[np.ndarray], list[tuple[int, np.ndarray]]]:
    """Logits of the prompt and of N_STEPS greedy tokens, and every MoE layer's route (layer, ids [T, A])."""
    routes = []

    def observer(layer, hidden, expert_ids=None, expert_weights=None):
        if expert_ids is not None:
            routes.append((layer, np.array(expert_ids)))

    session = model.session(capacity=32)
    logits = [session.prefill(PROMPT, all_logits=True, observer=observer)]
    for _ in range(N_STEPS):
        logits.append(session.prefill([int(logits[-1][-1].argmax())], all_logits=True, observer=observer))
    return logits, routes


def greedy_run(path, **load_options) -> tuple[list[int], list[np.ndarray], dict]:
    """Prefill (all logits), then greedy decode on the gpu; the tokens, every logits array and the stats."""
    with edge.load(path, device="gpu", **load_options) as model:
        session = model.session(capacity=32)
        logits = [session.prefill(PROMPT, all_logits=True)]
        tokens = [int(logits[0][-1].argmax())]
        for _ in range(5):
            logits.append(session.decode(tokens[-1]))
            tokens.append(int(logits[-1].argmax()))
        return tokens, logits, model.stats()


def assert_matches_reference(path, what: str, **expect_info) -> None:
    """Routes equal to the reference's, logits within LOGIT_REL_TOL; expect_info: fields of device_info()."""
    with edge.load(path, device="reference") as ref, edge.load(path, device="gpu") as gpu:
        info = gpu.device_info()
        assert {key: info[key] for key in expect_info} == expect_info
        expected, expected_routes = observed_run(ref)
        ours, routes = observed_run(gpu)
        stats = gpu.stats()
    assert routes and [layer for layer, _ in routes] == [layer for layer, _ in expected_routes], what
    for (layer, ids), (_, want) in zip(routes, expected_routes):
        np.testing.assert_array_equal(ids, want, err_msg=f"{what}: layer {layer}")
    for step, (got, want) in enumerate(zip(ours, expected)):
        assert got.shape == want.shape and got.dtype == np.float32
        error = np.abs(got - want).max() / np.abs(want).max()
        assert error <= LOGIT_REL_TOL, f"{what} step {step}: max|gpu - reference| / max|reference| = {error:.2e}"
    assert stats["gpu_expert_misses"] > 0 and stats["gpu_expert_hits"] > 0


@pytest.mark.parametrize("case, plan", CASES)
def test_moe_model_matches_reference(gpu_available, tiny_zoo, case, plan):
    assert_matches_reference(tiny_zoo.converted(case, plan), case)


def test_moefied_llama_matches_reference(gpu_available, tiny_zoo, tmp_path):
    """llama_moe: unit route weights, a router with a bias, layer 1 dense."""
    from test_moe_parity import write_llama_moe

    write_llama_moe(tiny_zoo.hf_folder("llama_mha"), tmp_path / "hf", num_experts=4, top_k=2, dense_layers=[1])
    convert(os.fspath(tmp_path / "hf"), os.fspath(tmp_path / "zllm"), MIXED, progress=False)
    assert_matches_reference(tmp_path / "zllm", "llama_moe")


def test_gpu_shaped_kernels_run_moe_models(gpu_available, tiny_zoo, monkeypatch):
    """The kernels a real GPU gets (linear.wgsl: threads sharing a row, no uniform input windows)."""
    from devices.gpu.launches import Tuning

    gpu_tuning = Tuning.for_device(is_cpu=False)
    monkeypatch.setattr(Tuning, "for_device", classmethod(lambda cls, is_cpu: gpu_tuning))
    assert_matches_reference(tiny_zoo.converted("qwen2_moe_shared", MIXED), "qwen2_moe_shared, gpu-shaped kernels",
                             kernels="gpu-shaped")


def test_long_prompts_route_every_submission(gpu_available, tiny_zoo, monkeypatch):
    import devices.gpu.forward

    monkeypatch.setattr(devices.gpu.forward, "MAX_TOKENS_PER_SUBMISSION", 5)
    path = tiny_zoo.converted("olmoe", MIXED)
    with edge.load(path, device="gpu") as model:
        assert model.transformer._fused_forward.max_tokens == 5
    assert_matches_reference(path, "olmoe, 12 tokens in 5+5+2")


def test_streamed_and_cache_bounded_runs_are_bit_identical_to_resident(gpu_available, tiny_zoo):
    path = tiny_zoo.converted("qwen3_moe_norm", MIXED)
    tokens, logits, stats = greedy_run(path)
    assert stats["expert_source"] == "resident" and stats["gpu_expert_evictions"] == 0
    assert stats["gpu_expert_cache_bytes"] == stats["gpu_expert_bytes_all"]  # the default holds every expert

    streamed_tokens, streamed_logits, streamed = greedy_run(path, memory_budget="50%")
    assert streamed["expert_source"] == "predictive" and streamed["expert_misses"] > 0
    assert streamed_tokens == tokens
    assert all(np.array_equal(got, want) for got, want in zip(streamed_logits, logits))

    # a GPU cache of one layer's 8 experts for a model of 2 MoE layers: every layer evicts the other's
    minimum = stats["gpu_expert_cache_minimum_bytes"]
    assert minimum == stats["gpu_expert_bytes_all"] // 2
    bounded_tokens, bounded_logits, bounded = greedy_run(path, memory_budget="50%", gpu_expert_cache=minimum)
    assert bounded_tokens == tokens
    assert all(np.array_equal(got, want) for got, want in zip(bounded_logits, logits))
    assert bounded["gpu_expert_cache_bytes"] == minimum
    assert bounded["gpu_expert_evictions"] > 0
    assert bounded["gpu_expert_bytes_uploaded"] > stats["gpu_expert_bytes_uploaded"]
    assert 0 < bounded["gpu_expert_bytes_held"] <= minimum
    requests = bounded["gpu_expert_hits"] + bounded["gpu_expert_misses"]
    assert requests == stats["gpu_expert_hits"] + stats["gpu_expert_misses"]  # the same routes, more misses
    assert bounded["gpu_expert_misses"] > stats["gpu_expert_misses"]


def test_gpu_expert_cache_sizes_and_reports(gpu_available, tiny_zoo):
    path = tiny_zoo.converted("mixtral", MIXED)
    with edge.load(path, device="gpu", gpu_expert_cache="50%") as model:
        info = model.device_info()["expert_cache"]
        stats = model.stats()
    assert info["rule"] == "gpu_expert_cache"
    for key in ("gpu_expert_hits", "gpu_expert_misses", "gpu_expert_bytes_uploaded", "gpu_expert_bytes_held",
                "gpu_expert_cache_bytes"):
        assert info[key] == stats[key]
    # 50% of mixtral's 2 layers x 4 experts is one layer's experts, exactly the minimum
    assert stats["gpu_expert_cache_bytes"] == stats["gpu_expert_bytes_all"] // 2 == stats["gpu_expert_cache_minimum_bytes"]


def test_gpu_expert_cache_below_one_layer_is_refused(gpu_available, tiny_zoo):
    path = tiny_zoo.converted("mixtral", MIXED)
    with edge.load(path, device="gpu") as model:
        minimum = model.stats()["gpu_expert_cache_minimum_bytes"]
    with pytest.raises(ExpertCacheError) as info:
        edge.load(path, device="gpu", gpu_expert_cache=minimum - 1)
    assert str(info.value) == (
        f"{path}: a GPU expert cache of {minimum - 1} bytes cannot hold one layer's experts: layer 0 has 4 experts "
        f"of {minimum // 4} bytes each on the device, so the minimum is {minimum} bytes ({minimum / 1e6:.2f} MB); "
        "pass gpu_expert_cache of at least that")


def test_gpu_expert_cache_option_is_refused_where_it_does_not_apply(gpu_available, tiny_zoo):
    moe = tiny_zoo.converted("mixtral", MIXED)
    with pytest.raises(ZllmError, match="gpu_expert_cache applies to Mixture-of-Experts models on device 'gpu'"):
        edge.load(moe, device="reference", gpu_expert_cache="1MB")
    with pytest.raises(ZllmError, match="gpu_expert_cache applies to Mixture-of-Experts models on device 'gpu'"):
        edge.load(tiny_zoo.converted("llama_mha", F32), device="gpu", gpu_expert_cache="1MB")
    with pytest.raises(ZllmError, match="gpu_expert_cache: memory budget 'lots' not understood"):
        edge.load(moe, device="gpu", gpu_expert_cache="lots")


def test_mla_moe_models_stay_refused(gpu_available, tiny_zoo):
    with pytest.raises(ZllmError, match="device 'gpu' does not implement MLA attention"):
        edge.load(tiny_zoo.converted("deepseek_v2_moe", MIXED), device="gpu")


@pytest.mark.parametrize("scheme", ["int4_sym_g32", "int8_affine_g64", "f16", "f32"])
def test_expert_device_bytes_are_what_the_upload_holds(gpu_available, scheme):
    """The cache charges each expert before uploading it: the estimate must be the buffers' real size,
    also for matrices split into several chunks by a small binding limit."""
    from devices.gpu.tensors import GpuMatrix, matrix_device_bytes
    from quant import Scheme, quantize

    backend = open_gpu(max_binding_bytes=1024)
    parsed = Scheme.parse(scheme)
    values = np.random.default_rng(0).standard_normal((48, 100)).astype(np.float32)
    floats = {"f16": np.float16, "f32": np.float32}
    weight = quantize(values, parsed) if parsed.is_quantized else values.astype(floats[parsed.dtype])
    matrix = GpuMatrix(backend.ctx, weight)
    assert len(matrix.chunks) > 1
    assert matrix_device_bytes(backend.ctx, parsed, (48, 100)) == matrix.nbytes


def test_bench_reports_gpu_upload_time_and_memory_beside_cpu(gpu_available, tiny_zoo, capsys):
    from edge.bench import format_table, run_bench

    path = tiny_zoo.converted("qwen2_moe_shared", MIXED)
    # --threads reaches the cpu; the gpu, which takes no thread count, runs beside it. cpu:f32 keeps
    # f32 inputs (no int8 decode or bf16 prefill rounding), so a random model's greedy tokens agree.
    report = run_bench(path, ["cpu:f32", "gpu"], threads=1, prompt_tokens=8, new_tokens=4, repeats=1)
    cpu, gpu = report["devices"]["cpu:f32"], report["devices"]["gpu"]
    assert cpu["device_upload_seconds"] is None and cpu["device_memory_bytes"] is None
    memory = gpu["device_memory"]
    assert gpu["device_upload_seconds"] > 0
    assert memory["weights"] > 0 and memory["experts"] > 0 and memory["kv_and_scratch"] > 0
    assert gpu["device_memory_bytes"] == memory["peak_allocated"] >= memory["weights"] + memory["experts"]
    assert gpu["tokens"] == cpu["tokens"]
    table = format_table(report)
    assert "upload to device (s)" in table and "device memory, peak (MB)" in table


def test_op_by_op_composition_on_gpu_matches_fused_executor(gpu_available, tiny_zoo):
    """edge's forward_ops on this backend (every op a round trip, experts uploaded per call) against the
    fused executor with its GPU expert cache: the same routes, logits within the bound."""
    path = tiny_zoo.converted("qwen2_moe_shared", MIXED)
    with edge.load(path, device="gpu") as gpu:
        transformer = gpu.transformer
        ops_cache, fused_cache = transformer.new_cache(16), transformer.new_cache(16)
        routes = {"ops": [], "fused": []}

        def observer(kind):
            return lambda layer, hidden, expert_ids=None, **_: routes[kind].append(expert_ids)

        by_ops = [transformer.forward_ops(np.array(PROMPT[:10]), ops_cache, True, observer("ops"))]
        fused = [transformer.forward(np.array(PROMPT[:10]), fused_cache, True, observer("fused"))]
        for token in PROMPT[10:]:
            by_ops.append(transformer.forward_ops(np.array([token]), ops_cache, False, observer("ops")))
            fused.append(transformer.forward(np.array([token]), fused_cache, False, observer("fused")))
    assert len(routes["ops"]) == len(routes["fused"]) == 2 * 3  # 2 MoE layers, 3 calls
    for ours, theirs in zip(routes["fused"], routes["ops"]):
        np.testing.assert_array_equal(ours, theirs)
    for ours, theirs in zip(fused, by_ops):
        assert np.abs(ours - theirs).max() <= LOGIT_REL_TOL * np.abs(theirs).max()
