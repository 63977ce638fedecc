"""Choosing the next token from logits: greedy, or temperature / top-k / top-p / min-p sampling,
with an optional repetition penalty (the CTRL/transformers form)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge.core.arguments import integer, number


# What a conversation samples with when its caller sets nothing (`zllm-edge chat`, the server): the
# defaults of llama.cpp and Ollama. A small model decoded greedily tends to loop.
CONVERSATION_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0      # 0 means greedy
    top_k: int = 0                # 0 means no limit
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0            # 0 means no limit

    def __post_init__(self) -> None:
        # InvalidArgumentError (also a ValueError) before any work; nan would pass `< 0` and reach numpy
        checked = {
            "temperature": number("temperature", self.temperature, minimum=0, note=" (0 = greedy)"),
            "top_k": integer("top_k", self.top_k, minimum=0, note=" (0 = no limit)"),
            # 0 keeps only the most likely token, as llama.cpp's and transformers' top-p do (min_keep 1)
            "top_p": number("top_p", self.top_p, minimum=0, maximum=1, note=" (1 = no limit)"),
            "repetition_penalty": number("repetition_penalty", self.repetition_penalty, above=0,
                                         note=" (1 = none)"),
            "min_p": number("min_p", self.min_p, minimum=0, maximum=1, note=" (0 = no limit)"),
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
    with np.errstate(over="ignore"):  # an extreme penalty makes +-inf, which sample_token takes
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
    # -inf (probability 0) instead of inf - inf = nan; the limit of T -> 0 is greedy (ties shared).
    # A tiny repetition penalty can push a logit to +-inf: equal to the best (inf too) it shifts to 0.
    candidates, best = logits[order], logits[order[0]]
    with np.errstate(over="ignore", invalid="ignore"):
        shifted = np.where(candidates == best, 0.0, candidates - best)
        probs = np.exp(shifted / params.temperature)
    probs /= probs.sum()
    if params.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1)
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    if params.min_p > 0.0:
        # keep the tokens at least min_p times as likely as the most likely one (llama.cpp's min-p)
        keep = int(np.count_nonzero(probs >= params.min_p * probs[0]))
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return int(order[rng.choice(len(order), p=probs)])
