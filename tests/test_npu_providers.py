"""Real non-default execution providers, each in its own virtualenv, and a peer exporter.

Each provider's wheel replaces or extends onnxruntime, so it gets a virtualenv of its own under
~/.cache/zllm-edge/venvs (created once, reused by later runs; --system-site-packages, so numpy,
onnx, torch and this project come from the main environment). A provider whose wheel cannot be
installed here is skipped with the pip error as the reason. The checks run
tests/npu_provider_check.py inside the virtualenv.

- OpenVINO (onnxruntime-openvino, OpenVINO's CPU device, precision ACCURACY = float32): MatMulNBits
  graphs and a whole tiny Llama (standard attention form) run entirely inside OpenVINO. Bound for
  one matmul: (K + 4) 2^-24 sum|x||w| (float32, see test_npu_packing.py); for the model REL_TOL 1e-4.
- QNN (onnxruntime-qnn, HTP simulator, float16 precision): the float MatMul graph runs on QNN.
  Bound: (K + 4) 2^-11 sum|x||w| (inputs and products rounded to float16, float32 accumulation).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from converters.convert import QuantPlan

ROOT = Path(__file__).resolve().parent.parent
CHECK = Path(__file__).resolve().parent / "npu_provider_check.py"
VENVS = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zllm-edge" / "venvs"
PROVIDER_WHEELS = {"openvino": "onnxruntime-openvino==1.24.1", "qnn": "onnxruntime-qnn==2.7.0"}
K = 200


def provider_venv(name: str, requirement: str) -> Path:
    """A virtualenv with `requirement` installed, created once and reused; skip when pip cannot."""
    folder = VENVS / f"{name}-{requirement.replace('==', '-')}"
    python = folder / "bin" / "python"
    done = folder / ".installed"
    if not done.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--clear", str(folder)], check=True)
        result = subprocess.run([str(python), "-m", "pip", "install", "-q", requirement],
                                capture_output=True, text=True)
        if result.returncode:
            pytest.skip(f"cannot install {requirement} here: {result.stderr.strip()[-400:]}")
        done.write_text(requirement)
    return python


def run_check(python: Path, provider: str, checkpoint: str | None = None) -> dict:
    command = [str(python), str(CHECK), provider] + ([checkpoint] if checkpoint else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("NPU-CHECK ")]
    assert result.returncode == 0 and lines, result.stderr[-2000:]
    report = json.loads(lines[-1][len("NPU-CHECK "):])
    print(json.dumps(report, indent=1))
    return report


def within(linear_report: dict, unit_roundoff: float) -> bool:
    return linear_report["max_error"] <= (K + 4) * unit_roundoff * linear_report["sum_abs_products"]


def test_openvino_runs_matmul_nbits_and_the_model_inside_openvino(tiny_zoo):
    python = provider_venv("openvino", PROVIDER_WHEELS["openvino"])
    checkpoint = tiny_zoo.converted("llama_mha", QuantPlan(weights="int4", group_size=32, symmetric=False))
    report = run_check(python, "openvino", checkpoint)
    assert report["provider"] == "OpenVINOExecutionProvider"
    assert report["options"]["precision"] == "ACCURACY"
    for name in ("float_matmul", "int4_affine_g32", "int8_sym_g32", "int4_sym_g128"):
        assert list(report[name]["placement"]) == ["OpenVINOExecutionProvider"], name
        assert within(report[name], 2.0 ** -24), name
    assert report["int4_affine_g32"]["placement"]["OpenVINOExecutionProvider"]["ops"]["MatMulNBits"] == 1
    model = report["model"]
    assert model["graph_form"] == "standard"
    assert [list(graph) for graph in model["placement"].values()] == [["OpenVINOExecutionProvider"]]
    assert model["relative_error"] <= 1e-4


def test_qnn_htp_simulator_runs_the_float_matmul():
    python = provider_venv("qnn", PROVIDER_WHEELS["qnn"])
    report = run_check(python, "qnn")
    assert report["provider"] == "QNNExecutionProvider"
    assert report["options"]["backend_path"].endswith("libQnnHtp.so")
    float_matmul = report["float_matmul"]
    assert list(float_matmul["placement"]) == ["QNNExecutionProvider"]
    assert float_matmul["placement"]["QNNExecutionProvider"]["ops"] == {"MatMul": 1}
    assert within(float_matmul, 2.0 ** -11)
