"""Calibrating the expert predictor: record route traces, replay them, pick the best signal mix.

N = tokens in a trace (every forward call's tokens, concatenated), A = active experts, E = experts of
a layer, S = signals, d = distance ahead in MoE layers.

A RouteTrace holds, per MoE layer, the experts each token chose, the layer's own router logits, and
the raw gate lookahead the predictor computed from that layer's residual for each layer up to
`depth` ahead (so a trace is a few bytes per token and layer instead of a whole residual; replay
learns the lookahead's drift from the layers' own logits, as the predictor does at run time). Replaying it through a predictor
gives, for every (token, layer, distance), the four signal distributions; the signals depend only
on past routes, not on the weights, so every weight mix of a grid is scored from one replay.
A mix is chosen on the fitting requests and reported on held-out ones.
"""
from __future__ import annotations

import itertools
import zipfile
from dataclasses import dataclass, field

import numpy as np

from edge.core.files import write_atomically
from edge.core.moe import MoeConfig
from streaming.predictor import SIGNALS, ExpertPredictor, PredictorError, SignalMix, SignalWeights, top_sets

TRACE_FORMAT_VERSION = 2
PHASES = ("decode", "prefill")
# The grid: only ratios between weights matter, so the gate is 1 or off and the others range around it.
GATE_LEVELS = (0.0, 1.0)
OTHER_LEVELS = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0)


@dataclass
class RouteTrace:
    """Routes of several requests; each request is prefill calls then one-token decode calls."""

    layers: list[int]                        # MoE layers in execution order
    num_experts: dict[int, int]
    top_k: dict[int, int]
    depth: int                               # gate lookahead recorded this many MoE layers ahead
    routes: dict[int, np.ndarray]            # layer -> [N, A] chosen ids
    gate: dict[tuple[int, int], np.ndarray]  # (layer, target) -> [N, E_target] target's raw router logits from
                                             # layer's residual; (layer, layer): the layer's own logits
    pass_tokens: np.ndarray                  # [P] tokens of each forward call
    pass_request: np.ndarray                 # [P] request each forward call belongs to
    source: str = ""                         # what text produced it

    @property
    def n_tokens(self) -> int:
        return int(self.pass_tokens.sum())

    @property
    def n_requests(self) -> int:
        return int(self.pass_request.max()) + 1 if len(self.pass_request) else 0

    def save(self, path: str) -> None:
        arrays = {"version": np.array(TRACE_FORMAT_VERSION), "layers": np.array(self.layers, np.int64),
                  "num_experts": np.array([self.num_experts[layer] for layer in self.layers], np.int64),
                  "top_k": np.array([self.top_k[layer] for layer in self.layers], np.int64),
                  "depth": np.array(self.depth), "pass_tokens": self.pass_tokens.astype(np.int64),
                  "pass_request": self.pass_request.astype(np.int64), "source": np.array(self.source)}
        arrays.update({f"routes_{layer}": ids.astype(np.int16) for layer, ids in self.routes.items()})
        arrays.update({f"gate_{layer}_{target}": logits.astype(np.float16) for (layer, target), logits in self.gate.items()})
        try:  # all or nothing: a trace cut short would be replayed by the next run; a file object, as numpy
            # would otherwise append .npz to the name
            write_atomically(path, lambda f: np.savez_compressed(f, **arrays), binary=True)
        except OSError as exc:
            raise PredictorError(f"cannot write the route trace to {path}: {exc.strerror or exc}") from None

    @classmethod
    def load(cls, path: str) -> "RouteTrace":
        try:
            data = np.load(path)
        except (OSError, ValueError, EOFError, zipfile.BadZipFile):
            data = None  # numpy's reasons (e.g. its allow_pickle advice) do not help with a file that is no trace
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise PredictorError(f"{path} is not a route trace (an npz archive written by zllm-edge calibrate); "
                                 "record one with zllm-edge calibrate --trace FILE") from None
        with data:
            version = int(data["version"]) if "version" in data else None
            if version != TRACE_FORMAT_VERSION:
                raise PredictorError(f"{path}: route trace version {version}, this zllm-edge reads version "
                                     f"{TRACE_FORMAT_VERSION}; record the trace again")
            layers = [int(x) for x in data["layers"]]
            gate = {}
            for key in data.files:
                if key.startswith("gate_"):
                    layer, target = (int(x) for x in key.split("_")[1:])
                    gate[(layer, target)] = data[key].astype(np.float32)
            return cls(layers=layers, num_experts=dict(zip(layers, (int(x) for x in data["num_experts"]))),
                       top_k=dict(zip(layers, (int(x) for x in data["top_k"]))), depth=int(data["depth"]),
                       routes={layer: data[f"routes_{layer}"].astype(np.int64) for layer in layers}, gate=gate,
                       pass_tokens=data["pass_tokens"], pass_request=data["pass_request"], source=str(data["source"]))


class TraceRecorder:
    """Collects a RouteTrace while a model runs: `route(layer, ids, residual)` for every MoE layer of
    every forward call (a call ends where the next one starts again at the first MoE layer), then
    `end_request()` after each request."""

    def __init__(self, configs: dict[int, MoeConfig], routers: dict, depth: int = 2, rms_norm_eps: float = 1e-6):
        # The predictor computes the gate lookahead exactly as it will at run time.
        self._lookahead = ExpertPredictor(configs, routers, depth=depth, rms_norm_eps=rms_norm_eps)
        self.configs = self._lookahead.configs
        self.depth = depth
        self._routes = {layer: [] for layer in self.configs}
        self._gate = {}
        self._pass_tokens, self._pass_request, self._request = [], [], 0
        self._this_pass: dict[int, int] = {}  # layer -> tokens routed in the current call

    def route(self, layer: int, expert_ids: np.ndarray, residual: np.ndarray) -> None:
        ids = np.asarray(expert_ids, np.int64)
        if self._this_pass and self._lookahead.position[layer] <= max(self._lookahead.position[l] for l in self._this_pass):
            self._end_pass()
        self._routes[layer].append(ids)
        self._this_pass[layer] = len(ids)
        lookahead = {layer: self._lookahead.raw_logits(layer, residual),
                     **self._lookahead.lookahead_logits(layer, residual)}
        for target, logits in lookahead.items():
            self._gate.setdefault((layer, target), []).append(logits)

    def _end_pass(self) -> None:
        counts = set(self._this_pass.values())
        if len(self._this_pass) != len(self.configs) or len(counts) != 1:
            raise PredictorError(f"a forward call routed MoE layers {sorted(self._this_pass)} with token counts "
                                 f"{sorted(counts)}; a trace needs every MoE layer of every call, all with one count")
        self._pass_tokens.append(counts.pop())
        self._pass_request.append(self._request)
        self._this_pass = {}

    def end_request(self) -> None:
        if self._this_pass:
            self._end_pass()
        self._request += 1

    def trace(self, source: str = "") -> RouteTrace:
        if self._this_pass:
            self.end_request()
        layers = list(self.configs)
        return RouteTrace(layers=layers, num_experts={l: c.num_experts for l, c in self.configs.items()},
                          top_k={l: c.top_k for l, c in self.configs.items()}, depth=self.depth,
                          routes={l: np.concatenate(self._routes[l]) for l in layers},
                          gate={key: np.concatenate(parts) for key, parts in self._gate.items()},
                          pass_tokens=np.array(self._pass_tokens, np.int64),
                          pass_request=np.array(self._pass_request, np.int64), source=source)


class RecordingExperts:
    """An ExpertSource that hands every route to a TraceRecorder, then asks the model's own source."""

    def __init__(self, inner, recorder: TraceRecorder):
        self.inner, self.recorder = inner, recorder

    def experts(self, layer: int, expert_ids: np.ndarray, residual: np.ndarray,
                router_logits: np.ndarray | None = None):
        self.recorder.route(layer, expert_ids, residual)
        return self.inner.experts(layer, expert_ids, residual, router_logits)

    def begin_request(self) -> None:
        self.inner.begin_request()

    def begin_token(self, embedding) -> None:
        self.inner.begin_token(embedding)

    def stats(self) -> dict:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()


def check_trace_fits(trace: RouteTrace, spec, trace_path: str, model_path: str) -> None:
    """Refuse a trace recorded on another model: its MoE layers, expert counts and top-k must be the model's
    (the calibrated weights are written into the model's checkpoint)."""
    model = {layer: spec.moe_for_layer(layer) for layer in range(spec.num_hidden_layers)}
    model = {layer: (config.num_experts, config.top_k) for layer, config in model.items() if config is not None}
    recorded = {layer: (trace.num_experts[layer], trace.top_k[layer]) for layer in trace.layers}
    if recorded != model:
        raise PredictorError(f"{trace_path} was recorded on another model: its MoE layers (layer: (experts, top_k)) "
                             f"are {_abridged(recorded)}, {model_path} has {_abridged(model)}; record a trace of this "
                             "model (--trace with a new file name)")


def _abridged(layers: dict) -> str:
    items = [f"{layer}: {value}" for layer, value in layers.items()]
    return "{" + ", ".join(items if len(items) <= 4 else [*items[:3], "...", items[-1]]) + "}"


def record_trace(model, prompts: list[list[int]], new_tokens: int, depth: int = 2, source: str = "") -> RouteTrace:
    """Run each prompt (prefill, then greedy decode of new_tokens - 1 tokens) and record its routes."""
    from streaming.predictor import predictor_inputs

    if model.experts is None:
        raise PredictorError(f"{model.path} is a dense {model.spec.model_type} model; only MoE models have routes "
                             "to record")
    layers, routers = predictor_inputs(model.spec, model.checkpoint.tensors)
    recorder = TraceRecorder(layers, routers, depth=depth, rms_norm_eps=model.spec.rms_norm_eps)
    transformer = model.transformer
    original = transformer.experts
    transformer.experts = RecordingExperts(original, recorder)
    try:
        for prompt in prompts:
            # the prompt, then new_tokens - 1 decoded tokens (the last one chosen is not run)
            with model.session(capacity=len(prompt) + new_tokens - 1) as session:
                token = int(np.argmax(session.prefill(prompt)))
                for _ in range(new_tokens - 1):
                    token = int(np.argmax(session.decode(token)))
            recorder.end_request()
    finally:
        transformer.experts = original
    return recorder.trace(source)


# ------------------------------------------------------------------------------------------ replay


@dataclass
class Evidence:
    """Every prediction a replay made at one distance, grouped so that sets can be scored in bulk."""

    signals: list[np.ndarray] = field(default_factory=list)   # [T, S, E] per (call, layer)
    actual: list[np.ndarray] = field(default_factory=list)    # [T, A]
    phase: list[str] = field(default_factory=list)
    request: list[int] = field(default_factory=list)
    _stacked: dict | None = None

    def stacked(self) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """(E, A) -> signals [N, S, E], actual [N, A], phase [N] (str), request [N]: one row per token-layer."""
        if self._stacked is None:
            groups: dict[tuple[int, int], list[int]] = {}
            for i, (stack, actual) in enumerate(zip(self.signals, self.actual)):
                groups.setdefault((stack.shape[-1], actual.shape[1]), []).append(i)
            self._stacked = {
                key: (np.concatenate([self.signals[i] for i in rows]), np.concatenate([self.actual[i] for i in rows]),
                      np.concatenate([np.full(len(self.actual[i]), self.phase[i]) for i in rows]),
                      np.concatenate([np.full(len(self.actual[i]), self.request[i]) for i in rows]))
                for key, rows in groups.items()}
        return self._stacked


def replay(trace: RouteTrace, depth: int | None = None) -> dict[int, Evidence]:
    """Run the trace through a predictor (learning online, as at run time) and collect its evidence."""
    depth = trace.depth if depth is None else depth
    if depth > trace.depth:
        raise PredictorError(f"the trace holds gate lookahead {trace.depth} layers ahead, asked to replay {depth}")
    # Replay needs only each layer's expert count and top_k, and never computes a gate lookahead (the
    # trace carries it): the intermediate size and the routers are placeholders.
    configs = {l: MoeConfig(num_experts=trace.num_experts[l], top_k=trace.top_k[l], intermediate_size=1)
               for l in trace.layers}
    routers = {l: (np.ones(1, np.float32), np.zeros((trace.num_experts[l], 1), np.float32), None) for l in trace.layers}
    predictor = ExpertPredictor(configs, routers, depth=depth)
    evidence = {d: Evidence() for d in range(1, depth + 1)}
    starts = np.concatenate([[0], np.cumsum(trace.pass_tokens)])
    request = None
    for call, n_tokens in enumerate(trace.pass_tokens):
        if trace.pass_request[call] != request:
            request = int(trace.pass_request[call])
            predictor.begin_request()
        rows = slice(int(starts[call]), int(starts[call + 1]))
        phase = "decode" if n_tokens == 1 else "prefill"
        for position, layer in enumerate(trace.layers):
            predictor.observe(layer, trace.routes[layer][rows], router_logits=trace.gate[(layer, layer)][rows])
            lookahead = {t: trace.gate[(layer, t)][rows] for t in predictor.targets(layer)}
            gate = predictor.corrected_gate(layer, lookahead)
            for target, stack in predictor.signals(layer, gate, int(n_tokens)).items():
                found = evidence[trace.layers.index(target) - position]
                found.signals.append(stack)
                found.actual.append(trace.routes[target][rows])
                found.phase.append(phase)
                found.request.append(request)
    return evidence


def score_mix(evidence: Evidence, mix: SignalMix, requests: set[int] | None = None, set_factor: int = 1) -> dict:
    """hits / predicted / actual per phase for one mix, with prediction sets of set_factor x top_k."""
    weights = mix.as_array()
    totals = {phase: np.zeros(4, np.int64) for phase in PHASES}  # hits, predicted, actual, token-layers
    for (_, top_k), (signals, actual, phase, request) in evidence.stacked().items():
        chosen = np.ones(len(actual), bool) if requests is None else np.isin(request, sorted(requests))
        predicted = top_sets(np.einsum("s,nse->ne", weights, signals[chosen]), top_k * set_factor)  # [N, k]
        hits = (predicted[:, :, None] == actual[chosen][:, None, :]).any(axis=1).sum(axis=1)  # [N]
        for name in PHASES:
            rows = phase[chosen] == name
            count = int(rows.sum())
            totals[name] += (int(hits[rows].sum()), count * predicted.shape[1], count * top_k, count)
    return {phase: {"precision": h / p if p else None, "recall": h / a if a else None, "token_layers": int(n)}
            for phase, (h, p, a, n) in totals.items()}


def mix_grid() -> list[SignalMix]:
    """Every distinct mix (up to scale) of the grid levels."""
    seen, mixes = set(), []
    for gate, *others in itertools.product(GATE_LEVELS, *(OTHER_LEVELS,) * (len(SIGNALS) - 1)):
        values = np.array([gate, *others])
        if values.sum() == 0:
            continue
        key = tuple(np.round(values / values.max(), 6))
        if key not in seen:
            seen.add(key)
            mixes.append(SignalMix(*values))
    return mixes


def named_mixes() -> dict[str, SignalMix]:
    """Reference rows of the table: each signal alone."""
    return {f"{name} only": SignalMix(**{name: 1.0}) for name in SIGNALS}


def calibrate(trace: RouteTrace, depth: int | None = None, mixes: list[SignalMix] | None = None) -> dict:
    """Score every mix per distance; pick the best on the fitting requests, report held-out figures.

    Requests alternate between fitting (even) and held-out (odd); with one request both are that one.
    The primary figure is the decode recall with sets of top_k (prefill recall when the trace has no
    decode); recall with sets of 2 x top_k is reported beside it."""
    evidence = replay(trace, depth)
    mixes = list(mixes or mix_grid())
    candidates = {**named_mixes(), "default": SignalWeights.default()}
    requests = set(range(trace.n_requests))
    fit = {r for r in requests if r % 2 == 0}
    held_out = (requests - fit) or fit
    phase = "decode" if any(p == "decode" for e in evidence.values() for p in e.phase) else "prefill"
    result = {"tokens": trace.n_tokens, "requests": trace.n_requests, "phase": phase, "source": trace.source,
              "fit_requests": sorted(fit), "held_out_requests": sorted(held_out), "distances": {}}
    chosen = {}
    for distance, found in evidence.items():
        if not found.actual:  # fewer MoE layers than this distance
            continue
        rows = []
        for mix in mixes:
            rows.append({"mix": mix, "fit": score_mix(found, mix, fit)[phase]["recall"] or 0.0})
        best = max(rows, key=lambda row: row["fit"])["mix"]
        best_no_gate = max((row for row in rows if row["mix"].gate == 0), key=lambda row: row["fit"])["mix"]
        chosen[distance] = best
        table = {"best": best, "best without gate": best_no_gate,
                 **{name: (m.mix(distance) if isinstance(m, SignalWeights) else m) for name, m in candidates.items()}}
        result["distances"][distance] = {
            name: {"mix": mix.label(), "weights": dict(zip(SIGNALS, mix.as_array().tolist())),
                   "fit_recall": score_mix(found, mix, fit)[phase]["recall"],
                   "held_out": score_mix(found, mix, held_out)[phase],
                   "held_out_2x": score_mix(found, mix, held_out, set_factor=2)[phase]}
            for name, mix in table.items()}
    if not chosen:
        raise PredictorError(f"the trace has {len(trace.layers)} MoE layer(s): there is no layer ahead to forecast")
    result["weights"] = SignalWeights(chosen).to_dict()
    return result


def format_calibration(result: dict) -> str:
    """The table `zllm-edge calibrate` prints: one block per distance, one row per mix."""
    lines = [f"route trace: {result['tokens']} tokens in {result['requests']} requests ({result['source']})",
             f"mixes chosen on requests {result['fit_requests']}, figures on held-out requests "
             f"{result['held_out_requests']}, {result['phase']} tokens; sets of top_k (precision = recall) and 2 x top_k"]
    header = f"{'distance':>8}  {'mix':28}  {'weights':34}  {'recall@k':>8}  {'recall@2k':>9}  {'precision@2k':>12}"
    lines += [header, "-" * len(header)]
    for distance, rows in result["distances"].items():
        for name, row in rows.items():
            held, wide = row["held_out"], row["held_out_2x"]
            lines.append(f"{distance:>8}  {name:28}  {row['mix']:34}  {_pct(held['recall']):>8}  "
                         f"{_pct(wide['recall']):>9}  {_pct(wide['precision']):>12}")
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
