"""A newcomer's first run and every run after it: seconds from a new process to the first generated token,
cold (a home whose kernel cache is empty: the kernels compile) and warm (the same home again: they load).

Each run is its own process, so that nothing compiled or imported by an earlier one is reused; the split
says where the time goes: importing the package, `edge.load`, and the first token (the first forward
compiles or loads the fused kernel). Prints a table, then JSON.

    python benchmarks/first_run.py CKPT [--device cpu] [--warm-runs 3] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import publish  # noqa: E402

ONE_RUN = r"""
import json, sys, time
started = time.monotonic()
import edge
imported = time.monotonic()
model = edge.load(sys.argv[1], device=sys.argv[2])
loaded = time.monotonic()
generation = model.generate(sys.argv[3], max_new_tokens=1)
text = "".join(generation)
first = time.monotonic()
print(json.dumps({"import_seconds": imported - started, "load_seconds": loaded - imported,
                  "first_token_seconds": first - loaded, "load_to_first_token_seconds": first - imported,
                  "text": text, "device": model.device_info().get("requested")}))
"""


def one_run(checkpoint: str, device: str, prompt: str, home: str) -> dict:
    env = dict(os.environ, ZLLM_EDGE_HOME=home)
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", ONE_RUN, checkpoint, device, prompt], env=env, capture_output=True,
                          text=True, timeout=1800)
    wall = time.monotonic() - began
    if done.returncode != 0:
        raise SystemExit(f"a run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_seconds"] = wall  # interpreter start to exit, as a user waits for it
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--warm-runs", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the JSON here")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="zllm-first-run-") as home:
        print(f"cold run (empty kernel cache in {home}) ...", file=sys.stderr, flush=True)
        rows.append({"run": "cold", **one_run(args.checkpoint, args.device, args.prompt, home)})
        for i in range(args.warm_runs):
            print(f"warm run {i + 1} of {args.warm_runs} ...", file=sys.stderr, flush=True)
            rows.append({"run": "warm", **one_run(args.checkpoint, args.device, args.prompt, home)})
    print(f"{'run':6} {'process s':>10} {'import s':>9} {'load s':>7} {'1st token s':>12} {'load->1st s':>12}  text")
    for row in rows:
        print(f"{row['run']:6} {row['process_seconds']:10.2f} {row['import_seconds']:9.2f} {row['load_seconds']:7.2f} "
              f"{row['first_token_seconds']:12.2f} {row['load_to_first_token_seconds']:12.2f}  {row['text']!r}")
    publish({"checkpoint": args.checkpoint, "device": args.device, "prompt": args.prompt, "runs": rows,
             "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                         "python": platform.python_version()}}, args.json)


if __name__ == "__main__":
    main()
