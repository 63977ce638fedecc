"""`zllm-edge convert --moefy [E:K]`: a dense Llama in, a `llama_moe` checkpoint with real routing out.

Each dense FFN (except the layers kept dense) is split into E experts by clustering its neurons
(converters/moefy_fit.py); a linear router fitted on calibration text picks K experts per token.
The dense model is run on the CPU backend over calibration text to collect each FFN's inputs,
then a MoEfied view of the source (MoefiedSource) goes through the normal converter, so atomic
staging, the quantization plan and the experts.bin writer are the converter's own.

Quantization: splitting gate/up by rows keeps their quantized blocks bit-exact (a row is an
output). down [D, I] is split by columns and its groups run along I, so an expert's down columns
do not form whole source groups: they are handed over dequantized, with the source format marked
"regrouped" (e.g. "Q4_1 regrouped"). Under `--weights source` the converter then requantizes
them to int8, as it does every source format it cannot import losslessly (requantizing to the
source's own 4 bits would add a second 4-bit rounding: +33% held-out perplexity instead of +23%
on SmolLM2); an explicit scheme applies as asked. The converter reports the error per tensor.

T = tokens, D = hidden size, I = dense intermediate size, E = experts, N = I / E, K = experts per token.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from converters.convert import ConversionSummary, QuantPlan
from converters.moefy_calibrate import as_float, evaluate
from converters.moefy_fit import LayerMoefication
from converters.source import SourceTensor
from edge.core.errors import ConversionError, UnsupportedModelError
from edge.core.spec import LlamaSpec
from quant import QuantizedTensor
from quant.expert_file import expert_tensor_name

CALIBRATION_TOKENS = 8192
HELDOUT_TOKENS = 4096
SENSITIVITY_TOKENS = 1024  # calibration-side tokens (not used for fitting) that rank layers for auto dense
DENSE_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
UNGROUPED_FORMATS = ("F32", "F16", "BF16", "F64")  # float formats: any column subset is stored exactly


@dataclass(frozen=True)
class MoefySetting:
    """E experts per layer, K chosen per token, and the layers that keep their dense FFN:
    layer ids (negative ones count from the end) or "auto:N" (the N layers whose MoEfication
    alone raises calibration perplexity most)."""

    experts: int
    top_k: int
    dense_layers: tuple[int, ...] | str = ()

    def __str__(self) -> str:
        dense = self.dense_layers if isinstance(self.dense_layers, str) else ",".join(map(str, self.dense_layers))
        return f"{self.experts}:{self.top_k} dense layers [{dense or 'none'}]"


# The sparsest setting whose held-out perplexity on SmolLM2-135M stays within +30% of the dense
# model (benchmarks/moefy_curve.py measures the whole curve).
DEFAULT_MOEFY = MoefySetting(experts=16, top_k=13, dense_layers=(0, -1))


def parse_moefy(text: str) -> tuple[int, int]:
    """"E:K" -> (E, K)."""
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not match:
        raise ConversionError(
            f"--moefy {text!r} not understood; expected E:K (experts per layer : experts chosen per token), "
            "e.g. 16:13, or no value for the default")
    return int(match.group(1)), int(match.group(2))


def parse_dense_layers(text: str) -> tuple[int, ...] | str:
    """"0,29" / "0,-1" -> layer ids; "auto:N" as is; "none" -> ()."""
    text = text.strip()
    if text == "none":
        return ()
    if re.fullmatch(r"auto:\d+", text):
        return text
    if re.fullmatch(r"-?\d+(\s*,\s*-?\d+)*", text):
        return tuple(int(v) for v in text.split(","))
    raise ConversionError(
        f"--moefy-dense-layers {text!r} not understood; expected layer ids such as 0,29 (negative counts "
        "from the end), auto:N (the N most sensitive layers) or none")


def check_moefy_source(spec: LlamaSpec, src: str) -> None:
    if spec.model_type != "llama":
        if any(spec.moe_for_layer(layer) is not None for layer in range(spec.num_hidden_layers)):
            raise UnsupportedModelError(
                f"{src} is already a Mixture-of-Experts model ({spec.model_type}); --moefy splits the FFNs "
                "of a dense Llama model")
        raise UnsupportedModelError(
            f"--moefy takes a dense Llama model (model_type 'llama'); {src} is {spec.model_type!r}")
    if spec.mlp_bias:
        raise UnsupportedModelError(f"{src} has FFN biases (mlp_bias); --moefy supports bias-free Llama FFNs only")


def check_setting(spec: LlamaSpec, experts: int, top_k: int) -> None:
    size = spec.intermediate_size
    if experts < 1 or top_k < 1:
        raise ConversionError(f"--moefy {experts}:{top_k}: E and K must both be at least 1")
    if top_k > experts:
        raise ConversionError(
            f"--moefy {experts}:{top_k} chooses {top_k} experts per token out of {experts}; K must be at most E")
    if size % experts:
        divisors = [d for d in range(2, min(size, 256) + 1) if size % d == 0]
        raise ConversionError(
            f"--moefy {experts}:{top_k}: {experts} experts do not split the intermediate size {size} evenly; "
            f"choose E among {divisors}")


def regrouped_format(source_format: str) -> str:
    """The format of down columns cut out of a tensor stored as `source_format`."""
    return source_format if source_format in UNGROUPED_FORMATS else f"{source_format} regrouped"


def check_expert_groups(spec: LlamaSpec, experts: int, top_k: int, plan: QuantPlan, down_format: str) -> None:
    """An expert's down projection [D, N] is quantized along N: N must be whole groups."""
    neurons = spec.intermediate_size // experts
    probe = SourceTensor(expert_tensor_name(0, 0, "down_proj"), (spec.hidden_size, neurons),
                         regrouped_format(down_format), 0)
    scheme = plan.scheme_for(probe)
    if scheme.is_quantized and neurons % scheme.group_size:
        valid = [e for e in range(1, spec.intermediate_size + 1)
                 if spec.intermediate_size % e == 0 and (spec.intermediate_size // e) % scheme.group_size == 0]
        raise ConversionError(
            f"--moefy {experts}:{top_k} gives experts of {neurons} neurons, not a multiple of the experts' "
            f"quantization group ({scheme}); choose E among {valid} or store experts unquantized (--experts f16)")


def resolve_dense_layers(dense_layers: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    resolved = []
    for layer in dense_layers:
        if not -num_layers <= layer < num_layers:
            raise ConversionError(
                f"dense layer {layer} is out of range for a model of {num_layers} layers "
                f"(use 0..{num_layers - 1}, or negative ids from the end)")
        resolved.append(layer % num_layers)
    if len(set(resolved)) == num_layers:
        raise ConversionError(f"dense layers {list(dense_layers)} (--moefy-dense-layers, default 0,-1) keep every "
                              f"layer of {num_layers} dense; nothing would be MoEfied: pass --moefy-dense-layers none "
                              "or fewer layers")
    return tuple(sorted(set(resolved)))


class MoefiedSource:
    """A SourceModel view of a dense Llama whose MoE layers' FFNs are replaced by router + experts."""

    def __init__(self, source, spec: LlamaSpec, experts: int, top_k: int, dense_layers: tuple[int, ...],
                 fits: dict[int, LayerMoefication], manifest_extra: dict):
        self.source = source
        self.fits = fits
        self.tokenizer = source.tokenizer
        self.description = f"{source.description} moefied {experts}:{top_k}"
        self.manifest_extra = manifest_extra
        self.config = {**source.config, "model_type": "llama_moe", "num_experts": experts,
                       "num_experts_per_tok": top_k, "moe_intermediate_size": spec.intermediate_size // experts,
                       "dense_layers": list(dense_layers)}
        self._derived: dict[str, tuple[str, int, int, str]] = {}  # name -> (kind, layer, expert, projection)
        self._tensors: list[SourceTensor] = []
        moe_dense_names = {f"model.layers.{layer}.mlp.{proj}.weight": (layer, proj)
                           for layer in fits for proj in DENSE_PROJECTIONS}
        neurons = spec.intermediate_size // experts
        for t in source.tensors():
            if t.name not in moe_dense_names:
                self._tensors.append(t)
                continue
            layer, proj = moe_dense_names[t.name]
            shape = (t.shape[0], neurons) if proj == "down_proj" else (neurons, t.shape[1])
            source_format = regrouped_format(t.source_format) if proj == "down_proj" else t.source_format
            for expert in range(experts):
                name = expert_tensor_name(layer, expert, proj)
                self._tensors.append(SourceTensor(name, shape, source_format, t.nbytes // experts))
                self._derived[name] = ("expert", layer, expert, proj)
            if proj == "gate_proj":
                for suffix, shape in (("weight", (experts, spec.hidden_size)), ("bias", (experts,))):
                    name = f"model.layers.{layer}.mlp.gate.{suffix}"
                    self._tensors.append(SourceTensor(name, shape, "F32", 4 * int(np.prod(shape))))
                    self._derived[name] = ("router_" + suffix, layer, -1, "")
        self._cache: dict[str, np.ndarray | QuantizedTensor] = {}  # the current layer's dense projections

    def tensors(self) -> list[SourceTensor]:
        return list(self._tensors)

    def _dense(self, layer: int, proj: str):
        name = f"model.layers.{layer}.mlp.{proj}.weight"
        if name not in self._cache:
            for old in [n for n in self._cache if not n.startswith(f"model.layers.{layer}.")]:
                del self._cache[old]
                self.source.release(old)
            value = self.source.load(name)
            # down is split by columns, across its quantization groups: keep it as float32
            self._cache[name] = as_float(value) if proj == "down_proj" else value
        return self._cache[name]

    def load(self, name: str):
        if name not in self._derived:
            return self.source.load(name)
        kind, layer, expert, proj = self._derived[name]
        fit = self.fits[layer]
        if kind == "router_weight":
            return fit.router_weight.copy()
        if kind == "router_bias":
            return fit.router_bias.copy()
        ids = fit.neurons[expert]
        dense = self._dense(layer, proj)
        if proj == "down_proj":
            return np.ascontiguousarray(dense[:, ids])  # [D, N]
        if isinstance(dense, QuantizedTensor):
            return dense.take_rows(ids)  # rows are outputs: codes and scales copied unchanged
        return np.ascontiguousarray(dense[ids])  # [N, D]

    def release(self, name: str) -> None:
        if name not in self._derived:
            self.source.release(name)

    def close(self) -> None:
        self._cache.clear()
        self.source.close()


@dataclass
class MoefySummary:
    conversion: ConversionSummary
    setting: MoefySetting             # dense_layers resolved to layer ids
    active_fraction: float            # share of all FFN neurons computed per token (dense layers count fully)
    calibration_tokens: int
    heldout_tokens: int
    dense_perplexity: float | None
    moe_perplexity: float | None
    routing: dict = field(default_factory=dict)
    clustering: dict = field(default_factory=dict)  # layer -> clustering that won
    seconds: float = 0.0

    def format(self) -> str:
        lines = [self.conversion.format(),
                 f"moefied {self.setting} (active FFN fraction {self.active_fraction:.3f}) "
                 f"calibrated on {self.calibration_tokens} tokens in {self.seconds:.1f} s total"]
        if self.moe_perplexity is not None:
            change = self.moe_perplexity / self.dense_perplexity - 1.0
            lines.append(f"  held-out perplexity ({self.heldout_tokens} tokens): dense {self.dense_perplexity:.2f}, "
                         f"MoEfied {self.moe_perplexity:.2f} ({change:+.1%})")
        if self.routing:
            recall = ", ".join(f"{k} {v:.3f}" for k, v in self.routing["lookahead_recall"].items())
            lines.append(f"  routing: load imbalance (busiest / mean) {self.routing['load_imbalance_mean']:.2f} "
                         f"mean, {self.routing['load_imbalance_max']:.2f} max; next-layer recall {recall}")
        return "\n".join(lines)


def active_fraction(num_layers: int, experts: int, top_k: int, dense_layers: tuple[int, ...]) -> float:
    moe_layers = num_layers - len(dense_layers)
    return (moe_layers * top_k / experts + len(dense_layers)) / num_layers


def most_sensitive_layers(transformer, ffns, fits, top_k: int, windows, count: int,
                          progress: bool = False) -> tuple[int, ...]:
    """The `count` layers whose MoEfication alone raises perplexity on `windows` most."""
    perplexity = {layer: evaluate(transformer, ffns, {layer: fit}, top_k, windows).perplexity
                  for layer, fit in tqdm(fits.items(), desc="layer sensitivity", unit="layer",
                                         disable=not progress, leave=False)}
    return tuple(sorted(sorted(perplexity, key=lambda layer: -perplexity[layer])[:count]))


