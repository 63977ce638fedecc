"""Virtual environments for the peer engines of benchmarks/peers.py.

Each peer that needs packages we do not want in the project's environment (a llama.cpp built
with portable flags, onnxruntime-genai and its model builder) gets its own venv under
`$ZLLM_EDGE_HOME/bench-envs/<name>` (default ~/.cache/zllm-edge/bench-envs). A venv is built
once and reused: a marker file records what it was built from, and a venv whose marker does
not match the request is built again. pip's output goes to `<venv>/install.log`; a failed
build raises PeerUnavailable with the log's tail, so the benchmark can report why.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import venv
from dataclasses import asdict, dataclass, field

MARKER = "zllm-bench-env.json"


class PeerUnavailable(RuntimeError):
    """A peer engine cannot be set up or run here; the message says why."""


def bench_envs_dir() -> str:
    from edge.home import home_dir

    return os.path.join(home_dir(), "bench-envs")


@dataclass(frozen=True)
class EnvSpec:
    name: str
    requirements: tuple[str, ...]
    build_env: dict = field(default_factory=dict)  # environment variables for pip (e.g. CMAKE_ARGS)
    system_site_packages: bool = False  # reuse torch/transformers from the project's interpreter
    import_check: str = ""  # a Python statement that must run in the finished venv
    pip_args: tuple[str, ...] = ()

    @property
    def path(self) -> str:
        return os.path.join(bench_envs_dir(), self.name)

    @property
    def python(self) -> str:
        return os.path.join(self.path, "Scripts" if os.name == "nt" else "bin", "python")


# llama.cpp through llama-cpp-python, compiled for AVX2/AVX-512 without -march=native and without AMX:
# the AMX kernels crash on machines that advertise AMX without the kernel enabling it.
LLAMA_CPP = EnvSpec(
    name="llama-cpp-0.3.36-avx512-noamx",
    requirements=("llama-cpp-python==0.3.36",),
    build_env={
        "CMAKE_ARGS": "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON "
                      "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF",
        "FORCE_CMAKE": "1",
    },
    pip_args=("--no-binary", "llama-cpp-python", "--no-cache-dir"),
    import_check="import llama_cpp; print(llama_cpp.__version__)",
)

# onnxruntime-genai and its model builder. The builder imports torch and transformers, which are
# reused from the project's interpreter (system site packages) instead of being installed again.
ORT_GENAI = EnvSpec(
    name="onnxruntime-genai-0.18.0",
    requirements=("onnxruntime-genai==0.18.0", "onnx", "onnx-ir"),
    system_site_packages=True,
    import_check="import onnxruntime_genai as og; import onnxruntime_genai.models.builder; print(og.__version__)",
)


def _marker(spec: EnvSpec) -> dict:
    return {**asdict(spec), "python": sys.version.split()[0]}


def is_ready(spec: EnvSpec) -> bool:
    try:
        with open(os.path.join(spec.path, MARKER)) as f:
            return json.load(f) == json.loads(json.dumps(_marker(spec)))
    except (OSError, json.JSONDecodeError):
        return False


def _log_tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


def ensure_env(spec: EnvSpec, progress=print) -> str:
    """The venv's python, building the venv first if it is missing or was built differently."""
    if is_ready(spec):
        return spec.python
    if os.path.exists(spec.path):
        shutil.rmtree(spec.path)
    os.makedirs(spec.path)
    log_path = os.path.join(spec.path, "install.log")
    progress(f"building venv {spec.path} ({', '.join(spec.requirements)}); log: {log_path}")
    started = time.perf_counter()
    venv.EnvBuilder(with_pip=True, system_site_packages=spec.system_site_packages).create(spec.path)
    env = {**os.environ, **spec.build_env, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
    env.pop("PYTHONPATH", None)
    command = [spec.python, "-m", "pip", "install", *spec.pip_args, *spec.requirements]
    with open(log_path, "w") as log:
        log.write(" ".join(command) + "\n" + json.dumps(spec.build_env) + "\n")
        log.flush()
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        raise PeerUnavailable(f"pip install {' '.join(spec.requirements)} failed in {spec.path} "
                              f"(exit {done.returncode}); last lines of {log_path}:\n{_log_tail(log_path)}")
    if spec.import_check:
        check = subprocess.run([spec.python, "-c", spec.import_check], capture_output=True, text=True, env=env)
        if check.returncode != 0:
            raise PeerUnavailable(f"{spec.path} was built but `{spec.import_check}` fails:\n{check.stderr[-2000:]}")
    with open(os.path.join(spec.path, MARKER), "w") as f:
        json.dump(_marker(spec), f, indent=1)
    progress(f"venv {spec.name} ready after {time.perf_counter() - started:.0f} s")
    return spec.python


if __name__ == "__main__":
    # Build every peer venv ahead of a benchmark run: python benchmarks/bench_envs.py [llama|ort]
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    wanted = set(sys.argv[1:]) or {"llama", "ort"}
    for key, spec in (("llama", LLAMA_CPP), ("ort", ORT_GENAI)):
        if key in wanted:
            try:
                print(ensure_env(spec, progress=lambda m: print(m, file=sys.stderr)))
            except PeerUnavailable as exc:
                print(f"{spec.name}: {exc}", file=sys.stderr)
