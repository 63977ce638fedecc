"""MoEfication math: split a dense SwiGLU feed-forward block into experts and fit a router.

Zhang et al., 2022, "MoEfication: Transformer Feed-forward Layers are Mixtures of Experts":
the intermediate neurons of a dense FFN are partitioned into E equal groups (the experts) and
a cheap router picks, per token, the K groups that matter most. Because the groups partition
the neurons, running all E experts (each weighted 1.0) is exactly the dense FFN.

T = tokens, D = hidden size, I = dense intermediate size, E = experts, N = I / E neurons per
expert, K = experts chosen per token.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CLUSTERINGS = ("weights", "coactivation")
KMEANS_ITERATIONS = 25
COACTIVATION_TOKENS = 4096   # tokens whose activations describe each neuron for co-activation clustering
ROUTER_RIDGE = 1e-3          # ridge strength relative to the mean diagonal of the normal equations
VALIDATION_SHARE = 0.2       # calibration tokens held back to choose the clustering


def silu(values: np.ndarray) -> np.ndarray:
    return values / (1.0 + np.exp(-values))


@dataclass
class DenseFfn:
    """One dense SwiGLU block in float32: down(silu(gate(x)) * up(x))."""

    gate: np.ndarray  # [I, D]
    up: np.ndarray    # [I, D]
    down: np.ndarray  # [D, I]

    @property
    def intermediate_size(self) -> int:
        return self.gate.shape[0]

    def activations(self, x: np.ndarray) -> np.ndarray:
        """h [T, I] = silu(x @ gate^T) * (x @ up^T)."""
        return silu(x @ self.gate.T) * (x @ self.up.T)

    def forward(self, x: np.ndarray) -> np.ndarray:
        return self.activations(x) @ self.down.T


def top_k_experts(logits: np.ndarray, k: int) -> np.ndarray:
    """ids [T, K] of the K largest logits per row, best first; ties go to the lowest id."""
    return np.argsort(-logits, axis=-1, kind="stable")[:, :k]


@dataclass
class LayerMoefication:
    """One layer's partition of neurons into experts and its linear router."""

    neurons: np.ndarray        # [E, N] neuron ids of each expert, ascending within an expert
    router_weight: np.ndarray  # [E, D]
    router_bias: np.ndarray    # [E]
    clustering: str            # which of CLUSTERINGS produced the partition
    validation_error: float    # relative L2 error of the routed output on held-back calibration tokens

    @property
    def num_experts(self) -> int:
        return self.neurons.shape[0]

    def expert_of_neuron(self) -> np.ndarray:
        """[I] the expert each neuron belongs to."""
        owner = np.empty(self.neurons.size, dtype=np.intp)
        for expert, ids in enumerate(self.neurons):
            owner[ids] = expert
        return owner

    def router_logits(self, x: np.ndarray) -> np.ndarray:
        """[T, E] = x @ W^T + b."""
        return x @ self.router_weight.T + self.router_bias

    def route(self, x: np.ndarray, k: int) -> np.ndarray:
        return top_k_experts(self.router_logits(x), k)

    def forward(self, ffn: DenseFfn, x: np.ndarray, chosen: np.ndarray) -> np.ndarray:
        """Sum of the chosen experts' outputs, each weighted 1.0: [T, D]."""
        return masked_output(ffn, ffn.activations(x), self.expert_of_neuron(), chosen)


def masked_output(ffn: DenseFfn, h: np.ndarray, owner: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """down(h restricted to the neurons of the chosen experts): [T, D]."""
    chosen_mask = np.zeros((h.shape[0], int(owner.max()) + 1), dtype=bool)  # [T, E]
    np.put_along_axis(chosen_mask, chosen, True, axis=1)
    return (h * chosen_mask[:, owner]) @ ffn.down.T


# --- clustering --------------------------------------------------------------------------------

def balanced_assignment(similarity: np.ndarray, capacity: int) -> np.ndarray:
    """Each row [I] to one of E clusters, at most `capacity` rows per cluster.

    In rounds, every unassigned row proposes to its most similar cluster that still has room; a
    cluster accepts its strongest proposals up to its room. Each round either places every
    remaining row or fills a cluster, so there are at most E + 1 rounds."""
    rows, clusters = similarity.shape
    open_similarity = similarity.astype(np.float64)  # full clusters are masked to -inf
    assignment = np.full(rows, -1, dtype=np.intp)
    filled = np.zeros(clusters, dtype=np.intp)
    while True:
        free = np.flatnonzero(assignment < 0)
        if len(free) == 0:
            return assignment
        favourite = np.argmax(open_similarity[free], axis=1)
        strength = open_similarity[free, favourite]
        for cluster in np.unique(favourite):
            proposing = favourite == cluster
            room = capacity - filled[cluster]
            accepted = free[proposing][np.argsort(-strength[proposing], kind="stable")[:room]]
            assignment[accepted] = cluster
            filled[cluster] += len(accepted)
        open_similarity[:, filled >= capacity] = -np.inf


def _unit_rows(features: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(features, axis=1, keepdims=True)
    return features / np.maximum(norms, 1e-12)


def balanced_kmeans(features: np.ndarray, clusters: int, seed: int = 0,
                    iterations: int = KMEANS_ITERATIONS) -> np.ndarray:
    """Spherical k-means with equal cluster sizes: [I, F] features -> [E, N] member ids, ascending."""
    points = _unit_rows(features.astype(np.float32))
    size = len(points) // clusters
    rng = np.random.default_rng(seed)
    # k-means++ seeding on cosine distance, so the first centroids are spread out
    centroids = [points[rng.integers(len(points))]]
    for _ in range(1, clusters):
        distance = 1.0 - np.max(points @ np.stack(centroids).T, axis=1)
        weights = np.maximum(distance, 0.0) ** 2
        total = weights.sum()
        pick = rng.choice(len(points), p=weights / total) if total > 0 else rng.integers(len(points))
        centroids.append(points[pick])
    centroid_matrix = np.stack(centroids)  # [E, F]
    assignment = None
    for _ in range(iterations):
        new_assignment = balanced_assignment(points @ centroid_matrix.T, size)
        if assignment is not None and np.array_equal(new_assignment, assignment):
            break
        assignment = new_assignment
        centroid_matrix = _unit_rows(np.stack([points[assignment == c].mean(axis=0) for c in range(clusters)]))
    members = [np.flatnonzero(assignment == c) for c in range(clusters)]
    return np.stack(members)


def neuron_features(ffn: DenseFfn, h: np.ndarray, clustering: str) -> np.ndarray:
    """What describes a neuron for clustering: [I, F]."""
    if clustering == "weights":  # the directions the neuron reads from, for its gate and its up projection
        return np.concatenate([_unit_rows(ffn.gate), _unit_rows(ffn.up)], axis=1)
    if clustering == "coactivation":  # how strongly it fires on each calibration token
        return np.abs(h[:COACTIVATION_TOKENS]).T
    raise ValueError(f"clustering {clustering!r} is not one of {CLUSTERINGS}")


# --- router ------------------------------------------------------------------------------------

def expert_output_norms(ffn: DenseFfn, h: np.ndarray, neurons: np.ndarray) -> np.ndarray:
    """[T, E] the L2 norm of each expert's contribution to the FFN output: what routing should keep."""
    norms = np.empty((h.shape[0], len(neurons)), dtype=np.float32)
    for expert, ids in enumerate(neurons):
        norms[:, expert] = np.linalg.norm(h[:, ids] @ ffn.down[:, ids].T, axis=1)
    return norms


def fit_linear_router(x: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ridge least squares from x [T, D] to targets [T, E]: weight [E, D], bias [E]."""
    design = np.concatenate([x, np.ones((len(x), 1), dtype=x.dtype)], axis=1).astype(np.float64)
    normal = design.T @ design
    normal[np.diag_indices_from(normal)] += ROUTER_RIDGE * np.trace(normal) / len(normal)
    solution = np.linalg.solve(normal, design.T @ targets.astype(np.float64))  # [D + 1, E]
    return solution[:-1].T.astype(np.float32), solution[-1].astype(np.float32)


def relative_error(approx: np.ndarray, exact: np.ndarray) -> float:
    return float(np.linalg.norm(approx - exact) / max(np.linalg.norm(exact), 1e-30))


def moefy_layer(ffn: DenseFfn, x: np.ndarray, experts: int, top_k: int,
                clusterings: tuple[str, ...] = CLUSTERINGS, seed: int = 0) -> LayerMoefication:
    """Partition one FFN into `experts` experts and fit its router on calibration inputs x [T, D].

    Each clustering in `clusterings` is tried; the one whose top_k routed output is closest to the
    dense output on the held-back calibration tokens wins, and its router is refitted on all tokens."""
    split = int(len(x) * (1.0 - VALIDATION_SHARE))
    h = ffn.activations(x)  # [T, I]
    dense_validation = h[split:] @ ffn.down.T
    best = None
    for clustering in clusterings:
        neurons = balanced_kmeans(neuron_features(ffn, h[:split], clustering), experts, seed)
        weight, bias = fit_linear_router(x[:split], expert_output_norms(ffn, h[:split], neurons))
        candidate = LayerMoefication(neurons, weight, bias, clustering, 0.0)
        chosen = candidate.route(x[split:], top_k)
        candidate.validation_error = relative_error(
            masked_output(ffn, h[split:], candidate.expert_of_neuron(), chosen), dense_validation)
        if best is None or candidate.validation_error < best.validation_error:
            best = candidate
    best.router_weight, best.router_bias = fit_linear_router(x, expert_output_norms(ffn, h, best.neurons))
    return best
