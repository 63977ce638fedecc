"""The `zllm-edge` command line."""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import threading

from edge.core.errors import InvalidArgumentError, ZllmError
from streaming.options import EXPERT_ENGINES, IO_ENGINES


def _add_quant_args(p: argparse.ArgumentParser) -> None:
    from converters.convert import GROUP_SIZES, TENSOR_CLASSES, WEIGHT_CHOICES

    p.add_argument("--weights", default=None,
                   help=f"weight format: {', '.join(WEIGHT_CHOICES)} or a full scheme such as int4_affine_g64 "
                        "(default: source for GGUF, int8 for Hugging Face folders; a bare int4/int8 keeps GGUF "
                        "blocks of that width (Q4_0/Q4_1/Q4_K; Q8_0/Q5_x/IQ4_x) as they are, a full scheme "
                        "requantizes them)")
    p.add_argument("--group-size", type=int, default=32, choices=GROUP_SIZES,
                   help="weights per scale of the int4/int8 tensors this run quantizes (default 32)")
    sym = p.add_mutually_exclusive_group()
    sym.add_argument("--symmetric", dest="symmetric", action="store_true", default=True,
                     help="scale only per group (default)")
    sym.add_argument("--affine", dest="symmetric", action="store_false", help="scale and offset per group")
    for cls in TENSOR_CLASSES:
        p.add_argument(f"--{cls.replace('_', '-')}", dest=f"override_{cls}", default=None, metavar="FORMAT",
                       help=f"format for {cls} tensors (overrides --weights)")


def cmd_convert(args) -> int:
    from converters.convert import TENSOR_CLASSES, QuantPlan, convert

    weights = args.weights if args.weights is not None else ("int8" if os.path.isdir(args.src) else "source")
    overrides = {c: getattr(args, f"override_{c}") for c in TENSOR_CLASSES if getattr(args, f"override_{c}") is not None}
    plan = QuantPlan(weights=weights, group_size=args.group_size, symmetric=args.symmetric, overrides=overrides)
    if args.moefy is not None:
        from converters.moefy import parse_dense_layers, parse_moefy
        from edge.moefy import moefy_convert

        experts, top_k = parse_moefy(args.moefy) if args.moefy else (None, None)
        dense = parse_dense_layers(args.moefy_dense_layers) if args.moefy_dense_layers is not None else None
        moefied = moefy_convert(args.src, args.out, experts, top_k, dense, plan, force=args.force,
                                progress=not args.quiet, compress_experts=args.compress_experts)
        summary = moefied.conversion
        print(moefied.format())
    else:
        if args.moefy_dense_layers is not None:
            raise ZllmError("--moefy-dense-layers applies to --moefy conversions only")
        summary = convert(args.src, args.out, plan, force=args.force, progress=not args.quiet,
                          compress_experts=args.compress_experts)
        print(summary.format())
    if args.report:
        worst = sorted(summary.tensors, key=lambda t: -t.rel_rms_error)
        print(f"\n{'tensor':60s} {'source':>6s} {'scheme':>18s} {'max abs':>10s} {'rel rms':>10s}")
        for t in worst:
            print(f"{t.name:60s} {t.source_format:>6s} {t.scheme:>18s} {t.max_abs_error:10.3e} {t.rel_rms_error:10.3e}")
    return 0


def cmd_inspect(args) -> int:
    from collections import Counter

    from quant.checkpoint import open_checkpoint

    with open_checkpoint(args.checkpoint) as checkpoint:  # files present, tensors as the manifest's spec says
        manifest, spec = checkpoint.manifest, checkpoint.spec
    if args.json:
        print(json.dumps(manifest, indent=1))
        return 0
    print(f"{args.checkpoint}: zllm format {manifest['format_version']}, from {manifest.get('source')}")
    print(f"model: {spec.model_type}, {spec.num_hidden_layers} layers, hidden {spec.hidden_size}, "
          f"heads {spec.num_attention_heads}/{spec.num_key_value_heads} (q/kv), head_dim {spec.head_dim}, "
          f"ffn {spec.intermediate_size}, vocab {spec.vocab_size}, context {spec.max_position_embeddings}, "
          f"tied embeddings {spec.tie_word_embeddings}")
    schemes = Counter((t.get("class", "?"), t["scheme"], _stored_from(t)) for t in manifest["tensors"].values())
    print("schemes:")
    for (cls, scheme, origin), count in sorted(schemes.items()):
        print(f"  {cls:12s} {scheme:26s} x{count:<4d} {origin}".rstrip())
    for name, info in manifest["files"].items():
        print(f"file: {name} {info['bytes'] / 1e6:.1f} MB sha256 {str(info.get('sha256'))[:16]}...")
    if manifest.get("experts"):
        _print_experts(manifest["experts"])
    tok = manifest.get("tokenizer", {})
    print(f"tokenizer: {tok.get('file')}, bos {tok.get('bos_token_id')}, eos {tok.get('eos_token_id')}, "
          f"chat template {'yes' if tok.get('chat_template') else 'no'}")
    return 0


def _stored_from(tensor: dict) -> str:
    """How a manifest tensor was made from its source: "Q4_K kept bit-exact", "Q6_K requantized", "F32 cast"."""
    from quant import Scheme

    source, scheme = tensor.get("source_format"), tensor["scheme"]
    if source is None or source.lower() == scheme:
        return ""
    if tensor.get("max_abs_error") == 0.0:
        return f"{source} kept bit-exact"
    return f"{source} {'requantized' if Scheme.parse(scheme).is_quantized else 'cast'}"


def _print_experts(entry: dict) -> None:
    """One line per MoE layer: expert count, raw and stored bytes per expert, schemes."""
    layers = entry["layers"]
    print(f"experts: {entry['file']}, {len(layers)} MoE layers, compression {entry.get('compression') or 'none'}, "
          f"records aligned to {entry['alignment']} bytes")
    for layer, info in sorted(layers.items(), key=lambda item: int(item[0])):
        stored = [length for _, length, _ in info["records"]]
        schemes = "/".join(p["scheme"] for p in info["projections"].values())
        print(f"  layer {int(layer):3d}: {info['num_experts']} experts, {info['raw_length'] / 1e3:.1f} kB each "
              f"(stored {min(stored) / 1e3:.1f}-{max(stored) / 1e3:.1f} kB), gate/up/down {schemes}")


def cmd_formats(args) -> int:
    from quant import FORMATS

    print(f"{'format':20s} {'block':>5s} {'bytes':>5s} {'bits/weight':>11s}  meaning")
    for info in FORMATS.values():
        print(f"{info.name:20s} {info.block_size:5d} {info.bytes_per_block:5d} {info.bits_per_weight:11.3f}  {info.description}")
    return 0


def _resolve_model(path: str | None, quiet: bool) -> str:
    """MODEL as given: a path, a built-in model's name (edge/home.py BUILTIN_MODELS: converted on first use),
    or nothing for the default model."""
    from edge.home import BUILTIN_MODELS, builtin_checkpoint, default_model_checkpoint

    if path == "":  # an empty word (an unset shell variable) is a mistake, not a request for the default
        raise InvalidArgumentError("MODEL is empty; name a checkpoint directory, or leave MODEL out for the "
                                   "default model")
    if path in BUILTIN_MODELS and not os.path.exists(path):
        return builtin_checkpoint(path, progress=not quiet)
    return path if path is not None else default_model_checkpoint(progress=not quiet)


def _stream(generation, args) -> int:
    if args.json:
        for _ in generation:
            pass
    else:
        for piece in generation:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def _generation_kwargs(args) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                stop=args.stop or None)


def _load_for_text(model_path: str | None, args):
    """generate/chat: check the options (the checks edge.load and generate run themselves) before the
    default model is converted or any model is loaded, then load one that can take text."""
    from edge.generation import GenerationOptions

    GenerationOptions.of(**_generation_kwargs(args))
    if getattr(args, "system", None):
        from edge.api import check_unicode

        check_unicode("--system", args.system)
    return _load_model(model_path, args)


def _load_model(model_path: str | None, args):
    """Load the model the load options (_add_load_args) ask for, checked before the default model is
    converted or any model is loaded; one that cannot take text is refused."""
    import edge
    from edge.options import LoadOptions

    if args.device is None:
        args.device = _default_device(args.quiet)
    if args.device.startswith("cpu") and not args.quiet:
        from kernels.cpu.runtime import compile_progress

        compile_progress.enabled = True  # a first run compiles for a while: say what and how long
    options = LoadOptions.of(device=args.device, threads=args.threads, kv_cache=args.kv_cache,
                             kv_capacity=args.kv_capacity, verify=args.verify, **_memory_options(args))
    path = _resolve_model(model_path, args.quiet)
    model = edge.load(path, options=options)
    if model.tokenizer is None:  # the API takes token ids then; the command line has only text
        model.close()
        raise ZllmError(f"{path} has no tokenizer, so it cannot take text; convert the model from a source that "
                        "has one (a Hugging Face folder with tokenizer.json, or a GGUF file)")
    return model


def _default_device(quiet: bool) -> str:
    from devices.base import fastest_device

    device, why_not_cpu = fastest_device()
    if why_not_cpu is not None and not quiet:
        print(f"running on device 'reference' (the numpy oracle, slow): {why_not_cpu}", file=sys.stderr)
    return device


def cmd_generate(args) -> int:
    if len(args.words) == 1:
        model_path, prompt = None, args.words[0]
    elif len(args.words) == 2:
        model_path, prompt = args.words
    else:
        raise ZllmError("usage: zllm-edge generate [MODEL] PROMPT")
    if not prompt:
        raise ZllmError("the prompt is empty; give the text to continue: zllm-edge generate [MODEL] PROMPT")
    from edge.api import check_unicode

    check_unicode("the text", prompt)  # before the default model is converted or any model loaded
    model = _load_for_text(model_path, args)
    generation = model.generate(prompt, **_generation_kwargs(args))
    _stream(generation, args)
    if args.json:
        r = generation.result
        print(json.dumps({
            "text": r.text, "tokens": r.tokens, "prompt_tokens": r.prompt_tokens,
            "finish_reason": r.finish_reason, "stop_string": r.stop_string, "seed": r.seed,
            "device": model.device_info(),
            "timings": r.timings, "stats": model.stats(),
        }))
    return 0


def cmd_chat(args) -> int:
    from edge.api import check_unicode
    from edge.core.sampling_defaults import SAMPLING_FIELDS
    from edge.sampling import CONVERSATION_SAMPLING, SamplingParams

    # the sampler's fields as generate leaves them (greedy, no filter, no penalty), for those a default omits
    off = {name: getattr(SamplingParams(), name) for name in SAMPLING_FIELDS}
    # chat's sampling flags default to None: the ones given win over the model's conversation sampling
    args.sampling_given = {name: getattr(args, name) for name in SAMPLING_FIELDS if getattr(args, name) is not None}
    for name, value in {**off, **CONVERSATION_SAMPLING, **args.sampling_given}.items():
        setattr(args, name, value)  # checked as given before the model loads; set again once it has
    model = _load_for_text(args.model, args)
    if not model.tokenizer.chat_template:  # refused before the user types a first message, not after it
        model.close()
        raise ZllmError(f"{model.path} has no chat template, so it cannot chat; use zllm-edge generate with a "
                        "plain prompt")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    sampling, origin = model.conversation_sampling()
    for name, value in {**off, **sampling, **args.sampling_given}.items():
        setattr(args, name, value)
    if args.temperature > 0 and args.seed in (None, -1):  # one seed for the conversation, said so it can be repeated
        import numpy as np

        args.seed = int(np.random.SeedSequence().generate_state(1)[0])
    if args.temperature > 0 and not args.quiet:
        given = f"; {', '.join(args.sampling_given)} as given" if args.sampling_given else ""
        print(f"[chat] sampling: temperature {args.temperature:g}, top-k {args.top_k}, top-p {args.top_p:g}, "
              f"min-p {args.min_p:g}, repetition penalty {args.repetition_penalty:g}, seed {args.seed} ({origin}"
              f"{given}; --temperature 0: greedy)", file=sys.stderr, flush=True)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        check_unicode("the line read from stdin", line)  # before the tokenizer counts the conversation's tokens
        messages.append({"role": "user", "content": line.rstrip("\n")})
        _fit_conversation(model, messages, args.max_new_tokens, quiet=args.quiet)
        generation = model.chat(messages, **_generation_kwargs(args))
        for piece in generation:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": generation.result.text})


def _fit_conversation(model, messages: list[dict], max_new_tokens: int, quiet: bool) -> None:
    """Drop the oldest exchanges (user message and reply; a system message stays) until the rendered
    conversation leaves room for a reply of max_new_tokens within what a generation may hold, as
    llama.cpp's chat discards old context instead of ending. The newest message always stays: if it
    does not fit alone, the generation refuses it with the limit's own message."""
    from edge.api import render_chat

    limit, _ = model.generation_limit()
    first = 1 if messages[0]["role"] == "system" else 0
    dropped = 0
    while len(messages) - first > 1:
        tokens = len(model.tokenizer.encode(render_chat(model.tokenizer, messages), add_special_tokens=False))
        if tokens + max_new_tokens <= limit:
            break
        del messages[first: first + 2 if messages[first + 1]["role"] == "assistant" else first + 1]
        dropped += 1
    if dropped and not quiet:
        print(f"[chat] the conversation outgrew the {limit} positions a reply may use: dropped its "
              f"{dropped} oldest exchange{'s' if dropped > 1 else ''}", file=sys.stderr, flush=True)


def _memory_options(args) -> dict:
    """edge.load's memory budget and expert streaming options from the command line."""
    return {"memory_budget": args.memory_budget, "storage": args.storage, "expert_strategy": args.expert_strategy,
            "expert_policy": args.expert_policy, "prefetch_depth": args.prefetch_depth,
            "prefetch_threads": args.prefetch_threads, "gpu_expert_cache": args.gpu_expert_cache,
            "io_engine": args.io_engine, "expert_engine": args.expert_engine}


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    _add_load_args(p)
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens to generate at most (default 64; the first comes from the prompt's prefill)")
    _add_sampling_args(p)


def _add_load_args(p: argparse.ArgumentParser) -> None:
    """How the model is loaded: device, threads, KV cache, memory budget and MoE streaming."""
    p.add_argument("--device", default=None,
                   help="reference, cpu, cpu:f32, gpu, npu:PROVIDER (default: the fastest that runs here, cpu where "
                        "its kernels run, else reference; reference is the numpy oracle, for checking)")
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads of the cpu and npu devices (the reference and gpu devices take none)")
    p.add_argument("--kv-cache", default="f32", choices=("f32", "f16", "int8"),
                   help="storage of the KV cache (f16 / int8: reference and cpu devices)")
    p.add_argument("--kv-capacity", type=int, default=None, metavar="N",
                   help="KV cache positions, prompt included (like llama.cpp's --ctx-size); with --memory-budget "
                        "the budget reserves this many (default 1024), else default: the model's context")
    p.add_argument("--memory-budget", default=None,
                   help="one budget for weights, KV cache, scratch and expert cache: 512MB, bytes, or P%% (MoE: "
                        "everything but the experts plus P%% of the expert bytes)")
    p.add_argument("--storage", default=None, help="MoE: emulate nvme, ufs, emmc, sd or custom:bw=500MB,lat=200us")
    p.add_argument("--expert-strategy", default=None, choices=("predictive", "ondemand", "mmap", "resident"),
                   help="MoE: where experts come from (default: resident, or predictive under a budget)")
    p.add_argument("--expert-policy", default=None, choices=("lru", "lfu", "forecast", "cycle", "nextuse"),
                   help="MoE: expert cache eviction (default: nextuse, the expert whose next use is expected "
                        "furthest ahead, with the predictive strategy; else lru)")
    p.add_argument("--prefetch-depth", type=int, default=2, help="MoE: layers ahead the predictor prefetches")
    p.add_argument("--prefetch-threads", type=int, default=4,
                   help="MoE, io engine 'threads': expert reader threads (each keeps one read in flight)")
    p.add_argument("--io-engine", choices=IO_ENGINES, default="auto",
                   help="MoE: how streamed experts are read: io_uring (no reader threads), threads, or auto "
                        "(io_uring where the kernel allows it)")
    p.add_argument("--expert-engine", choices=EXPERT_ENGINES, default="auto",
                   help="MoE: the streamed expert cache: compiled (a slot table in compiled calls; "
                        "uncompressed records, lru/lfu/nextuse), python, or auto (compiled where it runs)")
    p.add_argument("--gpu-expert-cache", default=None,
                   help="MoE on --device gpu: bytes of experts kept on the GPU: 64MB, bytes, or P%% of all experts "
                        "(default: every expert if they take at most half the adapter's memory)")
    p.add_argument("--verify", action="store_true",
                   help="check every file's sha256 (and each MoE expert's crc32) before running: finds a damaged "
                        "checkpoint whose sizes are intact, at the cost of reading it all once")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (generate's default); chat samples by default as the checkpoint's "
                        "generation_config.json says, else with temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, "
                        "as llama.cpp and Ollama do")
    p.add_argument("--top-k", type=int, default=0, help="sample among the K likeliest tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the likeliest tokens whose probabilities sum to P (1 = all; 0 keeps only the "
                        "likeliest)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="keep the tokens at least this many times as likely as the likeliest (0 = no limit)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide the logits of tokens already in the prompt or the output by R (1 = off), as "
                        "transformers and llama.cpp do")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the sampler, for reproducible sampling; -1 (as in llama.cpp) or none: a random seed")
    p.add_argument("--stop", action="append", default=[],
                   help="stop string (repeatable): the text ends before it; --json's tokens keep every generated "
                        "token (as llama.cpp's do) and stop_string names the one that matched")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="zllm-edge", description="Run LLMs on devices that cannot hold them comfortably.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the runtime does (INFO level)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "convert", help="convert a Hugging Face folder or a GGUF file into a zllm checkpoint",
        description="Convert a Hugging Face folder or a GGUF file into a zllm checkpoint, one tensor at a time, "
                    "into a hidden folder beside OUT that is renamed when complete: an interrupted run never "
                    "leaves a loadable checkpoint, and what a killed one left is removed by the next conversion "
                    "to the same OUT. GGUF Q4_0/Q4_1/Q8_0 tensors are kept as stored unless a full scheme is "
                    "asked for: requantizing 4-bit codes onto a second 4-bit grid compounds both roundings.")
    p.add_argument("src", help="a Hugging Face folder (config.json and safetensors) or a .gguf file")
    p.add_argument("out", help="the checkpoint folder to write (refused if it exists, unless --force)")
    _add_quant_args(p)
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--report", action="store_true", help="print every tensor's quantization error")
    p.add_argument("--compress-experts", action="store_true",
                   help="zstd-compress each routed expert's record in experts.bin (MoE models)")
    p.add_argument("--moefy", nargs="?", const="", default=None, metavar="E:K",
                   help="split each dense FFN of a Llama model into E experts, K routed per token, with a router "
                        "fitted on calibration text (MoEfication); no value: the built-in default")
    p.add_argument("--moefy-dense-layers", default=None, metavar="LAYERS",
                   help="with --moefy: layers that keep their dense FFN: ids such as 0,-1, auto:N (the N most "
                        "sensitive), or none (default: the built-in default's)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("inspect", help="print a checkpoint's spec, schemes and sizes",
                       description="Print a checkpoint's model spec, weight formats per tensor class and sizes.")
    p.add_argument("checkpoint", help="a checkpoint folder made by zllm-edge convert")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON instead of the summary")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("formats", help="list every weight format with its block size and bytes per block",
                       description="List every weight format with its block size and bytes per block.")
    p.set_defaults(func=cmd_formats)

    p = sub.add_parser(
        "generate", help="generate text: zllm-edge generate [MODEL] PROMPT",
        description="Generate text from a prompt, greedy unless sampling is asked for. --json prints one object: "
                    "text, tokens, prompt_tokens, finish_reason, stop_string, seed, device, timings (prefill and "
                    "decode seconds and tokens/s of the model's own work) and stats.")
    p.add_argument("words", nargs="+", metavar="[MODEL] PROMPT",
                   help="MODEL: a checkpoint, GGUF file or Hugging Face folder (default: the built-in SmolLM2, "
                        "converted on first use); PROMPT: the text, its words joined by spaces")
    _add_generation_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object with text, tokens, timings")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "chat", help="chat on stdin/stdout with the model's chat template",
        description="Chat with the model: one message per line of stdin, each reply on stdout. When the "
                    "conversation outgrows what a reply may use (the context, --kv-capacity or the budget's "
                    "reservation), the oldest exchanges are dropped (the system message stays) and stderr says so.")
    from edge.core.sampling_defaults import SAMPLING_FIELDS

    p.add_argument("model", nargs="?", default=None,
                   help="a checkpoint, GGUF file or Hugging Face folder, or a built-in model: smollm2-135m-instruct "
                        "(the default) or gemma3-270m")
    p.add_argument("--system", default=None, help="the system message that opens the conversation")
    _add_generation_args(p)
    # a conversation samples as the checkpoint asks, else as llama.cpp does (cmd_chat; --temperature 0: greedy)
    p.set_defaults(func=cmd_chat, **dict.fromkeys(SAMPLING_FIELDS))

    from edge import bench, diff

    p = sub.add_parser(
        "bench", help="load time, prefill/decode tokens/s, first-token time, peak RSS; devices side by side",
        description="Measure devices side by side, each in its own process, repeats alternating between them: load "
                    "time, cold first token (compilation included), prefill and decode tokens/s, time to first token "
                    "and peak RSS, greedy over a fixed prompt; the table shows medians and ratios to the first device "
                    "(naming a device twice measures the noise floor). gpu adds upload time and its buffers' peak "
                    "bytes; providers that cannot share one environment run in helper virtualenvs under "
                    "$ZLLM_EDGE_HOME/venvs, and a device that cannot run here gets a column saying why. With "
                    "--memory-budget (MoE checkpoints) it decodes per budget and expert strategy instead, and beside "
                    "every streamed row stands the bound no strategy can beat (the resident speed, or the reads an "
                    "omniscient cache of that size would need at this disk's speed) and the fraction of it reached.")
    bench.add_arguments(p)
    p.set_defaults(func=bench.cmd_bench)

    from edge import serve

    p = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions",
        description="Serve the model over OpenAI's HTTP API: POST /v1/chat/completions and /v1/completions "
                    "(streamed or whole; response_format json_object / json_schema; tools where the chat template "
                    "defines them), GET /v1/models and /health. Requests run concurrently, interleaved one model "
                    "step at a time; a request that continues a kept conversation reuses its KV.")
    serve.add_arguments(p)
    p.set_defaults(func=serve.cmd_serve)

    from edge import calibrate

    p = sub.add_parser(
        "calibrate", help="record MoE route traces and calibrate the expert predictor's signal mix",
        description="Record route traces of a MoE checkpoint on Python's own docs, replay them through the expert "
                    "predictor with a grid of signal mixes (gate lookahead, temporal, spatial, frequency), print "
                    "held-out recall and precision per layer distance, and save the best mix as the checkpoint's "
                    "predictor.json, which edge.load uses by default.")
    calibrate.add_arguments(p)
    p.set_defaults(func=calibrate.cmd_calibrate)

    p = sub.add_parser(
        "diff", help="run a prompt on two devices and name the first layer where they diverge",
        description="Run a prompt and a few greedy decode steps on two devices, compare the hidden state after every "
                    "layer and the logits (max abs, relative max abs per token, relative RMS, cosine, argmax) and name "
                    "the first layer beyond tolerance; the tolerance follows each device's arithmetic and the "
                    "checkpoint's weight formats (reference against reference must be exactly 0). Exit status 1 when "
                    "the devices diverge.")
    diff.add_arguments(p)
    p.set_defaults(func=diff.cmd_diff)
    return parser


def _bare_moefy(argv: list[str]) -> list[str]:
    """`--moefy SRC OUT` means the default MoEfication: argparse would take SRC as --moefy's value, so a
    bare --moefy followed by SRC becomes `--moefy=`. What follows is SRC when it exists, or when it is
    not an attempted E:K and fewer than two positional words (SRC OUT) come after it."""
    argv = list(argv)
    for i, arg in enumerate(argv[:-1]):
        following = argv[i + 1]
        words_after = sum(not word.startswith("-") for word in argv[i + 2:])
        if arg == "--moefy" and (os.path.exists(following) or
                                 (not re.fullmatch(r".*:.*|\d+", following) and words_after < 2)):
            argv[i] = "--moefy="
    return argv


class _Parser(argparse.ArgumentParser):
    """Usage mistakes print one `error:` line, like every other error, and exit with status 2."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {_one_line(message)} (see {self.prog} --help)\n")

    def _get_values(self, action, arg_strings):
        # "--option=--" is the value "--": argparse would drop it as the end of the options and give the
        # option an empty list (a traceback later) or, for an optional value, its const
        if action.option_strings and action.nargs in (None, "?") and arg_strings == ["--"]:
            value = self._get_value(action, "--")
            self._check_value(action, value)
            return value
        return super()._get_values(action, arg_strings)


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, with generate's words typed anywhere among its options ("generate MODEL
    --max-new-tokens 8 PROMPT"): argparse takes a run of positionals at once and leaves the ones
    after an option over; they are the same words, in the order typed. parse_intermixed_args does
    this, but not under subcommands."""
    args, extras = parser.parse_known_args(argv)
    options = [extra for extra in extras if extra.startswith("-")]
    if extras and not options and isinstance(getattr(args, "words", None), list):
        args.words += extras
    elif extras:
        parser.error(f"unrecognized arguments: {' '.join(options or extras)}")
    return args


def _one_line(message: str) -> str:
    """A message on the one line an error gets: a line break in it (a path's, a value's as typed) escaped."""
    return message.replace("\r", "\\r").replace("\n", "\\n")


class Terminated(BaseException):
    """SIGTERM (timeout, docker stop, systemd) arrived: unwind like Ctrl-C, so staging directories go
    (a BaseException, as KeyboardInterrupt is, so that no `except Exception` swallows it)."""


def _terminate(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    # A command line's bytes that are not UTF-8 reach Python as U+DC80-U+DCFF (surrogateescape); a path
    # made of them is printed back as the same bytes, a line read from stdin is taken the same way (its
    # text is then refused by name), and an error message shows them escaped: never a UnicodeError.
    for stream, errors in ((sys.stdout, "surrogateescape"), (sys.stdin, "surrogateescape"),
                           (sys.stderr, "backslashreplace")):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors=errors)
    args = _parse(build_parser(), _bare_moefy(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s: %(message)s")
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main_thread else None
    try:
        return args.func(args)
    except ZllmError as exc:
        print(f"error: {_one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except BrokenPipeError:
        return 0
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        runtime = sys.modules.get("kernels.cpu.runtime")
        if runtime is not None:  # said for this command only (_load_model turned it on)
            runtime.compile_progress.enabled = False


if __name__ == "__main__":
    sys.exit(main())
