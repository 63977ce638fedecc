"""StreamingExperts: the ExpertSource that streams experts from SSD through a bounded cache.

T = tokens, A = active experts per token, E = routed experts of a layer.

For each MoE layer the model calls `experts(layer, ids [T, A], residual [T, D])`:
  1. the experts this layer needs are pinned: a cached one is a hit, one being loaded (a prefetch
     in flight) is a hit the call may wait for, anything else is a miss loaded on demand ahead of
     every prefetch;
  2. the predictor sees the real route (it learns from it and keeps its precision/recall), then
     forecasts layers L+1..L+depth; their likeliest experts are queued as prefetches, as many as
     the cache holds beside the experts pinned for this layer;
  3. the call returns at once: a lookup of an expert waits for its load (reading a queued miss in
     the calling thread rather than waiting for a pool thread), and `ready_run` tells a consumer
     how many experts in ascending id order it can have without waiting, so the model computes
     with the experts that are loaded while the rest arrive; waiting and reading misses count as
     I/O stall.
Pins are released at the next call, when the model has finished with this layer's weights.

A layer whose route needs more distinct experts than the cache holds (a long prefill under a small
budget) gets a rolling window: the first experts in ascending id order are loaded up front, and
handing out a later one releases the earliest one handed out. The MoE block uses each expert's
weights right after it gets them, in ascending id order (edge/moe.py `expert_mixture`).

Whatever path loaded an expert, its weights are the same bytes decoded the same way, so results are
bit-identical to the all-resident run.
"""
from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np

from edge.core.errors import ZllmError
from edge.core.moe import ChosenExperts, ExpertWeights, MoeConfig, distinct_experts
from quant.expert_file import ExpertIndex
from streaming.cache import FAILED, LOADING, READY, Entry, ExpertCache, make_policy
from streaming.options import check_io_engine
from streaming.prefetch import LOAD_BATCH, RingLoader, ThreadLoader
from streaming.stats import StreamingCounters
from streaming.store import ExpertStore

# Prefetch set per layer ahead: the predictor's likeliest ceil(top_k x tokens x PREFETCH_WIDTH) experts.
# On the MoEfied SmolLM2 (top-12 of 16) at a 50% cache, 1.25 instead of 1.0 cut demand misses by 25-60%
# and I/O stall by half, but read 15-20% more bytes; on a 2-core machine the extra loads' CPU time cost
# more decode speed than the stall saved, so the default prefetches the layer's top_k per token.
PREFETCH_WIDTH = 1.0


class Lookahead:
    """How many MoE layers ahead prefetches reach: between 1 and `most` (the predictor's depth), set
    again every WINDOW decode passes from the share of their time the model waited for experts.
    Looking further ahead hides slow reads (large experts, a slow disk), and it reads experts the model
    may not use, which costs cache room and the model thread's CPU: when little time is lost waiting,
    one layer less. (No one depth suits every model: small experts that arrive in time do best one
    layer ahead, large ones that do not, further; compare `zllm-edge bench --prefetch-depth N`.)"""

    RAISE_STALL = 0.20  # waiting more than this share of a window: one layer further
    LOWER_STALL = 0.10  # less than this: one layer nearer
    WINDOW = 4          # decode passes

    def __init__(self, most: int):
        self.most = most
        self.depth = most
        self.changes = 0
        self._passes, self._seconds, self._stall = 0, 0.0, 0.0

    def pass_done(self, seconds: float, stall_seconds: float) -> None:
        """A decode pass took `seconds`, `stall_seconds` of them waiting for experts."""
        self._passes += 1
        self._seconds += seconds
        self._stall += stall_seconds
        if self._passes < self.WINDOW:
            return
        share = self._stall / self._seconds if self._seconds > 0 else 0.0
        if share > self.RAISE_STALL and self.depth < self.most:
            self.depth += 1
            self.changes += 1
        elif share < self.LOWER_STALL and self.depth > 1:
            self.depth -= 1
            self.changes += 1
        self._passes, self._seconds, self._stall = 0, 0.0, 0.0


def expert_label(layer: int, expert: int) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}"


def prepared_expert(index: ExpertIndex, prepare_weight, layer: int, expert: int, raw: np.ndarray) -> ExpertWeights:
    """Zero-copy views of a raw record, prepared for the backend."""
    weights = index.layout(layer).decode(raw, expert_label(layer, expert))
    return ExpertWeights(gate=prepare_weight(weights["gate_proj"]), up=prepare_weight(weights["up_proj"]),
                         down=prepare_weight(weights["down_proj"]))


class LayerPasses:
    """Where the model is in its forward passes over the MoE layers, for an expert source: a layer's
    position (pass * MoE layers + ordinal), the layers until one is computed again, and the lookahead's
    feedback at the end of each decode pass. A source says how long it has stalled in all."""

    def _start_passes(self, layers, predictor, depth: int) -> None:
        self.order = list(layers)
        self._ordinal = {layer: i for i, layer in enumerate(self.order)}
        self.predictor = predictor
        self.lookahead = Lookahead(depth) if predictor is not None else None
        self._pass, self._last_ordinal = 0, None
        self._pass_started, self._pass_stall, self._pass_tokens = time.monotonic(), 0.0, 0

    def _stall_seconds(self) -> float:
        raise NotImplementedError

    @property
    def depth(self) -> int:
        """MoE layers ahead the prefetches reach now (0 without a predictor)."""
        return self.lookahead.depth if self.lookahead is not None else 0

    @property
    def strategy(self) -> str:
        return "predictive" if self.predictor is not None else "ondemand"

    def forecast_path(self) -> str:
        """How the predictor forecasts a decode step (ExpertPredictor.forecast_path); "none" without one."""
        return self.predictor.forecast_path() if self.predictor is not None else "none"

    def _layers_until(self, layer: int) -> int:
        """MoE layers from the one running now until `layer` runs again (1..number of MoE layers)."""
        here = self._last_ordinal if self._last_ordinal is not None else -1
        return (self._ordinal[layer] - here) % len(self.order) or len(self.order)

    def _position(self, layer: int, n_tokens: int) -> int:
        if layer not in self._ordinal:
            raise ZllmError(f"layer {layer} is not a MoE layer of this model; MoE layers: {self.order}")
        ordinal = self._ordinal[layer]
        if self._last_ordinal is not None and ordinal <= self._last_ordinal:
            self._pass += 1  # a new forward pass started
            self._pass_done()
        self._last_ordinal = ordinal
        self._pass_tokens = max(self._pass_tokens, n_tokens)
        return self._position_now()

    def _position_now(self) -> int:
        """The position of the layer computed last."""
        return self._pass * len(self.order) + self._last_ordinal

    def _pass_done(self) -> None:
        """A forward pass ended: a decode pass (one token) tells the lookahead how long it waited."""
        now, stall = time.monotonic(), self._stall_seconds()
        if self.lookahead is not None and self._pass_tokens == 1:
            self.lookahead.pass_done(now - self._pass_started, stall - self._pass_stall)
        self._pass_started, self._pass_stall, self._pass_tokens = now, stall, 0

    def _next_pass_targets(self) -> list[int]:
        """The MoE layers of the next forward pass within `depth` layers of the one running now."""
        ahead = self._last_ordinal + self.depth - len(self.order)  # ordinals of the next pass reached
        return self.order[: max(0, ahead + 1)]


class StreamingExperts(LayerPasses):
    def __init__(self, index: ExpertIndex, prepare_weight, layers: dict[int, MoeConfig], cache_bytes: int,
                 storage=None, predictor=None, policy: str = "lru", depth: int = 2, threads: int = 2,
                 verify: bool = True, direct_io: bool = True, store: ExpertStore | None = None,
                 prefetch_width: float = PREFETCH_WIDTH, load_batch: int = LOAD_BATCH, io_engine: str = "auto",
                 expert_engine_reason: str = "expert_engine 'python' asked for"):
        self.index = index
        self._prepare_weight = prepare_weight
        self.layers = dict(sorted(layers.items()))
        self._start_passes(self.layers, predictor, depth)
        self.prefetch_width = prefetch_width
        self.store = store or ExpertStore(index, storage, verify=verify, direct_io=direct_io)
        self.cache = ExpertCache(cache_bytes, make_policy(policy, predictor.need_vector if predictor else None,
                                                          self._layers_until, len(self.layers),
                                                          lambda: self.prefetcher.position),
                                 on_buffer_dropped=self._forget_buffer)
        # Cache buffers are recycled, so the backend's prepared weights (descriptors pointing into a
        # buffer) are kept per buffer and layout and reused by the next expert read into that buffer:
        # preparing costs more CPU than the read itself.
        self._layout_signature = {layer: index.layout(layer).signature for layer in self.layers}
        self._prepared: dict[int, dict[tuple, ExpertWeights]] = {}  # buffer address -> layout -> weights
        self.io_engine_reason = self._engine_refusal(io_engine)
        if self.io_engine_reason is None:
            self.prefetcher = RingLoader(self.store, self.cache, self._prepare)
        else:
            self.prefetcher = ThreadLoader(self.store, self.cache, self._prepare, threads, load_batch)
        self.policy = policy
        self.expert_engine_reason = expert_engine_reason  # why the slot table (streaming/slots.py) does not serve
        self.counters = StreamingCounters()
        self._current: StreamedLayer | None = None

    def _engine_refusal(self, io_engine: str) -> str | None:
        """None when the loads go through io_uring, else why they go through reader threads."""
        if check_io_engine(io_engine) == "threads":
            return "io_engine 'threads' asked for"
        if self.index.compression is not None:
            reason = "compressed records are decompressed by the reader threads"
        else:
            from kernels.cpu.uring import unavailable_reason

            reason = unavailable_reason()
        if reason is not None and io_engine == "io_uring":
            raise ZllmError(f"io_engine 'io_uring' cannot run here: {reason}; use io_engine 'auto' or 'threads'")
        return reason

    def _prepare(self, layer: int, expert: int, raw: np.ndarray, address: int) -> ExpertWeights:
        """The backend's weights of the record `raw` read into the cache buffer at `address`."""
        by_layout = self._prepared.setdefault(address, {})
        signature = self._layout_signature[layer]
        weights = by_layout.get(signature)
        if weights is None:
            weights = by_layout[signature] = prepared_expert(self.index, self._prepare_weight, layer, expert, raw)
        return weights

    def _forget_buffer(self, address: int) -> None:
        """The cache gave the buffer at `address` back: drop the weights prepared on it, which would keep
        it alive."""
        self._prepared.pop(address, None)

    def _stall_seconds(self) -> float:
        return self.counters.stall_seconds

    def experts(self, layer: int, expert_ids: np.ndarray, residual: np.ndarray,
                router_logits: np.ndarray | None = None) -> Mapping[int, ExpertWeights]:
        position = self._position(layer, len(expert_ids))
        finished = self._current
        if finished is not None:
            finished.release()
        self.prefetcher.advance(position)
        if finished is not None:
            with self.cache.lock:
                self.cache.layer_done(finished.layer)
        ids = distinct_experts(expert_ids)
        room = self.cache.capacity_entries(self.store.buffer_bytes(layer))
        with self.cache.lock:
            self.cache.new_step()
        self._current = StreamedLayer(self, layer, ids, room)
        self.prefetcher.poll()  # this layer's misses go out before the forecast is made
        if self.predictor is not None:
            with self.cache.lock:  # eviction reads the predictor's need vectors under this lock
                forecast = self.predictor.observe_and_forecast(layer, expert_ids, residual, router_logits)
                self.cache.new_step()
                # The last layers of a pass also prefetch for the first layers of the next token, which
                # the gate lookahead cannot reach (another token's input): by the next-token estimate.
                forecast.update({first: self.predictor.need_vector(first) for first in self._next_pass_targets()})
            self._schedule(position, forecast, free_entries=room - len(ids), n_tokens=len(expert_ids))
            self.prefetcher.poll()
        return self._current

    def _schedule(self, position: int, forecast: dict[int, np.ndarray], free_entries: int, n_tokens: int) -> None:
        """Queue prefetches of the likeliest experts of the layers ahead, nearest layer first."""
        with self.cache.lock:
            self._schedule_locked(position, forecast, free_entries, n_tokens)

    def _schedule_locked(self, position: int, forecast: dict[int, np.ndarray], free_entries: int,
                         n_tokens: int) -> None:
        here = self._last_ordinal
        for target, need in sorted(forecast.items(), key=lambda item: self._layers_until(item[0])):
            distance = self._layers_until(target)
            if distance > self.depth or free_entries <= 0:
                continue
            next_pass = self._ordinal[target] <= here  # a decode step of one token follows this pass
            tokens = 1 if next_pass else n_tokens
            width = min(len(need), int(np.ceil(self.layers[target].top_k * tokens * self.prefetch_width)),
                        free_entries)
            likeliest = np.argsort(-need, kind="stable")[:width]
            scores = need[likeliest]
            if scores[-1] <= 0:
                likeliest, scores = likeliest[scores > 0], scores[scores > 0]  # (descending: a prefix)
            free_entries -= len(likeliest)  # cached ones too: each takes its share of the room
            cached = self.cache.by_layer.get(target, {})
            if len(cached) == len(need):
                continue  # every expert of the layer is cached already
            for expert, score in zip(likeliest.tolist(), scores.tolist()):
                if expert not in cached:  # (prefetch would skip it too)
                    self.prefetcher.prefetch((target, expert), position + distance, distance, score)

    def begin_token(self, embedding) -> None:
        """Before a decode step's layer 0: queue the first MoE layer's likeliest experts by the token's
        embedding (SlotExperts.begin_token)."""
        if self.predictor is None or self._last_ordinal is None:
            return
        pinned = len(self._current.ids) if self._current is not None else 0
        room = self.cache.capacity_entries(self.store.buffer_bytes(self.order[0]))
        with self.cache.lock:  # eviction reads the predictor's need vectors under this lock
            forecast = self.predictor.token_forecast(embedding())
        self._schedule(self._position_now(), forecast, room - pinned, n_tokens=1)
        self.prefetcher.poll()

    def begin_request(self) -> None:
        """A new request starts: the predictor restarts its per-request frequencies (the cache stays)."""
        if self.predictor is not None:
            with self.cache.lock:
                self.predictor.begin_request()

    def stats(self) -> dict:
        store, prefetch = self.store.stats(), self.prefetcher.stats()
        stats = self.counters.to_dict(io_seconds=prefetch["io_seconds"])
        stats.update({"expert_source": self.strategy, "expert_policy": self.policy,
                      "expert_engine": f"python cache: {self.expert_engine_reason}",
                      "io_engine_reason": self.io_engine_reason,
                      "bytes_read": store["bytes_read"], "io_mode": store["io_mode"], "storage": store["storage"],
                      "expert_cache_bytes": self.cache.capacity_bytes,
                      "expert_cache_peak_bytes": self.cache.peak_charged, "expert_evictions": self.cache.evictions,
                      "prefetches_evicted_unused": self.cache.unused_prefetches,
                      "prefetch_depth": self.lookahead.most if self.lookahead is not None else 0,
                      "prefetch_lookahead": self.depth,
                      "prefetch_lookahead_changes": self.lookahead.changes if self.lookahead is not None else 0,
                      **prefetch, "expert_reads": store["reads"],
                      "expert_read_calls": store["read_calls"], "expert_reads_again": store["reads_again"],
                      "emulated_wait_seconds": store["emulated_wait_seconds"]})
        if self.predictor is not None:
            stats.update(self.predictor.stats())
        else:
            stats.update({"predictor_precision": None, "predictor_recall": None})
        return stats

    def resize_cache(self, cache_bytes: int) -> None:
        """Experts past the new bound are evicted as the next ones are loaded."""
        with self.cache.lock:
            self.cache.capacity_bytes = int(cache_bytes)

    def close(self) -> None:
        if self._current is not None:
            self._current.release()
            self._current = None
        self.prefetcher.close()
        self.store.close()


class RouteWindow(ChosenExperts):
    """A route's experts (`ids`, ascending) of which at most `room` are pinned at once."""

    ids: list[int]
    room: int

    @property
    def window_size(self) -> int:
        """How many experts' weights stay valid together (edge/core/moe.py ExpertSource)."""
        return self.room

    def __iter__(self):
        return iter(self.ids)

    def __len__(self) -> int:
        return len(self.ids)


class StreamedLayer(RouteWindow):
    """The experts one layer's route needs: expert id -> ExpertWeights, loaded and pinned."""

    def __init__(self, source: StreamingExperts, layer: int, ids: list[int], room: int):
        self.source, self.layer, self.ids = source, layer, ids
        self.room = max(room, 1)
        self._entries: dict[int, Entry] = {}  # pinned, by expert
        self._ready: dict[int, ExpertWeights] = {}
        self._handed_out: list[int] = []
        try:
            with source.cache.lock:  # one hold for the layer, not one per expert
                self._entries, missing = source.cache.pin_cached(layer, ids[: self.room])
                source.counters.hits += len(self._entries)
                source.counters.late_prefetches += sum(entry.state == LOADING for entry in self._entries.values())
                for expert in missing:
                    self._acquire(expert)
        except BaseException:
            self.release()  # no pin may outlive a failed call
            raise

    def _acquire(self, expert: int) -> None:
        """Pin the expert's entry; a miss is queued ahead of every prefetch (`_wait` reads it if no
        loading thread has). The caller holds the cache's lock."""
        source = self.source
        entry, missed = source.prefetcher.demand((self.layer, expert))
        source.cache.touch(entry)
        if missed:
            source.counters.misses += 1
        else:
            source.counters.hits += 1
            source.counters.late_prefetches += entry.state != READY and entry.state != FAILED
        self._entries[expert] = entry

    def _wait(self, entry: Entry) -> None:
        if entry.state == LOADING:
            started = time.monotonic()
            self.source.prefetcher.wait_loaded(entry)
            self.source.counters.stall_seconds += time.monotonic() - started
        if entry.state == FAILED:
            cache = self.source.cache
            with cache.lock:
                cache.remove(entry)  # the next request reads it again
            self.release()
            raise entry.error

    def ready_run(self, ids: list[int], start: int) -> int:
        """How many of the experts ids[start:] (ascending, from this route) are loaded in a row,
        at least one: the call waits for ids[start] if it is not loaded yet. A consumer that mixes
        experts in ascending id order takes them run by run and computes with the loaded ones
        while the others are read."""
        self.source.prefetcher.poll()
        self[ids[start]]
        entries, n = self._entries, 1
        while start + n < len(ids):
            entry = entries.get(ids[start + n])
            if entry is None or entry.state != READY:
                break
            self._ready[ids[start + n]] = entry.weights
            n += 1
        return n

    def release(self) -> None:
        with self.source.cache.lock:
            for entry in self._entries.values():
                entry.pins -= 1
            self._entries.clear()
            self._ready = {}
            self.source.cache.lock.notify_all()

    def __getitem__(self, expert: int) -> ExpertWeights:
        weights = self._ready.get(expert)  # loaded and looked up before
        if weights is not None:
            return weights
        expert = int(expert)
        if expert not in self.ids:
            raise KeyError(f"layer {self.layer} expert {expert} is not in this route; it needs {self.ids}")
        entry = self._entries.get(expert)
        if entry is not None and self.room >= len(self.ids):  # every expert of the route is pinned
            self._wait(entry)
            self._ready[expert] = entry.weights
            return entry.weights
        if entry is None:  # rolling window: free the earliest expert already handed out
            if len(self._entries) >= self.room and self._handed_out:
                oldest = self._handed_out.pop(0)
                with self.source.cache.lock:
                    released = self._entries.pop(oldest, None)
                    if released is not None:
                        released.pins -= 1
                    self.source.cache.lock.notify_all()
            with self.source.cache.lock:
                self._acquire(expert)
            entry = self._entries[expert]
        self._wait(entry)
        if expert not in self._handed_out:
            self._handed_out.append(expert)
        return entry.weights
