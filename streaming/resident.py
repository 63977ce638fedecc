"""Every expert in memory: the ExpertSource of a MoE model run without a memory budget.

At load, each (layer, expert) record of experts.bin is read once (positional read, crc32 checked:
a damaged record is refused naming its layer and expert, as the streamed strategies do),
decompressed if needed, decoded into zero-copy views of its raw record, and handed to the
backend's `prepare_weight`. Every later request is a hit.

E = routed experts of a layer, T = tokens, A = active experts per token.
"""
from __future__ import annotations

import os
from typing import Callable, Mapping

import numpy as np

from edge.core.moe import ExpertSet, ExpertWeights, distinct_experts
from quant.checkpoint import check_finite
from quant.expert_file import ExpertIndex, expert_tensor_name, raw_record, read_expert_bytes


class ResidentExperts:
    """ExpertSource holding every expert of every MoE layer, prepared for one backend."""

    def __init__(self, index: ExpertIndex, prepare: Callable):
        self.index = index
        self._experts: dict[int, list[ExpertWeights]] = {}
        self._hits = 0
        self._bytes_read = 0
        fd = os.open(index.path, os.O_RDONLY)
        try:
            for layer, layer_experts in sorted(index.layers.items()):
                layout = layer_experts.layout
                prepared = []
                for expert in range(len(layer_experts.records)):
                    stored = read_expert_bytes(fd, index, layer, expert)
                    self._bytes_read += len(stored)
                    raw = raw_record(index, layer, expert, stored, np.empty(layout.raw_length, np.uint8))
                    weights = layout.decode(raw, f"model.layers.{layer}.mlp.experts.{expert}")
                    for projection, weight in weights.items():  # loaded once: checked as the dense tensors are
                        check_finite(index.path, expert_tensor_name(layer, expert, projection), weight)
                    prepared.append(ExpertWeights(gate=prepare(weights["gate_proj"]), up=prepare(weights["up_proj"]),
                                                  down=prepare(weights["down_proj"])))
                self._experts[layer] = prepared
        finally:
            os.close(fd)
        self.resident_bytes = index.total_raw_bytes

    def experts(self, layer: int, expert_ids: np.ndarray, residual: np.ndarray,
                router_logits: np.ndarray | None = None) -> Mapping[int, ExpertWeights]:
        layer_experts = self._experts[layer]
        wanted = distinct_experts(expert_ids)
        self._hits += len(wanted)
        return ExpertSet((e, layer_experts[e]) for e in wanted)

    def begin_request(self) -> None:
        pass  # nothing per request: every expert is held

    def begin_token(self, embedding) -> None:
        pass  # nothing to prefetch

    def stats(self) -> dict:
        return {"expert_source": "resident", "expert_hits": self._hits, "expert_misses": 0,
                "hit_rate": 1.0 if self._hits else 0.0, "bytes_read": self._bytes_read,
                "io_stall_seconds": 0.0, "expert_cache_bytes": self.resident_bytes}

    def resize_cache(self, cache_bytes: int) -> None:
        """Every expert is held for the model's lifetime (the plan counts them all)."""

    def close(self) -> None:
        self._experts = {}
