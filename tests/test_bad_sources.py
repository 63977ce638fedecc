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
import numpy as np
import pytest
from gguf_files import finish
from safetensors.numpy import load_file, save_file
from test_bad_input import (
    assert_nothing_written,
    read_safetensors_header,
    run_cli,
    run_cli_subprocess,
    write_tiny_gguf,
    write_tiny_llama,
)
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors

import edge
from converters.convert import QuantPlan, convert
from converters.gguf_source import GGUFSource
from converters.hf_source import HFSource
from edge.core.errors import CheckpointError, ConversionError, UnsupportedModelError
from edge.tokenizer import Tokenizer as EdgeTokenizer
from edge.tokenizer import TokenizerError

VICTIM = "model.norm.weight"  # a [64] float32 tensor of the tiny Llama
# JSON nested far past any real file's 4-8 levels: json's parser recursed until RecursionError
DEEP_LISTS = b"[" * 100_000 + b"]" * 100_000
DEEP_OBJECTS = b'{"a": ' * 100_000 + b"1" + b"}" * 100_000
TOO_DEEP = "{} {{path}} is not valid JSON (arrays and objects nest deeper than 64 levels); restore the file"


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


def test_header_nested_too_deep(src, tmp_path):
    weights = src / "model.safetensors"
    header = b'{"__metadata__": {"format": "pt"}, "x": ' + DEEP_LISTS + b"}"
    weights.write_bytes(struct.pack("<Q", len(header)) + header)
    assert refused(src, ConversionError, tmp_path) == (
        f"{src}: model.safetensors: header is not valid JSON (arrays and objects nest deeper than 64 levels)")


def span(header: dict, name: str) -> tuple[int, int]:
    return tuple(header[name]["data_offsets"])


def tensor_at(header: dict, begin: int) -> str:
    """The tensor whose data begins at byte `begin` of the data buffer."""
    return next(key for key in header if key != "__metadata__" and span(header, key)[0] == begin)


def tensor_before(header: dict, name: str) -> str:
    """The tensor whose data ends where `name`'s begins."""
    return next(key for key in header if key != "__metadata__" and span(header, key)[1] == span(header, name)[0])


def moved(name: str, by: int):
    """Shift tensor `name`'s data offsets by `by` bytes."""
    return lambda header: header[name].update(data_offsets=[o + by for o in span(header, name)])


def same_bytes_as(name: str, other: str):
    """Give tensor `name` the data offsets of `other` (of the same size)."""
    return lambda header: header[name].update(data_offsets=header[other]["data_offsets"])


NORM0, NORM1 = "model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"  # [64] float32
CORRUPT = "the file is corrupt or its header was edited, download or export it again"
# (edit of the header, the exact message after "<src>: model.safetensors: " given the unedited header)
LAYOUT_CASES = {
    "overlapping-the-tensor-before": (moved(VICTIM, -4), lambda h: (
        f"the data of tensors {tensor_before(h, VICTIM)!r} (bytes [{span(h, tensor_before(h, VICTIM))[0]}, "
        f"{span(h, VICTIM)[0]}) of the data buffer) and {VICTIM!r} (bytes [{span(h, VICTIM)[0] - 4}, "
        f"{span(h, VICTIM)[1] - 4})) overlap; {CORRUPT}")),
    "same-bytes-as-another": (same_bytes_as(VICTIM, NORM1), lambda h: (
        f"the data of tensors {NORM1!r} (bytes [{span(h, NORM1)[0]}, {span(h, NORM1)[1]}) of the data buffer) and "
        f"{VICTIM!r} (bytes [{span(h, NORM1)[0]}, {span(h, NORM1)[1]})) overlap; {CORRUPT}")),
    "shifted-forward": (moved(NORM0, 4), lambda h: (
        f"tensor {NORM0!r} starts at byte {span(h, NORM0)[0] + 4} of the data buffer, but the tensors before it end "
        f"at byte {span(h, NORM0)[0]}; safetensors tensors lie back to back, so its offsets are shifted: {CORRUPT}")),
    "moved-onto-the-first": (lambda h: h[NORM0].update(data_offsets=[0, 256]), lambda h: (
        f"the data of tensors {NORM0!r} (bytes [0, 256) of the data buffer) and {tensor_at(h, 0)!r} "
        f"(bytes [0, {span(h, tensor_at(h, 0))[1]})) overlap; {CORRUPT}")),
}


@pytest.mark.parametrize("name", LAYOUT_CASES)
def test_tensor_data_must_lie_back_to_back(name, src, tmp_path):
    """Overlapping or shifted data_offsets used to be read as given: two tensors shared bytes."""
    edit, message = LAYOUT_CASES[name]
    original = read_safetensors_header(src / "model.safetensors")[1]
    rewrite_header(src, edit)
    assert refused(src, ConversionError, tmp_path) == f"{src}: model.safetensors: {message(original)}"


def test_bytes_after_the_last_tensor(src, tmp_path):
    weights = src / "model.safetensors"
    data_size = weights.stat().st_size - 8 - read_safetensors_header(weights)[0]
    with open(weights, "ab") as f:
        f.write(bytes(8))
    assert refused(src, ConversionError, tmp_path) == (
        f"{src}: model.safetensors: the tensors' data ends at byte {data_size} of the data buffer, but the file holds "
        f"{data_size + 8} data bytes; {CORRUPT}")


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
    # nested past any real config
    pytest.param("config.json", DEEP_LISTS, TOO_DEEP.format("config"), id="config-deep-lists"),
    pytest.param("config.json", DEEP_OBJECTS, TOO_DEEP.format("config"), id="config-deep-objects"),
    pytest.param("config.json", b"[" * 65 + b"]" * 65, TOO_DEEP.format("config"),  # parses, too deep to keep
                 id="config-65-levels"),
    pytest.param("config.json", b'{"model_type": "llama", "eos_token_id": ' + DEEP_LISTS + b"}",
                 TOO_DEEP.format("config"), id="config-deep-eos"),
    pytest.param("generation_config.json", DEEP_LISTS, TOO_DEEP.format("generation config"), id="generation-deep"),
    pytest.param("tokenizer_config.json", DEEP_OBJECTS, TOO_DEEP.format("tokenizer config"), id="tokenizer-deep"),
    pytest.param("model.safetensors.index.json", DEEP_LISTS, TOO_DEEP.format("safetensors index"), id="index-deep"),
    ("config.json", b'{"model_type": "llama",', "config {path} is not valid JSON (Expecting property name enclosed in "
                                                 "double quotes: line 1 column 24 (char 23)); restore the file"),
    # token ids of generation_config.json: an id or a list of ids of the vocabulary (128 tokens)
    ("generation_config.json", b'{"eos_token_id": [[1, 2]]}',
     "{path}: eos_token_id is [[1, 2]]; expected a token id or a list of token ids"),
    ("generation_config.json", b'{"eos_token_id": 2.0}', "{path}: eos_token_id is 2.0; expected a token id or a list "
                                                         "of token ids"),
    ("generation_config.json", b'{"eos_token_id": {"id": 2}}',
     "{path}: eos_token_id is {{'id': 2}}; expected a token id or a list of token ids"),
    ("generation_config.json", b'{"eos_token_id": false}',
     "{path}: eos_token_id is False; expected a token id or a list of token ids"),
    ("generation_config.json", b'{"pad_token_id": "<pad>"}',
     "{path}: pad_token_id is '<pad>'; expected a token id or a list of token ids"),
    ("generation_config.json", b'{"eos_token_id": 128}',
     "{path}: eos_token_id 128 is not a token of the model: vocab_size is 128; fix eos_token_id (or vocab_size)"),
    ("generation_config.json", b'{"bos_token_id": [1, 5000]}',
     "{path}: bos_token_id 5000 is not a token of the model: vocab_size is 128; fix bos_token_id (or vocab_size)"),
    ("generation_config.json", b'{"pad_token_id": -1}',
     "{path}: pad_token_id is -1; expected a token id or a list of token ids"),
    # the sampling it asks a conversation to use
    ("generation_config.json", b'{"do_sample": "yes"}', "{path}: do_sample is 'yes'; expected true or false; restore the file"),
    ("generation_config.json", b'{"do_sample": true, "temperature": "hot"}',
     "{path}: temperature must be a finite number >= 0, got 'hot'; restore the file"),
    ("generation_config.json", b'{"do_sample": true, "top_p": 2}',
     "{path}: top_p must be a finite number in [0, 1], got 2.0; restore the file"),
    ("generation_config.json", b'{"do_sample": true, "top_k": 0.5}',
     "{path}: top_k must be an integer >= 0, got 0.5; restore the file"),
    pytest.param("generation_config.json", b'{"eos_token_id": [' + b"1, " * 100_000 + b'1.5]}',
                 "{path}: eos_token_id is [" + "1, " * 26 + "1...; expected a token id or a list of token ids",
                 id="generation-long-eos-list"),
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


# --------------------------------------------------------------------------- sharded weights

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


@pytest.fixture
def sharded(src) -> Path:
    """src with its weights in two shards and an index, as save_pretrained writes a large model (VICTIM, the
    last name, is in the second shard)."""
    weights = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    names = sorted(weights)
    halves = {SHARDS[0]: names[:len(names) // 2], SHARDS[1]: names[len(names) // 2:]}
    for shard, shard_names in halves.items():
        save_file({name: weights[name] for name in shard_names}, src / shard)
    write_index(src, {name: shard for shard, shard_names in halves.items() for name in shard_names})
    return src


def write_index(folder: Path, weight_map: dict) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_a_shard_named_two_ways_is_read_once(sharded, tmp_path):
    """The names "./a" and "a" are one shard; opened under both, its tensors were each said to be stored twice."""
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    first = next(name for name, shard in weight_map.items() if shard == SHARDS[0])
    write_index(sharded, {**weight_map, first: "./" + SHARDS[0]})
    convert(str(sharded), str(tmp_path / "ckpt"), QuantPlan(weights="int8"), progress=False)
    with edge.load(str(tmp_path / "ckpt")) as model:
        assert model.checkpoint.tensors.keys() == set(weight_map)


@pytest.mark.parametrize("shard", ["../model.safetensors", "/elsewhere/model.safetensors"])
def test_a_shard_outside_the_folder_is_refused(shard, sharded, tmp_path):
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    write_index(sharded, {**weight_map, VICTIM: shard})
    assert refused(sharded, ConversionError, tmp_path) == (
        f"{sharded / 'model.safetensors.index.json'} maps tensor {VICTIM!r} to {shard!r}, which lies outside "
        f"{sharded}; shards are files of the model's folder: restore the index")


def test_a_tensor_in_two_shards_is_refused(sharded, tmp_path):
    first = load_file(sharded / SHARDS[0])
    first[VICTIM] = load_file(sharded / SHARDS[1])[VICTIM]
    save_file(first, sharded / SHARDS[0])
    assert refused(sharded, ConversionError, tmp_path) == (
        f"{sharded}: tensor {VICTIM!r} is in both {SHARDS[0]} and {SHARDS[1]}; a tensor belongs to one shard: "
        "download the model again (every shard and the index from one revision)")


# ------------------------------------------------------------------ tokens beyond the vocabulary


def character_tokenizer() -> dict:
    """tokenizer.json of a character tokenizer of 98 ids (the tiny Llama has 128): <unk>, <s>, </s> and
    printable ASCII, BOS before every text."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(c): 3 + i for i, c in enumerate(range(ord(" "), ord("~") + 1))}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return json.loads(tokenizer.to_str())


def _add_tokens(tokenizer: dict) -> None:
    """31 added tokens that are not in the vocabulary: tokenizers gives them the next ids (98 to 128), whatever
    ids the file says, as a fine-tune that added tokens without resizing the embeddings does."""
    tokenizer["added_tokens"] += [{**tokenizer["added_tokens"][0], "id": 0, "content": f"<tool{i}>"} for i in range(31)]


@pytest.mark.parametrize("edit, token, token_id", [
    pytest.param(lambda t: t["model"]["vocab"].update(a=128), "a", 128, id="vocabulary"),
    pytest.param(_add_tokens, "<tool30>", 128, id="added-tokens"),
    pytest.param(lambda t: t["post_processor"]["special_tokens"]["<s>"].update(ids=[1000]), "<s>", 1000,
                 id="post-processor"),
])
def test_tokenizer_ids_beyond_the_vocabulary_are_refused(edit, token, token_id, src, tmp_path):
    """Such a tokenizer converted, and its prompts were refused at run time (or a generation never stopped at
    an end-of-turn token it could not produce)."""
    tokenizer = character_tokenizer()
    edit(tokenizer)
    (src / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert refused(src, ConversionError, tmp_path) == (
        f"{src / 'tokenizer.json'}: token {token!r} has id {token_id}, but the model's vocab_size is 128: no "
        "embedding holds it; the tokenizer and the weights disagree: convert the model with the tokenizer that "
        "came with its weights")


def test_gguf_with_more_tokens_than_embeddings_is_refused(tmp_path):
    """A GGUF whose vocabulary lists tokens past its vocab_size (the embeddings' rows): an end-of-turn token
    among them made a checkpoint that could not load (its eog_token_ids beyond the vocabulary)."""
    tiny = gguf.GGUFReader(write_tiny_gguf(tmp_path / "tiny.gguf"))
    writer = gguf.GGUFWriter(str(tmp_path / "more.gguf"), "llama")
    for field in tiny.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        if field.name == gguf.Keys.Tokenizer.LIST:
            value += ["<|im_end|>"]
        elif field.name == gguf.Keys.Tokenizer.TOKEN_TYPE:
            value += [gguf.TokenType.CONTROL]
        writer.add_key_value(field.name, value, field.types[0],
                             sub_type=field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    writer.add_vocab_size(260)
    for tensor in tiny.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data))
    finish(writer)
    path = tmp_path / "more.gguf"
    assert refused(path, ConversionError, tmp_path) == (
        f"{path} (its 'tokenizer.ggml.tokens'): token '<|im_end|>' has id 260, but the model's vocab_size is 260: no "
        "embedding holds it; the tokenizer and the weights disagree: convert the model with the tokenizer that came "
        "with its weights")


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


def test_text_the_tokenizer_cannot_encode(src, tmp_path):
    """A WordLevel tokenizer whose unknown token is not in its vocabulary cannot encode a character outside it;
    the tokenizers library's bare Exception was a traceback."""
    tokenizer = character_tokenizer()
    del tokenizer["model"]["vocab"]["<unk>"]
    (src / "tokenizer.json").write_text(json.dumps(tokenizer))
    convert(str(src), str(tmp_path / "ckpt"), QuantPlan(weights="int8"), progress=False)
    with edge.load(str(tmp_path / "ckpt")) as model:
        assert model.encode("Hi") == [1, 43, 76]  # <s>, then a character's id
        with pytest.raises(TokenizerError) as raised:
            model.encode("caf\u00e9")
    assert str(raised.value) == (
        f"{tmp_path / 'ckpt' / 'tokenizer.json'} cannot encode the text (WordLevel error: Missing [UNK] token from "
        "the vocabulary); pass token ids instead, or convert the model again from a tokenizer that can")


def test_chat_template_that_fails_with_a_python_error(src, tmp_path):
    """A template is a program: one dividing by zero raised ZeroDivisionError out of model.chat."""
    (src / "tokenizer.json").write_text(json.dumps(character_tokenizer()))
    (src / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages | length / 0 }}"}))
    convert(str(src), str(tmp_path / "ckpt"), QuantPlan(weights="int8"), progress=False)
    with edge.load(str(tmp_path / "ckpt")) as model:
        with pytest.raises(TokenizerError) as raised:
            model.chat([{"role": "user", "content": "Hi"}])
    assert str(raised.value) == (
        "the checkpoint's chat template failed (ZeroDivisionError: division by zero); generate with a plain prompt, "
        "or convert the model from a source with a working template")


# ------------------------------------------------------------------------- a checkpoint's files


@pytest.fixture
def checkpoint(src, tmp_path) -> Path:
    out = tmp_path / "ckpt"
    convert(str(src), str(out), QuantPlan(weights="int8"), progress=False)
    return out


def test_checkpoint_manifest_nested_too_deep(checkpoint):
    manifest = checkpoint / "zllm.json"
    manifest.write_bytes(DEEP_OBJECTS)
    with pytest.raises(CheckpointError) as raised:
        edge.load(str(checkpoint))
    assert str(raised.value) == (f"{manifest} is not valid JSON (arrays and objects nest deeper than 64 levels); the "
                                 "checkpoint is damaged, convert the model again")


def test_checkpoint_tensors_sharing_bytes(checkpoint):
    """The checkpoint's own safetensors file is held to the same layout; the file keeps its size (the
    manifest records it), only the header changes."""
    weights = checkpoint / "model.safetensors"
    header_len, header = read_safetensors_header(weights)
    shared = span(header, NORM1)
    header[VICTIM]["data_offsets"] = list(shared)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    assert len(encoded) <= header_len
    with open(weights, "r+b") as f:
        f.seek(8)
        f.write(encoded.ljust(header_len))
    with pytest.raises(CheckpointError) as raised:
        edge.load(str(checkpoint))
    assert str(raised.value) == (
        f"{checkpoint}: model.safetensors: the data of tensors {NORM1!r} (bytes [{shared[0]}, {shared[1]}) of the data "
        f"buffer) and {VICTIM!r} (bytes [{shared[0]}, {shared[1]})) overlap; {CORRUPT}")


@pytest.mark.parametrize("entry, message", [
    ({"eos_token_id": "abc"}, 'tokenizer: eos_token_id is "abc"; expected a token id below vocab_size 128, or null'),
    ({"eos_token_id": [2]}, "tokenizer: eos_token_id is [2]; expected a token id below vocab_size 128, or null"),
    ({"bos_token_id": 128}, "tokenizer: bos_token_id is 128; expected a token id below vocab_size 128, or null"),
    ({"eog_token_ids": 2}, "tokenizer: eog_token_ids is 2; expected a list of token ids below vocab_size 128, or null"),
    ({"eog_token_ids": [[1, 2]]},
     "tokenizer: eog_token_ids is [[1, 2]]; expected a list of token ids below vocab_size 128, or null"),
    ({"eog_token_ids": [2, 1.0]},
     "tokenizer: eog_token_ids is [2, 1.0]; expected a list of token ids below vocab_size 128, or null"),
    # a template of another type failed only when a chat was rendered; a flag "false" was true
    ({"chat_template": 5}, "tokenizer: chat_template is 5; expected a Jinja template string, or null"),
    ({"chat_template": ["{{ x }}"]},
     'tokenizer: chat_template is ["{{ x }}"]; expected a Jinja template string, or null'),
    ({"add_bos_token": "false"}, 'tokenizer: add_bos_token is "false"; expected true or false, or null'),
    ({"add_eos_token": 1}, "tokenizer: add_eos_token is 1; expected true or false, or null"),
])
def test_checkpoint_token_ids(entry, message, checkpoint):
    """The manifest's special ids are tokens of the model (an integer eog_token_ids was a TypeError at load), its
    flags and chat template of their types."""
    manifest_path = checkpoint / "zllm.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["tokenizer"].update(entry)
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as raised:
        edge.load(str(checkpoint))
    assert str(raised.value) == f"{manifest_path}: {message}; the checkpoint is damaged, convert the model again"


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


def test_cli_subprocess_for_a_config_nested_too_deep(src, tmp_path):
    """100,000 nested lists in config.json ended in a RecursionError traceback."""
    (src / "config.json").write_bytes(DEEP_LISTS)
    out = tmp_path / "ckpt"
    result = run_cli_subprocess("convert", src, out, "--quiet")
    assert (result.returncode, result.stdout, result.stderr) == (2, "", (
        f"error: config {src / 'config.json'} is not valid JSON (arrays and objects nest deeper than 64 levels); "
        "restore the file\n"))
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


@pytest.mark.parametrize("generation_config, sampling, origin", [
    ({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95},
     {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0, "repetition_penalty": 1.0},
     "the checkpoint's generation_config.json"),
    ({"do_sample": False, "temperature": 0.6}, {"temperature": 0.0}, "the checkpoint's generation_config.json"),
    ({"eos_token_id": 2}, {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}, "llama.cpp's and Ollama's defaults"),
])
def test_a_conversation_samples_as_the_generation_config_says(src, tmp_path, generation_config, sampling, origin):
    """do_sample true: its values over transformers' defaults; false: greedy; not said: llama.cpp's defaults."""
    import edge

    (src / "generation_config.json").write_text(json.dumps(generation_config))
    out = tmp_path / "ckpt"
    convert(str(src), str(out), QuantPlan(weights="int8"), progress=False)
    with edge.load(str(out)) as model:
        assert model.conversation_sampling() == (sampling, origin)


def test_a_damaged_sampling_entry_is_refused_at_load(src, tmp_path):
    import edge
    from edge.core.errors import CheckpointError

    (src / "generation_config.json").write_text(json.dumps({"do_sample": True}))
    out = tmp_path / "ckpt"
    convert(str(src), str(out), QuantPlan(weights="int8"), progress=False)
    manifest = json.loads((out / "zllm.json").read_text())
    manifest["tokenizer"]["sampling"]["top_p"] = -1
    (out / "zllm.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as raised:
        edge.load(str(out))
    assert str(raised.value) == (f"{out / 'zllm.json'}: tokenizer: top_p must be a finite number in [0, 1], got -1.0; "
                                 "the checkpoint is damaged, convert the model again")
