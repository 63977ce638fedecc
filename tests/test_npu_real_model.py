"""SmolLM2-135M (Q4_1 weights, Q8_0 embedding) on device="npu" (ONNX Runtime's CPU provider, default
settings: accuracy_level 4, affine int4 as MatMulNBits + exact group offsets) gives the reference
backend's greedy tokens up to the first near-tie of the reference's own top-two log-probs."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

import edge  # noqa: E402

PROMPT = "The capital of France is"
N_GREEDY = 12
NEAR_TIE = 0.3  # as in test_real_model.py: a gap under which rounding may pick the other token


def greedy(model, ids, steps):
    session = model.session(capacity=64)
    logits = session.prefill(ids)
    tokens, gaps = [], []
    for _ in range(steps):
        log_probs = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
        top2 = np.sort(log_probs)[-2:]
        gaps.append(float(top2[1] - top2[0]))
        tokens.append(int(logits.argmax()))
        logits = session.decode(tokens[-1])
    return tokens, gaps


def test_greedy_tokens_match_reference_up_to_first_near_tie(smollm2_checkpoint):
    with edge.load(smollm2_checkpoint, device="reference") as reference:
        ids = reference.encode(PROMPT)
        expected, gaps = greedy(reference, ids, N_GREEDY)
    with edge.load(smollm2_checkpoint, device="npu:cpu") as model:
        info = model.device_info()
        ours, _ = greedy(model, ids, N_GREEDY)
    assert info["provider"] == "CPUExecutionProvider" and info["accuracy_level"] == 4
    first_tie = next((i for i, gap in enumerate(gaps) if gap < NEAR_TIE), N_GREEDY)
    assert first_tie >= 1
    assert ours[:first_tie] == expected[:first_tie]
    assert model.decode(ours[:1]) == " Paris"
