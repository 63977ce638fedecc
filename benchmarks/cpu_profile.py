"""Where the CPU backend's time goes: per-step timers from inside the fused forward.

    python benchmarks/cpu_profile.py [CHECKPOINT] [--threads 1,2] [--prompt-tokens 128]
                                     [--decode-tokens 64] [--json out.json]

The fused kernel stamps the time at which each step's last task finishes (kernels/cpu/forward.py,
`clock`), so a step's duration is the wall time from the end of the step before it to its own end:
waits for the slowest thread included, which is what a user pays. Steps are summed over layers.
The table gives, for a 128-token prefill and for one decode step (averaged over the decode
tokens, the context growing from the prompt), milliseconds per call and the share of the call;
"outside the kernel" is the rest of the wall time of a session call (Python, RoPE tables,
argument passing, thread wake-up).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

from report import publish

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import edge  # noqa: E402
from edge.home import default_model_checkpoint  # noqa: E402


def profile(checkpoint: str, threads: int, n_prompt: int, n_decode: int, kv_cache: str = "f32") -> dict:
    with edge.load(checkpoint, device="cpu", threads=threads, kv_cache=kv_cache) as model:
        executor = model.transformer._fused_forward
        prompt = [int(i) for i in range(1000, 1000 + n_prompt)]
        session = model.session(capacity=n_prompt + n_decode + 1)
        session.prefill(prompt[:8])  # warm-up
        results = {}
        for phase in ("prefill", "decode"):
            steps, wall, calls = collections.Counter(), 0.0, 0
            repeats = 3 if phase == "prefill" else 1
            for _ in range(repeats):
                session.reset()
                start = time.perf_counter()
                logits = session.prefill(prompt)
                if phase == "prefill":
                    wall += time.perf_counter() - start
                    calls += 1
                    for _, name, seconds in executor.last_step_times():
                        steps[name] += seconds
                    continue
                for _ in range(n_decode):
                    start = time.perf_counter()
                    logits = session.decode(int(logits.argmax()))
                    wall += time.perf_counter() - start
                    calls += 1
                    for _, name, seconds in executor.last_step_times():
                        steps[name] += seconds
            in_kernel = sum(steps.values())
            rows = {name: seconds / calls for name, seconds in steps.items()}
            rows["outside the kernel"] = (wall - in_kernel) / calls
            results[phase] = {"ms_per_call": wall / calls * 1e3,
                              "steps_ms": {name: s * 1e3 for name, s in sorted(rows.items(), key=lambda r: -r[1])}}
        results["threading_layer"] = model.device_info()["threading_layer"]
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", nargs="?", default=None)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--kv-cache", default="f32", help="the KV cache's format (f32, f16, int8)")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    checkpoint = args.checkpoint or default_model_checkpoint()
    results = {"checkpoint": checkpoint, "load_average_before": os.getloadavg(), "threads": {}}
    for threads in (int(t) for t in args.threads.split(",")):
        result = profile(checkpoint, threads, args.prompt_tokens, args.decode_tokens, args.kv_cache)
        results["threads"][threads] = result
        for phase in ("prefill", "decode"):
            data = result[phase]
            label = f"{args.prompt_tokens}-token prefill" if phase == "prefill" else "decode step"
            print(f"\n{threads} thread(s), {label}: {data['ms_per_call']:.2f} ms per call "
                  f"({result['threading_layer']})")
            print(f"  {'step (summed over layers)':36s} {'ms':>8s} {'share':>6s}")
            for name, ms in data["steps_ms"].items():
                print(f"  {name:36s} {ms:8.3f} {100 * ms / data['ms_per_call']:5.1f}%")
    results["load_average_after"] = os.getloadavg()
    publish(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
