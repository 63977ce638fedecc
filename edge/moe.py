"""The Mixture-of-Experts feed-forward block as the op-by-op composition runs it: route (edge/core/moe.py),
fetch the chosen experts from the ExpertSource, mix them, add the shared experts.

T = tokens, E = routed experts in the layer, D = hidden size, A = active experts per token.

Expert weights do not live in the model: an ExpertSource (streaming/) hands the MoE block the
weights of the experts a route needs, already prepared for the backend, so that the same block
runs with every expert resident, paged from an mmap, or streamed through a bounded cache.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from edge.core.moe import ExpertSource, ExpertWeights, MoeLayerWeights, route
from edge.core.numerics import sigmoid


def expert_mixture(be, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                   experts: Mapping[int, ExpertWeights]) -> np.ndarray:
    """sum over a token's chosen experts of weight * down(silu(gate(x)) * up(x)): x [T, D] -> [T, D].

    Tokens are grouped by expert, so each expert's weights are read once per call; experts run in
    ascending id order, so the sum's rounding does not depend on where their weights came from.
    A backend with its own `expert_mixture` (one compiled call, same order) runs it; this loop is
    the readable oracle the reference backend runs.
    """
    if be.capabilities.expert_mixture:
        return be.expert_mixture(x, ids, weights, experts)
    out = np.zeros(x.shape, dtype=np.float32)  # [T, D]
    for expert in np.unique(ids):  # ascending
        rows, slots = np.nonzero(ids == expert)  # tokens routed to this expert, and in which of their A slots
        w = experts[int(expert)]
        xe = x[rows]  # [Te, D]
        ye = be.linear(be.swiglu(be.linear(xe, w.gate), be.linear(xe, w.up)), w.down)  # [Te, D]
        out[rows] += weights[rows, slots][:, None] * ye
    return out


def route_and_fetch(layer: int, router_logits: np.ndarray, residual: np.ndarray, weights: MoeLayerWeights,
                    source: ExpertSource) -> tuple[np.ndarray, np.ndarray, Mapping[int, ExpertWeights]]:
    """Route a MoE layer from its router logits [T, E] and take the chosen experts from `source`:
    -> (expert ids [T, A], route weights [T, A], {id: ExpertWeights}). For executors that mix the
    experts themselves (the gpu device, with its own expert cache)."""
    ids, route_weights = route(router_logits, weights.config, weights.correction_bias)  # [T, A] each
    return ids, route_weights, source.experts(layer, ids, residual, router_logits)


def routed_experts(be, layer: int, x: np.ndarray, residual: np.ndarray, router_logits: np.ndarray,
                   weights: MoeLayerWeights, source: ExpertSource) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The routed half of a MoE block, given its router logits [T, E] (computed here by moe_block, or
    inside a device's graph): route, fetch the chosen experts from `source`, mix them.

    x [T, D] -> (routed experts' output [T, D], expert ids [T, A], route weights [T, A])."""
    ids, route_weights, chosen = route_and_fetch(layer, router_logits, residual, weights, source)
    return expert_mixture(be, x, ids, route_weights, chosen), ids, route_weights


def moe_block(be, layer: int, x: np.ndarray, residual: np.ndarray, weights: MoeLayerWeights,
              source: ExpertSource) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A MoE feed-forward block: routed experts (from `source`) plus shared experts.

    x [T, D] -> (output [T, D], the route: expert ids [T, A] and their weights [T, A])."""
    router_logits = be.linear(x, weights.router, weights.router_bias)  # [T, E]
    out, ids, route_weights = routed_experts(be, layer, x, residual, router_logits, weights, source)
    shared = shared_experts(be, x, weights)
    if shared is not None:
        out = out + shared
    return out, ids, route_weights


def shared_experts(be, x: np.ndarray, weights: MoeLayerWeights) -> np.ndarray | None:
    """The always-on shared expert of a MoE block: x [T, D] -> [T, D], or None where there is none."""
    if weights.shared_gate is None:
        return None
    shared = be.linear(be.swiglu(be.linear(x, weights.shared_gate), be.linear(x, weights.shared_up)),
                       weights.shared_down)  # [T, D]
    if weights.shared_expert_gate is not None:  # Qwen2-MoE scales the shared expert per token
        shared = shared * sigmoid(np.asarray(be.linear(x, weights.shared_expert_gate), dtype=np.float32))
    return shared


class ExpertMixer:
    """The MoeRunner (edge/core/contract.py) a model hands its backend's fused executor: routes a MoE
    layer from router logits the executor computed, takes the chosen experts from the model's expert
    source, and mixes them on `backend` (the model's backend, whose `expert_mixture` runs on its
    expert backend), with the same routing and order as the op-by-op composition."""

    def __init__(self, backend, layers: Mapping[int, MoeLayerWeights], source: ExpertSource):
        self.backend = backend
        self.layers = layers  # MoE layer -> its router and shared experts
        self.source = source  # may be swapped while the model lives (route recording wraps it)

    def begin_token(self, embedding) -> None:
        """A one-token forward pass starts (ExpertSource.begin_token): before layer 0 runs."""
        self.source.begin_token(embedding)

    def route(self, layer: int, router_logits: np.ndarray, residual: np.ndarray):
        return route_and_fetch(layer, router_logits, residual, self.layers[layer], self.source)

    def routed(self, layer: int, x: np.ndarray, residual: np.ndarray, router_logits: np.ndarray):
        return routed_experts(self.backend, layer, x, residual, router_logits, self.layers[layer], self.source)

    def block(self, layer: int, x: np.ndarray, residual: np.ndarray, router_logits: np.ndarray):
        out, ids, route_weights = self.routed(layer, x, residual, router_logits)
        shared = shared_experts(self.backend, x, self.layers[layer])
        return (out if shared is None else out + shared), ids, route_weights
