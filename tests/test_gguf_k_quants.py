"""GGUF K-quants kept as they are, end to end: tiny models whose matrices are Q4_K, Q5_K and IQ4_XS blocks
convert with `--weights source` into our schemes with f32 sub-block scales, dequantize as the gguf package
does bit for bit, and run on cpu (f32 and int8 activations), gpu and reference as transformers runs the same
dequantized weights; Q6_K (sub-blocks of 16) is the type that is still requantized, and says so.

The gguf package cannot quantize these types, so the blocks are random bytes with super-block scales
sized for weights of about the tiny models' magnitude; transformers gets their dequantized values."""
from __future__ import annotations

import zlib
from typing import NamedTuple

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf_files import write_hf_model_gguf
from gpu_support import open_gpu
from tiny_models import (TinyCase, build_hf_model, checkpoint_expert_weights, checkpoint_float_weights, hf_logits,
                         hf_model_with_weights, random_prompt)

import edge
from converters.convert import QuantPlan, convert
from quant import QuantizedTensor
from quant.checkpoint import open_checkpoint

# every matrix's K a multiple of the 256 values of a super-block
DENSE = TinyCase("llama_k_quants", "llama", dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                                 num_key_value_heads=2))
MOE = TinyCase("olmoe_k_quants", "olmoe", dict(hidden_size=256, intermediate_size=256, num_attention_heads=4,
                                               num_key_value_heads=2, num_experts=4, num_experts_per_tok=2))
TYPES = {"token_embd": Q.Q4_K, "attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.IQ4_XS, "attn_output": Q.Q4_K,
         "ffn_gate": Q.Q5_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K, "output": Q.IQ4_XS,
         "ffn_gate_exps": Q.Q4_K, "ffn_up_exps": Q.IQ4_XS, "ffn_down_exps": Q.Q5_K}
KEPT = {Q.Q4_K: "int4_affine_g32_f32scale", Q.Q5_K: "int8_affine_g32_f32scale", Q.IQ4_XS: "int8_sym_g32_f32scale"}
# byte offset of each float16 super-block scale in a block, and its magnitude: d and dmin of Q4_K and Q5_K
# positive (their minimum carries the sign) and sized for weights of mean about 0; the symmetric types' d signed
SUPER_SCALES = {Q.Q4_K: {0: 1e-4, 2: 7.5e-4}, Q.Q5_K: {0: 5e-5, 2: 7.75e-4}, Q.IQ4_XS: {0: 2e-5}, Q.Q6_K: {208: 5e-6}}
SIGNED_SCALES = (Q.IQ4_XS, Q.Q6_K)
PROMPT = random_prompt(12, seed=11)
N_DECODE = 4
REL_TOL = 1e-4  # f32 against f32 (tests/test_parity_transformers.py)


def random_blocks(values: np.ndarray, qtype) -> np.ndarray:
    """Blocks of `qtype` for a tensor of values' shape: random codes, scales and minimums, super-block scales
    of the magnitudes above."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(zlib.crc32(values.tobytes()))  # each tensor its own blocks, run after run
    blocks = rng.integers(0, 256, values.shape[:-1] + (values.shape[-1] // block_values, block_bytes), np.uint8)
    for start, magnitude in SUPER_SCALES[qtype].items():
        sign = rng.choice([-1.0, 1.0], blocks.shape[:-1] + (1,)) if qtype in SIGNED_SCALES else 1.0
        scale = sign * magnitude * rng.uniform(0.5, 1.5, blocks.shape[:-1] + (1,))
        blocks[..., start:start + 2] = scale.astype(np.float16).view(np.uint8)
    return blocks.reshape(values.shape[:-1] + (-1,))


def k_quant_type(name: str, values: np.ndarray):
    return TYPES.get(name.split(".")[-2], Q.F32)  # the router stays f32


def stacked_experts(experts: dict[str, np.ndarray], case: TinyCase) -> dict[str, np.ndarray]:
    """Per-expert projections by our names -> transformers' stacked gate_up_proj [E, 2I, D] and down_proj [E, D, I]."""
    config = case.make_config()
    stacked = {}
    for layer in range(config.num_hidden_layers):
        def projection(expert: int, name: str) -> np.ndarray:
            return experts[f"model.layers.{layer}.mlp.experts.{expert}.{name}.weight"]
        indices = range(config.num_experts)
        stacked[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([projection(e, "gate_proj"), projection(e, "up_proj")]) for e in indices])
        stacked[f"model.layers.{layer}.mlp.experts.down_proj"] = np.stack([projection(e, "down_proj") for e in indices])
    return stacked


class Converted(NamedTuple):
    transformers_model: object  # with the checkpoint's dequantized weights
    checkpoint: str  # the `--weights source` conversion of `gguf`
    gguf: str
    summary: object


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Converted]:
    """case name -> its GGUF, conversion and transformers model."""
    built = {}
    for case in (DENSE, MOE):
        folder = tmp_path_factory.mktemp(case.name)
        source = write_hf_model_gguf(build_hf_model(case), folder / "model.gguf", case.family,
                                     qtype_for=k_quant_type, blocks_for=random_blocks)
        summary = convert(str(source), str(folder / "source"), QuantPlan(weights="source"), progress=False)
        # the model as stored: the K-quants' own values (checked against gguf's below), Q6_K's requantized ones
        weights = checkpoint_float_weights(folder / "source")
        if case is MOE:
            weights.update(stacked_experts(checkpoint_expert_weights(str(folder / "source")), case))
        transformers_model = hf_model_with_weights(build_hf_model(case), weights)
        built[case.name] = Converted(transformers_model, str(folder / "source"), str(source), summary)
    return built


def test_k_quant_tensors_are_kept_bit_exact_and_q6_k_is_requantized(converted):
    _, path, source, summary = converted[DENSE.name]
    reports = {t.name: t for t in summary.tensors}
    reader = gguf.GGUFReader(source)
    by_gguf_name = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
                    "blk.1.attn_v.weight": "model.layers.1.self_attn.v_proj.weight",
                    "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
                    "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
                    "blk.1.ffn_up.weight": "model.layers.1.mlp.up_proj.weight"}
    with open_checkpoint(path) as checkpoint:
        for tensor in reader.tensors:
            if tensor.name not in by_gguf_name:
                continue
            name = by_gguf_name[tensor.name]
            stored = checkpoint.tensors[name]
            assert isinstance(stored, QuantizedTensor) and str(stored.scheme) == KEPT[tensor.tensor_type], name
            assert reports[name].lossless and reports[name].source_format == tensor.tensor_type.name
            expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            np.testing.assert_array_equal(stored.dequantize().view(np.uint32), expected.view(np.uint32), err_msg=name)
        for layer in (0, 1):  # q, k: rows permuted back from llama.cpp's order, values unchanged
            for projection, qtype in (("q_proj", Q.Q4_K), ("k_proj", Q.Q5_K)):
                name = f"model.layers.{layer}.self_attn.{projection}.weight"
                assert str(checkpoint.tensors[name].scheme) == KEPT[qtype] and reports[name].lossless
            down = f"model.layers.{layer}.mlp.down_proj.weight"
            assert str(checkpoint.tensors[down].scheme) == "int8_sym_g32" and not reports[down].lossless
            assert reports[down].source_format == "Q6_K"


def test_every_expert_record_keeps_its_k_quant_blocks(converted):
    summary = converted[MOE.name].summary
    reports = {t.name: t for t in summary.tensors}
    experts = [t for name, t in reports.items() if ".mlp.experts." in name]
    assert len(experts) == 2 * 4 * 3 and all(t.lossless for t in experts)
    assert {t.scheme for t in experts} == set(KEPT.values())


def our_logits(model, prompt: list[int], fed: list[int]) -> list[np.ndarray]:
    """Prefill logits [T, V], then one row per decode step fed transformers' greedy tokens."""
    session = model.session(capacity=32)
    steps = list(session.prefill(prompt, all_logits=True))
    for token in fed:
        steps.append(session.decode(token))
    return steps


# The MoE runs with f32 activations only: int8 ones move the router's input, and where two experts' logits
# nearly tie, a route may flip and the logits with it, beyond any per-matmul budget.
@pytest.mark.parametrize("case, device", [(DENSE, "reference"), (DENSE, "cpu:f32"), (DENSE, "cpu"), (DENSE, "gpu"),
                                          (MOE, "reference"), (MOE, "cpu:f32"), (MOE, "gpu")],
                         ids=lambda value: getattr(value, "name", value))
def test_k_quant_models_run_as_transformers_runs_their_dequantized_weights(converted, case, device):
    """Per step max |ours - theirs| <= tolerance * max |theirs|: REL_TOL for f32 activations; for the int8
    activations of plain `cpu` the budget `zllm-edge diff` gives a model whose matmuls round their inputs to
    int8 (edge/diff.py), as tests/test_cpu_backend.py takes it."""
    from edge.diff import INT8_ACTIVATION_UNIT, MATMULS_IN_SERIES, SAFETY

    if device == "gpu":
        open_gpu()  # skips where there is no Vulkan device
    transformers_model, path = converted[case.name][:2]
    prefill, decode, fed = hf_logits(transformers_model, PROMPT, N_DECODE)
    theirs = list(prefill) + decode
    n_layers = transformers_model.config.num_hidden_layers
    int8_budget = SAFETY * MATMULS_IN_SERIES * np.sqrt(n_layers + 1) * INT8_ACTIVATION_UNIT
    tolerance = int8_budget if device == "cpu" else REL_TOL
    with edge.load(path, device=device) as model:
        ours = our_logits(model, PROMPT, fed)
    for step, (mine, expected) in enumerate(zip(ours, theirs, strict=True)):
        error = np.abs(mine - expected).max() / np.abs(expected).max()
        assert error <= tolerance, f"{case.name} on {device}: step {step} relative error {error:.2e}"


def test_streamed_k_quant_experts_give_the_resident_bits(converted):
    path = converted[MOE.name].checkpoint
    runs = {}
    for strategy, budget in (("resident", None), ("predictive", "50%")):
        with edge.load(path, device="cpu", expert_strategy=strategy, memory_budget=budget) as model:
            runs[strategy] = our_logits(model, PROMPT, [5, 9, 17])
    for resident, streamed in zip(runs["resident"], runs["predictive"], strict=True):
        np.testing.assert_array_equal(resident, streamed)
