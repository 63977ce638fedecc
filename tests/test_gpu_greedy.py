"""Greedy steps on the gpu device read back the next token id only (argmax on the device), and pick
exactly the token the logits' argmax picks (ties to the lowest id, as numpy)."""
from __future__ import annotations

import numpy as np
import pytest

import edge
from converters.convert import QuantPlan
from gpu_support import open_gpu
from tiny_models import random_prompt

INT4_AFFINE = QuantPlan(weights="int4", group_size=32, symmetric=False)
MIXED = QuantPlan(weights="int8", group_size=32, overrides={"experts": "int4"})
PROMPT = random_prompt(10, seed=3)


@pytest.fixture(scope="module")
def gpu_available():
    open_gpu()


def logits_greedy(model, steps: int) -> list[int]:
    session = model.session(capacity=32)
    tokens = [int(session.prefill(PROMPT).argmax())]
    for _ in range(steps):
        tokens.append(int(session.decode(tokens[-1]).argmax()))
    return tokens


@pytest.mark.parametrize("case, plan", [("llama_gqa_tied", INT4_AFFINE), ("qwen2_moe_shared", MIXED)])
def test_next_token_reads_back_one_id(gpu_available, tiny_zoo, case, plan):
    path = tiny_zoo.converted(case, plan)
    with edge.load(path, device="gpu") as model:
        expected = logits_greedy(model, steps=4)
        ctx = model.backend.ctx
        read_sizes = []
        original = ctx.read

        def recording_read(staging, nbytes, dtype=np.float32):
            read_sizes.append(nbytes)
            return original(staging, nbytes, dtype)

        ctx.read = recording_read
        session = model.session(capacity=32)
        tokens = [session.next_token(PROMPT)]
        for _ in range(4):
            tokens.append(session.next_token([tokens[-1]]))
        assert session.position == len(PROMPT) + 4
    assert tokens == expected
    vocab = model.spec.vocab_size
    assert 4 * vocab not in read_sizes  # never the logits
    assert read_sizes.count(4) == 5     # one id per step; a MoE model also reads each layer's router logits


def test_greedy_generation_on_gpu_matches_the_logits_argmax(gpu_available, tiny_zoo):
    path = tiny_zoo.converted("qwen3_qknorm", INT4_AFFINE)
    with edge.load(path, device="gpu") as gpu:
        generation = gpu.generate(PROMPT, max_new_tokens=6)
        list(generation.steps())
        expected = logits_greedy(gpu, steps=5)
    assert generation.result.tokens == expected


def test_sampling_still_uses_the_logits(gpu_available, tiny_zoo):
    path = tiny_zoo.converted("qwen3_qknorm", INT4_AFFINE)
    with edge.load(path, device="gpu") as gpu, edge.load(path, device="reference") as ref:
        runs = []
        for model in (gpu, ref):
            generation = model.generate(PROMPT, max_new_tokens=6, temperature=0.7, seed=11)
            list(generation.steps())
            runs.append(generation.result.tokens)
    assert len(runs[0]) == 6
    assert runs[0] == runs[1]  # the same seed samples the same tokens from logits within 1e-5
