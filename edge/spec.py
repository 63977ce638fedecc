"""Model specs: one dataclass per family, fields named exactly as in Hugging Face config.json.

`spec_from_dict` picks the family by `model_type` through a small alias table and ignores
keys it does not know, so a config.json written by any transformers version loads.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from edge.errors import UnsupportedModelError
from edge.moe import MoeConfig
# The families' dataclasses live beside this module; edge.spec is where the rest of the code imports them from.
from edge.spec_dense import LlamaSpec, MistralSpec, Qwen2Spec, Qwen3Spec  # noqa: F401
from edge.spec_moe import (  # noqa: F401
    DeepseekV2Spec, DeepseekV3Spec, LlamaMoeSpec, MixtralSpec, OlmoeSpec, Qwen2MoeSpec, Qwen3MoeSpec,
)


SPEC_CLASSES: dict[str, type[LlamaSpec]] = {
    "llama": LlamaSpec,
    "mistral": MistralSpec,
    "qwen2": Qwen2Spec,
    "qwen3": Qwen3Spec,
    "mixtral": MixtralSpec,
    "qwen2_moe": Qwen2MoeSpec,
    "qwen3_moe": Qwen3MoeSpec,
    "olmoe": OlmoeSpec,
    "llama_moe": LlamaMoeSpec,
    "deepseek_v2": DeepseekV2Spec,
    "deepseek_v3": DeepseekV3Spec,
}
# Other spellings of the same families.
# Config keys that transformers writes under another name for some families (its attribute_map):
# family -> {name in config.json: our field}.
FIELD_ALIASES: dict[str, dict[str, str]] = {
    "mixtral": {"num_experts": "num_local_experts"},
    "qwen3_moe": {"num_local_experts": "num_experts"},
    "olmoe": {"num_local_experts": "num_experts"},
}
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


# Families whose configs we recognise but whose attention we do not implement, and why.
UNSUPPORTED_FEATURES: dict[str, str] = {
    "gpt_oss": "its attention sinks (a learned per-head logit in every softmax) are not implemented",
}


def spec_from_dict(config: dict[str, Any]) -> LlamaSpec:
    """Build the family's spec from a config.json dict (unknown keys are ignored)."""
    model_type = config.get("model_type")
    if model_type is None:
        raise UnsupportedModelError(
            f"config has no model_type; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    family = MODEL_TYPE_ALIASES.get(model_type, model_type)
    spec_class = SPEC_CLASSES.get(family)
    if spec_class is None and family in UNSUPPORTED_FEATURES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported: {UNSUPPORTED_FEATURES[family]}; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if spec_class is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    config = _normalize_rope(config)
    for alias, field_name in FIELD_ALIASES.get(family, {}).items():
        if config.get(field_name) is None and config.get(alias) is not None:
            config[field_name] = config[alias]
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
    if spec.attention_kind == "mla":
        names += mla_tensor_names(spec, prefix + "self_attn.")
    else:
        names += gqa_tensor_names(spec, prefix + "self_attn.")
    names.append(prefix + "post_attention_layernorm.weight")
    moe = spec.moe_for_layer(layer)
    if moe is not None:
        return names + moe_block_tensor_names(moe, prefix + "mlp.")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        names.append(prefix + f"mlp.{proj}.weight")
        if spec.mlp_bias:
            names.append(prefix + f"mlp.{proj}.bias")
    return names


def moe_block_tensor_names(moe: MoeConfig, prefix: str) -> list[str]:
    """The non-expert weights of a MoE block (router, shared experts); routed experts live in experts.bin."""
    names = [prefix + "gate.weight"]
    if moe.score_correction_bias:
        names.append(prefix + "gate.e_score_correction_bias")
    if moe.shared_intermediate_size:
        names += [prefix + f"{moe.shared_expert_name}.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")]
        if moe.shared_expert_gate:
            names.append(prefix + "shared_expert_gate.weight")
    return names


def spec_expert_tensor_names(spec: LlamaSpec) -> dict[int, list[list[str]]]:
    """Routed expert weights by MoE layer: layer -> per expert, its [gate_proj, up_proj, down_proj] names."""
    experts = {}
    for layer in range(spec.num_hidden_layers):
        moe = spec.moe_for_layer(layer)
        if moe is not None:
            experts[layer] = [[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                               for proj in ("gate_proj", "up_proj", "down_proj")]
                              for e in range(moe.num_experts)]
    return experts


def spec_optional_tensor_names(spec: LlamaSpec) -> list[str]:
    """Weights a checkpoint of this spec may carry or omit: a MoEfied router's fitted intercept."""
    if spec.model_type != "llama_moe":
        return []
    return [f"model.layers.{layer}.mlp.gate.bias" for layer in range(spec.num_hidden_layers)
            if spec.moe_for_layer(layer) is not None]


def gqa_tensor_names(spec: LlamaSpec, prefix: str) -> list[str]:
    """The attention weights of one MHA/GQA/MQA layer."""
    names = []
    for proj in ("q_proj", "k_proj", "v_proj"):
        names.append(prefix + f"{proj}.weight")
        if spec.qkv_bias:
            names.append(prefix + f"{proj}.bias")
    if spec.qk_norm:
        names += [prefix + "q_norm.weight", prefix + "k_norm.weight"]
    names.append(prefix + "o_proj.weight")
    if spec.attention_bias:
        names.append(prefix + "o_proj.bias")
    return names


def mla_tensor_names(spec: DeepseekV2Spec, prefix: str) -> list[str]:
    """The attention weights of one MLA layer (transformers' DeepseekV2Attention / V3)."""
    names = []
    if spec.q_lora_rank is None:
        names.append(prefix + "q_proj.weight")
    else:
        names.append(prefix + "q_a_proj.weight")
        if spec.attention_bias:
            names.append(prefix + "q_a_proj.bias")
        names += [prefix + "q_a_layernorm.weight", prefix + "q_b_proj.weight"]
    names.append(prefix + "kv_a_proj_with_mqa.weight")
    if spec.attention_bias:
        names.append(prefix + "kv_a_proj_with_mqa.bias")
    names += [prefix + "kv_a_layernorm.weight", prefix + "kv_b_proj.weight", prefix + "o_proj.weight"]
    if spec.attention_bias:
        names.append(prefix + "o_proj.bias")
    return names


def spec_tensor_names(spec: LlamaSpec) -> list[str]:
    names = ["model.embed_tokens.weight"]
    for layer in range(spec.num_hidden_layers):
        names += spec_layer_tensor_names(spec, layer)
    names.append("model.norm.weight")
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    return names
