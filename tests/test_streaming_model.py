"""MoE models under one memory budget: streamed runs equal the all-resident run bit for bit, budgets
below the minimum working set are refused, damaged experts are reported where they are needed."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from tiny_models import greedy_decode, random_prompt

import edge
from converters.convert import QuantPlan
from edge.core.errors import SessionError, ZllmError
from quant.expert_file import EXPERTS_FILE, ExpertChecksumError
from streaming.budget import SCRATCH_TOKENS, Budget, parse_budget
from streaming.prefetch import DEFAULT_THREADS

PROMPT = random_prompt(9, seed=5)
N_DECODE = 6
MIXED = QuantPlan(weights="int8", group_size=32, overrides={"experts": "int4"})
CASES = ("qwen3_moe_norm", "qwen2_moe_shared")


def greedy_run(path: str, device: str, **load_options) -> tuple[list[int], list[np.ndarray], dict]:
    """Prefill (all logits), then greedy decode; the tokens, every logits array and the stats."""
    with edge.load(path, device=device, **load_options) as model:
        return (*greedy_decode(model, PROMPT, N_DECODE, capacity=32), model.stats())


_RESIDENT: dict[tuple[str, str], tuple] = {}


def resident_run(path: str, device: str):
    if (path, device) not in _RESIDENT:
        _RESIDENT[path, device] = greedy_run(path, device)
    return _RESIDENT[path, device]


def minimum_budget(path: str, strategy: str = "predictive", threads: int = DEFAULT_THREADS, device: str = "reference") -> int:
    """The smallest budget a load of `path` under `strategy` accepts. The budget counts the runtime the
    process has loaded (its kernels among it): a load like the budgeted one brings in the same kernels
    first, so the figure is the one the budgeted load will plan with."""
    with edge.load(path, device=device, expert_strategy=strategy, memory_budget="100%",
                   prefetch_threads=threads) as model:
        return model.memory.minimum_bytes


STREAMED = [
    pytest.param(dict(memory_budget="minimum", expert_policy="lru"), id="minimum-predictive-lru"),
    pytest.param(dict(memory_budget="25%", expert_strategy="ondemand", prefetch_threads=2), id="25%-ondemand"),
    pytest.param(dict(memory_budget="50%", expert_policy="forecast"), id="50%-predictive-forecast"),
    pytest.param(dict(memory_budget="30%", prefetch_threads=2), id="30%-predictive-cycle"),
    pytest.param(dict(memory_budget="75%", expert_policy="lfu", storage="nvme", prefetch_threads=3), id="75%-lfu-nvme"),
    pytest.param(dict(memory_budget="40%", expert_strategy="mmap"), id="40%-mmap"),
    pytest.param(dict(memory_budget="100%", expert_strategy="predictive", prefetch_depth=1), id="100%-depth1"),
]


def mapped_resident_bytes(file_path: str) -> int:
    """Bytes of file_path mapped and resident in this process (Linux /proc/self/smaps)."""
    total, in_file = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
                in_file = len(fields) >= 6 and fields[5] == file_path
            elif in_file and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_mmap_strategy_keeps_only_its_cache_share_mapped(tiny_zoo):
    """The plain-mmap strategy's mapped pages of experts.bin stay within its expert share: where the
    page cache holds the file in large folios, one fault maps a whole folio (every expert of a small
    file); the neighbours it brings in are unmapped again."""
    path = tiny_zoo.converted(CASES[0], MIXED)
    with edge.load(path, device="cpu", memory_budget="40%", expert_strategy="mmap") as model:
        session = model.session(capacity=32)
        session.prefill(PROMPT)
        for _ in range(3):
            session.decode(1)
        stats = model.stats()
        mapped = mapped_resident_bytes(os.path.realpath(os.path.join(path, EXPERTS_FILE)))
    assert 0 < mapped <= stats["expert_cache_peak_bytes"] <= stats["expert_cache_bytes"]


@pytest.mark.parametrize("device", ["reference", "cpu"])
@pytest.mark.parametrize("options", STREAMED)
@pytest.mark.parametrize("case", CASES)
def test_streamed_run_is_bit_identical_to_resident(tiny_zoo, case, options, device):
    path = tiny_zoo.converted(case, MIXED)
    options = dict(options)
    if options["memory_budget"] == "minimum":
        options["memory_budget"] = minimum_budget(path, device=device)
    tokens, logits, stats = greedy_run(path, device, **options)
    expected_tokens, expected_logits, _ = resident_run(path, device)
    assert tokens == expected_tokens
    assert all(np.array_equal(got, want) for got, want in zip(logits, expected_logits))
    assert stats["expert_hits"] + stats["expert_misses"] > 0
    assert stats["expert_misses"] > 0 or options["memory_budget"] == "100%"
    assert stats["budget_bytes"] is not None and stats["peak_rss_bytes"] > 0
    assert stats["expert_cache_peak_bytes"] <= stats["expert_cache_bytes"]


def test_compressed_experts_stream_bit_identically(tiny_zoo):
    plain = tiny_zoo.converted("qwen3_moe_norm", MIXED)
    packed = tiny_zoo.converted("qwen3_moe_norm", MIXED, compress_experts=True)
    tokens, logits, stats = greedy_run(packed, "reference", memory_budget="30%", prefetch_threads=2)
    expected_tokens, expected_logits, _ = resident_run(plain, "reference")
    assert tokens == expected_tokens
    assert all(np.array_equal(got, want) for got, want in zip(logits, expected_logits))
    assert stats["bytes_read"] > 0 and stats["io_mode"] == "direct"


def test_stats_report_the_streaming_figures(tiny_zoo):
    path = tiny_zoo.converted("qwen3_moe_norm", MIXED)
    _, _, stats = greedy_run(path, "reference", memory_budget="50%", storage="custom:bw=200MB,lat=100us")
    for key in ("expert_hits", "expert_misses", "hit_rate", "predictor_precision", "predictor_recall", "bytes_read",
                "io_stall_seconds", "io_hidden_fraction", "peak_rss_bytes", "budget_bytes", "expert_cache_bytes"):
        assert stats[key] is not None, key
    assert stats["hit_rate"] == stats["expert_hits"] / (stats["expert_hits"] + stats["expert_misses"])
    assert 0.0 <= stats["io_hidden_fraction"] <= 1.0 and 0.0 <= stats["predictor_recall"] <= 1.0
    assert stats["storage"] == "custom:bw=200MB,lat=100us (200 MB/s, 100 us)"
    assert stats["io_mode"] == "direct" and stats["expert_source"] == "predictive"
    assert stats["expert_policy"] == "nextuse"  # the predictive strategy's default
    plan = stats["memory_plan"]
    assert stats["budget_bytes"] == (plan["runtime_bytes"] + plan["dense_bytes"] + plan["tokenizer_bytes"] + plan["kv_bytes"]
                                     + plan["scratch_bytes"] + plan["staging_bytes"] + plan["predictor_bytes"]
                                     + plan["expert_cache_bytes"])
    assert plan["predictor_bytes"] > 0
    assert plan["expert_cache_bytes"] == -(-plan["expert_bytes"] // 2)


def test_budget_below_minimum_is_refused(tiny_zoo):
    path = tiny_zoo.converted("qwen3_moe_norm", MIXED)
    minimum = minimum_budget(path)
    edge.load(path, memory_budget=minimum).close()
    with edge.load(path, memory_budget=minimum) as model:
        plan = model.memory
        entry = plan.expert_bytes // 16  # 2 MoE layers of 8 experts, all the same size
    with pytest.raises(ZllmError) as error:
        edge.load(path, memory_budget=minimum - 1)
    assert str(error.value) == (
        f"memory budget {minimum - 1} bytes ({(minimum - 1) / 1e6:.1f} MB) is below this model's minimum working set "
        f"of {minimum} bytes ({minimum / 1e6:.1f} MB): {plan.runtime_bytes} bytes of runtime, "
        f"{plan.dense_bytes} bytes of non-expert weights, "
        f"0 bytes of tokenizer, {plan.kv_bytes} bytes of KV cache ({plan.kv_capacity} positions), "
        f"{plan.scratch_bytes} bytes of scratch, {plan.predictor_bytes} bytes of expert predictor and "
        f"{(2 + DEFAULT_THREADS) * entry} bytes for {2 + DEFAULT_THREADS} experts of layer 0 at once "
        f"(top_k 2 + {DEFAULT_THREADS} loading threads, of its 8); "
        f"raise memory_budget to at least {minimum} bytes")
    with pytest.raises(ZllmError) as error:  # never more experts at once than the layer has
        edge.load(path, memory_budget=minimum, prefetch_threads=12)
    assert f"{8 * entry} bytes for 8 experts of layer 0 at once (top_k 2 + 12 loading threads, of its 8)" in \
        str(error.value)
    with pytest.raises(ZllmError) as error:
        edge.load(path, memory_budget="10%")  # 10% of 16 experts holds fewer than the 6 needed at once
    assert str(error.value).startswith("memory budget ") and f"minimum working set of {minimum} bytes" in str(error.value)
    with pytest.raises(ZllmError) as error:
        edge.load(path, memory_budget="50%", expert_strategy="resident")
    assert "for every expert (resident)" in str(error.value)


def test_bad_streaming_options_are_refused(tiny_zoo):
    path = tiny_zoo.converted("qwen3_moe_norm", MIXED)
    with pytest.raises(ZllmError) as error:
        edge.load(path, memory_budget="50%", expert_strategy="ondemand", expert_policy="forecast")
    assert str(error.value) == ("expert_policy 'forecast' needs the expert predictor; use expert_strategy "
                                "'predictive' or expert_policy 'lru' or 'lfu'")
    with pytest.raises(ZllmError) as error:
        edge.load(path, memory_budget="50%", expert_strategy="swap")
    assert str(error.value) == "expert_strategy 'swap' is not known; choose one of predictive, ondemand, mmap, resident"
    with pytest.raises(ZllmError) as error:
        edge.load(path, memory_budget="150%")
    assert str(error.value) == "memory budget '150%': a share of the expert bytes must be in (0%, 100%]"
    packed = tiny_zoo.converted("qwen3_moe_norm", MIXED, compress_experts=True)
    with pytest.raises(ZllmError) as error:
        edge.load(packed, memory_budget="50%", expert_strategy="mmap")
    assert str(error.value) == (f"{os.path.join(packed, EXPERTS_FILE)}: expert_strategy 'mmap' uses experts in place, "
                                "but this checkpoint stores them zstd-compressed; convert without --compress-experts, "
                                "or use expert_strategy 'predictive' or 'ondemand'")


def test_default_strategy_streams_only_what_the_budget_cannot_hold(tiny_zoo):
    path = tiny_zoo.converted("qwen3_moe_norm", MIXED)
    with edge.load(path, memory_budget="100%") as model:
        assert model.expert_strategy == "resident"
        assert model.memory.budget_bytes >= model.memory.minimum_bytes
    with edge.load(path, memory_budget="50%") as model:
        assert model.expert_strategy == "predictive"
    with edge.load(path) as model:
        assert model.expert_strategy == "resident" and model.memory.budget_bytes is None


def test_sessions_beyond_the_kv_reservation_are_refused(tiny_zoo):
    path = tiny_zoo.converted("qwen3_moe_norm", MIXED)
    with edge.load(path, memory_budget="50%", kv_capacity=48) as model:
        first = model.session(capacity=32)
        with pytest.raises(SessionError) as error:
            model.session(capacity=32)
        assert str(error.value) == ("a session of 32 positions does not fit the memory budget: it reserves 48 KV "
                                    "positions and open sessions hold 32; close a session (or an unfinished "
                                    "generation: generation.close()), or load with a larger kv_capacity and "
                                    "memory_budget (--kv-capacity, --memory-budget)")
        assert model.session().capacity == 16  # the default takes what is left
        del first


def test_dense_model_budget_counts_weights_kv_and_scratch(tiny_zoo):
    path = tiny_zoo.converted("llama_mha", QuantPlan(weights="int8"))
    with edge.load(path) as model:
        plan = model.memory
    with pytest.raises(ZllmError) as error:
        edge.load(path, memory_budget=plan.minimum_bytes - 1)
    assert str(error.value) == (
        f"memory budget {plan.minimum_bytes - 1} bytes ({(plan.minimum_bytes - 1) / 1e6:.1f} MB) is below this "
        f"model's minimum working set of {plan.minimum_bytes} bytes ({plan.minimum_bytes / 1e6:.1f} MB): "
        f"{plan.runtime_bytes} bytes of runtime, {plan.dense_bytes} bytes of weights, 0 bytes of tokenizer, "
        f"{plan.kv_bytes} bytes of KV cache ({plan.kv_capacity} positions) "
        f"and {plan.scratch_bytes} bytes of scratch; raise memory_budget to at least {plan.minimum_bytes} bytes")
    with pytest.raises(ZllmError) as error:
        edge.load(path, memory_budget="50%")
    assert str(error.value) == ("memory budget 50%: a share of the expert bytes needs a Mixture-of-Experts model; "
                                "give this dense model a budget in bytes such as 512MB")


@pytest.mark.parametrize("strategy", ["predictive", "ondemand"])
def test_corrupted_expert_is_reported_when_needed(tiny_zoo, tmp_path, strategy):
    path = tmp_path / "damaged"
    shutil.copytree(tiny_zoo.converted("qwen3_moe_norm", MIXED), path)
    with open(path / "zllm.json") as f:
        records = json.load(f)["experts"]["layers"]["1"]["records"]
    with open(path / EXPERTS_FILE, "r+b") as f:
        for offset, length, _ in records:  # every expert of layer 1: the route cannot avoid them
            f.seek(offset + length // 2)
            byte = f.read(1)
            f.seek(offset + length // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
    with edge.load(path, memory_budget="50%", expert_strategy=strategy) as model:  # loading reads no expert
        session = model.session(capacity=16)
        with pytest.raises(ExpertChecksumError) as error:
            session.prefill(PROMPT)
    message = str(error.value)
    assert message.startswith(f"{path / EXPERTS_FILE}: layer 1 expert ")
    assert message.endswith(" fails its crc32 check; the checkpoint is damaged, convert it again")


def test_budget_forms():
    assert parse_budget(None) is None
    assert parse_budget(123) == Budget(bytes=123)
    assert parse_budget("512MB") == Budget(bytes=512_000_000)
    assert parse_budget("1.5GiB") == Budget(bytes=int(1.5 * 1024**3))
    assert parse_budget(" 50 % ") == Budget(expert_percent=50.0)
    for bad in ("lots", "0%", "12 parsecs"):
        with pytest.raises(ZllmError):
            parse_budget(bad)
    with pytest.raises(ZllmError) as error:
        parse_budget("lots")
    assert str(error.value) == ("memory budget 'lots' not understood; use bytes, a size such as 512MB or 2GiB, or a "
                                "share of the expert bytes such as 50%")


def test_budget_counts_the_tokenizer(smollm2_checkpoint):
    """The tokenizer's memory (tens of MB for a 49k vocabulary) is part of the budget, and the same
    figure on every load in a process."""
    plans = []
    for _ in range(2):
        with edge.load(smollm2_checkpoint, memory_budget="2GB") as model:
            plans.append(model.memory)
    first = plans[0]
    assert first.tokenizer_bytes > 1_000_000 and plans[1] == first
    assert first.minimum_bytes == (first.runtime_bytes + first.dense_bytes + first.tokenizer_bytes + first.kv_bytes
                                   + first.scratch_bytes)


def test_budget_counts_the_expert_predictor(tiny_zoo):
    """The plan's predictor_bytes covers the arrays the predictor keeps (it may round up: a bias and a
    spatial table are counted for every layer)."""
    path = tiny_zoo.converted("qwen3_moe_norm", MIXED)
    with edge.load(path, memory_budget="50%") as model:
        predictor, planned = model.experts.predictor, model.memory.predictor_bytes
        arrays = [a for gain, router, bias in predictor.routers.values() for a in (gain, router, bias) if a is not None]
        arrays += [*predictor._tables, *predictor._first_router]  # its state tables, the embedding's router
        held = sum(a.nbytes for a in arrays)
    assert held <= planned <= 1.25 * held


@pytest.mark.parametrize("case, plan", [("llama_mha", QuantPlan(weights="int8")), ("qwen3_moe_norm", MIXED)])
def test_budget_scratch_covers_the_cpu_executors_buffers(tiny_zoo, case, plan):
    """What the fused CPU executor allocates for a forward call of SCRATCH_TOKENS tokens over the
    budget's KV capacity, two threads' prefill tiles included, fits in the scratch the budget reserves."""
    path = tiny_zoo.converted(case, plan)
    # (the budget counts the process's runtime, which in a whole test run holds every earlier test's imports)
    with edge.load(path, device="cpu", threads=2, memory_budget="2GB") as model:
        session = model.session()
        session.prefill(random_prompt(min(SCRATCH_TOKENS, session.capacity), seed=3))
        buffers = vars(model.transformer._fused_forward.scratch)
        allocated = sum(array.nbytes for array in buffers.values() if isinstance(array, np.ndarray))
        assert buffers["tiles"].shape[0] == 2
        assert session.capacity == model.memory.kv_capacity
        assert 0 < allocated <= model.memory.scratch_bytes
