"""`zllm-edge bench` measures NPU execution providers from separate environments side by side in one run.

A tiny random Llama (int4 affine g32, as test_npu_providers.py) is benchmarked on
cpu,npu:cpu,npu:openvino,npu:qnn, 8 prompt tokens + 4 greedy tokens, one repeat:
- npu:openvino's worker runs in the OpenVINO virtualenv (devices/npu/provider_envs.py, built on first
  use; the test is skipped with pip's reason when it cannot be built) and its device_info and every
  graph's placement name OpenVINOExecutionProvider;
- npu:qnn is pinned here to a wheel that does not exist, installed with PIP_NO_INDEX=1, so its
  environment cannot be built: its column says so with pip's reason, and nothing runs in its place.
OpenVINO runs this model at float32 (precision ACCURACY, accuracy_level 0): its greedy tokens equal
the reference backend's exactly (test_npu_providers.py bounds its logits within 1e-4 relative).
"""
from __future__ import annotations

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

import edge  # noqa: E402
from converters.convert import QuantPlan  # noqa: E402
from devices import helper_envs  # noqa: E402
from devices.npu import provider_envs  # noqa: E402
from devices.base import split_device_list  # noqa: E402
from edge.bench import format_table, run_bench  # noqa: E402

PROMPT = [5, 17, 33, 9, 60, 101, 7, 44]
NEW_TOKENS = 4
MISSING_QNN = "onnxruntime-qnn==0.0.0"


def reference_greedy(checkpoint: str) -> list[int]:
    with edge.load(checkpoint, device="reference") as model, model.session(capacity=len(PROMPT) + NEW_TOKENS) as s:
        tokens = [s.next_token(PROMPT)]
        while len(tokens) < NEW_TOKENS:
            tokens.append(s.next_token([tokens[-1]]))
    return tokens


def test_bench_runs_each_provider_in_its_own_environment(tiny_zoo, tmp_path, monkeypatch):
    from devices.base import BACKENDS

    if "cpu" not in BACKENDS:
        pytest.skip("the cpu backend is not registered in devices.base.BACKENDS")
    try:
        openvino_python = provider_envs.provider_env_python("openvino")
    except provider_envs.ProviderEnvUnavailable as exc:
        pytest.skip(str(exc))
    # A venvs folder of this test's own: the OpenVINO environment linked in, QNN's made unbuildable.
    (tmp_path / provider_envs.provider_env_folder("openvino").name).symlink_to(openvino_python.parent.parent)
    monkeypatch.setenv(helper_envs.VENVS_VARIABLE, str(tmp_path))
    monkeypatch.setitem(provider_envs.PROVIDER_REQUIREMENTS, "qnn", MISSING_QNN)
    monkeypatch.setenv("PIP_NO_INDEX", "1")

    checkpoint = tiny_zoo.converted("llama_mha", QuantPlan(weights="int4", group_size=32, symmetric=False))
    devices = ["cpu", "npu:cpu", "npu:openvino", "npu:qnn"]
    report = run_bench(checkpoint, devices, threads=1, new_tokens=NEW_TOKENS, repeats=1, prompt_ids=PROMPT)
    table = format_table(report)
    print(table)

    results = report["devices"]
    assert list(results) == devices
    for device in devices[:3]:
        assert len(results[device]["tokens"]) == NEW_TOKENS and results[device]["prefill_tokens_per_second"] > 0
    assert results["npu:cpu"]["device_info"]["provider"] == "CPUExecutionProvider"
    assert "python" not in results["npu:cpu"]  # this environment's onnxruntime

    openvino = results["npu:openvino"]
    assert openvino["python"] == str(tmp_path / openvino_python.relative_to(openvino_python.parent.parent.parent))
    assert openvino["device_info"]["provider"] == "OpenVINOExecutionProvider"
    assert openvino["device_info"]["backend"] != results["npu:cpu"]["device_info"]["backend"]  # another onnxruntime
    assert openvino["placement"] and all(list(eps) == ["OpenVINOExecutionProvider"]
                                         for eps in openvino["placement"].values())
    assert openvino["tokens"] == reference_greedy(checkpoint)
    assert "npu:openvino/cpu" in report["ratios"] and "npu:qnn/cpu" not in report["ratios"]

    qnn = results["npu:qnn"]
    assert set(qnn) == {"device", "unavailable"}
    assert MISSING_QNN in qnn["unavailable"]
    assert f"npu:qnn: unavailable: device npu:qnn: cannot install {MISSING_QNN}" in table
    assert "npu:openvino: OpenVINOExecutionProvider (onnxruntime 1.24.1), python " in table
    agreeing = next(line for line in table.splitlines() if line.startswith("greedy tokens agreeing"))
    assert agreeing.split()[-1] == "-"  # the unavailable column


def test_device_settings_stay_with_their_device():
    assert split_device_list("cpu,npu:qnn,allow_cpu_nodes=1,static=0, npu:openvino,npu") == [
        "cpu", "npu:qnn,allow_cpu_nodes=1,static=0", "npu:openvino", "npu"]


def test_a_worker_refuses_a_model_on_another_provider():
    from devices.base import DeviceUnavailableError

    on_cpu = {"provider": "CPUExecutionProvider", "allow_cpu_nodes": False, "placement": {}}
    with pytest.raises(DeviceUnavailableError, match="asked for OpenVINOExecutionProvider, but the model runs on "
                                                     "CPUExecutionProvider"):
        provider_envs.verify_provider("npu:openvino", on_cpu)
    split = {"provider": "QNNExecutionProvider", "allow_cpu_nodes": False,
             "placement": {"S64": {"QNNExecutionProvider": {"nodes": 9}, "CPUExecutionProvider": {"nodes": 1}}}}
    with pytest.raises(DeviceUnavailableError,
                       match=r"placed outside QNNExecutionProvider: \{'S64': \['CPUExecutionProvider'\]\}"):
        provider_envs.verify_provider("npu:qnn", split)
    provider_envs.verify_provider("npu:qnn,allow_cpu_nodes=1", {**split, "allow_cpu_nodes": True})  # allowed explicitly
    provider_envs.verify_provider("npu", on_cpu)  # the automatic choice is reported, not refused
