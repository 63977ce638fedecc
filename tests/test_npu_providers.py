"""Real non-default execution providers, each in its own virtualenv, and a peer exporter.

Each provider's wheel replaces or extends onnxruntime, so it gets a virtualenv of its own
(devices/npu/provider_envs.py, devices/helper_envs.py: created once, reused by later runs; numpy, onnx,
torch and this project come from the main environment, the provider's onnxruntime ahead of its).
A provider whose wheel cannot be installed here is skipped with the pip error as the reason. The checks run
tests/npu_provider_check.py inside the virtualenv.

- OpenVINO (onnxruntime-openvino, OpenVINO's CPU device, precision ACCURACY = float32): MatMulNBits
  graphs and a whole tiny Llama (standard attention form) run entirely inside OpenVINO. Bound for
  one matmul: (K + 4) 2^-24 sum|x||w| (float32, see test_npu_packing.py); for the model REL_TOL 1e-4.
- QNN (onnxruntime-qnn, HTP simulator, float16 precision): the float MatMul graph runs on QNN.
  Bound: (K + 4) 2^-11 sum|x||w| (inputs and products rounded to float16, float32 accumulation).
  RMSNorm of rows with outliers up to |x| = 22,700 (x^2 overflows float16 beyond 256) runs on QNN
  within NORM_FP16_TOL = 16 * 2^-11 of each row's max |output| (a handful of float16 roundings:
  input, scaled row, mean square, root, quotient, gain; measured <= 1.1e-3). Quantized embedding rows
  (the uint8 Gather left to the CPU provider, the dequantization on QNN) within EMBED_FP16_TOL =
  4 * 2^-11 of max |row| (codes exact, scale, offset and product rounded to float16).
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from converters.convert import QuantPlan
from devices.npu.provider_envs import ProviderEnvUnavailable, provider_env_python

ROOT = Path(__file__).resolve().parent.parent
CHECK = Path(__file__).resolve().parent / "npu_provider_check.py"
K = 200
NORM_FP16_TOL = 16 * 2.0 ** -11
EMBED_FP16_TOL = 4 * 2.0 ** -11


def provider_venv(name: str) -> Path:
    """The provider's virtualenv python (devices/npu/provider_envs.py); skip when pip cannot build it."""
    try:
        return provider_env_python(name)
    except ProviderEnvUnavailable as exc:
        pytest.skip(str(exc))


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
    python = provider_venv("openvino")
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
    python = provider_venv("qnn")
    report = run_check(python, "qnn")
    assert report["provider"] == "QNNExecutionProvider"
    assert report["options"]["backend_path"].endswith("libQnnHtp.so")
    float_matmul = report["float_matmul"]
    assert list(float_matmul["placement"]) == ["QNNExecutionProvider"]
    assert float_matmul["placement"]["QNNExecutionProvider"]["ops"] == {"MatMul": 1}
    assert within(float_matmul, 2.0 ** -11)
    norm = report["rms_norm"]
    assert list(norm["placement"]) == ["QNNExecutionProvider"]
    assert max(norm["row_relative_error"]) <= NORM_FP16_TOL, norm
    for scheme, embedding in report["embedding"].items():
        assert "QNNExecutionProvider" in embedding["placement"], scheme
        assert embedding["relative_error"] <= EMBED_FP16_TOL, (scheme, embedding)
