"""Constrained decoding (edge/constrained.py): a grammar masks the logits, so the text is in its language;
and the min-p filter of the sampler. SmolLM2 on the cpu device, one thread."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

import edge
from edge import Grammar
from edge.constrained import GrammarError
from edge.core.errors import InvalidArgumentError
from edge.sampling import SamplingParams, sample_token

jsonschema = pytest.importorskip("jsonschema")

CITY = {"type": "object", "additionalProperties": False, "required": ["capital", "country", "coastal"],
        "properties": {"capital": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24},
                       "coastal": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def model(smollm2_checkpoint):
    with edge.load(str(smollm2_checkpoint), device="cpu", threads=1) as model:
        yield model


def test_a_json_schema_reply_parses_and_validates(model):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    generation = model.chat(messages, max_new_tokens=80, grammar=Grammar.json_schema(CITY))
    text = "".join(generation)
    reply = json.loads(text)
    jsonschema.validate(reply, CITY)
    assert generation.result.finish_reason in ("stop", "eos")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sampled_text_matches_a_regular_expression(model, seed):
    pattern = r" \d{3}-\d{4}\."
    generation = model.generate("Call me at", max_new_tokens=20, temperature=1.0, seed=seed,
                                grammar=Grammar.regex(pattern))
    text = "".join(generation)
    assert re.fullmatch(pattern, text), text
    assert generation.result.finish_reason in ("stop", "eos")


def test_any_json_object(model):
    generation = model.generate('The record, as JSON:', max_new_tokens=60, temperature=0.7, seed=5,
                                grammar=Grammar.json_object())
    text = "".join(generation)
    if generation.result.finish_reason != "length":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_new_tokens: a prefix of an object
        assert text.lstrip().startswith("{")


def test_a_grammar_keeps_sampling_reproducible(model):
    runs = ["".join(model.generate("Pick a word:", max_new_tokens=12, temperature=1.0, seed=9,
                                   grammar=Grammar.lark('start: " " WORD "."\nWORD: /[a-z]{2,10}/')))
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert re.fullmatch(r" [a-z]{2,10}\.", runs[0])


def test_grammars_that_cannot_be_used_are_refused_by_the_call(model):
    with pytest.raises(GrammarError, match=r"^the json schema grammar cannot be compiled: .*wat"):
        model.generate("x", grammar=Grammar.json_schema({"type": "wat"}))
    with pytest.raises(GrammarError, match=r"^the JSON schema is not valid JSON"):
        Grammar.json_schema("{not json")
    with pytest.raises(GrammarError, match=r"^the regex grammar cannot be compiled"):
        model.generate("x", grammar=Grammar.regex("("))
    with pytest.raises(InvalidArgumentError, match=r"^grammar must be an edge.Grammar .* got dict"):
        model.generate("x", grammar={"type": "object"})


def test_min_p_keeps_the_tokens_near_the_likeliest():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(temperature=1.0, min_p=0.5)  # keeps p >= 0.25: tokens 0 and 1
    rng = np.random.default_rng(0)
    drawn = {sample_token(logits, params, rng) for _ in range(400)}
    assert drawn == {0, 1}
    assert {sample_token(logits, SamplingParams(temperature=1.0, min_p=1.0), rng) for _ in range(50)} == {0}
    with pytest.raises(InvalidArgumentError, match=r"min_p must be a finite number in \[0, 1\] \(0 = no limit\), got 1.5"):
        SamplingParams(min_p=1.5)


def test_each_tokenizer_has_its_own_vocabulary_and_a_freed_one_is_forgotten(smollm2_checkpoint):
    """The grammar's view of a tokenizer is kept by the tokenizer object while it lives: a model loaded
    after another one is freed (whose tokenizer may take the freed one's address) builds its own."""
    import gc
    import weakref

    from edge import constrained

    def constrained_text():
        with edge.load(str(smollm2_checkpoint), device="reference") as model:
            text = "".join(model.generate("Call me at", max_new_tokens=12, grammar=Grammar.regex(r" \d{3}-\d{4}\.")))
            assert constrained._vocabularies.get(model.tokenizer) is not None
            return text, weakref.ref(model.tokenizer), len(constrained._vocabularies)

    first, tokenizer, held = constrained_text()
    gc.collect()
    assert tokenizer() is None and len(constrained._vocabularies) == held - 1
    assert constrained_text()[0] == first
