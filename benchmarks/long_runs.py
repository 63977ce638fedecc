"""Do long runs leak? The process's resident set and open file descriptors over a long decode and over
many sessions, on the default dense model and on the default MoE streamed under a memory budget.

    python benchmarks/long_runs.py [--dense CKPT] [--moe CKPT] [--models dense,moe] [--budget 50%]
                                   [--storage nvme] [--threads 1] [--tokens 5000] [--every-tokens 250]
                                   [--warmup-tokens 500] [--sessions 500] [--every-sessions 25]
                                   [--warmup-sessions 50] [--json FILE] [--plot FILE.png | --no-plot]

For each model (the home's default model, edge/home.py, on `cpu`; and its default MoE, streamed under
--budget), in a process of its own that has imported only the package before the load (two models in
one process would share the heap: the second one's curve would start in memory the first one freed):
  decode    one session whose KV capacity holds the prompt and --tokens more, decoding them by
            sampling (temperature 1, top-k 50, a fixed seed: the routes keep changing, unlike a greedy
            loop's); RSS and open file descriptors every --every-tokens tokens;
  sessions  --sessions sessions, each opened, given a short prompt (8 tokens), 8 decode steps, and
            closed; RSS and open file descriptors every --every-sessions sessions.
The curve is flat when nothing leaks: after the warm-up (--warmup-tokens, --warmup-sessions: kernels,
scratch, the expert cache and the allocator reach their size) the decode's RSS grows only by the KV
of the positions it adds (its pages are mapped as they are written), and the sessions' RSS and both
file descriptor counts not at all. Reported: each sample, the growth from the end of the warm-up to
the last sample against that KV, per 1,000 tokens and per 100 sessions, as a table, JSON and a plot
(--plot, else beside --json). A line on stderr per sample shows progress.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from report import publish

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import edge  # noqa: E402
from edge.core.process_memory import resident_bytes  # noqa: E402

IMPORTED_RSS = resident_bytes()  # the interpreter and the package's import: the curves start above it
PROMPT_TOKENS = 16  # the long decode's prompt
SESSION_PROMPT_TOKENS = 8
SESSION_DECODE_STEPS = 8
SEED = 0


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def sample(**counts) -> dict:
    rss = resident_bytes()
    return {**counts, "rss_bytes": rss, "rss_over_import_bytes": rss - IMPORTED_RSS, "open_fds": open_files()}


def progress(label: str, point: dict, total: int, unit: str) -> None:
    print(f"[long runs] {label}: {point[unit]}/{total} {unit}, RSS over import "
          f"{point['rss_over_import_bytes'] / 1e6:.1f} MB, {point['open_fds']} open fds", file=sys.stderr, flush=True)


def long_decode(model, label: str, tokens: int, every: int, rng) -> list[dict]:
    """Decode `tokens` tokens in one session by sampling; a sample every `every` tokens (and one after
    the prompt, at 0)."""
    from edge.core.kv import kv_bytes_per_token
    from edge.sampling import SamplingParams, sample_token

    params = SamplingParams(temperature=1.0, top_k=50)
    kv_per_token = kv_bytes_per_token(model.spec, model.transformer.kv_format)
    prompt = rng.integers(3, model.spec.vocab_size, PROMPT_TOKENS).tolist()
    samples = []
    with model.session(capacity=PROMPT_TOKENS + tokens) as session:
        token = sample_token(session.prefill(prompt), params, rng)
        samples.append(sample(tokens=0, kv_bytes=session.position * kv_per_token, tokens_per_second=None))
        last = time.perf_counter()
        for step in range(1, tokens + 1):
            token = sample_token(session.decode(token), params, rng)
            if step % every == 0 or step == tokens:
                now = time.perf_counter()
                samples.append(sample(tokens=step, kv_bytes=session.position * kv_per_token,
                                      tokens_per_second=(step - samples[-1]["tokens"]) / (now - last)))
                last = now
                progress(f"{label} decode", samples[-1], tokens, "tokens")
    return samples


def many_sessions(model, label: str, sessions: int, every: int, rng) -> list[dict]:
    """Open, use (a short prefill, a few decode steps) and close `sessions` sessions; a sample every
    `every` sessions (and one before the first)."""
    samples = [sample(sessions=0)]
    for opened in range(1, sessions + 1):
        prompt = rng.integers(3, model.spec.vocab_size, SESSION_PROMPT_TOKENS).tolist()
        with model.session(capacity=SESSION_PROMPT_TOKENS + SESSION_DECODE_STEPS) as session:
            token = session.next_token(prompt)
            for _ in range(SESSION_DECODE_STEPS):
                token = session.next_token([token])
        if opened % every == 0 or opened == sessions:
            samples.append(sample(sessions=opened))
            progress(f"{label} sessions", samples[-1], sessions, "sessions")
    return samples


def after_warmup(samples: list[dict], unit: str, warmup: int) -> tuple[dict, dict]:
    """(the first sample at or past the warm-up, the last sample)."""
    first = next((s for s in samples if s[unit] >= warmup), samples[-1])
    return first, samples[-1]


def decode_summary(samples: list[dict], warmup: int) -> dict:
    first, last = after_warmup(samples, "tokens", warmup)
    tokens = last["tokens"] - first["tokens"]
    growth = last["rss_bytes"] - first["rss_bytes"]
    kv_growth = last["kv_bytes"] - first["kv_bytes"]
    per_thousand = (lambda n_bytes: n_bytes * 1000 / tokens) if tokens else (lambda n_bytes: None)
    return {"from_tokens": first["tokens"], "to_tokens": last["tokens"],
            "rss_from_bytes": first["rss_bytes"], "rss_to_bytes": last["rss_bytes"],
            "fds_from": first["open_fds"], "fds_to": last["open_fds"],
            "growth_bytes": growth, "kv_growth_bytes": kv_growth, "growth_beyond_kv_bytes": growth - kv_growth,
            "growth_per_1000_tokens_bytes": per_thousand(growth),
            "kv_per_1000_tokens_bytes": per_thousand(kv_growth),
            "growth_beyond_kv_per_1000_tokens_bytes": per_thousand(growth - kv_growth),
            "fd_growth": last["open_fds"] - first["open_fds"]}


def sessions_summary(samples: list[dict], warmup: int) -> dict:
    first, last = after_warmup(samples, "sessions", warmup)
    sessions = last["sessions"] - first["sessions"]
    growth = last["rss_bytes"] - first["rss_bytes"]
    return {"from_sessions": first["sessions"], "to_sessions": last["sessions"],
            "rss_from_bytes": first["rss_bytes"], "rss_to_bytes": last["rss_bytes"],
            "fds_from": first["open_fds"], "fds_to": last["open_fds"], "growth_bytes": growth,
            "growth_per_100_sessions_bytes": growth * 100 / sessions if sessions else None,
            "fd_growth": last["open_fds"] - first["open_fds"]}


def run_model(label: str, checkpoint: str, args, **load_options) -> dict:
    import numpy as np

    from edge.core.kv import kv_bytes_per_token

    rng = np.random.default_rng(SEED)
    started = time.perf_counter()
    print(f"[long runs] {label}: loading {checkpoint}", file=sys.stderr, flush=True)
    with edge.load(checkpoint, device="cpu", threads=args.threads, **load_options) as model:
        decode = long_decode(model, label, args.tokens, args.every_tokens, rng)
        sessions = many_sessions(model, label, args.sessions, args.every_sessions, rng)
        stats = model.stats()
        kv_per_token = kv_bytes_per_token(model.spec, model.transformer.kv_format)
        budget_bytes = model.memory.budget_bytes
    return {"model": label, "checkpoint": os.path.abspath(checkpoint), "device": "cpu", "threads": args.threads,
            "imported_rss_bytes": IMPORTED_RSS,
            **{key: load_options.get(key) for key in ("memory_budget", "storage")}, "budget_bytes": budget_bytes,
            "kv_bytes_per_token": kv_per_token, "seconds": time.perf_counter() - started,
            "io_engine": stats.get("io_engine"), "expert_hit_rate": stats.get("hit_rate"),
            "decode": {"tokens": args.tokens, "warmup_tokens": args.warmup_tokens, "samples": decode,
                       **decode_summary(decode, args.warmup_tokens)},
            "sessions": {"sessions": args.sessions, "warmup_sessions": args.warmup_sessions,
                         "prompt_tokens": SESSION_PROMPT_TOKENS, "decode_steps": SESSION_DECODE_STEPS,
                         "samples": sessions, **sessions_summary(sessions, args.warmup_sessions)}}


def megabytes(n_bytes) -> str:
    return "-" if n_bytes is None else f"{n_bytes / 1e6:.2f}"


def print_tables(runs: list[dict]) -> None:
    for run in runs:
        decode, sessions = run["decode"], run["sessions"]
        print(f"\n{run['model']}: {run['checkpoint']} (cpu, {run['threads']} thread(s)"
              + (f", memory budget {run['memory_budget']}, {run['io_engine']}" if run["memory_budget"] else "")
              + f"), {run['seconds']:.0f} s")
        print(f"{'tokens':>7}  {'RSS-import MB':>13}  {'KV MB':>7}  {'fds':>4}  {'tok/s':>6}")
        for point in decode["samples"]:
            speed = "-" if point["tokens_per_second"] is None else f"{point['tokens_per_second']:.1f}"
            print(f"{point['tokens']:>7}  {point['rss_over_import_bytes'] / 1e6:>13.1f}  "
                  f"{point['kv_bytes'] / 1e6:>7.1f}  {point['open_fds']:>4}  {speed:>6}")
        print(f"after warm-up ({decode['from_tokens']} -> {decode['to_tokens']} tokens): RSS "
              f"{megabytes(decode['growth_bytes'])} MB, the KV of those positions "
              f"{megabytes(decode['kv_growth_bytes'])} MB, beyond it {megabytes(decode['growth_beyond_kv_bytes'])} MB "
              f"({megabytes(decode['growth_beyond_kv_per_1000_tokens_bytes'])} MB per 1,000 tokens); "
              f"open fds {decode['fds_from']} -> {decode['fds_to']}")
        print(f"{'sessions':>8}  {'RSS-import MB':>13}  {'fds':>4}")
        for point in sessions["samples"]:
            print(f"{point['sessions']:>8}  {point['rss_over_import_bytes'] / 1e6:>13.1f}  {point['open_fds']:>4}")
        print(f"after warm-up ({sessions['from_sessions']} -> {sessions['to_sessions']} sessions): RSS "
              f"{megabytes(sessions['growth_bytes'])} MB ({megabytes(sessions['growth_per_100_sessions_bytes'])} MB "
              f"per 100 sessions); open fds {sessions['fds_from']} -> {sessions['fds_to']}")


def plot(runs: list[dict], path: str) -> str | None:
    """The curves as a PNG at `path`: RSS (solid) and open file descriptors (dashed, right axis) over the
    long decode, with the warm-up RSS plus the KV of the positions (dotted), and over the sessions.
    -> None, or why no plot was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'); no plot written"
    figure, (decode_axis, sessions_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    fds_axes = {decode_axis: decode_axis.twinx(), sessions_axis: sessions_axis.twinx()}
    for color, run in zip(("tab:blue", "tab:orange", "tab:green"), runs):
        decode, sessions = run["decode"], run["sessions"]
        points = decode["samples"]
        start = next(p for p in points if p["tokens"] == decode["from_tokens"])
        decode_axis.plot([p["tokens"] for p in points], [p["rss_over_import_bytes"] / 1e6 for p in points],
                         color=color, label=f"{run['model']}: RSS over import")
        after = [p for p in points if p["tokens"] >= decode["from_tokens"]]
        decode_axis.plot([p["tokens"] for p in after],
                         [(start["rss_over_import_bytes"] + p["kv_bytes"] - start["kv_bytes"]) / 1e6 for p in after],
                         color=color, linestyle=":", label=f"{run['model']}: warm-up RSS + KV of the positions")
        fds_axes[decode_axis].step([p["tokens"] for p in points], [p["open_fds"] for p in points], where="post",
                                   color=color, linestyle="--", alpha=0.6, label=f"{run['model']}: open fds")
        points = sessions["samples"]
        sessions_axis.plot([p["sessions"] for p in points], [p["rss_over_import_bytes"] / 1e6 for p in points],
                           color=color, label=f"{run['model']}: RSS over import")
        fds_axes[sessions_axis].step([p["sessions"] for p in points], [p["open_fds"] for p in points], where="post",
                                     color=color, linestyle="--", alpha=0.6, label=f"{run['model']}: open fds")
    most_rss = max(p["rss_over_import_bytes"] for run in runs for part in ("decode", "sessions")
                   for p in run[part]["samples"]) / 1e6
    most_fds = max(p["open_fds"] for run in runs for part in ("decode", "sessions") for p in run[part]["samples"])
    for axis, part, warmup, title, unit in (
            (decode_axis, "decode", "warmup_tokens", "one long decode", "decoded tokens"),
            (sessions_axis, "sessions", "warmup_sessions", "sessions opened, used and closed", "sessions")):
        axis.axvline(runs[0][part][warmup], color="gray", linewidth=0.8, label="end of the warm-up")
        axis.set(title=title, xlabel=unit, ylabel="RSS over the package's import (MB)", ylim=(0, most_rss * 1.45))
        fds = fds_axes[axis]
        fds.set(ylabel="open file descriptors", ylim=(0, most_fds * 3))
        lines, labels = axis.get_legend_handles_labels()
        fd_lines, fd_labels = fds.get_legend_handles_labels()
        axis.legend(lines + fd_lines, labels + fd_labels, fontsize=7, loc="upper left", ncol=2)
    figure.tight_layout()
    figure.savefig(path)
    return None


def run_in_this_process(model: str, args) -> dict:
    from edge.home import default_model_checkpoint, default_moe_checkpoint

    if model == "dense":
        return run_model("dense", args.dense or default_model_checkpoint(), args)
    return run_model(f"moe {args.budget}", args.moe or default_moe_checkpoint(), args, memory_budget=args.budget,
                     storage=args.storage, kv_capacity=PROMPT_TOKENS + args.tokens)


def run_in_a_process(model: str, argv: list[str]) -> dict:
    """This script run for one model in a child process (its progress lines come through): its run."""
    import subprocess
    import tempfile

    kept = [arg for arg, after in zip(argv, [None, *argv]) if arg not in ("--json", "--plot", "--models")
            and after not in ("--json", "--plot", "--models")
            and not arg.startswith(("--json=", "--plot=", "--models="))]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "run.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), *kept, "--models", model, "--json", path,
                        "--no-plot"],
                       check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            return json.load(f)["runs"][0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dense", help="dense checkpoint (default: the home's default model)")
    parser.add_argument("--moe", help="MoE checkpoint (default: the home's default MoE)")
    parser.add_argument("--models", default="dense,moe", help="which to run: dense, moe or both")
    parser.add_argument("--budget", default="50%", help="the MoE's memory budget")
    parser.add_argument("--storage", default="nvme", help="the MoE's emulated storage")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=5000)
    parser.add_argument("--every-tokens", type=int, default=250)
    parser.add_argument("--warmup-tokens", type=int, default=500)
    parser.add_argument("--sessions", type=int, default=500)
    parser.add_argument("--every-sessions", type=int, default=25)
    parser.add_argument("--warmup-sessions", type=int, default=50)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--no-plot", action="store_true", help="write no plot beside --json")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or set(models) - {"dense", "moe"}:
        parser.error(f"--models takes dense, moe or dense,moe; got {args.models!r}")
    if min(args.tokens, args.every_tokens, args.sessions, args.every_sessions) < 1:
        parser.error("--tokens, --every-tokens, --sessions and --every-sessions must be at least 1")
    if len(models) == 1:
        runs = [run_in_this_process(models[0], args)]
    else:  # each in a process of its own: memory one model freed would be reused by the next one's curve
        runs = [run_in_a_process(model, argv if argv is not None else sys.argv[1:]) for model in models]
    print_tables(runs)
    result = {"runs": runs}
    plot_path = args.plot or (os.path.splitext(args.json)[0] + ".png" if args.json else None)
    if plot_path and not args.no_plot:
        problem = plot(runs, plot_path)
        print(f"plot: {problem or plot_path}", file=sys.stderr)
    publish(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
