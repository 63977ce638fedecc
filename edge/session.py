"""Sessions: a KV cache plus the token history, driven by three task forms.

- NewPrefill:    the first `prefill(ids)` of a session
- AppendPrefill: a later `prefill(ids)`, placed after everything already in the cache
- DecodeRound:   `decode(token_id)`, one token through every layer
"""
from __future__ import annotations

import numpy as np

from edge.core.arguments import flag, integer, is_integer, shown
from edge.core.errors import InvalidArgumentError, SessionError, ZllmError
from edge.core.logits import check_finite_logits


def check_token_ids(ids, vocab_size: int, error: type[ZllmError] = SessionError) -> np.ndarray:
    """ids (one id, a list of ids or a 1-D integer array) as an int64 vector [T]. What is not a
    sequence of integers is refused as an argument (InvalidArgumentError); an id outside
    [0, vocab_size) as `error`."""
    if isinstance(ids, (str, bytes, bytearray, memoryview)):  # characters and bytes are not token ids
        raise InvalidArgumentError(f"token ids must be integers, got {type(ids).__name__} {shown(ids)}")
    try:
        array = np.asarray(ids)
    except ValueError:  # nested lists of different lengths
        raise InvalidArgumentError(f"token ids must be one flat sequence of integers, got {shown(ids)}") from None
    if array.ndim > 1:  # a batch, or a row of one: which sequence was meant is not guessed
        raise InvalidArgumentError(f"token ids must be one sequence (a list or a 1-D array), got an array of "
                                   f"shape {array.shape}")
    array = array.reshape(-1)
    if array.dtype == object:  # ints beyond int64, or values of several types
        odd = [value for value in array if not is_integer(value)]
        if odd:
            raise InvalidArgumentError(f"token ids must be integers, got object values such as {shown(odd[0])}")
        outside = [int(value) for value in array if not 0 <= value < vocab_size]
        if outside:
            raise error(f"token id {outside[0]} is outside the vocabulary [0, {vocab_size})")
        return array.astype(np.int64)
    if array.size == 0:  # of any dtype (np.asarray([]) is float64): the caller says what it needs
        return np.zeros(0, dtype=np.int64)
    if array.dtype.kind not in "iu":
        raise InvalidArgumentError(f"token ids must be integers, got {array.dtype} values such as {shown(array[0])}")
    bad = array[(array < 0) | (array >= vocab_size)]  # compared before the cast: a uint64 id may exceed int64
    if bad.size:
        raise error(f"token id {int(bad[0])} is outside the vocabulary [0, {vocab_size})")
    return array.astype(np.int64)


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
        return self._run(ids, flag("all_logits", all_logits), observer)

    def decode(self, token_id: int) -> np.ndarray:
        """Run one token; logits [V]."""
        if isinstance(token_id, (list, tuple, range)) or getattr(token_id, "ndim", 0) != 0:
            raise InvalidArgumentError(f"decode takes one token id (an int), got {shown(token_id)}; "
                                       "run several with prefill")
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

    def rewind(self, length: int) -> None:
        """Keep the first `length` tokens of the history and their KV, drop the rest: the next prefill
        continues after them. A sliding-window layer whose ring buffer has wrapped no longer holds
        what came before its window: SessionError then (start again with reset())."""
        cache = self._open_cache()
        length = integer("length", length, minimum=0, maximum=cache.length)
        if cache.kept_prefix(length) != length:
            raise SessionError(f"the session cannot go back to position {length}: a sliding-window layer has "
                               f"overwritten what it held there ({cache.length} positions written); reset() it")
        cache.length = length
        del self.tokens[length:]

    def reusable_prefix(self, ids) -> int:
        """How many of ids' first tokens this session holds already and can continue from (rewind), at
        most all but the last: a prefill needs one token to give the next token's logits."""
        cache = self._open_cache()
        common = 0
        for held, new in zip(self.tokens, ids[:-1]):
            if held != new:
                break
            common += 1
        return cache.kept_prefix(common)
