"""The bounded expert cache, its eviction policies, the prefetcher and StreamingExperts on an expert file."""
from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest
from streaming_experts import raw_bytes, read_records_through_preadv, write_expert_file

from devices.reference import ReferenceBackend
from edge.core.errors import ZllmError
from edge.core.moe import MoeConfig
from streaming import store as store_module
from streaming.cache import (
    ENTRY_OVERHEAD,
    CyclePolicy,
    ExpertCache,
    ForecastPolicy,
    LfuPolicy,
    LruPolicy,
    NextUsePolicy,
)
from streaming.paging import MappedExperts
from streaming.source import StreamingExperts
from streaming.store import ExpertReadError, ExpertStore

BUFFER = 8192
ENTRY = BUFFER + ENTRY_OVERHEAD
LAYERS = {0: 6, 1: 6, 2: 6}


@pytest.fixture(scope="module")
def expert_file(tmp_path_factory):
    return write_expert_file(os.fspath(tmp_path_factory.mktemp("experts")), LAYERS)


def _fill(cache: ExpertCache, key, position: int = 0):
    with cache.lock:
        entry = cache.reserve(key, BUFFER, for_prefetch=False, position=position)
        cache.touch(entry)
        cache.mark_ready(entry, None)
    return entry


def test_cache_bound_is_never_exceeded():
    rng = np.random.default_rng(0)
    cache = ExpertCache(5 * ENTRY + 100)
    pinned = []
    for step in range(400):
        key = (int(rng.integers(3)), int(rng.integers(8)))
        with cache.lock:
            entry = cache.get(key)
            if entry is None:
                entry = cache.reserve(key, BUFFER, for_prefetch=bool(rng.integers(2)), position=step)
                if entry is None:
                    continue
                cache.mark_ready(entry, None)
            cache.touch(entry)
            if rng.random() < 0.3 and len(pinned) < 3:
                entry.pins += 1
                pinned.append(entry)
            elif pinned and rng.random() < 0.5:
                pinned.pop(0).pins -= 1
            assert cache.charged_bytes <= cache.capacity_bytes
            assert all(e.key in cache.entries for e in pinned)  # pinned entries were never evicted
    assert cache.peak_charged <= cache.capacity_bytes and cache.evictions > 0


def test_buffers_are_recycled():
    cache = ExpertCache(2 * ENTRY)
    first = _fill(cache, (0, 0)).buffer
    _fill(cache, (0, 1))
    third = _fill(cache, (0, 2))  # evicts (0, 0) and reuses its buffer
    assert third.buffer is first and cache.charged_bytes == 2 * ENTRY


def test_lru_evicts_least_recently_used():
    cache = ExpertCache(3 * ENTRY, LruPolicy())
    a, b, c = (_fill(cache, (0, e)) for e in range(3))
    with cache.lock:
        cache.touch(a)
    _fill(cache, (0, 3))
    assert set(cache.entries) == {(0, 0), (0, 2), (0, 3)}


def test_lfu_evicts_least_frequently_used_ties_by_lru():
    cache = ExpertCache(3 * ENTRY, LfuPolicy())
    a, b, c = (_fill(cache, (0, e)) for e in range(3))
    with cache.lock:
        for entry in (a, a, c, b):
            cache.touch(entry)  # a: 3 uses, b: 2, c: 2 (c used before b)
    _fill(cache, (0, 3))
    assert set(cache.entries) == {(0, 0), (0, 1), (0, 3)}


def test_forecast_evicts_lowest_need_ties_by_lru():
    need = {0: np.array([0.9, 0.1, 0.1, 0.5])}
    cache = ExpertCache(3 * ENTRY, ForecastPolicy(need.__getitem__))
    for e in range(3):
        _fill(cache, (0, e))
    _fill(cache, (0, 3))  # (0, 1) and (0, 2) tie on need; (0, 1) was used longer ago
    assert set(cache.entries) == {(0, 0), (0, 2), (0, 3)}


def test_cycle_evicts_the_layer_reached_last_ties_by_need():
    layers_until = {0: 3, 1: 1, 2: 2}  # the model runs layer 0 now: layer 1 comes next, layer 0 last
    need = {0: np.array([0.9, 0.2]), 1: np.array([0.0, 0.0]), 2: np.array([0.0])}
    cache = ExpertCache(4 * ENTRY, CyclePolicy(layers_until.__getitem__, need.__getitem__))
    for key in ((0, 0), (0, 1), (1, 0), (2, 0)):
        _fill(cache, key)
    _fill(cache, (1, 1))  # both experts of layer 0 are reached last; (0, 1) is needed less
    assert set(cache.entries) == {(0, 0), (1, 0), (2, 0), (1, 1)}


def test_nextuse_evicts_the_expert_needed_furthest_ahead():
    # three MoE layers in a cycle, visited as the streaming source does: at each step the model reaches
    # a layer, and the layer it has just finished is re-ranked
    here = {"position": 0, "layer": 0}
    layers_until = lambda layer: (layer - here["layer"]) % 3 or 3  # noqa: E731
    cache = ExpertCache(4 * ENTRY, NextUsePolicy(layers_until, 3, lambda: here["position"]))
    steps = [(0, [0, 1]), (1, [0]), (2, [0])] + [(layer, [0]) for layer in (0, 1, 2, 0, 1, 2)] + [(0, [])]
    for position, (layer, experts) in enumerate(steps):
        here.update(position=position, layer=layer)
        with cache.lock:
            if position:
                cache.layer_done(steps[position - 1][0])
            for expert in experts:
                entry = cache.entries.get((layer, expert)) or cache.reserve((layer, expert), BUFFER, False, position)
                cache.touch(entry)
                cache.mark_ready(entry, None)
    # Now at layer 0 (position 9), each layer visited 3 times. Expected next use, in layers from the
    # start: (0, 1), used once, 9 + 3 (1 - 2/5) / (2/5) = 13.5; (2, 0), used every time, 11 + 3 (1/5) / (4/5)
    # = 11.75; (1, 0) 10.75; (0, 0) 9.75 (the cycle order would evict (0, 0) first: its layer comes last).
    with cache.lock:
        for expert in (5, 4):  # prefetches for layer 1 (position 10): they are not evicted for each other
            cache.mark_ready(cache.reserve((1, expert), BUFFER, for_prefetch=True, position=9, needed_at=10), None)
    assert set(cache.entries) == {(0, 0), (1, 0), (1, 5), (1, 4)}
    with cache.lock:  # admission: a prefetch for position 11 would evict (1, 0), expected back at 10.75
        assert cache.reserve((2, 7), BUFFER, for_prefetch=True, position=9, needed_at=11) is None
    assert set(cache.entries) == {(0, 0), (1, 0), (1, 5), (1, 4)}
    _fill(cache, (2, 3), position=9)  # a demand load: the prefetches are expected at position 10
    assert set(cache.entries) == {(0, 0), (1, 5), (1, 4), (2, 3)}


def test_pinned_and_loading_entries_are_not_evicted():
    cache = ExpertCache(2 * ENTRY)
    pinned = _fill(cache, (0, 0))
    pinned.pins = 1
    with cache.lock:
        loading = cache.reserve((0, 1), BUFFER, for_prefetch=False, position=0)
        assert cache.reserve((0, 2), BUFFER, for_prefetch=True, position=0) is None  # nothing evictable now
        cache.mark_ready(loading, None)
        cache.mark_ready(cache.reserve((0, 2), BUFFER, for_prefetch=True, position=0), None)
    assert set(cache.entries) == {(0, 0), (0, 2)}
    with cache.lock:
        cache.entries[(0, 2)].pins = 1
        with pytest.raises(ZllmError) as error:
            cache.reserve((0, 3), BUFFER, for_prefetch=False, position=0)
    assert str(error.value) == (f"the expert cache ({2 * ENTRY} bytes) cannot hold layer 0 expert 3: {2 * ENTRY} "
                                "bytes are pinned by the layer being computed; raise memory_budget")


def test_prefetch_does_not_evict_unused_prefetches():
    cache = ExpertCache(2 * ENTRY)
    with cache.lock:
        for expert in range(2):
            entry = cache.reserve((1, expert), BUFFER, for_prefetch=True, position=5)
            entry.needed_at = 6  # loaded for a layer not reached yet
            cache.mark_ready(entry, None)
        assert cache.reserve((2, 0), BUFFER, for_prefetch=True, position=5) is None
        assert cache.reserve((2, 0), BUFFER, for_prefetch=True, position=7) is not None  # layer passed


def test_free_buffers_of_another_size_are_released_with_their_addresses():
    """Evicted buffers wait in a free list for an expert of their size and are reused as they are; when
    an expert of another size needs their room, they are released, and the owner of anything prepared
    on them is told their addresses."""
    dropped = []
    cache = ExpertCache(2 * ENTRY, on_buffer_dropped=dropped.append)
    first, second = _fill(cache, (0, 0)), _fill(cache, (0, 1))
    assert first.address == first.buffer.ctypes.data and second.address == second.buffer.ctypes.data
    with cache.lock:
        cache.remove(first)
        reused = cache.reserve((0, 2), BUFFER, for_prefetch=False, position=0)
        assert reused.buffer is first.buffer and reused.address == first.address and dropped == []
        cache.mark_ready(reused, None)
        cache.remove(reused)
        cache.remove(second)
        larger = cache.reserve((1, 0), 2 * BUFFER, for_prefetch=False, position=0)
    assert sorted(dropped) == sorted([first.address, second.address])
    assert larger.address == larger.buffer.ctypes.data and larger.buffer.nbytes == 2 * BUFFER
    assert cache.charged_bytes == 2 * BUFFER + ENTRY_OVERHEAD


def test_expert_larger_than_cache_is_refused():
    with pytest.raises(ZllmError) as error:
        ExpertCache(ENTRY - 1).reserve((3, 1), BUFFER, for_prefetch=False, position=0)
    assert str(error.value) == (f"an expert of layer 3 needs {ENTRY} bytes, more than the whole expert cache "
                                f"({ENTRY - 1} bytes); raise memory_budget")


# --- StreamingExperts -------------------------------------------------------------------------------------
class ScriptedPredictor:
    """Forecasts a fixed expert set per layer (a stand-in for the learned predictor in unit tests)."""

    def __init__(self, forecasts: dict[int, dict[int, list[int]]], n_experts: int = 6):
        self.forecasts, self.n_experts, self.observed = forecasts, n_experts, []

    def observe(self, layer, expert_ids, residual, router_logits=None):
        self.observed.append((layer, np.asarray(expert_ids).tolist()))

    def forecast(self, layer, residual):
        out = {}
        for target, experts in self.forecasts.get(layer, {}).items():
            scores = np.zeros(self.n_experts)
            scores[experts] = np.linspace(1.0, 0.5, len(experts))
            out[target] = scores
        return out

    def observe_and_forecast(self, layer, expert_ids, residual, router_logits=None):
        self.observe(layer, expert_ids, residual, router_logits)
        return self.forecast(layer, residual)

    def need_vector(self, layer):
        return np.zeros(self.n_experts)

    def stats(self):
        return {"predictor_precision": 1.0, "predictor_recall": 1.0}


def _source(index, cache_entries, predictor=None, **kwargs):
    configs = {layer: MoeConfig(num_experts=n, top_k=2, intermediate_size=64) for layer, n in LAYERS.items()}
    buffer = ExpertStore(index).buffer_bytes(0)
    return StreamingExperts(index, ReferenceBackend().prepare_weight, configs, cache_entries * (buffer + ENTRY_OVERHEAD),
                            predictor=predictor, **kwargs)


def _replay(index, routes, **kwargs) -> dict:
    """Stats after a source built with kwargs served one token's route [(layer, ids)] per call."""
    source = _source(index, **kwargs)
    try:
        for layer, ids in routes:
            chosen = source.experts(layer, np.array([ids]), np.zeros((1, 64), np.float32))
            for expert in chosen:  # as a MoE block does: take every expert's weights
                chosen[expert]
        return source.stats()
    finally:
        source.close()


def _expected_weights(index, layer, expert):
    layout = index.layout(layer)
    return layout.decode(np.frombuffer(raw_bytes(index, layer, expert), np.uint8).copy())


def test_streamed_weights_equal_the_stored_ones(expert_file):
    source = _source(expert_file, cache_entries=4)
    try:
        chosen = source.experts(1, np.array([[4, 1], [1, 5]]), np.zeros((2, 64), np.float32))
        assert list(chosen) == [1, 4, 5]
        for expert in (1, 4, 5):
            expected = _expected_weights(expert_file, 1, expert)
            for name, got in (("gate_proj", chosen[expert].gate), ("up_proj", chosen[expert].up),
                              ("down_proj", chosen[expert].down)):
                assert np.array_equal(got.qweight, expected[name].qweight)
                assert np.array_equal(got.scales, expected[name].scales)
    finally:
        source.close()


def test_ondemand_hits_and_misses_follow_lru(expert_file):
    routes = [(0, [0, 1]), (1, [2, 3]), (2, [0, 1]), (0, [0, 2]), (1, [2, 3]), (2, [4, 5]), (0, [0, 1])]
    stats = _replay(expert_file, routes, cache_entries=4)
    # LRU over 4 entries, simulated by hand: (0,0)(0,1) miss, (1,2)(1,3) miss, (2,0)(2,1) miss evicting (0,0)(0,1),
    # (0,0)(0,2) miss evicting (1,2)(1,3), (1,2)(1,3) miss evicting (2,0)(2,1), (2,4)(2,5) miss, (0,0) miss + (0,1) miss
    assert (stats["expert_hits"], stats["expert_misses"]) == (0, 14)
    assert stats["expert_cache_peak_bytes"] <= stats["expert_cache_bytes"]
    stats = _replay(expert_file, routes, cache_entries=6)
    # 6 entries: (0,0)(0,1)(1,2)(1,3)(2,0)(2,1) miss; (0,0) hit, (0,2) miss evicting (0,1); (1,2)(1,3) hit;
    # (2,4)(2,5) miss evicting (2,0)(2,1); (0,0) hit, (0,1) miss evicting (0,2)
    assert (stats["expert_hits"], stats["expert_misses"]) == (4, 10)
    assert stats["predictor_recall"] is None and stats["io_mode"] == "direct"


def test_predicted_experts_are_prefetched(expert_file):
    predictor = ScriptedPredictor({0: {1: [3, 4], 2: [5, 0]}})
    source = _source(expert_file, cache_entries=8, predictor=predictor, depth=2)
    try:
        source.experts(0, np.array([[1, 2]]), np.zeros((1, 64), np.float32))
        source.prefetcher.wait_idle()  # the prefetches complete while "layer 0 computes"
        source.experts(1, np.array([[3, 4]]), np.zeros((1, 64), np.float32))
        source.experts(2, np.array([[0, 5]]), np.zeros((1, 64), np.float32))
        stats = source.stats()
    finally:
        source.close()
    assert predictor.observed == [(0, [[1, 2]]), (1, [[3, 4]]), (2, [[0, 5]])]
    assert (stats["expert_hits"], stats["expert_misses"]) == (4, 2)
    assert stats["prefetches_queued"] == 4 and stats["demand_loads"] == 2


def test_stale_prefetches_are_cancelled(expert_file, monkeypatch):
    gate, real_preadv = threading.Event(), os.preadv
    layer1 = {expert_file.record(1, e).offset for e in range(LAYERS[1])}

    def held_preadv(fd, buffers, offset):
        if offset in layer1:
            gate.wait(10)  # hold reads of layer 1 until the model has moved past it
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(store_module.os, "preadv", held_preadv)
    read_records_through_preadv(monkeypatch)
    predictor = ScriptedPredictor({0: {1: [0, 1, 2, 3, 4, 5]}})
    source = _source(expert_file, cache_entries=12, predictor=predictor, depth=1, threads=1, prefetch_width=3.0,
                     load_batch=1, io_engine="threads")  # (io_uring's reads do not go through os.preadv)
    opener = threading.Timer(0.3, gate.set)
    try:
        source.experts(0, np.array([[0, 1]]), np.zeros((1, 64), np.float32))  # queues 6 prefetches of layer 1
        opener.start()
        source.experts(2, np.array([[0, 1]]), np.zeros((1, 64), np.float32))  # layer 1 skipped: they are stale
        source.prefetcher.wait_idle()
        stats = source.prefetcher.stats()
    finally:
        gate.set()
        opener.cancel()
        source.close()
    assert stats["prefetches_queued"] == 6 and stats["demand_loads"] == 4
    # one thread: at most the read it had started was in flight when the model reached layer 2
    assert stats["prefetches_cancelled"] >= 5
    assert stats["prefetches_loaded"] + stats["prefetches_cancelled"] == 6


def test_prefetch_error_surfaces_where_the_expert_is_needed(expert_file, monkeypatch):
    bad = expert_file.record(1, 3)
    real_preadv = os.preadv

    def failing_preadv(fd, buffers, offset):
        if offset == bad.offset:
            raise OSError(errno.EIO, "Input/output error")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(store_module.os, "preadv", failing_preadv)
    read_records_through_preadv(monkeypatch)
    predictor = ScriptedPredictor({0: {1: [3, 4]}})
    source = _source(expert_file, cache_entries=8, predictor=predictor, depth=1, io_engine="threads")
    try:
        source.experts(0, np.array([[1, 2]]), np.zeros((1, 64), np.float32))  # no error here
        source.prefetcher.wait_idle()
        entry = source.cache.get((1, 3))
        assert entry is not None and source.cache.wait_loaded(entry, 10) and entry.state == "failed"
        chosen = source.experts(1, np.array([[3, 4]]), np.zeros((1, 64), np.float32))
        assert chosen[4].gate is not None  # a loaded expert is handed over; the failed one raises
        with pytest.raises(ExpertReadError) as error:
            chosen[3]
        assert str(error.value) == (
            f"{expert_file.path}: reading layer 1 expert 3 ({bad.length} bytes at offset {bad.offset}) failed: "
            "[Errno 5] Input/output error; check the disk holding the checkpoint")
        assert source.cache.get((1, 3)) is None  # forgotten, so a later request reads it again
        monkeypatch.setattr(store_module.os, "preadv", real_preadv)
        chosen = source.experts(1, np.array([[3, 4]]), np.zeros((1, 64), np.float32))
        assert np.array_equal(chosen[3].gate.qweight, _expected_weights(expert_file, 1, 3)["gate_proj"].qweight)
    finally:
        source.close()


def test_route_wider_than_the_cache_rolls(expert_file):
    source = _source(expert_file, cache_entries=2)
    try:
        chosen = source.experts(2, np.array([[0, 1], [2, 3], [4, 5]]), np.zeros((3, 64), np.float32))
        assert list(chosen) == [0, 1, 2, 3, 4, 5]
        for expert in chosen:  # one at a time, ascending, as the MoE block uses them
            expected = _expected_weights(expert_file, 2, expert)["down_proj"].qweight
            assert np.array_equal(chosen[expert].down.qweight, expected)
            assert source.cache.charged_bytes <= source.cache.capacity_bytes
    finally:
        source.close()


def test_mmap_pages_experts_within_the_share(expert_file, monkeypatch):
    from streaming import paging

    dropped = []
    monkeypatch.setattr(paging.os, "posix_fadvise", lambda fd, offset, length, advice: dropped.append(
        (offset, advice)))
    buffer = ExpertStore(expert_file).buffer_bytes(0)
    source = MappedExperts(expert_file, ReferenceBackend().prepare_weight, cache_bytes=3 * buffer)
    try:
        for layer, ids in [(0, [0, 1]), (1, [2, 3]), (0, [0, 1]), (0, [1, 4])]:
            chosen = source.experts(layer, np.array([ids]), np.zeros((1, 64), np.float32))
            for expert in ids:
                assert np.array_equal(chosen[expert].up.qweight,
                                      _expected_weights(expert_file, layer, expert)["up_proj"].qweight)
        stats = source.stats()
    finally:
        source.close()
    # 3 experts fit: (0,0)(0,1) miss; (1,2) miss, (1,3) miss dropping (0,0); (0,0) miss dropping (1,2),
    # (0,1) hit; (0,1) hit, (0,4) miss dropping (1,3)
    assert (stats["expert_hits"], stats["expert_misses"]) == (2, 6)
    # each dropped expert's file range leaves the page cache, so its next use reads the disk again
    assert dropped == [(expert_file.record(*key).offset, os.POSIX_FADV_DONTNEED) for key in ((0, 0), (1, 2), (1, 3))]
    assert stats["expert_cache_peak_bytes"] <= 3 * buffer and stats["io_hidden_fraction"] == 0.0


def test_lookahead_adapts_to_the_time_waited_for_experts():
    """Every WINDOW decode passes: one layer further when the model waited more than RAISE_STALL of
    the window's time, one nearer under LOWER_STALL, within 1..most."""
    from streaming.source import Lookahead

    lookahead = Lookahead(3)
    window = Lookahead.WINDOW

    def passes(stall_share: float, n: int = window) -> int:
        for _ in range(n):
            lookahead.pass_done(0.01, 0.01 * stall_share)
        return lookahead.depth

    assert lookahead.depth == 3
    assert passes(0.01, window - 1) == 3  # a window not yet complete decides nothing
    assert passes(0.01, 1) == 2 and passes(0.0) == 1 and passes(0.0) == 1  # never below one layer
    assert passes(0.15) == 1  # between the thresholds: kept
    assert passes(0.5) == 2 and passes(0.5) == 3 and passes(0.5) == 3  # never beyond the predictor's depth
    assert lookahead.changes == 4
    assert Lookahead(1).depth == 1
