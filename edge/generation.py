"""Streaming generation: prompt in, text pieces out as they are produced."""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import numpy as np

from edge.core.arguments import integer, shown
from edge.core.errors import InvalidArgumentError, SessionError
from edge.constrained import Constraint, Grammar
from edge.sampling import SamplingParams, sample_token
from edge.tokenizer import IncrementalDecoder

RANDOM_SEED = -1  # llama.cpp's --seed -1: a fresh seed from the operating system's entropy


@dataclass
class GenerationResult:
    """`tokens` are every id the model generated, as llama.cpp's `tokens` (return_tokens) are: the
    token that completed a stop string stays, since the model produced it and it is in the KV cache.
    `text` ends where the stop string begins (the stop string and what followed it in that token are
    not part of it), and `stop_string` names the one that matched, as llama.cpp's `stopping_word`."""

    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "eos", "stop", "length"
    stop_string: str | None = None
    seed: int | None = None  # the sampler's seed, the one drawn for seed None / -1 too: pass it to sample again
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # the model's decode steps (forward and sampling), not the consumer's time
    prompt_tokens_reused: int = 0  # the prompt's first tokens whose KV a continued session held already

    @property
    def timings(self) -> dict:
        n_decoded = max(len(self.tokens) - 1, 0)  # the first token comes from the prefill
        return {
            "prefill_seconds": self.prefill_seconds,
            # the tokens this prefill computed: a continued session's reused prefix is not among them
            "prefill_tokens_per_second": (len(self.prompt_tokens) - self.prompt_tokens_reused) / self.prefill_seconds
            if self.prefill_seconds else None,
            "prompt_tokens_reused": self.prompt_tokens_reused,
            "decode_seconds": self.decode_seconds,
            "decode_tokens_per_second": n_decoded / self.decode_seconds if self.decode_seconds else None,
            "time_to_first_token_seconds": self.prefill_seconds,
        }


def _stop_strings(stop) -> tuple[str, ...]:
    """None, one string, or a list of strings; a single str is one stop string, not its characters."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    try:
        strings = list(stop)
    except TypeError:
        raise InvalidArgumentError(f"stop must be a string or a list of strings, got {shown(stop)}") from None
    for s in strings:
        if not isinstance(s, str):
            raise InvalidArgumentError(f"stop must be a string or a list of strings, got {shown(s)} in {shown(stop)}")
        try:  # a lone surrogate (a byte that is not UTF-8 on the command line) could never match decoded text
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgumentError(f"stop string {shown(s)} is not valid Unicode (it holds a lone surrogate, such as "
                                       "a byte that is not UTF-8 on the command line); give UTF-8 text") from None
    return tuple(s for s in strings if s)


@dataclass(frozen=True)
class GenerationOptions:
    """What a generation is asked for, checked when made (InvalidArgumentError): the CLI makes one
    before it converts or loads a model, Model.generate before it opens a session."""

    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None  # None or -1: a random seed
    stop: tuple[str, ...] = ()
    grammar: Grammar | None = None  # the language the text must belong to (edge/constrained.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_new_tokens", integer("max_new_tokens", self.max_new_tokens, minimum=0))
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise InvalidArgumentError(f"grammar must be an edge.Grammar (Grammar.json_schema(...), .json_object(), "
                                       f".regex(...), .lark(...)), got {type(self.grammar).__name__}")
        if self.seed is not None:
            seed = integer("seed", self.seed, minimum=RANDOM_SEED, note=f" ({RANDOM_SEED}: a random seed)")
            object.__setattr__(self, "seed", None if seed == RANDOM_SEED else seed)
        object.__setattr__(self, "stop", _stop_strings(self.stop))

    @classmethod
    def of(cls, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           repetition_penalty: float = 1.0, seed: int | None = None, stop=None, min_p: float = 0.0,
           grammar: Grammar | None = None) -> "GenerationOptions":
        """From Model.generate's keyword arguments."""
        return cls(max_new_tokens, SamplingParams(temperature, top_k, top_p, repetition_penalty, min_p), seed, stop,
                   grammar)


@dataclass(frozen=True)
class Step:
    """One step of a generation: the token produced (None for text released at the end) and
    the text that became final with it (often "", while a character or a stop string is pending)."""

    token: int | None
    text: str


class Generation:
    """Iterate it for text pieces, or `steps()` for (token, text) pairs; `result` holds ids,
    text and timings once it is exhausted. `close()` (or leaving a `with` block, or dropping the
    last reference) ends it early and frees its session's KV cache at once."""

    def __init__(self, model, prompt_ids: list[int], options: GenerationOptions, session=None):
        if len(prompt_ids) == 0:
            raise InvalidArgumentError("the prompt is empty; give some text or at least one token id")
        limit, what = model.generation_limit()
        if len(prompt_ids) > limit:
            raise SessionError(f"the prompt has {len(prompt_ids)} tokens, more than {what}")
        self.model = model
        self.options = options
        self.result = GenerationResult(prompt_tokens=list(prompt_ids))
        capacity = min(len(prompt_ids) + options.max_new_tokens, limit)
        # compiled now, so that a grammar that cannot be is refused by this call, before any session opens
        self._constraint = options.grammar.start(model) if options.grammar is not None else None
        # The loop is a module-level generator that does not refer to this object: no reference cycle,
        # so an abandoned generation is closed (and its session with it) as soon as it is dropped,
        # not when the garbage collector next runs, which a memory budget's next session cannot wait for.
        if session is None:
            self._steps = _generate(model, self.result, options, capacity, self._constraint)
        else:
            self._steps = _continue(model, session, self.result, options, self._constraint)

    def run_in(self, session) -> None:
        """Generate in `session` (as generate(..., session=) does: the prompt's first tokens it holds keep their
        KV) instead of a session of its own; the checks and the compiled grammar stay. Only before the first step."""
        if inspect.getgeneratorstate(self._steps) != inspect.GEN_CREATED:
            raise SessionError("this generation has started already; run_in() must come before its first step")
        self._steps = _continue(self.model, session, self.result, self.options, self._constraint)

    def steps(self):
        return self._steps

    def __iter__(self):
        return (step.text for step in self._steps if step.text)

    def close(self) -> None:
        """Stop generating and close the session (its KV positions go back to the budget)."""
        self._steps.close()

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stop_hit(text: str, stop: tuple[str, ...]) -> tuple[int, str] | None:
    """(where the earliest stop string in text begins, that string), or None."""
    hits = [(text.find(s), s) for s in stop if s in text]
    return min(hits) if hits else None


def _held_back(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest tail of text that could still grow into a stop string."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if s.startswith(text[-n:]):
                longest = n
                break
    return longest


def _generate(model, result: GenerationResult, options: GenerationOptions, capacity: int, constraint: Constraint | None):
    if options.max_new_tokens == 0:  # nothing to compute: no session, no KV reservation
        result.finish_reason = "length"
        return
    with model.session(capacity=capacity) as session:
        yield from _run(model, session, result, options, constraint)


def _continue(model, session, result: GenerationResult, options: GenerationOptions, constraint: Constraint | None):
    """Generate in the caller's session, which stays open: the prompt's first tokens that the session holds
    already keep their KV (a conversation's earlier turns), the rest of its history is dropped."""
    if session.model is not model:
        raise InvalidArgumentError("the session belongs to another model; open one with this model's session()")
    reused = session.reusable_prefix(result.prompt_tokens)
    session.rewind(reused)
    result.prompt_tokens_reused = reused
    if options.max_new_tokens == 0:
        result.finish_reason = "length"
        return
    yield from _run(model, session, result, options, constraint)


def _run(model, session, result: GenerationResult, options: GenerationOptions, constraint: Constraint | None):
    params, stop = options.sampling, options.stop
    # a random seed is drawn here and reported (llama.cpp prints its own), so that any run can be repeated
    result.seed = options.seed if options.seed is not None else int(np.random.SeedSequence().generate_state(1)[0])
    rng = np.random.default_rng(result.seed)
    decoder = IncrementalDecoder(model.tokenizer, result.prompt_tokens) if model.tokenizer else None
    history = np.asarray(result.prompt_tokens, dtype=np.int64)
    # plain greedy decoding needs only each step's argmax, which a device may pick without
    # returning the logits; sampling, the repetition penalty and a grammar's mask need the logits.
    greedy = params.temperature == 0.0 and params.repetition_penalty == 1.0 and constraint is None

    def step(ids) -> int:
        """Run ids through the model and choose the next token."""
        if greedy:
            return session.next_token(ids)
        logits = session.prefill(ids)
        if constraint is not None:
            logits = constraint.mask(logits)
        seen = np.concatenate([history, np.asarray(result.tokens, dtype=np.int64)])
        return sample_token(logits, params, rng, seen)

    emitted = 0  # characters of result.text already released
    started = time.perf_counter()
    token = step(result.prompt_tokens[result.prompt_tokens_reused:])
    result.prefill_seconds = time.perf_counter() - started
    while True:
        result.tokens.append(token)
        if constraint is not None:
            constraint.advance(token)
        if token in model.eog_token_ids:
            result.finish_reason = "eos"
            break
        released = ""
        if decoder is not None:
            result.text += decoder.push(token)
            hit = _stop_hit(result.text, stop)
            if hit is not None:
                result.text, result.stop_string = result.text[:hit[0]], hit[1]
                result.finish_reason = "stop"
                break
            ready = len(result.text) - _held_back(result.text, stop)
            if ready > emitted:
                released, emitted = result.text[emitted:ready], ready
        yield Step(token, released)  # outside the timed regions: the consumer's time is not the model's
        if len(result.tokens) >= options.max_new_tokens or session.position >= session.capacity:
            result.finish_reason = "length"
            break
        if constraint is not None and constraint.finished:  # the text is complete: nothing may follow
            result.finish_reason = "stop"
            break
        started = time.perf_counter()
        token = step([token])
        result.decode_seconds += time.perf_counter() - started
    yield Step(None, result.text[emitted:])
