"""Sessions: a KV cache plus the token history, driven by three task forms.

- NewPrefill:    the first `prefill(ids)` of a session
- AppendPrefill: a later `prefill(ids)`, placed after everything already in the cache
- DecodeRound:   `decode(token_id)`, one token through every layer
"""
from __future__ import annotations

import numpy as np

from edge.errors import SessionError


class Session:
    def __init__(self, model, capacity: int):
        self.model = model
        self.cache = model.transformer.new_cache(capacity)
        self.tokens: list[int] = []

    @property
    def position(self) -> int:
        """Number of tokens in the cache; the next token's position."""
        return self.cache.length

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def _run(self, ids, all_logits: bool, observer=None, next_token: bool = False) -> np.ndarray | int:
        ids = np.asarray(ids).reshape(-1)
        if ids.size and ids.dtype.kind not in "iu":
            raise SessionError(f"token ids must be integers, got {ids.dtype} values such as {ids[0]!r}")
        ids = ids.astype(np.int64)
        if ids.size == 0:
            raise SessionError("prefill needs at least one token id")
        vocab = self.model.spec.vocab_size
        bad = ids[(ids < 0) | (ids >= vocab)]
        if bad.size:
            raise SessionError(f"token id {int(bad[0])} is outside the vocabulary [0, {vocab})")
        self.cache.check_room(len(ids), self.model.spec.max_position_embeddings)
        if self.cache.length == 0:
            self._begin_request()
        transformer = self.model.transformer
        if next_token:
            result = transformer.forward_next_token(ids, self.cache)
        else:
            result = transformer.forward(ids, self.cache, all_logits, observer)
        self.tokens.extend(int(i) for i in ids)
        return result

    def prefill(self, ids, all_logits: bool = False, observer=None) -> np.ndarray:
        """Run ids after the current history. Logits [V] for the last token, or [T, V] with all_logits."""
        return self._run(ids, all_logits, observer)

    def decode(self, token_id: int) -> np.ndarray:
        """Run one token; logits [V]."""
        return self._run([int(token_id)], all_logits=False)

    def next_token(self, ids) -> int:
        """Run ids after the current history (a prefill, or one token: a decode round) and return the
        greedy next token, the argmax of the last logits (ties to the lowest id). Devices that can pick
        it themselves (gpu) read back one id instead of the logits."""
        return self._run(ids, all_logits=False, next_token=True)

    def save(self, path) -> None:
        """Write the KV state, position and token history to `path` (edge/saved_session.py);
        `model.load_session(path)` continues from it without a prefill."""
        from edge.saved_session import save_session

        save_session(self, path)

    def _begin_request(self) -> None:
        """A new request starts: an expert source restarts its per-request statistics (the predictor's
        frequencies within the request); its cache and what the predictor learned stay."""
        begin = getattr(self.model.transformer.experts, "begin_request", None)
        if begin is not None:
            begin()

    def close(self) -> None:
        """Free the KV cache and give its positions back to the model's memory budget."""
        self.cache = None
        self.model.release_session(self)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reset(self) -> None:
        self.cache.length = 0
        self.tokens.clear()
