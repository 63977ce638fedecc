"""Run inside a provider's own virtualenv by test_npu_providers.py: builds graphs with this
project's exporter, runs them on the provider, prints one JSON object (results + placement).

    python npu_provider_check.py openvino|qnn [CHECKPOINT]
"""
from __future__ import annotations

import json
import sys

import numpy as np
from onnx import TensorProto

from converters.onnx_export import ExportOptions, GraphBuilder, linear
from converters.onnx_weights import InlineWeights
from devices.npu.providers import choose_provider, create_session, placement
from quant.formats import Scheme, quantize

N, K = 64, 200


def one_linear_graph(weight) -> bytes:
    b = GraphBuilder(InlineWeights())
    b.add_input("x", TensorProto.FLOAT, [1, 4, K])
    b.add_output(linear(b, "x", weight, None, "w", ExportOptions("standard", "group_offset", 0)), "y",
                 TensorProto.FLOAT, [1, 4, N])
    return b.model("one_linear", {}).SerializeToString()


def run_linear(runtime, weight, dense: np.ndarray, x: np.ndarray) -> dict:
    session = create_session(runtime, one_linear_graph(weight), None, allow_cpu_nodes=False)
    y = session.run(None, {"x": x[None]})[0][0]
    exact = x.astype(np.float64) @ dense.astype(np.float64).T
    return {"max_error": float(np.abs(y - exact).max()),
            "sum_abs_products": float((np.abs(x) @ np.abs(dense).T).max()),
            "placement": placement(session)}


def main() -> None:
    provider, checkpoint = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    import onnxruntime

    runtime = choose_provider(onnxruntime, provider, {})
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, K)).astype(np.float32)
    dense = (0.1 * rng.standard_normal((N, K))).astype(np.float32)
    report = {"onnxruntime": onnxruntime.__version__, "provider": runtime.name, "options": runtime.options,
              "notes": runtime.notes, "float_matmul": run_linear(runtime, dense, dense, x)}
    for scheme in ("int4_affine_g32", "int8_sym_g32", "int4_sym_g128"):
        quantized = quantize(dense, Scheme.parse(scheme))
        try:
            report[scheme] = run_linear(runtime, quantized, quantized.dequantize(), x)
        except Exception as exc:  # reported, and judged by the test
            report[scheme] = {"error": str(exc)[:400]}
    if checkpoint:
        report["model"] = run_model(checkpoint, provider)
    print("NPU-CHECK " + json.dumps(report))


def run_model(checkpoint: str, provider: str) -> dict:
    import edge

    prompt = [5, 17, 33, 9, 60, 101, 7, 44]
    with edge.load(checkpoint, device="reference") as reference:
        session = reference.session(capacity=16)
        expected = [session.prefill(prompt, all_logits=True)] + [session.decode(t)[None] for t in (3, 8)]
    try:
        with edge.load(checkpoint, device=f"npu:{provider}") as model:
            session = model.session(capacity=16)
            ours = [session.prefill(prompt, all_logits=True)] + [session.decode(t)[None] for t in (3, 8)]
            info = model.device_info()
    except Exception as exc:
        return {"error": str(exc)[:600]}
    error = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(ours, expected))
    return {"relative_error": error, "placement": info["placement"], "graph_form": info["graph_form"],
            "static_shapes": info["static_shapes"], "warnings": info["warnings"]}


if __name__ == "__main__":
    main()
