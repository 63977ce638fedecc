"""`zllm-edge bench`: load time, prefill and decode speed, time to first token and peak memory of
one checkpoint on one or several devices, side by side.

Each device runs in its own worker process (spawned, so its peak RSS is its own and one device's
allocations do not pollute another's). Workers load the model once, run one untimed warm-up
(it reports the cold first-token time, which includes any JIT compilation), then the repeats
alternate between devices - device A, device B, device A, ... - so that drifts of a noisy
machine (frequency, page cache, neighbours) hit every device alike; the table reports medians.

A run is greedy, as `generate` is: prefill the fixed prompt, then decode one token at a time
through the session API (`session.next_token`, which returns the argmax of the last logits: a
device that picks it itself, such as gpu, reads back one id instead of the logits). Only those
calls are timed, bookkeeping is not. The run does not stop at end-of-sequence tokens: every
device does the same amount of work. A gpu's upload time and device memory (its buffers: weights,
KV cache, scratch, expert cache) are reported beside the other rows.

NPU execution providers that cannot share this Python environment (onnxruntime-openvino replaces
onnxruntime; onnxruntime-qnn pins its own range) run in virtualenvs of their own
(devices/npu/provider_envs.py): `--device cpu,npu:cpu,npu:openvino,npu:qnn` measures each provider in
one run, the worker of `npu:openvino` spawned with the OpenVINO environment's python when this
environment's onnxruntime lacks OpenVINO (the environment is built on first use). A worker checks that
its graphs run on the provider it was asked for. A device that is unavailable here (its environment
cannot be built, its runtime is missing) gets a column saying why instead of numbers; the first
device, the baseline, must run.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import platform
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np
import psutil

from devices.base import DeviceUnavailableError, split_device_list
from edge.core.errors import InvalidArgumentError, ZllmError
from edge.core.process_memory import peak_rss_bytes, resident_bytes
from streaming.options import EXPERT_ENGINES, IO_ENGINES

PROMPT_TOPIC = "execmodel"  # pydoc_data.topics entry the text prompt is cut from: plain English prose
PROMPT_SEED = 0
WARMUP_NEW_TOKENS = 2  # one prefill plus one decode step: enough to compile every kernel a run uses
WARMUP_PROMPT_TOKENS = 8  # the runtime warm-up's prompt (_warm_up_runtime), shortened to fit a smaller KV reservation
# Thread pools a backend may draw on. `--threads N` caps all of them, so that a device cannot win
# by quietly using more cores than another.
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
MAX_REPEATS = 100  # timed runs per device: a median of more tells nothing new


def load_threads(device: str, threads: int | None) -> int | None:
    """The `threads` edge.load takes for `device`: the gpu schedules its own work and the reference is
    numpy's (both refuse a count), so there --threads only caps the host's thread pools (THREAD_ENV_VARS)."""
    return None if device.partition(":")[0] in ("gpu", "reference") else threads


def check_prompt_tokens(n_tokens: int) -> None:
    if n_tokens < 1:
        raise BenchError(f"the prompt needs at least 1 token, got --prompt-tokens {n_tokens}")


def check_counts(prompt_tokens: int, new_tokens: int, repeats: int) -> None:
    """The run's sizes, checked before a model is built, converted or loaded."""
    check_prompt_tokens(prompt_tokens)
    if new_tokens < 1 or repeats < 1:
        raise BenchError(f"--new-tokens and --repeats must be at least 1, got {new_tokens} and {repeats}")
    if repeats > MAX_REPEATS:
        raise BenchError(f"--repeats must be at most {MAX_REPEATS}, got {repeats}: the median of more runs says "
                         "nothing new, and a count that large would run for days")


def check_device_names(devices: list[str]) -> None:
    """Every device names a known kind, and a variant after any ':' (what the variant and settings mean is
    its worker's to check): a typo is a usage error before the default model is converted, not a failed
    column after it."""
    from devices.base import device_name_problem

    for device in devices:
        problem = device_name_problem(device.partition(",")[0])
        if problem:
            raise InvalidArgumentError(f"device {device}: {problem}")  # the words of a worker's refusal


class BenchError(ZllmError):
    """A benchmark cannot run as asked (bad counts, a device that fails to load or run)."""


class BenchDeviceUnavailable(BenchError):
    """A device cannot load here (DeviceUnavailableError in its worker); the message says why."""


# ---------------------------------------------------------------------------------- prompt


def text_prompt(tokenizer, n_tokens: int) -> list[int]:
    """n_tokens ids of real text: a Python documentation topic, tokenized, repeated and cut to length."""
    from pydoc_data.topics import topics

    body = tokenizer.encode(topics[PROMPT_TOPIC], add_special_tokens=False)
    prefix = [tokenizer.bos_token_id] if tokenizer.add_bos_token and tokenizer.bos_token_id is not None else []
    repeats = -(-max(n_tokens - len(prefix), 0) // len(body))
    return (prefix + body * repeats)[:n_tokens]


def id_prompt(vocab_size: int, special_ids: set[int], n_tokens: int, seed: int = PROMPT_SEED) -> list[int]:
    """n_tokens deterministic ids for a model without a tokenizer, avoiding its special tokens."""
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(special_ids, dtype=np.int64, count=len(special_ids)))
    picks = np.random.default_rng(seed).integers(0, len(allowed), size=n_tokens)
    return [int(i) for i in allowed[picks]]


def benchmark_prompt(checkpoint_path: str, n_tokens: int) -> tuple[list[int], str]:
    """The benchmark's prompt ids for a checkpoint and where they come from."""
    from edge.core.spec import spec_from_dict
    from edge.tokenizer import Tokenizer
    from quant.checkpoint import open_checkpoint

    check_prompt_tokens(n_tokens)
    with open_checkpoint(checkpoint_path) as checkpoint:
        spec = spec_from_dict(checkpoint.model_config)
        config = checkpoint.tokenizer_config
        if checkpoint.tokenizer_path:
            tokenizer = Tokenizer(checkpoint.tokenizer_path, config)
            source = (f"pydoc_data.topics[{PROMPT_TOPIC!r}] of Python {platform.python_version()}, "
                      f"tokenized, repeated and cut to {n_tokens} tokens")
            return text_prompt(tokenizer, n_tokens), source
    special = {config.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    special |= set(config.get("eog_token_ids") or [])
    special.discard(None)
    source = f"no tokenizer: {n_tokens} ids drawn by numpy default_rng({PROMPT_SEED}), special tokens excluded"
    return id_prompt(spec.vocab_size, special, n_tokens), source


# ---------------------------------------------------------------------------------- measuring


@dataclass
class RunTimes:
    prefill_seconds: float
    decode_seconds: float  # sum over the decode calls only
    time_to_first_token_seconds: float
    prompt_tokens: int
    decode_steps: int
    tokens: list[int]  # the greedy tokens, the first one from the prefill
    decode_thread_seconds: float = 0.0  # CPU time of the calling thread in the decode calls

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds

    @property
    def decode_tokens_per_second(self) -> float | None:
        return self.decode_steps / self.decode_seconds if self.decode_steps else None

    def as_dict(self) -> dict:
        return {**asdict(self), "prefill_tokens_per_second": self.prefill_tokens_per_second,
                "decode_tokens_per_second": self.decode_tokens_per_second}


def greedy_run(model, prompt_ids: list[int], new_tokens: int, after_prefill=None) -> RunTimes:
    """Prefill prompt_ids, then decode greedily until new_tokens tokens exist; time the model calls.

    `after_prefill()`, when given, is called untimed between the prefill and the first decode step
    (the MoE benchmark snapshots the model's streaming counters there)."""
    with model.session(capacity=len(prompt_ids) + new_tokens) as session:
        started = time.perf_counter()
        token = session.next_token(prompt_ids)
        prefill_seconds = time_to_first_token = time.perf_counter() - started
        if after_prefill is not None:
            after_prefill()
        tokens, decode_seconds, decode_thread_seconds = [token], 0.0, 0.0
        for _ in range(new_tokens - 1):
            step_started, step_cpu_started = time.perf_counter(), time.thread_time()
            token = session.next_token([token])
            decode_seconds += time.perf_counter() - step_started
            decode_thread_seconds += time.thread_time() - step_cpu_started
            tokens.append(token)
    return RunTimes(prefill_seconds, decode_seconds, time_to_first_token, len(prompt_ids), new_tokens - 1, tokens,
                    decode_thread_seconds)


class PeakRSSSampler:
    """Peak RSS where the OS keeps no high-water mark: a daemon thread samples RSS every few ms."""

    def __init__(self, interval_seconds: float = 0.005):
        self.peak = psutil.Process().memory_info().rss
        self._interval = interval_seconds
        self._process = psutil.Process()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="peak-rss")
        self._thread.start()

    def _sample(self) -> None:
        while not self._stopped.wait(self._interval):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def stop(self) -> int:
        self._stopped.set()
        self._thread.join()
        return max(self.peak, psutil.Process().memory_info().rss)


# ---------------------------------------------------------------------------------- workers


def _device_worker(connection, checkpoint_path: str, device: str, threads: int | None,
                   load_options: dict | None = None) -> None:
    """Body of a device's worker process: load, then answer run/stop commands on `connection`.

    `load_options` are further keyword arguments of `edge.load` (memory budget, expert strategy...).
    A run command with "stats" also returns `model.stats()` after the prefill and after the run."""
    import edge

    # the interpreter and the package's import: what a memory budget is compared above (the runtime's
    # own modules, imported by the first load, are counted in the budget: edge/core/process_memory.py)
    rss_after_import = resident_bytes()
    try:
        if load_options is not None and _reset_peak_rss():
            _warm_up_runtime(checkpoint_path, device, threads, load_options)
        sampler = PeakRSSSampler() if peak_rss_bytes() is None else None
        rss_before_load = resident_bytes()
        started = time.perf_counter()
        model = edge.load(checkpoint_path, device=device, threads=load_threads(device, threads),
                          **(load_options or {}))
        load_seconds = time.perf_counter() - started
        _verify_device(device, model)
        connection.send({"event": "loaded", "load_seconds": load_seconds, "device_info": model.device_info(),
                         "weight_bytes": model.weight_bytes, "rss_before_load_bytes": rss_before_load,
                         "rss_after_import_bytes": rss_after_import,
                         "rss_after_load_bytes": resident_bytes(),
                         "memory_plan": model.memory.to_dict()})
        while True:
            try:
                command = connection.recv()
            except EOFError:  # the parent went away (it failed elsewhere): nothing left to answer
                return
            if command["cmd"] == "stop":
                peak = sampler.stop() if sampler else peak_rss_bytes()
                connection.send({"event": "stopped", "peak_rss_bytes": peak})
                return
            snapshots = {}
            after_prefill = (lambda: snapshots.update(stats_after_prefill=model.stats())) if command.get("stats") else None
            run = greedy_run(model, command["prompt_ids"], command["new_tokens"], after_prefill)
            if command.get("stats"):
                snapshots["stats"] = model.stats()
            text = model.decode(run.tokens) if model.tokenizer else None
            _verify_device(device, model)  # graphs of new shapes (static prefill chunks) exist now
            connection.send({"event": "ran", **run.as_dict(), "text": text, "device_info": model.device_info(),
                             **snapshots})
    except Exception as exc:  # forwarded whole to the parent, which raises it as a BenchError
        expected = isinstance(exc, ZllmError)  # errors zllm-edge raises on purpose carry their own wording
        connection.send({"event": "error", "message": str(exc) if expected else f"{type(exc).__name__}: {exc}",
                         "unavailable": isinstance(exc, DeviceUnavailableError)})


def _verify_device(device: str, model) -> None:
    """An `npu:<provider>` model must run on that provider (no node elsewhere unless allowed)."""
    if device.partition(":")[0] == "npu":
        from devices.npu.provider_envs import verify_provider

        verify_provider(device, model.device_info())


def _reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS count (VmHWM) at the current RSS; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: "5" resets the peak resident set size
        return True
    except OSError:
        return False


def _warm_up_runtime(checkpoint_path: str, device: str, threads: int | None, load_options: dict) -> None:
    """Load the model, run a few tokens, close it, give its freed memory back to the OS, then
    restart the peak-RSS count.

    What stays resident afterwards is the runtime itself: the interpreter, libraries and the
    device's compiled kernels, as a long-running process has them. The measured load's plan counts
    that runtime (edge/core/process_memory.py measured it during this load), and the budget is
    compared with the peak RSS over the RSS after importing the package; the RSS measured after
    this (the row's baseline_rss_bytes) is reported beside it."""
    import gc

    import edge
    from edge.core.process_memory import release_free_heap

    # short enough for the KV positions the run reserves (the MoE benchmark reserves prompt + new tokens)
    capacity = load_options.get("kv_capacity") or WARMUP_PROMPT_TOKENS + WARMUP_NEW_TOKENS
    n_prompt = max(1, min(WARMUP_PROMPT_TOKENS, capacity - WARMUP_NEW_TOKENS))
    with edge.load(checkpoint_path, device=device, threads=load_threads(device, threads), **load_options) as model:
        vocab = model.spec.vocab_size
        greedy_run(model, [i % vocab for i in range(1, n_prompt + 1)], min(WARMUP_NEW_TOKENS, capacity - n_prompt))
    del model
    gc.collect()
    release_free_heap()
    _reset_peak_rss()


@contextmanager
def thread_limits(threads: int | None):
    """Cap the thread pools of processes started inside this block (they read these at start)."""
    saved = {name: os.environ.get(name) for name in THREAD_ENV_VARS}
    if threads is not None:
        os.environ.update({name: str(threads) for name in THREAD_ENV_VARS})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def worker_python(device: str, progress=None) -> str | None:
    """The interpreter a device's worker runs in: None for this one. `npu:<provider>` whose provider
    this environment's onnxruntime lacks, but which has a virtualenv of its own
    (devices/npu/provider_envs.py), runs in that environment (built on first use; raises
    ProviderEnvUnavailable when it cannot be)."""
    kind, _, variant = device.partition(":")
    provider = variant.split(",")[0]
    if kind != "npu":
        return None
    from devices.npu.provider_envs import PROVIDER_REQUIREMENTS, provider_env_python

    if provider not in PROVIDER_REQUIREMENTS or _provider_in_this_environment(provider):
        return None
    return str(provider_env_python(provider, progress))


def _provider_in_this_environment(provider: str) -> bool:
    from devices.npu.providers import BY_KEY, available_providers

    try:
        import onnxruntime
    except ImportError:
        return False
    return BY_KEY[provider].ep_name in available_providers(onnxruntime)


@contextmanager
def worker_interpreter(python: str | None):
    """Processes spawned inside this block run `python` (None: this interpreter) with its own module
    search path. A spawned child replaces its sys.path with the parent's; the other environment's
    own site-packages must come first there, ahead of this environment's onnxruntime."""
    if python is None:
        yield
        return
    from multiprocessing import spawn

    from devices.npu.provider_envs import env_sys_path

    child_path = env_sys_path(python)
    child_path += [entry for entry in sys.path if entry not in child_path]  # this project, when not installed
    saved_executable, saved_path = spawn.get_executable(), sys.path[:]
    spawn.set_executable(python)
    sys.path[:] = child_path
    try:
        yield
    finally:
        spawn.set_executable(saved_executable)
        sys.path[:] = saved_path


class DeviceWorker:
    """A spawned process holding one model on one device (run by `python`; None: this interpreter)."""

    def __init__(self, checkpoint_path: str, device: str, threads: int | None, load_options: dict | None = None,
                 python: str | None = None):
        self.device = device
        context = multiprocessing.get_context("spawn")
        self._connection, child_end = context.Pipe()
        self._process = context.Process(target=_device_worker,
                                        args=(child_end, checkpoint_path, device, threads, load_options),
                                        name=f"zllm-bench-{device}", daemon=True)
        with thread_limits(threads), worker_interpreter(python):
            self._process.start()
        child_end.close()
        self.loaded = self._receive("loaded")

    def _receive(self, expected: str) -> dict:
        try:
            message = self._connection.recv()
        except EOFError:
            self._process.join(5)
            raise BenchError(f"the {self.device} worker died (exit code {self._process.exitcode}) "
                             "before answering; run with a single device to see its output") from None
        if message["event"] == "error":
            self.close()
            error = BenchDeviceUnavailable if message.get("unavailable") else BenchError
            raise error(f"device {self.device}: {message['message']}")
        if message["event"] != expected:
            raise BenchError(f"device {self.device}: worker answered {message['event']!r}, expected {expected!r}")
        return message

    def run(self, prompt_ids: list[int], new_tokens: int, stats: bool = False) -> dict:
        self._connection.send({"cmd": "run", "prompt_ids": prompt_ids, "new_tokens": new_tokens, "stats": stats})
        result = self._receive("ran")
        del result["event"]
        return result

    def stop(self) -> int | None:
        self._connection.send({"cmd": "stop"})
        peak = self._receive("stopped")["peak_rss_bytes"]
        self.close()
        return peak

    def close(self) -> None:
        self._connection.close()  # a worker waiting for a command sees EOF and returns
        self._process.join(5)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join()


# ---------------------------------------------------------------------------------- the benchmark


def device_labels(devices: list[str]) -> list[str]:
    """Column names: the device itself, with #2, #3 for repeats (an A/A run shows the noise floor)."""
    labels, seen = [], {}
    for device in devices:
        seen[device] = seen.get(device, 0) + 1
        labels.append(device if seen[device] == 1 else f"{device}#{seen[device]}")
    return labels


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


SUMMARY_METRICS = ("load_seconds", "cold_time_to_first_token_seconds", "prefill_tokens_per_second",
                   "decode_tokens_per_second", "time_to_first_token_seconds", "peak_rss_bytes",
                   "device_upload_seconds", "device_memory_bytes")


def device_figures(device_info: dict) -> dict:
    """A device's own memory and upload time, where it has them (gpu): seconds spent uploading weights
    and experts, and the bytes of its buffers (peak over the runs, and held by weights and experts)."""
    memory = device_info.get("memory_bytes")
    if memory is None:
        return {"device_upload_seconds": None, "device_memory_bytes": None, "device_memory": None}
    return {"device_upload_seconds": device_info.get("upload_seconds"),
            "device_memory_bytes": memory["peak_allocated"], "device_memory": memory}


def run_bench(checkpoint_path: str, devices: list[str], threads: int | None = None, prompt_tokens: int = 128,
              new_tokens: int = 128, repeats: int = 3, progress=None, prompt_ids: list[int] | None = None) -> dict:
    """Measure every device; returns the report (what --json prints). progress(str) gets status lines."""
    progress = progress or (lambda message: None)
    if not devices:
        raise BenchError("name at least one device, e.g. --device reference")
    check_counts(prompt_tokens if prompt_ids is None else len(prompt_ids), new_tokens, repeats)
    from quant.checkpoint import read_manifest

    manifest = read_manifest(checkpoint_path)
    context = manifest["model"]["max_position_embeddings"]
    n_prompt = prompt_tokens if prompt_ids is None else len(prompt_ids)
    if n_prompt + new_tokens > context:  # before a prompt of that many tokens is made
        raise BenchError(f"{n_prompt} prompt + {new_tokens} new tokens exceed the model's context of "
                         f"{context} tokens; lower --prompt-tokens or --new-tokens")
    if prompt_ids is None:
        prompt_ids, prompt_source = benchmark_prompt(checkpoint_path, prompt_tokens)
    else:
        prompt_source = "token ids given by the caller"

    labels = device_labels(devices)
    workers: dict[str, DeviceWorker] = {}
    results: dict[str, dict] = {}
    try:
        for device, label in zip(devices, labels):
            progress(f"loading {checkpoint_path} on {device}")
            try:  # graphs may compile at the first run: a device that cannot run the warm-up is unavailable too
                python = worker_python(device, progress)
                worker = workers[label] = DeviceWorker(checkpoint_path, device, threads, python=python)
                progress(f"{label}: loaded in {worker.loaded['load_seconds']:.2f} s; warm-up run")
                warmup = worker.run(prompt_ids, min(new_tokens, WARMUP_NEW_TOKENS))
            except (DeviceUnavailableError, BenchDeviceUnavailable) as exc:
                workers.pop(label, None)
                reason = str(exc) if isinstance(exc, BenchError) else f"device {device}: {exc}"
                if label == labels[0]:  # the baseline of every ratio must run
                    raise BenchError(reason) from None
                progress(f"{label}: unavailable: {reason}")
                results[label] = {"device": device, "unavailable": reason}
                continue
            results[label] = {"device": device, "device_info": worker.loaded["device_info"],
                               "load_seconds": worker.loaded["load_seconds"],
                               "weight_bytes": worker.loaded["weight_bytes"],
                               "rss_after_load_bytes": worker.loaded["rss_after_load_bytes"],
                               "cold_time_to_first_token_seconds": warmup["time_to_first_token_seconds"],
                               "runs": []}
            if python is not None:  # a provider's own environment
                results[label]["python"] = python
        for repeat in range(repeats):
            for device, worker in workers.items():  # alternate: every repeat visits every device
                run = worker.run(prompt_ids, new_tokens)
                results[device]["runs"].append(run)
                decode = run["decode_tokens_per_second"]
                progress(f"repeat {repeat + 1}/{repeats} {device}: prefill {run['prefill_tokens_per_second']:.1f} "
                         f"tok/s, decode {'-' if decode is None else f'{decode:.1f}'} tok/s")
        for device, worker in list(workers.items()):
            results[device]["peak_rss_bytes"] = worker.stop()
            del workers[device]
    finally:
        for worker in workers.values():
            worker.close()

    measured = [label for label in labels if "unavailable" not in results[label]]
    for result in (results[label] for label in measured):
        runs = result["runs"]
        for key in ("prefill_tokens_per_second", "decode_tokens_per_second", "time_to_first_token_seconds",
                    "prefill_seconds", "decode_seconds"):
            result[key] = _median(run[key] for run in runs)
        result["tokens"], result["text"] = runs[0]["tokens"], runs[0]["text"]
        last_info = runs[-1].pop("device_info")
        if "placement" in last_info:  # npu: graphs of every shape the runs used, and where their nodes ran
            result["placement"] = last_info["placement"]
        result.update(device_figures(last_info))
        for run in runs[:-1]:
            del run["device_info"]
        result["tokens_identical_across_repeats"] = all(run["tokens"] == runs[0]["tokens"] for run in runs)
    baseline = labels[0]
    for device in measured:
        results[device]["greedy_tokens_agreeing_with_" + baseline] = _agreeing_prefix(
            results[device]["tokens"], results[baseline]["tokens"])
    ratios = {}
    for device in measured[1:]:
        ratios[f"{device}/{baseline}"] = {
            key: (results[device][key] / results[baseline][key]
                  if results[device].get(key) and results[baseline].get(key) else None)
            for key in SUMMARY_METRICS
        }
    return {
        "model": os.path.abspath(checkpoint_path),
        "model_type": manifest["model"]["model_type"],
        "prompt_tokens": len(prompt_ids),
        "prompt_source": prompt_source,
        "new_tokens": new_tokens,
        "decode_steps": new_tokens - 1,
        "repeats": repeats,
        "threads": threads,
        "devices": results,
        "ratios": ratios,
        "machine": machine_info(),
    }


def machine_info() -> dict:
    return {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "logical_cpus": os.cpu_count(), "memory_bytes": psutil.virtual_memory().total,
            "python": platform.python_version(), "numpy": np.__version__}


# ---------------------------------------------------------------------------------- output


def _format_value(key: str, value) -> str:
    if value is None:
        return "-"
    if key in ("peak_rss_bytes", "device_memory_bytes"):
        return f"{value / 1e6:.0f}"
    if key == "device_upload_seconds":
        return f"{value:.3f}"
    if key.endswith("_seconds"):
        return f"{value * 1000:.1f}" if "first_token" in key else f"{value:.2f}"
    return f"{value:.1f}"


ROW_LABELS = {
    "load_seconds": "load (s)",
    "cold_time_to_first_token_seconds": "cold first token, incl. JIT (ms)",
    "prefill_tokens_per_second": "prefill (tokens/s)",
    "decode_tokens_per_second": "decode (tokens/s)",
    "time_to_first_token_seconds": "time to first token (ms)",
    "peak_rss_bytes": "peak RSS (MB)",
    "device_upload_seconds": "upload to device (s)",
    "device_memory_bytes": "device memory, peak (MB)",
}


def format_table(report: dict) -> str:
    devices = list(report["devices"])
    baseline = devices[0]
    ratio_names = list(report["ratios"])
    header = ["metric", *devices, *ratio_names]
    rows = [header]
    for key, label in ROW_LABELS.items():
        row = [label, *(_format_value(key, report["devices"][d].get(key)) for d in devices)]
        for name in ratio_names:
            ratio = report["ratios"][name][key]
            row.append("-" if ratio is None else f"{ratio:.2f}x")
        rows.append(row)
    agree_key = "greedy_tokens_agreeing_with_" + baseline
    rows.append([f"greedy tokens agreeing with {baseline}",
                 *(f"{report['devices'][d][agree_key]}/{report['new_tokens']}" if agree_key in report["devices"][d]
                   else "-" for d in devices),
                 *([""] * len(ratio_names))])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [f"zllm-edge bench {report['model']} ({report['model_type']})",
             f"prompt: {report['prompt_tokens']} tokens ({report['prompt_source']}); {report['new_tokens']} greedy "
             f"tokens ({report['decode_steps']} decode steps); threads {report['threads'] or 'default'}; "
             f"median of {report['repeats']} repeats, devices alternating"]
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[j]) if j == 0 else cell.rjust(widths[j]) for j, cell in enumerate(row)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines + _device_notes(report))


def _device_notes(report: dict) -> list[str]:
    """Under the table: what each npu column ran on (provider, onnxruntime, environment, the
    provider's warnings, e.g. the automatic choice of the CPU provider) and why a column has no numbers."""
    notes, main_python = [], sys.executable
    for label, result in report["devices"].items():
        if "unavailable" in result:
            notes.append(f"{label}: unavailable: {result['unavailable']}")
            continue
        info = result["device_info"]
        if "provider" in info:
            environment = "" if result.get("python", main_python) == main_python else f", python {result['python']}"
            nodes = {}
            for graph in (result.get("placement") or {}).values():
                for provider, entry in graph.items():
                    nodes[provider] = nodes.get(provider, 0) + entry["nodes"]
            elsewhere = {provider: n for provider, n in nodes.items() if provider != info["provider"]}
            placed = (f"; graph nodes: {', '.join(f'{n} on {provider}' for provider, n in nodes.items())}"
                      if elsewhere else "")
            notes.append(f"{label}: {info['provider']} ({info['backend']}){environment}{placed}")
            notes.extend(f"  {warning}" for warning in info.get("warnings", []))
    return notes


# ---------------------------------------------------------------------------------- CLI


def add_arguments(parser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="checkpoint (default: the built-in default model)")
    parser.add_argument("--device", default="reference",
                        help="device, or several separated by commas to compare side by side: reference,cpu "
                             "(the first is the baseline of the ratios; naming one twice measures the noise floor). "
                             "npu picks the best provider this environment has; to compare providers in one run "
                             "name them: cpu,npu:cpu,npu:openvino,npu:qnn (openvino and qnn run in virtualenvs "
                             "of their own, built on first use; one that cannot be built is reported as unavailable)")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for every device (caps BLAS/Numba pools; the gpu's host side only)")
    parser.add_argument("--prompt-tokens", type=int, default=128,
                        help="prompt length: Python's own docs tokenized and cut to N (seeded ids without a tokenizer)")
    parser.add_argument("--new-tokens", type=int, default=128, help="greedy tokens to generate (the first from prefill)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per device, alternating; median reported")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON to FILE ('-': stdout)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    moe = parser.add_argument_group("Mixture-of-Experts memory budgets (edge/bench_moe.py)")
    moe.add_argument("--memory-budget", default=None, metavar="LIST",
                     help="budgets to sweep, e.g. 25%%,50%%,75%%,100%% (share of expert bytes) or 512MB; "
                          "benchmarks expert strategies instead of devices (default model: the MoEfied SmolLM2)")
    moe.add_argument("--storage", default=None, help="emulated storage: nvme, ufs, emmc, sd or custom:bw=...,lat=...")
    moe.add_argument("--strategies", default="resident,mmap,ondemand,predictive",
                     help="expert strategies to compare (resident runs once, at 100%%)")
    moe.add_argument("--prefetch-depth", type=int, default=2, help="MoE layers ahead the predictor prefetches")
    moe.add_argument("--io-engine", choices=IO_ENGINES, default="auto",
                     help="how streamed experts are read (edge.load's io_engine)")
    moe.add_argument("--expert-engine", choices=EXPERT_ENGINES, default="auto",
                     help="which expert cache streams them (edge.load's expert_engine)")
    moe.add_argument("--plot", default=None, metavar="FILE.png", help="plot tokens/s and hit rate against the budget")
    moe.add_argument("--random-moe", nargs="?", const="stress", default=None, metavar="SHAPE",
                     help="benchmark a built-in random MoE (built on first use): stress (the default: the I/O "
                          "stress case), olmoe-1b-7b or qwen3-30b-a3b (those models' shapes)")


def cmd_bench(args) -> int:
    from edge.core.arguments import integer, writable_file
    from edge.home import default_model_checkpoint

    # checked before any model is built or converted, and before minutes of measuring
    if args.threads is not None:
        integer("--threads", args.threads, minimum=1)
    writable_file("--json", args.json)
    writable_file("--plot", args.plot, suffix=".png")
    if args.memory_budget is not None or args.random_moe or args.plot or args.storage:
        from edge.bench_moe import cmd_bench_moe

        return cmd_bench_moe(args)
    devices = split_device_list(args.device)
    if not devices:
        raise BenchError("name at least one device, e.g. --device reference")
    check_device_names(devices)
    check_counts(args.prompt_tokens, args.new_tokens, args.repeats)
    path = args.model or default_model_checkpoint(progress=not args.quiet)
    progress = None if args.quiet else (lambda message: print(f"[bench] {message}", file=sys.stderr, flush=True))
    report = run_bench(path, devices, threads=args.threads, prompt_tokens=args.prompt_tokens,
                       new_tokens=args.new_tokens, repeats=args.repeats, progress=progress)
    emit_report(format_table(report), report, args.json)
    return 0


def emit_report(table: str, report: dict, json_target: str | None) -> None:
    """The table on stdout and the JSON into a file; with `--json -`, JSON on stdout and the table on stderr."""
    if json_target == "-":
        print(table, file=sys.stderr)
        print(json.dumps(report, indent=1))
    else:
        print(table)
        if json_target:
            from edge.core.files import write_output

            write_output(json_target, lambda f: json.dump(report, f, indent=1))
