"""Long runs do not leak: sessions opened and closed by the dozen, and thousands of decoded tokens,
leave the process's open files and its RSS where they were after a warm-up, on `cpu` and with
streamed experts. (`benchmarks/moe_long_decode.py` prints the RSS curve of a long streamed decode.)"""
from __future__ import annotations

import os

import numpy as np
import psutil
import pytest
from tiny_models import CONTEXT, random_prompt, tiny_zoo  # noqa: F401

import edge
from converters.convert import QuantPlan

INT8 = QuantPlan(weights="int8", group_size=32)
MIXED = QuantPlan(weights="int8", group_size=32, overrides={"experts": "int4"})
RSS_GROWTH = 8 << 20  # bytes: allocator noise, far below what a leak of a session or a KV per round would add


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rounds(model, rounds: int, seed: int) -> int:
    """`rounds` sessions, each opened, run to the model's context and closed: -> decode steps run."""
    steps, prompt = 0, random_prompt(8, seed=seed)
    for _ in range(rounds):
        with model.session(capacity=CONTEXT) as session:
            token = int(np.argmax(session.prefill(prompt)))
            while session.position < CONTEXT:
                token = int(np.argmax(session.decode(token)))
                steps += 1
    return steps


@pytest.mark.parametrize("case, plan, options", [
    ("llama_gqa_tied", INT8, {"device": "cpu"}),
    ("qwen3_moe_norm", MIXED, {"device": "cpu", "memory_budget": "50%", "storage": "nvme"}),
])
def test_sessions_by_the_dozen_and_decode_steps_by_the_thousand_do_not_leak(tiny_zoo, case, plan, options):
    process = psutil.Process()
    with edge.load(tiny_zoo.converted(case, plan), **options) as model:
        _rounds(model, 8, seed=1)  # warm-up: kernels, scratch, caches reach their size
        files, rss = _open_files(), process.memory_info().rss
        steps = _rounds(model, 36, seed=2)
        assert steps >= 2000
        assert _open_files() == files
        assert process.memory_info().rss - rss < RSS_GROWTH


@pytest.mark.parametrize("case, plan, options", [
    ("llama_gqa_tied", INT8, {"device": "reference"}),
    ("llama_gqa_tied", INT8, {"device": "cpu"}),
    ("qwen3_moe_norm", MIXED, {"device": "cpu", "memory_budget": "50%", "storage": "nvme"}),
    ("qwen3_moe_norm", MIXED, {"device": "reference", "memory_budget": "50%", "storage": "nvme"}),
])
def test_threads_sharing_a_model_get_the_tokens_they_would_get_alone(tiny_zoo, case, plan, options):
    """One model, several threads, each with its own session: forward passes are serialised by the
    model (a prefill or a decode step at a time, so sessions interleave step by step), and each
    thread's greedy tokens are the ones it gets running alone."""
    import threading

    prompts = [random_prompt(6 + i, seed=20 + i) for i in range(4)]
    capacity = CONTEXT // len(prompts)  # (under a memory budget, the sessions share the context's KV)

    def greedy(model, prompt) -> list[int]:
        with model.session(capacity=capacity) as session:
            tokens = [int(np.argmax(session.prefill(prompt)))]
            while session.position < capacity:
                tokens.append(int(np.argmax(session.decode(tokens[-1]))))
        return tokens

    with edge.load(tiny_zoo.converted(case, plan), **options) as model:
        alone = [greedy(model, prompt) for prompt in prompts]
        together: list = [None] * len(prompts)
        errors: list = []

        def run(i: int) -> None:
            try:
                together[i] = greedy(model, prompts[i])
            except BaseException as exc:  # reported below, not lost in the thread
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors, errors
    assert together == alone
