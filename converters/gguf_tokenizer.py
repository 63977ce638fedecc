"""A Hugging Face `tokenizers` tokenizer rebuilt from a GGUF file's metadata.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, merges, token types, special
token ids and chat template as metadata keys. This module reads those keys and assembles the
same tokenizer transformers builds when it loads a GGUF (`integrations/gguf/
gguf_tokenizer_mapping.py`), without importing transformers:

    info = tokenizer_from_gguf(gguf.GGUFReader(path))
    tokenizer = tokenizers.Tokenizer.from_str(info.tokenizer_json)
    tokenizer.encode(prompt).ids  # BOS included when the file asks for it

It departs from transformers' loader in three places, each to match the model's own tokenizer:
  - pre-tokenizer "smollm" isolates digits before the GPT-2 regex, as SmolLM2's tokenizer.json
    and llama.cpp do (transformers: the regex alone);
  - `tokenizer.ggml.add_space_prefix = false` is honoured, as llama.cpp does (transformers
    ignores it);
  - a sentencepiece vocabulary keeps its unknown token on the BPE model, as Llama-2's
    tokenizer.json does (transformers leaves it unset).

Two tokenizer models are supported, named by `tokenizer.ggml.model`:
  "gpt2"   byte-level BPE (SmolLM2, Qwen2/3, Llama-3): the file lists the merges.
  "llama"  sentencepiece-style BPE with byte fallback (Llama-2, Mistral): merges are
           recovered from the piece scores when the file does not list them; Gemma's from
           the pieces' order in the file (`_gemma_bpe`).
"""

import logging
import math
from dataclasses import dataclass, fields

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from converters.gguf_source import gguf_field
from edge.core.arguments import is_integer
from edge.core.errors import ConversionError, UnsupportedModelError
from edge.core.spec_dense import clipped

logger = logging.getLogger(__name__)

Keys = gguf.Keys.Tokenizer

SPIECE_UNDERLINE = "\u2581"  # "▁", sentencepiece's spelling of a space

# Token texts llama.cpp treats as end of generation whatever ids the metadata names
# (llama.cpp `src/llama-vocab.cpp`, the special_eog_ids loop).
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",  # Llama-3
        "<|eom_id|>",  # Llama-3.1 tool calls
        "<|im_end|>",  # ChatML: SmolLM2, Qwen
        "<|end|>",  # Phi-3
        "<|endoftext|>",  # GPT-2 family, SmolLM2, Qwen
        "<|end_of_text|>",  # Granite
        "<end_of_turn>",  # Gemma
        "<|return|>",  # gpt-oss harmony
        "<|call|>",  # gpt-oss harmony
        "<EOT>",  # CodeLlama infill
        "_<EOT>",
        "<end_of_utterance>",  # SmolDocling
    }
)
# "</s>" ends a sentencepiece model's turn, but a byte-level code vocabulary can hold it as
# plain HTML text, so it only counts when the file marks it as a control token.
_EOG_CONTROL_TEXTS = frozenset({"</s>"})
# Ids the metadata itself marks as ending generation; llama.cpp adds the FIM padding and
# separator tokens too, so that infill stops at them.
_EOG_ID_KEYS = (Keys.EOS_ID, Keys.EOT_ID, Keys.EOM_ID, Keys.FIM_PAD_ID, Keys.FIM_REP_ID, Keys.FIM_SEP_ID)
_DAMAGED = "the file is damaged: export the GGUF again, or convert the model's Hugging Face tokenizer.json"


def _described(value) -> str:
    """A metadata value for a message: an array by its length and item type (a vocabulary's repr is huge)."""
    if not isinstance(value, list):
        return clipped(repr(value))
    kinds = {bool: "booleans", int: "integers", float: "numbers", str: "strings", list: "arrays"}
    return f"an array of {len(value)} {kinds.get(type(value[0]), 'values') if value else 'values'}"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _checked_field(reader: gguf.GGUFReader, key: str, valid, expected: str, default=None):
    """Metadata `key`, or `default` when the file lacks it; refused unless `valid(value)`: a value of
    the wrong type would otherwise fail deep inside the tokenizers library, or change meaning (the
    string "false" is true)."""
    value = gguf_field(reader, key)
    if value is None:
        return default
    if not valid(value):
        raise ConversionError(f"The GGUF file's {key!r} is {_described(value)}; expected {expected}: {_DAMAGED}.")
    return value


def _array_of(valid):
    return lambda value: isinstance(value, list) and all(valid(item) for item in value)


def _is_string(value) -> bool:
    return isinstance(value, str)


def _is_flag(value) -> bool:
    return isinstance(value, bool)


@dataclass
class TokenizerInfo:
    tokenizer_json: str  # serialized tokenizers.Tokenizer (Tokenizer.to_str())
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool  # whether encoding a prompt prepends BOS; the post-processor already does
    eog_token_ids: list[int]  # generation stops at any of these
    chat_template: str | None
    add_eos_token: bool = False  # whether encoding appends EOS; the post-processor already does

    def to_config(self) -> dict:
        """Everything but the tokenizer itself, as plain JSON values."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "tokenizer_json"}


@dataclass
class _GGUFVocab:
    """The tokenizer keys of one GGUF file, under llama.cpp's meaning."""

    model: str
    pre: str | None
    architecture: str | None
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    add_space_prefix: bool
    special_ids: dict[str, int]  # metadata key (Keys.BOS_ID, ...) -> token id, for the keys present

    def special_token(self, key: str) -> int | None:
        return self.special_ids.get(key)

    @classmethod
    def read(cls, reader: gguf.GGUFReader) -> "_GGUFVocab":
        model = gguf_field(reader, Keys.MODEL)
        if model is None:
            raise ConversionError(
                f"The GGUF file has no {Keys.MODEL!r} key, so it describes no tokenizer; "
                "convert the tokenizer from the model's Hugging Face tokenizer.json instead."
            )
        if not isinstance(model, str) or model not in _TOKENIZER_BUILDERS:
            raise UnsupportedModelError(
                f"GGUF tokenizer model {_described(model)} is not supported; supported tokenizer models: "
                f"{', '.join(sorted(_TOKENIZER_BUILDERS))}. "
                "Convert the tokenizer from the model's Hugging Face tokenizer.json instead."
            )
        tokens = _checked_field(reader, Keys.LIST, _array_of(_is_string), "an array of strings (the vocabulary)")
        if not tokens:
            raise ConversionError(f"The GGUF file has tokenizer model {model!r} but no {Keys.LIST!r} vocabulary.")
        # Files without token types predate them; every token was then a normal one.
        token_types = _checked_field(reader, Keys.TOKEN_TYPE, _array_of(is_integer), "an array of integers",
                                     [gguf.TokenType.NORMAL] * len(tokens))
        scores = _checked_field(reader, Keys.SCORES, _array_of(_is_number), "an array of numbers (none NaN)")
        for key, values in ((Keys.TOKEN_TYPE, token_types), (Keys.SCORES, scores)):
            if values is not None and len(values) != len(tokens):
                raise ConversionError(
                    f"The GGUF file has {len(values)} entries in {key!r} for {len(tokens)} tokens; "
                    "they must be the same length."
                )

        special_ids = {}
        for key in (Keys.BOS_ID, Keys.UNK_ID, Keys.PAD_ID, *_EOG_ID_KEYS):  # EOS is among the EOG keys
            token_id = gguf_field(reader, key)
            if token_id is None:
                continue
            if not is_integer(token_id):
                raise ConversionError(
                    f"The GGUF file's {key!r} is {_described(token_id)}; expected a token id (an integer in "
                    f"[0, {len(tokens)})).")
            if not 0 <= token_id < len(tokens):
                raise ConversionError(
                    f"The GGUF file names token {token_id} in {key!r}, but its vocabulary has {len(tokens)} tokens."
                )
            special_ids[key] = int(token_id)

        return cls(
            model=model,
            pre=_checked_field(reader, Keys.PRE, _is_string, "the name of a pre-tokenizer (a string)"),
            architecture=gguf_field(reader, gguf.Keys.General.ARCHITECTURE),
            tokens=tokens,
            token_types=[int(t) for t in token_types],
            scores=scores,
            merges=_checked_field(reader, Keys.MERGES, _array_of(_is_string), "an array of strings (the merges)"),
            # llama.cpp prepends a space to sentencepiece input unless the file says not to.
            add_space_prefix=_checked_field(reader, Keys.ADD_PREFIX, _is_flag, "true or false", True),
            special_ids=special_ids,
        )


def tokenizer_from_gguf(reader: gguf.GGUFReader) -> TokenizerInfo:
    """The tokenizer a GGUF file describes, with its special tokens and chat template."""
    vocab = _GGUFVocab.read(reader)
    tokenizer = _TOKENIZER_BUILDERS[vocab.model](vocab)
    _add_special_tokens(tokenizer, vocab)

    # transformers' rule (`get_gguf_tokenizer`): the file's flag when it has one; otherwise a
    # sentencepiece vocabulary gets BOS, as llama.cpp gives it, and a byte-level one does not.
    add_bos = _checked_field(reader, Keys.ADD_BOS, _is_flag, "true or false", vocab.model == "llama")
    add_eos = _checked_field(reader, Keys.ADD_EOS, _is_flag, "true or false", False)
    bos_id = vocab.special_token(Keys.BOS_ID)
    eos_id = vocab.special_token(Keys.EOS_ID)
    if add_bos and bos_id is None:
        logger.warning("The GGUF file asks for a BOS token but names none; prompts are encoded without one.")
        add_bos = False
    if add_eos and eos_id is None:
        logger.warning("The GGUF file asks for an EOS token but names none; prompts are encoded without one.")
        add_eos = False
    tokenizer.post_processor = _post_processor(vocab, bos_id if add_bos else None, eos_id if add_eos else None)

    return TokenizerInfo(
        tokenizer_json=tokenizer.to_str(),
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        add_bos_token=add_bos,
        eog_token_ids=_eog_token_ids(vocab),
        chat_template=_checked_field(reader, Keys.CHAT_TEMPLATE, _is_string, "a Jinja template string"),
        add_eos_token=add_eos,
    )


# ---------------------------------------------------------------------------- byte-level BPE


# Split regexes of the pre-tokenizers llama.cpp names in `tokenizer.ggml.pre`
# (the same strings as transformers' GGUF_PRE_TOKENIZER_SPLITS).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_regex_then_bytes() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # SmolLM2's own tokenizer.json, and llama.cpp's "smollm" pre-tokenizer: every digit on its
    # own, then the GPT-2 regex. transformers' GGUF loader uses the GPT-2 regex alone, which
    # differs only where a run of spaces precedes a digit ("a  2").
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_regex_then_bytes()])


_PRE_TOKENIZERS = {
    "gpt-2": _gpt2_regex_then_bytes,
    "smollm": _digits_then_gpt2,
    "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama-v3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "smaug-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
    "deepseek-r1-qwen": lambda: _split_then_bytes(_QWEN2_SPLIT),
    "gpt-4o": lambda: _split_then_bytes(_GPT4O_SPLIT),
    "llama4": lambda: _split_then_bytes(_GPT4O_SPLIT),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: printable Latin-1 bytes stand for themselves,
    the rest map to code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _byte_level_bpe(vocab: _GGUFVocab) -> Tokenizer:
    if vocab.merges is None:
        raise ConversionError(
            f"The GGUF file has a byte-level ('gpt2') tokenizer but no {Keys.MERGES!r}; "
            "its merges cannot be recovered from the vocabulary."
        )
    # Tokens the file stores as raw text (added tokens with spaces, say) are respelled in the
    # byte alphabet, the only spelling the BPE model can produce.
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    token_to_id = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(vocab.tokens)
    }
    tokenizer = Tokenizer(
        models.BPE(
            vocab=token_to_id,
            merges=_parse_merges(vocab.merges, token_to_id),
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    if vocab.pre in _PRE_TOKENIZERS:
        tokenizer.pre_tokenizer = _PRE_TOKENIZERS[vocab.pre]()
    else:
        logger.warning(
            "GGUF pre-tokenizer %r is not known here; splitting text with the GPT-2 regex, "
            "so some texts may not tokenize as the model was trained. Known: %s.",
            vocab.pre,
            ", ".join(sorted(_PRE_TOKENIZERS)),
        )
        tokenizer.pre_tokenizer = _gpt2_regex_then_bytes()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _parse_merges(merges: list[str], token_to_id: dict[str, int]) -> list[tuple[str, str]]:
    """(left, right) pairs; both pieces and the token they make must be in the vocabulary, which the
    BPE model needs (tokenizers refuses such a merge with a bare Exception)."""
    pairs = []
    for index, merge in enumerate(merges):
        parts = merge.split(" ") if isinstance(merge, str) else []
        if len(parts) != 2:
            raise ConversionError(
                f"GGUF merge {index} is {merge!r}; a merge must be two tokens separated by one space."
            )
        outside = next((piece for piece in (*parts, "".join(parts)) if piece not in token_to_id), None)
        if outside is not None:
            raise ConversionError(
                f"GGUF merge {index} is {merge!r}, but {outside!r} is not a token of the vocabulary; the merges and "
                "the tokens disagree: export the GGUF again, or convert the model's Hugging Face tokenizer.json."
            )
        pairs.append((parts[0], parts[1]))
    return pairs


# ---------------------------------------------------------------------- sentencepiece BPE


def _sentencepiece_bpe(vocab: _GGUFVocab) -> Tokenizer:
    """transformers' `LlamaTokenizer` (legacy=False), as its GGUF loader builds it."""
    if vocab.architecture in _GEMMA_ARCHITECTURES:
        return _gemma_bpe(vocab)
    token_to_id = {token: index for index, token in enumerate(vocab.tokens)}
    if vocab.merges is not None:
        merges = _parse_merges(vocab.merges, token_to_id)
    elif vocab.scores is not None:
        merges = _merges_from_scores(token_to_id, dict(zip(vocab.tokens, vocab.scores)))
    else:
        raise ConversionError(
            f"The GGUF file has a sentencepiece ('llama') tokenizer with neither {Keys.MERGES!r} "
            f"nor {Keys.SCORES!r}; the merges cannot be recovered."
        )
    unk_id = vocab.special_token(Keys.UNK_ID)
    # transformers leaves the unknown token unset, so a character with no byte pieces vanishes;
    # sentencepiece and Llama-2's tokenizer.json give the unknown id instead.
    tokenizer = _byte_fallback_bpe(token_to_id, merges, vocab.tokens[unk_id] if unk_id is not None else None)
    # transformers ignores `add_space_prefix` and always prepends; llama.cpp honours it.
    prepend = vocab.add_space_prefix
    steps = _spaces_and_bytes_decoded()
    if prepend:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)

    if vocab.architecture == "phi3":
        # Phi-3 spells the prefix space with a normalizer, so text that starts with a space
        # keeps it: " hi" becomes "▁▁hi", where Metaspace gives "▁hi" (transformers' phi3_tokenizer).
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend(prepend=SPIECE_UNDERLINE), normalizers.Replace(pattern=" ", content=SPIECE_UNDERLINE)]
            if prepend
            else [normalizers.Replace(pattern=" ", content=SPIECE_UNDERLINE)]
        )
    else:
        # "first": only the start of the text gets the prefix space, not text after a special token.
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPIECE_UNDERLINE, prepend_scheme="first" if prepend else "never", split=False
        )
    return tokenizer


# Sentencepiece vocabularies whose merges follow the file's order, not the scores (`_gemma_bpe`).
_GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})


def _gemma_bpe(vocab: _GGUFVocab) -> Tokenizer:
    """transformers' `GemmaTokenizer`, as its GGUF loader builds it (`gemma_tokenizer`). Two things
    differ from other sentencepiece files:
      - a token of spaces is stored as real spaces ("  "), where the tokenizer looks it up as "▁▁"
        (its normalizer spells every space "▁"): such tokens are respelled before anything else;
      - the merges, when the file lists none, are ranked by the tokens' order in the file, which is
        the order sentencepiece learned them in; Gemma's scores do not follow it.
    There is no prefix space (Gemma files say add_space_prefix = false, and its tokenizer adds none)."""
    tokens = [SPIECE_UNDERLINE * len(token) if " " in token and not token.strip() else token for token in vocab.tokens]
    token_to_id = {token: index for index, token in enumerate(tokens)}
    if vocab.merges is not None:
        merges = _parse_merges(vocab.merges, token_to_id)
    else:
        merges = _merges_from_scores(token_to_id, {token: -index for index, token in enumerate(tokens)})
    unk_id = vocab.special_token(Keys.UNK_ID)
    tokenizer = _byte_fallback_bpe(token_to_id, merges,
                                   tokens[unk_id] if unk_id is not None else "<unk>")  # (GemmaTokenizer's default)
    tokenizer.normalizer = normalizers.Replace(" ", SPIECE_UNDERLINE)
    # what GemmaTokenizer sets; after the normalizer no space is left to split on
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tokenizer.decoder = decoders.Sequence(_spaces_and_bytes_decoded())
    return tokenizer


def _byte_fallback_bpe(token_to_id: dict[str, int], merges: list[tuple[str, str]], unk_token: str | None) -> Tokenizer:
    """A BPE over sentencepiece pieces whose characters without a piece fall back to byte pieces."""
    return Tokenizer(models.BPE(vocab=token_to_id, merges=merges, dropout=None, unk_token=unk_token, fuse_unk=True,
                                byte_fallback=True))


def _spaces_and_bytes_decoded() -> list:
    """Decoder steps of a sentencepiece vocabulary: "▁" back to a space, byte pieces back to text."""
    return [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]


def _merges_from_scores(token_to_id: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary is a merge, ranked by the score
    of the piece it makes, best first; ties go to the longer left piece, then the longer right
    one. A sentencepiece BPE model applies its merges in exactly that order.

    This is transformers' `generate_merges(vocab, vocab_scores)`, kept step for step so that ties
    break the same way.
    """
    # Both halves of a split are tokens, so a cut falls only where both halves have some token's length:
    # trying every cut would copy a long piece once per character (a megabyte-long token: hours).
    lengths = {len(token) for token in token_to_id}
    cuts = sorted(lengths - {0})
    candidates = []
    for piece, score in scores.items():
        splits = [
            (piece[:cut], piece[cut:], score)
            for cut in cuts
            if cut < len(piece) and len(piece) - cut in lengths
            and piece[:cut] in token_to_id and piece[cut:] in token_to_id
        ]
        splits.sort(key=lambda s: (token_to_id[s[0]], token_to_id[s[1]]))
        candidates.extend(splits)
    candidates.sort(key=lambda s: (s[2], len(s[0]), len(s[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


_TOKENIZER_BUILDERS = {
    "gpt2": _byte_level_bpe,
    "llama": _sentencepiece_bpe,
}


# ------------------------------------------------------------------------ special tokens


def _add_special_tokens(tokenizer: Tokenizer, vocab: _GGUFVocab) -> None:
    """Keep control and user-defined tokens whole instead of letting BPE cut them up.

    Control tokens (`<|im_end|>`) become special tokens, which decoding skips; user-defined ones
    (`<think>`) become plain added tokens. The named bos/eos/unk/pad tokens are special too, as
    transformers makes them.

    A token must already be in the model's vocabulary under its own spelling: adding it otherwise
    would give it a new id past the embedding table. In a byte-level vocabulary that excludes
    a control token outside the byte alphabet, which is a llama.cpp mislabel.
    """
    added: set[str] = set()
    special = []
    plain = []
    for token, token_type in zip(vocab.tokens, vocab.token_types):
        if token_type not in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED):
            continue
        if tokenizer.token_to_id(token) is None:
            logger.debug("Skipping GGUF added token %r: it is not in the vocabulary under that spelling.", token)
            continue
        target = special if token_type == gguf.TokenType.CONTROL else plain
        target.append(AddedToken(token, normalized=False, special=token_type == gguf.TokenType.CONTROL))
        added.add(token)
    for key in (Keys.BOS_ID, Keys.EOS_ID, Keys.UNK_ID, Keys.PAD_ID):
        token_id = vocab.special_token(key)
        if token_id is None:
            continue
        token = vocab.tokens[token_id]
        if token not in added and tokenizer.token_to_id(token) is not None:
            special.append(AddedToken(token, normalized=False, special=True))
            added.add(token)
    if special:
        tokenizer.add_special_tokens(special)
    if plain:
        tokenizer.add_tokens(plain)


def _post_processor(vocab: _GGUFVocab, bos_id: int | None, eos_id: int | None) -> processors.PostProcessor:
    """BOS and EOS around every encoded text, as the file asks; the template transformers'
    `update_post_processor` writes, so `Tokenizer.encode(text).ids` alone is the prompt."""
    bos = vocab.tokens[bos_id] if bos_id is not None else None
    eos = vocab.tokens[eos_id] if eos_id is not None else None

    def template(sequence: str, type_id: int) -> list[str]:
        pieces = [f"${sequence}:{type_id}"]
        if bos is not None:
            pieces.insert(0, f"{bos}:{type_id}")
        if eos is not None:
            pieces.append(f"{eos}:{type_id}")
        return pieces

    special_tokens = [(token, token_id) for token, token_id in ((bos, bos_id), (eos, eos_id)) if token is not None]
    single = template("A", 0)
    pair = single + template("B", 1)
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special_tokens)


def _eog_token_ids(vocab: _GGUFVocab) -> list[int]:
    eog = {vocab.special_token(key) for key in _EOG_ID_KEYS} - {None}
    for index, (token, token_type) in enumerate(zip(vocab.tokens, vocab.token_types)):
        if token in _EOG_TEXTS or (token in _EOG_CONTROL_TEXTS and token_type == gguf.TokenType.CONTROL):
            eog.add(index)
    return sorted(eog)
