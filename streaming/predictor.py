"""The expert predictor: which experts the next MoE layers will need, learned from real routes.

T = tokens in this forward call, D = hidden size, E = routed experts of a layer, A = active experts
per token (the layer's top_k), S = signals (4), d = distance ahead in MoE layers (1 = the next one).

For every MoE layer M ahead of the current layer L (up to `depth` MoE layers ahead) the predictor
forms four distributions over M's experts, each "which expert will this token choose at M":

    gate       M's router applied to rms_norm(residual at L) with M's norm gain: the residual stream
               changes little from one layer to the next, so M's router already sees most of its input;
               what the layers in between add drifts M's logits the same way token after token, so
               that drift (M's real logits minus the lookahead, per expert) is learned online as a
               moving average and added to the lookahead
    temporal   transitions expert(M, token t-1) -> expert(M, token t), counted online
    spatial    co-occurrence expert(L, t) -> expert(L', t) for consecutive MoE layers L -> L', chained
               through the layers between L and M for distance > 1
    frequency  how often each expert of M has been chosen in this request

and mixes them with weights (SignalWeights, one mix per distance) calibrated on recorded route
traces (streaming/calibration.py). Counts are Laplace-smoothed, so a cold predictor is uniform in
everything but the gate.

The predictor holds no expert weights and does no I/O: it reads the routers it is given and the
routes it observes, and answers with scores. Its state lies in plain arrays (kernels/cpu/forecast.py
lists them), so that a decode step's observe and gate forecast run compiled, on their own or inside
the slot table's call (streaming/slots.py); routes of several tokens take the numpy path below.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import numpy as np

from edge.core.errors import ZllmError
from edge.core.files import write_output
from edge.core.moe import MoeConfig, kept_groups_mask, router_scores, selection_scores
from edge.core.numerics import rms_norm, softmax
from kernels.cpu import forecast as forecast_kernels

SIGNALS = ("gate", "temporal", "spatial", "frequency")
PREDICTOR_FILE = "predictor.json"
PREDICTOR_FORMAT = "zllm-expert-predictor"
PREDICTOR_VERSION = 1
SMOOTHING = forecast_kernels.SMOOTHING
SHARE_FLOOR, SHARE_CEILING = 1e-300, float(np.nextafter(1.0, 0.0))  # keep those logits finite
DRIFT_RATE = 0.1  # weight of the newest token in the moving average of the lookahead's logit drift
_DRIFT_RATE_F32 = np.float32(DRIFT_RATE)
_NO_LOGITS = np.zeros(0, np.float32)  # the compiled observe's "no router logits"
_NO_IDS = np.zeros(0, np.int64)


class PredictorError(ZllmError):
    """The predictor was given routers, routes or weights that do not fit the model."""


@dataclass(frozen=True)
class SignalMix:
    """How much each signal counts; only ratios matter (every signal is a distribution summing to 1)."""

    gate: float = 0.0
    temporal: float = 0.0
    spatial: float = 0.0
    frequency: float = 0.0

    def __post_init__(self) -> None:
        values = self.as_array()
        if not np.all(np.isfinite(values)) or np.any(values < 0) or not values.sum() > 0:
            raise PredictorError(f"signal weights must be finite, non-negative and not all zero, got {asdict(self)}")

    def as_array(self) -> np.ndarray:
        return np.array([self.gate, self.temporal, self.spatial, self.frequency], dtype=np.float64)  # [S]

    def label(self) -> str:
        return " ".join(f"{name[0]}={value:g}" for name, value in zip(SIGNALS, self.as_array()))


# Used when a checkpoint has no predictor.json: what `zllm-edge calibrate` chose for the MoEfied
# SmolLM2 (16 experts, 13 active; 768 tokens of pydoc topics; held-out decode recall with sets of
# top_k: 92.6% one layer ahead, 91.0% two ahead, against 87.3% for the best mix without the gate and
# 81.2% by chance; 16:12 gave 91.1% / 89.0% / 83.8%). The drift-corrected gate alone won at both
# distances: mixing in the count-based signals only diluted it.
DEFAULT_MIXES = {
    1: SignalMix(gate=1.0),
    2: SignalMix(gate=1.0),
}
# The eviction's estimate for the next token (need_score of layers already run) uses the temporal and
# frequency signals in these proportions when the mix gives them no weight.
NEXT_TOKEN_MIX = SignalMix(temporal=1.0, frequency=1.0)


@dataclass(frozen=True)
class SignalWeights:
    """One SignalMix per distance; a distance beyond the last calibrated one uses the last mix."""

    mixes: dict[int, SignalMix]

    def __post_init__(self) -> None:
        if not self.mixes or min(self.mixes) < 1:
            raise PredictorError(f"signal weights need a mix for distance 1 and up, got distances {sorted(self.mixes)}")

    @classmethod
    def default(cls) -> "SignalWeights":
        return cls(dict(DEFAULT_MIXES))

    def mix(self, distance: int) -> SignalMix:
        known = [d for d in self.mixes if d <= distance]
        return self.mixes[max(known)] if known else self.mixes[min(self.mixes)]

    def to_dict(self) -> dict:
        return {str(d): asdict(m) for d, m in sorted(self.mixes.items())}

    @classmethod
    def from_dict(cls, entry: dict) -> "SignalWeights":
        return cls({int(d): SignalMix(**{k: float(v) for k, v in m.items() if k in SIGNALS}) for d, m in entry.items()})

    @classmethod
    def for_checkpoint(cls, path: str) -> "SignalWeights":
        """The calibrated weights in `path`/predictor.json when present, else the defaults."""
        calibrated = read_predictor_file(path)
        return cls.from_dict(calibrated["weights"]) if calibrated else cls.default()


def read_predictor_file(checkpoint_path: str) -> dict | None:
    """The checkpoint's predictor.json (what `zllm-edge calibrate` wrote), or None when there is none."""
    path = os.path.join(checkpoint_path, PREDICTOR_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            entry = json.load(f)
    except (OSError, ValueError) as exc:
        raise PredictorError(f"{path} cannot be read ({exc}); run `zllm-edge calibrate` again or delete it") from None
    if entry.get("format") != PREDICTOR_FORMAT or entry.get("version") != PREDICTOR_VERSION:
        raise PredictorError(f"{path}: format {entry.get('format')!r} version {entry.get('version')!r}, expected "
                             f"{PREDICTOR_FORMAT!r} version {PREDICTOR_VERSION}; run `zllm-edge calibrate` again")
    return entry


def write_predictor_file(checkpoint_path: str, weights: SignalWeights, calibration: dict) -> str:
    """Write predictor.json atomically (a reader sees the old file or the new one, never a part)."""
    path = os.path.join(checkpoint_path, PREDICTOR_FILE)
    entry = {"format": PREDICTOR_FORMAT, "version": PREDICTOR_VERSION, "weights": weights.to_dict(),
             "calibration": calibration}
    write_output(path, lambda f: json.dump(entry, f, indent=1),
                 advice="calibrate with --no-save and keep the weights with --json, or copy the checkpoint to a "
                        "writable folder")
    return path


def predictor_inputs(spec, tensors: dict) -> tuple[dict[int, MoeConfig], dict[int, tuple]]:
    """The MoE layers of a model and each one's (post-attention norm gain, router [E, D] f32, bias),
    read from its checkpoint tensors (mmap views; a quantized router is dequantized once)."""
    from quant import dequantize

    layers, routers = {}, {}
    for layer in range(spec.num_hidden_layers):
        config = spec.moe_for_layer(layer)
        if config is None:
            continue
        prefix = f"model.layers.{layer}."
        bias_name = prefix + ("mlp.gate.e_score_correction_bias" if config.score_correction_bias else "mlp.gate.bias")
        bias = tensors.get(bias_name)
        layers[layer] = config
        routers[layer] = (np.asarray(tensors[prefix + "post_attention_layernorm.weight"], np.float32),
                          np.asarray(dequantize(tensors[prefix + "mlp.gate.weight"]), np.float32),
                          None if bias is None else np.asarray(bias, np.float32))
    return layers, routers


def _ids_within(ids: np.ndarray, num_experts: int) -> bool:
    """Every id of a route in [0, num_experts) (a decode step's few ids compared as Python ints)."""
    if len(ids) == 1:
        row = ids[0].tolist()
        return min(row) >= 0 and max(row) < num_experts
    return ids.min(initial=0) >= 0 and ids.max(initial=0) < num_experts


def _row_normalized(counts: np.ndarray) -> np.ndarray:
    smoothed = counts + SMOOTHING
    return smoothed / smoothed.sum(axis=-1, keepdims=True)


def _one_hot_mean(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """[T, A] ids -> [T, E]: each token's chosen experts, weight 1/A each."""
    out = np.zeros((len(ids), num_experts), np.float64)
    np.add.at(out, (np.repeat(np.arange(len(ids)), ids.shape[1]), ids.reshape(-1)), 1.0 / ids.shape[1])
    return out


def top_sets(scores: np.ndarray, size: int) -> np.ndarray:
    """[..., E] scores -> [..., size] ids of the highest scores (ties: the lower id first)."""
    return np.argsort(-scores, axis=-1, kind="stable")[..., :size]


def set_hits(predicted: np.ndarray, actual: np.ndarray) -> int:
    """How many of each token's actual experts [T, A] are in its predicted set [T, k], summed over tokens."""
    return int((predicted[:, :, None] == actual[:, None, :]).any(axis=1).sum())


class _Accuracy:
    """hits / predicted / actual per (phase, distance); phase is "decode" (one token) or "prefill".
    The decode counts are an array [depth + 1, 3] the compiled decode step adds to; Python adds the
    prefill's."""

    def __init__(self, decode: np.ndarray):
        self.decode = decode
        self.prefill: dict[int, list[int]] = {}  # distance -> [hits, predicted, actual]

    def add_prefill(self, distance: int, hits: int, predicted: int, actual: int) -> None:
        total = self.prefill.setdefault(distance, [0, 0, 0])
        total[0] += hits
        total[1] += predicted
        total[2] += actual

    def _totals(self, phase: str) -> dict[int, tuple[int, int, int]]:
        if phase == "decode":
            return {d: tuple(int(v) for v in row) for d, row in enumerate(self.decode) if row[1] or row[2]}
        return {d: tuple(row) for d, row in sorted(self.prefill.items())}

    def figures(self, phase: str, distance: int) -> tuple[float | None, float | None]:
        hits, predicted, actual = self._totals(phase).get(distance, (0, 0, 0))
        return (hits / predicted if predicted else None, hits / actual if actual else None)

    def by_distance(self, phase: str) -> dict[int, dict]:
        return {distance: {"precision": hits / predicted if predicted else None,
                           "recall": hits / actual if actual else None,
                           "hits": hits, "predicted": predicted, "actual": actual}
                for distance, (hits, predicted, actual) in self._totals(phase).items()}


class ExpertPredictor:
    """Forecasts the experts of the next `depth` MoE layers from the residual stream and past routes.

    layers: MoE layer -> its MoeConfig. routers: layer -> (post-attention norm gain [D], router weight
    [E, D], bias [E] or None); the bias is DeepSeek-V3's e_score_correction_bias (added to sigmoid
    scores for selection only) when the layer's config says `score_correction_bias`, else the router's
    linear bias. Call `observe` with each layer's real route, then `forecast` for the layers ahead.
    """

    def __init__(self, layers: dict[int, MoeConfig], routers: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray | None]],
                 depth: int = 2, weights: SignalWeights | None = None, rms_norm_eps: float = 1e-6):
        if depth < 1:
            raise PredictorError(f"the predictor looks at least 1 layer ahead, got depth {depth}")
        missing = sorted(set(layers) - set(routers))
        if missing:
            raise PredictorError(f"no router given for MoE layers {missing}; the gate lookahead needs every router")
        self.configs = dict(sorted(layers.items()))
        self.order = list(self.configs)  # MoE layers in execution order
        self.position = {layer: i for i, layer in enumerate(self.order)}
        self.depth = depth
        self.weights = weights or SignalWeights.default()
        self._mix_arrays: dict[int, np.ndarray] = {}  # distance -> the mix as an array [S]
        self._plans: dict[tuple, tuple] = {}  # (layer, targets) -> _forecast_plan
        self.eps = rms_norm_eps
        self._eps_f32 = np.float32(rms_norm_eps)
        self.routers = {}
        for layer, config in self.configs.items():
            gain, router, bias = routers[layer]
            router = np.ascontiguousarray(router, dtype=np.float32)
            if router.shape[0] != config.num_experts:
                raise PredictorError(f"layer {layer}: router has {router.shape[0]} rows, the layer has "
                                     f"{config.num_experts} experts")
            self.routers[layer] = (np.array(gain, np.float32), router.copy(),
                                   None if bias is None else np.array(bias, np.float32))
        # The lookahead from one layer applies every target's router to the same normalised residual:
        # with each norm gain folded into its router (x̂ ⊙ g) Rᵀ = x̂ (R ⊙ g)ᵀ, the targets' routers
        # stack into one matrix and the lookahead is one product per layer. Every layer's stack is a
        # block of rows of one array, as are the drift and raw lookahead of each (layer, target) pair.
        n_layers, n_experts = len(self.order), max(c.num_experts for c in self.configs.values())
        n_active = max(c.top_k for c in self.configs.values())
        self.hidden_size = len(next(iter(self.routers.values()))[0])
        reach = max(1, min(depth, n_layers - 1))  # the most MoE layers a forecast looks ahead within a pass
        spans, row = np.zeros((n_layers, reach, 2), np.int64), 0
        for p, layer in enumerate(self.order):
            for j, target in enumerate(self.targets(layer)):
                spans[p, j] = row, row + self.configs[target].num_experts
                row = int(spans[p, j, 1])
        routers_stacked, bias_stacked = np.zeros((row, self.hidden_size), np.float32), np.zeros(row, np.float32)
        self._stacked_routers = {}
        for p, layer in enumerate(self.order):
            targets = self.targets(layer)
            for j, target in enumerate(targets):
                (begin, end), (gain, router, bias) = spans[p, j], self.routers[target]
                routers_stacked[begin:end] = router * gain[None, :]
                if bias is not None and not self.configs[target].score_correction_bias:
                    bias_stacked[begin:end] = bias
            if targets:
                self._stacked_routers[layer] = routers_stacked[spans[p, 0, 0]:spans[p, len(targets) - 1, 1]]
        gain, router, bias = self.routers[self.order[0]]  # (token_forecast's, folded the same way)
        self._first_router = (np.ascontiguousarray(router * gain[None, :], np.float32),
                              np.zeros(len(router), np.float32) if bias is None else bias)
        self._decodable = [self._decodes(layer) for layer in self.order]
        mix = np.zeros((n_layers, reach), np.float64)
        for p, layer in enumerate(self.order):
            for j, _ in enumerate(self.targets(layer)):
                mix[p, j] = self.weights.mix(j + 1).gate
        next_mix = np.zeros((n_layers + 1, 2), np.float64)
        for distance in range(1, n_layers + 1):
            weights = self.weights.mix(distance).as_array()
            if weights[1] + weights[3] == 0:
                weights = NEXT_TOKEN_MIX.as_array()
            next_mix[distance] = weights[1], weights[3]
        sizes = np.array([self.configs[layer].num_experts for layer in self.order], np.int64)
        # The predictor's state, one set of arrays that the compiled decode step (kernels/cpu/forecast.py)
        # and the general path share. Counts are learned online and kept across requests (what the
        # model does with its experts does not change); the rest restarts with each request.
        self._tables = (
            routers_stacked, bias_stacked, np.zeros(row, np.float32), np.zeros(row, np.float32), spans,
            np.array([len(self.targets(layer)) for layer in self.order], np.int64), mix, sizes,
            np.array([self.configs[layer].top_k for layer in self.order], np.int64),
            np.zeros((n_layers, n_experts, n_experts)), np.zeros((n_layers, n_experts, n_experts)),
            np.zeros((n_layers, n_experts)), np.zeros((n_layers, n_active), np.int64), np.zeros(n_layers, np.int64),
            np.zeros((n_layers, n_active), np.int64), np.zeros(n_layers, np.int64),
            np.zeros((n_layers, reach + 1), np.int64), np.zeros((n_layers, reach + 1, n_active), np.int64),
            np.zeros((n_layers, reach + 1), np.int64), np.zeros((n_layers, n_experts)), np.zeros(n_layers, np.int64),
            next_mix, np.zeros((reach + 1, 3), np.int64), np.zeros(forecast_kernels.STATUS_FIELDS, np.int64))
        (_, _, self._drift, self._raw, self._spans, _, _, _, _, temporal, spatial, frequency, self._previous_ids,
         self._previous_len, self._route_ids, self._route_len, self._looked, self._pending_sets,
         self._pending_valid, self._need, self._need_valid, _, decode_accuracy, self._status) = self._tables
        self.temporal = {layer: temporal[p, :c.num_experts, :c.num_experts] for p, (layer, c)
                         in enumerate(self.configs.items())}
        self.spatial = {layer: spatial[p, :self.configs[prev].num_experts, :self.configs[layer].num_experts]
                        for p, (prev, layer) in enumerate(zip(self.order, self.order[1:]), start=1)}
        self.frequency = {layer: frequency[p, :c.num_experts] for p, (layer, c) in enumerate(self.configs.items())}
        self.accuracy = _Accuracy(decode_accuracy)
        self.begin_request()

    @property
    def predictions_made(self) -> int:
        return int(self._status[forecast_kernels.P_PREDICTIONS])

    # --- request state ---------------------------------------------------------------------------------
    def begin_request(self, forget_transitions: bool = False) -> None:
        """Start a new request: frequencies and the previous token's routes restart; transitions are kept
        unless `forget_transitions`."""
        if forget_transitions:
            for counts in (*self.temporal.values(), *self.spatial.values()):
                counts[:] = 0
        for counts in self.frequency.values():
            counts[:] = 0
        for flags in (self._previous_len, self._route_len, self._looked, self._pending_valid, self._need_valid):
            flags[:] = 0
        self._status[forecast_kernels.P_CURRENT] = -1
        self._pass_routes: dict[int, np.ndarray] = {}  # a forward call of several tokens: its routes [T, A]
        # ... and what its forecasts wait for: target -> distance -> predicted sets [T, k], and
        # target -> source layer -> raw logits [T, E] (a one-token call keeps these in the arrays)
        self._pending: dict[int, dict[int, np.ndarray]] = {}
        self._looked_ahead: dict[int, dict[int, np.ndarray]] = {}

    @property
    def _current_layer(self) -> int | None:
        """The MoE layer observed last (None: none yet in this request)."""
        current = int(self._status[forecast_kernels.P_CURRENT])
        return self.order[current] if current >= 0 else None

    def previous_token_route(self, layer: int) -> np.ndarray | None:
        """[A] the ids `layer` chose for the last token seen, or None."""
        p = self.position[layer]
        n = int(self._previous_len[p])
        return self._previous_ids[p, :n] if n else None

    def _pass_route(self, layer: int) -> np.ndarray | None:
        """[T, A] `layer`'s route in this forward call, or None where it has not run in it."""
        if self._status[forecast_kernels.P_DECODE_PASS]:
            p = self.position[layer]
            n = int(self._route_len[p])
            return self._route_ids[p, None, :n] if n else None
        return self._pass_routes.get(layer)

    # --- learning --------------------------------------------------------------------------------------
    def observe(self, layer: int, expert_ids: np.ndarray, residual: np.ndarray | None = None,
                router_logits: np.ndarray | None = None) -> None:
        """Learn from `layer`'s real route [T, A] and score the forecasts made for it. With the residual
        [T, D] entering the layer's FFN (or the layer's raw router logits [T, E] computed from it), also
        learn how far the lookahead of earlier layers drifted from this layer's real logits."""
        if len(expert_ids) == 1:  # a decode step: in one compiled call
            forecast_kernels.decode_observe(*self._tables, *self._one_token(layer, expert_ids, residual, router_logits),
                                            _DRIFT_RATE_F32)
            return
        ids = self._checked_route(layer, expert_ids)
        if router_logits is None and residual is not None:
            router_logits = self.raw_logits(layer, residual)
        position = self.position[layer]
        current = int(self._status[forecast_kernels.P_CURRENT])
        if current < 0 or position <= current:  # a new forward call starts at its first MoE layer
            self._pass_routes = {}
            self._route_len[:] = 0
            self._status[forecast_kernels.P_DECODE_PASS] = 0
        self._score_forecasts(layer, ids)
        self._learn_drift(layer, router_logits)
        self._count_route(layer, position, ids)
        self._previous_ids[position, :ids.shape[1]] = ids[-1]
        self._previous_len[position] = ids.shape[1]
        self._pass_routes[layer] = ids
        self._status[forecast_kernels.P_CURRENT] = position
        self._need_valid[: position + 1] = 0  # every layer not ahead is estimated again when asked

    def observe_and_forecast(self, layer: int, expert_ids: np.ndarray, residual: np.ndarray,
                             router_logits: np.ndarray | None = None) -> dict[int, np.ndarray]:
        """observe(...) then forecast(layer, residual): for one token with a compiled forecast, one call."""
        arguments = self.decode_arguments(layer, expert_ids, residual, router_logits)
        if arguments is None:
            self.observe(layer, expert_ids, residual, router_logits=router_logits)
            return self.forecast(layer, residual)
        forecast_kernels.decode_step(*arguments)
        return self._needs_ahead(self.position[layer])

    def decode_arguments(self, layer: int, expert_ids: np.ndarray, residual: np.ndarray,
                         router_logits: np.ndarray | None = None) -> tuple | None:
        """The arguments of the compiled decode step (kernels/cpu/forecast.py DECODE_ARGUMENT_TYPES) for
        `layer`'s route of one token, or None where that step does not apply (several tokens, or a
        forecast the general path makes). Whoever runs the step has observed and forecast `layer`."""
        self._config(layer)
        if len(expert_ids) != 1 or not self._decodable[self.position[layer]]:
            return None
        return (*self._tables, *self._one_token(layer, expert_ids, residual, router_logits), _DRIFT_RATE_F32,
                self._residual_row(residual), self._eps_f32)

    def _one_token(self, layer: int, expert_ids: np.ndarray, residual: np.ndarray | None,
                   router_logits: np.ndarray | None) -> tuple[int, np.ndarray, np.ndarray]:
        """A one-token route's (position, ids [A], router logits [E] or empty) as the compiled observe takes
        them, checked; what a forward call of several tokens left pending for `layer` is dropped."""
        ids = self._checked_route(layer, expert_ids)
        if router_logits is None and residual is not None:
            router_logits = self.raw_logits(layer, residual)
        self._pending.pop(layer, None), self._looked_ahead.pop(layer, None)  # (made for another call)
        return self.position[layer], ids[0], self._logits_row(layer, router_logits)

    def _checked_route(self, layer: int, expert_ids: np.ndarray) -> np.ndarray:
        config = self._config(layer)
        ids = np.ascontiguousarray(expert_ids, dtype=np.int64)  # (its rows go to compiled calls)
        if ids.ndim != 2 or ids.shape[1] == 0 or ids.shape[1] > self._previous_ids.shape[1] or \
                not _ids_within(ids, config.num_experts):
            raise PredictorError(f"layer {layer}: route must be [tokens, active] ids in [0, {config.num_experts}), "
                                 f"got shape {ids.shape}")
        return ids

    def _logits_row(self, layer: int, router_logits: np.ndarray | None) -> np.ndarray:
        """One token's router logits of `layer` as the compiled calls take them ([E] f32; none: empty)."""
        if router_logits is None:
            return _NO_LOGITS
        row = np.ascontiguousarray(router_logits, np.float32).reshape(-1)
        if len(row) != self.configs[layer].num_experts:  # (the compiled calls do not check their bounds)
            raise PredictorError(f"layer {layer}: router logits must be [1, {self.configs[layer].num_experts}], got "
                                 f"shape {np.shape(router_logits)}")
        return row

    def _residual_row(self, residual: np.ndarray) -> np.ndarray:
        """One token's residual stream [D] f32, as the compiled calls take it."""
        row = np.ascontiguousarray(residual, np.float32).reshape(-1)
        if len(row) != self.hidden_size:
            raise PredictorError(f"the residual stream must be [1, {self.hidden_size}], got shape {np.shape(residual)}")
        return row

    def _count_route(self, layer: int, position: int, ids: np.ndarray) -> None:
        """The counts a route [T, A] of several tokens teaches (the compiled observe's for one token)."""
        # temporal: token t-1 -> token t at this layer; the first token's predecessor is the last token seen
        previous = self.previous_token_route(layer)
        if previous is None:
            before, after = ids[:-1], ids[1:]
        else:
            before, after = np.concatenate([previous[None], ids[:-1]]), ids
        self._count_pairs(self.temporal[layer], before, after)
        # spatial: this token's experts at the previous MoE layer -> at this one
        if position > 0:
            prev_ids = self._pass_routes.get(self.order[position - 1])
            if prev_ids is not None and len(prev_ids) == len(ids):
                self._count_pairs(self.spatial[layer], prev_ids, ids)
        np.add.at(self.frequency[layer], ids.reshape(-1), 1.0)

    @staticmethod
    def _count_pairs(counts: np.ndarray, before: np.ndarray, after: np.ndarray) -> None:
        """counts[i, j] += 1 for every expert i of a token in `before` and j of the same row in `after`."""
        if len(before) == 0:
            return
        rows = np.broadcast_to(before[:, :, None], (len(before), before.shape[1], after.shape[1]))
        cols = np.broadcast_to(after[:, None, :], rows.shape)
        np.add.at(counts, (rows.reshape(-1), cols.reshape(-1)), 1.0)

    def _learn_drift(self, layer: int, router_logits: np.ndarray | None) -> None:
        """A forward call of several tokens: the moving average over its tokens, in order."""
        looked_ahead = self._looked_ahead.pop(layer, {})
        self._looked[self.position[layer]] = 0  # (one-token lookaheads were made for another call)
        if router_logits is None:
            return
        actual = np.ascontiguousarray(router_logits, np.float32).reshape(-1, self.configs[layer].num_experts)
        for source, lookahead in looked_ahead.items():
            if len(lookahead) != len(actual):
                continue  # made for another forward call
            drift = self.drift(source, layer)  # a view: updated in place
            drift *= (1.0 - DRIFT_RATE) ** len(actual)
            # in closed form: the newest token weighs DRIFT_RATE
            decay = (1.0 - DRIFT_RATE) ** np.arange(len(actual) - 1, -1, -1, dtype=np.float32)  # [T]
            drift += DRIFT_RATE * decay @ (actual - lookahead)

    def _score_forecasts(self, layer: int, ids: np.ndarray) -> None:
        """A forward call of several tokens: score the sets forecast for each of its tokens."""
        pending = self._pending.pop(layer, None)
        self._pending_valid[self.position[layer]] = 0  # (one-token forecasts were made for another call)
        for distance, predicted in (pending or {}).items():
            if len(predicted) == len(ids):  # (else made for another forward call)
                self.accuracy.add_prefill(distance, set_hits(predicted, ids), predicted.size, ids.size)

    # --- forecasting -----------------------------------------------------------------------------------
    def targets(self, layer: int) -> list[int]:
        """The MoE layers `forecast(layer, ...)` looks at, nearest first."""
        position = self.position[layer]
        return self.order[position + 1: position + 1 + self.depth]

    def raw_logits(self, target: int, residual: np.ndarray) -> np.ndarray:
        """`target`'s router applied to rms_norm(residual) with its norm gain (and its linear bias): [T, E]."""
        residual = np.asarray(residual, np.float32).reshape(-1, np.shape(residual)[-1])
        gain, router, _ = self.routers[target]
        return self._with_bias(target, rms_norm(residual, gain, self.eps) @ router.T)  # [T, E]

    def _with_bias(self, target: int, logits: np.ndarray) -> np.ndarray:
        bias = self.routers[target][2]
        if bias is not None and not self.configs[target].score_correction_bias:
            logits = logits + bias
        return logits.astype(np.float32, copy=False)

    def lookahead_logits(self, layer: int, residual: np.ndarray) -> dict[int, np.ndarray]:
        """For each target M ahead of `layer`: M's raw router logits [T, E_M] from `residual` [T, D]
        entering layer's FFN (before the learned drift; what a route trace records)."""
        targets = self.targets(layer)
        if not targets:
            return {}
        x = np.asarray(residual, np.float32).reshape(-1, np.shape(residual)[-1])
        normalised = x / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + self.eps)
        stacked = normalised @ self._stacked_routers[layer].T  # [T, sum of the targets' E]
        out, start = {}, 0
        for target in targets:
            end = start + self.configs[target].num_experts
            out[target] = self._with_bias(target, np.ascontiguousarray(stacked[:, start:end]))
            start = end
        return out

    def selection_logits(self, target: int, logits: np.ndarray) -> np.ndarray:
        """Raw logits [T, E] -> logits that rank experts the way `target`'s router selects them
        (edge/core/moe.py `route`: its selection scores, its group mask).

        Softmax and unit scoring select by the logits; sigmoid scoring with a correction bias selects by
        sigmoid(l) + bias, returned here as logits of it rescaled into (0, 1), so every family ranks the same way.
        Group-limited routing (n_group > 1) pushes the experts of the groups that would not compete
        below every other."""
        config = self.configs[target]
        bias = self.routers[target][2] if config.score_correction_bias else None
        choice = selection_scores(router_scores(logits, config), bias)  # [T, E]
        if config.scoring == "sigmoid" and bias is not None:
            # sigmoid(l) + bias lies in (min bias, 1 + max bias): rescaled into (0, 1) and taken back to
            # logits, strictly increasing, so the ranking is the router's to the last tie
            low, high = float(np.min(bias)), 1.0 + float(np.max(bias))
            share = np.clip((choice.astype(np.float64) - low) / (high - low), SHARE_FLOOR, SHARE_CEILING)
            logits = np.log(share) - np.log1p(-share)
        if config.n_group > 1:
            logits = np.where(kept_groups_mask(choice, config), logits, logits.min() - 30.0)
        return logits.astype(np.float32, copy=False)

    def signals(self, layer: int, gate_logits: dict[int, np.ndarray], n_tokens: int,
                used: tuple[bool, ...] = (True,) * len(SIGNALS)) -> dict[int, np.ndarray]:
        """For each target: the four signal distributions [T, S, E] (the predictor's raw evidence), from
        the selection logits `gate_logits` of the targets (a missing target gets a uniform gate).
        A signal that `used` marks False is left at zero (a mix that gives it no weight skips its cost)."""
        use_gate, use_temporal, use_spatial, use_frequency = used
        out = {}
        here = self._pass_route(layer) if self._current_layer == layer and use_spatial else None
        chained = None if here is None else _one_hot_mean(here, self.configs[layer].num_experts)  # [T, E_L]
        for target in self.targets(layer):
            num_experts = self.configs[target].num_experts
            uniform = np.full((n_tokens, num_experts), 1.0 / num_experts)
            stack = np.zeros((n_tokens, len(SIGNALS), num_experts))
            if use_gate:
                stack[:, 0] = softmax(gate_logits[target].astype(np.float64)) if target in gate_logits else uniform
            previous = self.previous_token_route(target)
            if use_temporal:
                stack[:, 1] = uniform if previous is None else _row_normalized(self.temporal[target])[previous].mean(0)
            if use_spatial:
                if chained is not None:
                    chained = chained @ _row_normalized(self.spatial[target])  # rows stay distributions
                    stack[:, 2] = chained
                else:
                    stack[:, 2] = uniform
            if use_frequency:
                counts = self.frequency[target] + SMOOTHING
                stack[:, 3] = counts / counts.sum()
            out[target] = stack
        return out

    def combine(self, layer: int, signals: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """Each target's per-token scores [T, E]: the signals mixed with the weights of its distance."""
        position = self.position[layer]
        return {target: np.einsum("s,tse->te", self.weights.mix(self.position[target] - position).as_array(), stack)
                for target, stack in signals.items()}

    def forecast(self, layer: int, residual: np.ndarray) -> dict[int, np.ndarray]:
        """Need scores [E] for each of the next `depth` MoE layers after `layer` (higher = sooner/likelier):
        views of the predictor's need table, current until the next observe or forecast.

        `residual` [T, D] is the residual stream entering `layer`'s FFN block; call after `observe(layer)`
        so the spatial signal starts from this token's route at `layer`."""
        self._config(layer)
        residual = np.asarray(residual, np.float32)
        n_tokens = 1 if residual.ndim == 1 else residual.shape[0]
        position = self.position[layer]
        if n_tokens == 1 and self._decodable[position]:
            forecast_kernels.decode_forecast(*self._tables, position, self._residual_row(residual), self._eps_f32)
            return self._needs_ahead(position)
        return self.forecast_from_lookahead(layer, self.lookahead_logits(layer, residual), n_tokens)

    def _needs_ahead(self, position: int) -> dict[int, np.ndarray]:
        """The need rows [E] of the targets of the layer at `position` (views of the predictor's array)."""
        return {target: self._need[self.position[target], :self.configs[target].num_experts]
                for target in self.targets(self.order[position])}

    def forecast_path(self) -> str:
        """"compiled" when every one-token forecast runs in one compiled call (kernels/cpu/forecast.py),
        else "numpy: <why>" (the general forecast, a few dozen numpy operations per MoE layer)."""
        reasons = []
        for p, layer in enumerate(self.order):
            targets = self.targets(layer)
            if not targets or self._decodable[p]:
                continue
            _, used = self._forecast_plan(layer, tuple(targets))
            others = [name for name, on in zip(SIGNALS[1:], used[1:]) if on]
            if others:
                reasons.append(f"the signal mix uses the {'/'.join(others)} signal")
            if not all(self._selects_by_logits(target) for target in targets):
                reasons.append("a router with sigmoid scores, a correction bias or expert groups")
        return "compiled" if not reasons else "numpy: " + "; ".join(dict.fromkeys(reasons))

    def _selects_by_logits(self, target: int) -> bool:
        """Whether `target`'s router ranks its experts by their raw logits (softmax or unit scoring, no
        correction bias, no expert groups)."""
        config = self.configs[target]
        return config.scoring != "sigmoid" and config.n_group == 1 and not config.score_correction_bias

    def _decodes(self, layer: int) -> bool:
        """Whether a one-token forecast from `layer` runs compiled: the gate alone in its targets' mixes
        and every target selecting by its raw logits (a layer with no targets has nothing to forecast)."""
        targets = self.targets(layer)
        if not targets:
            return True
        _, used = self._forecast_plan(layer, tuple(targets))
        return used == (True, False, False, False) and all(self._selects_by_logits(target) for target in targets)

    def token_forecast(self, embedding: np.ndarray) -> dict[int, np.ndarray]:
        """Need scores [E] of a decode step's first MoE layer from the token's embedding [D], before
        layer 0 runs: that layer's router applied to it (the gate signal, with nothing added to the
        residual stream yet), as `forecast` scores the next layer. (The layers after it see the
        embedding through another layer's output: the next-token estimate serves them better.)"""
        first = self.order[0]
        config = self.configs[first]
        if self._selects_by_logits(first):  # in one compiled call
            router, bias = self._first_router
            need = self._need[0, :config.num_experts]
            forecast_kernels.embedding_need(self._residual_row(embedding), router, bias, self._eps_f32, config.top_k,
                                            need)
            self._need_valid[0] = 1
            return {first: need.copy()}
        x = np.asarray(embedding, np.float32).reshape(1, -1)
        scores = softmax(self.selection_logits(first, self.raw_logits(first, x)).astype(np.float64))[0]
        return {first: self._set_need(0, np.minimum(1.0, config.top_k * scores)).copy()}

    def _set_need(self, position: int, need: np.ndarray) -> np.ndarray:
        row = self._need[position, :len(need)]
        row[:] = need
        self._need_valid[position] = 1
        return row

    def _pair_rows(self, layer: int, target: int) -> tuple[int, int]:
        """The rows of the stacked arrays that (layer, target ahead of it) owns."""
        p = self.position[layer]
        begin, end = self._spans[p, self.position[target] - p - 1]
        return int(begin), int(end)

    def drift(self, layer: int, target: int) -> np.ndarray:
        """[E] the learned drift of `target`'s logits looked ahead from `layer` (a view)."""
        begin, end = self._pair_rows(layer, target)
        return self._drift[begin:end]

    def corrected_gate(self, layer: int, lookahead: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """Selection logits of each target from its raw lookahead plus the drift learned for (layer, target);
        remembers the raw lookahead, so the target's real logits can update the drift."""
        out = {}
        for target, logits in lookahead.items():
            if len(logits) == 1:  # one token: where the compiled observe looks for it
                begin, end = self._pair_rows(layer, target)
                self._raw[begin:end] = logits[0]
                self._looked[self.position[target], self.position[target] - self.position[layer]] = 1
            else:
                self._looked_ahead.setdefault(target, {})[layer] = logits
            out[target] = self.selection_logits(target, logits + self.drift(layer, target))
        return out

    def forecast_from_lookahead(self, layer: int, lookahead: dict[int, np.ndarray], n_tokens: int) -> dict[int, np.ndarray]:
        """`forecast` from raw lookahead logits already computed (replaying a recorded trace)."""
        position = self.position[layer]
        mixes, used = self._forecast_plan(layer, tuple(lookahead))
        gate = self.corrected_gate(layer, lookahead)
        if used == (True, False, False, False):  # the gate alone (the default mix): what combine gives, directly
            scores = {target: mix[0] * softmax(gate[target].astype(np.float64)) for target, mix in zip(lookahead, mixes)}
        else:
            scores = self.combine(layer, self.signals(layer, gate, n_tokens, used))
        need = {}
        for target, per_token in scores.items():
            distance = self.position[target] - position
            top_k = self.configs[target].top_k
            sets = top_sets(per_token, top_k)
            if n_tokens == 1:  # where the compiled observe scores it
                q = self.position[target]
                self._pending_sets[q, distance, :top_k] = sets[0]
                self._pending_valid[q, distance] = 1
            else:
                self._pending.setdefault(target, {})[distance] = sets
            self._status[forecast_kernels.P_PREDICTIONS] += n_tokens
            # probability-like membership of each expert for the likeliest token, discounted by distance
            need[target] = self._set_need(self.position[target], np.minimum(
                1.0, top_k * per_token / per_token.sum(-1, keepdims=True)).max(0) / distance)
        return need

    def pending_sets(self, target: int) -> dict[int, np.ndarray]:
        """The sets [T, k] forecast for `target` and not yet scored, by distance."""
        q = self.position[target]
        out = {d: self._pending_sets[q, d, None, :self.configs[target].top_k]
               for d in range(1, self._pending_valid.shape[1]) if self._pending_valid[q, d]}
        out.update(self._pending.get(target, {}))
        return out

    def _forecast_plan(self, layer: int, targets: tuple[int, ...]) -> tuple[list[np.ndarray], tuple[bool, ...]]:
        """The mixes of `targets` seen from `layer`, and which signals any of them uses (asked per layer
        and token, the same every time)."""
        key = (layer, targets)
        plan = self._plans.get(key)
        if plan is None:
            position = self.position[layer]
            mixes = [self._mix_array(self.position[target] - position) for target in targets]
            plan = self._plans[key] = (mixes, tuple(bool(any(mix[s] for mix in mixes)) for s in range(len(SIGNALS))))
        return plan

    def _mix_array(self, distance: int) -> np.ndarray:
        mix = self._mix_arrays.get(distance)
        if mix is None:
            mix = self._mix_arrays[distance] = self.weights.mix(distance).as_array()
        return mix

    def need_score(self, layer: int, expert: int) -> float:
        """How soon/likely `expert` of `layer` is needed: the latest forecast for layers ahead; for the
        layer running now, 1 for the experts in use; for layers already run in this forward call, the
        next token's temporal and frequency estimate, discounted by how many MoE layers away it is."""
        config = self._config(layer)
        if not 0 <= expert < config.num_experts:
            raise PredictorError(f"layer {layer} has experts 0..{config.num_experts - 1}, asked for {expert}")
        return float(self.need_vector(layer)[expert])

    def need_vector(self, layer: int) -> np.ndarray:
        """need_score of every expert of `layer` [E] (eviction reads these; each is computed once per step)."""
        p = self.position.get(layer)
        if p is None:
            self._config(layer)
        if not self._need_valid[p]:
            in_use = self._pass_route(layer) if layer == self._current_layer else None
            forecast_kernels.estimate_need(*self._tables, p, _NO_IDS if in_use is None else in_use.reshape(-1))
        return self._need[p, :self.configs[layer].num_experts]

    # --- reporting -------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """predictor_precision / predictor_recall: decode tokens, one MoE layer ahead, prediction sets of
        the layer's top_k (so the two are equal unless a route repeats an id); None before any decode."""
        precision, recall = self.accuracy.figures("decode", 1)
        prefill_precision, prefill_recall = self.accuracy.figures("prefill", 1)
        return {"predictor_precision": precision, "predictor_recall": recall,
                "predictor_precision_prefill": prefill_precision, "predictor_recall_prefill": prefill_recall,
                "predictor_by_distance": self.accuracy.by_distance("decode"),
                "predictor_by_distance_prefill": self.accuracy.by_distance("prefill"),
                "predictor_predictions": self.predictions_made, "predictor_depth": self.depth}

    def _config(self, layer: int) -> MoeConfig:
        config = self.configs.get(layer)
        if config is None:
            raise PredictorError(f"layer {layer} is not a MoE layer of this model; MoE layers: {self.order}")
        return config
