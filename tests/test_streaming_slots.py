"""The compiled slot table (streaming/slots.py, kernels/cpu/expert_slots.py): the same bits, figures and
failures as the Python cache, with no Python per expert read."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest
from gpu_support import open_gpu
from test_streaming_model import MIXED, N_DECODE, PROMPT, greedy_run, resident_run
from tiny_models import greedy_decode

import edge
from edge.core.errors import ZllmError
from kernels.cpu import expert_slots as ks
from kernels.cpu.uring import unavailable_reason
from quant.expert_file import ExpertChecksumError
from streaming.slots import ENGINE, SlotExperts

# the slot table's I/O engines that run here: reader threads everywhere, io_uring where the kernel allows it
IO_ENGINES = ["threads"] + (["io_uring"] if unavailable_reason() is None else [])
CASE = "qwen3_moe_norm"
BUDGETS = [
    pytest.param(dict(memory_budget="25%", expert_strategy="ondemand", prefetch_threads=2), id="25%-ondemand-lru"),
    pytest.param(dict(memory_budget="40%"), id="40%-predictive-nextuse"),
    pytest.param(dict(memory_budget="50%", expert_policy="lfu", storage="nvme"), id="50%-lfu-nvme"),
    pytest.param(dict(memory_budget="30%", expert_policy="lru", prefetch_depth=3, prefetch_threads=2),
                 id="30%-lru-depth3"),
]


@pytest.mark.parametrize("io_engine", IO_ENGINES)
@pytest.mark.parametrize("device", ["reference", "cpu"])
@pytest.mark.parametrize("options", BUDGETS)
def test_both_engines_give_the_resident_bits_and_the_same_figures(tiny_zoo, options, device, io_engine):
    """Tokens and every logit equal the all-resident run's on both engines, and both report the same
    statistics (keys), each saying which engine ran."""
    path = tiny_zoo.converted(CASE, MIXED)
    expected_tokens, expected_logits, _ = resident_run(path, device)
    figures = {}
    for engine in ("compiled", "python"):
        tokens, logits, stats = greedy_run(path, device, expert_engine=engine, io_engine=io_engine, **options)
        assert tokens == expected_tokens, engine
        assert all(np.array_equal(got, want) for got, want in zip(logits, expected_logits)), engine
        assert stats["expert_misses"] > 0 and stats["expert_reads"] >= stats["expert_misses"]
        assert stats["expert_cache_peak_bytes"] <= stats["expert_cache_bytes"]
        figures[engine] = stats
    assert figures["compiled"]["expert_engine"] == ENGINE
    assert figures["python"]["expert_engine"] == "python cache: expert_engine 'python' asked for"
    assert set(figures["compiled"]) == set(figures["python"])
    assert figures["compiled"]["io_engine"] == io_engine


@pytest.mark.skipif("io_uring" not in IO_ENGINES, reason="io_uring does not run here")
@pytest.mark.parametrize("cores", [1, 2, 64])
def test_reads_are_issued_inline_only_where_the_compute_threads_take_every_core(tiny_zoo, monkeypatch, cores):
    """With the compute threads on every core the model's thread issues each read itself (a kernel worker
    would take a core from them), else the kernel's workers do; the bits are the resident run's either way."""
    path = tiny_zoo.converted(CASE, MIXED)
    expected_tokens, expected_logits, _ = resident_run(path, "cpu")
    monkeypatch.setattr("streaming.slots.usable_cores", lambda: cores)
    with edge.load(path, device="cpu", threads=2, memory_budget="40%", io_engine="io_uring") as model:
        tokens, logits = greedy_decode(model, PROMPT, N_DECODE, capacity=32)
        source = model.experts
        assert isinstance(source, SlotExperts)
        assert source.state[ks.G_INLINE_READS] == (1 if cores <= 2 else 0)
        assert model.stats()["expert_reads"] > 0
    assert tokens == expected_tokens
    assert all(np.array_equal(got, want) for got, want in zip(logits, expected_logits))


def test_the_default_engine_is_the_compiled_one_where_it_runs(tiny_zoo):
    path = tiny_zoo.converted(CASE, MIXED)
    with edge.load(path, memory_budget="50%") as model:
        assert isinstance(model.experts, SlotExperts)
        assert model.stats()["expert_engine"] == ENGINE
        assert model.stats()["io_engine"] == IO_ENGINES[-1]
    with edge.load(path, memory_budget="50%", expert_policy="cycle") as model:  # a policy it does not implement
        assert model.stats()["expert_engine"] == "python cache: expert_policy 'cycle' is served by the Python cache"
    with edge.load(path, memory_budget="50%", io_engine="threads") as model:  # reads through its reader threads
        stats = model.stats()
        assert stats["expert_engine"] == ENGINE
        assert (stats["io_engine"], stats["io_engine_reason"]) == ("threads", "io_engine 'threads' asked for")
        assert stats["prefetch_threads"] == 4


@pytest.mark.parametrize("options, reason", [
    (dict(expert_policy="forecast"), "expert_policy 'forecast' is served by the Python cache"),
    (dict(expert_policy="cycle"), "expert_policy 'cycle' is served by the Python cache"),
])
def test_asking_for_the_compiled_engine_where_it_cannot_run_is_refused(tiny_zoo, options, reason):
    path = tiny_zoo.converted(CASE, MIXED)
    with pytest.raises(ZllmError) as error:
        edge.load(path, memory_budget="50%", expert_engine="compiled", **options)
    assert str(error.value) == (f"expert_engine 'compiled' cannot stream this model: {reason}; use expert_engine "
                                "'auto' or 'python'")


def test_a_platform_without_eventfd_streams_through_the_python_cache(tiny_zoo, monkeypatch):
    path = tiny_zoo.converted(CASE, MIXED)
    expected_tokens, _, _ = resident_run(path, "cpu")
    monkeypatch.delattr(os, "eventfd")
    tokens, _, stats = greedy_run(path, "cpu", memory_budget="40%")
    assert stats["expert_engine"] == "python cache: this platform has no eventfd"
    assert tokens == expected_tokens
    with pytest.raises(ZllmError, match="this platform has no eventfd"):
        edge.load(path, memory_budget="40%", expert_engine="compiled")


def test_a_bad_expert_engine_is_refused(tiny_zoo):
    with pytest.raises(ZllmError, match="expert_engine"):
        edge.load(tiny_zoo.converted(CASE, MIXED), memory_budget="50%", expert_engine="numba")


class DamagedOnTheWay:
    """The next `times` reads of one expert arrive damaged, as a bit flipped in transfer would make them:
    the slot table expects another crc32 for them (the record on disk is intact, so a second read,
    which the store makes itself, passes)."""

    def __init__(self, monkeypatch, source: SlotExperts, ordinal: int, expert: int, times: int):
        self.source, self.row, self.remaining, self.struck = source, (ordinal, expert), times, 0
        self.crc = int(source.experts_table[ordinal, expert, ks.X_CRC])
        source.experts_table[ordinal, expert, ks.X_CRC] = self.crc ^ 1
        recover = source.recover

        def counted(slot, layer, expert_id):
            if (source._ordinal[layer], expert_id) == self.row:
                self.struck += 1
                self.remaining -= 1
                if self.remaining == 0:
                    source.experts_table[self.row][ks.X_CRC] = self.crc
            return recover(slot, layer, expert_id)

        monkeypatch.setattr(source, "recover", counted)


def pinned(source: SlotExperts) -> list[tuple[int, int]]:
    slots = source.slots[: source.capacity]
    held = slots[slots[:, ks.S_PINS] > 0]
    return sorted((source.order[layer], expert) for layer, expert in held[:, [ks.S_LAYER, ks.S_EXPERT]].tolist())


@pytest.mark.parametrize("io_engine", IO_ENGINES)
@pytest.mark.parametrize("device", ["reference", "cpu"])
def test_a_read_damaged_on_the_way_passes_with_a_second_read(tiny_zoo, monkeypatch, device, io_engine):
    path = tiny_zoo.converted(CASE, MIXED)
    expected_tokens, expected_logits, _ = resident_run(path, device)
    with edge.load(path, device=device, memory_budget="40%", io_engine=io_engine) as model:
        source = model.experts
        damage = DamagedOnTheWay(monkeypatch, source, 1, 0, times=2)
        tokens, logits = greedy_decode(model, PROMPT, 6, capacity=32)
        stats = model.stats()
        assert tokens == expected_tokens
        assert all(np.array_equal(got, want) for got, want in zip(logits, expected_logits))
        assert damage.struck >= 1 and stats["expert_reads_again"] == damage.struck
        # nothing in flight or queued once the reads settle; only the last layer's experts stay pinned
        assert source._ks.slot_drain(*source._table, 1000) == 0
        last = source._current
        assert pinned(source) == sorted((last.layer, expert) for expert in last._held)


@pytest.mark.parametrize("io_engine", IO_ENGINES)
def test_a_record_damaged_on_disk_is_reported_with_its_layer_and_expert_and_the_model_serves_on(tiny_zoo,
                                                                                                   monkeypatch,
                                                                                                   io_engine):
    """Every read of layer 1's experts fails its crc32: the request that needs one raises the typed error,
    no pin outlives it, and once the record reads back whole the same model serves the request."""
    path = tiny_zoo.converted(CASE, MIXED)
    expected_tokens, _, _ = resident_run(path, "cpu")
    with edge.load(path, device="cpu", memory_budget="40%", io_engine=io_engine) as model:
        source = model.experts
        ordinal = source._ordinal[1]
        crcs = source.experts_table[ordinal, :, ks.X_CRC].copy()
        source.experts_table[ordinal, :, ks.X_CRC] ^= 1
        monkeypatch.setattr(source.store.index.layers[1], "records",
                            [dataclasses.replace(record, crc32=record.crc32 ^ 1)
                             for record in source.store.index.layers[1].records])
        with pytest.raises(ExpertChecksumError) as error:
            model.session(capacity=32).prefill(PROMPT)
        assert str(error.value).startswith(f"{source.index.path}: layer 1 expert ")
        assert pinned(source) == [] and source._current is None
        monkeypatch.undo()
        source.experts_table[ordinal, :, ks.X_CRC] = crcs
        tokens, _ = greedy_decode(model, PROMPT, 6, capacity=32)
        assert tokens == expected_tokens


def test_a_budget_that_shrinks_gives_slots_back(tiny_zoo):
    path = tiny_zoo.converted(CASE, MIXED)
    expected_tokens, _, _ = resident_run(path, "cpu")
    with edge.load(path, device="cpu", memory_budget="50%") as model:
        source = model.experts
        greedy_decode(model, PROMPT, 2, capacity=32)
        source.release_current()
        before = source.capacity
        source.resize_cache(source.capacity_bytes // 2)
        assert source.capacity == source._slots_for(source.capacity_bytes) < before
        assert (source.slots[source.capacity:, ks.S_STATE] == ks.EMPTY).all()
        assert (source.experts_table[:, :, ks.X_SLOT] < source.capacity).all()
        tokens, _ = greedy_decode(model, PROMPT, 6, capacity=32)
        assert tokens == expected_tokens


def test_without_liburing_the_slot_table_reads_through_its_reader_threads(tiny_zoo):
    """A Python where the liburing package cannot be imported (a platform without its wheel): the slot
    table's kernels still compile, the reads go through reader threads, and the bits are the resident's."""
    path = tiny_zoo.converted(CASE, MIXED)
    expected_tokens, expected_logits, _ = resident_run(path, "cpu")
    script = textwrap.dedent(f"""
        import json, sys
        sys.modules["liburing"] = None  # import liburing raises ImportError
        import numpy as np
        from test_streaming_model import N_DECODE, PROMPT
        from tiny_models import greedy_decode
        import edge
        with edge.load({path!r}, device="cpu", memory_budget="40%") as model:
            tokens, logits = greedy_decode(model, PROMPT, N_DECODE, capacity=32)
            stats = model.stats()
        np.savez(sys.argv[1], *logits)
        print(json.dumps(dict(tokens=tokens, engine=stats["expert_engine"], io=stats["io_engine"],
                              reason=stats["io_engine_reason"], reads=stats["expert_reads"])))
    """)
    with tempfile.TemporaryDirectory() as folder:
        logits_file = os.path.join(folder, "logits.npz")
        path_entries = [os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path_entries))
        run = subprocess.run([sys.executable, "-c", script, logits_file], capture_output=True, text=True, env=env,
                             timeout=600)
        assert run.returncode == 0, run.stderr
        got = json.loads(run.stdout.strip().splitlines()[-1])
        with np.load(logits_file) as saved:
            logits = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    assert (got["engine"], got["io"]) == (ENGINE, "threads")
    assert got["reason"].startswith("the liburing package is not usable here")
    assert got["reads"] > 0 and got["tokens"] == expected_tokens
    assert len(logits) == len(expected_logits)
    assert all(np.array_equal(a, b) for a, b in zip(logits, expected_logits))


@pytest.mark.parametrize("device", ["reference", "cpu", pytest.param("npu:cpu", marks=pytest.mark.skipif(
    importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnx") is None,
    reason="the npu device needs onnxruntime and onnx")), "gpu"])
@pytest.mark.parametrize("engine", ["compiled", "python"])
def test_a_decode_step_forecasts_its_first_moe_layer_from_the_token_embedding(tiny_zoo, monkeypatch, engine, device):
    """Before layer 0 of every decode step (and of no prefill), the source forecasts the first MoE
    layer from that token's embedding (its router on the embedding, as the gate lookahead scores the
    next layer) and schedules that forecast's prefetches; the tokens stay the resident run's. On the
    gpu the embedding is read back from the device, the row its own embedding op gives."""
    if device == "gpu":
        open_gpu()  # skips where there is no Vulkan device at all
    from edge.core.moe import route
    from edge.core.numerics import rms_norm, softmax
    from streaming.predictor import ExpertPredictor
    from streaming.source import StreamingExperts

    path = tiny_zoo.converted(CASE, MIXED)
    seen, scheduled = [], []
    forecast = ExpertPredictor.token_forecast

    def spy(predictor, embedding):
        need = forecast(predictor, embedding)
        seen.append((np.array(embedding), need, predictor))
        return need

    def scheduling(schedule):
        def spied(source, *args, **kwargs):
            scheduled.extend(id(arg) for arg in args if isinstance(arg, dict))
            return schedule(source, *args, **kwargs)
        return spied

    monkeypatch.setattr(ExpertPredictor, "token_forecast", spy)
    for source_class in (SlotExperts, StreamingExperts):
        monkeypatch.setattr(source_class, "_schedule", scheduling(source_class._schedule))
    expected_tokens, _, _ = resident_run(path, device)
    tokens, _, stats = greedy_run(path, device, expert_engine=engine, memory_budget="40%")
    assert tokens == expected_tokens
    assert len(seen) == len(tokens) - 1  # one per decode step (the last token chosen is not run)
    with edge.load(path, device=device) as model:
        transformer = model.transformer
        for (embedding, need, predictor), token in zip(seen, tokens):
            assert np.array_equal(embedding, transformer.backend.embed(transformer.embed_tokens, [token])[0])
            assert list(need) == predictor.order[:1]
            assert id(need) in scheduled  # its prefetches were queued
            (target, scores), = need.items()
            gain, router, bias = predictor.routers[target]
            logits = rms_norm(embedding[None], gain, predictor.eps) @ router.T + (0 if bias is None else bias)
            config = predictor.configs[target]
            probability = softmax(logits.astype(np.float64))[0]
            np.testing.assert_allclose(scores, np.minimum(1.0, config.top_k * probability), rtol=1e-5)
            likeliest = set(np.argsort(-scores, kind="stable")[: config.top_k].tolist())
            assert likeliest == set(route(logits, config)[0][0].tolist())  # the router's own choice
    assert stats["prefetches_queued"] > 0


@pytest.mark.parametrize("device", ["reference", "cpu"])
def test_the_one_call_decode_step_learns_and_forecasts_as_the_separate_calls_do(tiny_zoo, monkeypatch, device):
    """Where the predictor's decode step is compiled, a one-token route's observe, forecast, next-token
    estimate and prefetches run inside the slot table's call (slot_decode_layer), with no observe or
    forecast called from Python: the predictor learns the same counts, scores the same forecasts and
    makes the same number of them as with the separate calls (slot table or Python cache), and the
    tokens stay the resident run's."""
    from streaming.predictor import ExpertPredictor

    path = tiny_zoo.converted(CASE, MIXED)
    expected_tokens, _, _ = resident_run(path, device)
    python_calls = []
    for name in ("observe", "forecast", "observe_and_forecast"):
        def spied(predictor, layer, expert_ids, *args, _method=getattr(ExpertPredictor, name), _name=name, **kwargs):
            python_calls.append((_name, len(expert_ids)))
            return _method(predictor, layer, expert_ids, *args, **kwargs)
        monkeypatch.setattr(ExpertPredictor, name, spied)
    learned = {}
    for run, engine, one_call in (("one call", "compiled", True), ("separate calls", "compiled", False),
                                  ("python cache", "python", False)):
        python_calls.clear()
        with edge.load(path, device=device, memory_budget="40%", expert_engine=engine) as model:
            if engine == "compiled":
                assert model.experts._compiled_predictor
                model.experts._compiled_predictor = one_call
            tokens, _ = greedy_decode(model, PROMPT, 6, capacity=32)
            predictor = model.experts.predictor
            learned[run] = dict(
                counts=[np.array(a) for table in (predictor.temporal, predictor.spatial, predictor.frequency)
                        for a in table.values()],
                drift=np.array(predictor._drift), stats=predictor.stats(), calls=list(python_calls))
        assert tokens == expected_tokens, run
    one_call = learned.pop("one call")
    assert all(n > 1 for _, n in one_call["calls"])  # only the prefill's routes went through Python
    assert one_call["stats"]["predictor_by_distance"][1]["actual"] > 0
    for run, other in learned.items():
        assert any(n == 1 for _, n in other["calls"]), run
        assert all(np.array_equal(a, b) for a, b in zip(one_call["counts"], other["counts"])), run
        np.testing.assert_allclose(one_call["drift"], other["drift"], rtol=1e-5, atol=1e-6)
        assert one_call["stats"] == other["stats"], run
