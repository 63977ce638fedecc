"""GGUF files: metadata → config.json-style dict, tensors renamed to Hugging Face names.

Tensors of the block types quant/gguf_import.py keeps (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, IQ4_NL, Q4_K,
Q5_K, IQ4_XS) come back as QuantizedTensor without requantization; other types come back as float32
for the converter to requantize. MoE files (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE) hand out each routed expert as its own tensor (converters/gguf_moe.py).
"""
from __future__ import annotations

import logging
import os
import re
from typing import Callable

import numpy as np

from converters.gguf_check import check_gguf
from converters.gguf_moe import (
    MOE_ARCHITECTURES,
    MOE_LAYER_TENSORS,
    ExpertSlice,
    expert_slices,
    moe_config_fields,
    moe_model_type,
)
from converters.source import SourceTensor, SourceTokenizer
from edge.core.arguments import is_integer
from edge.core.errors import ConversionError, UnsupportedModelError
from quant import QuantizedTensor
from quant.gguf_import import from_gguf
from quant.safetensors_io import release_pages

log = logging.getLogger(__name__)

# GGUF architecture -> our model_type. Mistral GGUFs are written with architecture "llama".
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text", **MOE_ARCHITECTURES}

# llama.cpp tensor names -> Hugging Face names (llama.cpp gguf-py tensor_mapping.py, reversed).
# Llama (incl. SmolLM2, Mistral), Qwen2 and Qwen3 share one naming scheme.
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",  # Qwen3
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    **MOE_LAYER_TENSORS,
}
# Gemma 3 normalises each block's output too: its ffn_norm is the feed-forward's input norm, which
# transformers calls pre_feedforward_layernorm, and post_attention_layernorm is the attention's output norm.
ARCH_LAYER_TENSORS = {
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
# llama.cpp stores Gemma's RMSNorm gains as 1 + w (its norm multiplies by the weight alone); transformers'
# weight is w.
NORM_SHIFT = {"gemma3": 1.0}
# What llama.cpp assumes of a Gemma 3 GGUF, whose metadata does not say: every 6th layer attends
# globally, and the sliding layers' rotary base is transformers' default.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62  # llama.cpp scales the 27B's queries by (hidden / heads) ** -0.5, the others by head_dim's
LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
ROPE_FREQS = "rope_freqs.weight"  # llama3-style rope scaling, stored as per-frequency divisors


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    match = LAYER_NAME.match(name)
    layer_tensors = {**LAYER_TENSORS, **ARCH_LAYER_TENSORS.get(arch, {})}
    if match and match.group(2) in layer_tensors:
        layer, kind, suffix = match.groups()
        return f"model.layers.{layer}.{layer_tensors[kind]}.{suffix}"
    return None


def _open_reader(path: str):
    from gguf import GGUFReader

    check_gguf(path)  # GGUFReader trusts the counts it reads: a lying one makes it loop and allocate
    try:
        return GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, OverflowError, EOFError) as exc:
        # what check_gguf leaves to GGUFReader: duplicate keys or tensor names, names that are not UTF-8
        detail = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc  # KeyError's str() adds quotes
        raise ConversionError(f"{os.path.basename(path)}: gguf.GGUFReader cannot read it ({detail}); "
                              "the file is truncated or damaged, download or export it again") from exc


def gguf_field(reader, key: str, default=None):
    """The value of metadata `key` (Python scalars, str, lists), or `default` when the file lacks it."""
    field = reader.get_field(key)
    if field is None:
        return default
    try:
        return field.contents()
    except UnicodeDecodeError as error:
        raise ConversionError(f"GGUF key {key!r} holds text that is not valid UTF-8 ({error}).") from error


class GGUFSource:
    def __init__(self, path: str):
        self.path = path
        self.reader = _open_reader(path)
        try:
            self._read_model()
        except BaseException:
            self.close()
            raise

    def _read_model(self) -> None:
        path = self.path
        arch = gguf_field(self.reader, "general.architecture")
        if not isinstance(arch, str) or arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {arch!r} is not supported; supported architectures: "
                f"{', '.join(sorted(ARCHITECTURES))}"
            )
        self.arch = arch
        self.description = f"gguf:{os.path.basename(path)}"
        self._tensors = {}
        expert_count = self._count("expert_count", 0, minimum=0)
        self.model_type = moe_model_type(arch, expert_count)  # None for a dense model
        self._experts: dict[str, ExpertSlice] = {}  # our per-expert name -> its slice of a GGUF tensor
        if self.model_type is not None:
            self._experts = expert_slices({t.name: t for t in self.reader.tensors}, os.path.basename(path), arch,
                                          expert_count)
        expert_sources = {part.tensor.name for part in self._experts.values()}  # GGUF names
        for tensor in self.reader.tensors:
            hf_name = gguf_to_hf_name(tensor.name, arch)
            if hf_name is not None:
                self._tensors[hf_name] = tensor
            elif tensor.name not in expert_sources and tensor.name != ROPE_FREQS:
                raise UnsupportedModelError(
                    f"GGUF tensor {tensor.name!r} has no counterpart in the {arch} model; "
                    "this GGUF variant is not supported"
                )
        self.config = self._config()
        from converters.gguf_tokenizer import tokenizer_from_gguf

        info = tokenizer_from_gguf(self.reader)
        self.tokenizer = SourceTokenizer(info.tokenizer_json, info.to_config())
        self.config.setdefault("bos_token_id", info.bos_token_id)
        self.config.setdefault("eos_token_id", info.eos_token_id)

    def _meta(self, key: str, default=None):
        return gguf_field(self.reader, f"{self.arch}.{key}", default)

    def _checked(self, key: str, default, valid: Callable[[object], bool], expected: str):
        """Metadata `{arch}.key`, required unless a default is given, refused unless `valid`."""
        value, where = self._meta(key, default), f"{os.path.basename(self.path)}: GGUF key '{self.arch}.{key}'"
        if value is None:
            raise ConversionError(f"{where} is missing; the file does not describe the model, "
                                  "export it again with llama.cpp's convert_hf_to_gguf.py")
        if isinstance(value, bool) or not valid(value):  # a bool is an int to Python, not a count
            raise ConversionError(f"{where} is {value!r}; expected {expected}")
        return value

    def _count(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        return self._checked(key, default, lambda v: is_integer(v, minimum), f"an integer >= {minimum}")

    def _number(self, key: str, default: float | None = None) -> float:
        return float(self._checked(key, default, lambda v: isinstance(v, (int, float)), "a number"))

    def _config(self) -> dict:
        meta, count, number = self._meta, self._count, self._number
        n_heads = count("attention.head_count")
        hidden = count("embedding_length")
        embed = self._tensors.get("model.embed_tokens.weight")
        vocab = meta("vocab_size")
        if vocab is None:  # older files: the tokenizer's length, else the embedding's rows
            tokens = self.reader.get_field("tokenizer.ggml.tokens")
            vocab = len(tokens.data) if tokens is not None else int(embed.shape[-1]) if embed is not None else None
        config = {
            "model_type": self.model_type or ARCHITECTURES[self.arch],
            "vocab_size": count("vocab_size", vocab),
            "hidden_size": hidden,
            "intermediate_size": count("feed_forward_length"),
            "num_hidden_layers": count("block_count"),
            "num_attention_heads": n_heads,
            "num_key_value_heads": count("attention.head_count_kv", n_heads),
            "head_dim": count("attention.key_length", hidden // n_heads),
            "max_position_embeddings": count("context_length", 2048),
            "rms_norm_eps": number("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": number("rope.freq_base", 10000.0),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "attention_bias": "model.layers.0.self_attn.o_proj.bias" in self._tensors,
            # llama.cpp writes a Llama's MLP biases (mlp_bias) as blk.N.ffn_{gate,up,down}.bias; no key says so
            "mlp_bias": "model.layers.0.mlp.down_proj.bias" in self._tensors,
        }
        scaling_type = meta("rope.scaling.type")
        if scaling_type in ("linear", "yarn"):
            config["rope_scaling"] = {
                "rope_type": scaling_type,
                "factor": number("rope.scaling.factor"),
                "original_max_position_embeddings": count(
                    "rope.scaling.original_context_length", config["max_position_embeddings"]
                ),
            }
        elif scaling_type not in (None, "none"):
            raise UnsupportedModelError(f"GGUF rope scaling {scaling_type!r} is not supported; supported: linear, yarn")
        if self.arch == "gemma3":
            config.update(self._gemma3_fields(config))
        if self.model_type is not None:
            config.update(moe_config_fields(self.model_type, self.arch, meta, config,
                                            lambda name: name in self._tensors or name in self._experts))
        freqs = next((t for t in self.reader.tensors if t.name == ROPE_FREQS), None)
        if freqs is not None:
            config["rope_scaling"] = {"rope_type": "freq_factors", "factors": [float(x) for x in freqs.data]}
        return config

    def _gemma3_fields(self, config: dict) -> dict:
        """What Gemma 3's decoder needs beyond the Llama keys, as llama.cpp reads (or assumes) it."""
        layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
        fields = {"sliding_window": self._count("attention.sliding_window"),
                  "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
                  "query_pre_attn_scalar": (config["hidden_size"] // heads if layers == GEMMA3_27B_LAYERS
                                            else config["head_dim"])}
        # gguf-py writes the pattern as one flag per layer (true: sliding); a period is read too
        pattern = self._meta("attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
        if isinstance(pattern, list) and len(pattern) == layers and all(isinstance(f, bool) for f in pattern):
            fields["layer_types"] = ["sliding_attention" if sliding else "full_attention" for sliding in pattern]
        else:
            fields["sliding_window_pattern"] = self._count("attention.sliding_window_pattern",
                                                           GEMMA3_SLIDING_WINDOW_PATTERN)
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):  # (Gemma 2's; refused by the spec)
            if self._meta(key) is not None:
                fields[key] = self._number(key)
        log.info("%s: Gemma 3's sliding layers rotate with base %g (transformers' default; the GGUF does not say)",
                 os.path.basename(self.path), GEMMA3_LOCAL_ROPE_BASE)
        return fields

    def tensors(self) -> list[SourceTensor]:
        dense = [SourceTensor(name, self._shape(name), t.tensor_type.name, int(t.n_bytes))
                 for name, t in self._tensors.items()]
        return dense + [SourceTensor(name, self._shape(name), part.tensor.tensor_type.name,
                                     self._expert_bytes(part)[1] - self._expert_bytes(part)[0])
                        for name, part in self._experts.items()]

    def _shape(self, name: str) -> tuple[int, ...]:
        """The logical numpy shape (GGUF lists dimensions innermost first)."""
        if name in self._experts:
            part = self._experts[name]
            shape = tuple(int(d) for d in reversed(part.tensor.shape))
            return shape[1:] if part.index is not None else shape
        shape = tuple(int(d) for d in reversed(self._tensors[name].shape))
        if name.endswith(".mlp.shared_expert_gate.weight") and len(shape) == 1:
            return (1, shape[0])  # llama.cpp stores Qwen2-MoE's [1, D] gate as a vector
        return shape

    def _expert_bytes(self, part: ExpertSlice) -> tuple[int, int]:
        """[start, end) of an expert's bytes in the file."""
        tensor = part.tensor
        if part.index is None:
            return tensor.data_offset, tensor.data_offset + int(tensor.n_bytes)
        per_expert = int(tensor.n_bytes) // int(tensor.shape[-1])
        start = tensor.data_offset + part.index * per_expert
        return start, start + per_expert

    def _unpermute_rows(self, name: str) -> np.ndarray | None:
        """llama.cpp's converter interleaves q/k rows of Llama models for its rope layout; undo it."""
        if self.arch != "llama":
            return None
        if ".self_attn.q_proj." in name:
            n_heads = self.config["num_attention_heads"]
        elif ".self_attn.k_proj." in name:
            n_heads = self.config["num_key_value_heads"]
        else:
            return None
        tensor = self._tensors[name]
        rows = int(tensor.shape[-1])  # GGUF shapes list the row count last
        if rows % (2 * n_heads):
            raise ConversionError(
                f"{os.path.basename(self.path)}: GGUF tensor {tensor.name!r} has {rows} rows, which do not split "
                f"into {n_heads} heads of two rope halves; the file is corrupt or not a llama model, export it again")
        permuted = np.arange(rows).reshape(n_heads, 2, rows // n_heads // 2).swapaxes(1, 2).reshape(rows)
        return np.argsort(permuted)

    def load(self, name: str) -> np.ndarray | QuantizedTensor:
        if name in self._experts:
            part = self._experts[name]
            data = part.tensor.data if part.index is None else part.tensor.data[part.index]  # a view of the mmap
            return from_gguf(data, part.tensor.tensor_type, self._shape(name))
        tensor = self._tensors[name]
        value = from_gguf(tensor.data, tensor.tensor_type, self._shape(name))
        shift = NORM_SHIFT.get(self.arch)
        if shift and name.endswith("norm.weight"):
            # back to transformers' w. Exact wherever 1 + w lies in [0.5, 2] (Sterbenz), within half an
            # ulp of w elsewhere; the runtime adds the 1 back in float32 as transformers does.
            return (np.asarray(value, dtype=np.float32) - np.float32(shift)).astype(np.float32)
        order = self._unpermute_rows(name)
        if order is None:
            return value
        if isinstance(value, QuantizedTensor):
            return value.take_rows(order)
        return np.ascontiguousarray(value[order])

    def release(self, name: str) -> None:
        if name in self._experts:
            release_pages(self.reader.data, *self._expert_bytes(self._experts[name]))
            return
        tensor = self._tensors[name]
        release_pages(self.reader.data, tensor.data_offset, tensor.data_offset + int(tensor.n_bytes))

    def close(self) -> None:
        mm = getattr(self.reader, "data", None)
        if mm is not None and hasattr(mm, "_mmap") and mm._mmap is not None:
            mm._mmap.close()
