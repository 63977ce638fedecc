"""Kernel launches: one op's pipeline(s), bound to its buffers, with grid sizes per token count.

Both the op-level contract (ops.py) and the fused executor (forward.py) build their work from
these, so the two share every kernel and every indexing convention. A launch is bound once;
`encode(pass, n_tokens)` records it for a call of n_tokens tokens (the step uniform says how
many, and at which position).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from devices.gpu.shaders import Bound, KernelCache
from devices.gpu.tensors import GpuMatrix


@dataclass(frozen=True)
class Tuning:
    """Workgroup shapes, by kind of device.

    A Vulkan device that is a CPU (lavapipe) runs a workgroup as a loop over 8-wide SIMD lanes on
    one core: every load from a storage buffer or workgroup memory is a gather, and a barrier is a
    coroutine switch, but a uniform-buffer load at an address shared by all lanes is one scalar
    load. There, each thread owns a whole row and reads the inputs through uniform windows
    (linear_rows.wgsl). A GPU wants a warp's worth of threads sharing each row, with coalesced
    reads and a reduction in workgroup memory (linear.wgsl)."""

    threads_per_row: int
    rows_per_group: int
    prefill_tokens_per_group: int
    norm_threads: int
    attention_threads: int
    row_threads: int
    uniform_inputs: bool  # linear layers read their inputs through uniform windows (linear_rows.wgsl)

    @classmethod
    def for_device(cls, is_cpu: bool) -> "Tuning":
        if is_cpu:
            return cls(threads_per_row=1, rows_per_group=64, prefill_tokens_per_group=8,
                       norm_threads=64, attention_threads=64, row_threads=64, uniform_inputs=True)
        return cls(threads_per_row=32, rows_per_group=8, prefill_tokens_per_group=8,
                   norm_threads=256, attention_threads=64, row_threads=256, uniform_inputs=False)


MAX_HEAD_DIM = 256


@dataclass
class Launch:
    bound: Bound
    groups: Callable[[int], tuple[int, int, int]]  # n_tokens -> workgroup grid

    def encode(self, compute_pass, n_tokens: int) -> None:
        self.bound.encode(compute_pass, self.groups(n_tokens))


@dataclass
class WindowedLaunch:
    """linear_rows.wgsl: one dispatch per window of `tokens_per_window` input rows, each bound at its
    dynamic offsets (the window's first input row, and that token's index)."""

    bound: Bound
    row_groups: int
    tokens_per_window: int
    row_bytes: int            # bytes of one input row
    index_stride: int         # bytes between entries of the token-index buffer
    last_token_only: bool

    def encode(self, compute_pass, n_tokens: int) -> None:
        firsts = [n_tokens - 1] if self.last_token_only else range(0, n_tokens, self.tokens_per_window)
        for first in firsts:
            offsets = {"x": first * self.row_bytes, "first_token": first * self.index_stride}
            self.bound.encode(compute_pass, (self.row_groups, 1, 1),
                              tuple(offsets[name] for name in self.bound.kernel.dynamic_order))


@dataclass
class Launches:
    items: list = field(default_factory=list)

    def add(self, bound: Bound, groups: Callable[[int], tuple[int, int, int]]) -> None:
        self.items.append(Launch(bound, groups))

    def add_launch(self, launch) -> None:
        self.items.append(launch)

    def extend(self, other: "Launches") -> None:
        self.items.extend(other.items)

    def encode(self, compute_pass, n_tokens: int) -> None:
        for launch in self.items:
            launch.encode(compute_pass, n_tokens)


def flat_grid(ctx, n_threads: int, width: int = 64) -> tuple[int, int, int]:
    """A grid of `width`-thread workgroups covering n_threads, spread over x and y."""
    groups = math.ceil(n_threads / width)
    if groups <= ctx.max_workgroups:
        return (groups, 1, 1)
    return (ctx.max_workgroups, math.ceil(groups / ctx.max_workgroups), 1)


def row_grid(ctx, rows: int) -> tuple[int, int, int]:
    """One workgroup per row, spread over x and y."""
    if rows <= ctx.max_workgroups:
        return (rows, 1, 1)
    return (ctx.max_workgroups, math.ceil(rows / ctx.max_workgroups), 1)


class LaunchBuilder:
    """Binds kernels to buffers. `step` is the uniform buffer holding (n_tokens, start)."""

    def __init__(self, ctx, kernels: KernelCache, tuning: Tuning, dummy):
        self.ctx, self.kernels, self.tuning = ctx, kernels, tuning
        self.dummy = dummy  # bound where a kernel's optional input (bias) is absent
        # Bytes of the uniform window through which linear_rows.wgsl reads its inputs; buffers that
        # feed linear layers are allocated with this much room past their end (ctx.storage).
        self.input_window = min(65536, ctx.max_uniform_bytes) if tuning.uniform_inputs else 0
        self.index_stride = max(16, ctx.uniform_alignment)
        self._token_index = None

    def token_index(self, n_tokens: int):
        """A uniform buffer whose entry i (at i * index_stride bytes) holds i."""
        if self._token_index is None or self._token_index[1] < n_tokens:
            count = max(n_tokens, 256)
            words = np.zeros((count, self.index_stride // 4), np.uint32)
            words[:, 0] = np.arange(count)
            self._token_index = (self.ctx.uniform(words.reshape(-1), "token_index"), count)
        return self._token_index[0]

    def _windowed(self, k: int, n_tokens_max: int) -> int:
        """Tokens per uniform window for inputs of k features, or 0 where linear_rows cannot serve."""
        if not self.input_window or (4 * k) % self.ctx.uniform_alignment or 4 * k > self.input_window:
            return 0
        fits = min(self.tuning.prefill_tokens_per_group, n_tokens_max, self.input_window // (4 * k), 8)
        return 1 << (max(fits, 1).bit_length() - 1)  # linear_rows.wgsl takes 1, 2, 4 or 8

    def linear(self, step, x, weight: GpuMatrix, y, *, max_tokens: int, bias=None, accumulate=False,
               y_offset=0, y_start_stride=0, last_token_only=False, tokens_per_group=1) -> Launches:
        """y[t, n] (+)= x[t] . weight[n] (+ bias[n]); rows of y are N apart.

        max_tokens: the most tokens a call will bring. With CPU tuning, inputs x allocated with an
        input window (ctx.storage(input_window=...)) are read by linear_rows.wgsl; otherwise, or
        where K does not suit a window, by linear.wgsl."""
        n, k = weight.shape
        tokens_per_window = self._windowed(k, tokens_per_group)
        if tokens_per_window and x.usage & self.ctx.wgpu.BufferUsage.UNIFORM:
            return self._linear_rows(step, x, weight, y, bias=bias, accumulate=accumulate, y_offset=y_offset,
                                     y_start_stride=y_start_stride, last_token_only=last_token_only,
                                     tokens_per_window=tokens_per_window, max_tokens=max_tokens)
        tune = self.tuning
        kernel = self.kernels.get(
            "linear", **weight.constants, THREADS_PER_ROW=tune.threads_per_row, ROWS_PER_GROUP=tune.rows_per_group,
            TOKENS_PER_GROUP=tokens_per_group, HAS_BIAS=bias is not None, ACCUMULATE=accumulate,
        )
        launches = Launches()
        for chunk in weight.chunks:
            bound = kernel.bind(step, dict(
                rows=chunk.rows, k=k, row_words=weight.row_words, groups=weight.groups, first_row=chunk.first_row,
                x_stride=k, y_offset=y_offset, y_stride=n, y_start_stride=y_start_stride,
                last_token_only=int(last_token_only),
            ), dict(x=x, weight_words=chunk.words, weight_scales=chunk.scales, weight_offsets=chunk.offsets,
                    bias=bias if bias is not None else self.dummy, y=y))
            row_groups = math.ceil(chunk.rows / tune.rows_per_group)

            def groups(n_tokens, row_groups=row_groups):
                tokens = 1 if last_token_only else n_tokens
                return (row_groups, math.ceil(tokens / tokens_per_group), 1)

            launches.add(bound, groups)
        return launches

    def _linear_rows(self, step, x, weight: GpuMatrix, y, *, bias, accumulate, y_offset, y_start_stride,
                     last_token_only, tokens_per_window, max_tokens) -> Launches:
        n, k = weight.shape
        if last_token_only:
            tokens_per_window = 1
        kernel = self.kernels.get(
            "linear_rows", dynamic={"x": self.input_window, "first_token": 16}, **weight.constants,
            TOKENS_PER_GROUP=tokens_per_window, X_VECS=self.input_window // 16, HAS_BIAS=bias is not None,
            ACCUMULATE=accumulate,
        )
        token_index = self.token_index(max_tokens)
        launches = Launches()
        for chunk in weight.chunks:
            bound = kernel.bind(step, dict(
                rows=chunk.rows, k=k, row_words=weight.row_words, groups=weight.groups, first_row=chunk.first_row,
                y_offset=y_offset, y_stride=n, y_start_stride=y_start_stride, last_token_only=int(last_token_only),
            ), dict(x=x, first_token=token_index, weight_words=chunk.words, weight_scales=chunk.scales,
                    weight_offsets=chunk.offsets, bias=bias if bias is not None else self.dummy, y=y))
            launches.add_launch(WindowedLaunch(bound, math.ceil(chunk.rows / 64), tokens_per_window, 4 * k,
                                               self.index_stride, last_token_only))
        return launches

    def embed(self, step, ids, table: GpuMatrix, out) -> Launches:
        kernel = self.kernels.get("embed", **table.constants)
        k = table.shape[1]
        launches = Launches()
        for chunk in table.chunks:
            bound = kernel.bind(step, dict(rows=chunk.rows, k=k, row_words=table.row_words, groups=table.groups,
                                           first_row=chunk.first_row),
                                dict(ids=ids, weight_words=chunk.words, weight_scales=chunk.scales,
                                     weight_offsets=chunk.offsets, out=out))
            launches.add(bound, lambda n_tokens: (math.ceil(k / 8 / 64), n_tokens, 1))
        return launches

    def rms_norm(self, step, x, weight, y, *, dim, eps, rows_per_token=1, x_offset=0, y_offset=0,
                 y_start_stride=0) -> Launches:
        kernel = self.kernels.get("rms_norm", NORM_THREADS=self.tuning.norm_threads)
        bound = kernel.bind(step, dict(dim=dim, rows_per_token=rows_per_token, x_offset=x_offset, y_offset=y_offset,
                                       y_start_stride=y_start_stride, eps=eps), dict(x=x, weight=weight, y=y))
        launches = Launches()
        launches.add(bound, lambda n_tokens: row_grid(self.ctx, n_tokens * rows_per_token))
        return launches

    def rope(self, step, x, cos, sin, y, *, heads, head_dim, y_start_stride=0) -> Launches:
        kernel = self.kernels.get("rope")
        bound = kernel.bind(step, dict(heads=heads, head_dim=head_dim, x_offset=0, y_offset=0,
                                       y_start_stride=y_start_stride), dict(x=x, cos=cos, sin=sin, y=y))
        launches = Launches()
        launches.add(bound, lambda n_tokens: flat_grid(self.ctx, n_tokens * heads * (head_dim // 2)))
        return launches

    def attention(self, step, q, keys, values, q_positions, k_positions, out, *, q_heads, kv_heads, head_dim,
                  scale, window, n_keys=0, follow_step=False) -> Launches:
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"GPU attention supports head_dim up to {MAX_HEAD_DIM}, got {head_dim}")
        if q_heads % kv_heads:
            raise ValueError(f"query heads ({q_heads}) must be a multiple of key/value heads ({kv_heads})")
        kernel = self.kernels.get("attention", ATTENTION_THREADS=self.tuning.attention_threads,
                                  MAX_HEAD_DIM=MAX_HEAD_DIM)
        bound = kernel.bind(step, dict(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, keys=n_keys,
                                       follow_step=int(follow_step), window=window or 0, scale=scale),
                            dict(q=q, keys=keys, values=values, q_pos=q_positions, k_pos=k_positions, out=out))
        launches = Launches()
        launches.add(bound, lambda n_tokens: (q_heads, n_tokens, 1))
        return launches

    def swiglu(self, step, gate, up, out, *, per_token) -> Launches:
        bound = self.kernels.get("swiglu").bind(step, dict(per_token=per_token), dict(gate=gate, up=up, out=out))
        launches = Launches()
        launches.add(bound, lambda n_tokens: flat_grid(self.ctx, n_tokens * per_token))
        return launches

    def rows_kernel(self, name: str, step, x, y, *, cols) -> Launches:
        """softmax or argmax of each of the step's n_tokens rows."""
        kernel = self.kernels.get(name, ROW_THREADS=self.tuning.row_threads)
        bound = kernel.bind(step, dict(cols=cols), dict(x=x, y=y))
        launches = Launches()
        launches.add(bound, lambda n_tokens: row_grid(self.ctx, n_tokens))
        return launches

    # --- Mixture-of-Experts blocks (devices/gpu/moe.py) -----------------------------------------
    def _elementwise(self, name: str, step, shape: dict, buffers: dict, per_token: int, **constants) -> Launches:
        bound = self.kernels.get(name, **constants).bind(step, shape, buffers)
        launches = Launches()
        launches.add(bound, lambda n_tokens: flat_grid(self.ctx, n_tokens * per_token))
        return launches

    def gather_rows(self, step, rows, x, out, *, dim, first) -> Launches:
        """out[i] = x[rows[first + i]] for the step's tokens (one expert's tokens)."""
        return self._elementwise("moe_gather", step, dict(dim=dim, first=first), dict(rows=rows, x=x, out=out), dim)

    def scatter_add_rows(self, step, rows, route_weights, y, out, *, dim, first) -> Launches:
        """out[rows[first + i]] += route_weights[first + i] * y[i] for the step's tokens."""
        return self._elementwise("moe_scatter", step, dict(dim=dim, first=first),
                                 dict(rows=rows, route_weights=route_weights, y=y, out=out), dim)

    def moe_combine(self, step, routed, hidden, *, dim, shared=None, shared_gate=None) -> Launches:
        """hidden += routed (+ shared, scaled by sigmoid(shared_gate) when gated)."""
        return self._elementwise(
            "moe_combine", step, dict(dim=dim),
            dict(routed=routed, shared_out=shared if shared is not None else self.dummy,
                 shared_gate=shared_gate if shared_gate is not None else self.dummy, hidden=hidden),
            dim, HAS_SHARED=shared is not None, GATED=shared_gate is not None)

    def clamp(self, step, x, y, *, per_token, limit, y_start_stride=0) -> Launches:
        """y (at the step's start when y_start_stride) = x clamped to [-limit, limit]."""
        return self._elementwise("clamp", step, dict(per_token=per_token, y_start_stride=y_start_stride,
                                                     limit=float(limit)), dict(x=x, y=y), per_token)
