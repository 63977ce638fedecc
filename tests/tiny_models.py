"""Tiny random Hugging Face models of every family, and their zllm conversions.

CASES are the dense families; MOE_CASES the Mixture-of-Experts ones (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, DeepSeek-V2/V3 MoE layers); ATTENTION_CASES the attention variants (MLA, layer types).

Each case is a transformers config (2 layers, hidden 64, vocab 160, context 64) with weights
drawn from a fixed torch seed. Weights are re-drawn after transformers' own init so that
logits are not degenerate (spread of about 1 over the vocabulary) and norm gains are not all
ones, so a missing norm weight would show. No tokenizer: the models take token ids only.

Use the session fixture `tiny_zoo` (import it into the test module):

    from tiny_models import CASES, tiny_zoo  # noqa: F401

    def test_x(tiny_zoo):
        hf = tiny_zoo.hf_model("llama_mha")                  # torch model, float32, eager attention
        path = tiny_zoo.converted("llama_mha", QuantPlan(weights="f32"))

Everything is written under pytest's base temp directory and built at most once per test run,
whichever module asks first (the cache is keyed by that directory).
"""
from __future__ import annotations

import copy
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from converters.convert import QuantPlan, convert
from quant import QuantizedTensor
from quant.checkpoint import open_checkpoint

VOCAB = 160
CONTEXT = 64  # max_position_embeddings of every case
SEED = 1234
WEIGHT_STD = 0.1  # matrices and embeddings; logits std ~ WEIGHT_STD * sqrt(hidden) ~ 0.8
NORM_STD = 0.1  # norm gains are 1 + NORM_STD * N(0, 1)

# transformers 5 renamed the KV cache argument and output field `past_key_values` to `cache`
_CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"

CONFIG_CLASSES = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
                  "mixtral": MixtralConfig, "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig,
                  "olmoe": OlmoeConfig, "deepseek_v2": DeepseekV2Config, "deepseek_v3": DeepseekV3Config,
                  "gemma3_text": Gemma3TextConfig}

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=CONTEXT,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)


@dataclass(frozen=True)
class TinyCase:
    name: str
    family: str  # model_type
    config: dict = field(default_factory=dict)  # on top of _COMMON
    note: str = ""

    def make_config(self):
        return CONFIG_CLASSES[self.family](**{**_COMMON, **self.config})


CASES: tuple[TinyCase, ...] = (
    TinyCase("llama_mha", "llama", dict(num_attention_heads=4, num_key_value_heads=4),
             "MHA, untied embeddings"),
    TinyCase("llama_gqa_tied", "llama",
             dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True),
             "GQA 4/2, head_dim 24 != 64/4, tied embeddings"),
    TinyCase("llama_mqa", "llama", dict(num_attention_heads=8, num_key_value_heads=1, intermediate_size=128),
             "MQA (1 KV head), head_dim 8"),
    TinyCase("llama_rope_llama3", "llama",
             dict(num_attention_heads=4, num_key_value_heads=2,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16}),
             "llama3 rope: head_dim 16 puts frequencies in all three bands (kept, blended, scaled)"),
    TinyCase("llama_rope_linear", "llama",
             dict(num_attention_heads=4, num_key_value_heads=4,
                  rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
             "linear rope scaling, factor 2"),
    TinyCase("llama_rope_yarn", "llama",
             dict(num_attention_heads=4, num_key_value_heads=2,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0,
                                   "original_max_position_embeddings": 16}),
             "yarn rope, factor 4 (attention factor 1 + 0.1 ln 4 on cos/sin)"),
    TinyCase("mistral_gqa", "mistral",
             dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=4096),
             "GQA, sliding window far beyond the test sequence"),
    TinyCase("mistral_swa4", "mistral",
             dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=4),
             "sliding window 4, test sequence of 16"),
    TinyCase("qwen2_bias", "qwen2", dict(num_attention_heads=4, num_key_value_heads=2),
             "q/k/v biases"),
    TinyCase("qwen2_swa_layer1", "qwen2",
             dict(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                  max_window_layers=1),
             "q/k/v biases; sliding window 4 on layer 1 only (layers >= max_window_layers)"),
    TinyCase("qwen3_qknorm", "qwen3",
             dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
             "q/k norm, explicit head_dim 32 != 64/4, tied embeddings"),
)
CASE_NAMES = tuple(c.name for c in CASES)

# Mixture-of-Experts cases (2 layers, hidden 64, top-2). The expert files they convert to are
# exercised by tests/test_moe_parity.py and tests/test_moe_checkpoint.py; kept apart from CASES so
# the dense parametrizations do not grow.
_MOE_ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2)
MOE_CASES: tuple[TinyCase, ...] = (
    TinyCase("mixtral", "mixtral", dict(_MOE_ATTENTION, num_local_experts=4, num_experts_per_tok=2),
             "softmax over 4 experts, top-2 renormalised; checkpoint names block_sparse_moe.experts.E.w1/w2/w3"),
    TinyCase("qwen2_moe_shared", "qwen2_moe",
             dict(_MOE_ATTENTION, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48, decoder_sparse_step=1),
             "8 experts, top-2 not renormalised, shared expert scaled by its sigmoid gate, q/k/v biases"),
    TinyCase("qwen2_moe_mlp_only", "qwen2_moe",
             dict(_MOE_ATTENTION, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48, mlp_only_layers=[0], norm_topk_prob=True),
             "layer 0 dense (mlp_only_layers), layer 1 sparse, renormalised"),
    TinyCase("qwen3_moe_norm", "qwen3_moe",
             dict(_MOE_ATTENTION, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  norm_topk_prob=True),
             "q/k norm per head, top-2 of 8 renormalised"),
    TinyCase("qwen3_moe_raw", "qwen3_moe",
             dict(_MOE_ATTENTION, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  norm_topk_prob=False, decoder_sparse_step=2),
             "top-2 of 8 not renormalised; decoder_sparse_step 2: layer 0 dense, layer 1 sparse"),
    TinyCase("olmoe", "olmoe",
             dict(_MOE_ATTENTION, num_experts=8, num_experts_per_tok=2, intermediate_size=32, clip_qkv=0.5),
             "q/k norm over the whole projection, q/k/v clipped to 0.5, top-2 of 8"),
)
# DeepSeek MoE layers on MLA attention (_MLA below): layer 0 dense (first_k_dense_replace=1), layer 1 MoE.
_DEEPSEEK_MOE = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                     qk_rope_head_dim=8, v_head_dim=24, q_lora_rank=None, first_k_dense_replace=1,
                     n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
MOE_CASES += (
    TinyCase("deepseek_v2_moe", "deepseek_v2",
             dict(_DEEPSEEK_MOE, topk_method="group_limited_greedy", n_group=4, topk_group=2, n_shared_experts=2,
                  routed_scaling_factor=1.5),
             "softmax over 8 experts in 4 groups, the best 2 groups (by max) compete; 2 shared experts; x1.5"),
    TinyCase("deepseek_v3_moe", "deepseek_v3",
             dict(_DEEPSEEK_MOE, n_group=4, topk_group=2, n_shared_experts=1, norm_topk_prob=True,
                  routed_scaling_factor=2.5),
             "sigmoid scores + random e_score_correction_bias for choice, groups by top-2 sum, renormalised, x2.5"),
)
MOE_CASE_NAMES = tuple(c.name for c in MOE_CASES)

# Attention variants (tests/test_attention_*.py): MLA with dense feed-forward blocks
# (first_k_dense_replace >= num_hidden_layers), and hybrid sliding/full layers.
_MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
ATTENTION_CASES: tuple[TinyCase, ...] = (
    TinyCase("deepseek_v2_mla", "deepseek_v2", dict(_MLA, q_lora_rank=None, v_head_dim=32),
             "MLA: q_proj, latent 32, nope 16 + rope 8 (interleaved pairs), v_head_dim 32 > 24"),
    TinyCase("deepseek_v2_qlora_yarn", "deepseek_v2",
             dict(_MLA, q_lora_rank=48, v_head_dim=16, attention_bias=True,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0,
                                   "beta_fast": 32, "beta_slow": 1}),
             "MLA with query LoRA 48, biases, yarn (softmax scale times mscale^2), v_head_dim 16 < 24"),
    TinyCase("deepseek_v3_mla", "deepseek_v3", dict(_MLA, q_lora_rank=40, v_head_dim=24, n_group=2, topk_group=1),
             "DeepSeek-V3 MLA, query LoRA 40, interleaved rope"),
    TinyCase("deepseek_v3_halfsplit", "deepseek_v3",
             dict(_MLA, q_lora_rank=None, v_head_dim=24, rope_interleave=False, n_group=2, topk_group=1),
             "DeepSeek-V3 MLA with rope_interleave=False (half-split rotary layout)"),
    TinyCase("qwen2_layer_types", "qwen2",
             dict(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                  layer_types=["sliding_attention", "full_attention"]),
             "layer_types: layer 0 slides over 4 positions, layer 1 attends to everything"),
    TinyCase("qwen3_layer_types", "qwen3",
             dict(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=5,
                  layer_types=["full_attention", "sliding_attention"]),
             "layer_types with q/k norm: layer 1 slides over 5 positions"),
    TinyCase("qwen3_moe_swa", "qwen3_moe",
             dict(num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, use_sliding_window=True, sliding_window=4),
             "Qwen3-MoE with use_sliding_window: every layer slides over 4 positions (no layer_types)"),
)
ATTENTION_CASE_NAMES = tuple(c.name for c in ATTENTION_CASES)

# Gemma 3 (tests/test_gemma3.py): a decoder layer of another form, which the gpu and npu devices refuse.
GEMMA_CASES: tuple[TinyCase, ...] = (
    TinyCase("gemma3_swa", "gemma3_text",
             dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
                  sliding_window=4, layer_types=["sliding_attention", "full_attention"], bos_token_id=2,
                  eos_token_id=1, pad_token_id=0,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                   "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
             "layer 0 slides over 4 positions with rotary base 100, layer 1 global with base 10000; scores "
             "scaled by 24 ** -0.5, not head_dim's; sandwich norms, (1 + w) gains, GELU-tanh, scaled embeddings"),
    TinyCase("gemma3_pattern_linear", "gemma3_text",
             dict(num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=48,
                  query_pre_attn_scalar=48, sliding_window=6, sliding_window_pattern=3, bos_token_id=2,
                  eos_token_id=1, pad_token_id=0,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                      "rope_theta": 1000000.0}}),
             "no layer_types: every 3rd layer global (sliding_window_pattern 3); linear rope x8 on the global "
             "layer only, as Gemma 3 4B and up; MQA"),
)
GEMMA_CASE_NAMES = tuple(c.name for c in GEMMA_CASES)
_BY_NAME = {c.name: c for c in CASES + MOE_CASES + ATTENTION_CASES + GEMMA_CASES}


def build_hf_model(case: TinyCase) -> torch.nn.Module:
    """The case's transformers model: float32, eager attention, eval mode, deterministic weights."""
    config = case.make_config()
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        # named_parameters() yields a tied lm_head/embedding once, so tying survives
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + NORM_STD * noise)
            else:  # matrices, embeddings and biases
                param.copy_(WEIGHT_STD * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's selection bias: big enough to matter
                buffer.copy_(WEIGHT_STD * torch.randn(buffer.shape, generator=generator, dtype=torch.float32))
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model.eval()


def hf_logits(model: torch.nn.Module, prompt: list[int], n_decode: int) -> tuple[np.ndarray, list[np.ndarray], list[int]]:
    """transformers' logits for the prompt (all positions, [T, V]) and for n_decode greedy steps.

    Decode feeds transformers' own greedy token each step through its KV cache (use_cache=True).
    Returns (prefill [T, V], [decode step logits [V]], the greedy tokens fed).
    """
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        prefill = out.logits[0].numpy().copy()
        cache = getattr(out, _CACHE_ARG)
        steps, fed = [], []
        token = int(prefill[-1].argmax())
        for _ in range(n_decode):
            fed.append(token)
            out = model(torch.tensor([[token]]), use_cache=True, **{_CACHE_ARG: cache})
            cache = getattr(out, _CACHE_ARG)
            logits = out.logits[0, -1].numpy().copy()
            steps.append(logits)
            token = int(logits.argmax())
    return prefill, steps, fed


def checkpoint_float_weights(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a zllm checkpoint as float32 (quantized ones dequantized), by HF name."""
    with open_checkpoint(os.fspath(path)) as ckpt:
        return {
            name: (t.dequantize() if isinstance(t, QuantizedTensor) else np.array(t, dtype=np.float32))
            for name, t in ckpt.tensors.items()
        }


def checkpoint_expert_weights(path: str) -> dict[str, np.ndarray]:
    """Every routed expert projection of an (uncompressed) checkpoint as float32, by our per-expert name."""
    weights = {}
    with open_checkpoint(path) as ckpt:
        for layer, layer_experts in ckpt.experts.layers.items():
            layout = ckpt.experts.layout(layer)
            for expert in range(len(layer_experts.records)):
                raw = np.fromfile(ckpt.experts.path, np.uint8, layout.raw_length,
                                  offset=ckpt.experts.record(layer, expert).offset)
                for projection, value in layout.decode(raw).items():
                    name = f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"
                    weights[name] = value.dequantize() if isinstance(value, QuantizedTensor) else np.array(value)
    return weights


def hf_model_with_weights(model: torch.nn.Module, weights: dict[str, np.ndarray]) -> torch.nn.Module:
    """A copy of `model` whose parameters are replaced by `weights` (e.g. a checkpoint's dequantized ones).

    Every parameter must be covered (a tied lm_head through the embedding it shares).
    """
    model = copy.deepcopy(model)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(weights))
    unknown = sorted(set(weights) - set(params))
    if missing or unknown:
        raise KeyError(f"checkpoint and model disagree: missing {missing}, unknown {unknown}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(torch.from_numpy(weights[name]))
    return model


def plan_key(plan: QuantPlan) -> str:
    overrides = "-".join(f"{k}={v}" for k, v in sorted(plan.overrides.items()))
    if plan.weights in ("f32", "f16", "source") and not any(v.startswith("int") for v in plan.overrides.values()):
        base = plan.weights
    else:
        base = f"{plan.weights}_{'sym' if plan.symmetric else 'affine'}_g{plan.group_size}"
    return base + (f"_{overrides}" if overrides else "")


class TinyZoo:
    """Builds each case's HF folder, torch model and conversions once, under `root`."""

    def __init__(self, root: Path):
        self.root = root
        self._models: dict[str, torch.nn.Module] = {}
        self._converted: dict[tuple[str, str], str] = {}

    def case(self, name: str) -> TinyCase:
        return _BY_NAME[name]

    def hf_model(self, name: str) -> torch.nn.Module:
        if name not in self._models:
            self._models[name] = build_hf_model(_BY_NAME[name])
        return self._models[name]

    def hf_folder(self, name: str) -> str:
        folder = self.root / "hf" / name
        if not folder.exists():
            self.hf_model(name).save_pretrained(folder, safe_serialization=True)
        return os.fspath(folder)

    def converted(self, name: str, plan: QuantPlan, compress_experts: bool = False) -> str:
        key = (name, plan_key(plan) + ("_zstd" if compress_experts else ""))
        if key not in self._converted:
            out = self.root / "zllm" / name / key[1]
            convert(self.hf_folder(name), os.fspath(out), plan, progress=False, compress_experts=compress_experts)
            self._converted[key] = os.fspath(out)
        return self._converted[key]


    def converted_case(self, case: TinyCase, plan: QuantPlan) -> tuple[torch.nn.Module, str]:
        """A case of a test's own (not in this module's lists): (its transformers model, its conversion
        with `plan`), written once under the zoo's directory."""
        model = build_hf_model(case)
        folder = self.root / "cases" / case.name
        out = folder / plan_key(plan)
        if not out.exists():
            if not (folder / "hf").exists():
                model.save_pretrained(folder / "hf", safe_serialization=True)
            convert(os.fspath(folder / "hf"), os.fspath(out), plan, progress=False)
        return model, os.fspath(out)


_ZOOS: dict[Path, TinyZoo] = {}


@pytest.fixture(scope="session")
def tiny_zoo(tmp_path_factory) -> TinyZoo:
    # A fixture imported into several modules is instantiated once per module; the zoo is shared
    # through _ZOOS so nothing is built twice in one run.
    base = tmp_path_factory.getbasetemp() / "tiny_models"
    if base not in _ZOOS:
        base.mkdir(exist_ok=True)
        _ZOOS[base] = TinyZoo(base)
    return _ZOOS[base]


def random_prompt(length: int, seed: int = 0) -> list[int]:
    """Token ids in [3, VOCAB) (away from bos/eos), reproducible."""
    return [int(i) for i in np.random.default_rng(seed).integers(3, VOCAB, size=length)]


def greedy_decode(model, prompt: list[int], n_decode: int, capacity: int) -> tuple[list[int], list[np.ndarray]]:
    """Prefill (all logits), then n_decode greedy steps in a new session: (tokens, every logits array)."""
    session = model.session(capacity=capacity)
    logits = [session.prefill(prompt, all_logits=True)]
    tokens = [int(logits[0][-1].argmax())]
    for _ in range(n_decode):
        logits.append(session.decode(tokens[-1]))
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits
