"""Mixture-of-Experts semantics: routing and the expert feed-forward block.

T = tokens, E = routed experts in the layer, D = hidden size, A = active experts per token,
I = one expert's intermediate size.

Expert weights do not live in the model: an ExpertSource (streaming/) hands the MoE block the
weights of the experts a route needs, already prepared for the backend, so that the same block
runs with every expert resident, paged from an mmap, or streamed through a bounded cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol

import numpy as np


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


@dataclass
class ExpertWeights:
    """One routed expert, as the backend takes its weights: down(silu(gate(x)) * up(x))."""

    gate: Any  # [I, D]
    up: Any    # [I, D]
    down: Any  # [D, I]


class ExpertSource(Protocol):
    """Where the MoE block gets expert weights (implemented in streaming/)."""

    def experts(self, layer: int, expert_ids: np.ndarray, residual: np.ndarray) -> Mapping[int, ExpertWeights]:
        """Weights of every distinct id in expert_ids [T, A] of `layer`, blocking until they are loaded.

        `residual` [T, D] is the residual stream entering the layer's feed-forward block (before its
        norm): the expert predictor applies later layers' routers to it. The call also records the
        route, so the source learns from it and schedules prefetches for the layers ahead."""

    def stats(self) -> dict: ...

    def close(self) -> None: ...
