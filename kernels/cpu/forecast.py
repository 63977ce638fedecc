"""The expert predictor's decode step in compiled calls: what one token's route at a MoE layer
teaches it, and its gate forecast of the layers ahead.

L = MoE layers (by ordinal), E = the most routed experts of a layer, A = the most active experts,
D = hidden size, d = distance ahead in MoE layers (1..depth, depth at most L - 1), R = rows of every layer's stacked
lookahead routers together.

For the default signal mix (the drift-corrected gate alone) a decode step is a few dozen tiny numpy
operations per MoE layer; on the model's thread, between its kernels, they cost more than the
layer's prediction is worth. These compute the same quantities as streaming/predictor.py's general
path for one token, on the predictor's state held in plain arrays (its "decode tables", in this
order, the arguments of every call below):

    routers   [R, D] f32   per layer p, its targets' routers (norm gains folded in) stacked: target j
                           (the MoE layer p + 1 + j, d = j + 1) owns rows spans[p, j, 0]:spans[p, j, 1]
    bias      [R] f32      each row's router bias (0 without one)
    drift     [R] f32      the moving average of each target's real logits minus those looked ahead
    raw       [R] f32      the latest lookahead logits (pending a target's real ones)
    spans     [L, depth, 2], targets [L]: the rows of each layer's targets, how many it has
    mix       [L, depth] f64  the gate's weight in each target's mix
    sizes, top_k [L]      each layer's routed experts and active experts per token
    temporal, spatial [L, E, E] f64, frequency [L, E] f64: the counts (streaming/predictor.py)
    previous [L, A], previous_len [L]: each layer's route for the last token seen (length 0: none)
    route [L, A], route_len [L]: this decode pass's routes so far
    looked [L, depth + 1]: target q's raw lookahead from q - d is pending (1) or not (0)
    pending [L, depth + 1, A], pending_valid [L, depth + 1]: the sets forecast for q from d ahead
    need [L, E] f64, need_valid [L]: the latest need scores of each layer (valid: 1)
    next_mix [L + 1, 2] f64: the next-token estimate's (temporal, frequency) weights per distance
    accuracy [depth + 1, 3] i64: decode forecasts' hits, predicted, actual per distance
    status [STATUS_FIELDS] i64: the layer seen last, forecasts made, whether the pass is a decode one

The gate forecast of target t from the residual x entering layer p's FFN:

    raw   = rms_norm(x) @ R^T + bias
    p_t   = mix_t * softmax(raw_t + drift_t)    over t's experts (float64)
    need  = min(1, top_k_t * p_t / sum(p_t)) / d
    sets  = the top_k_t largest p_t, ties to the lower id (as a stable argsort)

and the next-token estimate of a layer q already passed (d MoE layers until it runs again):

    need  = min(1, top_k * (w_t * mean_i temporal[i] / sum(temporal[i]) + w_f * freq / sum(freq))
            / (w_t + w_f)) / d      (counts + SMOOTHING; i over q's previous route; in use now: 1)
"""
from __future__ import annotations

import numpy as np
from numba import types

from kernels.cpu.runtime import helper, kernel, mutable, readonly

SMOOTHING = 0.1  # Laplace pseudo-count per transition: unseen transitions keep a little mass
P_CURRENT, P_PREDICTIONS, P_DECODE_PASS = range(3)  # status[...]
STATUS_FIELDS = 3

_F32, _F64, _I64 = types.float32, types.float64, types.int64
_TABLES = (readonly(_F32, 2), readonly(_F32, 1), mutable(_F32, 1), mutable(_F32, 1), readonly(_I64, 3),
           readonly(_I64, 1), readonly(_F64, 2), readonly(_I64, 1), readonly(_I64, 1), mutable(_F64, 3),
           mutable(_F64, 3), mutable(_F64, 2), mutable(_I64, 2), mutable(_I64, 1), mutable(_I64, 2), mutable(_I64, 1),
           mutable(_I64, 2), mutable(_I64, 3), mutable(_I64, 2), mutable(_F64, 2), mutable(_I64, 1), readonly(_F64, 2),
           mutable(_I64, 2), mutable(_I64, 1))
# a decode step's arguments after the tables: layer p, the token's route [A], its router logits [E]
# (empty: none), the drift's rate, the residual entering the FFN [D], the norm's epsilon
DECODE_ARGUMENT_TYPES = (*_TABLES, _I64, readonly(_I64, 1), readonly(_F32, 1), _F32, readonly(_F32, 1), _F32)


@helper
def _ranks_above(a, b):
    """Whether score a goes before score b in descending order, NaN after every number."""
    return a > b or (a == a and b != b)


@helper
def largest_first(scores, size, k, order):
    """order[:k] = the ids of the k largest of scores[:size] in descending order, ties to the lower id and
    NaN after every number (np.argsort(-scores, kind="stable")[:k]), by insertion into the k kept."""
    kept = 0
    for e in range(size):
        score = scores[e]
        i = kept
        while i > 0 and _ranks_above(score, scores[order[i - 1]]):
            i -= 1
        if i >= k:
            continue
        last = min(kept, k - 1)
        for j in range(last, i, -1):
            order[j] = order[j - 1]
        order[i] = e
        kept = min(kept + 1, k)


@helper
def router_logits(x, eps, routers, bias, begin, end, out):
    """out[s] = rms_norm(x) . routers[s] + bias[s] for rows s in [begin, end) (norm gains folded into
    the routers), the sums in f32."""
    d_model = x.shape[0]
    square_sum = np.float32(0.0)
    for i in range(d_model):
        square_sum += x[i] * x[i]
    inverse = np.float32(1.0) / np.sqrt(square_sum / np.float32(d_model) + eps)
    for s in range(begin, end):
        total = np.float32(0.0)
        for i in range(d_model):
            total += x[i] * routers[s, i]
        out[s] = total * inverse + bias[s]


@helper
def observe_decode(routers, bias, drift, raw, spans, targets, mix, sizes, top_k, temporal, spatial, frequency,
                   previous, previous_len, route, route_len, looked, pending, pending_valid, need, need_valid,
                   next_mix, accuracy, status, p, ids, logits, rate):
    """What layer p's route `ids` [A] for one token teaches: score the sets forecast for it, move the
    drift of each lookahead of it toward its real router logits [E] (none given: empty), count its
    transitions (each pair once per occurrence, as np.add.at), and make it the layer seen last."""
    current = status[P_CURRENT]
    if current < 0 or p <= current:  # a new forward pass starts at its first MoE layer
        route_len[:] = 0
        status[P_DECODE_PASS] = 1
    for d in range(1, pending_valid.shape[1]):
        if pending_valid[p, d]:
            pending_valid[p, d] = 0
            hits = 0
            for expert in ids:
                for k in range(top_k[p]):
                    if pending[p, d, k] == expert:
                        hits += 1
                        break
            accuracy[d, 0] += hits
            accuracy[d, 1] += top_k[p]
            accuracy[d, 2] += ids.shape[0]
        if looked[p, d]:
            looked[p, d] = 0
            if logits.shape[0] > 0:
                begin = spans[p - d, d - 1, 0]
                keep = np.float32(1.0) - rate
                for e in range(sizes[p]):
                    drift[begin + e] = keep * drift[begin + e] + rate * (logits[e] - raw[begin + e])
    for i in previous[p, :previous_len[p]]:
        for j in ids:
            temporal[p, i, j] += 1.0
    if p > 0:
        for i in route[p - 1, :route_len[p - 1]]:
            for j in ids:
                spatial[p, i, j] += 1.0
    for j in ids:
        frequency[p, j] += 1.0
    n = ids.shape[0]
    previous[p, :n] = ids
    route[p, :n] = ids
    previous_len[p] = route_len[p] = n
    status[P_CURRENT] = p
    for q in range(p + 1):  # needs of layers not ahead any more are estimated again when asked
        need_valid[q] = 0


@helper
def forecast_decode(routers, bias, drift, raw, spans, targets, mix, sizes, top_k, temporal, spatial, frequency,
                    previous, previous_len, route, route_len, looked, pending, pending_valid, need, need_valid,
                    next_mix, accuracy, status, p, x, eps):
    """The gate forecast of layer p's targets from the residual x [D] entering its FFN: their raw
    lookahead, need scores and predicted sets, pending their real routes."""
    n_targets = targets[p]
    if n_targets == 0:
        return
    router_logits(x, eps, routers, bias, spans[p, 0, 0], spans[p, n_targets - 1, 1], raw)
    for j in range(n_targets):
        q, d, begin = p + 1 + j, j + 1, spans[p, j, 0]
        size, k_q = sizes[q], top_k[q]
        scores = need[q]
        peak = -np.inf
        for e in range(size):
            peak = max(peak, np.float64(raw[begin + e] + drift[begin + e]))
        exp_sum = 0.0
        for e in range(size):
            scores[e] = np.exp(np.float64(raw[begin + e] + drift[begin + e]) - peak)
            exp_sum += scores[e]
        score_sum = 0.0
        for e in range(size):
            scores[e] = mix[p, j] * (scores[e] / exp_sum)  # p_t
            score_sum += scores[e]
        largest_first(scores, size, k_q, pending[q, d])
        for e in range(size):
            scores[e] = min(1.0, k_q * scores[e] / score_sum) / d
        pending_valid[q, d] = looked[q, d] = need_valid[q] = 1
    status[P_PREDICTIONS] += n_targets


@helper
def next_token_need(routers, bias, drift, raw, spans, targets, mix, sizes, top_k, temporal, spatial, frequency,
                    previous, previous_len, route, route_len, looked, pending, pending_valid, need, need_valid,
                    next_mix, accuracy, status, q, in_use):
    """need[q] by the next-token estimate (the layer's temporal and frequency counts), its experts
    `in_use` now set to 1."""
    n_layers, size = sizes.shape[0], sizes[q]
    distance = (q - status[P_CURRENT]) % n_layers
    if distance == 0:
        distance = n_layers
    w_temporal, w_frequency = next_mix[distance, 0], next_mix[distance, 1]
    scores = need[q]
    for e in range(size):
        scores[e] = 0.0
    rows = previous_len[q]
    for i in previous[q, :rows]:
        row_sum = 0.0
        for e in range(size):
            row_sum += temporal[q, i, e] + SMOOTHING
        for e in range(size):
            scores[e] += (temporal[q, i, e] + SMOOTHING) / row_sum
    count_sum = 0.0
    for e in range(size):
        count_sum += frequency[q, e] + SMOOTHING
    for e in range(size):
        temporal_share = scores[e] / rows if rows > 0 else 1.0 / size
        share = (w_temporal * temporal_share + w_frequency * (frequency[q, e] + SMOOTHING) / count_sum) \
            / (w_temporal + w_frequency)
        scores[e] = min(1.0, top_k[q] * share) / distance
    for expert in in_use:
        scores[expert] = 1.0
    need_valid[q] = 1


@kernel(types.void(*_TABLES, _I64, readonly(_I64, 1), readonly(_F32, 1), _F32), keep_gil=True)
def decode_observe(routers, bias, drift, raw, spans, targets, mix, sizes, top_k, temporal, spatial, frequency,
                   previous, previous_len, route, route_len, looked, pending, pending_valid, need, need_valid,
                   next_mix, accuracy, status, p, ids, logits, rate):
    """observe_decode, on its own (a forecast not compiled follows)."""
    observe_decode(routers, bias, drift, raw, spans, targets, mix, sizes, top_k, temporal, spatial, frequency,
                   previous, previous_len, route, route_len, looked, pending, pending_valid, need, need_valid,
                   next_mix, accuracy, status, p, ids, logits, rate)


@kernel(types.void(*_TABLES, _I64, readonly(_F32, 1), _F32), keep_gil=True)
def decode_forecast(routers, bias, drift, raw, spans, targets, mix, sizes, top_k, temporal, spatial, frequency,
                    previous, previous_len, route, route_len, looked, pending, pending_valid, need, need_valid,
                    next_mix, accuracy, status, p, x, eps):
    """forecast_decode, on its own."""
    forecast_decode(routers, bias, drift, raw, spans, targets, mix, sizes, top_k, temporal, spatial, frequency,
                    previous, previous_len, route, route_len, looked, pending, pending_valid, need, need_valid,
                    next_mix, accuracy, status, p, x, eps)


@kernel(types.void(*DECODE_ARGUMENT_TYPES), keep_gil=True)
def decode_step(routers, bias, drift, raw, spans, targets, mix, sizes, top_k, temporal, spatial, frequency,
                previous, previous_len, route, route_len, looked, pending, pending_valid, need, need_valid,
                next_mix, accuracy, status, p, ids, logits, rate, x, eps):
    """observe_decode then forecast_decode: a decode step's whole predictor work at layer p."""
    observe_decode(routers, bias, drift, raw, spans, targets, mix, sizes, top_k, temporal, spatial, frequency,
                   previous, previous_len, route, route_len, looked, pending, pending_valid, need, need_valid,
                   next_mix, accuracy, status, p, ids, logits, rate)
    forecast_decode(routers, bias, drift, raw, spans, targets, mix, sizes, top_k, temporal, spatial, frequency,
                    previous, previous_len, route, route_len, looked, pending, pending_valid, need, need_valid,
                    next_mix, accuracy, status, p, x, eps)


@kernel(types.void(*_TABLES, _I64, readonly(_I64, 1)), keep_gil=True)
def estimate_need(routers, bias, drift, raw, spans, targets, mix, sizes, top_k, temporal, spatial, frequency,
                  previous, previous_len, route, route_len, looked, pending, pending_valid, need, need_valid,
                  next_mix, accuracy, status, q, in_use):
    """next_token_need, on its own (the eviction asks for a layer's need)."""
    next_token_need(routers, bias, drift, raw, spans, targets, mix, sizes, top_k, temporal, spatial, frequency,
                    previous, previous_len, route, route_len, looked, pending, pending_valid, need, need_valid,
                    next_mix, accuracy, status, q, in_use)


@kernel(types.void(readonly(_F32, 1), readonly(_F32, 2), readonly(_F32, 1), _F32, _I64, mutable(_F64, 1)),
        keep_gil=True)
def embedding_need(x, router, bias, eps, top_k, need):
    """The first MoE layer's need scores from a token's embedding x [D], before layer 0 runs: its router
    R [E, D] (norm gain folded in) applied to rms_norm(x), need = min(1, top_k * softmax(raw))."""
    router_logits(x, eps, router, bias, 0, router.shape[0], need)
    peak = -np.inf
    for e in range(router.shape[0]):
        peak = max(peak, need[e])
    exp_sum = 0.0
    for e in range(router.shape[0]):
        need[e] = np.exp(need[e] - peak)
        exp_sum += need[e]
    for e in range(router.shape[0]):
        need[e] = min(1.0, top_k * (need[e] / exp_sum))
