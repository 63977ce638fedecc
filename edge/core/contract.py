"""The backend contract: what a device declares it can do, the operations every device has, and
what a fused executor is given in place of the model object.

Shapes: T = tokens in this call, S = cached positions, D = hidden size,
Hq / Hkv = query / key-value heads, Dh = head dimension, N x K = a weight's rows x inputs,
E = a MoE layer's routed experts, A = active experts per token.
A weight is whatever `prepare_weight` (or `load_weight`) returned for a float array or a
quant.QuantizedTensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from edge.core.moe import ExpertWeights


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond the operations every backend has; the layers above read this
    value instead of probing the backend for methods."""

    kv_formats: tuple[str, ...] = ("f32",)  # KV storage formats (edge/core/kv.py) the caches may hold
    cache_buffers: bool = False      # `allocate_cache` makes buffers in those formats for any layout (ring
                                     # buffers, MLA latents); without it, only allocate_kv's f32 K/V
    ring_buffers: bool = False       # sliding-window layers may keep only their window (rows p % window)
    stored_attention: bool = False   # `attention_over_cache` reads K/V as the cache stores them (f16, int8)
    runs_moe: bool = True            # Mixture-of-Experts models run here
    expert_mixture: bool = False     # `expert_mixture` mixes a MoE layer's routed experts in one call
    expert_cache: bool = False       # routed experts live in a cache of the device's own
                                     # (`configure_expert_cache` sizes it, `expert_stats` counts it)
    greedy_on_device: bool = False   # the fused executor's `next_token` picks a greedy token without
                                     # reading the logits back
    threads: int | None = None       # compute threads; None for a device that schedules its own work


@dataclass(frozen=True)
class ComputeThreads:
    """For the memory budget: the threads a backend computes a forward call with, and the scratch each
    one holds beyond the activations every backend needs (the cpu's prefill tile)."""

    count: int = 1
    scratch_bytes_each: int = 0


class MoeRunner(Protocol):
    """What a fused executor calls for a MoE layer, given the router logits [T, E] it computed: the
    model routes (edge/core/moe.py `route`, as on every device), takes the chosen experts from its
    expert source (resident, paged or streamed) and, where asked, mixes them on the backend experts
    are prepared for (`Backend.expert_backend`). `residual` [T, D] is the residual stream entering
    the block (the expert predictor forecasts from it); x [T, D] is the block's normed input."""

    def route(self, layer: int, router_logits: np.ndarray, residual: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, Mapping[int, ExpertWeights]]:
        """-> (expert ids [T, A], route weights [T, A], {id: ExpertWeights}): for an executor that
        mixes the experts itself (gpu)."""

    def routed(self, layer: int, x: np.ndarray, residual: np.ndarray, router_logits: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """-> (the routed experts' mixture [T, D], ids [T, A], route weights [T, A])."""

    def block(self, layer: int, x: np.ndarray, residual: np.ndarray, router_logits: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`routed` plus the layer's shared experts: the whole MoE block's output [T, D], ids, weights."""


@dataclass(frozen=True)
class ForwardModel:
    """Everything a fused executor compiles a model from (`Backend.compile_forward`). The weights
    are what the backend's `load_weight` returned; `layers[i].moe` holds a MoE layer's router and
    shared experts (routed experts come through `moe`)."""

    spec: Any                      # the family's spec (edge/core/spec.py)
    layers: list                   # per layer: norms, projections, biases, sliding window, moe, mla
    embed_tokens: Any
    final_norm: Any
    lm_head: Any                   # the embedding itself when tied
    rope: Any                      # cos_sin(positions) / cos_sin_span(start, n) tables (edge/rope.py)
    attention_scale: float
    kv_format: str                 # the K/V storage the session caches hold
    moe: MoeRunner | None          # None for a dense model
    forward_ops: Callable          # the op-by-op composition, same signature as an executor's __call__
    layer_ropes: dict | None = None  # rotary base -> tables of the layers whose base is their own (Gemma's sliding)


class ForwardExecutor(Protocol):
    """A fused forward pass (one compiled call per layer stretch on the CPU, one recorded command
    buffer on the GPU, one ONNX graph on an NPU), computing the op-by-op composition's math."""

    def __call__(self, ids: np.ndarray, cache, all_logits: bool, observer=None) -> np.ndarray:
        """Run ids (placed after the cache's valid positions), fill the cache: logits [T, V] when
        all_logits, else [V] for the last token; `observer(layer, hidden, **route)` after each layer."""

    def next_token(self, ids: np.ndarray, cache) -> int:
        """Only with `Capabilities.greedy_on_device`: run ids and return the argmax of the last token's
        logits (ties to the lowest id) without reading the logits back. Logits held on the host are
        checked first (edge/core/logits.py: NumericalError); device-side ones (gpu) are not."""


class Backend(Protocol):
    name: str
    capabilities: Capabilities
    expert_backend: Any  # the backend routed experts are prepared for and mixed on (often the backend itself)

    def prepare_weight(self, weight) -> Any:
        """A weight as this backend computes with it, for a call's lifetime (a streamed expert)."""

    def load_weight(self, weight) -> Any:
        """A weight the model holds for its lifetime (the backend may place it: huge pages, device memory)."""

    def embed(self, table, ids: np.ndarray) -> np.ndarray:
        """Rows of the embedding table: [T] ids -> [T, D]."""

    def linear(self, x: np.ndarray, weight, bias=None) -> np.ndarray:
        """x [T, K] times weight [N, K] transposed, plus bias [N]: -> [T, N]."""

    def rms_norm(self, x: np.ndarray, weight, eps: float) -> np.ndarray:
        """Normalise the last axis by its root mean square, then scale by weight."""

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Rotate x [T, H, Dh] (half-split layout) by cos/sin [T, Dh/2]."""

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray,
                  k_positions: np.ndarray, scale: float, window: int | None) -> np.ndarray:
        """Causal attention of q [T, Hq, Dh] over k, v [S, Hkv, Dh]: -> [T, Hq, Dh]."""

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """silu(gate) * up."""

    def gelu_tanh_gated(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """gelu_tanh(gate) * up (Gemma's feed-forward); a backend without it refuses such models in
        `compile_forward`."""

    def allocate_kv(self, capacity: int, kv_heads: int, head_dim: int) -> tuple[Any, Any]:
        """Key and value buffers for one layer: [capacity, Hkv, Dh] each, float32."""

    def compile_forward(self, model: ForwardModel) -> tuple[ForwardExecutor | None, str]:
        """A fused executor for the whole forward pass and "fused", or None and why the model runs
        op by op on this device (edge's composition of the operations above): the reason is shown
        in `device_info()["forward"]`, so a slower path is never silent."""

    def compute_threads(self, spec, tokens: int) -> ComputeThreads:
        """The threads a forward call of `tokens` tokens of this model computes with, and each one's own
        scratch (the memory budget reserves it)."""

    def info(self) -> dict: ...

    # With capabilities.cache_buffers:
    #   allocate_cache(rows, heads, dim, fmt) -> a buffer indexed like an array (devices/cache_buffers.py)
    # With capabilities.stored_attention:
    #   attention_over_cache(q, keys, values, q_positions, k_positions, scale, window): `attention` over
    #   K/V rows as stored (devices/cache_buffers.StoredRows), without an f32 copy of the cache
    # With capabilities.expert_mixture:
    #   expert_mixture(x [T, D], ids [T, A], weights [T, A], experts {id: ExpertWeights}) -> [T, D]: the
    #   sum over each token's experts of weight * down(silu(gate(x)) * up(x)), experts added in ascending
    #   id order (the result does not depend on which ExpertSource supplied them); a mapping with a
    #   `window_size` is read at most that many experts at a time
    # With capabilities.expert_cache:
    #   configure_expert_cache(layers {MoE layer: (E, {projection: (Scheme, shape)})}, capacity bytes, a
    #   share (0, 1] or None) before the model is built (ValueError below one layer's experts), and
    #   expert_stats() -> its counters
    # MLA models also use head_matmul(x [T, H, K], w [H, N, K]) -> [T, H, N].
