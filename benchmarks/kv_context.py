"""KV cache at long context on the CPU backend: decode tokens/s per cache format at 256, 2048 and
8192 tokens of context, KV bytes per token per format and attention family, and the logit error
int8 K/V adds.

    python benchmarks/kv_context.py [CHECKPOINT] [--contexts 256,2048,8192] [--steps 16]
                                    [--threads N] [--json results.json]

CHECKPOINT defaults to SmolLM2-135M-Instruct (context 8192, 30 layers, GQA 9/3 heads of 64).

What is measured, honestly:
- The context is built by a chunked f32 prefill (512 tokens per call) of a repeated English text,
  up to --real-prefill tokens (default 2048; a real 8192-token prefill takes ~10 minutes on two
  busy cores); beyond that the cache is filled by repeating the prefilled positions' K/V rows
  (a decode step's work does not depend on the values it reads), and the token history is
  extended with the same token ids. The JSON says how many positions were real.
- For f16 and int8 the f32 K/V of those positions are written into a cache of that format
  (quantized on write, as a prefill would store them; the later layers' K/V therefore come from
  f32 activations, a small difference from a prefill through the lossy cache that does not change
  the work a decode step does).
- Decode: `steps` greedy decode calls after the context (after one warm-up call), wall clock
  around the calls; the median step time is reported as tokens/s. The f32 and f16 caches run the
  fused executor (attention reading the stored f16 values directly); int8 runs op by op on the
  same Numba kernels, attention reading the codes and scales directly
  (kernels/cpu/attention_stored.py).
- int8 logit error: max over positions of max |logits_int8 - logits_f32| / max |logits_f32|, a
  256-token prefill through each cache.
The machine's load average is printed: on a shared machine other processes steal cores.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
from report import publish

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import edge  # noqa: E402
from edge.core.kv import (
    KV_FORMATS,  # noqa: E402
    cache_slots,  # noqa: E402
)
from edge.core.spec import spec_from_dict  # noqa: E402
from edge.home import default_model_checkpoint  # noqa: E402

TEXT = (
    "The history of the city begins with a small settlement on the banks of the river, where fishermen and "
    "traders built wooden houses and a market square. Over the centuries the town grew into a centre of "
    "commerce: merchants brought spices, cloth and salt from distant ports, and craftsmen opened workshops "
    "along the narrow streets. "
)
CHUNK = 512

# Attention families for the bytes-per-token table (HF config fields; only attention matters here).
FAMILIES = {
    "SmolLM2-135M (GQA 9/3 x 64)": dict(model_type="llama", hidden_size=576, num_hidden_layers=30,
                                        num_attention_heads=9, num_key_value_heads=3),
    "  same as MHA (9 KV heads)": dict(model_type="llama", hidden_size=576, num_hidden_layers=30,
                                       num_attention_heads=9, num_key_value_heads=9),
    "Llama-3-8B (GQA 32/8 x 128)": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32,
                                        num_attention_heads=32, num_key_value_heads=8),
    "Mistral-7B sliding 4096, per token <= window": dict(model_type="mistral", hidden_size=4096,
                                                         num_hidden_layers=32, num_attention_heads=32,
                                                         num_key_value_heads=8, sliding_window=4096),
    "DeepSeek-V2-Lite (MLA, C 512 + R 64)": dict(model_type="deepseek_v2", hidden_size=2048, num_hidden_layers=27,
                                                 num_attention_heads=16, kv_lora_rank=512, q_lora_rank=None,
                                                 qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    "  same heads as MHA (16 x (192 K + 128 V))": None,  # computed from the MLA spec
}


def family_bytes() -> dict:
    table = {}
    for name, config in FAMILIES.items():
        if config is None:  # MHA equivalent of DeepSeek-V2-Lite: per-head K [Dn + R] and V [Dv]
            spec = spec_from_dict(FAMILIES["DeepSeek-V2-Lite (MLA, C 512 + R 64)"])
            per_value = {"f32": 4, "f16": 2, "int8": 1 + 2 / 32}
            width = spec.num_attention_heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim + spec.v_head_dim)
            table[name] = {fmt: round(spec.num_hidden_layers * width * per_value[fmt]) for fmt in KV_FORMATS}
            continue
        spec = spec_from_dict(config)
        table[name] = {fmt: sum(s.bytes_per_token for s in cache_slots(spec, fmt, 1 << 20, True)) for fmt in KV_FORMATS}
    return table


def copy_context(source, target) -> None:
    """Write the source session's K/V (f32) into the target's cache (its format) and history."""
    length = source.cache.length
    for src_buffers, dst_buffers in zip(source.cache.layers, target.cache.layers):
        for src, dst in zip(src_buffers, dst_buffers):
            dst[0:length] = src[0:length]
    target.cache.length = length
    target.tokens = list(source.tokens)


def repeat_positions(session, length: int) -> None:
    """Grow a session's cache to `length` positions by repeating the rows it holds (benchmark only)."""
    held = session.cache.length
    for buffers in session.cache.layers:
        for buffer in buffers:
            for begin in range(held, length, held):
                end = min(length, begin + held)
                buffer[begin:end] = buffer[0:end - begin]
    session.tokens += [session.tokens[i % held] for i in range(held, length)]
    session.cache.length = length


def decode_rate(session, steps: int) -> float:
    token = 42
    session.decode(token)  # warm-up: scratch buffers for this context
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = session.decode(token)
        times.append(time.perf_counter() - start)
        token = int(np.argmax(logits))
    return 1.0 / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", nargs="?")
    parser.add_argument("--contexts", default="256,2048,8192")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--real-prefill", type=int, default=2048,
                        help="positions built by a real prefill; the rest repeat their K/V")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--json")
    args = parser.parse_args()
    path = args.checkpoint or default_model_checkpoint()
    contexts = [int(c) for c in args.contexts.split(",")]
    models = {fmt: edge.load(path, device="cpu", threads=args.threads, kv_cache=fmt) for fmt in KV_FORMATS}
    spec = models["f32"].spec
    capacity = min(spec.max_position_embeddings, max(contexts) + args.steps + 2)
    ids = models["f32"].encode(TEXT * (1 + capacity // 50))
    builder = models["f32"].session(capacity)
    sessions = {fmt: model.session(capacity) for fmt, model in models.items() if fmt != "f32"}
    print(f"{path}: {spec.model_type}, {spec.num_hidden_layers} layers, load average {os.getloadavg()[0]:.2f}, "
          f"threads {models['f32'].backend.threads}", flush=True)

    decode = []
    for context in contexts:
        if context > capacity - args.steps - 1:
            # the decode steps need room: at the model's limit, measure the last steps before it
            print(f"  context {context}: {args.steps + 1} decode steps need room, measuring from "
                  f"{capacity - args.steps - 1} (the model has {spec.max_position_embeddings} positions)")
            context = capacity - args.steps - 1
        builder.reset()
        started = time.perf_counter()
        real = min(context, args.real_prefill)
        for begin in range(0, real, CHUNK):
            builder.prefill(ids[begin:min(real, begin + CHUNK)])
        repeat_positions(builder, context)
        build_seconds = time.perf_counter() - started
        row = {"context": context, "real_prefill": real, "build_seconds": round(build_seconds, 2)}
        for fmt in ("f16", "int8"):
            copy_context(builder, sessions[fmt])
        for fmt in KV_FORMATS:
            session = builder if fmt == "f32" else sessions[fmt]
            row[f"{fmt}_tok_s"] = round(decode_rate(session, args.steps), 2)
            row[f"{fmt}_kv_mib"] = round(session.cache.nbytes_used / 2**20, 2)
            if fmt != "f32":
                session.reset()
        decode.append(row)
        print(f"  context {context} ({real} prefilled): built in {build_seconds:.1f} s, "
              + ", ".join(f"{fmt} {row[f'{fmt}_tok_s']} tok/s" for fmt in KV_FORMATS), flush=True)
        builder.reset()

    prompt = ids[:256]
    f32_logits = models["f32"].session(256).prefill(prompt, all_logits=True)
    errors = {}
    for fmt in ("f16", "int8"):
        logits = models[fmt].session(256).prefill(prompt, all_logits=True)
        per_position = np.abs(logits - f32_logits).max(axis=1) / np.abs(f32_logits).max(axis=1)
        errors[fmt] = {"max_relative": float(per_position.max()), "mean_relative": float(per_position.mean()),
                       "argmax_agreement": float(np.mean(logits.argmax(1) == f32_logits.argmax(1)))}

    families = family_bytes()
    print("\ndecode tokens/s on the cpu backend (median of %d steps; KV MiB in use)" % args.steps)
    print(f"{'context':>8} | " + " | ".join(f"{fmt + ' tok/s':>11} {'MiB':>7}" for fmt in KV_FORMATS))
    for row in decode:
        print(f"{row['context']:>8} | " + " | ".join(f"{row[f'{fmt}_tok_s']:>11} {row[f'{fmt}_kv_mib']:>7}"
                                                     for fmt in KV_FORMATS))
    print("\nKV bytes per token (all layers)")
    print(f"{'family':<48} | " + " | ".join(f"{fmt:>8}" for fmt in KV_FORMATS))
    for name, row in families.items():
        print(f"{name:<48} | " + " | ".join(f"{row[fmt]:>8}" for fmt in KV_FORMATS))
    print("\nlogit error vs f32 K/V (256-token prefill, relative to each position's largest logit)")
    for fmt, error in errors.items():
        print(f"  {fmt}: max {error['max_relative']:.2e}, mean {error['mean_relative']:.2e}, "
              f"argmax agreement {error['argmax_agreement']:.3f}")
    result = {"checkpoint": path, "threads": models["f32"].backend.threads, "load_average": os.getloadavg()[0],
              "decode": decode, "kv_bytes_per_token": families, "logit_error": errors}
    publish(result, args.json)


if __name__ == "__main__":
    main()
