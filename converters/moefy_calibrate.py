"""Calibration text, dense activations and the held-out evaluation of a MoEfication.

Calibration and evaluation text come from Python's own documentation (`pydoc_data.topics`),
available offline everywhere: the topics are sorted by name and every HELDOUT_EVERY-th topic
is held out, so the held-out text is never seen by clustering or router fitting.

T = tokens, D = hidden size, I = dense intermediate size, E = experts, K = experts per token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from converters.moefy_fit import DenseFfn, LayerMoefication, masked_output
from quant import QuantizedTensor

HELDOUT_EVERY = 5
WINDOW = 256  # tokens per evaluation/calibration sequence


def topic_texts() -> tuple[list[str], list[str]]:
    """(calibration texts, held-out texts) from pydoc_data's topics, split deterministically."""
    from pydoc_data.topics import topics

    calibration, heldout = [], []
    for index, name in enumerate(sorted(topics)):
        (heldout if index % HELDOUT_EVERY == 0 else calibration).append(topics[name])
    return calibration, heldout


def token_windows(encode, texts: list[str], budget: int, window: int = WINDOW) -> list[np.ndarray]:
    """Full windows of `window` tokens, taken round-robin over the texts, until `budget` tokens.

    Round-robin (first window of every text, then the second ...) keeps many topics in a small
    budget instead of the alphabetically first few."""
    per_text = []
    for text in texts:
        ids = np.asarray(encode(text), dtype=np.int64)
        per_text.append([ids[i:i + window] for i in range(0, len(ids) - window + 1, window)])
    windows, depth = [], 0
    while len(windows) * window < budget and any(depth < len(w) for w in per_text):
        for text_windows in per_text:
            if depth < len(text_windows) and len(windows) * window < budget:
                windows.append(text_windows[depth])
        depth += 1
    return windows


def as_float(tensor) -> np.ndarray:
    return tensor.dequantize() if isinstance(tensor, QuantizedTensor) else np.asarray(tensor, dtype=np.float32)


def dense_ffn(tensors: dict, layer: int) -> DenseFfn:
    prefix = f"model.layers.{layer}.mlp."
    return DenseFfn(*(as_float(tensors[prefix + f"{proj}.weight"]) for proj in ("gate_proj", "up_proj", "down_proj")))


def ffn_norm_weights(tensors: dict, layers: int) -> list[np.ndarray]:
    return [as_float(tensors[f"model.layers.{i}.post_attention_layernorm.weight"]) for i in range(layers)]


def capture_ffn_inputs(transformer, windows: list[np.ndarray], progress=None) -> list[np.ndarray]:
    """Run the dense model over windows; every layer's FFN input x [T, D] (after its norm)."""
    captured: list[list[np.ndarray]] = [[] for _ in transformer.layers]

    def record(layer: int, x: np.ndarray):
        captured[layer].append(np.array(x, dtype=np.float32))
        return None  # run the dense block

    for ids in windows:
        transformer.forward_ops(ids, transformer.new_cache(len(ids)), False, ffn_hook=record)
        if progress is not None:
            progress.update(1)
    return [np.concatenate(parts) for parts in captured]


def next_token_nll(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of ids[1:] under logits[:-1]: [T - 1]."""
    predicted = logits[:-1].astype(np.float64)
    top = predicted.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(predicted - top).sum(axis=1)) + top[:, 0]
    return log_norm - predicted[np.arange(len(ids) - 1), ids[1:]]


@dataclass
class RoutingStats:
    """Held-out routing statistics of one MoEfied model."""

    # per MoE layer: chosen-count of each expert [E]
    expert_load: dict[int, np.ndarray] = field(default_factory=dict)
    # (layer, set size) -> (experts of layer+1 recalled, experts chosen) summed over tokens
    lookahead: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    def load_imbalance(self) -> dict[int, float]:
        """Per layer: the busiest expert's load over the mean load (1.0 = perfectly balanced)."""
        return {layer: float(load.max() / max(load.mean(), 1e-12)) for layer, load in self.expert_load.items()}

    def lookahead_recall(self, set_size_factor: int) -> float:
        """Share of layer L+1's chosen experts found in the top (factor x K) experts that layer L+1's
        router picks when applied to layer L's FFN input residual (re-normed with L+1's norm)."""
        hits = sum(v[0] for (_, f), v in self.lookahead.items() if f == set_size_factor)
        total = sum(v[1] for (_, f), v in self.lookahead.items() if f == set_size_factor)
        return hits / total if total else float("nan")

    def to_dict(self, top_k: int) -> dict:
        imbalance = self.load_imbalance()
        experts = max((len(load) for load in self.expert_load.values()), default=0)
        return {
            "load_imbalance_mean": float(np.mean(list(imbalance.values()))) if imbalance else None,
            "load_imbalance_max": max(imbalance.values()) if imbalance else None,
            "load_imbalance_per_layer": {str(k): round(v, 3) for k, v in imbalance.items()},
            "lookahead_recall": {f"set_{min(factor * top_k, experts)}": self.lookahead_recall(factor)
                                 for factor in (1, 2)},
        }


@dataclass
class Evaluation:
    perplexity: float
    tokens: int
    routing: RoutingStats


def evaluate(transformer, ffns: dict[int, DenseFfn], moefied: dict[int, LayerMoefication], top_k: int,
             windows: list[np.ndarray], norm_weights: list[np.ndarray] | None = None,
             progress=None) -> Evaluation:
    """Perplexity on windows with the layers in `moefied` replaced by their routed experts.

    With `norm_weights` (every layer's post-attention norm gain) it also measures one-layer
    lookahead: the router of layer L+1 applied to layer L's residual, re-normed for layer L+1.
    Recovering the normed residual as x_L / g_L * g_{L+1} is exact: RMS norm is scale-free."""
    routing = RoutingStats()
    owners = {layer: m.expert_of_neuron() for layer, m in moefied.items()}
    routes: dict[int, np.ndarray] = {}
    inputs: dict[int, np.ndarray] = {}

    def hook(layer: int, x: np.ndarray):
        if layer not in moefied:
            return None
        moe = moefied[layer]
        chosen = moe.route(x, top_k)  # [T, K]
        routes[layer], inputs[layer] = chosen, x
        load = routing.expert_load.setdefault(layer, np.zeros(moe.num_experts, dtype=np.int64))
        np.add.at(load, chosen.ravel(), 1)
        return masked_output(ffns[layer], ffns[layer].activations(x), owners[layer], chosen).astype(np.float32)

    total_nll, count = 0.0, 0
    for ids in windows:
        routes.clear()
        inputs.clear()
        logits = transformer.forward_ops(ids, transformer.new_cache(len(ids)), True, ffn_hook=hook)
        nll = next_token_nll(logits, ids)
        total_nll += float(nll.sum())
        count += len(nll)
        if norm_weights is not None:
            _record_lookahead(routing, moefied, routes, inputs, norm_weights, top_k)
        if progress is not None:
            progress.update(1)
    return Evaluation(float(np.exp(total_nll / max(count, 1))), count, routing)


def _record_lookahead(routing: RoutingStats, moefied: dict[int, LayerMoefication], routes: dict, inputs: dict,
                      norm_weights: list[np.ndarray], top_k: int) -> None:
    for layer in routes:
        following = layer + 1
        if following not in routes:
            continue
        moe = moefied[following]
        renormed = inputs[layer] / norm_weights[layer] * norm_weights[following]
        logits = moe.router_logits(renormed)
        actual = np.zeros((len(logits), moe.num_experts), dtype=bool)  # [T, E]
        np.put_along_axis(actual, routes[following], True, axis=1)
        for factor in (1, 2):
            predicted = np.argsort(-logits, axis=1, kind="stable")[:, :min(factor * top_k, moe.num_experts)]
            hits = int(np.take_along_axis(actual, predicted, axis=1).sum())
            entry = routing.lookahead.setdefault((layer, factor), [0, 0])
            entry[0] += hits
            entry[1] += actual.sum()
