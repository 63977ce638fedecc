"""Mixture-of-Experts semantics: routing and the expert feed-forward block.

T = tokens, E = routed experts in the layer, D = hidden size, A = active experts per token,
I = one expert's intermediate size.

Expert weights do not live in the model: an ExpertSource (streaming/) hands the MoE block the
weights of the experts a route needs, already prepared for the backend, so that the same block
runs with every expert resident, paged from an mmap, or streamed through a bounded cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

import numpy as np

from edge.errors import UnsupportedModelError

SCORINGS = ("softmax", "sigmoid", "unit")


@dataclass(frozen=True)
class MoeConfig:
    """How one MoE layer routes; filled by each family's spec (edge/spec.py `moe_for_layer`)."""

    num_experts: int                  # E routed experts
    top_k: int                        # A experts per token
    intermediate_size: int            # I of each routed expert
    scoring: str = "softmax"          # "softmax" | "sigmoid" over router logits; "unit": weight 1 per chosen expert
    norm_topk_prob: bool = False      # renormalise the chosen experts' weights to sum to 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1                  # DeepSeek group-limited routing: E experts in n_group groups,
    topk_group: int = 1               # only the best topk_group groups compete for the top-k
    group_score: str = "max"          # a group's score: "max" (DeepSeek-V2) or "top2_sum" (DeepSeek-V3)
    score_correction_bias: bool = False  # DeepSeek-V3: a learned bias added to scores for selection only
    shared_intermediate_size: int = 0    # 0: no shared expert; else I of the always-on shared expert(s)
    shared_expert_gate: bool = False     # Qwen2-MoE: the shared expert's output is scaled by sigmoid(x @ g)
    shared_expert_name: str = "shared_expert"  # module name: Qwen2-MoE "shared_expert", DeepSeek "shared_experts"

    def __post_init__(self) -> None:
        problems = []
        if not 0 < self.top_k <= self.num_experts:
            problems.append(f"num_experts_per_tok {self.top_k} must be in [1, {self.num_experts}] (the experts)")
        if self.n_group < 1 or self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            problems.append(f"{self.num_experts} experts cannot form {self.n_group} groups of which "
                            f"{self.topk_group} are kept")
        elif self.n_group > 1 and self.top_k > self.topk_group * (self.num_experts // self.n_group):
            problems.append(f"top-{self.top_k} cannot be chosen from {self.topk_group} groups of "
                            f"{self.num_experts // self.n_group} experts")
        if self.scoring not in SCORINGS:
            problems.append(f"router scoring {self.scoring!r} is not one of {', '.join(SCORINGS)}")
        if problems:
            raise UnsupportedModelError("unsupported Mixture-of-Experts configuration: " + "; ".join(problems))


@dataclass
class ExpertWeights:
    """One routed expert, as the backend takes its weights: down(silu(gate(x)) * up(x))."""

    gate: Any  # [I, D]
    up: Any    # [I, D]
    down: Any  # [D, I]
    packed: Any = field(default=None, compare=False, repr=False)  # the backend's own form of the three, made on first use


class ExpertSource(Protocol):
    """Where the MoE block gets expert weights (implemented in streaming/)."""

    def experts(self, layer: int, expert_ids: np.ndarray, residual: np.ndarray,
                router_logits: np.ndarray | None = None) -> Mapping[int, ExpertWeights]:
        """Weights of every distinct id in expert_ids [T, A] of `layer`: looking one up blocks until it
        is loaded (and raises the error of a failed load). A source that loads experts while the model
        computes may offer `ready_run(ids, start)`: how many of the ascending ids[start:] can be taken
        without waiting (at least one, waiting for ids[start]), so a consumer computes with those first.

        `residual` [T, D] is the residual stream entering the layer's feed-forward block (before its
        norm): the expert predictor applies later layers' routers to it. The call also records the
        route, so the source learns from it and schedules prefetches for the layers ahead.
        `router_logits` [T, E] are the layer's own router logits, which the model has computed
        already (the predictor learns its lookahead's drift from them instead of recomputing them).

        The weights stay valid until the next call, except when the mapping has a `window_size`
        (a route needing more experts than a small cache holds): then only that many experts'
        weights are valid at once, and taking a further one (in ascending id order) releases the
        earliest taken; a consumer uses at most `window_size` experts' weights together."""

    def stats(self) -> dict: ...

    def close(self) -> None: ...


@dataclass
class MoeLayerWeights:
    """The non-expert weights of one MoE block, prepared for the backend."""

    config: MoeConfig
    router: Any                      # [E, D]
    router_bias: Any | None = None   # [E] (a MoEfied router's fitted intercept)
    correction_bias: np.ndarray | None = None  # [E] f32, DeepSeek-V3 selection bias
    shared_gate: Any | None = None   # [Is, D]
    shared_up: Any | None = None     # [Is, D]
    shared_down: Any | None = None   # [D, Is]
    shared_expert_gate: Any | None = None  # [1, D]


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def _sigmoid(logits: np.ndarray) -> np.ndarray:
    # exp(-x) overflows float32 below x = -88: 1 / (1 + inf) = 0 is then the right limit, not an error
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)


def _top_k(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values per row, largest first; ties go to the lowest index (as torch.topk)."""
    return np.argsort(-values, axis=-1, kind="stable")[:, :k]


def distinct_experts(expert_ids: np.ndarray) -> list[int]:
    """The ascending distinct expert ids of a route [T, A] (Python ints: sources key dicts by them)."""
    return sorted(set(np.asarray(expert_ids).ravel().tolist()))


def route(router_logits: np.ndarray, config: MoeConfig, correction_bias: np.ndarray | None = None
          ) -> tuple[np.ndarray, np.ndarray]:
    """Which experts each token uses and with what weight: logits [T, E] -> ids [T, A] int64, weights [T, A] f32.

    Follows transformers' routers: scores in float32 (softmax over all experts, or sigmoid per
    expert); DeepSeek's correction bias shifts the scores used for choosing only; with n_group > 1
    only the experts of the topk_group best groups compete; the chosen experts' weights are their
    scores, optionally renormalised to sum to 1, times routed_scaling_factor. "unit" scoring (a
    MoEfied dense FFN) weights every chosen expert 1.0.
    """
    logits = np.asarray(router_logits, dtype=np.float32)  # [T, E]
    n_tokens, n_experts = logits.shape
    if config.scoring == "softmax":
        scores = _softmax(logits)
    elif config.scoring == "sigmoid":
        scores = _sigmoid(logits)
    else:  # "unit" (MoeConfig admits no other scoring): the chosen experts are the largest logits
        scores = logits
    choice = scores if correction_bias is None else scores + correction_bias.astype(np.float32)  # [T, E]
    if config.n_group > 1:
        grouped = choice.reshape(n_tokens, config.n_group, n_experts // config.n_group)  # [T, G, E/G]
        if config.group_score == "max":  # DeepSeek-V2
            group_scores = grouped.max(axis=-1)
            excluded = 0.0  # V2 zeroes the scores of excluded groups
        else:  # DeepSeek-V3: sum of each group's two best scores
            group_scores = np.sort(grouped, axis=-1)[:, :, -2:].sum(axis=-1, dtype=np.float32)
            excluded = -np.inf
        kept_groups = _top_k(group_scores, config.topk_group)  # [T, topk_group]
        group_mask = np.zeros(group_scores.shape, dtype=bool)
        np.put_along_axis(group_mask, kept_groups, True, axis=-1)
        expert_mask = np.repeat(group_mask, n_experts // config.n_group, axis=-1)  # [T, E]
        choice = np.where(expert_mask, choice, np.float32(excluded))
    ids = _top_k(choice, config.top_k)  # [T, A]
    if config.scoring == "unit":
        return ids, np.ones(ids.shape, dtype=np.float32)
    weights = np.take_along_axis(scores, ids, axis=-1)  # [T, A]
    if config.norm_topk_prob:
        # DeepSeek-V3 guards the sigmoid sum against zero; a softmax sum is never zero
        guard = np.float32(1e-20) if config.scoring == "sigmoid" else np.float32(0.0)
        weights = weights / (weights.sum(axis=-1, keepdims=True) + guard)
    if config.routed_scaling_factor != 1.0:
        weights = weights * np.float32(config.routed_scaling_factor)
    return ids.astype(np.int64), weights.astype(np.float32)


def expert_mixture(be, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                   experts: Mapping[int, ExpertWeights]) -> np.ndarray:
    """sum over a token's chosen experts of weight * down(silu(gate(x)) * up(x)): x [T, D] -> [T, D].

    Tokens are grouped by expert, so each expert's weights are read once per call; experts run in
    ascending id order, so the sum's rounding does not depend on where their weights came from.
    A backend with its own `expert_mixture` (one compiled call, same order) runs it; this loop is
    the readable oracle the reference backend runs.
    """
    fused = getattr(be, "expert_mixture", None)
    if fused is not None:
        return fused(x, ids, weights, experts)
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
        shared = shared * _sigmoid(np.asarray(be.linear(x, weights.shared_expert_gate), dtype=np.float32))
    return shared
