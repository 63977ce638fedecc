"""`zllm-edge convert`: a source model (Hugging Face folder or GGUF file) in, a zllm checkpoint out.

Tensors stream through one at a time: read (mmap), dequantize if needed, quantize into the
tensor's scheme, write, forget. Peak memory is a small multiple of the largest tensor.

A MoE model's routed experts (class "experts") go to experts.bin instead of model.safetensors,
one aligned record per (layer, expert) holding its gate/up/down projections (quant/expert_file.py),
so that one read fetches one expert; routers (class "router") stay f32 unless overridden, since
routing is a discrete choice that must match the source model.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from converters import checkpoint as output
from converters.expert_file import ExpertFileWriter
from converters.safetensors_io import SafetensorsWriter
from converters.source import SourceModel, SourceTensor
from edge.core.errors import ConversionError
from edge.core.spec import (
    LlamaSpec,
    counts_beyond_tensors,
    shape_mismatches,
    spec_expert_tensor_names,
    spec_from_dict,
    spec_optional_tensor_names,
    spec_tensor_names,
    tokens_outside_vocab,
)
from edge.core.spec_dense import clipped
from quant import GROUP_SIZES, QuantizedTensor, Scheme, quantize
from quant import checkpoint as ckpt
from quant.expert_file import EXPERTS_FILE, PROJECTIONS, ExpertLayout
from quant.formats import describe_non_finite
from quant.gguf_import import LOSSLESS_BLOCKS
from quant.metrics import quantization_error
from quant.safetensors_io import NUMPY_TO_SAFETENSORS, SafetensorsFormatError

log = logging.getLogger(__name__)

WEIGHT_CHOICES = ("f32", "f16", "int8", "int4", "source")
TENSOR_CLASSES = ("embeddings", "attention", "ffn", "lm_head", "experts", "router")
# Routers stay f32 unless overridden: routing is a discrete choice that must match the source model.
CLASS_DEFAULTS = {"router": "f32"}
# GGUF block types kept as they are (repacked into one of our schemes without loss), by source format name
LOSSLESS_SOURCE_SCHEMES = {blocks.info.name: blocks.scheme for blocks in LOSSLESS_BLOCKS.values()}


def tensor_class(name: str) -> str:
    """Which override class a tensor belongs to; "norm" (vectors) always stays f32."""
    if name.endswith(".bias") or "norm" in name.rsplit(".", 2)[-2]:
        return "norm"
    if name == "model.embed_tokens.weight":
        return "embeddings"
    if name == "lm_head.weight":
        return "lm_head"
    if ".self_attn." in name:
        return "attention"
    if ".mlp.experts." in name:
        return "experts"  # routed experts, written to experts.bin
    if ".mlp.gate." in name or name.endswith(".mlp.shared_expert_gate.weight"):
        return "router"
    if ".mlp." in name:
        return "ffn"  # dense FFNs and shared experts
    raise ConversionError(f"tensor {name!r} belongs to no known class")


@dataclass(frozen=True)
class QuantPlan:
    """What the user asked for: a default choice plus per-class overrides."""

    weights: str = "int8"
    group_size: int = 32
    symmetric: bool = True
    overrides: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for choice in [self.weights, *self.overrides.values()]:
            self._parse_choice(choice)
        if self.group_size not in GROUP_SIZES:
            raise ConversionError(f"group size {self.group_size} is not supported; choose one of {GROUP_SIZES}")
        unknown = set(self.overrides) - set(TENSOR_CLASSES)
        if unknown:
            raise ConversionError(f"unknown tensor classes {sorted(unknown)}; overrides take {TENSOR_CLASSES}")

    def _parse_choice(self, choice: str) -> Scheme | str:
        if choice == "source":
            return choice
        if choice in ("f32", "f16"):
            return Scheme(choice)
        if choice in ("int8", "int4"):
            return Scheme(choice, self.group_size, self.symmetric)
        try:
            return Scheme.parse(choice)  # a full scheme such as int8_affine_g64
        except ValueError:
            raise ConversionError(
                f"weights {choice!r} not understood; choose one of {', '.join(WEIGHT_CHOICES)} "
                "or a full scheme such as int4_sym_g32"
            ) from None

    def scheme_for(self, tensor: SourceTensor) -> Scheme:
        """The scheme `tensor` is stored in. A bare bit width ("int8", "int4") keeps a GGUF tensor that
        already holds that many bits in one of our schemes (Q4_0, Q4_1, Q4_K at 4 bits; Q8_0, Q5_0, Q5_1,
        Q5_K, IQ4_NL, IQ4_XS at 8) as it is:
        rounding 4-bit codes onto a second 4-bit grid compounds both roundings (SmolLM2's Q4_1 layers
        requantized to int4_sym_g32 lose "Paris" in "The capital of France is"), for no saving worth
        it. A full scheme ("int4_sym_g64") is requantized as asked."""
        cls = tensor_class(tensor.name)
        if cls == "norm" or len(tensor.shape) != 2:
            return Scheme("f32")
        asked = self.overrides.get(cls, CLASS_DEFAULTS.get(cls, self.weights))
        choice = self._parse_choice(asked)
        kept = LOSSLESS_SOURCE_SCHEMES.get(tensor.source_format)
        if asked in ("int8", "int4") and kept is not None and kept.dtype == choice.dtype:
            return kept
        if choice != "source":
            return choice
        if tensor.source_format in LOSSLESS_SOURCE_SCHEMES:
            return LOSSLESS_SOURCE_SCHEMES[tensor.source_format]
        if tensor.source_format == "F16":
            return Scheme("f16")
        if tensor.source_format in ("F32", "BF16", "F64"):
            return Scheme("f32")
        # Any other GGUF quantization (Q6_K, Q3_K, Q2_K: sub-blocks of 16, ...) is requantized to 8 bits, the
        # nearest of our schemes that does not lose more than the source already did.
        return Scheme("int8", self.group_size, self.symmetric)


@dataclass
class TensorReport:
    name: str
    source_format: str
    scheme: str
    shape: tuple[int, ...]
    bytes_in: int
    bytes_out: int
    lossless: bool
    max_abs_error: float
    rel_rms_error: float


@dataclass
class ConversionSummary:
    output: str
    tensors: list[TensorReport]
    seconds: float

    @property
    def bytes_in(self) -> int:
        return sum(t.bytes_in for t in self.tensors)

    @property
    def bytes_out(self) -> int:
        return sum(t.bytes_out for t in self.tensors)

    @property
    def worst(self) -> TensorReport:
        return max(self.tensors, key=lambda t: t.rel_rms_error)

    def format(self) -> str:
        worst = self.worst
        lossless = sum(t.lossless for t in self.tensors)
        return (
            f"converted {len(self.tensors)} tensors in {self.seconds:.1f} s -> {self.output}\n"
            f"  bytes in {self.bytes_in / 1e6:.1f} MB, out {self.bytes_out / 1e6:.1f} MB "
            f"(ratio {self.bytes_out / max(self.bytes_in, 1):.3f})\n"
            f"  {lossless} tensors kept bit-exact, {len(self.tensors) - lossless} (re)quantized or cast\n"
            f"  worst quantization error: {worst.name} ({worst.scheme}) "
            f"rel RMS {worst.rel_rms_error:.2e}, max abs {worst.max_abs_error:.2e}"
        )


def open_source(src: str) -> SourceModel:
    from converters.gguf_source import GGUFSource
    from converters.hf_source import HFSource

    output.check_source_named(src)
    try:
        if os.path.isdir(src):
            return HFSource(src)
        if os.path.isfile(src):
            return GGUFSource(src)
    except SafetensorsFormatError as exc:  # a damaged source is a ConversionError, as documented
        raise ConversionError(f"{src}: {exc}") from None
    except OSError as exc:  # no permission, an I/O error
        raise ConversionError(f"{src}: cannot read {exc.filename or 'it'}: {exc.strerror or exc}; "
                              "check the file's permissions and the disk") from None
    raise ConversionError(f"{src} does not exist; SRC is a Hugging Face model folder or a .gguf file")


def _to_scheme(value: np.ndarray | QuantizedTensor, scheme: Scheme, name: str
               ) -> tuple[np.ndarray | QuantizedTensor, bool, float, float]:
    """Tensor `name` in `scheme`, whether the conversion was lossless, and its max-abs / rel-RMS error."""
    try:
        if not isinstance(value, QuantizedTensor):
            value = np.asarray(value, dtype=np.float32)
        _check_finite(value)  # whatever becomes of it: kept bit for bit, cast or requantized
        if isinstance(value, QuantizedTensor) and value.scheme == scheme:
            return value, True, 0.0, 0.0
        reference = value.dequantize() if isinstance(value, QuantizedTensor) else value
        if not scheme.is_quantized:
            with np.errstate(over="ignore"):
                stored = reference.astype(np.float16 if scheme.dtype == "f16" else np.float32)
            if not np.isfinite(stored).all():  # finite float32 values beyond float16's range became inf
                option = f"--{tensor_class(name).replace('_', '-')} f32"
                raise ConversionError(f"a value of magnitude {np.abs(reference).max():.6g} exceeds the float16 range "
                                      f"(65504); keep this tensor f32 ({option}, or --weights f32)")
            report = quantization_error(reference, stored)
            return stored, report.max_abs == 0.0, report.max_abs, report.rel_rms
        quantized = quantize(reference, scheme)
    except (ConversionError, ValueError) as exc:  # the quantizer's messages do not know the tensor
        raise ConversionError(f"tensor {name} ({scheme}): {exc}") from None
    report = quantization_error(reference, quantized)
    return quantized, False, report.max_abs, report.rel_rms


def _check_finite(value: np.ndarray | QuantizedTensor) -> None:
    """Refuse NaN or infinity in a source's weights: a float value, or a scale or offset of quantized blocks
    (GGUF Q4_0/Q4_1/Q8_0, whose garbage or edited f16 fields import unchanged otherwise). A model holding
    them computes NaN logits whatever format it is stored in."""
    found = describe_non_finite(value)
    if found is not None:
        raise ConversionError(f"the source holds a non-finite {found}; its weights are damaged: download or export "
                              "the model again")


def _encode(value: np.ndarray | QuantizedTensor, source: SourceTensor, scheme: Scheme
            ) -> tuple[dict[str, np.ndarray], bool, float, float]:
    """Arrays to store, whether the conversion was lossless, and its max-abs / rel-RMS error."""
    stored, lossless, max_abs, rel_rms = _to_scheme(value, scheme, source.name)
    arrays = stored.to_arrays(source.name) if isinstance(stored, QuantizedTensor) else {source.name: stored}
    return arrays, lossless, max_abs, rel_rms


def _source_spec(source: SourceModel, src: str) -> LlamaSpec:
    """The source's spec, strictly checked: every field that decides a weight's shape given, every value
    of the right type and range (a malformed one is a ConversionError naming the config and the field)."""
    if os.path.isdir(src):
        where = os.path.join(src, "config.json")
    elif os.path.isfile(src):
        where = f"{src} (its GGUF metadata, read as config.json fields)"
    else:
        where = f"{src} (its config)"
    return spec_from_dict(source.config, where=where, strict=True)


def _as_float32(value: np.ndarray | QuantizedTensor) -> np.ndarray:
    return value.dequantize() if isinstance(value, QuantizedTensor) else np.asarray(value, dtype=np.float32)


def _equal_values(a, b, rows_per_block: int = 4096) -> bool:
    """a == b as float32 values; plain arrays (a source's mmap views) are compared a block of rows at a
    time, so a large vocabulary's two tables are never both copied whole."""
    if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
        return np.array_equal(_as_float32(a), _as_float32(b))
    return all(np.array_equal(_as_float32(a[i:i + rows_per_block]), _as_float32(b[i:i + rows_per_block]))
               for i in range(0, len(a), rows_per_block))


def _untie_differing_lm_head(source: SourceModel, spec: LlamaSpec, src: str) -> LlamaSpec:
    """A config that ties the LM head to the embeddings while the source holds an lm_head.weight of other
    values: transformers (5.x) then does not tie them and warns; so do we, and the checkpoint keeps the
    source's lm_head (its manifest says tie_word_embeddings false). An identical copy is dropped."""
    by_name = {t.name: t for t in source.tensors()}
    head, embeddings = by_name.get("lm_head.weight"), by_name.get("model.embed_tokens.weight")
    if not spec.tie_word_embeddings or head is None or embeddings is None:
        return spec
    same = tuple(head.shape) == tuple(embeddings.shape)
    if same:
        same = _equal_values(source.load(head.name), source.load(embeddings.name))
        source.release(head.name)
        source.release(embeddings.name)
    if same:
        return spec
    log.warning("%s: the config says tie_word_embeddings true, but lm_head.weight differs from "
                "model.embed_tokens.weight; keeping them untied, as transformers does (the checkpoint records "
                "tie_word_embeddings false). If the model is meant to be tied, remove lm_head.weight from the source; "
                "if not, set tie_word_embeddings false in its config", src)
    return dataclasses.replace(spec, tie_word_embeddings=False)


def _tensors_in_checkpoint_order(source: SourceModel, spec, src: str
                                  ) -> tuple[list[SourceTensor], dict[int, list[list[SourceTensor]]]]:
    """The source's dense tensors in the order the spec lists them, and its routed experts by layer
    (per expert: gate_proj, up_proj, down_proj); missing or unexpected tensors, and tensors whose shape
    is not the one the spec gives them (edge/core/spec.py `spec_tensor_shapes`), are errors."""
    by_name = {t.name: t for t in source.tensors()}
    beyond = counts_beyond_tensors(spec, by_name)
    if beyond:
        raise ConversionError(f"{src}: {beyond}; the config and the weights disagree: fix the config, or export the "
                              "model again")
    expected = spec_tensor_names(spec)
    expected += [n for n in spec_optional_tensor_names(spec) if n in by_name]
    expert_names = spec_expert_tensor_names(spec)
    required = expected + [n for layer in expert_names.values() for expert in layer for n in expert]
    missing = [n for n in required if n not in by_name]
    if missing == ["lm_head.weight"]:
        raise ConversionError(
            f"{src} has no lm_head.weight, but its config says tie_word_embeddings false; if the model shares its "
            "embeddings with the LM head, set tie_word_embeddings true in the config")
    if missing:
        raise ConversionError(
            f"{src} lacks {len(missing)} tensors the {spec.model_type} config requires, e.g. {missing[:3]}"
        )
    if spec.tie_word_embeddings:
        by_name.pop("lm_head.weight", None)  # a copy of the embeddings (_untie_differing_lm_head checked it)
    unexpected = sorted(set(by_name) - set(required) - _configured_away(by_name, set(required)))
    if unexpected:
        raise ConversionError(
            f"{src} holds tensors the {spec.model_type} config does not describe, e.g. {unexpected[:3]}"
        )
    _check_shapes(spec, src, [by_name[n] for n in required])
    experts = {layer: [[by_name[n] for n in expert] for expert in names] for layer, names in expert_names.items()}
    return [by_name[n] for n in expected], experts


def _check_special_ids(source: SourceModel, spec: LlamaSpec) -> None:
    """The special token ids a source names beside its config (generation_config.json's) are tokens of the
    model; checked once the tensors confirmed vocab_size."""
    for key, (where, ids) in source.tokenizer.special_ids.items():
        problem = tokens_outside_vocab(key, ids, spec.vocab_size)
        if problem:
            raise ConversionError(f"{where}: {problem}")


def _check_tokenizer_ids(source: SourceModel, spec: LlamaSpec, src: str) -> None:
    """Every id the tokenizer produces is a row of the embeddings: a prompt that held a larger one would be
    refused at run time, and a generation could never stop at such an end-of-turn token."""
    if not source.tokenizer.tokenizer_json:
        return
    token_id, token = _largest_token_id(source.tokenizer.tokenizer_json)
    if token_id >= spec.vocab_size:
        where = (os.path.join(src, "tokenizer.json") if os.path.isdir(src)
                 else f"{src} (its 'tokenizer.ggml.tokens')" if os.path.isfile(src) else f"{src} (its tokenizer)")
        raise ConversionError(f"{where}: token {clipped(repr(token))} has id {token_id}, but the model's vocab_size is "
                              f"{spec.vocab_size}: no embedding holds it; the tokenizer and the weights disagree: "
                              "convert the model with the tokenizer that came with its weights")


def _largest_token_id(tokenizer_json: str) -> tuple[int, str]:
    """The largest id a tokenizer produces, and its token: of its vocabulary, its added tokens, and the special
    tokens its post-processor adds around every text (a template names their ids itself)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    framed = tokenizer.encode("", add_special_tokens=True)
    ids = [(token_id, token) for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items()]
    return max([*ids, *zip(framed.ids, framed.tokens)], default=(-1, ""))


def _configured_away(by_name: dict[str, SourceTensor], required: set[str]) -> set[str]:
    """Tensors of blocks a config sizes to nothing, which transformers still saves: zero-size weights
    (n_shared_experts 0, shared_expert_intermediate_size 0), and the gate of such a shared expert,
    which scales its zero output. Nothing to store or compute."""
    empty = {name for name, tensor in by_name.items() if name not in required and 0 in tensor.shape}
    gates = {name for name in by_name if name.endswith("mlp.shared_expert_gate.weight") and name not in required
             and name.replace("shared_expert_gate.weight", "shared_expert.down_proj.weight") in empty}
    return empty | gates


def _check_shapes(spec: LlamaSpec, src: str, tensors: list[SourceTensor]) -> None:
    """Every tensor's shape (matrices [out, in], as the converter reads them; a GGUF file lists its
    dimensions the other way round) against the one the config gives it, before anything is written."""
    problems = shape_mismatches(spec, {t.name: t.shape for t in tensors})
    if not problems:
        return
    more = f" ({len(problems) - 1} more tensors disagree too)" if len(problems) > 1 else ""
    order = " (numpy order [out, in]; GGUF lists the dimensions reversed)" if os.path.isfile(src) else ""
    raise ConversionError(f"{src}: {problems[0]}{order}{more}; the config and the weights disagree: fix the config, "
                          "or export the model again")


def _write_experts(source: SourceModel, plan: QuantPlan, experts: dict[int, list[list[SourceTensor]]],
                   path: str, compression: str | None, progress: bool) -> tuple[dict, list[TensorReport]]:
    """Write every routed expert into the expert file at `path`, one tensor in memory at a time.

    Returns the manifest's "experts" entry and a report per expert projection."""
    reports: list[TensorReport] = []
    with ExpertFileWriter(path, compression) as writer:
        for layer, layer_experts in experts.items():
            schemes = dict(zip(PROJECTIONS, (plan.scheme_for(t) for t in layer_experts[0])))
            shapes = {proj: tuple(t.shape) for proj, t in zip(PROJECTIONS, layer_experts[0])}
            for expert in layer_experts:
                for proj, t in zip(PROJECTIONS, expert):
                    if tuple(t.shape) != shapes[proj] or plan.scheme_for(t) != schemes[proj]:
                        raise ConversionError(
                            f"{t.name}: shape {t.shape} / scheme {plan.scheme_for(t)} differs from expert 0's "
                            f"{shapes[proj]} / {schemes[proj]}; every expert of a layer must share them")
            writer.add_layer(layer, ExpertLayout.plan(schemes, shapes), len(layer_experts))
            for index, expert in enumerate(tqdm(layer_experts, desc=f"experts of layer {layer}", unit="expert",
                                                disable=not progress, leave=False)):
                stored = {}
                for proj, t in zip(PROJECTIONS, expert):
                    value, lossless, max_abs, rel_rms = _to_scheme(source.load(t.name), schemes[proj], t.name)
                    stored[proj] = value
                    source.release(t.name)
                    bytes_out = (sum(a.nbytes for a in value.to_arrays("").values())
                                 if isinstance(value, QuantizedTensor) else value.nbytes)
                    reports.append(TensorReport(t.name, t.source_format, str(schemes[proj]), t.shape, t.nbytes,
                                                bytes_out, lossless, max_abs, rel_rms))
                writer.write(layer, index, stored)
    return writer.entry(), reports


def _manifest(source: SourceModel, spec, reports: list[TensorReport], schemes: dict[str, Scheme],
              weights_path: str, experts_entry: dict | None = None) -> dict:
    def tensor_entry(r: TensorReport) -> dict:
        arrays = ckpt.stored_arrays(r.name, schemes[r.name], r.shape)
        return {"scheme": r.scheme, "shape": list(r.shape), "file": ckpt.WEIGHTS, "class": tensor_class(r.name),
                "source_format": r.source_format,
                "arrays": {key: {"dtype": NUMPY_TO_SAFETENSORS[dtype], "shape": list(shape)}
                           for key, (dtype, shape) in arrays.items()},
                "max_abs_error": r.max_abs_error, "rel_rms_error": r.rel_rms_error}

    files = {ckpt.WEIGHTS: {"bytes": os.path.getsize(weights_path), "sha256": ckpt.sha256_file(weights_path)}}
    manifest = {
        "format": ckpt.FORMAT,
        "format_version": ckpt.FORMAT_VERSION,
        "source": source.description,
        "model": spec.to_dict(),
        "tokenizer": {"file": ckpt.TOKENIZER if source.tokenizer.tokenizer_json else None,
                      **source.tokenizer.config},
        "tensors": {r.name: tensor_entry(r) for r in reports},
        "files": files,
    }
    # A source that derives its model (MoEfication) records how, e.g. {"moefy": {...}}.
    manifest.update(getattr(source, "manifest_extra", None) or {})
    if experts_entry is not None:
        manifest["experts"] = experts_entry
        experts_path = os.path.join(os.path.dirname(weights_path), experts_entry["file"])
        files[experts_entry["file"]] = {"bytes": os.path.getsize(experts_path),
                                        "sha256": ckpt.sha256_file(experts_path)}
    return ckpt.sealed(manifest)


def convert(src: str | SourceModel, out: str, plan: QuantPlan | None = None, force: bool = False,
            progress: bool = True, compress_experts: bool = False) -> ConversionSummary:
    """Convert SRC into a checkpoint at OUT, atomically; a MoE model's routed experts go to experts.bin
    (each record zstd-compressed with `compress_experts`).

    SRC is a path, or an opened SourceModel (e.g. a MoEfied view of a dense model), closed at the end."""
    plan = plan or QuantPlan()
    out = output.check_output(out, force, (src,) if isinstance(src, (str, os.PathLike)) else ())
    started = time.perf_counter()
    source = open_source(os.fspath(src)) if isinstance(src, (str, os.PathLike)) else src
    src = src if isinstance(src, (str, os.PathLike)) else source.description
    try:
        spec = _untie_differing_lm_head(source, _source_spec(source, src), src)
        tensors, experts = _tensors_in_checkpoint_order(source, spec, src)
        _check_special_ids(source, spec)
        _check_tokenizer_ids(source, spec, src)
        schemes = {t.name: plan.scheme_for(t) for t in tensors}
        layout: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
        for t in tensors:
            layout.update(ckpt.stored_arrays(t.name, schemes[t.name], t.shape))

        reports: list[TensorReport] = []
        with output.StagingDirectory(out, force=force) as staging:
            weights_path = os.path.join(staging.path, ckpt.WEIGHTS)
            with SafetensorsWriter(weights_path, layout, metadata={"format": "zllm"}) as writer:
                for t in tqdm(tensors, desc="converting", unit="tensor", disable=not progress, leave=False):
                    scheme = schemes[t.name]
                    arrays, lossless, max_abs, rel_rms = _encode(source.load(t.name), t, scheme)
                    for key, array in arrays.items():
                        writer.write(key, array)
                    source.release(t.name)
                    bytes_out = sum(a.nbytes for a in arrays.values())
                    reports.append(TensorReport(t.name, t.source_format, str(scheme), t.shape, t.nbytes,
                                                bytes_out, lossless, max_abs, rel_rms))
            experts_entry = None
            if experts:
                experts_entry, expert_reports = _write_experts(
                    source, plan, experts, os.path.join(staging.path, EXPERTS_FILE),
                    "zstd" if compress_experts else None, progress)
            if source.tokenizer.tokenizer_json:
                with open(os.path.join(staging.path, ckpt.TOKENIZER), "w", encoding="utf-8") as f:
                    f.write(source.tokenizer.tokenizer_json)
            with open(os.path.join(staging.path, ckpt.MANIFEST), "w", encoding="utf-8") as f:
                json.dump(_manifest(source, spec, reports, schemes, weights_path, experts_entry), f, indent=1)
            staging.commit()
            if experts_entry is not None:
                reports += expert_reports
    except SafetensorsFormatError as exc:
        raise ConversionError(str(exc)) from None
    except OSError as exc:  # a full disk, an I/O error: the staging directory is gone, OUT untouched
        raise ConversionError(f"converting {src} into {out} failed: {exc.strerror or exc} ({exc.filename or out}); "
                              "nothing was written") from None
    finally:
        source.close()
    return ConversionSummary(out, reports, time.perf_counter() - started)
