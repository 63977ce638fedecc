"""The runtime's own memory (edge/core/process_memory.py): each part measured once per process, a part
loaded inside another's measurement counted in that one, and the first load's parts in the plan."""
from __future__ import annotations

import numpy as np

import edge
from edge.core.process_memory import RuntimeMemory, runtime_memory

MB = 1 << 20


def test_a_part_is_measured_once_and_nested_parts_count_in_the_outer_one():
    meter = RuntimeMemory()
    kept = []
    with meter.measure("backend test"):
        kept.append(np.ones(16 * MB, np.uint8))  # touched: it grows the resident set
        with meter.measure("kernel inner"):
            kept.append(np.ones(8 * MB, np.uint8))
    assert set(meter.parts()) == {"backend test"}  # the inner part is the outer one's
    assert meter.parts()["backend test"] >= 20 * MB
    first = meter.total()
    with meter.measure("backend test"):  # measured before: not again
        kept.append(np.ones(16 * MB, np.uint8))
    assert meter.total() == first
    meter.record("imports x", -5)  # a shrinking resident set counts as nothing
    assert meter.parts()["imports x"] == 0
    assert meter.by_kind() == {"backend": first, "imports": 0}


def test_a_load_counts_the_runtime_in_its_plan(tiny_zoo):
    from converters.convert import QuantPlan

    path = tiny_zoo.converted("qwen3_moe_norm", QuantPlan(weights="int8"))
    with edge.load(path, device="cpu", memory_budget="50%") as model:
        plan, stats = model.memory, model.stats()
    kinds = runtime_memory.by_kind()
    assert {"imports", "backend", "kernel"} <= set(kinds)
    assert plan.runtime_bytes == runtime_memory.total() == sum(kinds.values()) > 0
    assert stats["runtime_bytes_by_kind"] == kinds
    assert plan.budget_bytes == (plan.runtime_bytes + plan.dense_bytes + plan.tokenizer_bytes + plan.kv_bytes
                                 + plan.scratch_bytes + plan.staging_bytes + plan.predictor_bytes
                                 + plan.expert_cache_bytes)
