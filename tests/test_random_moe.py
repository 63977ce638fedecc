"""The random MoE shapes of `zllm-edge bench --random-moe` (edge/random_moe.py): the named shapes'
source builds a checkpoint that runs, the same bytes every time, with the named model's sizes."""
from __future__ import annotations

import hashlib
import os

import numpy as np

import edge
from edge.random_moe import SHAPES, RandomMoeShape, random_moe_checkpoint
from quant.checkpoint import read_manifest

TINY = RandomMoeShape(layers=2, experts=8, top_k=2, hidden=128, expert_intermediate=64, heads=4, kv_heads=2,
                      vocab=256, context=256, label="tiny")


def _digest(path: str) -> str:
    return hashlib.sha256(open(os.path.join(path, "experts.bin"), "rb").read()).hexdigest()


def test_a_named_shape_builds_a_checkpoint_that_streams_as_it_runs_resident(tmp_path):
    path = random_moe_checkpoint(os.fspath(tmp_path / "a"), TINY, progress=False)
    manifest = read_manifest(path)
    model = manifest["model"]
    assert (model["model_type"], model["num_hidden_layers"], model["num_local_experts"], model["num_experts_per_tok"],
            model["hidden_size"], model["intermediate_size"]) == ("mixtral", 2, 8, 2, 128, 64)
    runs = {}
    for name, options in (("reference", {"device": "reference"}), ("resident", {"device": "cpu"}),
                          ("streamed", {"device": "cpu", "memory_budget": "50%", "storage": "nvme"})):
        with edge.load(path, **options) as loaded:
            session = loaded.session()
            tokens = [int(np.argmax(session.prefill([1, 2, 3, 4])))]
            for _ in range(8):
                tokens.append(int(np.argmax(session.decode(tokens[-1]))))
            runs[name] = tokens
    assert runs["reference"] == runs["resident"] == runs["streamed"]
    assert len(set(runs["resident"])) > 2  # the routes change from token to token
    again = random_moe_checkpoint(os.fspath(tmp_path / "b"), TINY, progress=False)
    assert _digest(again) == _digest(path)  # seeded per tensor: the same model every time


def test_the_named_shapes_have_their_models_sizes():
    olmoe, qwen = SHAPES["olmoe-1b-7b"], SHAPES["qwen3-30b-a3b"]
    sizes = lambda shape: (shape.layers, shape.hidden, shape.experts, shape.expert_intermediate, shape.top_k)  # noqa: E731
    assert sizes(olmoe) == (16, 2048, 64, 1024, 8)
    assert sizes(qwen) == (48, 2048, 128, 768, 8)
    assert 3.4e9 < olmoe.expert_int4_bytes < 3.8e9 and 15e9 < qwen.expert_int4_bytes < 17e9


BUILD_IN_A_CHILD = """
import sys
sys.path.insert(0, {root!r})
from edge.random_moe import RandomMoeShape, random_moe_checkpoint
shape = RandomMoeShape(**{shape!r})
print(random_moe_checkpoint({home!r}, shape, progress=False))
"""


def test_processes_building_one_model_at_once_build_it_once(tmp_path):
    """Processes asking for the same model in one home while another holds its lock wait for it,
    saying for whom; then one of them builds it and the other uses the finished checkpoint."""
    import dataclasses
    import subprocess
    import sys
    import time

    from edge.core.files import exclusive

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = BUILD_IN_A_CHILD.format(root=root, shape=dataclasses.asdict(TINY), home=os.fspath(tmp_path))
    path = os.fspath(tmp_path / "models" / TINY.name)
    with exclusive(path + ".lock", "building the random MoE"):
        children = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True) for _ in range(2)]
        time.sleep(3)  # both are waiting now (their imports take about a second)
        assert not os.path.exists(path)
    results = [child.communicate(timeout=600) + (child.returncode,) for child in children]
    assert [code for _, _, code in results] == [0, 0], [err for _, err, _ in results]
    assert [out.strip() for out, _, _ in results] == [path, path]
    errors = "".join(err for _, err, _ in results)
    assert errors.count(f"waiting for process {os.getpid()}, which is building the random MoE into {path}") == 2
    assert errors.count(f"building the random MoE {TINY.name} into") == 1  # built once
    assert _digest(path) == _digest(random_moe_checkpoint(os.fspath(tmp_path / "alone"), TINY, progress=False))


def test_a_lock_left_by_a_dead_process_does_not_block(tmp_path):
    from edge.core.files import exclusive

    lock = tmp_path / "model.lock"
    lock.write_text("999999999")  # a pid no process has: its owner died without removing the file
    with exclusive(os.fspath(lock), "building the model"):
        assert lock.read_text() == str(os.getpid())


def test_a_damaged_model_in_the_home_is_built_again(tmp_path, capsys):
    path = random_moe_checkpoint(os.fspath(tmp_path), TINY, progress=False)
    expected = _digest(path)
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) - 100)
    capsys.readouterr()
    assert random_moe_checkpoint(os.fspath(tmp_path), TINY, progress=False) == path
    err = capsys.readouterr().err
    assert f"building the random MoE {TINY.name} into {path} (the one there is damaged ({path}: model.safetensors has " \
           in err and "building it again" in err
    assert _digest(path) == expected
    with edge.load(path, device="reference") as model:
        assert np.isfinite(model.session(capacity=8).prefill([1, 2, 3])).all()
