"""MoEfication as a tool: convert a dense Llama into a Mixture-of-Experts checkpoint by running it.

The conversion itself (splitting each FFN into experts, fitting routers, writing the checkpoint) is
converters/moefy*.py; this layer loads the dense model those steps calibrate on, so converters/
never runs a model of its own.
"""
from __future__ import annotations

import os
import tempfile
import time

from tqdm import tqdm

from converters.checkpoint import check_output
from converters.convert import QuantPlan, convert, open_source
from converters.moefy import (
    CALIBRATION_TOKENS,
    DEFAULT_MOEFY,
    HELDOUT_TOKENS,
    SENSITIVITY_TOKENS,
    MoefiedSource,
    MoefySetting,
    MoefySummary,
    active_fraction,
    check_expert_groups,
    check_moefy_source,
    check_setting,
    most_sensitive_layers,
    parse_dense_layers,
    resolve_dense_layers,
)
from converters.moefy_calibrate import (
    WINDOW,
    capture_ffn_inputs,
    dense_ffn,
    evaluate,
    ffn_norm_weights,
    token_windows,
    topic_texts,
)
from converters.moefy_fit import moefy_layer
from edge.api import load
from edge.core.errors import ConversionError
from edge.core.spec import spec_from_dict


def moefy_convert(src: str, out: str, experts: int | None = None, top_k: int | None = None,
                  dense_layers=None, plan: QuantPlan | None = None, force: bool = False, progress: bool = True,
                  compress_experts: bool = False, calibration_tokens: int = CALIBRATION_TOKENS,
                  heldout_tokens: int = HELDOUT_TOKENS) -> MoefySummary:
    """MoEfy the dense Llama at SRC (GGUF file or HF folder) into a llama_moe checkpoint at OUT.

    experts/top_k default to DEFAULT_MOEFY's (both or neither); dense_layers: None for the
    default's, layer ids, or "auto:N". heldout_tokens=0 skips the held-out evaluation."""
    started = time.perf_counter()
    if (experts is None) != (top_k is None):
        raise ConversionError("--moefy takes both E and K (E:K), or neither for the default")
    experts = DEFAULT_MOEFY.experts if experts is None else experts
    top_k = DEFAULT_MOEFY.top_k if top_k is None else top_k
    dense_layers = DEFAULT_MOEFY.dense_layers if dense_layers is None else dense_layers
    if isinstance(dense_layers, str):
        dense_layers = parse_dense_layers(dense_layers)
    if plan is None:
        plan = QuantPlan(weights="int8" if os.path.isdir(src) else "source")
    out = check_output(out, force, (src,))

    source = open_source(src)
    try:
        spec = spec_from_dict(source.config)
        check_moefy_source(spec, src)
        check_setting(spec, experts, top_k)
        down = next(t for t in source.tensors() if t.name.endswith(".mlp.down_proj.weight"))
        check_expert_groups(spec, experts, top_k, plan, down.source_format)
        num_layers = spec.num_hidden_layers
        auto_dense = int(dense_layers.split(":")[1]) if isinstance(dense_layers, str) else None
        if auto_dense is not None and auto_dense >= num_layers:
            raise ConversionError(f"--moefy-dense-layers auto:{auto_dense} keeps every layer of {num_layers} dense")
        fixed_dense = () if auto_dense is not None else resolve_dense_layers(dense_layers, num_layers)

        with tempfile.TemporaryDirectory(prefix="zllm-moefy-") as scratch:
            dense_path = os.path.join(scratch, "dense")
            convert(src, dense_path, QuantPlan(weights="source"), progress=False)
            model = load(dense_path, device="cpu")
            try:
                if model.tokenizer is None:
                    raise ConversionError(f"{src} has no tokenizer; --moefy calibrates on text and needs one")
                fits, extra, summary_parts = _calibrate_and_fit(
                    model, spec, experts, top_k, fixed_dense, auto_dense, calibration_tokens, heldout_tokens,
                    progress)
            finally:
                model.close()
    except BaseException:
        source.close()
        raise
    dense = tuple(layer for layer in range(num_layers) if layer not in fits)
    extra["moefy"]["dense_layers"] = list(dense)
    moefied = MoefiedSource(source, spec, experts, top_k, dense, fits, extra)
    conversion = convert(moefied, out, plan, force=force, progress=progress, compress_experts=compress_experts)
    return MoefySummary(conversion, MoefySetting(experts, top_k, dense),
                        active_fraction(num_layers, experts, top_k, dense), seconds=time.perf_counter() - started,
                        **summary_parts)


def _calibrate_and_fit(model, spec, experts, top_k, fixed_dense, auto_dense, calibration_tokens, heldout_tokens,
                       progress):
    """Fit every MoE layer on calibration text; evaluate on held-out text. -> (fits, manifest extra, summary fields)"""
    num_layers = spec.num_hidden_layers
    tensors = model.checkpoint.tensors
    calibration_texts, heldout_texts = topic_texts()
    sensitivity_tokens = SENSITIVITY_TOKENS if auto_dense else 0
    window = min(WINDOW, spec.max_position_embeddings)
    windows = token_windows(model.encode, calibration_texts, calibration_tokens + sensitivity_tokens, window)
    fit_count = max(1, len(windows) - sensitivity_tokens // window) if windows else 0
    fit_windows, sensitivity_windows = windows[:fit_count], windows[fit_count:]
    if not fit_windows:
        raise ConversionError("the calibration text produced no full window of tokens; the tokenizer looks broken")
    with tqdm(total=len(fit_windows), desc="calibration", unit="window", disable=not progress, leave=False) as bar:
        inputs = capture_ffn_inputs(model.transformer, fit_windows, bar)
    candidates = [layer for layer in range(num_layers) if layer not in fixed_dense]
    ffns = {layer: dense_ffn(tensors, layer) for layer in range(num_layers)}
    fits = {}
    for layer in tqdm(candidates, desc="clustering experts", unit="layer", disable=not progress, leave=False):
        fits[layer] = moefy_layer(ffns[layer], inputs[layer], experts, top_k)
    del inputs
    if auto_dense:
        for layer in most_sensitive_layers(model.transformer, ffns, fits, top_k, sensitivity_windows, auto_dense,
                                           progress):
            del fits[layer]
    calibration = {"text": "pydoc_data.topics", "tokens": sum(len(w) for w in fit_windows)}
    moefy = {"experts": experts, "top_k": top_k, "calibration": calibration,
             "clustering": {str(layer): fit.clustering for layer, fit in fits.items()},
             "validation_error": {str(layer): round(fit.validation_error, 4) for layer, fit in fits.items()}}
    parts = dict(calibration_tokens=calibration["tokens"], heldout_tokens=0, dense_perplexity=None,
                 moe_perplexity=None, clustering=dict(moefy["clustering"]))
    heldout = token_windows(model.encode, heldout_texts, heldout_tokens, window) if heldout_tokens else []
    if heldout:
        norms = ffn_norm_weights(tensors, num_layers)
        with tqdm(total=2 * len(heldout), desc="held-out evaluation", unit="window", disable=not progress,
                  leave=False) as bar:
            dense_eval = evaluate(model.transformer, ffns, {}, top_k, heldout, progress=bar)
            moe_eval = evaluate(model.transformer, ffns, fits, top_k, heldout, norms, progress=bar)
        routing = moe_eval.routing.to_dict(top_k)
        parts.update(heldout_tokens=moe_eval.tokens, dense_perplexity=dense_eval.perplexity,
                     moe_perplexity=moe_eval.perplexity, routing=routing)
        moefy["heldout"] = {"text": "pydoc_data.topics", "tokens": moe_eval.tokens,
                            "dense_perplexity": dense_eval.perplexity, "moe_perplexity": moe_eval.perplexity}
        moefy["routing"] = routing
    return fits, {"moefy": moefy}, parts

