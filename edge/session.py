"""Sessions: a KV cache plus the token history, driven by three task forms.

- NewPrefill:    the first `prefill(ids)` of a session
- AppendPrefill: a later `prefill(ids)`, placed after everything already in the cache
- DecodeRound:   `decode(token_id)`, one token through every layer
"""
from __future__ import annotations

import numpy as np

from edge.core.errors import SessionError, ZllmError
from edge.core.logits import check_finite_logits


def check_token_ids(ids, vocab_size: int, error: type[ZllmError] = SessionError) -> np.ndarray:
    """ids as an int64 vector [T], refused (`error`) unless they are integers in [0, vocab_size)."""
    ids = np.asarray(ids).reshape(-1)
    if ids.size and ids.dtype.kind not in "iu":
        raise error(f"token ids must be integers, got {ids.dtype} values such as {ids[0]!r}")
    ids = ids.astype(np.int64)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise error(f"token id {int(bad[0])} is outside the vocabulary [0, {vocab_size})")
    return ids


class Session:
    def __init__(self, model, capacity: int):
        self.model = model
        self.cache = model.transformer.new_cache(capacity)
        self.tokens: list[int] = []
        # NaN or infinite logits raise NumericalError; the diff tool turns this off, since it reports
        # a device that produces them as a divergence and names the layer where they began
        self.check_logits = True

    def _open_cache(self):
        """The KV cache, or a typed error once the session (or its model) is closed."""
        self.model.require_open()
        if self.cache is None:
            raise SessionError("the session is closed; open a new one with model.session()")
        return self.cache

    @property
    def position(self) -> int:
        """Number of tokens in the cache; the next token's position."""
        return self._open_cache().length

    @property
    def capacity(self) -> int:
        return self._open_cache().capacity

    def _run(self, ids, all_logits: bool, observer=None, next_token: bool = False) -> np.ndarray | int:
        """One forward pass, holding the model's forward lock: sessions of one model in several threads
        run one prefill or decode step at a time, each computing what it would compute alone."""
        with self.model.forward_lock:
            return self._run_locked(ids, all_logits, observer, next_token)

    def _run_locked(self, ids, all_logits: bool, observer, next_token: bool) -> np.ndarray | int:
        cache = self._open_cache()
        ids = check_token_ids(ids, self.model.spec.vocab_size)
        if ids.size == 0:
            raise SessionError("prefill needs at least one token id")
        cache.check_room(len(ids), self.model.spec.max_position_embeddings, self.model.session_ceiling())
        if cache.length == 0:
            self._begin_request()
        transformer = self.model.transformer
        start = cache.length
        if next_token:  # checks the logits where they are read (not on a device that picks the token itself)
            result = transformer.forward_next_token(ids, cache)
        else:
            result = transformer.forward(ids, cache, all_logits, observer)
        self.tokens.extend(int(i) for i in ids)  # they are in the cache, whatever the check finds
        if not next_token and self.check_logits:
            check_finite_logits(result, start if all_logits else start + len(ids) - 1, transformer.backend.name)
        return result

    def prefill(self, ids, all_logits: bool = False, observer=None) -> np.ndarray:
        """Run ids after the current history. Logits [V] for the last token, or [T, V] with all_logits."""
        return self._run(ids, all_logits, observer)

    def decode(self, token_id: int) -> np.ndarray:
        """Run one token; logits [V]."""
        return self._run([token_id], all_logits=False)  # a float or None is refused, not truncated

    def next_token(self, ids) -> int:
        """Run ids after the current history (a prefill, or one token: a decode round) and return the
        greedy next token, the argmax of the last logits (ties to the lowest id). Devices that can pick
        it themselves (gpu) read back one id instead of the logits."""
        return self._run(ids, all_logits=False, next_token=True)

    def save(self, path) -> None:
        """Write the KV state, position and token history to `path` (edge/saved_session.py);
        `model.load_session(path)` continues from it without a prefill."""
        from edge.saved_session import save_session

        self._open_cache()
        save_session(self, path)

    def _begin_request(self) -> None:
        """A new request starts: an expert source restarts its per-request statistics (the predictor's
        frequencies within the request); its cache and what the predictor learned stay."""
        if self.model.experts is not None:
            self.model.experts.begin_request()

    def close(self) -> None:
        """Free the KV cache and give its positions back to the model's memory budget (again: nothing)."""
        self.cache = None
        self.model.release_session(self)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reset(self) -> None:
        self._open_cache().length = 0
        self.tokens.clear()
