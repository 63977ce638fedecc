"""Peak memory of `zllm-edge convert` against model size and largest tensor.

Writes a random Llama-shaped Hugging Face folder (sharded safetensors with an index) far
larger than its largest tensor, converts it in a child process, and reports the child's peak
RSS next to the model's total and largest-tensor sizes.

    python benchmarks/convert_memory.py [--layers 20] [--hidden 1024] [--weights int8] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from safetensors.numpy import save_file

from report import publish


def write_random_llama(folder: str, layers: int, hidden: int, intermediate: int, vocab: int, shards: int) -> dict:
    config = {
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": hidden // 64, "num_key_value_heads": hidden // 64,
        "vocab_size": vocab, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    }
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            **{p + f"self_attn.{n}_proj.weight": (hidden, hidden) for n in "qkvo"},
            p + "mlp.gate_proj.weight": (intermediate, hidden), p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate),
        })
    names = list(shapes)
    weight_map = {}
    for s in range(shards):
        filename = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: (rng.standard_normal(shapes[n], dtype=np.float32) * 0.02) for n in part},
                  os.path.join(folder, filename))
        weight_map.update({n: filename for n in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    sizes = [int(np.prod(s)) * 4 for s in shapes.values()]
    return {"total_bytes": sum(sizes), "largest_tensor_bytes": max(sizes), "tensors": len(sizes)}


def child_peak_rss(code: str) -> int:
    """Run code in a fresh interpreter and return its peak RSS (VmHWM, which exec resets,
    unlike ru_maxrss, which a forked child inherits from this large parent)."""
    probe = code + "\nprint([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])"
    done = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True)
    return int(done.stdout.strip().splitlines()[-1]) * 1024


def measure_conversion(src: str, out: str, weights: str) -> dict:
    """`zllm-edge convert SRC OUT --weights W` in a child process: its time, its peak RSS, and the peak
    RSS of a child that only imports what conversion imports (the interpreter's baseline)."""
    started = time.perf_counter()
    peak = child_peak_rss(f"from edge.cli import main; status = main(['convert', {src!r}, {out!r}, "
                          f"'--weights', {weights!r}, '--quiet'])\nassert status == 0, status")
    seconds = time.perf_counter() - started
    baseline = child_peak_rss("import edge.cli, converters.convert, converters.hf_source, converters.gguf_source")
    return {"weights": weights, "convert_seconds": round(seconds, 2), "peak_rss_bytes": peak,
            "import_baseline_rss_bytes": baseline}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--weights", default="int8")
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "src"), os.path.join(tmp, "out")
        os.makedirs(src)
        print(f"writing a random {args.layers}-layer Llama ...", file=sys.stderr)
        model = write_random_llama(src, args.layers, args.hidden, args.intermediate, args.vocab, args.shards)
        measured = measure_conversion(src, out, args.weights)
    seconds, peak, baseline = (measured[k] for k in ("convert_seconds", "peak_rss_bytes", "import_baseline_rss_bytes"))
    result = {**model, **measured, "model_over_largest": round(model["total_bytes"] / model["largest_tensor_bytes"], 1),
              "peak_over_largest": round(peak / model["largest_tensor_bytes"], 2),
              "peak_above_baseline_over_largest": round((peak - baseline) / model["largest_tensor_bytes"], 2)}
    print(f"{'model total':32s} {model['total_bytes'] / 1e6:10.1f} MB")
    print(f"{'largest tensor':32s} {model['largest_tensor_bytes'] / 1e6:10.1f} MB")
    print(f"{'peak RSS of convert':32s} {peak / 1e6:10.1f} MB")
    print(f"{'RSS after imports alone':32s} {baseline / 1e6:10.1f} MB")
    print(f"{'(peak - imports) / largest':32s} {result['peak_above_baseline_over_largest']:10.2f}")
    print(f"{'conversion time':32s} {seconds:10.1f} s")
    publish(result, args.json)


if __name__ == "__main__":
    main()
