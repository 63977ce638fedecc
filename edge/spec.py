"""Model specs: one dataclass per family, fields named exactly as in Hugging Face config.json.

`spec_from_dict` picks the family by `model_type` through a small alias table and ignores
keys it does not know, so a config.json written by any transformers version loads.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from edge.errors import UnsupportedModelError
from edge.moe import MoeConfig


@dataclass
class LlamaSpec:
    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # {"rope_type": "default"|"linear"|"llama3"|"yarn"|"freq_factors", ...}; None means default
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | list[int] | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.hidden_act not in ("silu", "swish"):
            raise UnsupportedModelError(
                f"hidden_act {self.hidden_act!r} is not supported for {self.model_type}; supported: silu"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    # What the model composition needs to know, derived once from the family's fields.
    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return False

    def sliding_window_for_layer(self, layer: int) -> int | None:
        return None

    def moe_for_layer(self, layer: int) -> "MoeConfig | None":
        """How the layer's feed-forward block routes to experts; None for a dense block."""
        return None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class MistralSpec(LlamaSpec):
    model_type: str = "mistral"
    sliding_window: int | None = None

    def sliding_window_for_layer(self, layer: int) -> int | None:
        return self.sliding_window


@dataclass
class Qwen2Spec(LlamaSpec):
    model_type: str = "qwen2"
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28

    @property
    def qkv_bias(self) -> bool:
        return True  # Qwen2 always has q/k/v biases; its config has no switch for them

    def sliding_window_for_layer(self, layer: int) -> int | None:
        # transformers: layers at index >= max_window_layers use the sliding window
        if self.use_sliding_window and self.sliding_window and layer >= self.max_window_layers:
            return self.sliding_window
        return None


@dataclass
class Qwen3Spec(Qwen2Spec):
    model_type: str = "qwen3"

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return True


SPEC_CLASSES: dict[str, type[LlamaSpec]] = {
    "llama": LlamaSpec,
    "mistral": MistralSpec,
    "qwen2": Qwen2Spec,
    "qwen3": Qwen3Spec,
}
# Other spellings of the same families.
MODEL_TYPE_ALIASES: dict[str, str] = {
    "smollm2": "llama",
}
SUPPORTED_MODEL_TYPES = sorted(SPEC_CLASSES)


def _normalize_rope(config: dict[str, Any]) -> dict[str, Any]:
    """transformers >= 5 writes `rope_parameters` (theta inside); older writes rope_theta + rope_scaling."""
    config = dict(config)
    rope = config.pop("rope_parameters", None)
    if rope:
        rope = dict(rope)
        if "rope_theta" in rope:
            config["rope_theta"] = rope.pop("rope_theta")
        config.setdefault("rope_scaling", None)
        if config["rope_scaling"] is None:
            config["rope_scaling"] = rope
    scaling = config.get("rope_scaling")
    if scaling:
        scaling = dict(scaling)
        scaling["rope_type"] = scaling.get("rope_type", scaling.pop("type", "default"))
        scaling.pop("type", None)
        if scaling["rope_type"] in ("llama3", "yarn"):
            scaling.setdefault(
                "original_max_position_embeddings",
                config.get("original_max_position_embeddings", config.get("max_position_embeddings")),
            )
        config["rope_scaling"] = None if scaling["rope_type"] == "default" and len(scaling) == 1 else scaling
    return config


def spec_from_dict(config: dict[str, Any]) -> LlamaSpec:
    """Build the family's spec from a config.json dict (unknown keys are ignored)."""
    model_type = config.get("model_type")
    if model_type is None:
        raise UnsupportedModelError(
            f"config has no model_type; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    family = MODEL_TYPE_ALIASES.get(model_type, model_type)
    spec_class = SPEC_CLASSES.get(family)
    if spec_class is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    config = _normalize_rope(config)
    known = {f.name for f in dataclasses.fields(spec_class)}
    values = {k: v for k, v in config.items() if k in known and v is not None}
    values["model_type"] = family
    try:
        return spec_class(**values)
    except TypeError as exc:
        raise UnsupportedModelError(f"config for {model_type!r} is malformed: {exc}") from None


def spec_layer_tensor_names(spec: LlamaSpec, layer: int) -> list[str]:
    """Every weight a decoder layer of this spec owns, in checkpoint order."""
    prefix = f"model.layers.{layer}."
    names = [prefix + "input_layernorm.weight"]
    for proj in ("q_proj", "k_proj", "v_proj"):
        names.append(prefix + f"self_attn.{proj}.weight")
        if spec.qkv_bias:
            names.append(prefix + f"self_attn.{proj}.bias")
    if spec.qk_norm:
        names += [prefix + "self_attn.q_norm.weight", prefix + "self_attn.k_norm.weight"]
    names.append(prefix + "self_attn.o_proj.weight")
    if spec.attention_bias:
        names.append(prefix + "self_attn.o_proj.bias")
    names.append(prefix + "post_attention_layernorm.weight")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        names.append(prefix + f"mlp.{proj}.weight")
        if spec.mlp_bias:
            names.append(prefix + f"mlp.{proj}.bias")
    return names


def spec_tensor_names(spec: LlamaSpec) -> list[str]:
    names = ["model.embed_tokens.weight"]
    for layer in range(spec.num_hidden_layers):
        names += spec_layer_tensor_names(spec, layer)
    names.append("model.norm.weight")
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    return names
