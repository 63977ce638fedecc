"""Faults between the disk and a streamed expert, through the whole model, on both I/O engines
(streaming/prefetch.py: io_uring and reader threads), both streaming strategies and the `reference` and
`cpu` devices: a read that fails (EIO), a read cut short and a file shorter than its index, a record
corrupted on disk or on the way, a submission io_uring does not take, and a disk that becomes slow.

A fault that passes (a read that fails once, comes back short once, brings a flipped byte once) costs
one more read of the record and nothing else: the request gets the undamaged outcome. A fault that
lasts is reported as its typed error, naming the layer and the expert, by the call that needs that
expert (session.prefill, session.decode, iterating model.generate), and the model stays usable: a
request that does not need the expert gives the tokens and logits of an undamaged run, a session
whose step failed goes on from where it was, and once the fault is gone (the disk reads again, the
file is put right) the next call that needs the expert reads it again and gets them too. A slow disk
gives the same tokens, later.

Faults on the way are made where the bytes enter Python: the reader threads' batch read
(streaming.store.read_records), the store's own positional read (os.preadv as streaming.store calls
it) and the result the io_uring engine hands the store for a completed read (ExpertStore.finish_read:
the completion's byte count or -errno).
"""
from __future__ import annotations

import copy
import ctypes
import errno
import os
import re
import shutil
import threading
import time
import zlib
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from streaming_experts import damaged_copy, raw_bytes, write_expert_file
from tiny_models import random_prompt

import edge
from converters.convert import QuantPlan
from devices.reference import ReferenceBackend
from edge.core.errors import ZllmError
from edge.core.moe import ExpertWeights, MoeConfig
from kernels.cpu import uring
from quant.expert_file import EXPERTS_FILE, ExpertChecksumError
from streaming import store as store_module
from streaming.cache import ENTRY_OVERHEAD, LOADING
from streaming.source import StreamingExperts
from streaming.storage import EmulatedDevice, parse_storage
from streaming.store import IO_DIRECT, PAGE, ExpertReadError, ExpertStore

CASE = "qwen3_moe_norm"  # 2 MoE layers of 8 experts, top-2
MIXED = QuantPlan(weights="int8", group_size=32, overrides={"experts": "int4"})
BUDGET = "50%"
N_DECODE = 4
SLOW_DISK = "custom:bw=5MB,lat=10ms"


# --- what an undamaged run gives ------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    n_decode: int

    @property
    def capacity(self) -> int:
        return len(self.prompt) + self.n_decode


@dataclass
class Outcome:
    logits: list[np.ndarray]      # the prefill's [T, V], then each decode step's [V]
    tokens: list[int]             # the greedy token after each call
    generated: list[int]          # model.generate(prompt, max_new_tokens=n_decode + 1)


@dataclass
class Plan:
    """The expert the faults hit (the last record of experts.bin, so that cutting the file inside it
    leaves every other record whole) and three requests: one whose prefill needs it, one that first
    needs it at decode step `decode_step` (1-based), and one that never does; with each request's
    outcome on the all-resident model."""
    expert: tuple[int, int]
    needs_in_prefill: Request
    needs_in_decode: Request
    decode_step: int
    avoids: Request
    expected: dict[Request, Outcome]


def run(model, request: Request, outputs: list | None = None) -> Outcome:
    """Prefill (all logits), then greedy decode steps in a session closed at the end; each call's logits
    go to `outputs` as they come, so a test can see which call raised."""
    outputs = [] if outputs is None else outputs
    with model.session(capacity=request.capacity) as session:
        outputs.append(session.prefill(list(request.prompt), all_logits=True))
        tokens = [int(outputs[-1][-1].argmax())]
        for _ in range(request.n_decode):
            outputs.append(session.decode(tokens[-1]))
            tokens.append(int(outputs[-1].argmax()))
    return Outcome(outputs, tokens, generate(model, request))


def generate(model, request: Request) -> list[int]:
    generation = model.generate(list(request.prompt), max_new_tokens=request.n_decode + 1)
    return [step.token for step in generation.steps() if step.token is not None]


def assert_same(got: Outcome, expected: Outcome) -> None:
    assert got.tokens == expected.tokens and got.generated == expected.generated
    assert len(got.logits) == len(expected.logits)
    for got_logits, expected_logits in zip(got.logits, expected.logits):
        np.testing.assert_array_equal(got_logits, expected_logits)


def routed_experts(model, request: Request) -> list[set[tuple[int, int]]]:
    """The (layer, expert) pairs each call of the request routes to (prefill first)."""
    source, calls = model.experts, []
    fetch = source.experts

    def recording(layer, ids, residual, router_logits=None):
        calls[-1].update((layer, int(expert)) for expert in np.unique(ids))
        return fetch(layer, ids, residual, router_logits)

    source.experts = recording
    try:
        with model.session(capacity=request.capacity) as session:
            calls.append(set())
            token = int(session.prefill(list(request.prompt)).argmax())
            for _ in range(request.n_decode):
                calls.append(set())
                token = int(session.decode(token).argmax())
    finally:
        del source.experts
    return calls


_PLANS: dict[str, Plan] = {}


def plan_for(path: str, device: str) -> Plan:
    if device in _PLANS:
        return _PLANS[device]
    with edge.load(path, device=device) as model:  # every expert resident: the undamaged outcome
        index = model.checkpoint.experts
        expert = max(((layer, e) for layer in index.layers for e in range(len(index.layers[layer].records))),
                     key=lambda key: index.record(*key).offset)
        needs_in_prefill = needs_in_decode = avoids = None
        decode_step = 0
        for seed in range(200):
            short = Request(tuple(random_prompt(2 + seed % 3, seed=100 + seed)), N_DECODE + 4)
            routes = routed_experts(model, short)
            needed = [i for i, calls in enumerate(routes) if expert in calls]
            if avoids is None and not needed:
                avoids = Request(short.prompt, N_DECODE)
            if needs_in_decode is None and needed and needed[0] > 0:
                needs_in_decode, decode_step = Request(short.prompt, needed[0]), needed[0]
            if needs_in_prefill is None:
                long = Request(tuple(random_prompt(9, seed=seed)), N_DECODE)
                if expert in routed_experts(model, long)[0]:
                    needs_in_prefill = long
            if None not in (needs_in_prefill, needs_in_decode, avoids):
                break
        else:
            raise AssertionError(f"no prompts found that route to {expert} only where needed")
        requests = (needs_in_prefill, needs_in_decode, avoids)
        _PLANS[device] = Plan(expert, needs_in_prefill, needs_in_decode, decode_step, avoids,
                              {request: run(model, request) for request in requests})
    return _PLANS[device]


# --- the streamed model under test ----------------------------------------------------------------
@pytest.fixture(params=["io_uring", "threads"])
def engine(request):
    if request.param == "io_uring" and (reason := uring.unavailable_reason()) is not None:
        pytest.skip(f"io_uring cannot run here: {reason} (the threads engine is tested instead)")
    return request.param


@pytest.fixture(params=["predictive", "ondemand"])
def strategy(request):
    return request.param


@pytest.fixture(params=["reference", "cpu"])
def device(request):
    return request.param


@pytest.fixture
def checkpoint(tiny_zoo, tmp_path) -> str:
    """A copy of the tiny MoE checkpoint that a test may damage."""
    path = tmp_path / "moe"
    shutil.copytree(tiny_zoo.converted(CASE, MIXED), path)
    return os.fspath(path)


@pytest.fixture
def plan(tiny_zoo, device) -> Plan:
    return plan_for(tiny_zoo.converted(CASE, MIXED), device)


def load(checkpoint: str, device: str, strategy: str, engine: str):
    """The Python engines (their loaders are what these tests fault and inspect); the compiled slot table's
    faults are tested in test_streaming_slots.py."""
    model = edge.load(checkpoint, device=device, memory_budget=BUDGET, expert_strategy=strategy, io_engine=engine,
                      expert_engine="python")
    assert model.stats()["io_engine"] == engine
    return model


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def assert_nothing_held(model, positions_open: int = 0) -> None:
    """No expert pinned but the last layer's (held until the next layer's call, by design), none left
    loading, nothing queued, and the KV positions of the memory budget free but those of sessions still
    open (`positions_open`)."""
    source = model.experts
    source.prefetcher.wait_idle()
    last_layer = source._current._entries.values() if source._current is not None else ()
    with source.cache.lock:
        assert [e for e in source.cache.entries.values() if e.state == LOADING] == []
        assert sorted(e.key for e in source.cache.entries.values() if e.pins) == sorted(e.key for e in last_layer)
        assert all(e.pins == 1 for e in last_layer)
    with model.session() as session:  # (under a budget a session takes the positions left by default)
        assert session.capacity == model.memory.kv_capacity - positions_open


def raised_by(model, request: Request, error_type: type[ZllmError]) -> tuple[list, ZllmError]:
    """Run a request that must fail: (the logits of the calls before the one that raised, the error)."""
    outputs: list = []
    with pytest.raises(error_type) as error:
        run(model, request, outputs)
    return outputs, error.value


# --- faults on the way ------------------------------------------------------------------------------
class ReadFault:
    """Reads of one expert's record go wrong, as a disk or the kernel would make them go wrong:
    "eio" (the read fails with EIO), "short" (it returns a third of the record), "flip" (a byte arrives
    flipped); for the next `times` reads of the record, or every one until `heal()` (times None)."""

    def __init__(self, monkeypatch, store, key: tuple[int, int], kind: str, times: int | None = None):
        self.store, self.key = store, key
        self.record = self.store.index.record(*key)
        self.cut = self.record.length // 3
        self.kind, self.remaining, self.struck = kind, times, 0
        self._lock = threading.Lock()  # reads come from the loading threads too
        monkeypatch.setattr(store_module, "read_records", self._read_records(store_module.read_records))
        monkeypatch.setattr(store_module.os, "preadv", self._preadv(os.preadv))
        monkeypatch.setattr(self.store, "finish_read", self._finish_read(self.store.finish_read))

    def heal(self) -> None:
        with self._lock:
            self.remaining = 0

    def _strikes(self) -> bool:
        """Whether this read of the record goes wrong."""
        with self._lock:
            if self.remaining == 0:
                return False
            self.struck += 1
            if self.remaining is not None:
                self.remaining -= 1
            return True

    def _read_records(self, read_records):
        """The reader threads' batch read: a record's byte count, bytes and crc32 as the fault leaves them."""
        def faulty(fd, offsets, spans, lengths, addresses, checksum, got, crcs):
            calls = read_records(fd, offsets, spans, lengths, addresses, checksum, got, crcs)
            for i in np.flatnonzero(offsets == self.record.offset).tolist():
                if not self._strikes():
                    continue
                if self.kind == "eio":
                    got[i] = -1  # as the compiled reader reports a failed read
                    continue
                data = (ctypes.c_uint8 * int(spans[i])).from_address(int(addresses[i]))
                if self.kind == "short":
                    got[i] = min(got[i], self.cut)
                    ctypes.memset(int(addresses[i]) + self.cut, 0, int(spans[i]) - self.cut)
                else:
                    data[self.record.length // 2] ^= 0xFF
                crcs[i] = zlib.crc32(bytes(data)[:min(int(got[i]), int(lengths[i]))])
            return calls
        return faulty

    def _preadv(self, preadv):
        """The store's own positional reads (a second read, the compressed and fallback paths)."""
        def faulty(fd, buffers, offset):
            if offset != self.record.offset or not self._strikes():
                return preadv(fd, buffers, offset)
            if self.kind == "eio":
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            if self.kind == "short":
                return preadv(fd, [memoryview(buffers[0])[:self.cut]], offset)
            got = preadv(fd, buffers, offset)
            if got > self.record.length // 2:  # (another fault may have cut this read short)
                memoryview(buffers[0])[self.record.length // 2] ^= 0xFF
            return got
        return faulty

    def _finish_read(self, finish_read):
        """What the io_uring engine hands the store for a completed read: its result and crc32."""
        def faulty(layer, expert, out, result, crc, elapsed):
            if (layer, expert) != self.key or not self._strikes():
                return finish_read(layer, expert, out, result, crc, elapsed)
            length = self.record.length
            if self.kind == "eio":
                result = -errno.EIO
            elif self.kind == "short":
                result = min(result, self.cut)
                out[self.cut:length] = 0
            else:
                out[length // 2] ^= 0xFF
            if result > 0:
                crc = zlib.crc32(out[:min(result, length)])
            return finish_read(layer, expert, out, result, crc, elapsed)
        return faulty


@pytest.mark.parametrize("kind", ["eio", "short", "flip"])
def test_a_fault_on_the_way_passes_with_a_second_read(checkpoint, plan, device, strategy, engine, monkeypatch,
                                                      kind):
    """A read that fails once, is cut short once or brings one flipped byte is read again at once: the
    request gets the undamaged tokens and logits, and the second read is counted."""
    with load(checkpoint, device, strategy, engine) as model:
        fault = ReadFault(monkeypatch, model.experts.store, plan.expert, kind, times=1)
        request = plan.needs_in_prefill
        assert_same(run(model, request), plan.expected[request])
        assert fault.struck == 1
        assert model.stats()["expert_reads_again"] >= 1
        assert_nothing_held(model)


def test_a_read_error_is_reported_where_the_expert_is_needed_until_it_passes(checkpoint, plan, device, strategy,
                                                                             engine, monkeypatch):
    """Every read of the expert fails with EIO (the second read too) until the disk reads again."""
    with load(checkpoint, device, strategy, engine) as model:
        fault = ReadFault(monkeypatch, model.experts.store, plan.expert, "eio")
        check_reported_until_put_right(model, plan, ExpertReadError, read_error_message(model, plan.expert), fault.heal)
        assert fault.struck >= 2  # read again after each failure: the error is the second read's


def read_error_message(model, key: tuple[int, int]) -> str:
    index = model.checkpoint.experts
    record = index.record(*key)
    return (f"{index.path}: reading layer {key[0]} expert {key[1]} ({record.length} bytes at offset {record.offset}) "
            "failed: [Errno 5] Input/output error; check the disk holding the checkpoint")


@pytest.mark.parametrize("times", [1, None], ids=["once", "until-it-passes"])
def test_compressed_records_are_read_again_and_reported_alike(tiny_zoo, tmp_path, plan, device, strategy,
                                                              monkeypatch, times):
    """zstd-compressed records, which the reader threads read one by one (ExpertStore.read): a read
    error passes with a second read when it happens once, and is reported where the expert is needed
    while it lasts."""
    checkpoint = tmp_path / "compressed"
    shutil.copytree(tiny_zoo.converted(CASE, MIXED, compress_experts=True), checkpoint)
    with load(os.fspath(checkpoint), device, strategy, "threads") as model:
        assert model.checkpoint.experts.compression == "zstd"
        fault = ReadFault(monkeypatch, model.experts.store, plan.expert, "eio", times)
        if times == 1:
            assert_same(run(model, plan.needs_in_prefill), plan.expected[plan.needs_in_prefill])
            assert fault.struck == 1 and model.stats()["expert_reads_again"] >= 1
            assert_nothing_held(model)
        else:
            check_reported_until_put_right(model, plan, ExpertReadError, read_error_message(model, plan.expert),
                                           fault.heal)


@pytest.mark.parametrize("times", [1, None], ids=["once", "always"])
def test_reads_io_uring_does_not_take_are_read_by_the_models_thread(checkpoint, plan, device, strategy, monkeypatch,
                                                                     caplog, times):
    """A submission the kernel refuses in part (EAGAIN: it takes the reads before the expert's, not the
    rest) is no fault of the records: the reads it did not take are read by the model's thread, said
    in the log and counted, and the request gets the undamaged outcome."""
    if (reason := uring.unavailable_reason()) is not None:
        pytest.skip(f"io_uring cannot run here: {reason}")
    with load(checkpoint, device, strategy, "io_uring") as model:
        offset = model.checkpoint.experts.record(*plan.expert).offset
        submit, refusals = uring.ring_submit, []

        def refusing(ring, fd, offsets, spans, addresses, tags, done, refused):
            hit = np.flatnonzero(offsets == offset)
            if not len(hit) or len(refusals) == times:
                return submit(ring, fd, offsets, spans, addresses, tags, done, refused)
            first = int(hit[0])
            refusals.append(len(offsets) - first)
            taken = submit(ring, fd, offsets[:first], spans[:first], addresses[:first], tags[:first], done, refused)
            refused[0] = errno.EAGAIN
            return taken

        monkeypatch.setattr(uring, "ring_submit", refusing)
        for request in (plan.needs_in_prefill, plan.needs_in_decode):
            assert_same(run(model, request), plan.expected[request])
        assert refusals and model.stats()["io_uring_reads_refused"] == sum(refusals)
        assert caplog.messages.count(f"io_uring did not take {refusals[0]} expert read(s) (Resource temporarily "
                                     "unavailable); the model's thread reads them") >= 1
        assert_nothing_held(model)


@dataclass
class DamagedFile:
    """experts.bin with the record of one expert damaged in place: cut inside it ("truncate", the file
    then ends there: it is the file's last record) or one byte flipped ("corrupt"); `put_right` writes
    the original bytes back (into the same file, which the store keeps open)."""
    path: str
    offset: int
    length: int

    def damage(self, how: str) -> None:
        self.original = open(self.path, "rb").read()
        with open(self.path, "r+b") as f:
            if how == "truncate":
                f.truncate(self.offset + self.length // 3)
            else:
                f.seek(self.offset + self.length // 2)
                f.write(bytes([self.original[self.offset + self.length // 2] ^ 0xFF]))

    def put_right(self) -> None:
        with open(self.path, "r+b") as f:
            f.write(self.original)


@pytest.mark.parametrize("how", ["truncate", "corrupt"])
def test_a_damaged_record_is_reported_where_the_expert_is_needed_until_put_right(checkpoint, plan, device, strategy,
                                                                                 engine, how):
    path = os.path.join(checkpoint, EXPERTS_FILE)
    with load(checkpoint, device, strategy, engine) as model:
        layer, expert = plan.expert
        record = model.checkpoint.experts.record(layer, expert)
        damaged = DamagedFile(path, record.offset, record.length)
        damaged.damage(how)
        if how == "truncate":
            message = (f"{path}: layer {layer} expert {expert} is truncated ({record.length // 3} of {record.length} "
                       f"bytes at offset {record.offset}); the checkpoint is damaged, convert it again")
        else:
            message = (f"{path}: layer {layer} expert {expert} fails its crc32 check; the checkpoint is damaged, "
                       "convert it again")
        check_reported_until_put_right(model, plan, ExpertChecksumError, message, damaged.put_right)


def check_reported_until_put_right(model, plan: Plan, error_type: type[ZllmError], message: str, put_right) -> None:
    """While the fault lasts, each call that needs the expert raises `message`, and only that call: the
    calls before it return the undamaged logits, a request that does not need the expert gives the
    undamaged outcome. Once it is put right, the session whose decode step failed goes on from where it
    was, the requests that failed give the undamaged outcome, and nothing was left held or open."""
    files, expected = open_files(), plan.expected
    outputs, error = raised_by(model, plan.needs_in_prefill, error_type)
    assert (outputs, str(error)) == ([], message)
    assert_same(run(model, plan.avoids), expected[plan.avoids])
    with pytest.raises(error_type, match=f"^{re.escape(message)}$"):
        generate(model, plan.needs_in_prefill)
    request, step = plan.needs_in_decode, plan.decode_step
    undamaged = expected[request]
    with model.session(capacity=request.capacity) as session:
        np.testing.assert_array_equal(session.prefill(list(request.prompt), all_logits=True), undamaged.logits[0])
        for before in range(1, step):
            np.testing.assert_array_equal(session.decode(undamaged.tokens[before - 1]), undamaged.logits[before])
        for _ in range(2):  # failing again: the failed read left nothing behind
            with pytest.raises(error_type) as error:
                session.decode(undamaged.tokens[step - 1])
            assert str(error.value) == message
        # another request meanwhile (the predictor may prefetch the expert for it, and that read fails)
        assert_same(run(model, plan.avoids), expected[plan.avoids])
        assert_nothing_held(model, positions_open=request.capacity)
        put_right()
        for after in range(step, request.n_decode + 1):
            np.testing.assert_array_equal(session.decode(undamaged.tokens[after - 1]), undamaged.logits[after])
    for request in (plan.needs_in_prefill, plan.needs_in_decode):
        assert_same(run(model, request), expected[request])
    assert_nothing_held(model)
    assert open_files() == files


def test_a_disk_that_becomes_slow_gives_the_same_tokens_later(checkpoint, plan, device, strategy, engine):
    with load(checkpoint, device, strategy, engine) as model:
        store = model.experts.store
        request = plan.needs_in_prefill
        assert_same(run(model, request), plan.expected[request])
        # the disk slows down in the middle of a generation
        generation = model.generate(list(request.prompt), max_new_tokens=request.n_decode + 1)
        steps = generation.steps()
        tokens = [next(steps).token]
        store.storage = parse_storage(SLOW_DISK)
        store.device = EmulatedDevice(store.storage)
        waited = store.stats()["emulated_wait_seconds"]
        tokens += [step.token for step in steps if step.token is not None]
        assert tokens == plan.expected[request].generated
        assert store.stats()["emulated_wait_seconds"] > waited
        # and stays slow: every request gives its undamaged outcome, each read no sooner than the disk allows
        for request in (plan.needs_in_prefill, plan.needs_in_decode, plan.avoids):
            reads = store.stats()["reads"]
            started = time.monotonic()
            outcome = run(model, request)
            elapsed = time.monotonic() - started
            assert_same(outcome, plan.expected[request])
            if store.stats()["reads"] > reads:
                assert elapsed >= store.storage.latency_s
        assert_nothing_held(model)


# --- the store on its own ---------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[None, "zstd"], ids=["raw", "zstd"])
def expert_file(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"experts_{request.param}")
    return write_expert_file(os.fspath(folder), {0: 3, 2: 5}, compression=request.param)


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "buffered"])
def test_a_read_the_os_cuts_short_is_continued_where_it_stopped(expert_file, monkeypatch, direct_io):
    """A positional read may return fewer bytes than asked before the end of the file: the store reads
    on from where it stopped (from the page it stopped in, with O_DIRECT) instead of calling the record
    truncated, and that is no second read."""
    real_preadv, calls = os.preadv, []

    def preadv_of_one_page(fd, buffers, offset):
        calls.append(offset)
        return real_preadv(fd, [memoryview(buffers[0])[:PAGE if store.io_mode == IO_DIRECT else 1000]], offset)

    with ExpertStore(expert_file, direct_io=direct_io) as store:
        monkeypatch.setattr(store_module.os, "preadv", preadv_of_one_page)
        record = expert_file.record(2, 4)
        assert record.length > PAGE
        assert store.read(2, 4, store.new_buffer(2)).tobytes() == raw_bytes(expert_file, 2, 4)
        assert store.stats()["reads_again"] == 0
    step = PAGE if store.io_mode == IO_DIRECT else 1000
    assert calls == [record.offset + i for i in range(0, record.length, step)]


def test_a_record_read_again_still_short_is_reported_truncated(expert_file, tmp_path):
    """The file ends inside the record: the second read finds the same end, and the record is reported
    truncated, naming the layer and the expert, after two reads."""
    index = damaged_copy(copy.copy(expert_file), tmp_path, 2, 4, "truncate")
    record = index.record(2, 4)
    with ExpertStore(index) as store:
        with pytest.raises(ExpertChecksumError) as error:
            store.read(2, 4, store.new_buffer(2))
        assert store.stats()["reads_again"] == 1
    assert str(error.value) == (
        f"{index.path}: layer 2 expert 4 is truncated ({record.length // 3} of "
        f"{record.length} bytes at offset {record.offset}); the checkpoint is damaged, convert it again")


# --- any schedule of faults -------------------------------------------------------------------------
# CI runs EXAMPLES schedules per engine; a longer local run: ZLLM_EDGE_FUZZ_EXAMPLES=1000 python -m pytest
# tests/test_streaming_faults.py -k schedule. Schedules that once went wrong stay as @example.
EXAMPLES = int(os.environ.get("ZLLM_EDGE_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=10_000,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
FUZZ_LAYERS = {0: 4, 2: 4}  # layer -> experts
_layer = st.sampled_from(sorted(FUZZ_LAYERS))
_expert = st.integers(0, 3)
STEPS = st.lists(st.one_of(
    st.tuples(st.just("route"), _layer, st.lists(_expert, min_size=1, max_size=3, unique=True)),
    st.tuples(st.just("prefetch"), _layer, _expert),
    st.tuples(st.just("fault"), _layer, _expert, st.sampled_from(["eio", "short", "flip"]),
              st.sampled_from([1, 2, 3, None])),
    st.tuples(st.just("heal"), _layer, _expert),
    st.tuples(st.just("settle")),
), max_size=14)


@pytest.fixture(scope="module")
def fuzz_file(tmp_path_factory):
    return write_expert_file(os.fspath(tmp_path_factory.mktemp("fuzz_experts")), FUZZ_LAYERS)


def prepared_bytes(weights) -> bytes:
    return b"".join(w.qweight.tobytes() + w.scales.tobytes() for w in (weights.gate, weights.up, weights.down))


def expected_prepared_bytes(index, layer: int, expert: int) -> bytes:
    """prepared_bytes of the expert prepared by the reference backend from its expected raw record."""
    record = index.layout(layer).decode(np.frombuffer(raw_bytes(index, layer, expert), np.uint8).copy())
    return prepared_bytes(ExpertWeights(*(ReferenceBackend().prepare_weight(record[name])
                                          for name in ("gate_proj", "up_proj", "down_proj"))))


@FUZZ
@given(cache_entries=st.integers(2, 4), steps=STEPS)
# a prefetch that failed while its expert was not needed, put right before the expert is needed: the
# lookup reported the prefetch's stale error instead of reading the expert again
@example(cache_entries=2, steps=[("fault", 2, 1, "eio", None), ("prefetch", 2, 1), ("settle",), ("route", 0, [0]),
                                 ("heal", 2, 1), ("route", 2, [1])])
# a prefetch a loading thread dropped (no room beside the pinned experts) emptied the queue without waking
# wait_idle, which waited for ever
@example(cache_entries=2, steps=[("route", 0, [1, 3]), ("prefetch", 2, 0), ("settle",)])
# two faults on one record, one cutting short the read the other flips a byte of
@example(cache_entries=2, steps=[("route", 0, [0]), ("fault", 2, 2, "flip", 3), ("fault", 2, 2, "short", 3),
                                 ("route", 2, [0, 1, 2])])
def test_any_schedule_of_read_faults_ends_in_the_weights_or_their_typed_error(fuzz_file, engine, cache_entries,
                                                                             steps):
    """Routes, prefetches, faults that pass after some bad reads or last until healed, in any order, on
    a small cache: a lookup of an expert gives its exact weights, or the typed error naming it; an
    error only for an expert a lasting fault (more than one bad read) was set on, and only from a read
    that went wrong during the lookup or was in flight when it began (no stale error of a read that
    failed before). Once every fault is healed, every expert reads back exactly, and nothing is left
    pinned, loading or open. "settle" waits until no read is in flight."""
    files = open_files()
    expected = {(layer, expert): expected_prepared_bytes(fuzz_file, layer, expert)
                for layer, n in FUZZ_LAYERS.items() for expert in range(n)}
    configs = {layer: MoeConfig(num_experts=n, top_k=2, intermediate_size=64) for layer, n in FUZZ_LAYERS.items()}
    with pytest.MonkeyPatch.context() as patch:
        source = StreamingExperts(fuzz_file, ReferenceBackend().prepare_weight, configs,
                                  cache_entries * (expert_buffer_bytes(fuzz_file) + ENTRY_OVERHEAD), io_engine=engine)
        schedule = FaultSchedule(patch, source.store)
        try:
            for kind, *step in steps:
                if kind == "route":
                    schedule.look_up(source, *step, expected)
                elif kind == "prefetch":
                    with source.cache.lock:
                        source.prefetcher.prefetch(tuple(step), source.prefetcher.position + 1, 1, 1.0)
                    source.prefetcher.poll()
                    schedule.unsettled.add(tuple(step))
                elif kind == "fault":
                    schedule.add(*step)
                elif kind == "heal":
                    schedule.heal(tuple(step))
                else:
                    source.prefetcher.wait_idle()
                    schedule.unsettled.clear()
            for key in list(schedule.faults):
                schedule.heal(key)
            source.prefetcher.wait_idle()  # reads struck before the healing are over
            schedule.lasting.clear()  # from here on no lookup may fail
            for layer, n_experts in FUZZ_LAYERS.items():
                for expert in range(n_experts):
                    schedule.look_up(source, layer, [expert], expected)
            source.prefetcher.wait_idle()
            with source.cache.lock:
                assert [e for e in source.cache.entries.values() if e.state == LOADING] == []
                held = source._current._entries.values() if source._current is not None else ()
                assert sorted(e.key for e in source.cache.entries.values() if e.pins) == sorted(e.key for e in held)
        finally:
            source.close()
    assert open_files() == files


class FaultSchedule:
    """The faults of a schedule, by expert, and what a lookup may then find."""

    def __init__(self, patch, store):
        self.patch, self.store = patch, store
        self.faults: dict[tuple[int, int], list[ReadFault]] = {}  # not healed yet
        self.every_fault: dict[tuple[int, int], list[ReadFault]] = {}
        self.lasting: set[tuple[int, int]] = set()  # experts a fault of more than one bad read was set on
        self.unsettled: set[tuple[int, int]] = set()  # experts whose read may be in flight

    def add(self, layer: int, expert: int, how: str, times: int | None) -> None:
        fault = ReadFault(self.patch, self.store, (layer, expert), how, times)
        self.faults.setdefault((layer, expert), []).append(fault)
        self.every_fault.setdefault((layer, expert), []).append(fault)
        if times != 1:
            self.lasting.add((layer, expert))

    def heal(self, key: tuple[int, int]) -> None:
        for fault in self.faults.pop(key, []):
            fault.heal()

    def bad_reads(self, key: tuple[int, int]) -> int:
        return sum(fault.struck for fault in self.every_fault.get(key, []))

    def look_up(self, source, layer: int, experts: list[int], expected: dict) -> None:
        """Route one token of `layer` to `experts` and look each up, in ascending order as the MoE block
        does, until one raises (the block's call ends there; the reads of the rest may go on)."""
        bad_reads = {expert: self.bad_reads((layer, expert)) for expert in experts}  # the reads start at once
        chosen = source.experts(layer, np.array([experts]), np.zeros((1, 64), np.float32))
        for i, expert in enumerate(sorted(experts)):
            key = (layer, expert)
            try:
                weights = chosen[expert]
            except (ExpertReadError, ExpertChecksumError) as error:
                assert key in self.lasting, f"layer {layer} expert {expert} failed without a lasting fault: {error}"
                assert self.bad_reads(key) > bad_reads[expert] or key in self.unsettled, f"a stale error: {error}"
                assert f": reading layer {layer} expert {expert} (" in str(error) or \
                    f": layer {layer} expert {expert} " in str(error)
                self.unsettled.update((layer, rest) for rest in sorted(experts)[i + 1:])
                return
            assert prepared_bytes(weights) == expected[key]


def expert_buffer_bytes(index) -> int:
    with ExpertStore(index) as store:
        return store.buffer_bytes(0)
