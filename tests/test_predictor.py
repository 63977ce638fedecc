"""The expert predictor and its calibration on synthetic route traces whose structure is known.

L = MoE layers, E = experts per layer, A = active experts per token, D = hidden size.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from edge.core.moe import MoeConfig, route
from streaming.calibration import RouteTrace, TraceRecorder, calibrate, format_calibration, replay
from streaming.predictor import (
    PREDICTOR_FILE,
    ExpertPredictor,
    PredictorError,
    SignalMix,
    SignalWeights,
    top_sets,
    read_predictor_file,
    write_predictor_file,
)

N_LAYERS, E, A = 4, 16, 2
LAYERS = [1, 2, 4, 5]  # MoE layers need not be consecutive (dense layers between them)
D = E * len(LAYERS)


def distinct_choice(rng, ids: np.ndarray) -> np.ndarray:
    """ids with duplicates replaced by random unused experts (a route names distinct experts)."""
    out = list(dict.fromkeys(int(i) for i in ids))
    while len(out) < len(ids):
        pick = int(rng.integers(E))
        if pick not in out:
            out.append(pick)
    return np.array(out)


def synthetic_routes(kind: str, n_tokens: int, seed: int = 0, noise: float = 0.05) -> np.ndarray:
    """[N, L, A] routes. temporal: a token's experts at a layer are a fixed permutation of the previous
    token's there; spatial: of the same token's at the previous MoE layer; random: no structure."""
    permutations = [np.random.default_rng(100 + m).permutation(E) for m in range(len(LAYERS))]  # the "model"
    rng = np.random.default_rng(seed)
    routes = np.zeros((n_tokens, len(LAYERS), A), np.int64)
    for t in range(n_tokens):
        for m in range(len(LAYERS)):
            if kind == "temporal" and t > 0:
                ids = permutations[m][routes[t - 1, m]]
            elif kind == "spatial" and m > 0:
                ids = permutations[m][routes[t, m - 1]]
            else:
                ids = rng.choice(E, A, replace=False)
            noisy = rng.random(A) < noise
            ids = np.where(noisy, rng.integers(0, E, A), ids)
            routes[t, m] = distinct_choice(rng, ids)
    return routes


def configs() -> dict[int, MoeConfig]:
    return {layer: MoeConfig(num_experts=E, top_k=A, intermediate_size=8) for layer in LAYERS}


def block_routers() -> dict:
    """Layer m's router reads its own block of E hidden dimensions (gain 1, no bias)."""
    routers = {}
    for m, layer in enumerate(LAYERS):
        router = np.zeros((E, D), np.float32)
        router[:, m * E:(m + 1) * E] = np.eye(E)
        routers[layer] = (np.ones(D, np.float32), router, None)
    return routers


def residual_pointing_at(routes_of_token: np.ndarray, rng, strength: float) -> np.ndarray:
    """A residual whose block for layer m is large at the experts the token will choose there."""
    residual = rng.normal(0, 1, D).astype(np.float32)
    for m, ids in enumerate(routes_of_token):
        residual[m * E + ids] += strength
    return residual


def drive(predictor: ExpertPredictor, routes: np.ndarray, prefill: int, gate_strength: float = 0.0, seed: int = 1):
    """One request: a prefill call of `prefill` tokens, then one call per token; observe then forecast."""
    rng = np.random.default_rng(seed)
    predictor.begin_request()
    calls = [slice(0, prefill)] + [slice(t, t + 1) for t in range(prefill, len(routes))]
    for rows in calls:
        residual = np.stack([residual_pointing_at(r, rng, gate_strength) for r in routes[rows]])  # [T, D]
        for m, layer in enumerate(LAYERS):
            predictor.observe(layer, routes[rows, m], residual)
            predictor.forecast(layer, residual)


def recall_with(mix: SignalMix, kind: str, depth: int = 1, gate_strength: float = 0.0, n_tokens: int = 300):
    predictor = ExpertPredictor(configs(), block_routers(), depth=depth, weights=SignalWeights({1: mix}))
    drive(predictor, synthetic_routes(kind, n_tokens), prefill=16, gate_strength=gate_strength)
    return predictor.stats()


def test_temporal_markov_chain_is_recalled():
    stats = recall_with(SignalMix(temporal=1.0), "temporal")
    assert stats["predictor_recall"] > 0.85
    assert stats["predictor_precision"] == stats["predictor_recall"]  # sets of top_k, routes of top_k
    assert stats["predictor_by_distance"][1]["actual"] == (300 - 16) * (len(LAYERS) - 1) * A


def test_spatial_chain_is_recalled_two_layers_ahead():
    stats = recall_with(SignalMix(spatial=1.0), "spatial", depth=2)
    by_distance = stats["predictor_by_distance"]
    assert by_distance[1]["recall"] > 0.85
    assert by_distance[2]["recall"] > 0.75  # chained through the layer between
    assert stats["predictor_recall_prefill"] is not None


def test_gate_lookahead_reads_the_next_routers():
    stats = recall_with(SignalMix(gate=1.0), "random", depth=2, gate_strength=6.0)
    assert stats["predictor_by_distance"][1]["recall"] > 0.95
    assert stats["predictor_by_distance"][2]["recall"] > 0.95


@pytest.mark.parametrize("mix", [SignalMix(temporal=1.0), SignalMix(spatial=1.0), SignalMix(frequency=1.0),
                                 SignalMix(gate=1.0, temporal=0.5, spatial=0.5, frequency=0.25)])
def test_random_routes_are_recalled_at_chance(mix):
    stats = recall_with(mix, "random", n_tokens=600)
    assert abs(stats["predictor_recall"] - A / E) < 0.04


def test_signals_are_distributions_and_counts_follow_routes():
    predictor = ExpertPredictor(configs(), block_routers(), depth=2)
    routes = synthetic_routes("temporal", 40)
    drive(predictor, routes, prefill=8)
    # every (token t-1, token t) pair of the first layer was counted A x A times, once
    assert predictor.temporal[LAYERS[0]].sum() == (len(routes) - 1) * A * A
    assert predictor.spatial[LAYERS[1]].sum() == len(routes) * A * A
    assert predictor.frequency[LAYERS[0]].sum() == len(routes) * A
    gate = predictor.corrected_gate(LAYERS[0], predictor.lookahead_logits(LAYERS[0], np.zeros((1, D))))
    signals = predictor.signals(LAYERS[0], gate, 1)
    for stack in signals.values():  # [T, S, E]
        np.testing.assert_allclose(stack.sum(-1), 1.0, rtol=1e-9)


def test_need_score_ranks_experts_in_use_and_forecasts():
    predictor = ExpertPredictor(configs(), block_routers(), depth=1, weights=SignalWeights({1: SignalMix(gate=1.0)}))
    rng = np.random.default_rng(0)
    route = np.array([[3, 7]])
    residual = residual_pointing_at(np.array([[3, 7], [5, 9], [0, 1], [2, 4]]), rng, 8.0)[None]
    predictor.observe(LAYERS[0], route, residual)
    need = predictor.forecast(LAYERS[0], residual)
    assert list(need) == [LAYERS[1]]
    assert set(np.argsort(-need[LAYERS[1]])[:A]) == {5, 9}
    assert predictor.need_score(LAYERS[0], 3) == 1.0  # in use now
    assert predictor.need_score(LAYERS[1], 5) > predictor.need_score(LAYERS[1], 6)
    assert predictor.need_score(LAYERS[2], 0) <= 1.0 / 2  # two MoE layers away, no forecast yet


def test_gate_lookahead_learns_the_drift_between_layers():
    """Layer 2's input is layer 1's plus a shift that rules out experts 0-7 of layer 2: the plain lookahead
    cannot know it, the learned drift does."""
    layers = {layer: config for layer, config in configs().items() if layer in (1, 2)}
    routers = {layer: block_routers()[layer] for layer in layers}
    shift = np.zeros(D, np.float32)
    shift[E + np.arange(8)] = -4.0  # layer 2 reads block 1 of the hidden dimensions
    rng = np.random.default_rng(7)
    predictor = ExpertPredictor(layers, routers, depth=1, weights=SignalWeights({1: SignalMix(gate=1.0)}))
    for _ in range(300):
        before = rng.normal(0, 1, (1, D)).astype(np.float32)
        after = before + shift
        for layer, residual in ((1, before), (2, after)):
            route = np.argsort(-predictor.raw_logits(layer, residual), axis=-1, kind="stable")[:, :A]
            predictor.observe(layer, route, residual)
            if layer == 1:
                predictor.forecast(layer, residual)
    assert np.all(predictor.drift(1, 2)[:8] < -1.0) and np.all(np.abs(predictor.drift(1, 2)[8:]) < 0.5)
    assert predictor.stats()["predictor_recall"] > 0.9  # chance among experts 8-15 alone would be 0.25


def test_sigmoid_correction_bias_and_groups_rank_like_the_router():
    rng = np.random.default_rng(3)
    n_experts, d = 16, 12
    deepseek = MoeConfig(num_experts=n_experts, top_k=4, intermediate_size=8, scoring="sigmoid", n_group=4,
                         topk_group=2, group_score="top2_sum", score_correction_bias=True)
    gain, router, bias = rng.normal(1, 0.1, d), rng.normal(0, 1, (n_experts, d)), rng.normal(0, 0.3, n_experts)
    predictor = ExpertPredictor({0: deepseek, 1: deepseek}, {0: (gain, router, bias), 1: (gain, router, bias)}, depth=1)
    residual = rng.normal(0, 1, (64, d)).astype(np.float32)
    logits = predictor.selection_logits(1, predictor.lookahead_logits(0, residual)[1])
    # the router's own selection rule, written out: sigmoid + bias, best 2 of 4 groups by top-2 sums, top 4
    x = residual / np.sqrt(np.mean(residual ** 2, -1, keepdims=True) + 1e-6) * gain
    selection = 1 / (1 + np.exp(-(x @ router.T))) + bias
    groups = np.sort(selection.reshape(64, 4, 4), -1)[..., -2:].sum(-1)
    allowed = np.repeat(np.argsort(-groups, -1)[:, :2, None] == np.arange(4)[None, None, :], 1, 0).any(1)
    expected = np.argsort(-np.where(np.repeat(allowed, 4, 1), selection, -np.inf), -1)[:, :4]
    np.testing.assert_array_equal(np.sort(np.argsort(-logits, -1)[:, :4], -1), np.sort(expected, -1))


def test_bad_input_is_refused_with_a_message():
    with pytest.raises(PredictorError, match=r"^no router given for MoE layers \[5\]; the gate lookahead needs every router$"):
        ExpertPredictor(configs(), {k: v for k, v in block_routers().items() if k != 5})
    predictor = ExpertPredictor(configs(), block_routers())
    with pytest.raises(PredictorError, match=r"^layer 3 is not a MoE layer of this model; MoE layers: \[1, 2, 4, 5\]$"):
        predictor.forecast(3, np.zeros((1, D)))
    with pytest.raises(PredictorError, match=r"^layer 1: route must be \[tokens, active\] ids in \[0, 16\), got shape \(2, 2\)$"):
        predictor.observe(1, np.array([[0, 16], [1, 2]]))
    with pytest.raises(PredictorError, match=r"^signal weights must be finite, non-negative and not all zero"):
        SignalMix()
    with pytest.raises(PredictorError, match=r"^the predictor looks at least 1 layer ahead, got depth 0$"):
        ExpertPredictor(configs(), block_routers(), depth=0)
    # a decode step's compiled calls do not check their bounds: the shapes are checked before them
    with pytest.raises(PredictorError, match=rf"^layer 1: router logits must be \[1, {E}\], got shape \(1, 3\)$"):
        predictor.observe(1, np.array([[0, 1]]), router_logits=np.zeros((1, 3), np.float32))
    with pytest.raises(PredictorError, match=rf"^the residual stream must be \[1, {D}\], got shape \(1, 5\)$"):
        predictor.observe_and_forecast(1, np.array([[0, 1]]), np.zeros((1, 5), np.float32),
                                       router_logits=np.zeros((1, E), np.float32))
    with pytest.raises(PredictorError, match=rf"^the residual stream must be \[1, {D}\], got shape \(7,\)$"):
        predictor.token_forecast(np.zeros(7, np.float32))


# ------------------------------------------------------------------------------------------ calibration


def record(kind: str, requests: int = 2, prefill: int = 12, decode: int = 60, gate_strength: float = 0.0):
    recorder = TraceRecorder(configs(), block_routers(), depth=2)
    rng = np.random.default_rng(5)
    for request in range(requests):
        routes = synthetic_routes(kind, prefill + decode, seed=10 + request)
        for rows in [slice(0, prefill)] + [slice(t, t + 1) for t in range(prefill, prefill + decode)]:
            residual = np.stack([residual_pointing_at(r, rng, gate_strength) for r in routes[rows]])
            for m, layer in enumerate(LAYERS):
                recorder.route(layer, routes[rows, m], residual)
        recorder.end_request()
    return recorder.trace(source=f"synthetic {kind}")


def test_trace_round_trip(tmp_path):
    trace = record("spatial")
    path = tmp_path / "trace.npz"
    trace.save(str(path))
    loaded = RouteTrace.load(str(path))
    assert (loaded.layers, loaded.depth, loaded.n_tokens, loaded.n_requests) == (LAYERS, 2, 2 * 72, 2)
    for layer in LAYERS:
        np.testing.assert_array_equal(loaded.routes[layer], trace.routes[layer])
    assert set(loaded.gate) == {(1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (2, 5), (4, 4), (4, 5), (5, 5)}
    np.testing.assert_allclose(loaded.gate[(1, 2)], trace.gate[(1, 2)], rtol=1e-3, atol=1e-3)  # stored as f16
    evidence = replay(loaded)
    assert sum(len(s) for s in evidence[1].signals) == 2 * 72 * 3  # tokens x layers with a successor


def test_calibration_finds_the_signal_that_carries_the_structure(tmp_path):
    result = calibrate(record("temporal"))
    best = result["distances"][1]["best"]
    assert best["weights"]["temporal"] > 0 and best["held_out"]["recall"] > 0.85
    assert result["distances"][1]["gate only"]["held_out"]["recall"] < 0.3  # the residuals are noise here
    assert result["fit_requests"] == [0] and result["held_out_requests"] == [1]
    table = format_calibration(result)
    assert "best without gate" in table and "temporal only" in table

    path = write_predictor_file(str(tmp_path), SignalWeights.from_dict(result["weights"]), {"tokens": result["tokens"]})
    assert path == str(tmp_path / PREDICTOR_FILE)
    weights = SignalWeights.for_checkpoint(str(tmp_path))
    assert weights.mix(1).temporal == best["weights"]["temporal"]
    assert weights.mix(5) == weights.mix(2)  # beyond the calibrated distances: the last mix
    assert SignalWeights.for_checkpoint(str(tmp_path / "missing")) == SignalWeights.default()


def test_predictor_file_with_another_version_is_refused(tmp_path):
    (tmp_path / PREDICTOR_FILE).write_text(json.dumps({"format": "zllm-expert-predictor", "version": 9}))
    with pytest.raises(PredictorError, match=r"predictor.json: format 'zllm-expert-predictor' version 9, expected "
                                             r"'zllm-expert-predictor' version 1; run `zllm-edge calibrate` again$"):
        read_predictor_file(str(tmp_path))


def test_recorder_needs_every_layer_of_a_call():
    recorder = TraceRecorder(configs(), block_routers(), depth=1)
    recorder.route(1, np.array([[0, 1]]), np.zeros((1, D)))
    with pytest.raises(PredictorError, match=r"^a forward call routed MoE layers \[1\] with token counts \[1\]; "):
        recorder.route(1, np.array([[0, 1]]), np.zeros((1, D)))


def test_one_token_gate_forecast_is_the_general_one():
    """A decode step with the gate alone runs a compiled forecast (kernels/cpu/forecast.py): the same
    needs, predicted sets and learned drift as the general numpy path, on routers with biases."""
    rng = np.random.default_rng(7)
    routers = {layer: (rng.uniform(0.5, 1.5, D).astype(np.float32), rng.normal(0, 1, (E, D)).astype(np.float32),
                       rng.normal(0, 0.5, E).astype(np.float32)) for layer in LAYERS}
    compiled, general = (ExpertPredictor(configs(), routers, depth=2) for _ in range(2))
    general._decodable = [False] * len(LAYERS)  # every forecast takes the numpy path
    routes = synthetic_routes("random", 40, seed=3)
    for predictor in (compiled, general):
        predictor.begin_request()
    for t in range(len(routes)):
        residual = rng.normal(0, 1, (1, D)).astype(np.float32)
        for m, layer in enumerate(LAYERS):
            for predictor in (compiled, general):
                predictor.observe(layer, routes[t:t + 1, m], residual)
            needs = [predictor.forecast(layer, residual) for predictor in (compiled, general)]
            assert needs[0].keys() == needs[1].keys()
            for target in needs[0]:
                np.testing.assert_allclose(needs[0][target], needs[1][target], rtol=1e-5, atol=1e-7)
                assert compiled.pending_sets(target).keys() == general.pending_sets(target).keys()
                for distance, predicted in general.pending_sets(target).items():
                    np.testing.assert_array_equal(compiled.pending_sets(target)[distance], predicted)
    np.testing.assert_allclose(compiled.drift(1, 2), general.drift(1, 2), rtol=1e-5, atol=1e-6)
    assert compiled.stats()["predictor_recall"] == general.stats()["predictor_recall"]
    assert compiled._decodable[0] and compiled.forecast_path() == "compiled"


def test_one_token_observe_counts_every_transition():
    """A decode step counts its transitions and frequencies in one compiled call
    (kernels/cpu/forecast.py `count_decode_route`): the counts np.add.at gives over the whole
    sequence of routes, a repeated id counted once per occurrence."""
    rng = np.random.default_rng(11)
    routers = {layer: (np.ones(D, np.float32), rng.normal(0, 1, (E, D)).astype(np.float32), None) for layer in LAYERS}
    predictor = ExpertPredictor(configs(), routers, depth=2)
    routes = synthetic_routes("random", 30, seed=5)
    routes[7, 2] = [3, 3]  # a route may repeat an id
    for t in range(len(routes)):
        residual = rng.normal(0, 1, (1, D)).astype(np.float32)
        for m, layer in enumerate(LAYERS):
            predictor.observe(layer, routes[t:t + 1, m], residual)
            predictor.forecast(layer, residual)
    for m, layer in enumerate(LAYERS):
        temporal, spatial, frequency = np.zeros((E, E)), np.zeros((E, E)), np.zeros(E)
        for t in range(len(routes)):
            np.add.at(frequency, routes[t, m], 1.0)
            if t > 0:
                np.add.at(temporal, (np.repeat(routes[t - 1, m], A), np.tile(routes[t, m], A)), 1.0)
            if m > 0:
                np.add.at(spatial, (np.repeat(routes[t, m - 1], A), np.tile(routes[t, m], A)), 1.0)
        np.testing.assert_array_equal(predictor.temporal[layer], temporal)
        np.testing.assert_array_equal(predictor.frequency[layer], frequency)
        if m > 0:
            np.testing.assert_array_equal(predictor.spatial[layer], spatial)
    assert predictor.frequency[LAYERS[2]][3] >= 2


def test_one_token_drift_step_is_the_moving_average():
    """A decode step moves the drift of each lookahead toward the target's real logits:
    drift <- (1 - rate) drift + rate (actual - lookahead), in float32."""
    rng = np.random.default_rng(2)
    routers = {layer: (rng.uniform(0.5, 1.5, D).astype(np.float32), rng.normal(0, 1, (E, D)).astype(np.float32),
                       None) for layer in LAYERS}
    predictor = ExpertPredictor(configs(), routers, depth=1)
    expected = np.zeros(E, np.float32)
    for t in range(3):
        residual = rng.normal(0, 1, (1, D)).astype(np.float32)
        predictor.observe(LAYERS[0], np.array([[0, 1]]), residual)
        predictor.forecast(LAYERS[0], residual)
        lookahead = predictor.lookahead_logits(LAYERS[0], residual)[LAYERS[1]][0]
        actual = rng.normal(0, 1, (1, E)).astype(np.float32)
        predictor.observe(LAYERS[1], np.array([[2, 3]]), router_logits=actual)
        expected = np.float32(0.9) * expected + np.float32(0.1) * (actual[0] - lookahead)
        np.testing.assert_allclose(predictor.drift(LAYERS[0], LAYERS[1]), expected, rtol=1e-5, atol=1e-6)
        predictor.observe(LAYERS[2], np.array([[0, 1]]))


@pytest.mark.parametrize("config", [
    MoeConfig(num_experts=16, top_k=4, intermediate_size=8),
    MoeConfig(num_experts=16, top_k=4, intermediate_size=8, scoring="unit"),
    MoeConfig(num_experts=16, top_k=3, intermediate_size=8, scoring="sigmoid", norm_topk_prob=True),
    MoeConfig(num_experts=16, top_k=4, intermediate_size=8, scoring="sigmoid", score_correction_bias=True),
    MoeConfig(num_experts=16, top_k=4, intermediate_size=8, n_group=4, topk_group=2, group_score="max"),
    MoeConfig(num_experts=16, top_k=4, intermediate_size=8, scoring="sigmoid", n_group=4, topk_group=2,
              group_score="top2_sum", score_correction_bias=True),
], ids=["softmax", "unit", "sigmoid", "sigmoid-bias", "groups-max", "deepseek-v3"])
def test_selection_logits_pick_the_routers_experts(config):
    """Routing is defined once (edge/core/moe.py `route`): the experts the predictor's selection logits
    rank highest are exactly the ones `route` chooses from the same router logits."""
    rng = np.random.default_rng(11)
    d = 12
    bias = rng.normal(0, 0.3, config.num_experts).astype(np.float32)
    gain, router = rng.normal(1, 0.1, d).astype(np.float32), rng.normal(0, 1, (config.num_experts, d)).astype(np.float32)
    correction = bias if config.score_correction_bias else None
    predictor = ExpertPredictor({0: config, 1: config}, {0: (gain, router, correction), 1: (gain, router, correction)},
                                depth=1)
    logits = rng.normal(0, 2, (200, config.num_experts)).astype(np.float32)
    ranked = top_sets(predictor.selection_logits(1, logits), config.top_k)
    ids, _ = route(logits, config, correction)
    np.testing.assert_array_equal(np.sort(ranked, -1), np.sort(ids, -1))


def test_the_compiled_top_k_orders_as_a_stable_descending_argsort():
    """kernels/cpu/forecast.py largest_first, which orders forecast sets and prefetches, picks what
    np.argsort(-scores, kind="stable") does: ties to the lower id, NaN after every number. (A helper is
    compiled into the kernels that call it, so it is called here from a Kernel, as they do.)"""
    from numba import types

    from kernels.cpu.forecast import largest_first
    from kernels.cpu.runtime import Kernel, mutable, readonly

    def _ordered(scores, size, k, order):
        largest_first(scores, size, k, order)

    signature = types.void(readonly(types.float64, 1), types.int64, types.int64, mutable(types.int64, 1))
    ordered = Kernel(_ordered, [signature])
    rng = np.random.default_rng(7)
    for trial in range(400):
        size = int(rng.integers(1, 70))
        k = int(rng.integers(1, size + 1))
        scores = [rng.random(size), rng.integers(0, 4, size).astype(np.float64),
                  np.where(rng.random(size) < 0.3, np.nan, rng.integers(0, 3, size)).astype(np.float64),
                  np.where(rng.random(size) < 0.2, -np.inf, rng.random(size))][trial % 4]
        order = np.full(size, -1, np.int64)
        padded = np.concatenate([scores, rng.random(3)])  # entries past `size` are not read
        padded.setflags(write=False)
        ordered(padded, size, k, order)
        np.testing.assert_array_equal(order[:k], np.argsort(-scores, kind="stable")[:k])
