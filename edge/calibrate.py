"""`zllm-edge calibrate`: record route traces of a MoE checkpoint, replay them through the expert
predictor with a grid of signal mixes, print precision/recall per layer distance, and save the best
mix as the checkpoint's predictor.json (used by default when present)."""
from __future__ import annotations

import json
import os
import sys

from edge.core.errors import ZllmError

DEFAULT_REQUESTS = 8
DEFAULT_PROMPT_TOKENS = 32
CALIBRATION_SEED = 100  # id prompts of tokenizer-less models; the benchmark draws its own from seed 0


def calibration_prompts(tokenizer, n_requests: int, prompt_tokens: int) -> tuple[list[list[int]], str]:
    """Prompts cut from Python's pydoc_data topics (offline English prose and code), one topic each."""
    from pydoc_data.topics import topics

    from edge.bench_moe import WORKLOAD_TOPICS
    from streaming.predictor import PredictorError

    prefix = [tokenizer.bos_token_id] if tokenizer.add_bos_token and tokenizer.bos_token_id is not None else []
    encoded = {name: prefix + tokenizer.encode(text, add_special_tokens=False)
               for name, text in sorted(topics.items()) if name not in WORKLOAD_TOPICS}  # (the benchmark's prompts)
    names = [name for name, ids in encoded.items() if len(ids) >= prompt_tokens]  # every prompt as long as asked
    if n_requests > len(names):
        raise PredictorError(f"{n_requests} requests of {prompt_tokens} prompt tokens need as many pydoc topics of that "
                             f"length; {len(names)} have it: lower --requests or the prompt length")
    step = max(1, len(names) // n_requests)
    chosen = names[::step][:n_requests]
    prompts = [encoded[name][:prompt_tokens] for name in chosen]
    return prompts, f"pydoc_data.topics {chosen}, {prompt_tokens} prompt tokens each"


def add_arguments(parser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="MoE checkpoint (default: the built-in default MoE, the MoEfied SmolLM2)")
    parser.add_argument("--tokens", type=int, default=512,
                        help="tokens to record in all (prompts and greedy decode), split over --requests")
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS,
                        help="requests (prompts), alternately used to choose the mix and to report it")
    parser.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS, help="prompt tokens per request")
    parser.add_argument("--depth", type=int, default=2, help="MoE layers ahead to forecast and calibrate")
    parser.add_argument("--device", default="reference", help="device that runs the model while recording")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="route trace (npz): replayed when FILE exists, else recorded and saved there")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="write the figures of every mix as JSON to FILE ('-': stdout)")
    parser.add_argument("--no-save", action="store_true", help="do not write predictor.json into the checkpoint")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _check_recording(args) -> int:
    """The recording's sizes, checked before a model is built (the default MoE takes minutes) or
    loaded; returns the tokens per request."""
    if args.requests < 2:  # requests alternate between choosing the mix and reporting it
        raise ZllmError(f"--requests must be at least 2, got {args.requests}: the mix is chosen on half of the "
                        "requests and reported on the other, held-out half")
    if args.prompt_tokens < 1 or args.depth < 1:
        raise ZllmError(f"--prompt-tokens and --depth must be at least 1, got {args.prompt_tokens} and {args.depth}")
    per_request = args.tokens // args.requests
    if per_request <= args.prompt_tokens:
        raise ZllmError(f"--tokens {args.tokens} over --requests {args.requests} leaves {per_request} tokens per "
                        f"request, which must exceed --prompt-tokens {args.prompt_tokens} so that each request "
                        "decodes; raise --tokens or lower --requests")
    return per_request


def _record(path: str, args):
    import edge
    from edge.bench import id_prompt
    from edge.core.spec import spec_from_dict
    from quant.checkpoint import read_manifest
    from streaming.calibration import record_trace

    per_request = _check_recording(args)
    spec = spec_from_dict(read_manifest(path)["model"])
    context = spec.max_position_embeddings
    if per_request > context:
        raise ZllmError(f"--tokens {args.tokens} over --requests {args.requests} makes requests of {per_request} "
                        f"tokens, beyond the model's context of {context}; lower --tokens or raise --requests")
    moe_layers = sum(spec.moe_for_layer(i) is not None for i in range(spec.num_hidden_layers))
    if 0 < moe_layers < args.depth:  # the trace keeps each lookahead apart: one beyond the layers is all empty
        raise ZllmError(f"--depth {args.depth} looks further ahead than the model's {moe_layers} MoE layers; "
                        f"give --depth of at most {moe_layers}")
    model = edge.load(path, device=args.device)
    try:
        if model.tokenizer is not None:
            prompts, source = calibration_prompts(model.tokenizer, args.requests, args.prompt_tokens)
        else:  # a model without a tokenizer (a random test model) takes random ids
            special = model.eog_token_ids | {model.checkpoint.tokenizer_config.get("bos_token_id")}
            special.discard(None)
            prompts = [id_prompt(model.spec.vocab_size, special, args.prompt_tokens, seed=CALIBRATION_SEED + i)
                       for i in range(args.requests)]
            source = f"no tokenizer: random ids, numpy default_rng({CALIBRATION_SEED} + request)"
        if not args.quiet:
            print(f"[calibrate] recording {args.requests} requests x ({args.prompt_tokens} prompt + "
                  f"{per_request - args.prompt_tokens} decoded) tokens on {args.device}", file=sys.stderr, flush=True)
        return record_trace(model, prompts, per_request - args.prompt_tokens + 1, depth=args.depth, source=source)
    finally:
        model.close()


def cmd_calibrate(args) -> int:
    from edge.core.arguments import writable_file
    from edge.core.files import write_output
    from edge.core.spec import spec_from_dict
    from edge.home import default_moe_checkpoint
    from edge.options import LoadOptions
    from quant.checkpoint import read_manifest
    from streaming.calibration import RouteTrace, calibrate, check_trace_fits, format_calibration
    from streaming.predictor import SignalWeights, write_predictor_file

    replay = args.trace is not None and os.path.isfile(args.trace)
    if not replay:  # checked before the default MoE is built (minutes) and before the recording
        _check_recording(args)
        LoadOptions.of(device=args.device)
        if args.trace == "-":
            raise ZllmError("--trace names a file (npz); it cannot be '-' (stdout)")
        writable_file("--trace", args.trace)
    writable_file("--json", args.json)
    path = args.model or default_moe_checkpoint(progress=not args.quiet)
    if replay:
        trace = RouteTrace.load(args.trace)
        check_trace_fits(trace, spec_from_dict(read_manifest(path)["model"]), args.trace, path)
    else:
        trace = _record(path, args)
        if args.trace:
            trace.save(args.trace)
    result = calibrate(trace, depth=min(args.depth, trace.depth))
    # `--json -`: the JSON alone on stdout, the table on stderr (as bench does)
    table = sys.stderr if args.json == "-" else sys.stdout
    print(format_calibration(result), file=table)
    if not args.no_save:
        saved = write_predictor_file(path, SignalWeights.from_dict(result["weights"]),
                                     {key: result[key] for key in ("tokens", "requests", "phase", "source")})
        print(f"predictor weights saved to {saved}", file=table)
    if args.json == "-":
        print(json.dumps(result, indent=1))
    elif args.json:
        write_output(args.json, lambda f: json.dump(result, f, indent=1))
    return 0
