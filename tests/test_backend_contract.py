"""The backend contract (edge/core/contract.py): a backend declares its capabilities in one value, a fused
executor is given a ForwardModel (never the model object), which forward path a model runs on a device
is said in device_info() and at load, and running a checkpoint needs nothing of converters/."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from test_cli import run_cli
from tiny_models import random_prompt

import edge
from converters.convert import QuantPlan
from devices.base import BACKENDS
from devices.reference import ReferenceBackend
from edge.core.contract import Capabilities, ForwardModel
from edge.options import LoadOptions

F32 = QuantPlan(weights="f32")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def dense(tiny_zoo) -> str:
    return tiny_zoo.converted("llama_gqa_tied", F32)


@pytest.mark.parametrize("device", ["reference", "cpu"])
def test_every_backend_declares_its_capabilities(dense, device):
    with edge.load(dense, device=device) as model:
        capabilities = model.backend.capabilities
        assert isinstance(capabilities, Capabilities)
        assert capabilities.threads == (None if device == "reference" else model.backend.threads)
        assert model.backend.expert_backend is model.backend


class Recording(ReferenceBackend):
    """device "recording": the reference, keeping what compile_forward was given."""

    name = "recording"
    given: list = []

    def compile_forward(self, model):
        Recording.given.append(model)
        return None, "ops: recorded"


def test_a_fused_executor_is_given_a_forward_model_not_the_model(monkeypatch, tiny_zoo):
    monkeypatch.setitem(BACKENDS, "recording", f"{__name__}:Recording")
    Recording.given = []
    path = tiny_zoo.converted("qwen3_moe_norm", F32)
    with edge.load(path, device="recording") as model:
        model.generate(random_prompt(5), max_new_tokens=2).result
        given = Recording.given[-1]
        assert type(given) is ForwardModel
        assert given.layers is model.transformer.layers and given.rope is model.transformer.rope
        moe_layers = [i for i, layer in enumerate(given.layers) if layer.moe is not None]
        assert moe_layers and given.moe is model.transformer.moe
        assert model.device_info()["forward"] == "ops: recorded"


def test_cpu_runs_the_fused_executor_and_says_so(dense):
    with edge.load(dense, device="cpu") as model:
        assert model.device_info()["forward"] == "fused"
    with edge.load(dense, device="reference") as model:
        assert model.device_info()["forward"] == "ops: the numpy oracle is the op-by-op composition"


@pytest.mark.parametrize("case, options, reason", [
    ("deepseek_v2_mla", {}, "ops: MLA attention"),
    ("llama_gqa_tied", {"kv_cache": "int8"}, "ops: int8 KV cache"),
    ("olmoe", {}, "ops: q/k norm over the whole projection"),
])
def test_an_op_by_op_path_on_the_cpu_is_never_silent(tiny_zoo, caplog, case, options, reason):
    path = tiny_zoo.converted(case, F32)
    with caplog.at_level(logging.WARNING, logger="zllm.edge"):
        with edge.load(path, device="cpu", **options) as model:
            assert model.device_info()["forward"] == reason
            model.generate(random_prompt(4), max_new_tokens=2).result
    said = [r.getMessage() for r in caplog.records if r.name == "zllm.edge"]
    assert said == [f"device 'cpu' runs {os.path.basename(path)} op by op ({reason.removeprefix('ops: ')})"]


def test_sliding_window_sessions_longer_than_the_window_are_named(tiny_zoo):
    path = tiny_zoo.converted("mistral_swa4", F32)
    with edge.load(path, device="cpu") as model:
        window = min(w for w in (model.spec.sliding_window_for_layer(i) for i in range(model.spec.num_hidden_layers))
                     if w is not None)
        assert model.device_info()["forward_long_sessions"] == (
            f"ops: sessions of more than {window} positions (ring-buffered sliding-window layers)")


def test_the_predictor_says_how_it_forecasts(tiny_zoo):
    path = tiny_zoo.converted("qwen3_moe_norm", F32)
    with edge.load(path, device="cpu", memory_budget="50%") as model:
        assert model.expert_strategy == "predictive"
        assert model.device_info()["expert_forecast"] == "compiled"
    with edge.load(path, device="cpu") as model:  # every expert resident: no predictor
        assert "expert_forecast" not in model.device_info()


def test_generate_json_carries_the_forward_path(smollm2_checkpoint, capsys):
    code, out, err = run_cli(capsys, "generate", smollm2_checkpoint, "The capital of France is", "--device", "cpu",
                             "--max-new-tokens", "2", "--json")
    assert (code, err) == (0, "")
    assert json.loads(out)["device"]["forward"] == "fused"


def test_load_options_are_one_value_checked_once(dense):
    options = LoadOptions.of(device="cpu", threads=2, memory_budget="50%", prefetch_depth=3)
    assert options.threads == 2 and options.streaming.prefetch_depth == 3
    with pytest.raises(edge.InvalidArgumentError, match="edge.load got unknown settings devce"):
        edge.load(dense, devce="cpu")
    with pytest.raises(edge.InvalidArgumentError, match="not both"):
        edge.load(dense, options=options, device="cpu")
    with edge.load(dense, options=LoadOptions.of(device="cpu")) as model:
        assert model.options.device == "cpu"
    with edge.load(dense, "cpu", 1) as model:  # the first settings by position, as edge.load always took them
        assert (model.options.device, model.options.threads) == ("cpu", 1)
    with pytest.raises(edge.InvalidArgumentError, match="device both by position and by name"):
        edge.load(dense, "cpu", device="reference")


def test_running_a_checkpoint_imports_nothing_of_the_converters(dense):
    """Loading and generating are the reader's work (quant/checkpoint.py): converters/ stays unimported."""
    script = ("import sys, edge\n"
              f"model = edge.load({dense!r}, device='cpu')\n"
              "model.generate([1, 2, 3], max_new_tokens=2).result\n"
              "print(sorted(m for m in sys.modules if m == 'converters' or m.startswith('converters.')))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
