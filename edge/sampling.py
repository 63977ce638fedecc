"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling,
with an optional repetition penalty (the CTRL/transformers form)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge.core.arguments import integer, number


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0      # 0 means greedy
    top_k: int = 0                # 0 means no limit
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        # InvalidArgumentError (also a ValueError) before any work; nan would pass `< 0` and reach numpy
        checked = {
            "temperature": number("temperature", self.temperature, minimum=0, note=" (0 = greedy)"),
            "top_k": integer("top_k", self.top_k, minimum=0, note=" (0 = no limit)"),
            # 0 keeps only the most likely token, as llama.cpp's and transformers' top-p do (min_keep 1)
            "top_p": number("top_p", self.top_p, minimum=0, maximum=1, note=" (1 = no limit)"),
            "repetition_penalty": number("repetition_penalty", self.repetition_penalty, above=0,
                                         note=" (1 = none)"),
        }
        for name, value in checked.items():  # plain Python numbers from here on (numpy scalars, ints)
            object.__setattr__(self, name, value)


def apply_repetition_penalty(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """Make already-seen tokens less likely: divide positive logits by the penalty, multiply negative ones."""
    if penalty == 1.0 or len(seen) == 0:
        return logits
    logits = logits.copy()
    ids = np.unique(seen)
    picked = logits[ids]
    logits[ids] = np.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
                 seen: np.ndarray | None = None) -> int:
    logits = np.asarray(logits, dtype=np.float64)
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.temperature == 0.0:
        return int(np.argmax(logits))
    order = np.argsort(-logits, kind="stable")  # candidates, most likely first
    if params.top_k:
        order = order[: params.top_k]
    # shifted by the best logit before the division: every value is <= 0, so a tiny temperature gives
    # -inf (probability 0) instead of inf - inf = nan; the limit of T -> 0 is greedy (ties shared)
    with np.errstate(over="ignore"):
        probs = np.exp((logits[order] - logits[order[0]]) / params.temperature)
    probs /= probs.sum()
    if params.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1)
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return int(order[rng.choice(len(order), p=probs)])
