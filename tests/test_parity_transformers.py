"""The model agrees with transformers: every tiny family case, f32 / f16 / int8 / int4 weights.

Protocol (one "step" is one row of logits): prefill a 12-token random prompt with all_logits
(12 steps), then 4 decode steps, each fed the greedy token of the transformers model under
comparison (torch float32, eager attention, use_cache=True, so its own KV cache is exercised).

Metric for agreement: per step, max_v |ours_v - theirs_v| <= REL_TOL * max_v |theirs_v|.

Quantized and f16 checkpoints are checked in two separate ways:

1. exactness of the quantized path: transformers, given the checkpoint's dequantized weights,
   must agree with us to the same REL_TOL. The product must compute exactly the model it stores.
2. the effect of quantization itself, against the original f32 transformers model: a bound on
   the logits' relative RMS error that scales with the weight errors recorded in zllm.json
   (derivation at `quantization_bound`), plus greedy-argmax checks.

Run with -s to print the table of measured errors.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np
import pytest
import torch
from tiny_models import (
    CASE_NAMES,
    build_hf_model,
    checkpoint_float_weights,
    hf_logits,
    hf_model_with_weights,
    plan_key,
    random_prompt,
)

import edge
from converters.convert import QuantPlan
from quant import QuantizedTensor
from quant.checkpoint import open_checkpoint

PROMPT = random_prompt(12, seed=7)
N_DECODE = 4
# f32 vs f32: both sides round differently (matmul order, rope tables built in float64 here,
# softmax); measured errors are ~1e-6 of the largest logit, so 1e-4 leaves two orders of margin.
REL_TOL = 1e-4

F32 = QuantPlan(weights="f32")
LOSSY_PLANS = (
    QuantPlan(weights="f16"),
    QuantPlan(weights="int8", group_size=32, symmetric=True),
    QuantPlan(weights="int8", group_size=64, symmetric=False),
    QuantPlan(weights="int4", group_size=32, symmetric=True),
    QuantPlan(weights="int4", group_size=128, symmetric=False),  # K = 64 or 96 < 128: one zero-padded group per row
)
# A mixed scheme on an untied model: embeddings kept f32, attention and head int8, ffn int4.
MIXED = ("llama_mha", QuantPlan(weights="int4", group_size=64, symmetric=True,
                                overrides={"embeddings": "f32", "attention": "int8", "lm_head": "int8"}))
LOSSY = [(case, plan) for case in CASE_NAMES for plan in LOSSY_PLANS] + [MIXED]


def _id(value):
    return plan_key(value) if isinstance(value, QuantPlan) else str(value)


# --- collecting the measured errors for the printed table ---------------------------------------
_TABLE: dict[tuple[str, str, str], float] = {}  # (case, plan label, metric) -> value


def label(plan: QuantPlan) -> str:
    if plan == MIXED[1]:
        return "mixed: emb f32, attn+head int8, ffn int4_sym_g64"
    return plan_key(plan)


@pytest.fixture(scope="module", autouse=True)
def _print_error_table():
    yield
    if not _TABLE:
        return
    columns = [  # (title, metric key, format)
        ("vs HF same weights", "same", "{:.2e}"),
        ("vs HF f32", "max_rel", "{:.2e}"),
        ("rel RMS vs f32", "rel_rms", "{:.2e}"),
        ("bound", "bound", "{:.2e}"),
        ("gain", "gain", "{:.2f}"),
        ("argmax agree", "agree", "{:.2f}"),
        (f"in top {INT4_TOP_K}", "top_k", "{:.2f}"),
        ("median margin", "margin", "{:.2f}"),
    ]
    order = [label(F32)] + [label(p) for p in LOSSY_PLANS] + [label(MIXED[1])]
    rows = sorted({(case, scheme) for case, scheme, _ in _TABLE},
                  key=lambda row: (CASE_NAMES.index(row[0]), order.index(row[1])))
    print("\n\nzllm reference backend vs transformers, 12 prefill positions + 4 decode steps")
    print("  vs HF same weights / vs HF f32: worst step of max|ours-theirs| / max|theirs|")
    print("  rel RMS vs f32: rms(ours-theirs) / rms(theirs) over all steps; bound = GAIN * sqrt(sum eps_i^2);"
          " gain = rel RMS / sqrt(sum eps_i^2)")
    print("  median margin (f32 rows): median over steps of (top1 - top2 logit) / std of the step's logits")
    print(f"{'case':18s} {'scheme':48s}" + "".join(f"{title:>19s}" for title, _, _ in columns))
    for case, scheme in rows:
        cells = [_TABLE.get((case, scheme, key)) for _, key, _ in columns]
        print(f"{case:18s} {scheme:48s}" + "".join(
            f"{'':>19s}" if value is None else f"{fmt.format(value):>19s}"
            for value, (_, _, fmt) in zip(cells, columns)))


# --- helpers ---------------------------------------------------------------------------------------
def per_step_max_rel(ours: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    """[steps] max_v |ours - theirs| / max_v |theirs|, one value per row of logits."""
    return np.abs(ours - theirs).max(axis=-1) / np.abs(theirs).max(axis=-1)


def our_logits(path: str, prompt: list[int], fed: list[int]) -> np.ndarray:
    """[len(prompt) + len(fed), V]: prefill with all_logits, then one decode per fed token."""
    model = edge.load(path, device="reference")
    try:
        session = model.session()
        rows = [session.prefill(prompt, all_logits=True)]
        for token in fed:
            rows.append(session.decode(token)[None])
        assert session.position == len(prompt) + len(fed)
        return np.concatenate(rows)
    finally:
        model.close()


def check_parity(hf_model, path: str) -> tuple[np.ndarray, np.ndarray]:
    """Both runs on the same tokens (transformers' greedy chain); returns (per-step errors, their logits)."""
    prefill, steps, fed = hf_logits(hf_model, PROMPT, N_DECODE)
    theirs = np.concatenate([prefill, np.stack(steps)])
    ours = our_logits(path, PROMPT, fed)
    assert ours.shape == theirs.shape == (len(PROMPT) + N_DECODE, hf_model.config.vocab_size)
    assert ours.dtype == np.float32
    errors = per_step_max_rel(ours, theirs)
    worst = int(errors.argmax())
    assert errors[worst] <= REL_TOL, (
        f"step {worst} ({'prefill position' if worst < len(PROMPT) else 'decode step'} "
        f"{worst if worst < len(PROMPT) else worst - len(PROMPT)}): max|ours-theirs|/max|theirs| = "
        f"{errors[worst]:.3e} > {REL_TOL:.0e}"
    )
    return errors, theirs


def manifest_tensors(path: str) -> dict:
    with open(os.path.join(path, "zllm.json"), encoding="utf-8") as f:
        return json.load(f)["tensors"]


# --- f32 ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASE_NAMES)
def test_f32_logits_match_transformers(tiny_zoo, case):
    """f32 checkpoint: every prefill position and decode step within REL_TOL of transformers."""
    errors, theirs = check_parity(tiny_zoo.hf_model(case), tiny_zoo.converted(case, F32))
    _TABLE[(case, label(F32), "same")] = float(errors.max())
    top_two = np.sort(theirs, axis=1)[:, -2:]
    _TABLE[(case, label(F32), "margin")] = float(np.median((top_two[:, 1] - top_two[:, 0]) / theirs.std(axis=1)))


@pytest.mark.parametrize("case", ["mistral_swa4", "qwen2_swa_layer1"])
def test_sliding_window_cases_really_slide(tiny_zoo, case):
    """The window must change transformers' eager logits, or the sliding-window parity proves nothing.

    Same weights without the window: identical logits while every key is inside the window
    (positions < 4), clearly different once keys fall out of it.
    """
    tiny = tiny_zoo.case(case)
    no_window = {"sliding_window": None} if tiny.family == "mistral" else {"use_sliding_window": False}
    windowed = tiny_zoo.hf_model(case)
    full = build_hf_model(dataclasses.replace(tiny, config={**tiny.config, **no_window}))
    for (name, a), (_, b) in zip(windowed.state_dict().items(), full.state_dict().items()):
        assert torch.equal(a, b), name
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        with_window = windowed(ids).logits[0].numpy()
        without = full(ids).logits[0].numpy()
    window = tiny.config["sliding_window"]
    errors = per_step_max_rel(with_window, without)
    assert errors[:window].max() <= 1e-6
    assert errors[window:].min() >= 1e-2


@pytest.mark.parametrize("case", ["llama_rope_llama3", "llama_rope_linear", "llama_rope_yarn"])
def test_rope_scaling_cases_really_scale(tiny_zoo, case):
    """transformers must apply the case's rope scaling, or its parity would prove nothing.

    Same weights with default rope: position 0 is untouched (angle 0; a yarn attention factor only
    rescales the single score a first token has), later positions clearly change.
    """
    tiny = tiny_zoo.case(case)
    default = {"rope_type": "default", "rope_theta": tiny.config["rope_parameters"]["rope_theta"]}
    scaled = tiny_zoo.hf_model(case)
    unscaled = build_hf_model(dataclasses.replace(tiny, config={**tiny.config, "rope_parameters": default}))
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        errors = per_step_max_rel(scaled(ids).logits[0].numpy(), unscaled(ids).logits[0].numpy())
    assert errors[0] <= 1e-6
    assert errors[1:].max() >= 0.1


# --- lossy schemes ----------------------------------------------------------------------------------
def expected_scheme(name: str, shape: list[int], plan: QuantPlan) -> str:
    if len(shape) != 2 or "norm" in name or name.endswith(".bias"):
        return "f32"
    cls = ("embeddings" if name == "model.embed_tokens.weight" else "lm_head" if name == "lm_head.weight"
           else "attention" if ".self_attn." in name else "ffn")
    choice = plan.overrides.get(cls, plan.weights)
    if choice in ("f32", "f16"):
        return choice
    return f"{choice}_{'sym' if plan.symmetric else 'affine'}_g{plan.group_size}"


@pytest.mark.parametrize("case,plan", LOSSY, ids=_id)
def test_quantized_path_is_exact(tiny_zoo, case, plan):
    """transformers running the checkpoint's dequantized weights agrees with us to REL_TOL.

    So whatever error the scheme adds comes from the stored weights alone, never from how the
    reference backend unpacks or multiplies them.
    """
    path = tiny_zoo.converted(case, plan)
    tensors = manifest_tensors(path)
    for name, info in tensors.items():
        assert info["scheme"] == expected_scheme(name, info["shape"], plan), name
    with open_checkpoint(path) as ckpt:
        quantized = {n for n, t in ckpt.tensors.items() if isinstance(t, QuantizedTensor)}
    assert quantized == {n for n, info in tensors.items() if info["scheme"].startswith("int")}

    dequantized_hf = hf_model_with_weights(tiny_zoo.hf_model(case), checkpoint_float_weights(path))
    errors, _ = check_parity(dequantized_hf, path)
    _TABLE[(case, label(plan), "same")] = float(errors.max())


def quantization_bound(weight_errors: list[float]) -> float:
    """Upper bound on rms(logits_q - logits) / rms(logits) from the tensors' rel RMS weight errors.

    Derivation. Write each stored tensor as W_i + dW_i with rms(dW_i) = eps_i * rms(W_i) (eps_i is
    zllm.json's rel_rms_error). To first order the logit error is a sum of one term per tensor,
    J_i[dW_i]. For y = W x, rounding errors are zero-mean and independent of x, so
    rms(dW x) = eps_i * rms(W x) for weights whose rows are not aligned with x (random ones are
    not): each tensor adds a relative error eps_i where it acts. That relative error reaches the
    logits with a gain g_i: RMS norms are scale-invariant (gain <= 1 on a relative error), residual
    additions dilute it, silu/softmax have bounded slopes at these activation sizes; an embedding
    or lm_head error reaches the logits with gain ~1. The tensors' errors are independent, so
    their contributions add in quadrature:
        rel_rms(d logits) ~= sqrt(sum_i g_i^2 eps_i^2) <= G * sqrt(sum_i eps_i^2).
    We take G = GAIN = 2. The measured rel_rms / sqrt(sum eps^2) (the "gain" column printed with
    -s) is 0.65 - 1.23 over every case and scheme here; second-order terms are ~eps^2, negligible
    even for int4 (eps ~ 0.1 per tensor).
    """
    return GAIN * math.sqrt(sum(e * e for e in weight_errors))


GAIN = 2.0
# Greedy argmax, "most positions" (measured 0.81 - 1.00 for f16 and int8).
MIN_ARGMAX_AGREEMENT = 0.75
# int4 on random-init tiny models: the median top-1 margin is only 0.11 - 0.52 logit-std (printed
# per case), while int4 leaves logit noise of ~0.3 logit-std (eps ~0.09 on each of ~16 tensors), so
# the greedy token flips at about half the positions whatever the implementation (measured top-1
# agreement 0.38 - 0.81; the exactness test shows the flips come from the stored weights, not from
# the product). Trained models have far larger margins. What holds here: the f32 greedy token
# stays within our top 5 ...
INT4_TOP_K, INT4_MIN_TOP_K_AGREEMENT = 5, 0.75  # (measured 0.88 - 1.00)
# ... and wherever the f32 margin exceeds SAFE_MARGIN_SIGMAS bounded pair-noise std, argmax must not flip.
SAFE_MARGIN_SIGMAS = 6.0


@pytest.mark.parametrize("case,plan", LOSSY, ids=_id)
def test_quantization_error_within_bound(tiny_zoo, case, plan):
    """Against the original f32 transformers model, on its greedy chain (teacher forcing)."""
    path = tiny_zoo.converted(case, plan)
    prefill, steps, fed = hf_logits(tiny_zoo.hf_model(case), PROMPT, N_DECODE)
    theirs = np.concatenate([prefill, np.stack(steps)])  # [16, V]
    ours = our_logits(path, PROMPT, fed)
    difference = (ours - theirs).astype(np.float64)
    rms_theirs = float(np.sqrt(np.mean(np.square(theirs, dtype=np.float64))))
    rel_rms = float(np.sqrt(np.mean(difference**2))) / rms_theirs
    weight_errors = [info["rel_rms_error"] for info in manifest_tensors(path).values()]
    bound = quantization_bound(weight_errors)
    key = (case, label(plan))
    _TABLE[key + ("gain",)] = rel_rms * GAIN / bound
    _TABLE[key + ("max_rel",)] = float(per_step_max_rel(ours, theirs).max())
    _TABLE[key + ("rel_rms",)] = rel_rms
    _TABLE[key + ("bound",)] = bound
    assert rel_rms <= bound, f"logit rel RMS error {rel_rms:.3e} above the bound {bound:.3e}"

    greedy = theirs.argmax(axis=1)
    agree = float(np.mean(ours.argmax(axis=1) == greedy))
    _TABLE[key + ("agree",)] = agree
    top_two = np.sort(theirs, axis=1)[:, -2:]
    margin = top_two[:, 1] - top_two[:, 0]
    # a flip needs d_v - d_greedy > margin; each d has rms <= bound * rms_theirs, their difference sqrt(2) x
    safe = margin > SAFE_MARGIN_SIGMAS * math.sqrt(2) * bound * rms_theirs
    flipped = safe & (ours.argmax(axis=1) != greedy)
    assert not flipped.any(), f"argmax flipped at steps {np.flatnonzero(flipped)} despite a safe margin"
    if plan.weights == "int4":
        rank = (ours > ours[np.arange(len(ours)), greedy][:, None]).sum(axis=1)  # 0 = our argmax
        in_top_k = float(np.mean(rank < INT4_TOP_K))
        _TABLE[key + ("top_k",)] = in_top_k
        assert in_top_k >= INT4_MIN_TOP_K_AGREEMENT, f"f32 greedy token in our top {INT4_TOP_K} at {in_top_k:.2f}"
    else:
        assert agree >= MIN_ARGMAX_AGREEMENT, f"greedy argmax agrees at {agree:.2f} of positions"
