"""NaN and infinity never pass silently: conversion refuses them in what it imports (GGUF block scales
and offsets kept bit for bit, requantized or cast; dequantized and float weights), loading refuses
them in a checkpoint's scales, offsets and float tensors (dense and resident experts), and every
forward pass's logits are checked before a token is chosen from them (NumericalError)."""
from __future__ import annotations

import json
import re
import shutil
import zlib
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf_files import write_hf_model_gguf
from safetensors.numpy import load_file, save_file
from test_bad_input import assert_nothing_written, run_cli
from tiny_models import random_prompt, tiny_zoo  # noqa: F401

import edge
from converters.convert import QuantPlan, convert
from devices.cpu.executor import FusedForward
from edge.core.errors import CheckpointError, ConversionError, NumericalError
from edge.model import Transformer
from quant.checkpoint import sealed, sha256_file
from quant.expert_file import EXPERTS_FILE, INDEX_SHA256, index_sha256

NAN, INF, MINUS_INF = 0x7E00, 0x7C00, 0xFC00  # float16 bits
VICTIM = "model.layers.1.mlp.up_proj.weight"  # [96, 64]: two blocks of 32 per row, rows not permuted
DAMAGED_SOURCE = "its weights are damaged: download or export the model again"
DAMAGED_CHECKPOINT = "the checkpoint is damaged, convert the model again"
PROMPT = random_prompt(5, seed=3)


# ------------------------------------------------------------------------------------ convert


def gguf_with_field(hf_model, path: Path, qtype: Q, row: int, block: int, field: int, bits: int) -> Path:
    """The tiny Llama as a GGUF of `qtype` matrices, with the float16 at byte `field` of block `block`
    of row `row` of the victim (ffn_up of layer 1) set to `bits`."""
    write_hf_model_gguf(hf_model, path, "llama", qtype_for=lambda name, values: qtype)
    reader = gguf.GGUFReader(path, "r+")
    tensor = next(t for t in reader.tensors if t.name == "blk.1.ffn_up.weight")
    start = block * gguf.GGML_QUANT_SIZES[qtype][1] + field
    tensor.data[row, start:start + 2] = np.frombuffer(np.uint16(bits).tobytes(), np.uint8)
    reader.data.flush()
    return path


@pytest.mark.parametrize("qtype, weights, field, bits, found", [
    # kept bit for bit
    (Q.Q8_0, "int8", 0, NAN, "(int8_sym_g32): the source holds a non-finite scale (nan) at row 3, group 1"),
    (Q.Q8_0, "int8", 0, INF, "(int8_sym_g32): the source holds a non-finite scale (inf) at row 3, group 1"),
    (Q.Q4_0, "int4", 0, MINUS_INF, "(int4_sym_g32): the source holds a non-finite scale (-inf) at row 3, group 1"),
    (Q.Q4_1, "int4", 0, INF, "(int4_affine_g32): the source holds a non-finite scale (inf) at row 3, group 1"),
    (Q.Q4_1, "int4", 2, NAN, "(int4_affine_g32): the source holds a non-finite offset (nan) at row 3, group 1"),
    # requantized or cast
    (Q.Q4_0, "int8", 0, NAN, "(int8_sym_g32): the source holds a non-finite scale (nan) at row 3, group 1"),
    (Q.Q8_0, "int4_sym_g64", 0, INF, "(int4_sym_g64): the source holds a non-finite scale (inf) at row 3, group 1"),
    (Q.Q4_1, "f16", 2, NAN, "(f16): the source holds a non-finite offset (nan) at row 3, group 1"),
    (Q.Q5_0, "int8", 0, NAN, "(int8_sym_g32): the source holds a non-finite scale (nan) at row 3, group 1"),
    (Q.Q5_1, "int8", 2, INF, "(int8_affine_g32): the source holds a non-finite offset (inf) at row 3, group 1"),
    (Q.Q5_0, "int4", 0, NAN, "(int4_sym_g32): the source holds a non-finite scale (nan) at row 3, group 1"),
])
def test_non_finite_gguf_block_fields_are_refused(tiny_zoo, tmp_path, qtype, weights, field, bits, found):
    path = gguf_with_field(tiny_zoo.hf_model("llama_mha"), tmp_path / "bad.gguf", qtype, 3, 1, field, bits)
    out = tmp_path / "out" / "ckpt"
    with pytest.raises(ConversionError) as raised:
        convert(str(path), str(out), QuantPlan(weights=weights), progress=False)
    assert str(raised.value) == f"tensor {VICTIM} {found}; {DAMAGED_SOURCE}"
    assert_nothing_written(out)


def test_finite_gguf_blocks_still_convert_bit_for_bit(tiny_zoo, tmp_path):
    path = tmp_path / "good.gguf"
    write_hf_model_gguf(tiny_zoo.hf_model("llama_mha"), path, "llama", qtype_for=lambda name, values: Q.Q4_1)
    summary = convert(str(path), str(tmp_path / "ckpt"), QuantPlan(weights="int4"), progress=False)
    assert all(t.lossless for t in summary.tensors)


# --------------------------------------------------------------------------------------- load


def damaged_copy(source: str, destination: Path, name: str, index, value) -> Path:
    """A copy of checkpoint `source` whose stored array `name` holds `value` at `index`, rewritten with the
    safetensors package and its size and sha256 updated in the manifest, as a careful edit would leave it."""
    path = Path(shutil.copytree(source, destination))
    weights = path / "model.safetensors"
    arrays = load_file(weights)
    arrays[name] = arrays[name].copy()
    arrays[name][index] = value
    save_file(arrays, weights, metadata={"format": "zllm"})
    manifest = json.loads((path / "zllm.json").read_text())
    manifest["files"]["model.safetensors"] = {"bytes": weights.stat().st_size, "sha256": sha256_file(str(weights))}
    (path / "zllm.json").write_text(json.dumps(sealed(manifest)))
    return path


@pytest.mark.parametrize("plan, name, index, value, found", [
    (QuantPlan(weights="int8"), f"{VICTIM}.scales", (3, 1), np.nan, f"tensor {VICTIM} holds a non-finite scale (nan) "
                                                                    "at row 3, group 1"),
    (QuantPlan(weights="int8"), f"{VICTIM}.scales", (0, 0), np.inf, f"tensor {VICTIM} holds a non-finite scale (inf) "
                                                                    "at row 0, group 0"),
    (QuantPlan(weights="int4", symmetric=False), f"{VICTIM}.offsets", (95, 1), -np.inf,
     f"tensor {VICTIM} holds a non-finite offset (-inf) at row 95, group 1"),
    (QuantPlan(weights="int8"), "model.norm.weight", (5,), np.nan,
     "tensor model.norm.weight holds a non-finite value (nan) at index [5]"),
    (QuantPlan(weights="f16"), "model.layers.0.self_attn.q_proj.weight", (2, 7), np.inf,
     "tensor model.layers.0.self_attn.q_proj.weight holds a non-finite value (inf) at index [2, 7]"),
])
@pytest.mark.parametrize("verify", [False, True])  # the checksums match: only the values tell
def test_a_checkpoint_edited_to_non_finite_is_refused_at_load(tiny_zoo, tmp_path, plan, name, index, value, found,
                                                              verify):
    path = damaged_copy(tiny_zoo.converted("llama_mha", plan), tmp_path / "damaged", name, index, value)
    with pytest.raises(CheckpointError) as raised:
        edge.load(path, device="reference", verify=verify)
    assert str(raised.value) == f"{path}: {found}; {DAMAGED_CHECKPOINT}"


def moe_with_non_finite_scales(source: str, destination: Path, layer: int, experts: list[int]) -> Path:
    """A copy of a MoE checkpoint whose experts' up_proj scale [0, 1] is NaN, every record's crc32, the
    index's sha256 and the file's sha256 updated, so that only the values tell."""
    path = Path(shutil.copytree(source, destination))
    manifest = json.loads((path / "zllm.json").read_text())
    entry = manifest["experts"]["layers"][str(layer)]
    scales = entry["projections"]["up_proj"]["arrays"]["scales"]
    data = bytearray((path / EXPERTS_FILE).read_bytes())
    for expert in experts:
        offset, length, _ = entry["records"][expert]
        start, size = offset + scales["offset"], 2 * int(np.prod(scales["shape"]))
        np.frombuffer(data, np.float16, count=size // 2, offset=start).reshape(scales["shape"])[0, 1] = np.nan
        entry["records"][expert][2] = zlib.crc32(data[offset:offset + length])
    (path / EXPERTS_FILE).write_bytes(bytes(data))
    manifest["experts"][INDEX_SHA256] = index_sha256(manifest["experts"])
    manifest["files"][EXPERTS_FILE]["sha256"] = sha256_file(str(path / EXPERTS_FILE))
    (path / "zllm.json").write_text(json.dumps(sealed(manifest)))
    return path


def test_resident_experts_are_checked_at_load(tiny_zoo, tmp_path):
    source = tiny_zoo.converted("olmoe", QuantPlan(weights="int8"))
    path = moe_with_non_finite_scales(source, tmp_path / "damaged", 1, [2])
    with pytest.raises(CheckpointError) as raised:
        edge.load(path, device="reference", verify=True)
    assert str(raised.value) == (f"{path / EXPERTS_FILE}: tensor model.layers.1.mlp.experts.2.up_proj.weight holds "
                                 f"a non-finite scale (nan) at row 0, group 1; {DAMAGED_CHECKPOINT}")


def test_streamed_experts_are_caught_by_the_logits_check(tiny_zoo, tmp_path):
    # a streamed expert is read on demand: its crc32 is checked then, and NaN shows in the logits
    source = tiny_zoo.converted("olmoe", QuantPlan(weights="int8"))
    path = moe_with_non_finite_scales(source, tmp_path / "damaged", 1, list(range(8)))  # the route cannot avoid them
    with edge.load(path, device="reference", expert_strategy="predictive", memory_budget="50%") as model:
        with pytest.raises(NumericalError) as raised:
            model.session(capacity=16).prefill(PROMPT)
    assert str(raised.value) == ("the model produced non-finite logits (nan) at position 4; its checkpoint or config "
                                 "is damaged: convert the model again")


# ------------------------------------------------------------------------------------- logits


def remedy(device: str) -> str:
    if device == "reference":
        return "its checkpoint or config is damaged: convert the model again"
    return (f"its checkpoint or config is damaged (convert the model again), or device {device!r} computes wrongly "
            f"(compare it with the reference: zllm-edge diff MODEL PROMPT --devices reference,{device})")


def nan_logits_message(position: int, device: str) -> str:
    return f"the model produced non-finite logits (nan) at position {position}; {remedy(device)}"


@pytest.fixture
def nan_from(monkeypatch):
    """nan_from(P): from position P on, every forward pass's logits hold a NaN (the op-by-op composition's
    and the cpu's fused executor's, whose greedy next_token reads them in place)."""
    def install(first: int) -> None:
        def poison(logits: np.ndarray, start: int, n_tokens: int, all_logits: bool) -> None:
            positions = np.arange(start, start + n_tokens) if all_logits else np.array([start + n_tokens - 1])
            logits.reshape(len(positions), -1)[positions >= first, 7] = np.nan

        forward_ops, fused_forward = Transformer.forward_ops, FusedForward._forward

        def poisoned_ops(self, ids, cache, all_logits, observer=None, ffn_hook=None):
            start = cache.length
            logits = forward_ops(self, ids, cache, all_logits, observer, ffn_hook)
            poison(logits, start, len(ids), all_logits)
            return logits

        def poisoned_fused(self, ids, cache, all_logits, observer):
            start = cache.length
            logits = fused_forward(self, ids, cache, all_logits, observer)
            poison(logits[:len(ids)] if all_logits else logits[:1], start, len(ids), all_logits)
            return logits

        monkeypatch.setattr(Transformer, "forward_ops", poisoned_ops)
        monkeypatch.setattr(FusedForward, "_forward", poisoned_fused)

    return install


DEVICES = ["reference", "cpu"]


@pytest.mark.parametrize("device", DEVICES)
def test_sessions_refuse_non_finite_logits(tiny_zoo, nan_from, device):
    nan_from(6)
    with edge.load(tiny_zoo.converted("llama_mha", QuantPlan(weights="int8")), device=device) as model:
        session = model.session(capacity=16)
        token = int(session.prefill(PROMPT).argmax())  # positions 0-4
        token = int(session.decode(token).argmax())  # 5
        with pytest.raises(NumericalError) as raised:
            session.decode(token)
        assert str(raised.value) == nan_logits_message(6, device)
        assert session.position == len(session.tokens) == 7  # the token is in the cache and in the history

        with pytest.raises(NumericalError) as raised:
            model.session(capacity=16).prefill(PROMPT + PROMPT, all_logits=True)
        assert str(raised.value) == nan_logits_message(6, device)  # the first position that holds one
        with pytest.raises(NumericalError) as raised:
            model.session(capacity=16).next_token(PROMPT + PROMPT[:3])
        assert str(raised.value) == nan_logits_message(7, device)  # the last token's logits, read in place


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 1}], ids=["greedy", "sampled"])
def test_generate_refuses_non_finite_logits(tiny_zoo, nan_from, device, sampling):
    nan_from(6)
    with edge.load(tiny_zoo.converted("llama_mha", QuantPlan(weights="int8")), device=device) as model:
        generation = model.generate(PROMPT, max_new_tokens=8, **sampling)
        with pytest.raises(NumericalError) as raised:
            list(generation.steps())
        assert str(raised.value) == nan_logits_message(6, device)
        assert len(generation.result.tokens) == 2  # chosen from the logits of positions 4 and 5 only


@pytest.fixture(scope="module")
def text_checkpoint(tiny_zoo, tmp_path_factory) -> Path:
    """The tiny Llama with a byte-level tokenizer (through GGUF) and a chat template."""
    folder = tmp_path_factory.mktemp("text")
    source = write_hf_model_gguf(tiny_zoo.hf_model("llama_mha"), folder / "tiny.gguf", "llama")
    path = folder / "ckpt"
    convert(str(source), str(path), QuantPlan(weights="int8"), progress=False)
    manifest = json.loads((path / "zllm.json").read_text())
    manifest["tokenizer"]["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (path / "zllm.json").write_text(json.dumps(sealed(manifest)))
    return path


@pytest.mark.parametrize("device", DEVICES)
def test_chat_and_the_cli_refuse_non_finite_logits(text_checkpoint, nan_from, capsys, device):
    with edge.load(text_checkpoint, device=device) as model:
        prompt_length = len(model.encode("the theme"))
        chat_length = len(model.tokenizer.encode(model.tokenizer.apply_chat_template(
            [{"role": "user", "content": "the theme"}]), add_special_tokens=False))
    nan_from(0)
    with edge.load(text_checkpoint, device=device) as model:
        with pytest.raises(NumericalError) as raised:
            list(model.chat([{"role": "user", "content": "the theme"}], max_new_tokens=4))
    assert str(raised.value) == nan_logits_message(chat_length - 1, device)
    code, out, err = run_cli(capsys, "generate", text_checkpoint, "the theme", "--device", device,
                             "--max-new-tokens", "4", "--quiet")
    assert (code, out, err) == (2, "", f"error: {nan_logits_message(prompt_length - 1, device)}\n")


@pytest.mark.parametrize("device", DEVICES)
def test_a_finite_checkpoint_whose_logits_overflow(tiny_zoo, tmp_path, device):
    # a final norm gain of 3e38 is finite, so conversion and loading take it; the logits overflow
    path = damaged_copy(tiny_zoo.converted("llama_mha", QuantPlan(weights="int8")), tmp_path / "huge",
                        "model.norm.weight", slice(None), 3e38)
    with edge.load(path, device=device) as model:
        with pytest.raises(NumericalError) as raised:
            list(model.generate(PROMPT, max_new_tokens=4).steps())
    assert re.fullmatch(r"the model produced non-finite logits \((nan|inf|-inf)\) at position 4; (.*)",
                        str(raised.value)).group(2) == remedy(device)


def test_diff_reports_non_finite_logits_instead_of_raising(tiny_zoo, monkeypatch):
    from edge.diff import run_diff

    fused_forward = FusedForward._forward

    def nan_logits(self, ids, cache, all_logits, observer):  # the cpu's logits only
        logits = fused_forward(self, ids, cache, all_logits, observer)
        logits[:, 7] = np.nan
        return logits

    monkeypatch.setattr(FusedForward, "_forward", nan_logits)
    report = run_diff(tiny_zoo.converted("llama_mha", QuantPlan(weights="int8")), PROMPT, ["reference", "cpu"],
                      decode_steps=1)
    assert report["first_divergence"] == {"pass": "prefill", "layer": "logits"}  # a divergence, not an error
