"""The cpu device gives the same bits every run and in every process: whether its kernels were
compiled in the process or loaded from Numba's cache, whatever was compiled before them, on an idle
machine or beside a CPU hog (kernels/cpu/runtime.py: every kernel calls its own copies of its
helpers; forward.py and attention.py: threads split work by rows and tasks, never inside a sum).

Each probe is a fresh process that loads SmolLM2 (Q4_1, plain "cpu": int8 activations where the
CPU has an int8 dot-product instruction) and a tiny Mixtral (int4 experts) on 2 threads, and hashes
the logits of a prefill and of greedy decode steps. Probes: cold (an empty home: every kernel
compiled), warm (the same home: every kernel loaded), warm beside a CPU hog (a busy loop per core),
and cold in another home with another order (the MoE and cpu:f32 SmolLM2 first, so that the helpers
compile first inside other kernels). All four hashes must be equal.

The bug this guards against showed on AVX2 and not on AVX-512 (different helper copies happened
to agree there), so on a machine above AVX2 the probes also run with the kernels capped at AVX2
(ZLLM_EDGE_ISA, kernels/cpu/isa.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from converters.convert import QuantPlan
from tiny_models import tiny_zoo  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
PROBE = r"""
import hashlib, json, sys
import numpy as np
import edge

smollm2, moe, order = sys.argv[1], sys.argv[2], sys.argv[3]


def digest(path, device, prompt):
    with edge.load(path, device=device, threads=2) as model:
        session = model.session(capacity=64)
        logits = session.prefill(prompt, all_logits=True)
        h = hashlib.sha256(logits.tobytes())
        token = int(np.argmax(logits[-1]))
        for _ in range(8):
            step = session.decode(token)
            h.update(step.tobytes())
            token = int(np.argmax(step))
        return h.hexdigest(), model.device_info()["isa"]


prompt = [int(i) for i in np.random.default_rng(0).integers(3, 160, 40)]
if order == "moe-first":
    results = {"moe": digest(moe, "cpu", prompt), "smollm2-f32": digest(smollm2, "cpu:f32", prompt)}
    results["smollm2"] = digest(smollm2, "cpu", prompt)
else:
    results = {"smollm2": digest(smollm2, "cpu", prompt), "moe": digest(moe, "cpu", prompt)}
print(json.dumps({name: results[name] for name in ("smollm2", "moe")}))
"""


def levels() -> list[str | None]:
    from kernels.cpu import isa

    host = isa.host_level()
    below = isa.architecture() == "x86_64" and host in ("avxvnni", "avx512")
    return [None] + (["avx2"] if below else [])


def probe(home: Path, level: str | None, smollm2: Path, moe: str, order: str, hog: bool = False) -> dict:
    env = {**os.environ, "ZLLM_EDGE_HOME": str(home), "PYTHONPATH": str(REPO)}
    env.pop("ZLLM_EDGE_ISA", None)
    if level is not None:
        env["ZLLM_EDGE_ISA"] = level
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)] \
        if hog else []
    try:
        time.sleep(0.2 if hog else 0)
        result = subprocess.run([sys.executable, "-c", PROBE, str(smollm2), moe, order], env=env, capture_output=True,
                                text=True, timeout=900)
    finally:
        for process in hogs:
            process.kill()
            process.wait()
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("level", levels(), ids=lambda level: level or "host")
def test_cpu_bits_do_not_depend_on_the_cache_the_order_or_the_load(level, smollm2_checkpoint, tiny_zoo, tmp_path):
    moe = tiny_zoo.converted("mixtral", QuantPlan(weights="int4"))
    cold = probe(tmp_path / "home", level, smollm2_checkpoint, moe, "smollm2-first")
    if level is not None:
        assert {isa for _, isa in cold.values()} == {level}
    warm = probe(tmp_path / "home", level, smollm2_checkpoint, moe, "smollm2-first")
    busy = probe(tmp_path / "home", level, smollm2_checkpoint, moe, "smollm2-first", hog=True)
    reordered = probe(tmp_path / "other-home", level, smollm2_checkpoint, moe, "moe-first")
    assert warm == cold, "kernels loaded from the cache give other bits than the same kernels compiled"
    assert busy == cold, "a busy machine changes the bits"
    assert reordered == cold, "the order kernels were compiled in changes the bits"
