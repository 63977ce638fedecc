"""Load on `zllm-edge serve`: requests/s, time to first token and tokens/s at 1, 2 and 4 concurrent clients.

    python benchmarks/serve_load.py [CHECKPOINT] [--clients 1,2,4] [--requests 8] [--max-tokens 48]
                                    [--device cpu] [--threads 1] [--time-limit 600] [--json out.json]

Starts the server on 127.0.0.1 (port 0) in a subprocess, then for each client count sends a fixed number of
streamed greedy chat requests (different prompts, the same for every client count) from that many threads
at once, and measures per request the time to the first streamed token and the tokens/s after it, and per
run the requests/s and the tokens/s of all streams together. Loopback only; a run stops at --time-limit.
Requests are interleaved one model step at a time (edge/serve.py), so the aggregate tokens/s of several
streams against one stream says what interleaving costs or gains on this machine.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from report import publish

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PROMPTS = ["What is the capital of France?", "Name three colours.", "Write a haiku about the sea.",
           "How do I sort a list in Python?", "What is two plus two?", "Describe a cat in one sentence.",
           "Why is the sky blue?", "Give me a word that rhymes with moon."]


def start_server(checkpoint: str | None, device: str, threads: int) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "edge.cli", "serve", *([checkpoint] if checkpoint else []), "--port", "0",
               "--device", device, "--threads", str(threads)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=REPO)
    for line in process.stderr:
        print(line, end="", file=sys.stderr)
        match = re.match(r"serving .* on (http://[^\s{}]+)/v1 ", line)
        if match:
            threading.Thread(target=lambda: [None for _ in process.stderr], daemon=True).start()
            return process, match.group(1)
    raise SystemExit(f"the server did not start (exit status {process.wait()})")


def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    started = time.perf_counter()
    first = None
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    tokens = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    ended = time.perf_counter()
    first = first if first is not None else ended
    return {"seconds": ended - started, "time_to_first_token_seconds": first - started, "tokens": tokens,
            "tokens_per_second": (tokens - 1) / (ended - first) if tokens > 1 and ended > first else None}


def run(client, model: str, clients: int, requests: int, max_tokens: int, deadline: float) -> dict:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(lambda p=p: one_request(client, model, p, max_tokens) if time.monotonic() < deadline
                               else None) for p in prompts]
        done = [f.result() for f in futures]
    wall = time.perf_counter() - started
    done = [d for d in done if d is not None]
    rates = [d["tokens_per_second"] for d in done if d["tokens_per_second"]]
    return {"clients": clients, "requests": len(done), "wall_seconds": wall, "requests_per_second": len(done) / wall,
            "tokens": sum(d["tokens"] for d in done), "aggregate_tokens_per_second": sum(d["tokens"] for d in done) / wall,
            "median_time_to_first_token_seconds": statistics.median(d["time_to_first_token_seconds"] for d in done),
            "median_stream_tokens_per_second": statistics.median(rates) if rates else None, "each": done}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", default=None, help="default: the built-in default model")
    parser.add_argument("--clients", default="1,2,4")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--time-limit", type=float, default=600, help="seconds; requests not started by then are skipped")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import openai

    process, url = start_server(args.checkpoint, args.device, args.threads)
    deadline = time.monotonic() + args.time_limit
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=args.time_limit)
        model = client.models.list().data[0].id
        one_request(client, model, PROMPTS[0], 4)  # the first request's own costs (tokenizer caches) go here
        results = []
        for clients in (int(c) for c in args.clients.split(",")):
            results.append(run(client, model, clients, args.requests, args.max_tokens, deadline))
            r = results[-1]
            print(f"[serve_load] {clients} clients: {r['requests']} requests in {r['wall_seconds']:.1f} s",
                  file=sys.stderr, flush=True)
    finally:
        process.terminate()
        process.wait(30)
    single = results[0]["aggregate_tokens_per_second"]
    print(f"\n{'clients':>7s} {'requests/s':>10s} {'tokens/s all':>12s} {'vs 1 client':>11s} "
          f"{'TTFT median s':>13s} {'tokens/s per stream':>19s}")
    for r in results:
        per_stream = r["median_stream_tokens_per_second"]
        print(f"{r['clients']:7d} {r['requests_per_second']:10.2f} {r['aggregate_tokens_per_second']:12.1f} "
              f"{r['aggregate_tokens_per_second'] / single:10.2f}x {r['median_time_to_first_token_seconds']:13.3f} "
              f"{per_stream if per_stream is not None else float('nan'):19.1f}")
    publish({"device": args.device, "threads": args.threads, "max_tokens": args.max_tokens,
             "requests_per_run": args.requests, "load_average": os.getloadavg(), "runs": results}, args.json)


if __name__ == "__main__":
    main()
