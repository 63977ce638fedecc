"""Run inside a provider's own virtualenv by test_npu_providers.py: builds graphs with this
project's exporter, runs them on the provider, prints one JSON object (results + placement).

    python npu_provider_check.py openvino|qnn [CHECKPOINT]
"""
from __future__ import annotations

import json
import sys

import numpy as np
from onnx import TensorProto

from devices.npu.onnx_export import ExportOptions, GraphBuilder, embed, linear, rms_norm
from devices.npu.onnx_weights import InlineWeights
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


def run_rms_norm(runtime) -> dict:
    """RMSNorm (standard form) of rows whose largest |x| is 4, 200, 836 and 22,700 (SmolLM2's residual
    stream reaches ~22,700; x^2 overflows float16 beyond 256). Error relative to each row's max |exact|."""
    hidden, eps = 576, 1e-5
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, hidden)).astype(np.float32)
    x[1:, 7] = [200.0, 836.0, 22700.0]
    gain = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    b = GraphBuilder(InlineWeights())
    b.add_input("x", TensorProto.FLOAT, [1, 4, hidden])
    b.add_output(rms_norm(b, "x", gain, eps, "norm", ExportOptions("standard", "group_offset", 0)), "y",
                 TensorProto.FLOAT, [1, 4, hidden])
    session = create_session(runtime, b.model("rms_norm", {}).SerializeToString(), None, allow_cpu_nodes=False)
    y = session.run(None, {"x": x[None]})[0][0].astype(np.float64)
    x64 = x.astype(np.float64)
    exact = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + eps) * gain
    relative = np.abs(y - exact).max(-1) / np.abs(exact).max(-1)
    return {"row_max_abs_x": np.abs(x).max(-1).tolist(),
            "row_relative_error": np.nan_to_num(relative, nan=np.inf).tolist(), "placement": placement(session)}


def run_embedding(runtime, scheme: str) -> dict:
    """Quantized embedding rows dequantized in the graph (the provider may leave the uint8 Gather to
    the CPU provider), against quant/'s own dequantization. Error relative to max |row|."""
    rng = np.random.default_rng(2)
    table = quantize((0.1 * rng.standard_normal((64, K))).astype(np.float32), Scheme.parse(scheme))
    ids = np.array([[3, 0, 63, 17, 42, 5, 8, 29]], np.int64)
    b = GraphBuilder(InlineWeights())
    b.add_input("ids", TensorProto.INT64, [1, ids.shape[1]])
    b.add_output(embed(b, "ids", table, "embed"), "rows", TensorProto.FLOAT, [1, ids.shape[1], K])
    session = create_session(runtime, b.model("embed", {}).SerializeToString(), None, allow_cpu_nodes=True)
    rows = session.run(None, {"ids": ids})[0][0]
    exact = table.dequantize_rows(ids[0])
    return {"relative_error": float(np.abs(rows - exact).max() / np.abs(exact).max()), "placement": placement(session)}


def main() -> None:
    provider, checkpoint = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    import onnxruntime

    runtime = choose_provider(onnxruntime, provider, {})
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, K)).astype(np.float32)
    dense = (0.1 * rng.standard_normal((N, K))).astype(np.float32)
    report = {"onnxruntime": onnxruntime.__version__, "provider": runtime.name, "options": runtime.options,
              "notes": runtime.notes, "float_matmul": run_linear(runtime, dense, dense, x),
              "rms_norm": run_rms_norm(runtime),
              "embedding": {scheme: run_embedding(runtime, scheme) for scheme in ("int8_sym_g32", "int4_affine_g32")}}
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
