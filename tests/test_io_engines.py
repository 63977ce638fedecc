"""The two engines that read streamed experts (streaming/prefetch.py): io_uring, driven by the model's
thread in compiled calls, and the reader threads; the same loads, bytes, errors and emulated timing."""
from __future__ import annotations

import copy
import errno
import os
import threading
import time

import numpy as np
import pytest
from streaming_experts import damaged_copy, raw_bytes, write_expert_file

from devices.reference import ReferenceBackend
from edge.core.errors import InvalidArgumentError, ZllmError
from edge.core.moe import MoeConfig
from kernels.cpu import uring
from quant.expert_file import ExpertChecksumError
from streaming.cache import ENTRY_OVERHEAD
from streaming.options import StreamingOptions
from streaming.source import StreamingExperts
from streaming.store import ExpertReadError, ExpertStore

LAYERS = {0: 6, 1: 6, 2: 6}
ROUTES = [(0, [0, 1]), (1, [2, 3]), (2, [0, 1]), (0, [0, 2]), (1, [2, 3]), (2, [4, 5]), (0, [0, 1])]


@pytest.fixture(scope="module")
def expert_file(tmp_path_factory):
    return write_expert_file(os.fspath(tmp_path_factory.mktemp("experts")), LAYERS)


@pytest.fixture(params=["io_uring", "threads"])
def engine(request):
    if request.param == "io_uring" and (reason := uring.unavailable_reason()) is not None:
        pytest.skip(f"io_uring cannot run here: {reason} (the threads engine is tested instead)")
    return request.param


def _source(index, cache_entries, engine, **kwargs):
    configs = {layer: MoeConfig(num_experts=n, top_k=2, intermediate_size=64) for layer, n in LAYERS.items()}
    buffer = ExpertStore(index).buffer_bytes(0)
    return StreamingExperts(index, ReferenceBackend().prepare_weight, configs, cache_entries * (buffer + ENTRY_OVERHEAD),
                            io_engine=engine, **kwargs)


def _weights_bytes(chosen, expert) -> bytes:
    weights = chosen[expert]
    return b"".join(w.qweight.tobytes() + w.scales.tobytes() for w in (weights.gate, weights.up, weights.down))


def test_both_engines_load_the_same_experts_with_the_same_hits(expert_file, engine):
    source = _source(expert_file, 4, engine)
    seen = []
    try:
        for layer, ids in ROUTES:
            chosen = source.experts(layer, np.array([ids]), np.zeros((1, 64), np.float32))
            seen.append([_weights_bytes(chosen, e) for e in chosen])
        stats = source.stats()
    finally:
        source.close()
    assert stats["io_engine"] == engine
    assert (stats["expert_hits"], stats["expert_misses"], stats["expert_reads"]) == (0, 14, 14)  # LRU over 4 entries
    reference = ReferenceBackend()
    for (layer, ids), loaded in zip(ROUTES, seen):
        layout = expert_file.layout(layer)
        for expert, got in zip(sorted(ids), loaded):
            record = layout.decode(np.frombuffer(raw_bytes(expert_file, layer, expert), np.uint8).copy())
            expected = [reference.prepare_weight(record[name]) for name in ("gate_proj", "up_proj", "down_proj")]
            assert got == b"".join(w.qweight.tobytes() + w.scales.tobytes() for w in expected)


@pytest.mark.parametrize("how", ["corrupt", "truncate"])
def test_a_damaged_record_is_reported_where_its_expert_is_needed(expert_file, tmp_path, engine, how):
    index = damaged_copy(copy.copy(expert_file), tmp_path, 2, 5, how)
    source = _source(index, 4, engine)
    try:
        chosen = source.experts(2, np.array([[1, 5]]), np.zeros((1, 64), np.float32))
        assert chosen[1].gate is not None  # an intact expert of the same layer is handed over
        with pytest.raises(ExpertChecksumError) as error:
            chosen[5]
        assert f"layer 2 expert 5 {'fails its crc32 check' if how == 'corrupt' else 'is truncated'}" in str(error.value)
        # the failed entry is dropped: the next request reads it again, and fails again
        with pytest.raises(ExpertChecksumError):
            source.experts(2, np.array([[5, 1]]), np.zeros((1, 64), np.float32))[5]
    finally:
        source.close()


def test_an_emulated_read_is_not_delivered_before_the_device_would(expert_file, engine):
    # 10 MB/s and 40 ms a read: two misses of one layer take >= 2 x (record / bandwidth) + the latency
    record = expert_file.record(1, 0).length
    source = _source(expert_file, 4, engine, storage="custom:bw=10MB,lat=40ms")
    try:
        started = time.monotonic()
        chosen = source.experts(1, np.array([[0, 3]]), np.zeros((1, 64), np.float32))
        chosen[0], chosen[3]
        elapsed = time.monotonic() - started
    finally:
        source.close()
    assert elapsed >= 0.040 + 2 * record / 10e6 - 1e-3


def test_io_uring_refused_is_said_and_auto_falls_back_to_threads(expert_file, monkeypatch):
    monkeypatch.setattr(uring, "unavailable_reason", lambda: "the kernel refused io_uring_setup (test)")
    with pytest.raises(ZllmError, match=r"io_engine 'io_uring' cannot run here: the kernel refused"):
        _source(expert_file, 4, "io_uring")
    source = _source(expert_file, 4, "auto")
    try:
        stats = source.stats()
    finally:
        source.close()
    assert stats["io_engine"] == "threads"
    assert stats["io_engine_reason"] == "the kernel refused io_uring_setup (test)"


def test_an_unknown_io_engine_is_refused_by_name():
    message = "io_engine 'aio' is not known; choose one of auto, io_uring, threads"
    with pytest.raises(InvalidArgumentError, match=message):
        StreamingOptions(io_engine="aio")


def test_reads_after_the_completion_thread_stopped_fail_where_their_experts_are_needed(expert_file):
    if (reason := uring.unavailable_reason()) is not None:
        pytest.skip(f"io_uring cannot run here: {reason}")
    source = _source(expert_file, 4, "io_uring")
    try:
        source.prefetcher._completion_error = -errno.EIO  # as if io_uring_wait_cqe had failed
        chosen = source.experts(0, np.array([[2, 4]]), np.zeros((1, 64), np.float32))
        with pytest.raises(ExpertReadError, match=r"reading layer 0 expert 2 .* failed: \[Errno 5\] Input/output"):
            chosen[2]
    finally:
        source.close()


def test_a_demand_load_waits_out_a_cache_full_of_loads_in_flight(expert_file, engine):
    """Every entry of the cache is a prefetch still being read when a layer misses an expert: the demand
    load waits until one is published and evicts it (with io_uring no other thread publishes reads, so
    the waiting caller must take them itself) instead of waiting for ever."""
    source = _source(expert_file, 2, engine, storage="custom:bw=50MB,lat=30ms")
    loader, result = source.prefetcher, {}

    def demand():
        with source.cache.lock:
            entry, missed = loader.demand((2, 5))
        loader.wait_loaded(entry)
        result.update(state=entry.state, missed=missed)

    try:
        with source.cache.lock:
            for expert in (0, 1):
                assert loader.prefetch((1, expert), 10, 1, 1.0)
        deadline = time.monotonic() + 5
        while len(source.cache.entries) < 2 and time.monotonic() < deadline:
            loader.poll()  # io_uring: submitted here; threads: taken by the loading threads
            time.sleep(0.001)
        assert [e.state for e in source.cache.entries.values()] == ["loading", "loading"]
        thread = threading.Thread(target=demand, daemon=True)
        thread.start()
        thread.join(timeout=30)
        assert not thread.is_alive(), "the demand load waited for ever"
        assert result == {"state": "ready", "missed": True}
        assert (2, 5) in source.cache.entries and len(source.cache.entries) == 2
    finally:
        source.close()
