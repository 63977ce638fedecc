"""Single operations of the backend contract, each as a small graph on the backend's provider.

They are built from the same emitters as the whole-model graphs (devices/npu/onnx_export.py), so a
layer-by-layer comparison against the reference exercises the very nodes the fused graphs use.
Sessions are cached per weight and shape signature; weights are embedded in these small graphs.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from devices.npu.onnx_export import ExportOptions, GraphBuilder, attend, embed, linear, rms_norm, rotate
from devices.npu.onnx_weights import InlineWeights
from devices.npu.providers import create_session

FLOAT = TensorProto.FLOAT


class OpRunner:
    def __init__(self, runtime, settings):
        self.runtime = runtime
        self.settings = settings
        self._sessions: dict[tuple, tuple] = {}  # key -> (session, objects kept alive so ids stay unique)

    def _session(self, key: tuple, build, keep=()):
        if key not in self._sessions:
            options = ExportOptions(self.settings.attention, self.settings.affine_int4, self.settings.accuracy_level)
            b = GraphBuilder(InlineWeights())
            build(b, options)
            model = b.model(f"zllm_op_{key[0]}", {"zllm_op": str(key[0])})
            session = create_session(self.runtime, model.SerializeToString(), self.settings.threads,
                                     self.settings.allow_cpu_nodes)
            self._sessions[key] = (session, keep)
        return self._sessions[key][0]

    def linear(self, x: np.ndarray, weight, bias=None) -> np.ndarray:
        x = np.asarray(x, np.float32)
        k = x.shape[-1]

        def build(b, options):
            b.add_input("x", FLOAT, [1, "T", k])
            y = linear(b, "x", weight, bias, "weight", options)
            b.add_output(y, "y", FLOAT, [1, "T", None])

        session = self._session(("linear", id(weight), id(bias)), build, keep=(weight, bias))
        return session.run(None, {"x": x.reshape(1, -1, k)})[0].reshape(*x.shape[:-1], -1)

    def embed(self, table, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, np.int64)

        def build(b, options):
            b.add_input("ids", TensorProto.INT64, [1, "T"])
            b.add_output(embed(b, "ids", table, "table"), "rows", FLOAT, [1, "T", None])

        session = self._session(("embed", id(table)), build, keep=(table,))
        return session.run(None, {"ids": ids.reshape(1, -1)})[0].reshape(*ids.shape, -1)

    def rms_norm(self, x: np.ndarray, weight, eps: float) -> np.ndarray:
        x = np.asarray(x, np.float32)
        shape = x.shape

        def build(b, options):
            b.add_input("x", FLOAT, [None] * 3)
            b.add_output(rms_norm(b, "x", weight, eps, "norm", options), "y", FLOAT, [None] * 3)

        session = self._session(("rms_norm", id(weight), eps), build, keep=(weight,))
        return session.run(None, {"x": x.reshape(1, -1, shape[-1])})[0].reshape(shape)

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float32)  # [T, H, Dh]

        def build(b, options):
            b.add_input("x", FLOAT, [1, "T", "H", "Dh"])
            for name in ("cos", "sin"):
                b.add_input(name, FLOAT, [1, "T", 1, "half"])
            b.add_output(rotate(b, "x", "cos", "sin", "rope"), "y", FLOAT, [1, "T", "H", "Dh"])

        session = self._session(("rope",), build)
        feeds = {"x": x[None], "cos": np.asarray(cos, np.float32)[None, :, None], "sin": np.asarray(sin, np.float32)[None, :, None]}
        return session.run(None, feeds)[0][0]

    def attention(self, q, k, v, q_positions, k_positions, scale, window=None) -> np.ndarray:
        n_tokens, n_heads, head_dim = q.shape
        n_kv_heads = k.shape[1]

        def build(b, options):
            b.add_input("q", FLOAT, [1, n_heads, "T", head_dim])
            b.add_input("k", FLOAT, [1, n_kv_heads, "S", head_dim])
            b.add_input("v", FLOAT, [1, n_kv_heads, "S", head_dim])
            b.add_input("mask", FLOAT, ["T", "S"])
            grouped = b.op("Tile", ["mask", b.constant([n_heads // n_kv_heads, 1], np.int64, "repeats")], "grouped")
            out = attend(b, "q", "k", "v", grouped, n_heads, n_kv_heads, head_dim, scale, "attention")
            b.add_output(out, "out", FLOAT, [1, "T", n_heads * head_dim])

        session = self._session(("attention", n_heads, n_kv_heads, head_dim, float(scale)), build)
        q_positions, k_positions = np.asarray(q_positions), np.asarray(k_positions)
        visible = k_positions[None, :] <= q_positions[:, None]
        if window is not None:
            visible &= q_positions[:, None] - k_positions[None, :] < window
        feeds = {"q": np.ascontiguousarray(np.asarray(q, np.float32).transpose(1, 0, 2))[None],
                 "k": np.ascontiguousarray(np.asarray(k, np.float32).transpose(1, 0, 2))[None],
                 "v": np.ascontiguousarray(np.asarray(v, np.float32).transpose(1, 0, 2))[None],
                 "mask": np.where(visible, np.float32(0), np.float32(-np.inf)).astype(np.float32)}
        return session.run(None, feeds)[0].reshape(n_tokens, n_heads, head_dim)

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        def build(b, options):
            b.add_input("gate", FLOAT, [None, None])
            b.add_input("up", FLOAT, [None, None])
            silu = b.op("Mul", ["gate", b.op("Sigmoid", ["gate"], "sigmoid")], "silu")
            b.add_output(b.op("Mul", [silu, "up"], "swiglu"), "y", FLOAT, [None, None])

        gate = np.asarray(gate, np.float32)
        session = self._session(("swiglu",), build)
        feeds = {"gate": gate.reshape(-1, gate.shape[-1]), "up": np.asarray(up, np.float32).reshape(-1, gate.shape[-1])}
        return session.run(None, feeds)[0].reshape(gate.shape)
