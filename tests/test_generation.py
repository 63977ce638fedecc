"""Sampling, streaming detokenization, stop strings and chat templates."""
from __future__ import annotations

import numpy as np
import pytest

import edge
from edge.sampling import SamplingParams, apply_repetition_penalty, sample_token
from edge.tokenizer import IncrementalDecoder


@pytest.fixture(scope="module")
def model(smollm2_checkpoint):
    with edge.load(smollm2_checkpoint) as m:
        yield m


def test_greedy_is_argmax_and_ignores_the_generator():
    logits = np.array([0.1, 3.0, -1.0, 2.9])
    assert sample_token(logits, SamplingParams(), np.random.default_rng(0)) == 1


def test_top_k_one_and_tiny_top_p_reduce_to_greedy():
    rng = np.random.default_rng(0)
    logits = np.random.default_rng(1).standard_normal(500)
    best = int(np.argmax(logits))
    for _ in range(20):
        assert sample_token(logits, SamplingParams(temperature=1.5, top_k=1), rng) == best
        assert sample_token(logits, SamplingParams(temperature=1.5, top_p=1e-9), rng) == best


def test_sampling_follows_the_softmax_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    rng = np.random.default_rng(123)
    draws = [sample_token(logits, SamplingParams(temperature=1.0), rng) for _ in range(6000)]
    frequencies = np.bincount(draws, minlength=3) / len(draws)
    np.testing.assert_allclose(frequencies, [0.5, 0.3, 0.2], atol=0.03)


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(5)
    draws = {sample_token(logits, SamplingParams(temperature=1.0, top_p=0.75), rng) for _ in range(500)}
    assert draws == {0, 1}


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = np.array([2.0, -2.0, 1.0])
    penalized = apply_repetition_penalty(logits, np.array([0, 1, 1]), 2.0)
    np.testing.assert_array_equal(penalized, [1.0, -4.0, 1.0])


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-1), dict(top_p=-0.1), dict(repetition_penalty=0)])
def test_bad_sampling_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_streaming_never_splits_multibyte_characters(model):
    text = "Café 世界 🎉🇫🇷 naïve — done"
    ids = model.tokenizer.encode(text)
    decoder = IncrementalDecoder(model.tokenizer, [])
    pieces = [decoder.push(i) for i in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text
    # the emoji spans several byte-level tokens, so some pushes must have held text back
    assert pieces.count("") > 0


def test_seeded_sampling_is_reproducible(model):
    def run(seed):
        generation = model.generate("Once upon a time", max_new_tokens=6, temperature=1.0, top_k=40, seed=seed)
        text = "".join(generation)
        return generation.result.tokens, text

    first, second = run(7), run(7)
    assert first == second
    assert len(first[0]) == 6


def test_stop_string_truncates_and_ends_generation(model):
    generation = model.generate("The capital of France is", max_new_tokens=8, stop=["."])
    text = "".join(generation)
    assert text == " Paris"
    assert generation.result.finish_reason == "stop"


def test_generated_pieces_join_to_the_result_text(model):
    generation = model.generate("The capital of France is", max_new_tokens=6)
    pieces = list(generation)
    assert "".join(pieces) == generation.result.text == model.decode(generation.result.tokens)
    assert generation.result.finish_reason == "length"
    timings = generation.result.timings
    assert timings["prefill_seconds"] > 0 and timings["decode_tokens_per_second"] > 0


def test_chat_template_renders_like_transformers(model, smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    import os

    folder, filename = os.path.split(smollm2_gguf)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    ours = model.tokenizer.apply_chat_template(messages)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    reply = model.chat(messages, max_new_tokens=4)
    list(reply)
    assert reply.result.prompt_tokens == hf_tokenizer(theirs, add_special_tokens=False)["input_ids"]
