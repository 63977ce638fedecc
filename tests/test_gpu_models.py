"""Whole models on the gpu device: the fused executor against the reference backend.

Tiny random models of every family (tests/tiny_models.py) must give the reference's logits
within a bound, through NewPrefill, AppendPrefill and DecodeRound; SmolLM2-135M must give the
reference's greedy tokens up to the first near-tie.

Bound for tiny-model logits: 1e-5 of the largest logit. The two backends run the same f32
math in different orders: dot products of K <= 128 terms (error ~ sqrt(K) u each, the same
argument as tests/test_session.py's 1e-5 between reference runs), plus WGSL's exp, allowed
3 + 2|x| ULP (under 5e-6 relative for the |x| < 20 met in attention and SiLU here).
Measured: at most 7e-7.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from gpu_support import open_gpu
from tiny_models import CASE_NAMES, plan_key, random_prompt

import edge
from converters.convert import QuantPlan
from edge.core.spec import spec_from_dict
from edge.model import Transformer
from quant.checkpoint import open_checkpoint

LOGIT_REL_TOL = 1e-5

INT4_AFFINE = QuantPlan(weights="int4", group_size=32, symmetric=False)
MODELS = [(case, INT4_AFFINE) for case in CASE_NAMES] + [
    ("llama_gqa_tied", QuantPlan(weights="f32")),
    ("llama_mha", QuantPlan(weights="f16")),
    ("qwen3_qknorm", QuantPlan(weights="int8", group_size=64, symmetric=True)),
    ("qwen2_bias", QuantPlan(weights="int4", group_size=128, symmetric=True)),
]


@pytest.fixture(scope="module")
def gpu_available():
    open_gpu()  # skips the module, with the reason, where there is no Vulkan device at all


def assert_logits_close(ours: np.ndarray, reference: np.ndarray, what: str) -> None:
    assert ours.shape == reference.shape, what
    assert ours.dtype == np.float32, what
    error = np.abs(ours - reference).max() / np.abs(reference).max()
    assert error <= LOGIT_REL_TOL, f"{what}: max|gpu - reference| / max|reference| = {error:.2e}"


def run_session(model, prompt: list[int], split: int) -> np.ndarray:
    """Logits of every prompt token: NewPrefill of prompt[:split] (all logits), then AppendPrefill of
    the next three tokens, then one DecodeRound per remaining token."""
    session = model.session(capacity=32)
    rows = [session.prefill(prompt[:split], all_logits=True),
            session.prefill(prompt[split : split + 3], all_logits=True)]
    rows += [session.decode(token)[None] for token in prompt[split + 3 :]]
    assert session.position == len(prompt)
    return np.concatenate(rows)


@pytest.mark.parametrize("case, plan", [pytest.param(c, p, id=f"{c}-{plan_key(p)}") for c, p in MODELS])
def test_tiny_model_logits_match_reference(gpu_available, tiny_zoo, case, plan):
    path = tiny_zoo.converted(case, plan)
    prompt = random_prompt(16, seed=5)
    with edge.load(path, device="reference") as ref, edge.load(path, device="gpu") as gpu:
        assert gpu.device_info()["backend"] == "Vulkan"
        expected = run_session(ref, prompt, split=9)
        ours = run_session(gpu, prompt, split=9)
    assert_logits_close(ours, expected, f"{case} {plan_key(plan)}")


@pytest.mark.parametrize("case", ["llama_gqa_tied", "qwen3_qknorm"])
def test_gpu_shaped_kernels_run_whole_models(gpu_available, tiny_zoo, case):
    from devices.gpu.launches import Tuning

    path = tiny_zoo.converted(case, INT4_AFFINE)
    prompt = random_prompt(16, seed=5)
    with edge.load(path, device="reference") as ref:
        expected = run_session(ref, prompt, split=9)
    shaped = open_gpu(tuning=Tuning.for_device(is_cpu=False))
    with open_checkpoint(path) as checkpoint:
        transformer = Transformer(spec_from_dict(checkpoint.model_config), checkpoint.tensors, shaped)
        cache = transformer.new_cache(32)
        rows = [transformer.forward(np.array(prompt[:9]), cache, all_logits=True),
                transformer.forward(np.array(prompt[9:12]), cache, all_logits=True)]
        rows += [transformer.forward(np.array([token]), cache, all_logits=False)[None] for token in prompt[12:]]
    assert_logits_close(np.concatenate(rows), expected, f"{case}, gpu-shaped kernels")


def test_op_by_op_composition_on_gpu_buffers_matches_fused_executor(gpu_available, tiny_zoo):
    # edge's forward_ops on this backend: every op a round trip, the KV cache read and written
    # through GpuKV's slicing; the fused executor must agree with it.
    path = tiny_zoo.converted("mistral_swa4", INT4_AFFINE)
    prompt = random_prompt(12, seed=8)
    with edge.load(path, device="gpu") as gpu:
        transformer = gpu.transformer
        ops_cache, fused_cache = transformer.new_cache(16), transformer.new_cache(16)
        by_ops = transformer.forward_ops(np.array(prompt[:10]), ops_cache, all_logits=True)
        fused = transformer.forward(np.array(prompt[:10]), fused_cache, all_logits=True)
        assert_logits_close(fused, by_ops, "prefill")
        for token in prompt[10:]:
            assert_logits_close(transformer.forward(np.array([token]), fused_cache, False),
                                transformer.forward_ops(np.array([token]), ops_cache, False), "decode")
        np.testing.assert_allclose(fused_cache.layers[1][0][:12], ops_cache.layers[1][0][:12], rtol=0, atol=1e-5)


def test_observer_sees_every_layer(gpu_available, tiny_zoo):
    path = tiny_zoo.converted("qwen3_qknorm", INT4_AFFINE)
    prompt = random_prompt(6, seed=2)
    seen = {}
    for device in ("reference", "gpu"):
        with edge.load(path, device=device) as model:
            hidden = []
            model.session(capacity=8).prefill(prompt, observer=lambda layer, h: hidden.append((layer, h.copy())))
            seen[device] = hidden
    assert [layer for layer, _ in seen["gpu"]] == [0, 1]
    for (_, ours), (_, expected) in zip(seen["gpu"], seen["reference"]):
        assert_logits_close(ours, expected, "hidden state")


def test_long_prompts_run_in_several_submissions(gpu_available, tiny_zoo, monkeypatch):
    import devices.gpu.forward

    monkeypatch.setattr(devices.gpu.forward, "MAX_TOKENS_PER_SUBMISSION", 4)
    path = tiny_zoo.converted("llama_gqa_tied", QuantPlan(weights="f32"))
    prompt = random_prompt(11, seed=4)
    with edge.load(path, device="reference") as ref, edge.load(path, device="gpu") as gpu:
        assert gpu.transformer._fused_forward.max_tokens == 4
        expected = ref.session(16).prefill(prompt, all_logits=True)
        assert_logits_close(gpu.session(16).prefill(prompt, all_logits=True), expected, "11 tokens in 4+4+3")
        assert_logits_close(gpu.session(16).prefill(prompt), expected[-1], "last logits only")


def test_model_whose_tensors_exceed_one_binding(gpu_available, tiny_zoo):
    # the tied 160 x 64 f32 embedding (40 KiB) is split into 16-row chunks, for the lookup and the LM head
    path = tiny_zoo.converted("llama_gqa_tied", QuantPlan(weights="f32"))
    prompt = random_prompt(7, seed=6)
    with edge.load(path, device="reference") as ref:
        expected = ref.session(8).prefill(prompt, all_logits=True)
    small = open_gpu(max_binding_bytes=4096)
    with open_checkpoint(path) as checkpoint:
        transformer = Transformer(spec_from_dict(checkpoint.model_config), checkpoint.tensors, small)
        assert len(transformer.embed_tokens.chunks) == 10 and transformer.lm_head is transformer.embed_tokens
        ours = transformer.forward(np.array(prompt), transformer.new_cache(8), all_logits=True)
    assert_logits_close(ours, expected, "split embedding / LM head")


# --- the real model ---------------------------------------------------------------------------------------
PROMPT = "The capital of France is"
N_GREEDY = 6  # lavapipe decodes SmolLM2 at a few tokens/s: enough steps to pass the answer
NEAR_TIE = 0.3  # as tests/test_real_model.py: log-prob gap under which f32 order may flip the choice


def greedy(model, prompt_ids: list[int], n: int) -> tuple[list[int], list[float], float]:
    """Greedy ids, the top-two log-prob gap at each step, and the seconds it took."""
    session = model.session(capacity=64)
    began = time.perf_counter()
    logits = session.prefill(prompt_ids)
    ids, gaps = [], []
    for _ in range(n):
        log_probs = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        top_two = np.sort(log_probs)[-2:]
        ids.append(int(logits.argmax()))
        gaps.append(float(top_two[1] - top_two[0]))
        if len(ids) < n:
            logits = session.decode(ids[-1])
    return ids, gaps, time.perf_counter() - began


def test_smollm2_greedy_tokens_match_reference_up_to_first_near_tie(gpu_available, smollm2_checkpoint):
    with edge.load(smollm2_checkpoint, device="reference") as ref:
        prompt_ids = ref.encode(PROMPT)
        expected, gaps, _ = greedy(ref, prompt_ids, N_GREEDY)
    with edge.load(smollm2_checkpoint, device="gpu") as gpu:
        info = gpu.device_info()
        assert info["backend"] == "Vulkan" and info["requested"] == "gpu"
        ours, _, seconds = greedy(gpu, prompt_ids, N_GREEDY)
        assert gpu.decode(ours).startswith(" Paris")
    first_tie = next((i for i, gap in enumerate(gaps) if gap < NEAR_TIE), N_GREEDY)
    assert first_tie >= 2, "the prompt must discriminate for more than one step"
    assert ours[:first_tie] == expected[:first_tie], f"{seconds:.1f}s on {info['adapter']}"


def test_heads_wider_than_the_attention_kernel_are_refused_at_load(gpu_available, tmp_path):
    """A head_dim beyond the GPU attention kernel's is a typed error from edge.load, not a failure at
    the first prefill."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from converters.convert import convert
    from devices.gpu.launches import MAX_HEAD_DIM
    from edge.core.errors import ZllmError

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
                         num_key_value_heads=1, head_dim=2 * MAX_HEAD_DIM, vocab_size=64, max_position_embeddings=32)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"), QuantPlan(weights="f32"), progress=False)
    with pytest.raises(ZllmError) as refused:
        edge.load(str(tmp_path / "ckpt"), device="gpu")
    assert str(refused.value) == (f"{tmp_path / 'ckpt'}: device 'gpu' runs attention heads of up to {MAX_HEAD_DIM} "
                                  f"dimensions; this model's have {2 * MAX_HEAD_DIM}: use device 'cpu' or 'npu'")
