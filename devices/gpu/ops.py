"""The op-level backend contract on the GPU: each call uploads its inputs, runs its kernels in one
submission and reads its result back. Slow by construction (a round trip per op); it exists so
that every kernel can be checked against the reference one op at a time, and so that edge's
op-by-op composition runs on this device. Generation uses the fused executor (forward.py).
"""
from __future__ import annotations

import numpy as np

from devices.gpu.launches import LaunchBuilder, Launches
from devices.gpu.tensors import GpuMatrix, GpuVector


class GpuOps:
    def __init__(self, ctx, builder: LaunchBuilder):
        self.ctx, self.builder = ctx, builder

    # --- plumbing ------------------------------------------------------------------------------
    def _step(self, n_tokens: int, start: int = 0):
        return self.ctx.uniform(np.array([n_tokens, start, 0, 0], np.uint32), "step")

    def _input(self, array, dtype=np.float32):
        return self.ctx.upload(np.ascontiguousarray(array, dtype=dtype))

    def _run(self, launches: Launches, n_tokens: int, out, shape: tuple, dtype=np.float32) -> np.ndarray:
        encoder = self.ctx.device.create_command_encoder()
        compute_pass = encoder.begin_compute_pass()
        launches.encode(compute_pass, n_tokens)
        compute_pass.end()
        self.ctx.queue.submit([encoder.finish()])
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.ctx.download(out, nbytes, dtype).reshape(shape)

    def _output(self, n_values: int):
        return self.ctx.storage(4 * n_values, "out", copy_src=True)

    @staticmethod
    def _as_rows(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        return x.reshape(-1, x.shape[-1])

    # --- the contract --------------------------------------------------------------------------
    def embed(self, table: GpuMatrix, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids).reshape(-1)
        n_rows, dim = table.shape
        if ids.size and (ids.min() < 0 or ids.max() >= n_rows):
            raise IndexError(f"embedding ids must lie in [0, {n_rows}), got {ids.min()}..{ids.max()}")
        step = self._step(len(ids))
        out = self._output(len(ids) * dim)
        launches = self.builder.embed(step, self._input(ids, np.uint32), table, out)
        return self._run(launches, len(ids), out, (len(ids), dim))

    def linear(self, x: np.ndarray, weight: GpuMatrix, bias: GpuVector | None = None) -> np.ndarray:
        rows = self._as_rows(x)
        n, k = weight.shape
        if rows.shape[1] != k:
            raise ValueError(f"linear: x has {rows.shape[1]} features, the weight {weight.shape} expects {k}")
        n_tokens = len(rows)
        step = self._step(n_tokens)
        out = self._output(n_tokens * n)
        tokens_per_group = 1 if n_tokens == 1 else self.builder.tuning.prefill_tokens_per_group
        x_buffer = self.ctx.upload(rows, "x", input_window=self.builder.input_window)
        launches = self.builder.linear(step, x_buffer, weight, out, bias=None if bias is None else bias.buffer,
                                       tokens_per_group=tokens_per_group, max_tokens=n_tokens)
        return self._run(launches, n_tokens, out, (*np.shape(x)[:-1], n))

    def rms_norm(self, x: np.ndarray, weight: GpuVector, eps: float) -> np.ndarray:
        rows = self._as_rows(x)
        step = self._step(len(rows))
        out = self._output(rows.size)
        launches = self.builder.rms_norm(step, self._input(rows), weight.buffer, out, dim=rows.shape[1], eps=eps)
        return self._run(launches, len(rows), out, np.shape(x))

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        n_tokens, heads, head_dim = x.shape
        step = self._step(n_tokens)
        out = self._output(x.size)
        launches = self.builder.rope(step, self._input(x), self._input(cos), self._input(sin), out,
                                     heads=heads, head_dim=head_dim)
        return self._run(launches, n_tokens, out, x.shape)

    def attention(self, q, k, v, q_positions, k_positions, scale, window=None) -> np.ndarray:
        q = np.asarray(q, dtype=np.float32)
        n_tokens, q_heads, head_dim = q.shape
        n_keys, kv_heads, _ = np.shape(k)
        step = self._step(n_tokens)
        out = self._output(q.size)
        launches = self.builder.attention(
            step, self._input(q), self._input(k), self._input(v), self._input(q_positions, np.int32),
            self._input(k_positions, np.int32), out, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
            scale=float(scale), window=window, n_keys=n_keys)
        return self._run(launches, n_tokens, out, q.shape)

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        gate_rows, up_rows = self._as_rows(gate), self._as_rows(up)
        step = self._step(len(gate_rows))
        out = self._output(gate_rows.size)
        launches = self.builder.swiglu(step, self._input(gate_rows), self._input(up_rows), out,
                                       per_token=gate_rows.shape[1])
        return self._run(launches, len(gate_rows), out, np.shape(gate))

    # --- extras: the sampler's reductions, on the device ---------------------------------------
    def softmax(self, x: np.ndarray) -> np.ndarray:
        rows = self._as_rows(x)
        step = self._step(len(rows))
        out = self._output(rows.size)
        launches = self.builder.rows_kernel("softmax", step, self._input(rows), out, cols=rows.shape[1])
        return self._run(launches, len(rows), out, np.shape(x))

    def argmax(self, x: np.ndarray) -> np.ndarray:
        rows = self._as_rows(x)
        step = self._step(len(rows))
        out = self._output(len(rows))
        launches = self.builder.rows_kernel("argmax", step, self._input(rows), out, cols=rows.shape[1])
        return self._run(launches, len(rows), out, np.shape(x)[:-1], np.uint32).astype(np.int64)
