"""Prefill and decode tokens/s of SmolLM2-135M on device="npu" providers, next to the reference backend.

    python benchmarks/npu_decode.py [--devices reference npu:cpu ...] [--prompt-tokens 64] [--decode 32]
                                    [--repeats 3] [--json out.json]

Each device: load (graphs built or taken from the cache; load time reported), one warm-up
prefill+decode, then `repeats` runs of a fresh session: prefill of a fixed prompt of
--prompt-tokens ids, then --decode greedy steps. Reported: the median tokens/s of each phase.
Providers absent from this machine's onnxruntime are reported as skipped with the reason.
Prints a table and one JSON object (also written to --json).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import edge  # noqa: E402
from edge.core.errors import ZllmError  # noqa: E402
from edge.home import default_model_checkpoint  # noqa: E402

DEFAULT_DEVICES = ["reference", "npu:cpu", "npu:cpu,accuracy_level=0", "npu:cpu,attention=standard",
                   "npu:cpu,static=1", "npu:openvino", "npu:qnn"]


def measure(checkpoint: str, device: str, prompt: list[int], n_decode: int, repeats: int) -> dict:
    started = time.perf_counter()
    try:
        model = edge.load(checkpoint, device=device)
    except ZllmError as exc:
        return {"device": device, "skipped": str(exc)}
    load_seconds = time.perf_counter() - started
    capacity = len(prompt) + n_decode + 1
    runs = []
    for repeat in range(repeats + 1):  # the first run warms up
        session = model.session(capacity=capacity)
        t0 = time.perf_counter()
        logits = session.prefill(prompt)
        t1 = time.perf_counter()
        tokens = []
        for _ in range(n_decode):
            tokens.append(int(logits.argmax()))
            logits = session.decode(tokens[-1])
        t2 = time.perf_counter()
        if repeat:
            runs.append((len(prompt) / (t1 - t0), n_decode / (t2 - t1)))
    info = model.device_info()
    model.close()
    return {"device": device, "provider": info.get("provider", "numpy"), "load_seconds": round(load_seconds, 3),
            "prefill_tokens_per_second": round(statistics.median(r[0] for r in runs), 2),
            "decode_tokens_per_second": round(statistics.median(r[1] for r in runs), 2),
            "greedy_tokens": tokens[:8], "warnings": info.get("warnings", [])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", nargs="+", default=DEFAULT_DEVICES)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checkpoint", default=None, help="default: the built-in SmolLM2 checkpoint")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    checkpoint = args.checkpoint or default_model_checkpoint(progress=False)
    prompt = [(7 * i + 1000) % 40000 + 100 for i in range(args.prompt_tokens)]
    results = []
    for device in args.devices:
        repeats = 1 if device == "reference" else args.repeats
        results.append(measure(checkpoint, device, prompt, args.decode if device != "reference" else 8, repeats))
    print(f"{'device':34} {'provider':28} {'load s':>7} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for r in results:
        if "skipped" in r:
            print(f"{r['device']:34} skipped: {r['skipped'][:90]}")
        else:
            print(f"{r['device']:34} {r['provider']:28} {r['load_seconds']:7.2f} "
                  f"{r['prefill_tokens_per_second']:14.1f} {r['decode_tokens_per_second']:13.1f}")
    report = {"checkpoint": checkpoint, "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode,
              "results": results}
    print(json.dumps(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
