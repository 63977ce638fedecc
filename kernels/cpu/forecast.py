"""The expert predictor's gate forecast for one decode token, in one compiled call.

D = hidden size, S = the routed experts of the targets (the next `depth` MoE layers) together,
n = targets. For the default signal mix (the drift-corrected gate alone) a decode step's forecast
is a few dozen tiny numpy operations per MoE layer; on the model's thread, between its kernels,
they cost more than the layer's prediction is worth. This computes the same quantities
(streaming/predictor.py `lookahead_logits` and `forecast_from_lookahead`) for one token:

    raw   = rms_norm(x) @ R^T + bias            R [S, D]: the targets' routers, norm gains folded in
    p_t   = mix_t * softmax(raw_t + drift_t)    per target t, over its E_t experts (float64)
    need  = min(1, top_k_t * p_t / sum(p_t)) / distance_t
    sets  = the top_k_t largest p_t, ties to the lower id (as a stable argsort)
"""
from __future__ import annotations

import numpy as np
from numba import types

from kernels.cpu.runtime import kernel, mutable, readonly

_F32_RO, _F32_RO_2D, _F64_RO, _I64_RO = (readonly(types.float32, 1), readonly(types.float32, 2),
                                         readonly(types.float64, 1), readonly(types.int64, 1))


@kernel(types.void(_F32_RO, _F32_RO_2D, _F32_RO, _F32_RO, types.float32, _F64_RO, _I64_RO, _I64_RO, _I64_RO,
                   mutable(types.float32, 1), mutable(types.float64, 1), mutable(types.int64, 2)), keep_gil=True)
def gate_forecast(x, routers, bias, drift, eps, mix, top_k, distance, offsets, raw, need, sets):
    """x [D], routers [S, D], bias and drift [S] (f32); eps; per target: mix weight, top_k, distance,
    offsets [n + 1] into S. Out: raw [S] (the lookahead logits), need [S], sets [n, >= max top_k]."""
    d_model = x.shape[0]
    square_sum = np.float32(0.0)
    for i in range(d_model):
        square_sum += x[i] * x[i]
    inverse = np.float32(1.0) / np.sqrt(square_sum / np.float32(d_model) + eps)
    for s in range(routers.shape[0]):
        total = np.float32(0.0)
        for i in range(d_model):
            total += x[i] * routers[s, i]
        raw[s] = total * inverse + bias[s]
    for t in range(offsets.shape[0] - 1):
        begin, end = offsets[t], offsets[t + 1]
        peak = -np.inf
        for s in range(begin, end):
            peak = max(peak, np.float64(raw[s] + drift[s]))
        exp_sum = 0.0
        for s in range(begin, end):
            need[s] = np.exp(np.float64(raw[s] + drift[s]) - peak)
            exp_sum += need[s]
        score_sum = 0.0
        for s in range(begin, end):
            need[s] = mix[t] * (need[s] / exp_sum)  # p_t
            score_sum += need[s]
        for k in range(top_k[t]):  # the k-th largest, ties to the lower id, not taken before
            best = -1
            for s in range(begin, end):
                taken = False
                for j in range(k):
                    taken = taken or sets[t, j] == s - begin
                if not taken and (best < 0 or need[s] > need[best]):
                    best = s
            sets[t, k] = best - begin
        for s in range(begin, end):
            need[s] = min(1.0, top_k[t] * need[s] / score_sum) / distance[t]


@kernel(types.void(_I64_RO, _I64_RO, mutable(types.float64, 2), _I64_RO, mutable(types.float64, 2),
                   mutable(types.float64, 1)), keep_gil=True)
def count_decode_route(ids, previous, temporal, before, spatial, frequency):
    """What one decode token's route `ids` [A] at a layer teaches the predictor's counts
    (streaming/predictor.py `observe`), each pair counted once per occurrence (as np.add.at):

        temporal[i, j]  += 1   i in `previous` (the layer's route for the token before; empty: none)
        spatial[i, j]   += 1   i in `before` (this token's route at the MoE layer before; empty: none)
        frequency[j]    += 1   for every j in ids"""
    for i in previous:
        for j in ids:
            temporal[i, j] += 1.0
    for i in before:
        for j in ids:
            spatial[i, j] += 1.0
    for j in ids:
        frequency[j] += 1.0


@kernel(types.void(mutable(types.float32, 1), _F32_RO, _F32_RO, types.float32), keep_gil=True)
def learn_decode_drift(drift, actual, lookahead, rate):
    """drift <- (1 - rate) drift + rate (actual - lookahead): one decode token's step of the moving
    average of how far a layer's real router logits [E] drift from those looked ahead."""
    keep = np.float32(1.0) - rate
    for e in range(drift.shape[0]):
        drift[e] = keep * drift[e] + rate * (actual[e] - lookahead[e])
