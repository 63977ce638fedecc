"""Streaming generation: prompt in, text pieces out as they are produced."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from edge.sampling import SamplingParams, sample_token
from edge.tokenizer import IncrementalDecoder


@dataclass
class GenerationResult:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "eos", "stop", "length"
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def timings(self) -> dict:
        n_decoded = max(len(self.tokens) - 1, 0)  # the first token comes from the prefill
        return {
            "prefill_seconds": self.prefill_seconds,
            "prefill_tokens_per_second": len(self.prompt_tokens) / self.prefill_seconds if self.prefill_seconds else None,
            "decode_seconds": self.decode_seconds,
            "decode_tokens_per_second": n_decoded / self.decode_seconds if self.decode_seconds else None,
            "time_to_first_token_seconds": self.prefill_seconds,
        }


@dataclass(frozen=True)
class Step:
    """One step of a generation: the token produced (None for text released at the end) and
    the text that became final with it (often "", while a character or a stop string is pending)."""

    token: int | None
    text: str


class Generation:
    """Iterate it for text pieces, or `steps()` for (token, text) pairs; `result` holds ids,
    text and timings once it is exhausted."""

    def __init__(self, model, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
                 seed: int | None, stop: list[str] | None):
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.params = params
        self.rng = np.random.default_rng(seed)
        self.stop = [s for s in (stop or []) if s]
        self.result = GenerationResult(prompt_tokens=list(prompt_ids))
        self._steps = self._generate()

    def steps(self):
        return self._steps

    def __iter__(self):
        return (step.text for step in self._steps if step.text)

    def _stop_hit(self, text: str) -> int | None:
        hits = [text.find(s) for s in self.stop if s in text]
        return min(hits) if hits else None

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of text that could still grow into a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if s.startswith(text[-n:]):
                    longest = n
                    break
        return longest

    def _generate(self):
        capacity = min(len(self.result.prompt_tokens) + self.max_new_tokens, self.model.spec.max_position_embeddings)
        with self.model.session(capacity=capacity) as session:
            yield from self._run(session)

    def _run(self, session):
        model, result = self.model, self.result
        tokenizer = model.tokenizer
        decoder = IncrementalDecoder(tokenizer, result.prompt_tokens) if tokenizer else None
        emitted = 0  # characters of result.text already released
        if self.max_new_tokens == 0:
            result.finish_reason = "length"
            return
        # plain greedy decoding needs only each step's argmax, which a device may pick without
        # returning the logits; sampling and the repetition penalty need the logits.
        # `outcome` of a step: the next token (greedy) or the logits to sample it from
        greedy = self.params.temperature == 0.0 and self.params.repetition_penalty == 1.0
        started = time.perf_counter()
        outcome = session.next_token(result.prompt_tokens) if greedy else session.prefill(result.prompt_tokens)
        result.prefill_seconds = time.perf_counter() - started
        decode_started = None
        history = np.asarray(result.prompt_tokens, dtype=np.int64)
        while True:
            if greedy:
                token = outcome
            else:
                seen = np.concatenate([history, np.asarray(result.tokens, dtype=np.int64)])
                token = sample_token(outcome, self.params, self.rng, seen)
            result.tokens.append(token)
            if token in model.eog_token_ids:
                result.finish_reason = "eos"
                break
            released = ""
            if decoder is not None:
                result.text += decoder.push(token)
                cut = self._stop_hit(result.text)
                if cut is not None:
                    result.text = result.text[:cut]
                    result.finish_reason = "stop"
                    break
                ready = len(result.text) - self._held_back(result.text)
                if ready > emitted:
                    released, emitted = result.text[emitted:ready], ready
            yield Step(token, released)
            if len(result.tokens) >= self.max_new_tokens or session.position >= session.capacity:
                result.finish_reason = "length"
                break
            if decode_started is None:
                decode_started = time.perf_counter()
            outcome = session.next_token([token]) if greedy else session.decode(token)
        if decode_started is not None:
            result.decode_seconds = time.perf_counter() - decode_started
        yield Step(None, result.text[emitted:])
