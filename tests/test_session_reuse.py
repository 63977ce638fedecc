"""A session goes back to an earlier position (Session.rewind) and a generation continues an open session
(model.generate/chat(..., session=)), keeping the KV of the prompt's first tokens that the session holds: a
conversation's earlier turns are not computed again."""
from __future__ import annotations

import numpy as np
import pytest
from tiny_models import random_prompt

import edge
from converters.convert import QuantPlan
from edge.core.errors import InvalidArgumentError, SessionError

F32 = QuantPlan(weights="f32")


@pytest.mark.parametrize("device", ["reference", "cpu"])
def test_rewind_then_prefill_continues_from_the_kept_prefix(tiny_zoo, device):
    path = tiny_zoo.converted("llama_gqa_tied", F32)
    a, b, c = random_prompt(6, seed=1), random_prompt(5, seed=2), random_prompt(4, seed=3)
    with edge.load(path, device=device) as model:
        with model.session(capacity=32) as fresh:
            fresh.prefill(a)
            expected = fresh.prefill(c)
        with model.session(capacity=32) as session:
            session.prefill(a)
            session.prefill(b)
            session.rewind(len(a))
            assert (session.position, session.tokens) == (len(a), a)
            # the same computation from the same state: the same bits
            np.testing.assert_array_equal(session.prefill(c), expected)
            with pytest.raises(InvalidArgumentError, match=r"length must be an integer in \[0, 10\], got 11"):
                session.rewind(len(a) + len(c) + 1)


def test_a_wrapped_sliding_window_cannot_go_back(tiny_zoo):
    path = tiny_zoo.converted("mistral_swa4", F32)  # window 4, ring-buffered on the reference device
    with edge.load(path, device="reference") as model, model.session(capacity=32) as session:
        session.prefill(random_prompt(3, seed=4))
        session.rewind(1)  # nothing overwritten yet
        session.prefill(random_prompt(8, seed=5))
        assert session.reusable_prefix(session.tokens + [1]) == session.position  # nothing to go back over
        diverging = session.tokens[:2] + [(session.tokens[2] + 1) % 100, 1]
        assert session.reusable_prefix(diverging) == 0  # going back to 2 would read overwritten rows
        with pytest.raises(SessionError, match="cannot go back to position 2: a sliding-window layer has "
                                               "overwritten what it held there"):
            session.rewind(2)
        session.rewind(session.position)  # staying where it is is always possible


@pytest.mark.parametrize("device", ["reference", "cpu"])
def test_a_generation_continues_a_session_and_reuses_its_common_prefix(smollm2_checkpoint, device):
    with edge.load(str(smollm2_checkpoint), device=device) as model, model.session(capacity=256) as session:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        first = model.chat(messages, max_new_tokens=10, session=session)
        reply = "".join(first)
        assert first.result.timings["prompt_tokens_reused"] == 0
        held = list(session.tokens)  # the prompt and every generated token but the last (never run)
        assert held == first.result.prompt_tokens + first.result.tokens[:-1]
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And of Italy?"}]
        second = model.chat(messages, max_new_tokens=10, session=session)
        "".join(second)
        prompt = second.result.prompt_tokens
        reused = second.result.timings["prompt_tokens_reused"]
        common = next(i for i, (x, y) in enumerate(zip(held + [-1], prompt)) if x != y)
        assert reused == common > len(first.result.prompt_tokens)
        assert session.tokens[:len(prompt)] == prompt  # the rest of the first turn was dropped
        # greedy tokens are what a fresh generation of the whole second prompt chooses
        fresh = model.generate(prompt, max_new_tokens=10)
        "".join(fresh)
        assert second.result.tokens == fresh.result.tokens
    assert session.cache is None  # the with block closed it; the generations did not


def test_a_session_of_another_model_is_refused(smollm2_checkpoint):
    with edge.load(str(smollm2_checkpoint)) as one, edge.load(str(smollm2_checkpoint)) as other:
        with other.session(capacity=16) as session:
            with pytest.raises(InvalidArgumentError, match="the session belongs to another model"):
                "".join(one.generate("Hi", max_new_tokens=1, session=session))
        with pytest.raises(InvalidArgumentError, match="session must be a Session from model.session"):
            one.generate("Hi", session="yes")


def test_a_made_generation_moves_into_a_session_before_its_first_step(smollm2_checkpoint):
    """What the server does: a request's generation (checked, its grammar compiled) is made first and given
    a session when one is free; it then runs as generate(..., session=) would."""
    grammar = edge.Grammar.regex(r"[a-z ]{1,12}")
    with edge.load(str(smollm2_checkpoint)) as model, model.session(capacity=64) as session:
        expected = model.generate("The capital of France is", max_new_tokens=6, grammar=grammar)
        "".join(expected)
        generation = model.generate("The capital of France is", max_new_tokens=6, grammar=grammar)
        generation.run_in(session)
        "".join(generation)
        assert generation.result.tokens == expected.result.tokens
        assert session.tokens == generation.result.prompt_tokens + generation.result.tokens[:-1]
        with pytest.raises(SessionError, match="this generation has started already"):
            generation.run_in(session)
