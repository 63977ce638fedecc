"""Constrained decoding: a grammar masks the logits before each token is chosen, so that the generated text
is a sentence of its language (any JSON object, JSON that validates against a schema, a regular expression,
a Lark grammar). The grammar engine is llguidance: it compiles the grammar against the model's own
vocabulary and, at each step, says which tokens may come next (the end-of-generation token only where the
text is complete).

    grammar = Grammar.json_schema({"type": "object", "properties": {"name": {"type": "string"}}})
    model.generate(prompt, grammar=grammar)

A Grammar is only a description; `Grammar.start(model)` compiles it into a Constraint for one generation,
and refuses a grammar llguidance cannot compile with GrammarError carrying its reason.
"""
from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from edge.core.errors import InvalidArgumentError, ZllmError


class GrammarError(InvalidArgumentError):
    """A grammar that cannot be used: not valid, or not compilable against the model's vocabulary."""

KINDS = ("json_object", "json_schema", "regex", "lark")
# JSON as the model writes it: no whitespace beyond single spaces, so that a small model cannot wander off
# into endless indentation
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    kind: str    # one of KINDS
    source: str  # the schema as JSON text, the regular expression, or the Lark grammar

    @classmethod
    def json_object(cls) -> "Grammar":
        """Any JSON object."""
        return cls("json_object", json.dumps({"type": "object"}))

    @classmethod
    def json_schema(cls, schema) -> "Grammar":
        """JSON that validates against `schema` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema is an object (or true/false), got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError(f"a regular expression is a non-empty string, got {pattern!r}")
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> "Grammar":
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError(f"a Lark grammar is a non-empty string, got {grammar!r}")
        return cls("lark", grammar)

    def _llguidance_grammar(self, matcher_class) -> str:
        if self.kind in ("json_object", "json_schema"):
            try:
                return matcher_class.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)
            except ValueError as exc:
                raise GrammarError(f"the JSON schema cannot be used: {exc}") from None
        if self.kind == "regex":
            return matcher_class.grammar_from_regex(self.source)
        return matcher_class.grammar_from_lark(self.source)

    def start(self, model) -> "Constraint":
        """This grammar compiled against the model's vocabulary, at the start of a generation."""
        from llguidance import LLMatcher

        grammar = self._llguidance_grammar(LLMatcher)
        matcher = LLMatcher(_vocabulary(model), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {self.kind.replace('_', ' ')} grammar cannot be compiled: "
                                       f"{matcher.get_error()}")
        return Constraint(matcher, model.spec.vocab_size)


# by tokenizer object, kept while it lives (an id() could name the next model's tokenizer once one is freed)
_vocabularies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_vocabularies_lock = threading.Lock()


def _vocabulary(model):
    """llguidance's view of the model's tokenizer, built once per tokenizer (it takes a second or two)."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise InvalidArgumentError(f"{model.path} has no tokenizer, and a grammar constrains text; convert the "
                                   "model from a source that has one")
    with _vocabularies_lock:
        vocabulary = _vocabularies.get(tokenizer)
        if vocabulary is None:
            from llguidance import LLTokenizer

            ends = sorted(model.eog_token_ids) or None
            vocabulary = LLTokenizer(tokenizer.to_json(), n_vocab=model.spec.vocab_size, eos_token=ends)
            _vocabularies[tokenizer] = vocabulary
        return vocabulary


class Constraint:
    """One generation's grammar state: `allowed()` before a token is chosen, `advance(token)` after."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self._vocab_size = vocab_size

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the tokens the grammar allows next."""
        bias = np.frombuffer(self._matcher.compute_logit_bias(), np.uint8)
        allowed = np.zeros(self._vocab_size, bool)
        n = min(len(bias), self._vocab_size)
        allowed[:n] = bias[:n] > 0
        if not allowed.any():
            raise ZllmError(f"the grammar allows no next token: {self._matcher.get_error() or 'a dead end'}")
        return allowed

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """The logits with every token the grammar does not allow at -inf (a copy)."""
        masked = np.where(self.allowed(), logits, np.float32(-np.inf)).astype(np.float32, copy=False)
        return masked

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(int(token)):
            raise ZllmError(f"the grammar refused token {token}: {self._matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The text is complete and the grammar allows nothing more (the generation ends here)."""
        return self._matcher.is_stopped()
