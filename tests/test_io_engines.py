"""The two engines that read streamed experts (streaming/prefetch.py): io_uring, driven by the model's
thread in compiled calls, and the reader threads; the same loads, bytes, errors and emulated timing."""
from __future__ import annotations

import copy
import errno
import os
import shutil
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
from streaming.cache import ENTRY_OVERHEAD, FAILED
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
    with ExpertStore(index) as store:
        buffer = store.buffer_bytes(0)
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
    for (layer, ids), loaded in zip(ROUTES, seen):
        for expert, got in zip(sorted(ids), loaded):
            assert got == _expected_bytes(expert_file, layer, expert)


def _expected_bytes(index, layer, expert) -> bytes:
    """_weights_bytes of an expert prepared from its expected raw record."""
    record = index.layout(layer).decode(np.frombuffer(raw_bytes(index, layer, expert), np.uint8).copy())
    expected = [ReferenceBackend().prepare_weight(record[name]) for name in ("gate_proj", "up_proj", "down_proj")]
    return b"".join(w.qweight.tobytes() + w.scales.tobytes() for w in expected)


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


def test_a_prefetch_that_failed_is_read_again_when_its_expert_is_needed(expert_file, tmp_path, engine):
    """A prefetch whose read failed before any layer needed its expert is not that layer's error: the
    layer reads the expert again (here, once the record was put right) and gets its weights."""
    index = damaged_copy(copy.copy(expert_file), tmp_path, 2, 5, "corrupt")
    source = _source(index, 4, engine)
    try:
        with source.cache.lock:
            assert source.prefetcher.prefetch((2, 5), 10, 1, 1.0)
        source.prefetcher.wait_idle()
        assert source.cache.get((2, 5)).state == FAILED
        shutil.copyfile(expert_file.path, index.path)  # put right, in the file the store has open
        chosen = source.experts(2, np.array([[5, 1]]), np.zeros((1, 64), np.float32))
        assert _weights_bytes(chosen, 5) == _expected_bytes(index, 2, 5)
        assert source.stats()["expert_misses"] == 2
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


def _io_uring_descriptors() -> set[int]:
    """This process's file descriptors of io_uring instances."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[io_uring]":
                found.add(int(fd))
        except OSError:  # the descriptor of the listing itself, closed since
            continue
    return found


def test_reads_the_kernel_did_not_take_never_run_later(expert_file):
    """A submission the kernel refuses (here the ring's descriptor is swapped for /dev/null, where
    io_uring_enter answers EOPNOTSUPP) says how many reads it took and why not the rest, and turns the
    rest into no-ops: the next submission sends them out as no-ops, not as reads into buffers whose
    callers were told that they failed."""
    if (reason := uring.unavailable_reason()) is not None:
        pytest.skip(f"io_uring cannot run here: {reason}")
    record = expert_file.record(0, 1)
    n = record.length
    buffers = np.zeros((2, n), np.uint8)
    addresses = np.array([buffers[0].ctypes.data, buffers[1].ctypes.data], np.uint64)
    lengths = np.array([n, n], np.int64)
    done, results = np.zeros(2, np.int64), np.zeros(2, np.int64)
    crcs, refused = np.zeros(2, np.uint32), np.zeros(1, np.int64)
    offsets, spans = np.array([record.offset], np.int64), np.array([n], np.int64)
    rings_before = _io_uring_descriptors()
    ring = np.zeros(uring.RING_BYTES, np.uint8)
    assert uring.ring_init(ring.ctypes.data, 4) == 0
    (ring_fd,) = _io_uring_descriptors() - rings_before
    fd, saved, null = os.open(expert_file.path, os.O_RDONLY), os.dup(ring_fd), os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(null, ring_fd)
        try:
            taken = uring.ring_submit(ring.ctypes.data, fd, offsets, spans, addresses[:1], np.array([0]), done, refused)
        finally:
            os.dup2(saved, ring_fd)
        assert (taken, int(refused[0])) == (0, errno.EOPNOTSUPP)
        completer = threading.Thread(target=uring.ring_complete, daemon=True,
                                     args=(ring.ctypes.data, addresses, lengths, True, results, crcs, done,
                                           uring.NO_WAKE))
        completer.start()
        taken = uring.ring_submit(ring.ctypes.data, fd, offsets, spans, addresses[1:], np.array([1]), done, refused)
        assert (taken, int(refused[0])) == (1, 0)
        assert uring.ring_wait(done, 1, 50_000)
        assert uring.ring_stop(ring.ctypes.data) == 0
        completer.join(timeout=10)
        assert not completer.is_alive()
        # the read refused never ran (its no-op went out first, and completed as nothing)
        assert done[0] == 0 and not buffers[0].any()
        assert results[1] == n and buffers[1].tobytes() == expert_file_bytes(expert_file, record)
        assert crcs[1] == record.crc32
    finally:
        uring.ring_exit(ring.ctypes.data)
        for descriptor in (fd, saved, null):
            os.close(descriptor)


def expert_file_bytes(index, record) -> bytes:
    with open(index.path, "rb") as f:
        f.seek(record.offset)
        return f.read(record.length)


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
