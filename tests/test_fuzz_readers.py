"""Property-based fuzzing of every file reader: a valid file with a few random mutations (byte flips,
truncations, lying 64-bit numbers, zeroed runs; for JSON files also values of the wrong type or range,
deleted and duplicated entries; for a GGUF's tokenizer, its keys rewritten with GGUFWriter) either reads
into a working model or is refused with the project's typed error. Never another exception, a hang (each
example has a deadline), NaN logits or a half-written checkpoint: a mutated file that converts or loads
must also run, and where it has a tokenizer, encode and decode a prompt and render a chat.

Seeded (`derandomize`) and bounded, so CI runs the same examples every time in well under a minute;
a longer local run: ZLLM_EDGE_FUZZ_EXAMPLES=2000 python -m pytest tests/test_fuzz_readers.py.
Cases that once broke a reader stay as explicit `@example`s (the regression corpus), or as exact-message
tests beside the reader's other damage tests (test_bad_gguf_counts, test_bad_sources, test_bad_configs,
test_gguf_tokenizer, test_saved_sessions, test_moe_checkpoint).
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from copy import deepcopy
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_files import byte_alphabet, finish
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file
from test_bad_input import assert_nothing_written, write_tiny_gguf
from tiny_models import VOCAB, random_prompt, tiny_zoo  # noqa: F401
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

import edge
from converters.convert import QuantPlan, convert
from edge.core.errors import ZllmError
from quant.checkpoint import sealed

EXAMPLES = int(os.environ.get("ZLLM_EDGE_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=10_000,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
LYING_NUMBERS = [0, 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**63 - 1, 2**64 - 1]


def mutations(hot_bytes: int):
    """Lists of (kind, position, value): positions mostly inside the first `hot_bytes` (headers, metadata)."""
    position = st.one_of(st.integers(0, hot_bytes - 1), st.floats(0.0, 1.0))
    kind = st.sampled_from(["flip", "truncate", "number", "zeros"])
    return st.lists(st.tuples(kind, position, st.integers(0, len(LYING_NUMBERS) - 1)), min_size=1, max_size=3)


def mutated(data: bytes, edits) -> bytes:
    data = bytearray(data)
    for kind, position, value in edits:
        at = position if isinstance(position, int) else int(position * len(data))
        at = min(at, max(len(data) - 1, 0))
        if kind == "flip":
            data[at] ^= 1 << (value % 8)
        elif kind == "truncate":
            del data[at:]
        elif kind == "number":
            data[at:at + 8] = struct.pack("<Q", LYING_NUMBERS[value])
        else:
            data[at:at + 4 * (value + 1)] = bytes(len(data[at:at + 4 * (value + 1)]))
        if not data:
            break
    return bytes(data)


PROMPT = "Hello, world<|im_end|>"  # text, and a special token of the tokenizers below
MESSAGES = [{"role": "user", "content": "Hi"}]


def runs_or_is_refused(load, text: bool = False, converted: bool = False) -> None:
    """load() -> a model, or a typed error; a model that loads must run one prefill to finite logits
    (or refuse it with a typed error, such as NumericalError). With `text`, a model with a tokenizer must
    also encode PROMPT and decode the ids, and reply to MESSAGES through its chat template when it has one,
    each step or refuse it with a typed error. A checkpoint just `converted` must load, and encode into ids
    of its vocabulary (the converter checks what it writes, the tokenizer against the embeddings)."""
    try:
        model = load()
    except ZllmError:
        if converted:
            raise
        return
    with model:
        steps = [_prefill]
        if text and model.tokenizer is not None:
            steps += [_encode_and_decode, _chat]
        for step in steps:
            try:
                step(model, converted)
            except ZllmError:
                pass


def _prefill(model, converted: bool) -> None:
    assert np.isfinite(model.session(capacity=8).prefill([1, 2, 3])).all()


def _encode_and_decode(model, converted: bool) -> None:
    ids = model.encode(PROMPT)
    if converted:
        assert all(0 <= i < model.spec.vocab_size for i in ids), ids
    assert isinstance(model.decode(ids), str)


def _chat(model, converted: bool) -> None:
    if model.tokenizer.chat_template:
        assert isinstance("".join(model.chat(MESSAGES, max_new_tokens=2)), str)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[bytes, int]:
    path = write_tiny_gguf(tmp_path_factory.mktemp("fuzz") / "tiny.gguf")
    return path.read_bytes(), gguf.GGUFReader(str(path)).data_offset


@FUZZ
@given(data=st.data())
@example(data=None)  # the file as written converts and runs
def test_gguf(tiny_gguf, data):
    source, metadata_bytes = tiny_gguf
    edits = [] if data is None else data.draw(mutations(metadata_bytes))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "model.gguf")
        path.write_bytes(mutated(source, edits))
        out = Path(folder, "out")
        try:
            convert(str(path), str(out), QuantPlan(weights="source"), progress=False)
        except ZllmError:
            assert not out.exists()  # nothing half-written
            return
        runs_or_is_refused(lambda: edge.load(out, device="reference"), text=True, converted=True)


@pytest.fixture(scope="module")
def checkpoint(tiny_zoo) -> str:
    return tiny_zoo.converted("qwen3_moe_norm", QuantPlan(weights="int8", group_size=32, overrides={"experts": "int4"}))


def _copy(checkpoint: str, folder: str) -> Path:
    target = Path(folder, "ckpt")
    shutil.copytree(checkpoint, target)
    return target


@FUZZ
@given(data=st.data())
def test_manifest(checkpoint, data):
    text = Path(checkpoint, "zllm.json").read_bytes()
    edits = data.draw(mutations(len(text)))
    with tempfile.TemporaryDirectory() as folder:
        copy = _copy(checkpoint, folder)
        (copy / "zllm.json").write_bytes(mutated(text, edits))
        strategy = data.draw(st.sampled_from(["resident", "predictive"]))
        runs_or_is_refused(lambda: edge.load(copy, device="reference", expert_strategy=strategy,
                                             memory_budget=None if strategy == "resident" else "50%"))


@FUZZ
@given(data=st.data())
def test_manifest_values(checkpoint, data):
    """The manifest as valid JSON whose numbers and strings are replaced (what byte flips rarely reach)."""
    manifest = json.loads(Path(checkpoint, "zllm.json").read_text())
    leaves = []

    def collect(node, path):
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in items:
            if isinstance(child, (dict, list)):
                collect(child, path + [key])
            else:
                leaves.append(path + [key])

    collect(manifest, [])
    odd = st.one_of(st.sampled_from([-1, 0, 2**63, 1e308, float("nan"), "", "x", None, True, [], {}, [[1]]]),
                    st.integers(-2**70, 2**70))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(leaves))
        node = manifest
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = data.draw(odd)
    if data.draw(st.booleans()):  # an edit that also writes the digest again: the checks behind it must hold
        sealed(manifest)
    with tempfile.TemporaryDirectory() as folder:
        copy = _copy(checkpoint, folder)
        (copy / "zllm.json").write_text(json.dumps(manifest))
        runs_or_is_refused(lambda: edge.load(copy, device="reference"))


@FUZZ
@given(data=st.data())
def test_safetensors_header(checkpoint, data):
    weights = Path(checkpoint, "model.safetensors").read_bytes()
    header = 8 + struct.unpack("<Q", weights[:8])[0]
    edits = [(kind, at, value) for kind, at, value in data.draw(mutations(header)) if kind != "truncate"]
    with tempfile.TemporaryDirectory() as folder:
        copy = _copy(checkpoint, folder)
        (copy / "model.safetensors").write_bytes(mutated(weights, edits)[:len(weights)].ljust(len(weights), b"\0"))
        runs_or_is_refused(lambda: edge.load(copy, device="reference"))


@pytest.fixture(scope="module")
def saved_session(tiny_zoo, tmp_path_factory):
    model = edge.load(tiny_zoo.converted("llama_gqa_tied", QuantPlan(weights="int8", group_size=32)),
                      device="reference", kv_cache="int8")
    path = tmp_path_factory.mktemp("fuzz") / "s.zsession"
    session = model.session(capacity=16)
    session.prefill(random_prompt(6, seed=3))
    session.save(path)
    return model, path.read_bytes()


@FUZZ
@given(data=st.data())
def test_saved_session(saved_session, data):
    model, saved = saved_session
    header = 52 + struct.unpack("<Q", saved[12:20])[0]
    edits = data.draw(mutations(header))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "s.zsession")
        path.write_bytes(mutated(saved, edits))
        try:
            session = model.load_session(path)
        except ZllmError:
            return
        try:
            assert np.isfinite(session.decode(1)).all()
        except ZllmError:
            pass
        finally:
            session.close()


@FUZZ
@given(data=st.data())
def test_hugging_face_config(tiny_zoo, data):
    source = Path(tiny_zoo.hf_folder("llama_gqa_tied"))
    config = (source / "config.json").read_bytes()
    edits = data.draw(mutations(len(config)))
    with tempfile.TemporaryDirectory() as folder:
        copy = Path(folder, "hf")
        shutil.copytree(source, copy)
        (copy / "config.json").write_bytes(mutated(config, edits))
        out = Path(folder, "out")
        try:
            convert(str(copy), str(out), QuantPlan(weights="int8", group_size=32), progress=False)
        except ZllmError:
            assert not out.exists()
            return
        runs_or_is_refused(lambda: edge.load(out, device="reference"), converted=True)


# ------------------------------------------------------------------ a GGUF's tokenizer keys
# The tiny GGUF's model keys and tensors (vocab_size 260) with a vocabulary of either kind the converter
# builds a tokenizer from; each example rewrites some of its tokenizer keys and writes the file anew.

TOKENIZER = gguf.Keys.Tokenizer
GGUF = gguf.GGUFValueType
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GGUF_VOCAB = 260


def byte_level_keys() -> dict:
    """gpt2 keys: the 256 byte symbols, two merges and ChatML's two control tokens."""
    tokens = byte_alphabet() + ["th", "the", "<|im_start|>", "<|im_end|>"]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 2) + [gguf.TokenType.CONTROL] * 2
    return {TOKENIZER.MODEL: ("gpt2", GGUF.STRING), TOKENIZER.PRE: ("gpt-2", GGUF.STRING),
            TOKENIZER.LIST: (tokens, GGUF.ARRAY, GGUF.STRING), TOKENIZER.TOKEN_TYPE: (types, GGUF.ARRAY, GGUF.INT32),
            TOKENIZER.MERGES: (["t h", "th e"], GGUF.ARRAY, GGUF.STRING), TOKENIZER.EOS_ID: (259, GGUF.UINT32),
            TOKENIZER.ADD_BOS: (False, GGUF.BOOL), TOKENIZER.CHAT_TEMPLATE: (CHATML, GGUF.STRING)}


def sentencepiece_keys() -> dict:
    """llama keys: special tokens, pieces scored best first (their merges come from the scores), single
    characters, then byte pieces up to 260 tokens."""
    special = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    pieces = ["el", "lo", "ello", "▁H", "▁Hello", "or", "ld", "orld", "▁w", "▁world", "▁Hi"]
    characters = ["▁"] + [chr(c) for c in range(ord("!"), ord("~") + 1)]
    byte_pieces = [f"<0x{b:02X}>" for b in range(GGUF_VOCAB - len(special) - len(pieces) - len(characters))]
    tokens = special + pieces + characters + byte_pieces
    types = ([gguf.TokenType.UNKNOWN] + [gguf.TokenType.CONTROL] * 4 + [gguf.TokenType.NORMAL] * (
        len(pieces) + len(characters)) + [gguf.TokenType.BYTE] * len(byte_pieces))
    scores = [0.0] * len(special) + [-float(rank) for rank in range(len(pieces))] + [
        -1000.0 - rank for rank in range(len(characters))] + [0.0] * len(byte_pieces)
    return {TOKENIZER.MODEL: ("llama", GGUF.STRING), TOKENIZER.LIST: (tokens, GGUF.ARRAY, GGUF.STRING),
            TOKENIZER.TOKEN_TYPE: (types, GGUF.ARRAY, GGUF.INT32), TOKENIZER.SCORES: (scores, GGUF.ARRAY, GGUF.FLOAT32),
            TOKENIZER.BOS_ID: (1, GGUF.UINT32), TOKENIZER.EOS_ID: (4, GGUF.UINT32), TOKENIZER.UNK_ID: (0, GGUF.UINT32),
            TOKENIZER.ADD_BOS: (True, GGUF.BOOL), TOKENIZER.CHAT_TEMPLATE: (CHATML, GGUF.STRING)}


VOCABULARIES = {"gpt2": byte_level_keys, "llama": sentencepiece_keys}
EDITED_KEYS = (TOKENIZER.MODEL, TOKENIZER.PRE, TOKENIZER.LIST, TOKENIZER.TOKEN_TYPE, TOKENIZER.SCORES,
               TOKENIZER.MERGES, TOKENIZER.BOS_ID, TOKENIZER.EOS_ID, TOKENIZER.PAD_ID, TOKENIZER.UNK_ID,
               TOKENIZER.EOT_ID, TOKENIZER.ADD_BOS, TOKENIZER.ADD_EOS, TOKENIZER.ADD_PREFIX, TOKENIZER.CHAT_TEMPLATE)
# a key's whole value replaced: wrong types, ids beyond the vocabulary, text that is not UTF-8, huge text
ODD_KEY_VALUES = {
    "0": (0, GGUF.UINT32), "259": (259, GGUF.UINT32), "260": (GGUF_VOCAB, GGUF.UINT32),
    "u32 max": (2**32 - 1, GGUF.UINT32), "-1": (-1, GGUF.INT32), "u64 max": (2**64 - 1, GGUF.UINT64),
    "1.5": (1.5, GGUF.FLOAT32), "nan": (float("nan"), GGUF.FLOAT32), "true": (True, GGUF.BOOL),
    "'false'": ("false", GGUF.STRING), "''": ("", GGUF.STRING), "not UTF-8": (b"\xff\xfe", GGUF.STRING),
    "huge": ("x" * 2**20, GGUF.STRING), "'gpt2'": ("gpt2", GGUF.STRING), "'llama'": ("llama", GGUF.STRING),
    "template that refuses": ("{{ raise_exception('no') }}", GGUF.STRING),
    "template dividing by 0": ("{{ 1/0 }}", GGUF.STRING), "not Jinja": ("{% for %}", GGUF.STRING),
    "integers": ([1, 2], GGUF.ARRAY, GGUF.INT32), "strings": (["a", "b"], GGUF.ARRAY, GGUF.STRING),
    "numbers": ([1.0], GGUF.ARRAY, GGUF.FLOAT32), "booleans": ([True], GGUF.ARRAY, GGUF.BOOL),
    "strings not UTF-8": ([b"\xff"], GGUF.ARRAY, GGUF.STRING),
}
# one item of an array replaced, by the array's item type
ODD_ITEMS = {
    GGUF.STRING: {"''": "", "not UTF-8": b"\xc3", "huge": "a" * 2**20, "'<|im_end|>'": "<|im_end|>",
                  "'a b c'": "a b c", "'t h'": "t h", "'H'": "H"},
    GGUF.INT32: {"-1": -1, "99": 99, "i32 max": 2**31 - 1, "control": int(gguf.TokenType.CONTROL)},
    GGUF.FLOAT32: {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "1e38": 1e38},
}
ARRAY_ACTIONS = ("truncate", "extend", "duplicate", "item")


@st.composite
def key_edits(draw) -> list[tuple[str, str, float, str]]:
    """(key, action, position in [0, 1], value name): remove or replace a key, or cut, lengthen (with copies
    of its last items), copy one item over the next, or replace one item of an array."""
    edits = []
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(EDITED_KEYS))
        action = draw(st.sampled_from(("remove", "replace") + ARRAY_ACTIONS))
        items = {TOKENIZER.TOKEN_TYPE: GGUF.INT32, TOKENIZER.SCORES: GGUF.FLOAT32}.get(key, GGUF.STRING)
        names = ODD_ITEMS[items] if action == "item" else ODD_KEY_VALUES
        edits.append((key, action, draw(st.floats(0.0, 1.0)), draw(st.sampled_from(sorted(names)))))
    return edits


def edited_keys(keys: dict, edits) -> dict:
    keys = dict(keys)
    for key, action, position, name in edits:
        if action == "remove":
            keys.pop(key, None)
        elif action == "replace":
            keys[key] = ODD_KEY_VALUES[name]
        elif key in keys and keys[key][1] == GGUF.ARRAY:
            values, _, items = keys[key]
            values, at = list(values), int(position * (len(values) - 1))
            if action == "truncate":
                values = values[:at + 1]  # GGUFWriter writes no empty array
            elif action == "extend":
                values += values[-1 - int(position * 4):]
            elif action == "duplicate":
                values[(at + 1) % len(values)] = values[at]
            elif name in ODD_ITEMS.get(items, {}):
                values[at] = ODD_ITEMS[items][name]
            keys[key] = (values, GGUF.ARRAY, items)
    return keys


@pytest.fixture(scope="module")
def tiny_gguf_model(tmp_path_factory) -> tuple[list, list]:
    """The tiny GGUF's model keys (with vocab_size, which llama.cpp writes) and its tensors."""
    reader = gguf.GGUFReader(str(write_tiny_gguf(tmp_path_factory.mktemp("fuzz") / "tiny.gguf")))
    keys = [(field.name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
            for field in reader.fields.values()
            if not field.name.startswith(("GGUF.", "tokenizer.")) and field.name != "general.architecture"]
    keys.append(("llama.vocab_size", GGUF_VOCAB, GGUF.UINT32, None))
    return keys, [(tensor.name, np.array(tensor.data)) for tensor in reader.tensors]


def write_gguf(path: Path, model, tokenizer_keys: dict) -> None:
    model_keys, tensors = model
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, value, value_type, items in model_keys:
        writer.add_key_value(name, value, value_type, sub_type=items)
    for name, (value, value_type, *items) in tokenizer_keys.items():
        writer.add_key_value(name, value, value_type, sub_type=items[0] if items else None)
    for name, values in tensors:
        writer.add_tensor(name, values)
    finish(writer)


@FUZZ
@given(vocabulary=st.sampled_from(sorted(VOCABULARIES)), edits=key_edits())
@example(vocabulary="gpt2", edits=[])  # as written, each vocabulary converts, runs and chats
@example(vocabulary="llama", edits=[])
# were tracebacks: a vocabulary, token types or scores of the wrong type, a pre-tokenizer name that is an array
@example(vocabulary="gpt2", edits=[(TOKENIZER.LIST, "replace", 0.0, "integers"), (TOKENIZER.EOS_ID, "remove", 0.0, ""),
                                   (TOKENIZER.TOKEN_TYPE, "truncate", 0.004, "")])  # two tokens, two types
@example(vocabulary="gpt2", edits=[(TOKENIZER.LIST, "replace", 0.0, "259")])
@example(vocabulary="gpt2", edits=[(TOKENIZER.TOKEN_TYPE, "replace", 0.0, "strings"),
                                   (TOKENIZER.LIST, "truncate", 0.004, ""), (TOKENIZER.EOS_ID, "remove", 0.0, "")])
@example(vocabulary="llama", edits=[(TOKENIZER.SCORES, "replace", 0.0, "1.5")])
@example(vocabulary="gpt2", edits=[(TOKENIZER.PRE, "replace", 0.0, "strings")])
# a template that divides by zero failed with ZeroDivisionError at chat time
@example(vocabulary="gpt2", edits=[(TOKENIZER.CHAT_TEMPLATE, "replace", 0.0, "template dividing by 0")])
# took hours: the merges of a megabyte-long sentencepiece piece were sought at every cut
@example(vocabulary="llama", edits=[(TOKENIZER.LIST, "item", 0.1, "huge")])
# more tokens than embeddings: a copy of the end-of-turn token <|im_end|> took id 260, and the checkpoint
# written could not load (its eog_token_ids beyond the vocabulary)
@example(vocabulary="gpt2", edits=[(TOKENIZER.LIST, "extend", 0.0, ""), (TOKENIZER.TOKEN_TYPE, "extend", 0.0, "")])
def test_gguf_tokenizer(tiny_gguf_model, vocabulary, edits):
    with tempfile.TemporaryDirectory() as folder:
        path, out = Path(folder, "model.gguf"), Path(folder, "out")
        write_gguf(path, tiny_gguf_model, edited_keys(VOCABULARIES[vocabulary](), edits))
        try:
            convert(str(path), str(out), QuantPlan(weights="source"), progress=False)
        except ZllmError:
            assert_nothing_written(out)
            return
        runs_or_is_refused(lambda: edge.load(out, device="reference"), text=True, converted=True)


# ---------------------------------------------------------- a Hugging Face folder's other files
# llama_gqa_tied (vocab_size 160) with what a Hub model carries beside config.json: a tokenizer.json, its
# tokenizer_config.json (with a ChatML template), special_tokens_map.json, generation_config.json, and its
# weights in two shards with an index.

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
            "model.safetensors.index.json")
# a JSON value replaced: wrong types, ids beyond the vocabulary, shard names that are not the model's shards
ODD_JSON = {
    "-1": -1, "0": 0, "4": 4, "160": VOCAB, "2**32": 2**32, "2**64": 2**64, "1.5": 1.5, "1e308": 1e308,
    "nan": float("nan"), "''": "", "'x'": "x", "null": None, "true": True, "[]": [], "{}": {}, "[[1]]": [[1]],
    "[1, 'x']": [1, "x"], "'<|im_end|>'": "<|im_end|>", "template dividing by 0": "{{ 1/0 }}",
    "not Jinja": "{% for %}", "huge": "a" * 2**16, "missing shard": "model-00003-of-00003.safetensors",
    "first shard": SHARDS[0], "second shard": SHARDS[1], "'./' shard": "./" + SHARDS[0],
    "outside": "../model.safetensors", "config.json": "config.json",
}


def tokenizer_json() -> str:
    """Single characters (printable ASCII) after SPECIAL_TOKENS, within 160 ids; BOS before every text."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({chr(c): len(SPECIAL_TOKENS) + i for i, c in enumerate(range(ord(" "), ord("~") + 1))})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", 1)])
    tokenizer.decoder = decoders.Fuse()
    return tokenizer.to_str()


@pytest.fixture(scope="module")
def hf_folder(tiny_zoo, tmp_path_factory) -> Path:
    folder = Path(shutil.copytree(tiny_zoo.hf_folder("llama_gqa_tied"), tmp_path_factory.mktemp("fuzz") / "hf"))
    (folder / "tokenizer.json").write_text(tokenizer_json())
    added = {str(i): {"content": token, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                      "single_word": False} for i, token in enumerate(SPECIAL_TOKENS)}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>",
        "chat_template": CHATML, "added_tokens_decoder": added, "model_max_length": 64,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    (folder / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "<|im_end|>", "special": True}, "unk_token": "<unk>"}))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 4]}))
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {SHARDS[0]: names[:len(names) // 2], SHARDS[1]: names[len(names) // 2:]}
    for shard, shard_names in shards.items():
        save_file({name: weights[name] for name in shard_names}, folder / shard)
    (folder / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": sum(w.nbytes for w in weights.values())},
        "weight_map": {name: shard for shard, shard_names in shards.items() for name in shard_names}}))
    return folder


def json_mutations():
    """Lists of (action, where, value name): replace, delete or duplicate the node at `where`, a position in
    [0, 1] among every node of the document (or, in an @example, the node's path)."""
    action = st.sampled_from(["replace", "delete", "duplicate"])
    return st.lists(st.tuples(action, st.floats(0.0, 1.0), st.sampled_from(sorted(ODD_JSON))), min_size=1, max_size=3)


def json_edited(document, edits):
    for action, where, name in edits:
        paths = []

        def collect(node, path):
            items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
            for key, child in items:
                paths.append(path + (key,))
                collect(child, path + (key,))

        collect(document, ())
        if not paths:
            return document
        path = where if isinstance(where, tuple) else paths[int(where * (len(paths) - 1))]
        parent = document
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        if action == "replace":
            parent[key] = deepcopy(ODD_JSON[name])
        elif action == "delete":
            del parent[key]
        elif isinstance(parent, list):
            parent.insert(key, deepcopy(parent[key]))
        else:
            parent[f"{key}2"] = deepcopy(parent[key])
    return document


def damage(path: Path, edits) -> None:
    """Byte mutations (`mutations`), or JSON edits of the document (`json_mutations`), written over `path`."""
    if not edits:
        return
    if edits[0][0] in ("replace", "delete", "duplicate"):
        path.write_text(json.dumps(json_edited(json.loads(path.read_text()), edits)))
    else:
        path.write_bytes(mutated(path.read_bytes(), edits))


@FUZZ
@given(name=st.sampled_from(HF_FILES), edits=st.one_of(json_mutations(), mutations(4096)))
@example(name="tokenizer.json", edits=[])  # as written, the folder converts, runs and chats
# a template dividing by zero was a ZeroDivisionError at chat time
@example(name="tokenizer_config.json", edits=[("replace", ("chat_template",), "template dividing by 0")])
# converted, then encoded PROMPT beyond the vocabulary: a character's id, the post-processor's BOS
@example(name="tokenizer.json", edits=[("replace", ("model", "vocab", "H"), "160")])
@example(name="tokenizer.json", edits=[("replace", ("post_processor", "special_tokens", "<s>", "ids", 0), "160")])
def test_hugging_face_files(hf_folder, name, edits):
    with tempfile.TemporaryDirectory() as folder:
        copy, out = Path(shutil.copytree(hf_folder, Path(folder, "hf"))), Path(folder, "out")
        damage(copy / name, edits)
        try:
            convert(str(copy), str(out), QuantPlan(weights="int8", group_size=32), progress=False)
        except ZllmError:
            assert_nothing_written(out)
            return
        runs_or_is_refused(lambda: edge.load(out, device="reference"), text=True, converted=True)


# -------------------------------------------------------------- a converted checkpoint's tokenizer
# What edge.load reads for text: the checkpoint's tokenizer.json, and the manifest's tokenizer entry
# (special ids, flags, chat template), damaged after conversion: the converter's checks are behind them,
# so what the load does not refuse, encoding, decoding or the chat must.


@pytest.fixture(scope="module")
def chat_checkpoint(hf_folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fuzz") / "chat"
    convert(str(hf_folder), str(out), QuantPlan(weights="int8", group_size=32), progress=False)
    return out


@FUZZ
@given(tokenizer_edits=st.one_of(st.just([]), json_mutations(), mutations(4096)),
       entry_edits=st.one_of(st.just([]), json_mutations()))
@example(tokenizer_edits=[], entry_edits=[])  # as converted, it runs and chats
# without its unknown token, a character outside the vocabulary was a bare Exception of tokenizers at encode
@example(tokenizer_edits=[("delete", ("model", "vocab", "<unk>"), "''")], entry_edits=[])
def test_checkpoint_tokenizer(chat_checkpoint, tokenizer_edits, entry_edits):
    with tempfile.TemporaryDirectory() as folder:
        copy = _copy(chat_checkpoint, folder)
        damage(copy / "tokenizer.json", tokenizer_edits)
        manifest = json.loads((copy / "zllm.json").read_text())
        manifest["tokenizer"] = json_edited(manifest["tokenizer"], entry_edits)
        (copy / "zllm.json").write_text(json.dumps(sealed(manifest)))  # past the digest, to the entry's checks
        runs_or_is_refused(lambda: edge.load(copy, device="reference"), text=True)
