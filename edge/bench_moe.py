"""`zllm-edge bench MODEL --memory-budget 25%,50%,75%,100% --storage nvme`: a MoE checkpoint's greedy
decode under memory budgets, one expert strategy against another.

Strategies (edge.load's expert_strategy):
    resident    every expert in memory (run once, at the 100% budget): the speed to approach
    mmap        plain mmap of the expert file, the page cache bounded to the budget (what llama.cpp does)
    ondemand    a bounded LRU expert cache, experts read when a layer needs them, no prediction
    predictive  ours: the predictor's prefetches, and the product's default eviction ("nextuse")

Every (strategy, budget) runs in its own spawned worker (edge/bench.py's DeviceWorker), so each peak
RSS is its own. A budget means the whole process less the interpreter and the package's import
(streaming/budget.py counts the runtime in it): the budget is compared with peak RSS minus the RSS
the worker had after importing the package. Before the measured load a worker loads the model once,
runs a few tokens and closes it (on Linux, then restarts the kernel's peak-RSS count), as a
long-running process would have. Each worker
loads, runs one short warm-up on a prompt of its own (JIT compilation, the predictor's first routes),
then `repeats` timed runs, each on a different prompt (a predictor must not be scored on a sequence
it has already seen). Counters (hits, misses, bytes, stall) are taken over the decode steps only,
from `model.stats()` before and after them.
"""
from __future__ import annotations

import os
import platform
import statistics
import sys

import numpy as np

from edge.bench import (
    PROMPT_SEED,
    WARMUP_NEW_TOKENS,
    BenchError,
    DeviceWorker,
    _agreeing_prefix,
    check_prompt_tokens,
    emit_report,
    id_prompt,
    machine_info,
)
from streaming.options import StreamingOptions

STRATEGY_OPTIONS = {
    "resident": {"expert_strategy": "resident"},
    "mmap": {"expert_strategy": "mmap"},
    "ondemand": {"expert_strategy": "ondemand", "expert_policy": "lru"},
    "predictive": {"expert_strategy": "predictive"},
}
RESIDENT_BUDGET = "100%"
# pydoc_data.topics entries the workload's prompts are cut from (the first is edge/bench.py's prompt);
# `zllm-edge calibrate` records its traces on other topics.
WORKLOAD_TOPICS = ("execmodel", "compound", "import", "types", "specialnames", "string-methods")
COUNTERS = ("expert_hits", "expert_misses", "bytes_read", "io_stall_seconds", "expert_reads", "prefetches_evicted_unused")
RSS_TOLERANCE = 0.05  # peak RSS over the interpreter baseline may exceed the budget by this share


def parse_budgets(text: str) -> list[str]:
    """'25%,50%,512MB' -> ['25%', '50%', '512MB'], each checked by the budget parser."""
    from streaming.budget import parse_budget

    budgets = [b.strip() for b in text.split(",") if b.strip()]
    if not budgets:
        raise BenchError(f"--memory-budget {text!r} names no budget; give e.g. 25%,50%,75%,100% or 512MB")
    for budget in budgets:
        parse_budget(budget)  # raises a ZllmError naming the bad one
    return budgets


def parse_strategies(text: str) -> list[str]:
    strategies = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGY_OPTIONS]
    if unknown or not strategies:
        raise BenchError(f"--strategies {text!r}: unknown {unknown}; choose from {', '.join(STRATEGY_OPTIONS)}")
    return strategies


def workload_prompts(checkpoint_path: str, n_tokens: int, count: int) -> tuple[list[list[int]], str]:
    """`count` distinct prompts of n_tokens ids: text topics when the checkpoint has a tokenizer, else ids."""
    from pydoc_data.topics import topics

    from edge.core.spec import spec_from_dict
    from edge.tokenizer import Tokenizer
    from quant.checkpoint import open_checkpoint

    check_prompt_tokens(n_tokens)
    if count > len(WORKLOAD_TOPICS):
        raise BenchError(f"at most {len(WORKLOAD_TOPICS) - 1} repeats (one prompt each, plus the warm-up's), "
                         f"got {count - 1}")
    with open_checkpoint(checkpoint_path) as checkpoint:
        spec = spec_from_dict(checkpoint.model_config)
        config = checkpoint.tokenizer_config
        if checkpoint.tokenizer_path:
            tokenizer = Tokenizer(checkpoint.tokenizer_path, config)
            prefix = [tokenizer.bos_token_id] if tokenizer.add_bos_token and tokenizer.bos_token_id is not None else []
            prompts = []
            for name in WORKLOAD_TOPICS[:count]:
                body = tokenizer.encode(topics[name], add_special_tokens=False)
                repeats = -(-max(n_tokens - len(prefix), 0) // len(body))
                prompts.append((prefix + body * repeats)[:n_tokens])
            return prompts, (f"pydoc_data.topics {list(WORKLOAD_TOPICS[:count])} of Python "
                             f"{platform.python_version()}, tokenized and cut to {n_tokens} tokens")
    special = {config.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    special |= set(config.get("eog_token_ids") or [])
    special.discard(None)
    prompts = [id_prompt(spec.vocab_size, special, n_tokens, seed=PROMPT_SEED + i) for i in range(count)]
    return prompts, f"no tokenizer: {n_tokens} ids per prompt drawn by numpy default_rng({PROMPT_SEED} + i)"


def _decode_counters(run: dict) -> dict:
    """The streaming counters of a run's decode steps: stats after the run minus stats after its prefill."""
    before, after = run["stats_after_prefill"], run["stats"]
    counters = {key: (after.get(key) or 0) - (before.get(key) or 0) for key in COUNTERS}
    for distance, figures in (after.get("predictor_by_distance") or {}).items():
        earlier = (before.get("predictor_by_distance") or {}).get(distance, {})
        for key in ("hits", "predicted", "actual"):
            counters[f"predictor_{key}_{distance}"] = figures[key] - earlier.get(key, 0)
    return counters


def _ratio(a, b):
    return a / b if a is not None and b else None


def summarize(strategy: str, budget: str, loaded: dict, runs: list[dict], peak_rss: int | None) -> dict:
    """One row of the report from a worker's load message, its timed runs and its peak RSS."""
    totals: dict[str, float] = {}
    for run in runs:
        for key, value in _decode_counters(run).items():
            totals[key] = totals.get(key, 0) + value
    decode_seconds = sum(run["decode_seconds"] for run in runs)
    decode_steps = sum(run["decode_steps"] for run in runs)
    requests = totals["expert_hits"] + totals["expert_misses"]
    plan = loaded.get("memory_plan") or {}
    baseline = loaded["rss_before_load_bytes"]
    budget_bytes = plan.get("budget_bytes")
    over_baseline = None if peak_rss is None else peak_rss - baseline
    imported = loaded.get("rss_after_import_bytes")
    over_import = None if peak_rss is None or imported is None else peak_rss - imported
    distances = sorted({int(k.rsplit("_", 1)[1]) for k in totals if k.startswith("predictor_actual_")})
    final = runs[-1]["stats"]
    return {
        "strategy": strategy, "budget": budget, "budget_bytes": budget_bytes,
        "expert_cache_bytes": plan.get("expert_cache_bytes"), "expert_bytes": plan.get("expert_bytes"),
        "expert_share": _ratio(plan.get("expert_cache_bytes"), plan.get("expert_bytes")),
        "memory_plan": plan, "load_seconds": loaded["load_seconds"],
        "decode_tokens_per_second": statistics.median(run["decode_tokens_per_second"] for run in runs),
        "prefill_tokens_per_second": statistics.median(run["prefill_tokens_per_second"] for run in runs),
        "hit_rate": totals["expert_hits"] / requests if requests else None,
        "expert_hits": int(totals["expert_hits"]), "expert_misses": int(totals["expert_misses"]),
        "bytes_read": int(totals["bytes_read"]), "io_stall_seconds": totals["io_stall_seconds"],
        # records read per decoded token (beside the bound's floor), and prefetched ones evicted unused
        "expert_reads_per_token": (totals["expert_reads"] / decode_steps
                                   if decode_steps and "expert_reads" in final else None),
        "unused_prefetches_per_token": (totals["prefetches_evicted_unused"] / decode_steps
                                        if decode_steps and "prefetches_evicted_unused" in final else None),
        "stall_fraction": totals["io_stall_seconds"] / decode_seconds if decode_seconds else None,
        # CPU time of the model's thread (its share of the compute, and all the streaming's Python)
        "model_thread_cpu_seconds_per_token": (sum(run["decode_thread_seconds"] for run in runs) / decode_steps
                                               if decode_steps else None),
        "io_hidden_fraction": final.get("io_hidden_fraction"),
        "predictor_precision": _ratio(totals.get("predictor_hits_1"), totals.get("predictor_predicted_1")),
        "predictor_recall": _ratio(totals.get("predictor_hits_1"), totals.get("predictor_actual_1")),
        "predictor_recall_by_distance": {d: _ratio(totals[f"predictor_hits_{d}"], totals[f"predictor_actual_{d}"])
                                         for d in distances},
        "storage": final.get("storage"), "io_mode": final.get("io_mode"), "io_engine": final.get("io_engine"),
        "expert_engine": final.get("expert_engine"),
        # the RSS before the measured load, after the warm-up load (the runtime as a long-running process has it)
        "peak_rss_bytes": peak_rss, "baseline_rss_bytes": baseline, "peak_rss_over_baseline_bytes": over_baseline,
        # the whole process against the budget: peak RSS over what importing the package took (the
        # runtime's own memory, compiled kernels included, counts here as the budget counts it)
        "import_baseline_rss_bytes": loaded.get("rss_after_import_bytes"),
        "peak_rss_over_import_bytes": over_import,
        "process_within_budget": (None if budget_bytes is None or over_import is None
                                  else over_import <= budget_bytes * (1 + RSS_TOLERANCE)),
        "tokens": [run["tokens"] for run in runs],
        "runs": [{key: run[key] for key in ("prefill_seconds", "decode_seconds", "decode_tokens_per_second",
                                             "prefill_tokens_per_second", "decode_steps")} for run in runs],
    }


def check_moe_counts(prompt_tokens: int, new_tokens: int, repeats: int) -> None:
    """The sweep's sizes, checked before a model is built (the default MoE takes minutes) or loaded."""
    check_prompt_tokens(prompt_tokens)
    if new_tokens < 2 or repeats < 1:
        raise BenchError(f"the MoE benchmark decodes: --new-tokens must be at least 2 and --repeats at least 1, "
                         f"got {new_tokens} and {repeats}")
    if repeats > len(WORKLOAD_TOPICS) - 1:  # one distinct prompt per repeat, plus the warm-up's
        raise BenchError(f"the MoE benchmark runs at most {len(WORKLOAD_TOPICS) - 1} repeats (one distinct prompt "
                         f"each, plus the warm-up's), got --repeats {repeats}")


def run_moe_bench(checkpoint_path: str, budgets: list[str], strategies: list[str], storage: str | None,
                  device: str = "cpu", threads: int | None = None, prompt_tokens: int = 64, new_tokens: int = 64,
                  repeats: int = 1, prefetch_depth: int = 2, progress=None, options: str = "--memory-budget",
                  io_engine: str = "auto", expert_engine: str = "auto") -> dict:
    """Measure every (strategy, budget); returns the report (what --json writes). `options`: the command
    line options that asked for this benchmark, which a refusal of a dense checkpoint names."""
    from quant.checkpoint import read_manifest
    from streaming.storage import parse_storage

    progress = progress or (lambda message: None)
    check_moe_counts(prompt_tokens, new_tokens, repeats)
    parse_storage(storage)
    manifest = read_manifest(checkpoint_path)
    if not manifest.get("experts"):
        verb = "benchmarks" if "," not in options else "benchmark"
        raise BenchError(f"{checkpoint_path} is a dense {manifest['model']['model_type']} checkpoint; "
                         f"{options} {verb} Mixture-of-Experts checkpoints (try --random-moe)")
    context = manifest["model"]["max_position_embeddings"]
    if prompt_tokens + new_tokens > context:
        raise BenchError(f"{prompt_tokens} prompt + {new_tokens} new tokens exceed the model's context of "
                         f"{context} tokens; lower --prompt-tokens or --new-tokens")
    prompts, prompt_source = workload_prompts(checkpoint_path, prompt_tokens, repeats + 1)
    warmup_prompt, timed_prompts = prompts[-1], prompts[:-1]

    configs = [(s, RESIDENT_BUDGET if s == "resident" else b)
               for s in strategies for b in (budgets if s != "resident" else [RESIDENT_BUDGET])]
    rows = []
    for strategy, budget in configs:
        options = {**STRATEGY_OPTIONS[strategy], "memory_budget": budget, "storage": storage,
                   "prefetch_depth": prefetch_depth, "kv_capacity": prompt_tokens + new_tokens, "io_engine": io_engine,
                   "expert_engine": expert_engine}
        progress(f"{strategy} at {budget}: loading")
        try:
            worker = DeviceWorker(checkpoint_path, device, threads, options)
        except BenchError as exc:  # e.g. a budget below the minimum working set: shown, not fatal
            progress(f"{strategy} at {budget}: refused: {exc}")
            rows.append({"strategy": strategy, "budget": budget, "error": str(exc)})
            continue
        try:
            worker.run(warmup_prompt, min(new_tokens, WARMUP_NEW_TOKENS), stats=True)
            runs = [worker.run(prompt, new_tokens, stats=True) for prompt in timed_prompts]
            peak = worker.stop()
        finally:
            worker.close()
        row = summarize(strategy, budget, worker.loaded, runs, peak)
        rows.append(row)
        progress(f"{strategy} at {budget}: decode {row['decode_tokens_per_second']:.1f} tok/s, hit rate "
                 f"{_pct(row['hit_rate'])}, recall {_pct(row['predictor_recall'])}")

    resident = next((r for r in rows if r["strategy"] == "resident" and "error" not in r), None)
    for row in rows:
        if "error" not in row and resident is not None:
            row["tokens_match_resident"] = row["tokens"] == resident["tokens"]
            row["greedy_tokens_agreeing_with_resident"] = sum(
                _agreeing_prefix(a, b) for a, b in zip(row["tokens"], resident["tokens"]))
            row["decode_vs_resident"] = _ratio(row["decode_tokens_per_second"], resident["decode_tokens_per_second"])
            # the model thread's extra CPU per streamed token, as a share of a resident token's time
            row["extra_model_cpu_vs_resident_token"] = _ratio(
                row["model_thread_cpu_seconds_per_token"] - resident["model_thread_cpu_seconds_per_token"],
                1.0 / resident["decode_tokens_per_second"])
    for row in rows:
        mmap = next((r for r in rows if r["strategy"] == "mmap" and r["budget"] == row["budget"] and "error" not in r),
                    None)
        if "error" not in row and mmap is not None:
            row["decode_vs_mmap"] = _ratio(row["decode_tokens_per_second"], mmap["decode_tokens_per_second"])
    if resident is not None:
        progress("the read floor: replaying the resident run's routes")
        from streaming.prefetch import RING_DEPTH

        # the queue depth the runs read at: io_uring's reads in flight, or one per loading thread
        ring = any(row.get("io_engine") == "io_uring" for row in rows)
        add_bounds(rows, resident, checkpoint_path, manifest, device, threads, timed_prompts, storage,
                   queue_depth=RING_DEPTH if ring else StreamingOptions().prefetch_threads)
    baselines = [r["baseline_rss_bytes"] for r in rows if "error" not in r]
    return {
        "model": os.path.abspath(checkpoint_path), "model_type": manifest["model"]["model_type"],
        "device": device, "threads": threads, "storage": storage or "native", "budgets": budgets,
        "strategies": strategies, "prefetch_depth": prefetch_depth, "io_engine": io_engine,
        "expert_engine": expert_engine,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens, "decode_steps": new_tokens - 1, "repeats": repeats, "prompt_source": prompt_source,
        # (the RSS after the warm-up load, before the measured one: interpreter and warm runtime)
        "interpreter_baseline_rss_bytes": statistics.median(baselines) if baselines else None,
        "rss_tolerance": RSS_TOLERANCE, "configs": rows, "machine": machine_info(),
    }


# ---------------------------------------------------------------------------------- the bound


def resident_routes(checkpoint_path: str, device: str, threads: int | None, prompts: list[list[int]],
                    generated: list[list[int]]) -> tuple[list[tuple[int, int]], list[bool], int, int]:
    """The expert uses [(layer, expert)] of the resident runs, in execution order, re-run with the
    tokens they produced: -> (uses, which are the decode steps' (the prefills' only fill the cache),
    uses per decode step, decode steps)."""
    import edge
    from edge.bench import load_threads

    uses: list[tuple[int, int]] = []
    counted: list[bool] = []
    steps = 0

    def observer(decoding: bool):
        def observe(layer, hidden, expert_ids=None, expert_weights=None):
            if expert_ids is not None:
                experts = sorted(set(np.asarray(expert_ids).ravel().tolist()))
                uses.extend((layer, expert) for expert in experts)
                counted.extend([decoding] * len(experts))
        return observe

    with edge.load(checkpoint_path, device=device, threads=load_threads(device, threads),
                   expert_strategy="resident") as model:
        for prompt, tokens in zip(prompts, generated):
            with model.session(capacity=len(prompt) + len(tokens)) as session:
                session.prefill(prompt, observer=observer(False))
                for token in tokens[:-1]:  # the last token chosen is not run
                    session.prefill([token], observer=observer(True))
                    steps += 1
    return uses, counted, sum(counted) // max(steps, 1), steps


def add_bounds(rows: list[dict], resident: dict, checkpoint_path: str, manifest: dict, device: str, threads: int | None,
               prompts: list[list[int]], storage: str | None, queue_depth: int) -> None:
    """Beside every streamed row: the bound no expert strategy can beat, 1 / max(the resident token time
    of this run, the time the Belady read floor of its cache size takes on the disk), and the share of
    it reached. The floor counts the decode steps' reads only, each prompt's prefill having filled the
    cache before them (as it fills the streamed run's). The disk is this machine's, measured with
    O_DIRECT reads at the engine's queue depth;
    an emulated device (--storage) delivers each read no earlier than the real disk does, so with one
    the floor takes the longer of its time on either."""
    from quant.expert_file import ExpertIndex
    from streaming.budget import entry_bytes
    from streaming.floor import demand_reads, disk_throughput, read_seconds
    from streaming.storage import parse_storage
    from streaming.store import aligned_length

    uses, counted, per_step, steps = resident_routes(checkpoint_path, device, threads, prompts, resident["tokens"])
    index = ExpertIndex(checkpoint_path, manifest["experts"])
    layers = sorted(index.layers)
    entry = max(entry_bytes(index, layer) for layer in layers)
    record_bytes = max(aligned_length(index.layout(layer).raw_length) for layer in layers)
    measured = disk_throughput(index.path, record_bytes, queue_depth)
    # (bandwidth, latency per queue-full of commands) of each device a read goes through; the native
    # measurement includes the latency
    devices = {"native": (measured["gb_per_second"] * 1e9, 0.0)}
    disk = {"storage": "native", "queue_depth": queue_depth, "native_bandwidth_bytes_per_second": devices["native"][0],
            "native_reads_per_second": measured["reads_per_second"]}
    emulated = parse_storage(storage)
    if emulated is not None:
        devices[emulated.name] = (emulated.bandwidth_bytes_per_s, emulated.latency_s)
        disk.update({"storage": emulated.name, "emulated_bandwidth_bytes_per_second": emulated.bandwidth_bytes_per_s,
                     "emulated_latency_seconds": emulated.latency_s})
    resident_seconds = 1.0 / resident["decode_tokens_per_second"]
    for row in rows:
        if "error" in row or row["strategy"] == "resident" or row["expert_cache_bytes"] is None:
            continue  # (a resident run reads nothing while it decodes)
        capacity = max(1, row["expert_cache_bytes"] // entry)
        reads = demand_reads(uses, layers, per_step, capacity, "belady", counted) / max(steps, 1)
        on_device = {name: read_seconds(reads, record_bytes, bandwidth, latency, queue_depth)
                     for name, (bandwidth, latency) in devices.items()}
        slowest = max(on_device, key=on_device.get)
        floor_seconds = on_device[slowest]
        bound = 1.0 / max(resident_seconds, floor_seconds)
        row["bound"] = {"resident_seconds_per_token": resident_seconds, "floor_reads_per_token": reads,
                        "floor_bytes_per_token": reads * record_bytes, "floor_seconds_per_token": floor_seconds,
                        "floor_seconds_per_token_on": on_device, "disk": disk, "tokens_per_second": bound,
                        "limited_by": "compute" if resident_seconds >= floor_seconds else f"disk ({slowest})"}
        row["fraction_of_bound"] = row["decode_tokens_per_second"] / bound


# ---------------------------------------------------------------------------------- output


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _mb(value) -> str:
    return "-" if value is None else f"{value / 1e6:.0f}"


def _num(value, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def format_moe_table(report: dict) -> str:
    header = ["strategy", "budget", "cache MB", "decode tok/s", "vs resident", "vs mmap", "reads", "floor reads",
              "bound t/s", "bound by", "of bound", "hit rate", "recall@k", "stall", "model CPU +", "budget MB",
              "process MB", "in budget", "tokens = resident"]
    rows = [header]
    for r in report["configs"]:
        if "error" in r:
            rows.append([r["strategy"], r["budget"], "refused: " + r["error"]])
            continue
        rows.append([r["strategy"], r["budget"], _mb(r["expert_cache_bytes"]), _num(r["decode_tokens_per_second"]),
                     _num(r.get("decode_vs_resident"), ".2f"), _num(r.get("decode_vs_mmap"), ".2f"),
                     _num(r.get("expert_reads_per_token")),
                     _num((r.get("bound") or {}).get("floor_reads_per_token")),
                     _num((r.get("bound") or {}).get("tokens_per_second")), (r.get("bound") or {}).get("limited_by", "-"),
                     _num(r.get("fraction_of_bound"), ".2f"),
                     _pct(r["hit_rate"]), _pct(r["predictor_recall"]), _pct(r["stall_fraction"]),
                     _pct(r.get("extra_model_cpu_vs_resident_token")),
                     _mb(r["budget_bytes"]), _mb(r.get("peak_rss_over_import_bytes")),
                     {None: "-", True: "yes", False: "NO"}[r.get("process_within_budget")],
                     {None: "-", True: "yes", False: "NO"}[r.get("tokens_match_resident")]])
    lines = [f"zllm-edge bench {report['model']} ({report['model_type']}) on {report['device']}, storage "
             f"{report['storage']}, prefetch depth {report['prefetch_depth']}",
             f"prompt: {report['prompt_tokens']} tokens ({report['prompt_source']}); {report['new_tokens']} greedy "
             f"tokens; {report['repeats']} timed run(s) per config, each in its own process",
             "streamed experts: " + (", ".join(sorted({str(r.get("expert_engine")) for r in report["configs"]
                                                       if r.get("expert_engine")})) or "-"),
             "reads: expert records read per decoded token; floor reads: expert reads per token an omniscient (Belady) cache of that size needs, replaying the "
             "resident run's routes; bound t/s: 1 / max(resident token time, the floor's reads on the disk: on the "
             "slower of the emulated device and this machine's disk, which every emulated read also goes through); "
             "model CPU +: the model thread's CPU per token over the resident run's, as a share of a resident token's "
             "time; process MB: peak RSS over the RSS after importing the package (the runtime's own memory "
             "counted)"]
    return "\n".join(lines + aligned_rows(rows, left=2))


def aligned_rows(rows: list[list[str]], left: int) -> list[str]:
    """A table's lines: rows[0] the header, then a rule; the first `left` columns left-aligned, the others
    right-aligned; a row of another length than the header's (a refusal) joined as it is."""
    header = rows[0]
    widths = [max(len(row[i]) for row in rows if len(row) == len(header)) for i in range(len(header))]
    lines = []
    for i, row in enumerate(rows):
        if len(row) != len(header):
            lines.append("  ".join(row))
            continue
        cells = [cell.ljust(w) if j < left else cell.rjust(w) for j, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def plot_moe_report(report: dict, path: str) -> None:
    """Decode tokens/s and hit rate against the budget's expert share, one line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (speed, hits) = plt.subplots(1, 2, figsize=(11, 4.2))
    rows = [r for r in report["configs"] if "error" not in r]
    for strategy in report["strategies"]:
        mine = sorted((r for r in rows if r["strategy"] == strategy), key=lambda r: r["expert_share"] or 0)
        if not mine:
            continue
        if strategy == "resident":
            speed.axhline(mine[0]["decode_tokens_per_second"], linestyle="--", color="gray", label="resident")
            continue
        shares = [100 * (r["expert_share"] or 0) for r in mine]
        speed.plot(shares, [r["decode_tokens_per_second"] for r in mine], marker="o", label=strategy)
        hits.plot(shares, [100 * (r["hit_rate"] or 0) for r in mine], marker="o", label=strategy)
    speed.set(xlabel="expert cache (% of all expert bytes)", ylabel="decode tokens/s", ylim=(0, None))
    hits.set(xlabel="expert cache (% of all expert bytes)", ylabel="expert hit rate (%)", ylim=(0, 105))
    for axis in (speed, hits):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(f"{os.path.basename(report['model'])} on {report['device']}, storage {report['storage']}")
    figure.tight_layout()
    try:
        from edge.core.files import write_output

        write_output(path, lambda f: figure.savefig(f, format="png", dpi=120), binary=True)
    finally:
        plt.close(figure)


def cmd_bench_moe(args) -> int:
    from edge.bench import load_threads
    from edge.home import default_moe_checkpoint, home_dir
    from edge.options import LoadOptions
    from streaming.storage import parse_storage

    if len([d for d in args.device.split(",") if d.strip()]) != 1:
        raise BenchError(f"--memory-budget benchmarks one device at a time, got --device {args.device}")
    budgets = parse_budgets(args.memory_budget or "25%,50%,75%,100%")
    strategies = parse_strategies(args.strategies)
    check_moe_counts(args.prompt_tokens, args.new_tokens, args.repeats)
    parse_storage(args.storage)
    # the device, --threads and --prefetch-depth as every configuration's edge.load will check them: before the
    # default MoE is built (minutes), not as a refusal of every configuration after it
    device = args.device.strip()
    LoadOptions.of(device, load_threads(device, args.threads), prefetch_depth=args.prefetch_depth,
                   io_engine=args.io_engine, expert_engine=args.expert_engine)
    if args.plot:
        try:  # checked before the sweep, not after minutes of it
            import matplotlib  # noqa: F401
        except ImportError:
            raise BenchError("--plot needs matplotlib: pip install 'zllm-edge[bench]' (or matplotlib)") from None
    if args.random_moe:
        if args.model:
            raise BenchError("give either a MODEL or --random-moe, not both")
        from edge.random_moe import SHAPES, random_moe_checkpoint

        if args.random_moe not in SHAPES:
            raise BenchError(f"--random-moe {args.random_moe!r} is not a shape here; choose one of {', '.join(SHAPES)}")
        path = random_moe_checkpoint(home_dir(), SHAPES[args.random_moe], progress=not args.quiet)
    else:
        path = args.model or default_moe_checkpoint(progress=not args.quiet)
    progress = None if args.quiet else (lambda message: print(f"[bench] {message}", file=sys.stderr, flush=True))
    given = [option for option, value in (("--memory-budget", args.memory_budget), ("--storage", args.storage),
                                          ("--plot", args.plot)) if value is not None]
    report = run_moe_bench(path, budgets, strategies, args.storage, device=device, threads=args.threads,
                           prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, repeats=args.repeats,
                           prefetch_depth=args.prefetch_depth, progress=progress,
                           options=", ".join(given) or "--memory-budget", io_engine=args.io_engine,
                           expert_engine=args.expert_engine)
    emit_report(format_moe_table(report), report, args.json)
    refused = [row for row in report["configs"] if "error" in row]
    if len(refused) == len(report["configs"]):  # nothing measured: a failure, not a report
        raise BenchError(f"no configuration could run: all {len(refused)} were refused (the first: "
                         f"{refused[0]['error']})")
    if args.plot:
        plot_moe_report(report, args.plot)
    return 0
