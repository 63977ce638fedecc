"""Peer check of the npu device's graphs: onnxruntime-genai's model builder exports the same tiny random
Llama, and its ONNX graph and ours give the same logits at float32.

The builder (PyPI onnxruntime-genai) runs in the helper virtualenv benchmarks/bench_envs.py ORT_GENAI
pins for the benchmark's peer (devices/helper_envs.py: built once, reused; torch, transformers and
onnxruntime come from the main environment); when pip cannot install it the test is skipped with pip's
error as the reason, and when it is built but cannot import the builder the test fails. The builder
needs a tokenizer in the HF folder, so the folder gets a word-level one over the model's 160 ids.
intermediate_size (96) differs from vocab_size (160): the builder finds the LM head by its output
width and mistakes an FFN matrix for it when they match.

Both graphs run on onnxruntime's CPU provider: the builder's (GroupQueryAttention, fp32 MatMul) fed
input_ids, an attention mask and its own past/present K/V; ours through the npu device
(accuracy_level 0: float32 activations) from a zllm checkpoint converted at f32, in both graph forms.
Protocol: an 8-token prefill (all positions' logits), then 3 decode steps of fixed tokens.

Bound: the same float32 math in different orders (the builder fuses q/k/v into one MatMul and folds
the final norm into SkipSimplifiedLayerNormalization; our standard form computes attention with
MatMul/Softmax): measured <= 1e-6 relative to max |theirs|; bound REL_TOL = 1e-5.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

import edge  # noqa: E402
from converters.convert import QuantPlan, convert  # noqa: E402
from devices import helper_envs  # noqa: E402

REL_TOL = 1e-5
PROMPT = [5, 17, 33, 9, 60, 101, 7, 44]
DECODE = [3, 8, 150]
VOCAB = 160
KV_HEADS, HEAD_DIM = 2, 16


def builder_python() -> Path:
    """The onnxruntime-genai environment's python (built on first use); skip when pip cannot build it.
    A built environment whose import check fails (HelperEnvBroken) fails the test."""
    # benchmarks/ is a folder of scripts, not a package: load its bench_envs by path, without putting
    # the folder on sys.path for the rest of the session. Registered in sys.modules, where dataclasses
    # look a class's module up.
    bench_envs = sys.modules.get("bench_envs")
    if bench_envs is None:
        location = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_envs.py"
        module_spec = importlib.util.spec_from_file_location("bench_envs", location)
        bench_envs = importlib.util.module_from_spec(module_spec)
        sys.modules["bench_envs"] = bench_envs
        module_spec.loader.exec_module(bench_envs)
    try:
        return helper_envs.ensure_env(bench_envs.ORT_GENAI)
    except helper_envs.HelperEnvUnavailable as exc:
        pytest.skip(str(exc))


def write_tiny_llama(folder: Path) -> None:
    """A tiny random Llama (GQA 4/2, head_dim 16) and a word-level tokenizer, as an HF folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():  # logits spread ~1 over the vocabulary; norm gains away from 1 so a lost one shows
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)
    model.save_pretrained(folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)


def builder_logits(model_path: Path) -> list[np.ndarray]:
    """The builder's graph on onnxruntime's CPU provider: prefill logits [T, V], then each decode step's [1, V]."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    past_inputs = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    past = {i.name: np.zeros((1, KV_HEADS, 0, HEAD_DIM), np.float32) for i in past_inputs}  # [B, Hkv, P, Dh]
    outputs = [o.name for o in session.get_outputs()]
    steps, seen = [], 0
    for ids in [PROMPT] + [[t] for t in DECODE]:
        seen += len(ids)
        feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, seen), np.int64), **past}
        results = dict(zip(outputs, session.run(outputs, feeds)))
        steps.append(results["logits"][0])
        past = {name: results[name.replace("past_key_values.", "present.")] for name in past}
    return steps


@pytest.fixture(scope="module")
def peer_models(tmp_path_factory):
    python = builder_python()
    root = tmp_path_factory.mktemp("ort_genai_peer")
    write_tiny_llama(root / "hf")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    built = subprocess.run([str(python), "-m", "onnxruntime_genai.models.builder", "-i", str(root / "hf"),
                            "-o", str(root / "ort"), "-p", "fp32", "-e", "cpu", "-c", str(root / "builder-cache")],
                           capture_output=True, text=True, env=env, timeout=600)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    convert(str(root / "hf"), str(root / "zllm"), QuantPlan(weights="f32"), progress=False)
    return root / "ort" / "model.onnx", str(root / "zllm")


@pytest.mark.parametrize("form", ["contrib", "standard"])
def test_our_graph_agrees_with_onnxruntime_genai_builder(peer_models, form):
    their_model, our_checkpoint = peer_models
    theirs = builder_logits(their_model)
    with edge.load(our_checkpoint, device=f"npu:cpu,accuracy_level=0,attention={form}") as model:
        session = model.session(capacity=32)
        ours = [session.prefill(PROMPT, all_logits=True)] + [session.decode(t)[None] for t in DECODE]
    assert [a.shape for a in ours] == [b.shape for b in theirs] == [(8, VOCAB)] + [(1, VOCAB)] * 3
    errors = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(ours, theirs)]
    print(f"\nnpu ({form}) vs onnxruntime-genai builder, fp32, max relative logit error per step: "
          + " ".join(f"{e:.1e}" for e in errors))
    assert max(errors) <= REL_TOL
    assert [int(a.argmax(-1)[-1]) for a in ours] == [int(b.argmax(-1)[-1]) for b in theirs]
