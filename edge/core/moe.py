"""Mixture-of-Experts semantics every layer shares: how a layer is configured, how a token is routed
(scores, group-limited selection, correction bias, top-k, route weights), and the types that carry
experts' weights between the expert source (streaming/) and the backends.

T = tokens, E = routed experts in the layer, D = hidden size, A = active experts per token,
I = one expert's intermediate size.

This numpy routing is the oracle: compiled variants (the expert predictor's forecast) are tested
against it, expert ids exactly.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from edge.core.errors import UnsupportedModelError
from edge.core.numerics import sigmoid, softmax

SCORINGS = ("softmax", "sigmoid", "unit")


@dataclass(frozen=True)
class MoeConfig:
    """How one MoE layer routes; filled by each family's spec (edge/core/spec.py `moe_for_layer`)."""

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


class ChosenExperts(Mapping):
    """The experts a route needs, id -> ExpertWeights (what ExpertSource.experts returns).

    `window_size`: None when every expert's weights stay valid together until the source's next
    call; else (a route needing more experts than a small cache holds) only that many are valid at
    once, and taking a further one (in ascending id order) releases the earliest taken.
    `ready_run(ids, start)`: how many of the ascending ids[start:] can be taken without waiting (at
    least one, waiting for ids[start]), so a consumer computes with those while the rest load.
    A source may also offer `ready_rows(pack, ids, start)`: ready_run's run length and the backend's
    packed form of that run (pack(weights), rows stacked), kept by the source so that a consumer need
    not take the experts one by one; (n, None) when it cannot (the consumer takes each expert)."""

    window_size: int | None = None

    def ready_run(self, ids: list[int], start: int) -> int:
        return len(ids) - start


class ExpertSet(dict, ChosenExperts):
    """ChosenExperts already in memory: all valid together, none to wait for."""


def as_chosen(experts: Mapping[int, ExpertWeights]) -> ChosenExperts:
    """Any mapping of expert weights as ChosenExperts: a mapping that is not one (a plain dict, a
    source's own type) keeps the `window_size` and `ready_run` it has, and gets the defaults (all
    valid together, nothing to wait for) for those it lacks."""
    return experts if isinstance(experts, ChosenExperts) else _MappingAsChosen(experts)


class _MappingAsChosen(ChosenExperts):
    def __init__(self, experts: Mapping[int, ExpertWeights]):
        self._experts = experts
        self.window_size = getattr(experts, "window_size", None)
        ready_run = getattr(experts, "ready_run", None)
        if ready_run is not None:
            self.ready_run = ready_run

    def __getitem__(self, expert: int) -> ExpertWeights:
        return self._experts[expert]

    def __iter__(self):
        return iter(self._experts)

    def __len__(self) -> int:
        return len(self._experts)


class ExpertSource(Protocol):
    """Where the MoE block gets expert weights (implemented in streaming/)."""

    def experts(self, layer: int, expert_ids: np.ndarray, residual: np.ndarray,
                router_logits: np.ndarray | None = None) -> ChosenExperts:
        """Weights of every distinct id in expert_ids [T, A] of `layer`: looking one up blocks until it
        is loaded (and raises the error of a failed load).

        `residual` [T, D] is the residual stream entering the layer's feed-forward block (before its
        norm): the expert predictor applies later layers' routers to it. The call also records the
        route, so the source learns from it and schedules prefetches for the layers ahead.
        `router_logits` [T, E] are the layer's own router logits, which the model has computed
        already (the predictor learns its lookahead's drift from them instead of recomputing them).
        The weights stay valid until the next call, or as the result's `window_size` says."""

    def begin_request(self) -> None:
        """A new request starts: per-request statistics restart (the cache and what was learned stay)."""

    def begin_token(self, embedding: Callable[[], np.ndarray]) -> None:
        """A decode step of one token starts, before layer 0 runs; `embedding()` gives the token's
        embedding [D]. A source with a predictor prefetches the first MoE layer's likely experts from
        it (a layer the previous token's last layers could only guess for); others do nothing."""

    def resize_cache(self, cache_bytes: int) -> None:
        """Hold at most `cache_bytes` of experts from now on (the memory plan's share, made again once the
        model's kernels have loaded); a source that holds every expert has nothing to resize."""

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


def top_k_indices(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values per row, largest first; ties go to the lowest index (as torch.topk)."""
    return np.argsort(-values, axis=-1, kind="stable")[:, :k]


def distinct_experts(expert_ids: np.ndarray) -> list[int]:
    """The ascending distinct expert ids of a route [T, A] (Python ints: sources key dicts by them)."""
    return sorted(set(np.asarray(expert_ids).ravel().tolist()))


def router_scores(router_logits: np.ndarray, config: MoeConfig) -> np.ndarray:
    """What a router's logits [T, E] score each expert, float32: softmax over all experts, sigmoid per
    expert, or the logits themselves ("unit" scoring, a MoEfied dense FFN)."""
    logits = np.asarray(router_logits, dtype=np.float32)
    if config.scoring == "softmax":
        return softmax(logits)
    if config.scoring == "sigmoid":
        return sigmoid(logits)
    return logits  # "unit" (MoeConfig admits no other scoring): the chosen experts are the largest logits


def selection_scores(scores: np.ndarray, correction_bias: np.ndarray | None) -> np.ndarray:
    """The scores [T, E] experts are chosen by: DeepSeek-V3's correction bias shifts them for choosing only."""
    return scores if correction_bias is None else scores + correction_bias.astype(np.float32)


def kept_groups_mask(choice: np.ndarray, config: MoeConfig) -> np.ndarray:
    """Group-limited routing (n_group > 1): True [T, E] for the experts of each token's topk_group best
    groups, a group scored by its best choice score ("max", DeepSeek-V2) or its two best summed
    ("top2_sum", DeepSeek-V3); every expert is kept when n_group is 1."""
    n_tokens, n_experts = choice.shape
    if config.n_group == 1:
        return np.ones(choice.shape, dtype=bool)
    grouped = choice.reshape(n_tokens, config.n_group, n_experts // config.n_group)  # [T, G, E/G]
    if config.group_score == "max":
        group_scores = grouped.max(axis=-1)
    else:
        group_scores = np.sort(grouped, axis=-1)[:, :, -2:].sum(axis=-1, dtype=np.float32)
    kept_groups = top_k_indices(group_scores, config.topk_group)  # [T, topk_group]
    group_mask = np.zeros(group_scores.shape, dtype=bool)
    np.put_along_axis(group_mask, kept_groups, True, axis=-1)
    return np.repeat(group_mask, n_experts // config.n_group, axis=-1)  # [T, E]


def route(router_logits: np.ndarray, config: MoeConfig, correction_bias: np.ndarray | None = None
          ) -> tuple[np.ndarray, np.ndarray]:
    """Which experts each token uses and with what weight: logits [T, E] -> ids [T, A] int64, weights [T, A] f32.

    Follows transformers' routers: scores in float32 (softmax over all experts, or sigmoid per
    expert); DeepSeek's correction bias shifts the scores used for choosing only; with n_group > 1
    only the experts of the topk_group best groups compete; the chosen experts' weights are their
    scores, optionally renormalised to sum to 1, times routed_scaling_factor. "unit" scoring (a
    MoEfied dense FFN) weights every chosen expert 1.0.
    """
    scores = router_scores(router_logits, config)  # [T, E]
    choice = selection_scores(scores, correction_bias)
    if config.n_group > 1:
        excluded = 0.0 if config.group_score == "max" else -np.inf  # V2 zeroes excluded groups' scores
        choice = np.where(kept_groups_mask(choice, config), choice, np.float32(excluded))
    ids = top_k_indices(choice, config.top_k)  # [T, A]
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

