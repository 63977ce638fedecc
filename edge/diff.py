"""`zllm-edge diff`: run one prompt on two devices, compare them layer by layer, and name the first
layer where they diverge.

The prompt goes through `session.prefill(ids, all_logits=True, observer=...)` on both devices; the
observer records the residual stream after every layer. Then a few decode steps follow, each
feeding both devices the reference device's greedy token (the first device named is the
reference), so that a divergence in the KV cache path shows too. Each step is a one-token
`prefill` with an observer: the same `_run` path as `session.decode`, which takes no observer.

Metrics, per layer and for the logits (a = the device under test, r = the reference device):
    max_abs      max |a - r|
    rel_max_abs  max over tokens t of  max |a_t - r_t| / max |r_t|   (checked against the tolerance;
                 per token, because one token's outlier would otherwise set every token's scale)
    rel_rms      ||a - r|| / ||r||
    min_cosine   the lowest cosine similarity between a token's row in a and in r
and for the logits, the positions whose argmax differs (discrete, reported exactly).

Tolerance (an error budget, not a proof). Two devices that run the same checkpoint differ only
in their arithmetic, which each device describes with an `Arithmetic`:
    accumulation    unit roundoff of its sums (f32: 2^-24); 0 only for the reference's own code
    activations[k]  relative rounding of a matmul's input when the weight is stored as k
                    ("f32", "f16", "quantized"): 0 for f32 inputs, 2^-11 for f16, 1/254 for int8
                    activation quantization with per-block absmax scales (half a step of 127)
    weights[k]      relative rounding of weights of kind k as the device holds them: 0 when it
                    dequantizes exactly into f32 (an f16 scale times a 4- or 8-bit code fits
                    f32's 24-bit mantissa), 2^-11 when it keeps them as f16
The checkpoint's schemes pick the kinds: the worst kind present among its matrices counts.
One matmul over K inputs then errs by about
    e = activations[k] + weights[k] + accumulation * sqrt(K)   (rounding errors of random sign)
and the residual stream after layer l (0-based) by at most
    rtol(l) = SAFETY * MATMULS_IN_SERIES * sqrt(l + 1) * e
every layer adding its own, independent rounding errors to the stream (they add in quadrature).
The logits get rtol(L) with L = the number of layers (the head is one more stage). For scale: an
f32 device emulated by float64 matmuls rounded to f32 differs from the reference by about 1e-6 at
every layer of SmolLM2-135M (K = 1536), against budgets of 2e-5 (layer 0) to 1e-4 (layer 29);
noise of 1% of the weights' spread on one layer's down-projection shows as 6e-4. The tolerance of
a pair of devices is the sum of theirs, so reference vs reference has tolerance 0: any difference
at all is reported, since both run the very same code.

MoE routing: after a MoE layer the observer also gets the route (expert_ids, expert_weights, each
[T, A]; LayerRecorder keeps them). compare_extras compares it: each token's set of experts must
agree exactly (a discrete result), and where it does, the weights within the layer's tolerance. A
layer whose routing differs is a divergence, named like one in the hidden states. Other extras are
listed as not compared.

A backend declares its arithmetic by returning {"arithmetic": {"accumulation": ..., "activations":
{...}, "weights": {...}}} from info(). Failing that, the precision keys backends already report are
read (info()["activations"] such as "float32"; the NPU's MatMulNBits "accuracy_level" and provider),
and failing those DEVICE_ARITHMETIC below holds the assumption for the device kind. The report says
which source was used.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field

import numpy as np

from devices.base import split_device_list
from edge.core.arguments import integer
from edge.core.errors import ZllmError

SAFETY = 2.0
MATMULS_IN_SERIES = 4  # longest chain of matmuls inside one layer: q/k/v -> scores -> values -> o, then gate/up -> down
WEIGHT_KINDS = ("f32", "f16", "quantized")
F32_UNIT = 2.0**-24
F16_UNIT = 2.0**-11
BF16_UNIT = 2.0**-8
INT8_ACTIVATION_UNIT = 1.0 / 254.0


class DiffError(ZllmError):
    """The comparison cannot run as asked."""


@dataclass(frozen=True)
class Arithmetic:
    accumulation: float
    activations: dict = field(default_factory=lambda: dict.fromkeys(WEIGHT_KINDS, 0.0))
    weights: dict = field(default_factory=lambda: dict.fromkeys(WEIGHT_KINDS, 0.0))

    def matmul_error(self, kinds: set[str], inputs: int) -> float:
        """Relative error of one matmul over `inputs` terms with weights of the given kinds."""
        worst_kind = max(self.activations.get(k, 0.0) + self.weights.get(k, 0.0) for k in kinds) if kinds else 0.0
        return worst_kind + self.accumulation * math.sqrt(inputs)

    @classmethod
    def from_dict(cls, data: dict) -> "Arithmetic":
        unknown = set(data) - {"accumulation", "activations", "weights"}
        if unknown:
            raise DiffError(f"a backend's info()['arithmetic'] has unknown keys {sorted(unknown)}")
        return cls(float(data.get("accumulation", 0.0)),
                   {**dict.fromkeys(WEIGHT_KINDS, 0.0), **data.get("activations", {})},
                   {**dict.fromkeys(WEIGHT_KINDS, 0.0), **data.get("weights", {})})


_F32_DEVICE = Arithmetic(F32_UNIT)
# What each device kind is assumed to do when its backend does not say (see the module docstring).
DEVICE_ARITHMETIC: dict[str, Arithmetic] = {
    # the oracle itself: a second reference run executes the same numpy calls, so it must be exact
    "reference": Arithmetic(0.0),
    # Numba kernels as `cpu:f32` runs them (weights dequantized into f32, f32 activations, sums in
    # another order); the backend's info() declares its variant's arithmetic, int8 inputs included
    "cpu": _F32_DEVICE,
    # Vulkan compute shaders in f32
    "gpu": _F32_DEVICE,
    # NPUs and ONNX Runtime: f16 graphs; MatMulNBits quantizes activations to int8 (accuracy level 4)
    "npu": Arithmetic(F32_UNIT, {"f32": F16_UNIT, "f16": F16_UNIT, "quantized": INT8_ACTIVATION_UNIT},
                      {"f32": F16_UNIT, "f16": 0.0, "quantized": F16_UNIT}),
}


# Precision names backends already report in info(): "activations" (cpu) and MatMulNBits'
# "accuracy_level" (npu: 0 unset = f32, 1 f32, 2 f16, 3 bf16, 4 int8).
ACTIVATION_UNITS = {"float32": 0.0, "float16": F16_UNIT, "bfloat16": BF16_UNIT, "int8": INT8_ACTIVATION_UNIT}
ACCURACY_LEVEL_UNITS = {0: 0.0, 1: 0.0, 2: F16_UNIT, 3: BF16_UNIT, 4: INT8_ACTIVATION_UNIT}


def device_arithmetic(device: str, info: dict) -> tuple[Arithmetic, str]:
    """(the device's arithmetic, where that description came from)."""
    if "arithmetic" in info:
        return Arithmetic.from_dict(info["arithmetic"]), "declared by the backend's info()"
    kind = device.partition(":")[0]
    if info.get("activations") in ACTIVATION_UNITS:
        unit = ACTIVATION_UNITS[info["activations"]]
        return (Arithmetic(F32_UNIT, dict.fromkeys(WEIGHT_KINDS, unit)),
                f"f32 sums, {info['activations']} matmul inputs (info()['activations'])")
    if kind == "npu" and info.get("accuracy_level") in ACCURACY_LEVEL_UNITS:
        base = DEVICE_ARITHMETIC["npu"]
        level = info["accuracy_level"]
        if info.get("provider") == "cpu":  # ONNX Runtime's CPU provider keeps float graphs in f32
            base = _F32_DEVICE
        activations = {**base.activations, "quantized": ACCURACY_LEVEL_UNITS[level]}
        return (Arithmetic(base.accumulation, activations, base.weights),
                f"MatMulNBits accuracy_level {level} (info()), provider {info.get('provider')!r}")
    if kind not in DEVICE_ARITHMETIC:
        raise DiffError(f"device {device!r} does not describe its arithmetic, so no tolerance can be derived; "
                        "return {'arithmetic': {...}} from its backend's info() or add its kind to "
                        "edge.diff.DEVICE_ARITHMETIC")
    return DEVICE_ARITHMETIC[kind], f"assumed for device kind {kind!r} (edge.diff.DEVICE_ARITHMETIC)"


def weight_kinds(manifest: dict) -> set[str]:
    """The kinds of the checkpoint's matrices: "f32", "f16" and/or "quantized" (norm vectors excluded)."""
    kinds = set()
    for info in manifest["tensors"].values():
        if len(info["shape"]) != 2:
            continue
        scheme = info["scheme"]
        kinds.add(scheme if scheme in ("f32", "f16") else "quantized")
    return kinds


@dataclass
class Tolerance:
    """rtol(depth) = SAFETY * MATMULS_IN_SERIES * sqrt(depth) * per_matmul, per_matmul summed over both devices."""

    per_matmul: float
    matmul_inputs: int
    weight_kinds: list[str]
    sources: dict

    def relative(self, depth: int) -> float:
        return SAFETY * MATMULS_IN_SERIES * math.sqrt(depth) * self.per_matmul


def derive_tolerance(devices: list[str], infos: list[dict], manifest: dict) -> Tolerance:
    config = manifest["model"]
    inputs = max(config["hidden_size"], config["intermediate_size"], config["num_attention_heads"] * config["head_dim"])
    kinds = weight_kinds(manifest)
    per_matmul, sources = 0.0, {}
    for device, info in zip(devices, infos):
        arithmetic, source = device_arithmetic(device, info)
        per_matmul += arithmetic.matmul_error(kinds, inputs)
        sources[device] = {"arithmetic": asdict(arithmetic), "source": source}
    return Tolerance(per_matmul, inputs, sorted(kinds), sources)


# ---------------------------------------------------------------------------------- recording


class LayerRecorder:
    """The observer: keeps a float32 copy of the residual stream after each layer, and any extra
    keyword arguments (a MoE layer's route: expert_ids, expert_weights) per layer."""

    def __init__(self):
        self.hidden: dict[int, np.ndarray] = {}
        self.extras: dict[int, dict] = {}

    def __call__(self, layer: int, hidden, **extras) -> None:
        # copy: a fused executor may hand over a buffer it reuses for the next layer
        self.hidden[layer] = np.array(hidden, dtype=np.float32, copy=True)
        if extras:
            self.extras[layer] = extras


ROUTE_KEYS = ("expert_ids", "expert_weights")


def compare_routes(reference: dict, other: dict, tolerance: float) -> dict:
    """One MoE layer's routes [T, A]: tokens whose expert sets differ, and the weights' worst error
    (relative to the largest weight) over the tokens that agree."""
    ref_ids, other_ids = (np.sort(np.asarray(r["expert_ids"]), axis=-1) for r in (reference, other))
    if ref_ids.shape != other_ids.shape:
        raise DiffError(f"the devices disagree on a route's shape: {ref_ids.shape} vs {other_ids.shape}")
    agree = (ref_ids == other_ids).all(axis=-1)  # [T]

    def weights_by_id(route: dict) -> np.ndarray:
        order = np.argsort(np.asarray(route["expert_ids"]), axis=-1)
        return np.take_along_axis(np.asarray(route["expert_weights"], np.float64), order, axis=-1)

    ref_weights, other_weights = weights_by_id(reference), weights_by_id(other)
    scale = max(float(np.abs(ref_weights).max(initial=0.0)), np.finfo(np.float64).tiny)
    weight_error = float(np.abs(ref_weights - other_weights)[agree].max(initial=0.0)) / scale
    return {"tokens_with_other_experts": [int(t) for t in np.nonzero(~agree)[0]],
            "weights_rel_max_abs": weight_error, "tolerance": tolerance,
            "exceeds": bool((~agree).any()) or not weight_error <= tolerance}  # nan weights exceed too


def compare_extras(reference: LayerRecorder, other: LayerRecorder, tolerance: "Tolerance | None" = None) -> dict:
    """Routes of MoE layers compared (ids exactly, weights within the layer's tolerance); other extras listed."""
    result = {}
    layers = sorted(set(reference.extras) | set(other.extras))
    routed = [layer for layer in layers
              if all(key in rec.extras.get(layer, {}) for rec in (reference, other) for key in ROUTE_KEYS)]
    if routed and tolerance is not None:
        result["routing"] = {layer: compare_routes(reference.extras[layer], other.extras[layer],
                                                   tolerance.relative(layer + 1)) for layer in routed}
    compared = set(ROUTE_KEYS) if "routing" in result else set()
    names = sorted({key for rec in (reference, other) for extras in rec.extras.values() for key in extras} - compared)
    if names:
        result["not_compared"] = names
    return result


@dataclass
class TensorDiff:
    max_abs: float
    reference_max_abs: float
    rel_max_abs: float
    rel_rms: float
    min_cosine: float
    tolerance: float

    @property
    def exceeds(self) -> bool:
        # a nan (a device that produced nan or inf) fails every comparison: it must exceed, not pass
        return not self.rel_max_abs <= self.tolerance

    def as_dict(self) -> dict:
        return {**asdict(self), "exceeds": self.exceeds}


def tensor_diff(reference: np.ndarray, other: np.ndarray, tolerance: float) -> TensorDiff:
    if reference.shape != other.shape:
        raise DiffError(f"the devices disagree on a tensor's shape: {reference.shape} vs {other.shape}")
    reference = np.asarray(reference, np.float64).reshape(-1, reference.shape[-1])  # [tokens, features]
    other = np.asarray(other, np.float64).reshape(reference.shape)
    difference = other - reference
    max_abs = float(np.abs(difference).max())
    reference_max = float(np.abs(reference).max())
    # Relative per token, then the worst token: one token's outlier (an attention sink's residual
    # can be 1000x the others') must not set the scale that every other token is judged by.
    token_max = np.abs(reference).max(axis=1)
    token_difference = np.abs(difference).max(axis=1)
    token_relative = np.where(token_max > 0, token_difference / np.where(token_max > 0, token_max, 1.0),
                              np.where(token_difference > 0, math.inf, 0.0))
    norms = np.linalg.norm(reference, axis=1) * np.linalg.norm(other, axis=1)
    cosines = np.where(norms > 0, (reference * other).sum(axis=1) / np.where(norms > 0, norms, 1.0), 1.0)
    cosines[(difference == 0).all(axis=1)] = 1.0  # identical rows: exactly 1, not 1 - rounding of the norms
    return TensorDiff(
        max_abs=max_abs,
        reference_max_abs=reference_max,
        rel_max_abs=float(token_relative.max()),
        rel_rms=float(np.linalg.norm(difference) / max(np.linalg.norm(reference), np.finfo(np.float64).tiny)),
        min_cosine=float(cosines.min()),
        tolerance=tolerance,
    )


@dataclass
class PassDiff:
    """One forward call on both devices: the prompt's prefill or one decode step."""

    name: str
    tokens: list[int]
    layers: list[TensorDiff | None]  # None: the compared device does not show this layer's output
    logits: TensorDiff
    argmax_mismatch_positions: list[int]
    extras: dict

    @property
    def first_divergent_layer(self) -> int | str | None:
        routing = self.extras.get("routing", {})
        for index, layer in enumerate(self.layers):
            if (layer is not None and layer.exceeds) or routing.get(index, {}).get("exceeds"):
                return index
        return "logits" if self.logits.exceeds else None

    def as_dict(self) -> dict:
        return {"name": self.name, "tokens": self.tokens, "first_divergent_layer": self.first_divergent_layer,
                "layers": [None if layer is None else layer.as_dict() for layer in self.layers], "logits": self.logits.as_dict(),
                "argmax_mismatch_positions": self.argmax_mismatch_positions, **self.extras}


def _compare_pass(name: str, tokens: list[int], recorders, logits, tolerance: Tolerance, n_layers: int) -> PassDiff:
    reference, other = recorders
    missing = [layer for layer in range(n_layers) if layer not in reference.hidden or
               (layer == n_layers - 1 and layer not in other.hidden)]  # a fused graph still shows its last
    if missing:
        raise DiffError(f"{name}: the observer saw no hidden state for layers {missing}; a backend's fused "
                        "executor must call observer(layer, hidden) after every layer")
    # A device that fuses several layers into one graph (npu) shows the hidden state only where a
    # graph ends: the layers inside a graph are compared through the next one it shows (None here).
    layers = [tensor_diff(reference.hidden[i], other.hidden[i], tolerance.relative(i + 1)) if i in other.hidden
              else None for i in range(n_layers)]
    ref_logits, other_logits = (np.asarray(x, np.float32).reshape(-1, x.shape[-1]) for x in logits)
    logits_diff = tensor_diff(ref_logits, other_logits, tolerance.relative(n_layers + 1))
    mismatches = np.nonzero(ref_logits.argmax(axis=1) != other_logits.argmax(axis=1))[0]
    return PassDiff(name, tokens, layers, logits_diff, [int(i) for i in mismatches],
                    compare_extras(reference, other, tolerance))


# ---------------------------------------------------------------------------------- the comparison


def check_diff_arguments(devices: list[str], decode_steps: int, threads: int | None) -> None:
    """What diff is asked for, checked before a model is converted or loaded (DiffError / InvalidArgumentError)."""
    from edge.bench import load_threads
    from edge.options import LoadOptions

    if len(devices) != 2:
        raise DiffError(f"diff compares exactly two devices, got {len(devices)}: {','.join(devices) or '(none)'}")
    if decode_steps < 0:
        raise DiffError(f"--decode-steps must be >= 0, got {decode_steps}")
    if threads is not None:
        integer("--threads", threads, minimum=1)
    for device in devices:
        LoadOptions.of(device, load_threads(device, threads))


def run_diff(checkpoint_path: str, prompt_ids: list[int], devices: list[str], decode_steps: int = 4,
             threads: int | None = None) -> dict:
    """Compare devices[1] against devices[0] (the reference) on prompt_ids and decode_steps greedy steps."""
    import edge
    from edge.bench import load_threads
    from quant.checkpoint import read_manifest

    check_diff_arguments(devices, decode_steps, threads)
    if not prompt_ids:
        raise DiffError("the prompt has no tokens")
    context = read_manifest(checkpoint_path)["model"]["max_position_embeddings"]
    if len(prompt_ids) + decode_steps > context:
        raise DiffError(f"the prompt's {len(prompt_ids)} tokens and --decode-steps {decode_steps} exceed the model's "
                        f"context of {context} tokens; shorten the prompt or lower --decode-steps")
    # --threads is for the devices that run threads (cpu, npu); reference and gpu refuse a count
    models = []
    try:
        for device in devices:  # a device that fails to load leaves none open
            models.append(edge.load(checkpoint_path, device=device, threads=load_threads(device, threads)))
        n_layers = models[0].spec.num_hidden_layers
        manifest = models[0].checkpoint.manifest
        infos = [model.device_info() for model in models]
        tolerance = derive_tolerance(devices, infos, manifest)
        sessions = [model.session(capacity=len(prompt_ids) + decode_steps) for model in models]
        for session in sessions:  # a device that produces NaN is a divergence to report, not an error
            session.check_logits = False

        def forward(ids: list[int], all_logits: bool):
            recorders = [LayerRecorder(), LayerRecorder()]
            logits = [np.asarray(session.prefill(ids, all_logits=all_logits, observer=recorder))
                      for session, recorder in zip(sessions, recorders)]
            return recorders, logits

        recorders, logits = forward(prompt_ids, all_logits=True)
        passes = [_compare_pass("prefill", list(prompt_ids), recorders, logits, tolerance, n_layers)]
        token = int(np.asarray(logits[0])[-1].argmax())
        for step in range(decode_steps):
            recorders, logits = forward([token], all_logits=False)
            passes.append(_compare_pass(f"decode {step + 1}", [token], recorders, logits, tolerance, n_layers))
            token = int(np.asarray(logits[0]).argmax())
    finally:
        for model in models:
            model.close()

    first = next(({"pass": p.name, "layer": p.first_divergent_layer} for p in passes
                  if p.first_divergent_layer is not None), None)
    return {
        "model": checkpoint_path,
        "devices": {"reference": devices[0], "compared": devices[1]},
        "device_info": dict(zip(["reference", "compared"], infos)),
        "prompt_ids": list(prompt_ids),
        "decode_steps": decode_steps,
        "tolerance": {"rule": f"rel_max_abs(layer l) <= {SAFETY:g} * {MATMULS_IN_SERIES} * sqrt(l + 1) * per_matmul; "
                              f"logits use l + 1 = layers + 1",
                      **asdict(tolerance)},
        "first_divergence": first,
        "passes": [p.as_dict() for p in passes],
    }


# ---------------------------------------------------------------------------------- output and CLI


def format_report(report: dict) -> str:
    reference, compared = report["devices"]["reference"], report["devices"]["compared"]
    tol = report["tolerance"]
    lines = [f"zllm-edge diff {report['model']}: {compared} against {reference}, prompt of "
             f"{len(report['prompt_ids'])} tokens, {report['decode_steps']} greedy decode steps (tokens from {reference})",
             f"tolerance: {tol['rule']}; per_matmul = {tol['per_matmul']:.3g} (weights {', '.join(tol['weight_kinds'])}, "
             f"K = {tol['matmul_inputs']})"]
    for device, source in tol["sources"].items():
        lines.append(f"  {device}: {source['source']}: accumulation {source['arithmetic']['accumulation']:.3g}, "
                     f"activations {source['arithmetic']['activations']}, weights {source['arithmetic']['weights']}")
    header = f"{'pass':10s} {'layer':>6s} {'max abs':>10s} {'rel max abs':>12s} {'tolerance':>10s} {'rel rms':>10s} {'min cos':>10s}"
    lines += ["", header, "-" * len(header)]

    def row(name, label, d, note=""):
        flag = "  <-- exceeds" if d["exceeds"] else ""
        return (f"{name:10s} {label:>6s} {d['max_abs']:10.3e} {d['rel_max_abs']:12.3e} {d['tolerance']:10.3e} "
                f"{d['rel_rms']:10.3e} {d['min_cosine']:10.6f}{note}{flag}")

    for p in report["passes"]:
        if p["name"] == "prefill":
            for index, layer in enumerate(p["layers"]):
                lines.append(row(p["name"], str(index), layer) if layer is not None else
                             f"{p['name']:10s} {index:>6d} not shown by {compared} (inside a fused graph)")
        elif any(layer is not None for layer in p["layers"]):  # one line per decode step: its worst layer
            shown = [i for i, layer in enumerate(p["layers"]) if layer is not None]
            worst = max(shown, key=lambda i: _tolerance_ratio(p["layers"][i]))
            lines.append(row(p["name"], f"w{worst}", p["layers"][worst], "  (worst layer)"))
        mismatches = p["argmax_mismatch_positions"]
        note = f"  argmax differs at {len(mismatches)}/{len(p['tokens'])} positions" if mismatches else "  argmax agrees"
        lines.append(row(p["name"], "logits", p["logits"], note))
        for layer, route in (p.get("routing") or {}).items():
            if route["tokens_with_other_experts"]:
                lines.append(f"{p['name']:10s} {'moe ' + str(layer):>6s} experts differ at token positions "
                             f"{route['tokens_with_other_experts']}  <-- exceeds")
            else:
                flag = "  <-- exceeds" if route["exceeds"] else ""
                lines.append(f"{p['name']:10s} {'moe ' + str(layer):>6s} experts agree; weights rel max abs "
                             f"{route['weights_rel_max_abs']:.3e} (tolerance {route['tolerance']:.3e}){flag}")
        if p.get("not_compared"):
            lines.append(f"{p['name']:10s} observer extras not compared yet: {', '.join(p['not_compared'])}")
    first = report["first_divergence"]
    lines.append("")
    if first is None:
        lines.append("no divergence: every layer and the logits are within tolerance")
    else:
        lines.append(f"first divergence: {first['pass']}, layer {first['layer']}")
    return "\n".join(lines)


def _finite(value):
    """value with every nan or infinite float replaced by None, for strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _tolerance_ratio(d: dict) -> float:
    if d["rel_max_abs"] is None or math.isnan(d["rel_max_abs"]):  # nan (None once made JSON): the worst
        return math.inf
    if d["tolerance"] > 0:
        return d["rel_max_abs"] / d["tolerance"]
    return math.inf if d["rel_max_abs"] > 0 else 0.0


def add_arguments(parser) -> None:
    parser.add_argument("words", nargs="+", metavar="[MODEL] PROMPT",
                        help="checkpoint (default: the built-in default model) and the prompt text")
    parser.add_argument("--devices", default="reference,reference",
                        help="two devices, the reference first: reference,cpu (default reference,reference)")
    parser.add_argument("--ids", action="store_true",
                        help="PROMPT is comma-separated token ids (for checkpoints without a tokenizer)")
    parser.add_argument("--decode-steps", type=int, default=4, help="greedy decode steps compared after the prompt")
    parser.add_argument("--threads", type=int, default=None, help="compute threads of the cpu and npu devices")
    parser.add_argument("--json", action="store_true",
                        help="print the whole report as JSON (nan and infinite figures as null)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def cmd_diff(args) -> int:
    """Exit status 0 when the devices agree within tolerance, 1 when a layer diverges."""
    from edge.home import default_model_checkpoint

    if len(args.words) not in (1, 2):
        raise DiffError("usage: zllm-edge diff [MODEL] PROMPT --devices reference,cpu")
    devices = split_device_list(args.devices)
    check_diff_arguments(devices, args.decode_steps, args.threads)  # before the default model is converted
    prompt = args.words[-1]
    if args.ids:
        try:
            prompt_ids = [int(word) for word in prompt.replace(",", " ").split()]
        except ValueError:
            raise DiffError(f"--ids expects comma-separated integers, got {prompt!r}") from None
    else:
        from edge.api import check_unicode

        check_unicode("the text", prompt)  # before the default model is converted
    path = args.words[0] if len(args.words) == 2 else default_model_checkpoint(progress=not args.quiet)
    if not args.ids:
        from edge.tokenizer import Tokenizer, TokenizerError
        from quant.checkpoint import open_checkpoint

        with open_checkpoint(path) as checkpoint:
            if checkpoint.tokenizer_path is None:
                raise TokenizerError(f"{path} has no tokenizer; pass token ids with --ids 1,2,3")
            prompt_ids = Tokenizer(checkpoint.tokenizer_path, checkpoint.tokenizer_config).encode(prompt)
    report = run_diff(path, prompt_ids, devices, decode_steps=args.decode_steps, threads=args.threads)
    # strict JSON: nan and infinity (a device that produced nan, a zero reference row) become null
    print(json.dumps(_finite(report), indent=1, allow_nan=False) if args.json else format_report(report))
    sys.stdout.flush()
    return 0 if report["first_divergence"] is None else 1
