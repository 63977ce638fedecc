"""Hugging Face model folders: config.json, one or more *.safetensors (with an index when sharded),
and the tokenizer files."""
from __future__ import annotations

import logging
import os
import re

import numpy as np

from converters.source import SourceTensor, SourceTokenizer
from edge.core.arguments import is_integer
from edge.core.errors import ConversionError, InvalidArgumentError, UnsupportedModelError
from edge.core.json_text import parse_json
from edge.core.sampling_defaults import sampling_of_generation_config
from edge.core.spec_dense import clipped
from quant.safetensors_io import SafetensorsFile

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# Stored dtypes that hold weights; integer tensors are quantized (GPTQ, AWQ, bitsandbytes) or buffers.
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
# Buffers some checkpoints carry that are recomputed from the config.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Checkpoint names that differ from ours: (pattern, replacement), applied in order.
NAME_ALIASES: tuple[tuple[re.Pattern, str], ...] = (
    # Mixtral (mistralai/Mixtral-8x7B-v0.1): experts' w1 / w3 / w2 are gate / up / down, the router is "gate"
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w1\."), r".mlp.experts.\1.gate_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w3\."), r".mlp.experts.\1.up_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w2\."), r".mlp.experts.\1.down_proj."),
    (re.compile(r"\.block_sparse_moe\.gate\."), r".mlp.gate."),
)


# transformers >= 5 holds a layer's routed experts stacked, and writes them so when saving with
# save_original_format=False: gate_up_proj [E, 2I, D] (gate rows, then up rows, as its forward's
# chunk(2) reads them) and down_proj [E, D, I]. Each expert becomes one of our per-expert tensors.
STACKED_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def stacked_expert_parts(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple]]:
    """(our per-expert name, index into the stacked array) for each expert in a stacked tensor; [] otherwise."""
    match = STACKED_EXPERTS.match(name)
    if match is None or len(shape) != 3:
        return []
    prefix, n_experts = match["prefix"], shape[0]
    if match["kind"] == "down_proj":
        return [(f"{prefix}.{e}.down_proj.weight", (e,)) for e in range(n_experts)]
    rows = shape[1] // 2
    return [part for e in range(n_experts)
            for part in ((f"{prefix}.{e}.gate_proj.weight", (e, slice(0, rows))),
                         (f"{prefix}.{e}.up_proj.weight", (e, slice(rows, 2 * rows))))]


def sanitize_name(name: str) -> str:
    """Our (transformers module) name for a checkpoint tensor name."""
    for pattern, replacement in NAME_ALIASES:
        name = pattern.sub(replacement, name)
    return name


def _read_text(path: str, what: str) -> str:
    """The UTF-8 text in `path`; `what` names the file in errors."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as exc:
        raise ConversionError(f"{what} {path} is not UTF-8 text ({exc}); restore the file") from None
    except OSError as exc:  # unreadable: permissions, an I/O error
        raise ConversionError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None


def _read_json(path: str, what: str) -> dict:
    """The JSON object in `path`; `what` names the file in errors."""
    try:
        value = parse_json(_read_text(path, what))
    except ValueError as exc:
        raise ConversionError(f"{what} {path} is not valid JSON ({exc}); restore the file") from None
    if not isinstance(value, dict):
        raise ConversionError(f"{what} {path} holds a JSON {type(value).__name__}, not an object; restore the file")
    return value


def _check_tokenizer(text: str, path: str) -> None:
    """Refuse a tokenizer.json that the `tokenizers` library, which loads it at run time, cannot load."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises a plain Exception for bad JSON and for a wrong schema alike
        raise ConversionError(f"tokenizer {path} cannot be loaded by the tokenizers library ({exc}); "
                              "restore the file from the model's repository") from None


def _chat_template(value, path: str) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named templates."""
    if isinstance(value, list):  # transformers applies the one named "default" unless told otherwise
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
        if value is None:
            raise ConversionError(
                f"{path}: chat_template lists no template named 'default'; name the one to use 'default'")
    if value is not None and not isinstance(value, str):
        raise ConversionError(f"{path}: chat_template is {clipped(repr(value))}; expected a Jinja template string")
    return value


def _token_ids(value, key: str, path: str) -> list[int]:
    """A config's token id entry (an id, a list of ids, or null) as a list of ids."""
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(is_integer(v, minimum=0) for v in values):
        raise ConversionError(f"{path}: {key} is {clipped(repr(value))}; expected a token id or a list of token ids")
    return values


class HFSource:
    def __init__(self, folder: str):
        self.folder = folder
        config_path = os.path.join(folder, "config.json")
        if not os.path.isfile(config_path):
            raise ConversionError(
                f"{folder} has no config.json; a Hugging Face model folder needs config.json and "
                "*.safetensors weights (or pass a .gguf file)"
            )
        self.config = _read_json(config_path, "config")
        model_type = self.config.get("model_type")
        if model_type is not None and not isinstance(model_type, str):  # the model family is looked up by it
            raise ConversionError(f"config {config_path}: model_type is {clipped(repr(model_type))}; "
                                  "expected a string such as 'llama'")
        self.description = f"huggingface:{os.path.basename(os.path.abspath(folder))}"
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, SafetensorsFile] = {}
        self._stored_name: dict[str, str] = {}  # our name -> the name in the safetensors file
        self._part: dict[str, tuple] = {}  # our name -> its index into a stacked tensor
        try:
            for filename in self._weight_files():
                st = SafetensorsFile(os.path.join(folder, filename))
                self._files[filename] = st
                for stored_name in st.keys():
                    if stored_name.endswith(IGNORED_SUFFIXES):
                        continue
                    dtype = st.entries[stored_name].dtype
                    if dtype not in FLOAT_DTYPES:
                        raise UnsupportedModelError(
                            f"{st.path}: tensor {stored_name!r} is stored as {dtype}; only floating-point weights "
                            f"({', '.join(FLOAT_DTYPES)}) convert; use the model's unquantized checkpoint")
                    parts = (stacked_expert_parts(stored_name, st.entries[stored_name].shape)
                             or [(sanitize_name(stored_name), None)])
                    for name, part in parts:
                        if name in self._stored_name and self._stored_name[name] == stored_name:
                            first = os.path.relpath(self._where[name].path, folder)
                            raise ConversionError(
                                f"{folder}: tensor {stored_name!r} is in both {first} and {filename}; a tensor "
                                f"belongs to one shard: download the model again (every shard and the index "
                                f"from one revision)")
                        if name in self._stored_name:
                            raise ConversionError(
                                f"{folder} holds both {self._stored_name[name]!r} and {stored_name!r}, which name "
                                f"the same tensor {name!r}; keep one of them")
                        self._where[name] = st
                        self._stored_name[name] = stored_name
                        if part is not None:
                            self._part[name] = part
            self._check_index()
            self.tokenizer = self._read_tokenizer()
        except BaseException:
            self.close()
            raise

    def _check_index(self) -> None:
        """Every tensor the index maps to a shard is in that shard: an index that disagrees with its
        shards means a shard from another revision (or a hand-edited index), whose weights may not be
        the model's."""
        for stored_name, filename in self._weight_map.items():
            if stored_name not in self._files[filename].entries:
                raise ConversionError(
                    f"{os.path.join(self.folder, INDEX_FILE)} maps tensor {clipped(repr(stored_name))} to shard "
                    f"{filename}, but that shard does not hold it; the index and the shards disagree: download the "
                    f"model again (every shard and the index from one revision)")

    def _weight_files(self) -> list[str]:
        self._weight_map: dict[str, str] = {}  # the index's tensor name -> shard file, when sharded
        index_path = os.path.join(self.folder, INDEX_FILE)
        if os.path.isfile(index_path):
            weight_map = _read_json(index_path, "safetensors index").get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ConversionError(f"{index_path}: weight_map is not an object mapping tensor names to shard "
                                      "file names; restore the file")
            if not weight_map:
                raise ConversionError(f"{index_path} maps no tensors; its weight_map is empty")
            # one spelling per shard ("./a" is "a"), so that no shard is opened twice
            weight_map = {name: os.path.normpath(f) if f else f for name, f in weight_map.items()}
            outside = next(((name, f) for name, f in weight_map.items()
                            if os.path.isabs(f) or f.split(os.sep)[0] == os.pardir), None)
            if outside is not None:
                raise ConversionError(f"{index_path} maps tensor {clipped(repr(outside[0]))} to "
                                      f"{clipped(repr(outside[1]))}, which lies outside {self.folder}; shards are "
                                      "files of the model's folder: restore the index")
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not os.path.isfile(os.path.join(self.folder, f))]
            if missing:
                raise ConversionError(f"{INDEX_FILE} names shards that are missing from {self.folder}: "
                                      f"{clipped(repr(missing))}")
            self._weight_map = weight_map
        else:
            files = sorted(f for f in os.listdir(self.folder) if f.endswith(".safetensors"))
        if not files:
            raise ConversionError(
                f"{self.folder} has no *.safetensors weights; convert .bin checkpoints to safetensors first"
            )
        return files

    def _read_tokenizer(self) -> SourceTokenizer:
        tokenizer_path = os.path.join(self.folder, "tokenizer.json")
        tokenizer_json = None
        if os.path.isfile(tokenizer_path):
            tokenizer_json = _read_text(tokenizer_path, "tokenizer")
            _check_tokenizer(tokenizer_json, tokenizer_path)
        else:
            log.warning("%s has no tokenizer.json; the checkpoint will take token ids only", self.folder)
        tok_config_path = os.path.join(self.folder, "tokenizer_config.json")
        tok_config = _read_json(tok_config_path, "tokenizer config") if os.path.isfile(tok_config_path) else {}
        chat_template = _chat_template(tok_config.get("chat_template"), tok_config_path)
        template_path = os.path.join(self.folder, "chat_template.jinja")
        if chat_template is None and os.path.isfile(template_path):
            chat_template = _read_text(template_path, "chat template")
        gen_config_path = os.path.join(self.folder, "generation_config.json")
        gen_config = _read_json(gen_config_path, "generation config") if os.path.isfile(gen_config_path) else {}
        config_path = os.path.join(self.folder, "config.json")
        # generation_config.json's ids, checked against the vocabulary once the spec has it (config.json's
        # are the spec's own fields); its pad_token_id is unused, but refused like the others when damaged
        special_ids = {key: (gen_config_path, _token_ids(gen_config.get(key), key, gen_config_path))
                       for key in ("bos_token_id", "eos_token_id", "pad_token_id")}

        def ids(key: str) -> list[int]:  # generation_config.json overrides config.json
            return special_ids[key][1] or _token_ids(self.config.get(key), key, config_path)

        eos_ids, bos_ids = ids("eos_token_id"), ids("bos_token_id")
        config = {
            "bos_token_id": bos_ids[0] if bos_ids else None,
            "eos_token_id": eos_ids[0] if eos_ids else None,
            "eog_token_ids": sorted(set(eos_ids)),
            # tokenizer.json's post-processor already adds BOS where the model wants it
            "add_bos_token": False,
            "chat_template": chat_template,
        }
        try:  # the sampling the model's authors ask a conversation to use, if they say
            sampling = sampling_of_generation_config(gen_config)
        except InvalidArgumentError as exc:
            raise ConversionError(f"{gen_config_path}: {exc}; restore the file") from None
        if sampling is not None:
            config["sampling"] = sampling
        return SourceTokenizer(tokenizer_json, config, special_ids)

    def tensors(self) -> list[SourceTensor]:
        out = []
        for name, st in self._where.items():
            entry = st.entries[self._stored_name[name]]
            shape, nbytes = entry.shape, entry.end - entry.begin
            if name in self._part:  # one expert's slice of a stacked tensor
                shape = np.broadcast_to(np.empty((), np.uint8), entry.shape)[self._part[name]].shape
                nbytes = nbytes * int(np.prod(shape)) // int(np.prod(entry.shape))
            out.append(SourceTensor(name, tuple(shape), entry.dtype, nbytes))
        return out

    def load(self, name: str) -> np.ndarray:
        return self._where[name].float32(self._stored_name[name], self._part.get(name))

    def release(self, name: str) -> None:
        self._where[name].release(self._stored_name[name])

    def close(self) -> None:
        for st in self._files.values():
            st.close()
