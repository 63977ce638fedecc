"""Malformed source files for `zllm-edge convert`: each is refused with a typed error whose exact
message names the file, tensor or key, never with a raw Python exception.

Hugging Face folders start from test_bad_input's tiny random Llama and damage one file; GGUF files
start from its tiny GGUF and have bytes changed in place through a writable gguf.GGUFReader.
"""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import gguf
import pytest
from test_bad_input import (
    assert_nothing_written,
    read_safetensors_header,
    run_cli,
    run_cli_subprocess,
    write_tiny_gguf,
    write_tiny_llama,
)
from tokenizers import Tokenizer, models

import edge
from converters.convert import QuantPlan, convert
from converters.gguf_source import GGUFSource
from converters.hf_source import HFSource
from edge.core.errors import CheckpointError, ConversionError, UnsupportedModelError
from edge.tokenizer import Tokenizer as EdgeTokenizer

VICTIM = "model.norm.weight"  # a [64] float32 tensor of the tiny Llama


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")


@pytest.fixture
def src(tiny_llama, tmp_path) -> Path:
    """A private copy of the tiny Llama folder, free to damage."""
    return Path(shutil.copytree(tiny_llama, tmp_path / "src"))


def refused(src: Path, error: type, tmp_path: Path) -> str:
    """convert(src) raises `error`, writes nothing; returns the message."""
    out = tmp_path / "out" / "ckpt"
    with pytest.raises(error) as raised:
        convert(str(src), str(out), QuantPlan(weights="int8"), progress=False)
    assert_nothing_written(out)
    return str(raised.value)


# ------------------------------------------------------------------------- safetensors header


def rewrite_header(folder: Path, edit) -> None:
    """Rewrite the header of folder/model.safetensors through `edit(header)`, keeping the data."""
    weights = folder / "model.safetensors"
    header_len, header = read_safetensors_header(weights)
    data = weights.read_bytes()[8 + header_len:]
    edit(header)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    weights.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def rewrite_entry(folder: Path, **fields) -> None:
    """Replace fields of VICTIM's header entry."""
    rewrite_header(folder, lambda header: header[VICTIM].update(fields))


def entry(folder: Path) -> dict:
    return read_safetensors_header(folder / "model.safetensors")[1][VICTIM]


MALFORMED = (" is malformed: {info!r}; expected dtype, shape (non-negative integers) and data_offsets "
             "(two non-negative integers)")


@pytest.mark.parametrize("fields", [
    pytest.param(lambda e: {"data_offsets": [str(o) for o in e["data_offsets"]]}, id="offsets-are-strings"),
    pytest.param(lambda e: {"data_offsets": e["data_offsets"][:1]}, id="one-offset"),
    pytest.param(lambda e: {"shape": [-8, -8]}, id="negative-dims"),  # their product is positive
    pytest.param(lambda e: {"shape": [64.0]}, id="float-dim"),
    pytest.param(lambda e: {"shape": 64}, id="shape-not-a-list"),
    pytest.param(lambda e: {"dtype": ["F32"]}, id="dtype-not-a-string"),
])
def test_malformed_header_entry(fields, src, tmp_path):
    rewrite_entry(src, **fields(entry(src)))
    message = refused(src, ConversionError, tmp_path)
    assert message == f"{src}: model.safetensors: header entry for {VICTIM!r}" + MALFORMED.format(info=entry(src))


def test_shape_whose_size_overflows_int64(src, tmp_path):
    begin = entry(src)["data_offsets"][0]
    # 2^32 x 2^32 elements: an int64 product wraps to 0 bytes and would match the empty range
    rewrite_entry(src, shape=[2**32, 2**32], data_offsets=[begin, begin])
    assert refused(src, ConversionError, tmp_path) == (
        f"{src}: model.safetensors: tensor {VICTIM!r} has offsets [{begin}, {begin}] that do not match its shape "
        f"[4294967296, 4294967296] and dtype F32 ({2**64 * 4} bytes)")


def test_metadata_not_an_object(src, tmp_path):
    rewrite_header(src, lambda header: header.update(__metadata__=["pt"]))
    assert refused(src, ConversionError, tmp_path) == (
        f"{src}: model.safetensors: header's __metadata__ is not a JSON object: ['pt']")


def test_integer_weights_are_refused(src, tmp_path):
    rewrite_entry(src, dtype="I32")  # same itemsize: the header stays consistent
    assert refused(src, UnsupportedModelError, tmp_path) == (
        f"{src / 'model.safetensors'}: tensor {VICTIM!r} is stored as I32; only floating-point weights "
        "(F32, F16, BF16, F64) convert; use the model's unquantized checkpoint")


# ------------------------------------------------------------------------------ JSON files


@pytest.mark.parametrize("filename, content, message", [
    ("config.json", b"[1, 2]", "config {path} holds a JSON list, not an object; restore the file"),
    ("config.json", b'{"model_type": "\xff"}',
     "config {path} is not UTF-8 text ('utf-8' codec can't decode byte 0xff in position 16: invalid start byte); "
     "restore the file"),
    ("config.json", b'{"model_type": ["llama"]}',
     "config {path}: model_type is ['llama']; expected a string such as 'llama'"),
    ("model.safetensors.index.json", b"[]",
     "safetensors index {path} holds a JSON list, not an object; restore the file"),
    ("model.safetensors.index.json", b'{"weight_map": ["model.safetensors"]}',
     "{path}: weight_map is not an object mapping tensor names to shard file names; restore the file"),
    ("model.safetensors.index.json", b'{"weight_map": {}}', "{path} maps no tensors; its weight_map is empty"),
    ("tokenizer.json", b"\xff\xfe\x00garbage",
     "tokenizer {path} is not UTF-8 text ('utf-8' codec can't decode byte 0xff in position 0: invalid start byte); "
     "restore the file"),
    ("tokenizer.json", b"{not json",
     "tokenizer {path} cannot be loaded by the tokenizers library (key must be a string at line 1 column 2); "
     "restore the file from the model's repository"),
    ("tokenizer.json", b'{"hello": 1}',
     "tokenizer {path} cannot be loaded by the tokenizers library (expected `,` or `}}` at line 1 column 9); "
     "restore the file from the model's repository"),
    ("tokenizer_config.json", b"[1]", "tokenizer config {path} holds a JSON list, not an object; restore the file"),
    ("tokenizer_config.json", b'{"chat_template": 5}', "{path}: chat_template is 5; expected a Jinja template string"),
    ("tokenizer_config.json", b'{"chat_template": [{"name": "tool_use", "template": "x"}]}',
     "{path}: chat_template lists no template named 'default'; name the one to use 'default'"),
    ("generation_config.json", b"[1]", "generation config {path} holds a JSON list, not an object; restore the file"),
    ("generation_config.json", b'{"eos_token_id": "abc"}',
     "{path}: eos_token_id is 'abc'; expected a token id or a list of token ids"),
    ("generation_config.json", b'{"bos_token_id": [1, true]}',
     "{path}: bos_token_id is [1, True]; expected a token id or a list of token ids"),
])
def test_malformed_json_file(filename, content, message, src, tmp_path):
    path = src / filename
    path.write_bytes(content)
    assert refused(src, ConversionError, tmp_path) == message.format(path=path)


def test_named_chat_templates_keep_the_default(src):
    (src / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "chat"}]}))
    source = HFSource(str(src))
    source.close()
    assert source.tokenizer.config["chat_template"] == "chat"


# ------------------------------------------------------------------------- tokenizer loader


def test_damaged_tokenizer_in_a_checkpoint(src, tmp_path):
    (src / "tokenizer.json").write_text(Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")).to_str())
    out = tmp_path / "ckpt"
    convert(str(src), str(out), QuantPlan(weights="int8"), progress=False)
    tokenizer = out / "tokenizer.json"
    tokenizer.write_text('{"hello": 1}')
    message = (f"{tokenizer} cannot be loaded by the tokenizers library (expected `,` or `}}` at line 1 column 9); "
               "the checkpoint is damaged, convert the model again")
    with pytest.raises(CheckpointError) as raised:
        EdgeTokenizer(str(tokenizer), {})
    assert str(raised.value) == message
    with pytest.raises(CheckpointError) as raised:
        edge.load(str(out))
    assert str(raised.value) == message


# ------------------------------------------------------------------------------------- GGUF


def edited_gguf(path: Path, edit) -> Path:
    """write_tiny_gguf(path), then `edit(reader)` changes its bytes in place through a writable GGUFReader."""
    reader = gguf.GGUFReader(write_tiny_gguf(path), "r+")
    edit(reader)
    reader.data.flush()
    return path


def rename_key(key: str):
    """Misspell `key` (same length), so that the file lacks it."""
    def edit(reader):
        reader.fields[key].parts[1][-1] = ord("_")
    return edit


def set_value(key: str, value, value_type: gguf.GGUFValueType | None = None):
    """Overwrite a 4-byte scalar, optionally reinterpreting its bytes as another 4-byte type."""
    def edit(reader):
        field = reader.fields[key]
        if value_type is not None:
            field.parts[2][0] = value_type
        field.parts[-1][0] = value
    return edit


@pytest.mark.parametrize("edit, message", [
    (rename_key("llama.attention.head_count"), "GGUF key 'llama.attention.head_count' is missing"),
    (rename_key("llama.block_count"), "GGUF key 'llama.block_count' is missing"),
    (rename_key("llama.embedding_length"), "GGUF key 'llama.embedding_length' is missing"),
    (rename_key("llama.feed_forward_length"), "GGUF key 'llama.feed_forward_length' is missing"),
    (set_value("llama.attention.head_count", 0),
     "GGUF key 'llama.attention.head_count' is 0; expected an integer >= 1"),
    (set_value("llama.attention.head_count_kv", 0),
     "GGUF key 'llama.attention.head_count_kv' is 0; expected an integer >= 1"),
    (set_value("llama.attention.head_count", 0x40800000, gguf.GGUFValueType.FLOAT32),  # the bits of 4.0
     "GGUF key 'llama.attention.head_count' is 4.0; expected an integer >= 1"),
    (set_value("llama.block_count", 0xFFFFFFFF, gguf.GGUFValueType.INT32),  # the bits of -1
     "GGUF key 'llama.block_count' is -1; expected an integer >= 1"),
])
def test_bad_model_metadata(edit, message, tmp_path):
    path = edited_gguf(tmp_path / "bad.gguf", edit)
    if message.endswith("missing"):
        message += "; the file does not describe the model, export it again with llama.cpp's convert_hf_to_gguf.py"
    assert refused(path, ConversionError, tmp_path) == f"bad.gguf: {message}"


def test_architecture_not_utf8(tmp_path):
    def edit(reader):
        field = reader.fields["general.architecture"]
        field.parts[field.data[0]][:] = 0xFF
    path = edited_gguf(tmp_path / "arch.gguf", edit)
    assert refused(path, ConversionError, tmp_path) == (
        "GGUF key 'general.architecture' holds text that is not valid UTF-8 "
        "('utf-8' codec can't decode byte 0xff in position 0: invalid start byte).")


def tensor_offset(reader, name: str):
    """The stored offset (relative to the data section) of tensor `name`, as a writable 1-element array."""
    return next(t for t in reader.tensors if t.name == name).field.parts[-1]


def test_misaligned_tensor_data(tmp_path):
    def edit(reader):
        tensor_offset(reader, "token_embd.weight")[0] += 1
    path = edited_gguf(tmp_path / "shifted.gguf", edit)
    assert refused(path, ConversionError, tmp_path) == (
        "shifted.gguf: tensor 'token_embd.weight' starts at data offset 1, not a multiple of the file's alignment 32; "
        "the file is corrupt, download or export it again")


def test_overlapping_tensor_data(tmp_path):
    def edit(reader):
        tensor_offset(reader, "blk.0.attn_norm.weight")[0] = tensor_offset(reader, "token_embd.weight")[0]
    path = edited_gguf(tmp_path / "overlap.gguf", edit)
    assert refused(path, ConversionError, tmp_path) == (
        "overlap.gguf: the data of tensors 'token_embd.weight' and 'blk.0.attn_norm.weight' overlap; "
        "the file is corrupt, download or export it again")


def test_llama_q_rows_not_divisible_by_heads(tmp_path):
    def edit(reader):  # 30 rows of 64: the tensor shrinks in place, the data after it stays aligned
        next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight").field.parts[3][1] = 30
    source = GGUFSource(str(edited_gguf(tmp_path / "q30.gguf", edit)))
    try:
        with pytest.raises(ConversionError) as raised:
            source.load("model.layers.0.self_attn.q_proj.weight")
    finally:
        source.close()
    assert str(raised.value) == (
        "q30.gguf: GGUF tensor 'blk.0.attn_q.weight' has 30 rows, which do not split into 4 heads of two rope halves; "
        "the file is corrupt or not a llama model, export it again")


# ------------------------------------------------------------------------------------- CLI


def test_cli_prints_one_error_line(src, tmp_path, capsys):
    rewrite_entry(src, data_offsets=["0", "256"])
    out = tmp_path / "ckpt"
    code, stdout, stderr = run_cli(capsys, "convert", src, out, "--quiet")
    assert (code, stdout) == (2, "")
    assert stderr == (f"error: {src}: model.safetensors: header entry for {VICTIM!r}"
                      + MALFORMED.format(info=entry(src)) + "\n")
    assert_nothing_written(out)


def test_cli_subprocess_without_traceback(tmp_path):
    path = edited_gguf(tmp_path / "no-heads.gguf", rename_key("llama.attention.head_count"))
    out = tmp_path / "ckpt"
    result = run_cli_subprocess("convert", path, out, "--quiet")
    assert (result.returncode, result.stdout, result.stderr) == (2, "", (
        "error: no-heads.gguf: GGUF key 'llama.attention.head_count' is missing; the file does not describe the "
        "model, export it again with llama.cpp's convert_hf_to_gguf.py\n"))
    assert_nothing_written(out)


# ------------------------------------------------------------------------------ weight values


def _edit_weight(folder: Path, name: str, edit) -> None:
    """Rewrite folder/model.safetensors with tensor `name` changed in place by `edit(array)`."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    edit(tensors[name])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("weights", ["f32", "f16"])
def test_non_finite_weight_is_refused(weights, src, tmp_path):
    # the quantized formats refused NaN already; stored as a float it used to pass, and every logit was NaN
    _edit_weight(src, VICTIM, lambda values: values.__setitem__(17, float("nan")))
    out = tmp_path / "out" / "ckpt"
    with pytest.raises(ConversionError) as raised:
        convert(str(src), str(out), QuantPlan(weights=weights), progress=False)
    assert_nothing_written(out)
    assert str(raised.value) == (f"tensor {VICTIM} (f32): the source holds a non-finite value (nan) at index [17]; its "
                                 "weights are damaged: download or export the model again")


def test_weight_beyond_float16_range_is_refused_for_f16(src, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    _edit_weight(src, name, lambda values: values.__setitem__((3, 5), 1e6))
    out = tmp_path / "out" / "ckpt"
    with pytest.raises(ConversionError) as raised:
        convert(str(src), str(out), QuantPlan(weights="f16"), progress=False)
    assert_nothing_written(out)
    assert str(raised.value) == (f"tensor {name} (f16): a value of magnitude 1e+06 exceeds the float16 range (65504); "
                                 "keep this tensor f32 (--ffn f32, or --weights f32)")
    convert(str(src), str(out), QuantPlan(weights="f16", overrides={"ffn": "f32"}), progress=False)  # the remedy
