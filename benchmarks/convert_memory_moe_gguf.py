"""Peak memory of `zllm-edge convert` on a MoE GGUF against its stacked expert tensors.

Writes a random Qwen3-MoE GGUF whose routed experts are stacked as llama.cpp stores them
(blk.L.ffn_{gate,up,down}_exps, Q8_0, each stack far larger than one expert), converts it in a
child process, and reports the child's peak RSS next to the largest stack and one expert's size:
the converter reads one expert's slice of a stack at a time, so peak memory follows the expert,
not the stack.

    python benchmarks/convert_memory_moe_gguf.py [--layers 4] [--experts 32] [--hidden 1024]
        [--expert-intermediate 768] [--weights source] [--json FILE]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import gguf
import numpy as np

from report import publish

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from convert_memory import measure_conversion  # noqa: E402

Q8_0 = gguf.GGMLQuantizationType.Q8_0


def write_random_moe_gguf(path: str, layers: int, experts: int, hidden: int, intermediate: int, vocab: int) -> dict:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "qwen3moe")
    heads = hidden // 64
    for add, value in ((writer.add_block_count, layers), (writer.add_context_length, 2048),
                       (writer.add_embedding_length, hidden), (writer.add_feed_forward_length, intermediate),
                       (writer.add_head_count, heads), (writer.add_head_count_kv, heads), (writer.add_key_length, 64),
                       (writer.add_value_length, 64), (writer.add_layer_norm_rms_eps, 1e-6),
                       (writer.add_vocab_size, vocab), (writer.add_expert_count, experts),
                       (writer.add_expert_used_count, 2), (writer.add_expert_feed_forward_length, intermediate)):
        add(value)
    writer.add_tokenizer_model("gpt2")  # a placeholder vocabulary: the benchmark measures weights
    writer.add_token_list(["a", "b", "ab"] + [f"<t{i}>" for i in range(vocab - 3)])
    writer.add_token_merges(["a b"])
    sizes = {}

    def add(name: str, shape: tuple[int, ...], quantized: bool) -> None:
        values = rng.standard_normal(shape, dtype=np.float32) * 0.02
        if quantized:
            data = gguf.quants.quantize(values, Q8_0)
            writer.add_tensor(name, data, raw_dtype=Q8_0)
        else:
            data = values
            writer.add_tensor(name, values)
        sizes[name] = data.nbytes

    add("token_embd.weight", (vocab, hidden), True)
    add("output_norm.weight", (hidden,), False)
    add("output.weight", (vocab, hidden), True)
    for layer in range(layers):
        p = f"blk.{layer}."
        for norm in ("attn_norm", "ffn_norm"):
            add(p + norm + ".weight", (hidden,), False)
        for norm in ("attn_q_norm", "attn_k_norm"):
            add(p + norm + ".weight", (64,), False)
        for proj in ("attn_q", "attn_k", "attn_v", "attn_output"):
            add(p + proj + ".weight", (hidden, hidden), True)
        add(p + "ffn_gate_inp.weight", (experts, hidden), False)
        add(p + "ffn_gate_exps.weight", (experts, intermediate, hidden), True)
        add(p + "ffn_up_exps.weight", (experts, intermediate, hidden), True)
        add(p + "ffn_down_exps.weight", (experts, hidden, intermediate), True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    largest_stack = max(v for k, v in sizes.items() if "_exps" in k)
    return {"total_bytes": sum(sizes.values()), "largest_stack_bytes": largest_stack,
            "expert_bytes": 3 * largest_stack // experts, "tensors": len(sizes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--expert-intermediate", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--weights", default="source")
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "moe.gguf"), os.path.join(tmp, "out")
        print(f"writing a random {args.layers}-layer, {args.experts}-expert Qwen3-MoE GGUF ...", file=sys.stderr)
        model = write_random_moe_gguf(src, args.layers, args.experts, args.hidden, args.expert_intermediate,
                                      args.vocab)
        measured = measure_conversion(src, out, args.weights)
    seconds, peak, baseline = (measured[k] for k in ("convert_seconds", "peak_rss_bytes", "import_baseline_rss_bytes"))
    result = {**model, **measured,
              "peak_above_baseline_over_largest_stack": round((peak - baseline) / model["largest_stack_bytes"], 2)}
    print(f"{'model total':32s} {model['total_bytes'] / 1e6:10.1f} MB")
    print(f"{'largest expert stack':32s} {model['largest_stack_bytes'] / 1e6:10.1f} MB")
    print(f"{'one expert (gate+up+down)':32s} {model['expert_bytes'] / 1e6:10.1f} MB")
    print(f"{'peak RSS of convert':32s} {peak / 1e6:10.1f} MB")
    print(f"{'RSS after imports alone':32s} {baseline / 1e6:10.1f} MB")
    print(f"{'(peak - imports) / largest stack':32s} {result['peak_above_baseline_over_largest_stack']:10.2f}")
    print(f"{'conversion time':32s} {seconds:10.1f} s")
    publish(result, args.json)


if __name__ == "__main__":
    main()
