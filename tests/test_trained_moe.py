"""benchmarks/trained_moe.py: the routing statistics it reports, and its build of a trained MoE (here a
tiny recipe trained for two steps): trained, saved, converted, loadable with its tokenizer, and trained
only once. (The real recipe's training and sweep belong to the benchmark, not to the suite.)"""
from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import trained_moe  # noqa: E402

import edge  # noqa: E402

TINY = trained_moe.TrainedMoeRecipe(layers=2, hidden=64, experts=8, expert_intermediate=64, top_k=2, heads=2,
                                    kv_heads=1, head_dim=32, vocab=384, context=64, batch=2, steps=2, warmup_steps=1)


def test_routing_statistics_of_known_routes():
    same = [{0: [0, 1], 3: [4, 5]}] * 5
    stats = trained_moe.routing_statistics(same, experts=8, top_k=2)
    assert stats["reuse_share"] == 1.0 and stats["chance_reuse_share"] == 0.25
    assert stats["max_load_over_mean"] == pytest.approx(4.0)  # two of eight experts take every use
    assert stats["load_entropy"] == pytest.approx(math.log(2) / math.log(8))
    alternating = [{0: [0, 1]}, {0: [2, 3]}, {0: [0, 1]}, {0: [2, 3]}]
    stats = trained_moe.routing_statistics(alternating, experts=4, top_k=2)
    assert stats["reuse_share"] == 0.0 and stats["max_load_over_mean"] == pytest.approx(1.0)
    assert stats["load_entropy"] == pytest.approx(1.0)
    half = [{0: [0, 1]}, {0: [1, 2]}]
    assert trained_moe.routing_statistics(half, experts=4, top_k=2)["reuse_share_by_layer"] == {0: 0.5}


def test_the_training_text_holds_the_benchmark_prompts_out():
    train, held = trained_moe.documentation()
    assert len(held) == len(trained_moe.WORKLOAD_TOPICS) and all(held)
    assert not set(held) & set(train)
    assert sum(map(len, train)) > 1_000_000  # the topics and the standard library's docstrings


def test_a_trained_moe_is_built_once_and_loads(tmp_path, monkeypatch):
    path = trained_moe.trained_moe_checkpoint(str(tmp_path), TINY, threads=1, progress=False)
    with open(os.path.join(path + ".hf", "training.json")) as f:
        training = json.load(f)
    assert [entry["step"] for entry in training["log"]] == [0, 1]
    assert all(np.isfinite([entry["loss"] for entry in training["log"]])) and np.isfinite(training["held_out_loss"])
    assert trained_moe.moe_shape(path) == (TINY.experts, TINY.top_k)
    text = "def f(x):\n    return x  # ünïcode"
    with edge.load(path, device="reference") as model:
        assert model.tokenizer.decode(model.tokenizer.encode(text, add_special_tokens=False)) == text
        with model.session(capacity=16) as session:
            assert np.isfinite(session.prefill(model.tokenizer.encode(text)[:8])).all()

    def no_training(*args, **kwargs):
        raise AssertionError("trained again")

    monkeypatch.setattr(trained_moe, "train", no_training)
    assert trained_moe.trained_moe_checkpoint(str(tmp_path), TINY, progress=False) == path  # kept
    os.rename(path, path + ".old")  # a lost checkpoint is converted again from the kept folder
    assert trained_moe.trained_moe_checkpoint(str(tmp_path), TINY, progress=False) == path
    assert os.path.isfile(os.path.join(path, "zllm.json"))
