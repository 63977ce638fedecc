"""Hugging Face model folders: config.json, one or more *.safetensors (with an index when sharded),
and the tokenizer files."""
from __future__ import annotations

import json
import logging
import os
import re

import numpy as np

from converters.safetensors_io import SafetensorsFile
from converters.source import SourceTensor, SourceTokenizer
from edge.errors import ConversionError

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
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


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ConversionError(f"{what} {path} is not valid JSON: {exc}") from None


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
                    parts = (stacked_expert_parts(stored_name, st.entries[stored_name].shape)
                             or [(sanitize_name(stored_name), None)])
                    for name, part in parts:
                        if name in self._stored_name:
                            raise ConversionError(
                                f"{folder} holds both {self._stored_name[name]!r} and {stored_name!r}, which name "
                                f"the same tensor {name!r}; keep one of them")
                        self._where[name] = st
                        self._stored_name[name] = stored_name
                        if part is not None:
                            self._part[name] = part
            self.tokenizer = self._read_tokenizer()
        except BaseException:
            self.close()
            raise

    def _weight_files(self) -> list[str]:
        index_path = os.path.join(self.folder, INDEX_FILE)
        if os.path.isfile(index_path):
            weight_map = _read_json(index_path, "safetensors index").get("weight_map", {})
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not os.path.isfile(os.path.join(self.folder, f))]
            if missing:
                raise ConversionError(f"{INDEX_FILE} names shards that are missing from {self.folder}: {missing}")
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
            with open(tokenizer_path, encoding="utf-8") as f:
                tokenizer_json = f.read()
        else:
            log.warning("%s has no tokenizer.json; the checkpoint will take token ids only", self.folder)
        tok_config_path = os.path.join(self.folder, "tokenizer_config.json")
        tok_config = _read_json(tok_config_path, "tokenizer config") if os.path.isfile(tok_config_path) else {}
        chat_template = tok_config.get("chat_template")
        template_path = os.path.join(self.folder, "chat_template.jinja")
        if chat_template is None and os.path.isfile(template_path):
            with open(template_path, encoding="utf-8") as f:
                chat_template = f.read()
        gen_config_path = os.path.join(self.folder, "generation_config.json")
        gen_config = _read_json(gen_config_path, "generation config") if os.path.isfile(gen_config_path) else {}

        def ids(value) -> list[int]:
            if value is None:
                return []
            return [int(v) for v in (value if isinstance(value, list) else [value])]

        eos_ids = ids(gen_config.get("eos_token_id")) or ids(self.config.get("eos_token_id"))
        bos_ids = ids(gen_config.get("bos_token_id")) or ids(self.config.get("bos_token_id"))
        config = {
            "bos_token_id": bos_ids[0] if bos_ids else None,
            "eos_token_id": eos_ids[0] if eos_ids else None,
            "eog_token_ids": sorted(set(eos_ids)),
            # tokenizer.json's post-processor already adds BOS where the model wants it
            "add_bos_token": False,
            "chat_template": chat_template,
        }
        return SourceTokenizer(tokenizer_json, config)

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
