"""Session semantics: NewPrefill / AppendPrefill / DecodeRound agree, state is exact, limits are errors.

Two tiny models: a GQA Llama with tied embeddings (f32 weights), and a Mistral with a sliding
window of 4 stored as int4 (so appends and decodes cross the window, and quantized rows are
looked up one token at a time).
"""
from __future__ import annotations

import numpy as np
import pytest

import edge
from converters.convert import QuantPlan
from edge.tokenizer import TokenizerError
from tiny_models import CONTEXT, VOCAB, random_prompt

# The same token through the same weights, computed with a different number of tokens per call:
# only the f32 summation order inside matmuls (BLAS blocking depends on T) and nothing else
# differs. Each dot product has K <= 96 terms, error ~ sqrt(K) * 2^-24 ~ 1e-6 relative at most
# through the ~10 dependent ops of 2 layers; measured <= 4.6e-7. Tolerance: 1e-5 of the largest logit.
SPLIT_REL_TOL = 1e-5

MODELS = [
    ("llama_gqa_tied", QuantPlan(weights="f32")),
    ("mistral_swa4", QuantPlan(weights="int4", group_size=32, symmetric=True)),
]


@pytest.fixture(scope="module", params=MODELS, ids=lambda m: m[0])
def model(request, tiny_zoo):
    case, plan = request.param
    loaded = edge.load(tiny_zoo.converted(case, plan), device="reference")
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def llama(tiny_zoo):
    loaded = edge.load(tiny_zoo.converted("llama_gqa_tied", QuantPlan(weights="f32")), device="reference")
    yield loaded
    loaded.close()


def assert_close(ours: np.ndarray, reference: np.ndarray, what: str) -> None:
    assert ours.shape == reference.shape, what
    assert ours.dtype == np.float32, what
    error = np.abs(ours - reference).max() / np.abs(reference).max()
    assert error <= SPLIT_REL_TOL, f"{what}: max|a-b|/max|b| = {error:.2e}"


def assert_state(session, tokens: list[int]) -> None:
    assert session.position == len(tokens)
    assert session.cache.length == len(tokens)
    assert session.tokens == tokens


A = random_prompt(7, seed=11)
B = random_prompt(6, seed=12)


def test_new_prefill_append_prefill_and_decode_agree(model):
    whole = model.session()
    assert_state(whole, [])
    reference = whole.prefill(A + B, all_logits=True)  # [13, V]
    assert reference.shape == (len(A) + len(B), VOCAB)
    assert_state(whole, A + B)

    appended = model.session()
    first = appended.prefill(A, all_logits=True)
    assert_state(appended, A)
    second = appended.prefill(B, all_logits=True)
    assert_state(appended, A + B)
    assert_close(np.concatenate([first, second]), reference, "prefill(a); prefill(b)")

    decoded = model.session()
    assert_close(decoded.prefill(A, all_logits=True), reference[: len(A)], "prefill(a)")
    for i, token in enumerate(B):
        logits = decoded.decode(token)
        assert logits.shape == (VOCAB,)
        assert_close(logits, reference[len(A) + i], f"decode of b[{i}]")
        assert_state(decoded, A + B[: i + 1])


def test_last_token_logits_equal_the_last_row(model):
    rows = model.session().prefill(A, all_logits=True)
    session = model.session()
    last = session.prefill(A)
    assert last.shape == (VOCAB,)
    assert_close(last, rows[-1], "prefill(a) without all_logits")
    assert_close(session.prefill(B), model.session().prefill(A + B, all_logits=True)[-1], "append, last token")


def test_reset_forgets_history_and_stale_cache(model):
    fresh = model.session().prefill(B, all_logits=True)
    session = model.session()
    session.prefill(A + A)
    session.reset()
    assert_state(session, [])
    assert_close(session.prefill(B, all_logits=True), fresh, "prefill after reset")
    assert_state(session, B)


def test_sessions_are_independent(model):
    one, two = model.session(), model.session()
    reference_one = model.session().prefill(A + B, all_logits=True)
    reference_two = model.session().prefill(B + A, all_logits=True)
    got_one = [one.prefill(A, all_logits=True)]
    got_two = [two.prefill(B, all_logits=True)]
    got_one.append(one.prefill(B, all_logits=True))
    got_two.append(two.prefill(A, all_logits=True))
    assert_close(np.concatenate(got_one), reference_one, "interleaved session one")
    assert_close(np.concatenate(got_two), reference_two, "interleaved session two")


# --- limits ------------------------------------------------------------------------------------------
def capacity_message(n_new: int, end: int, capacity: int) -> str:
    return (f"the sequence would grow from {end - n_new} to {end} tokens, beyond this session's KV cache "
            f"capacity of {capacity}; open the session with model.session(capacity=...) (a saved one: "
            f"model.load_session(path, capacity=...)) up to {CONTEXT}")


def context_message(n_new: int, end: int) -> str:
    return (f"the sequence would grow from {end - n_new} to {end} tokens, beyond the model's context of "
            f"{CONTEXT} tokens; start a new session or shorten the input")


def test_capacity_is_enforced_and_a_refused_call_changes_nothing(llama):
    session = llama.session(capacity=8)
    assert session.capacity == 8
    ids = random_prompt(9, seed=3)
    with pytest.raises(edge.SessionError) as info:
        session.prefill(ids)
    assert str(info.value) == capacity_message(9, 9, 8)
    assert_state(session, [])

    session.prefill(ids[:5])
    with pytest.raises(edge.SessionError) as info:
        session.prefill(ids[5:])
    assert str(info.value) == capacity_message(4, 9, 8)
    assert_state(session, ids[:5])

    for token in ids[5:8]:  # the refused call left the cache usable: fill it exactly
        session.decode(token)
    assert_state(session, ids[:8])
    with pytest.raises(edge.SessionError) as info:
        session.decode(ids[8])
    assert str(info.value) == capacity_message(1, 9, 8)
    assert_state(session, ids[:8])


def test_model_context_is_enforced(llama):
    assert llama.spec.max_position_embeddings == CONTEXT
    assert llama.session().capacity == CONTEXT  # default: min(context, 4096)
    ids = random_prompt(CONTEXT + 1, seed=4)
    session = llama.session(capacity=CONTEXT)
    with pytest.raises(edge.SessionError) as info:
        session.prefill(ids)
    assert str(info.value) == context_message(CONTEXT + 1, CONTEXT + 1)
    session.prefill(ids[:CONTEXT])
    assert_state(session, ids[:CONTEXT])
    with pytest.raises(edge.SessionError) as info:
        session.decode(ids[CONTEXT])
    assert str(info.value) == context_message(1, CONTEXT + 1)
    assert_state(session, ids[:CONTEXT])


@pytest.mark.parametrize("capacity", [0, -1, CONTEXT + 1])
def test_session_capacity_outside_the_context_is_refused(llama, capacity):
    # a ZllmError (not a SessionError: there is no session yet)
    with pytest.raises(edge.ZllmError) as info:
        llama.session(capacity=capacity)
    assert str(info.value) == f"session capacity must be in [1, {CONTEXT}] (the model's context), got {capacity}"


def test_empty_prefill_is_refused(llama):
    session = llama.session()
    for empty in ([], np.array([], dtype=np.int64)):
        with pytest.raises(edge.SessionError) as info:
            session.prefill(empty)
        assert str(info.value) == "prefill needs at least one token id"
    assert_state(session, [])


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 1000, -1])
def test_token_outside_the_vocabulary_is_refused(llama, bad):
    session = llama.session()
    message = f"token id {bad} is outside the vocabulary [0, {VOCAB})"
    with pytest.raises(edge.SessionError) as info:
        session.prefill([5, bad, 6])
    assert str(info.value) == message
    assert_state(session, [])
    session.prefill([5])
    with pytest.raises(edge.SessionError) as info:
        session.decode(bad)
    assert str(info.value) == message
    assert_state(session, [5])


# --- generation from ids (the tiny checkpoints have no tokenizer) --------------------------------
def greedy_chain(model, prompt: list[int], n: int) -> list[int]:
    session = model.session()
    logits = session.prefill(prompt)
    chain = []
    while True:
        chain.append(int(np.argmax(logits)))
        if len(chain) == n:
            return chain
        logits = session.decode(chain[-1])


def test_generate_from_ids_is_the_greedy_chain(model):
    assert model.tokenizer is None
    prompt = random_prompt(10, seed=5)
    generation = model.generate(prompt, max_new_tokens=5)
    pieces = list(generation)
    assert pieces == []  # no tokenizer: ids only, no text is streamed
    result = generation.result
    assert result.prompt_tokens == prompt
    assert result.tokens == greedy_chain(model, prompt, 5)
    assert result.text == ""
    assert result.finish_reason == "length"


def test_generate_stops_at_the_model_context(llama):
    # 62 prompt tokens in a context of 64: the tokens sampled at positions 61, 62 and 63 fit; a
    # fourth would need position 64.
    prompt = random_prompt(CONTEXT - 2, seed=6)
    generation = llama.generate(prompt, max_new_tokens=5)
    assert list(generation) == []
    assert generation.result.tokens == greedy_chain(llama, prompt, 3)
    assert generation.result.finish_reason == "length"


def test_generate_from_ids_stops_at_eos(llama):
    eos = llama.checkpoint.tokenizer_config["eos_token_id"]
    assert eos == 2 and llama.checkpoint.tokenizer_config["eog_token_ids"] == [eos]
    prompt = random_prompt(6, seed=12)  # chosen so that the greedy chain reaches eos at its third token
    chain = greedy_chain(llama, prompt, 5)
    assert eos in chain[:3]
    generation = llama.generate(prompt, max_new_tokens=5)
    assert list(generation) == []
    assert generation.result.tokens == chain[: chain.index(eos) + 1]
    assert generation.result.finish_reason == "eos"


def test_generate_zero_tokens(llama):
    generation = llama.generate([5, 6], max_new_tokens=0)
    assert list(generation) == []
    assert generation.result.tokens == []
    assert generation.result.finish_reason == "length"


def test_text_without_a_tokenizer_is_refused(llama):
    with pytest.raises(TokenizerError) as info:
        llama.generate("hello", max_new_tokens=2)
    assert str(info.value) == f"{llama.path} has no tokenizer; pass token ids instead of text"
    assert isinstance(info.value, edge.ZllmError)
