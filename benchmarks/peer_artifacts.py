"""The model files each engine of benchmarks/peers.py runs, made from one GGUF and cached.

Under `$ZLLM_EDGE_HOME/bench-models/<gguf stem>-<gguf bytes>/`:
    zllm-q4_1/          `zllm-edge convert --weights source`: the GGUF's Q4_1 imported losslessly
    zllm-int8/          `--weights int8` (symmetric, groups of 32)          ~ llama.cpp Q8_0
    zllm-int4-sym/      `--weights int4 --symmetric` (groups of 32)         ~ llama.cpp Q4_0
    llama-Q8_0.gguf     llama.cpp requantization (llama_model_quantize, pure: every matrix)
    llama-Q4_0.gguf
    llama-Q4_K_M-mix.gguf   the same with llama.cpp's own tensor mix (not pure)
    hf-fp32/            transformers' dequantized GGUF, saved with save_pretrained
    ort-int4/, ort-fp32/  onnxruntime-genai's model builder run on hf-fp32/

Every artifact is written under a temporary name and renamed when complete, so a cached one is
whole; `--rebuild` deletes them. A failure raises PeerUnavailable saying what failed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from bench_envs import PeerUnavailable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_worker.py")

ZLLM_PLANS = {  # name -> QuantPlan arguments
    "source": dict(weights="source"),  # GGUF blocks of our formats kept (SmolLM2's Q4_1), the others requantized
    "int8": dict(weights="int8", group_size=32, symmetric=True),
    "int4-sym": dict(weights="int4", group_size=32, symmetric=True),
}


def models_dir(gguf: str) -> str:
    from edge.home import home_dir

    stem = os.path.splitext(os.path.basename(gguf))[0]
    return os.path.join(home_dir(), "bench-models", f"{stem}-{os.path.getsize(gguf)}")


def _log_tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _run(command: list[str], what: str, env: dict | None = None) -> None:
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise PeerUnavailable(f"{what} failed (exit {done.returncode}):\n{_log_tail(done.stderr + done.stdout)}")


def _build(destination: str, make) -> str:
    """make(temporary path) builds the artifact; it becomes `destination` only once complete."""
    if os.path.exists(destination):
        return destination
    partial = destination + ".partial"
    os.makedirs(os.path.dirname(destination), exist_ok=True)
    if os.path.isdir(partial):
        shutil.rmtree(partial)
    elif os.path.exists(partial):
        os.remove(partial)
    make(partial)
    os.rename(partial, destination)
    return destination


def zllm_checkpoint(gguf: str, name: str) -> str:
    from converters.convert import QuantPlan, convert

    def make(path):
        convert(gguf, path, QuantPlan(**ZLLM_PLANS[name]), progress=False)

    return _build(os.path.join(models_dir(gguf), f"zllm-{name}"), make)


def llama_gguf(gguf: str, ftype: str, llama_python: str, pure: bool = True) -> str:
    """llama.cpp's requantization of `gguf` to `ftype`: every matrix to that type (pure), or the type's
    own mix of tensor types (e.g. Q4_K_M's Q6_K for some tensors, and fallbacks for rows that K-quants
    do not divide)."""
    mix = "pure" if pure else "mix"

    def make(path):
        _run([llama_python, WORKER, "--quantize", gguf, path, ftype, mix], f"llama.cpp requantization to {ftype}")

    return _build(os.path.join(models_dir(gguf), f"llama-{ftype}{'' if pure else '-mix'}.gguf"), make)


def hf_folder(gguf: str) -> str:
    """transformers loads the GGUF dequantized to float32; the weights are saved as a plain HF folder."""
    def make(path):
        _run([sys.executable, os.path.abspath(__file__), "--export-hf", gguf, path], "transformers GGUF export")

    return _build(os.path.join(models_dir(gguf), "hf-fp32"), make)


def export_hf(gguf: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # A model loaded from GGUF is marked as gguf-quantized and refuses save_pretrained; its
    # weights are plain float32 tensors, so they move into an unmarked model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def ort_model(hf: str, precision: str, ort_python: str) -> str:
    """onnxruntime-genai's builder: precision "int4" (MatMulNBits, its CPU defaults) or "fp32"."""
    def make(path):
        cache = path + ".cache"
        try:
            _run([ort_python, "-m", "onnxruntime_genai.models.builder", "-i", hf, "-o", path, "-p", precision,
                  "-e", "cpu", "-c", cache], f"onnxruntime-genai model builder ({precision})")
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    return _build(os.path.join(os.path.dirname(hf), f"ort-{precision}"), make)


def rebuild(gguf: str) -> None:
    shutil.rmtree(models_dir(gguf), ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    if sys.argv[1] == "--export-hf":
        export_hf(sys.argv[2], sys.argv[3])
