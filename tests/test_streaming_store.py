"""The expert store (positional, page-cache-bypassing reads) and the storage emulation."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from streaming_experts import damaged_copy, raw_bytes, write_expert_file

from edge.core.errors import ZllmError
from quant.expert_file import ExpertChecksumError
from streaming import store as store_module
from streaming.storage import PRESETS, EmulatedDevice, StorageModel, parse_storage
from streaming.store import IO_BUFFERED, IO_DIRECT, PAGE, ExpertReadError, ExpertStore, aligned_empty


@pytest.fixture(scope="module", params=[None, "zstd"], ids=["raw", "zstd"])
def expert_file(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"experts_{request.param}")
    return write_expert_file(os.fspath(folder), {0: 3, 2: 5}, compression=request.param)


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "buffered"])
def test_round_trip_every_expert(expert_file, direct_io):
    with ExpertStore(expert_file, direct_io=direct_io) as store:
        assert store.io_mode == (IO_DIRECT if direct_io else IO_BUFFERED)
        buffer = store.new_buffer(2)
        assert buffer.ctypes.data % PAGE == 0 and len(buffer) % PAGE == 0
        for layer, n_experts in ((0, 3), (2, 5)):
            for expert in range(n_experts):
                raw = store.read(layer, expert, buffer)
                assert raw.tobytes() == raw_bytes(expert_file, layer, expert)
        stats = store.stats()
    assert stats["reads"] == 8
    assert stats["bytes_read"] == sum(expert_file.record(layer, e).length for layer, n in ((0, 3), (2, 5))
                                      for e in range(n))


def test_refused_o_direct_falls_back_visibly(expert_file, monkeypatch):
    real_open = os.open

    def open_without_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(store_module.os, "open", open_without_direct)
    with ExpertStore(expert_file) as store:
        assert store.io_mode == IO_BUFFERED
        assert store.stats()["io_mode"] == "buffered+dontneed"
        assert store.read(0, 1, store.new_buffer(0)).tobytes() == raw_bytes(expert_file, 0, 1)


def test_o_direct_refused_at_read_falls_back(expert_file, monkeypatch):
    real_preadv, refused = os.preadv, []

    def preadv(fd, buffers, offset):
        if not refused:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(store_module.os, "preadv", preadv)
    with ExpertStore(expert_file) as store:
        assert store.read(2, 4, store.new_buffer(2)).tobytes() == raw_bytes(expert_file, 2, 4)
        assert store.io_mode == IO_BUFFERED


def test_corrupted_expert_names_layer_and_expert(expert_file, tmp_path):
    import copy

    index = damaged_copy(copy.copy(expert_file), tmp_path, 2, 3, "corrupt")
    with ExpertStore(index) as store:
        assert store.read(2, 2, store.new_buffer(2)).tobytes() == raw_bytes(index, 2, 2)
        with pytest.raises(ExpertChecksumError) as error:
            store.read(2, 3, store.new_buffer(2))
    assert str(error.value) == (f"{index.path}: layer 2 expert 3 fails its crc32 check; the checkpoint is damaged, "
                                "convert it again")


def test_undecompressable_expert_names_layer_and_expert_without_verify(tmp_path):
    compressed = write_expert_file(os.fspath(tmp_path / "zstd"), {0: 3, 2: 5}, compression="zstd")
    index = damaged_copy(compressed, tmp_path, 2, 3, "unreadable")
    with ExpertStore(index, verify=False) as store:
        with pytest.raises(ExpertChecksumError) as error:
            store.read(2, 3, store.new_buffer(2))
    assert str(error.value).startswith(f"{index.path}: layer 2 expert 3 fails to decompress (")
    assert str(error.value).endswith("); the checkpoint is damaged, convert the model again")


def test_truncated_expert_names_layer_and_expert(expert_file, tmp_path):
    import copy

    index = damaged_copy(copy.copy(expert_file), tmp_path, 2, 4, "truncate")
    record = index.record(2, 4)
    with ExpertStore(index) as store:
        with pytest.raises(ExpertChecksumError) as error:
            store.read(2, 4, store.new_buffer(2))
    assert str(error.value) == (
        f"{index.path}: layer 2 expert 4 is truncated ({record.length // 3} of {record.length} bytes at offset "
        f"{record.offset}); the checkpoint is damaged, convert it again")


def test_os_read_error_names_layer_and_expert(expert_file, monkeypatch):
    def failing_preadv(fd, buffers, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(store_module.os, "preadv", failing_preadv)
    record = expert_file.record(0, 2)
    with ExpertStore(expert_file) as store:
        with pytest.raises(ExpertReadError) as error:
            store.read(0, 2, store.new_buffer(0))
    assert str(error.value) == (
        f"{expert_file.path}: reading layer 0 expert 2 ({record.length} bytes at offset {record.offset}) failed: "
        "[Errno 5] Input/output error; check the disk holding the checkpoint")


def test_aligned_empty():
    for n in (1, 4096, 10000):
        buffer = aligned_empty(n)
        assert buffer.ctypes.data % PAGE == 0 and buffer.nbytes == n


# --- storage emulation ---------------------------------------------------------------------------------
class FakeClock:
    """Time that only moves when someone sleeps (or the test advances it)."""

    def __init__(self):
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_presets_and_custom_storage():
    assert parse_storage("nvme") == StorageModel("nvme", 3.0e9, 80e-6)
    assert parse_storage("SD") is PRESETS["sd"]
    assert parse_storage(None) is None and parse_storage("native") is None
    custom = parse_storage("custom:bw=500MB,lat=200us")
    assert (custom.bandwidth_bytes_per_s, custom.latency_s) == (500e6, pytest.approx(200e-6))
    assert parse_storage("custom:bw=1.5GiB/s,lat=1ms").bandwidth_bytes_per_s == 1.5 * 1024**3
    with pytest.raises(ZllmError) as error:
        parse_storage("floppy")
    assert str(error.value) == ("storage 'floppy' is not known; use one of native, nvme, ufs, emmc, sd, or "
                                "custom:bw=SIZE,lat=TIME such as custom:bw=500MB,lat=200us (bandwidth per second)")
    with pytest.raises(ZllmError) as error:
        parse_storage("custom:bw=fast,lat=1ms")
    assert str(error.value).startswith("storage 'custom:bw=fast,lat=1ms': bandwidth 'fast' not understood")


def test_a_read_is_never_faster_than_the_model(expert_file):
    clock = FakeClock()
    model = StorageModel("slow", 1e6, 1e-3)
    with ExpertStore(expert_file, storage=model, clock=clock, sleep=clock.sleep) as store:
        buffer = store.new_buffer(2)
        started = clock()
        store.read(2, 0, buffer)
        assert clock() - started == pytest.approx(model.read_seconds(expert_file.record(2, 0).length))
        # the device is idle again after that read: the next one takes the same time
        started = clock()
        store.read(2, 1, buffer)
        assert clock() - started == pytest.approx(model.read_seconds(expert_file.record(2, 1).length))


def test_concurrent_reads_share_the_bandwidth():
    clock = FakeClock()
    device = EmulatedDevice(StorageModel("d", 1e6, 1e-3), clock, clock.sleep)
    # four reads of 1000 bytes issued at once: latencies overlap, transfers (1 ms each) queue up
    done = [device.schedule(1000, clock()) for _ in range(4)]
    assert done == pytest.approx([100.002, 100.003, 100.004, 100.005])
    # a read issued when the device is idle again takes latency + transfer
    clock.now = 200.0
    assert device.schedule(1000, clock()) == pytest.approx(200.002)
    assert device.wait_until(200.002) == pytest.approx(0.002) and clock() == pytest.approx(200.002)
    assert device.wait_until(150.0) == 0.0  # already past: no sleep
    # a batch booked at once queues the same way as its reads booked one by one
    clock.now = 300.0
    assert device.schedule_batch([1000] * 4, clock()) == pytest.approx(300.005)
    assert device.schedule(1000, clock()) == pytest.approx(300.006)


def test_slow_real_read_is_not_slowed_further(expert_file, monkeypatch):
    clock = FakeClock()
    real_preadv = os.preadv

    def slow_preadv(fd, buffers, offset):
        clock.now += 1.0  # the real disk takes a second
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(store_module.os, "preadv", slow_preadv)
    with ExpertStore(expert_file, storage="nvme", clock=clock, sleep=clock.sleep) as store:
        store.read(0, 0, store.new_buffer(0))
    assert clock.slept == [] and store.stats()["read_seconds"] == pytest.approx(1.0)


def test_buffered_reads_drop_their_pages(expert_file, monkeypatch):
    advised = []
    monkeypatch.setattr(store_module.os, "posix_fadvise", lambda fd, offset, length, advice: advised.append(
        (offset, length, advice)))
    with ExpertStore(expert_file, direct_io=False) as store:
        store.read(2, 1, store.new_buffer(2))
    record = expert_file.record(2, 1)
    assert advised == [(record.offset, record.length, os.POSIX_FADV_DONTNEED)]


def test_buffer_too_small_is_refused(expert_file):
    with ExpertStore(expert_file) as store:
        with pytest.raises(ValueError):
            store.read(0, 0, np.zeros(16, np.uint8))


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "buffered"])
def test_records_back_to_back_are_read_by_one_call(expert_file, direct_io):
    # layer 2's experts lie back to back in the file (whole pages apart, the span a direct read
    # takes): asked in any order, 1..4 is one run; 0 and 4 are not adjacent. Compressed records are
    # read (and decompressed) one by one.
    with ExpertStore(expert_file, direct_io=direct_io) as store:
        contiguous = expert_file.compression is None and (store.io_mode == IO_DIRECT or all(
            expert_file.record(2, e).offset + expert_file.record(2, e).length == expert_file.record(2, e + 1).offset
            for e in range(4)))
        buffers = [store.new_buffer(2) for _ in range(4)]
        results = store.read_batch([(2, e, b) for e, b in zip((3, 1, 4, 2), buffers)])
        for expert, raw in zip((3, 1, 4, 2), results):
            assert raw.tobytes() == raw_bytes(expert_file, 2, expert)
        assert store.stats()["read_calls"] == (1 if contiguous else 4)
        results = store.read_batch([(2, 4, buffers[0]), (2, 0, buffers[1])])
        assert [r.tobytes() for r in results] == [raw_bytes(expert_file, 2, 4), raw_bytes(expert_file, 2, 0)]
        stats = store.stats()
    assert (stats["reads"], stats["read_calls"]) == (6, 3 if contiguous else 6)


def test_a_truncated_record_inside_a_run_is_named(expert_file, tmp_path):
    import copy

    index = damaged_copy(copy.copy(expert_file), tmp_path, 2, 3, "truncate")
    with ExpertStore(index) as store:
        results = store.read_batch([(2, e, store.new_buffer(2)) for e in (1, 2, 3, 4)])
    assert [r.tobytes() for r in results[:2]] == [raw_bytes(index, 2, 1), raw_bytes(index, 2, 2)]
    assert isinstance(results[2], ExpertChecksumError) and "layer 2 expert 3 is truncated" in str(results[2])
    assert isinstance(results[3], ExpertChecksumError) and "layer 2 expert 4 is truncated" in str(results[3])
