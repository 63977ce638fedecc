"""Model specs: one dataclass per family, fields named exactly as in Hugging Face config.json.

`spec_from_dict` picks the family by `model_type` through a small alias table and ignores
keys it does not know, so a config.json written by any transformers version loads.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
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

    @property
    def qk_norm_over_projection(self) -> bool:
        """True: q/k norms span the whole projection (OLMoE); False: each head (Qwen3)."""
        return False

    @property
    def clip_qkv(self) -> float | None:
        return None

    @property
    def attention_kind(self) -> str:
        """"gqa": per-head K/V projections (MHA, GQA and MQA); "mla": DeepSeek's latent attention."""
        return "gqa"

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
    # per layer "full_attention" | "sliding_attention"; None: derived from max_window_layers
    layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_layer_types(self)

    @property
    def qkv_bias(self) -> bool:
        return True  # Qwen2 always has q/k/v biases; its config has no switch for them

    def sliding_window_for_layer(self, layer: int) -> int | None:
        # transformers: the window applies only with use_sliding_window, to the layers that
        # layer_types marks "sliding_attention", or else to layers at index >= max_window_layers
        if not (self.use_sliding_window and self.sliding_window):
            return None
        if self.layer_types is not None:
            return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None
        return self.sliding_window if layer >= self.max_window_layers else None


@dataclass
class Qwen3Spec(Qwen2Spec):
    model_type: str = "qwen3"

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return True


LAYER_TYPES = ("full_attention", "sliding_attention")


def check_layer_types(spec: LlamaSpec) -> None:
    layer_types = getattr(spec, "layer_types", None)
    if layer_types is None:
        return
    if len(layer_types) != spec.num_hidden_layers:
        raise UnsupportedModelError(
            f"layer_types lists {len(layer_types)} layers but num_hidden_layers is {spec.num_hidden_layers}; "
            f"the config is inconsistent, fix layer_types"
        )
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise UnsupportedModelError(
            f"layer_types {unknown} are not supported for {spec.model_type}; supported: {', '.join(LAYER_TYPES)}"
        )


@dataclass
class DeepseekV2Spec(LlamaSpec):
    """DeepSeek-V2: multi-head latent attention (MLA) and, from layer first_k_dense_replace on,
    a MoE block with shared experts. transformers sets head_dim = qk_rope_head_dim (the rotary part)."""

    model_type: str = "deepseek_v2"
    # MLA. q_lora_rank None: queries come from one q_proj (DeepSeek-V2-Lite), else q_a -> norm -> q_b
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # MoE, HF config names
    n_routed_experts: int = 64
    n_shared_experts: int = 2
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int = 1407
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False
    scoring_func: str = "softmax"

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_attention_heads  # every head has its own K/V, rebuilt from the latent
        self.head_dim = self.qk_rope_head_dim
        super().__post_init__()
        if self.qk_rope_head_dim % 2:
            raise UnsupportedModelError(f"qk_rope_head_dim must be even for rotary embeddings, got {self.qk_rope_head_dim}")
        self._check_routing()

    def _check_routing(self) -> None:
        if self.topk_method not in ("greedy", "group_limited_greedy"):
            raise UnsupportedModelError(
                f"topk_method {self.topk_method!r} is not supported for {self.model_type}; "
                f"supported: greedy, group_limited_greedy"
            )
        if self.scoring_func != "softmax":
            raise UnsupportedModelError(
                f"scoring_func {self.scoring_func!r} is not supported for {self.model_type}; supported: softmax"
            )

    @property
    def attention_kind(self) -> str:
        return "mla"

    @property
    def qkv_bias(self) -> bool:
        return False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_interleaved(self) -> bool:
        """The rotary part of q and k pairs dimensions (0, 1), (2, 3), ... (DeepSeek's layout)."""
        return True

    @property
    def mla_softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times yarn's mscale(factor, mscale_all_dim)^2 (DeepSeek's long-context fix)."""
        scale = self.qk_head_dim ** -0.5
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
            factor = scaling["factor"]
            mscale = 1.0 if factor <= 1 else 0.1 * scaling["mscale_all_dim"] * math.log(factor) + 1.0
            scale *= mscale * mscale
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return (self.num_experts_per_tok is not None and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)

    def moe_for_layer(self, layer: int) -> MoeConfig | None:
        if not self.is_moe_layer(layer):
            return None
        grouped = self.topk_method == "group_limited_greedy"
        # transformers' DeepseekV2TopkRouter never renormalises the chosen weights (norm_topk_prob unused)
        return MoeConfig(
            num_experts=self.n_routed_experts,
            top_k=self.num_experts_per_tok,
            intermediate_size=self.moe_intermediate_size,
            scoring="softmax",
            norm_topk_prob=False,
            routed_scaling_factor=self.routed_scaling_factor,
            n_group=(self.n_group or 1) if grouped else 1,
            topk_group=(self.topk_group or 1) if grouped else 1,
            group_score="max",
            shared_intermediate_size=self.moe_intermediate_size * self.n_shared_experts,
            shared_expert_name="shared_experts",
        )


@dataclass
class DeepseekV3Spec(DeepseekV2Spec):
    """DeepSeek-V3: MLA as V2; sigmoid routing with a selection bias over n_group expert groups."""

    model_type: str = "deepseek_v3"
    q_lora_rank: int | None = None
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    first_k_dense_replace: int = 3
    routed_scaling_factor: float = 2.5
    topk_method: str = "noaux_tc"
    n_group: int | None = 8
    topk_group: int | None = 4
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    rope_interleave: bool = True

    def _check_routing(self) -> None:
        if self.topk_method != "noaux_tc":
            raise UnsupportedModelError(
                f"topk_method {self.topk_method!r} is not supported for {self.model_type}; supported: noaux_tc"
            )
        if self.scoring_func != "sigmoid":
            raise UnsupportedModelError(
                f"scoring_func {self.scoring_func!r} is not supported for {self.model_type}; supported: sigmoid"
            )
        if self.n_group and self.n_routed_experts % self.n_group:
            raise UnsupportedModelError(
                f"n_routed_experts ({self.n_routed_experts}) is not a multiple of n_group ({self.n_group})"
            )

    @property
    def rope_interleaved(self) -> bool:
        return self.rope_interleave

    def moe_for_layer(self, layer: int) -> MoeConfig | None:
        if not self.is_moe_layer(layer):
            return None
        return MoeConfig(
            num_experts=self.n_routed_experts,
            top_k=self.num_experts_per_tok,
            intermediate_size=self.moe_intermediate_size,
            scoring="sigmoid",
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
            n_group=self.n_group or 1,
            topk_group=self.topk_group or 1,
            group_score="top2_sum",
            score_correction_bias=True,
            shared_intermediate_size=self.moe_intermediate_size * self.n_shared_experts,
            shared_expert_name="shared_experts",
        )


# --- Mixture-of-Experts families ----------------------------------------------------------------
# Each says which layers are sparse and how their router scores experts (edge/moe.py `route`).


def _sparse_by_step(layer: int, num_experts: int, decoder_sparse_step: int, mlp_only_layers: list[int]) -> bool:
    """Qwen2-MoE / Qwen3-MoE: every decoder_sparse_step-th layer (1-based) is sparse, except mlp_only_layers."""
    return (layer not in mlp_only_layers and num_experts > 0 and decoder_sparse_step > 0
            and (layer + 1) % decoder_sparse_step == 0)


@dataclass
class MixtralSpec(MistralSpec):
    model_type: str = "mixtral"
    num_local_experts: int = 8
    num_experts_per_tok: int = 2

    def moe_for_layer(self, layer: int) -> MoeConfig | None:
        # every layer is sparse; softmax over all experts, top-k, renormalised to sum to 1
        return MoeConfig(self.num_local_experts, self.num_experts_per_tok, self.intermediate_size,
                         scoring="softmax", norm_topk_prob=True)


@dataclass
class Qwen2MoeSpec(Qwen2Spec):
    model_type: str = "qwen2_moe"
    qkv_bias: bool = True  # a config field in this family (a fixed property in Qwen2)
    num_experts: int = 60
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 1408
    shared_expert_intermediate_size: int = 5632
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def moe_for_layer(self, layer: int) -> MoeConfig | None:
        if not _sparse_by_step(layer, self.num_experts, self.decoder_sparse_step, self.mlp_only_layers):
            return None
        return MoeConfig(self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size,
                         scoring="softmax", norm_topk_prob=self.norm_topk_prob,
                         shared_intermediate_size=self.shared_expert_intermediate_size, shared_expert_gate=True)


@dataclass
class Qwen3MoeSpec(Qwen3Spec):
    model_type: str = "qwen3_moe"
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def moe_for_layer(self, layer: int) -> MoeConfig | None:
        if not _sparse_by_step(layer, self.num_experts, self.decoder_sparse_step, self.mlp_only_layers):
            return None
        return MoeConfig(self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size,
                         scoring="softmax", norm_topk_prob=self.norm_topk_prob)


@dataclass
class OlmoeSpec(LlamaSpec):
    model_type: str = "olmoe"
    num_experts: int = 64
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    clip_qkv: float | None = None  # q, k, v clamped to [-clip_qkv, clip_qkv] after their projections

    @property
    def qk_norm(self) -> bool:
        return True

    @property
    def qk_norm_over_projection(self) -> bool:
        # OLMoE normalises the whole q / k projection (Hq*Dh / Hkv*Dh wide), not each head
        return True

    def moe_for_layer(self, layer: int) -> MoeConfig | None:
        return MoeConfig(self.num_experts, self.num_experts_per_tok, self.intermediate_size,
                         scoring="softmax", norm_topk_prob=self.norm_topk_prob)


@dataclass
class LlamaMoeSpec(LlamaSpec):
    """A Llama whose FFNs were split into experts by MoEfication (`zllm-edge convert --moefy`).

    The experts partition the dense FFN's neurons, so a chosen expert contributes with weight 1.0:
    the router only decides which neurons to compute. Its optional bias `mlp.gate.bias` is the
    intercept of the least-squares fit that produced it."""

    model_type: str = "llama_moe"
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    dense_layers: list[int] = field(default_factory=list)  # layers that keep their dense FFN

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.moe_intermediate_size <= 0 and len(set(self.dense_layers)) < self.num_hidden_layers:
            raise UnsupportedModelError(
                f"llama_moe config has moe_intermediate_size {self.moe_intermediate_size}; expected the experts' "
                "intermediate size (> 0)")

    def moe_for_layer(self, layer: int) -> MoeConfig | None:
        if layer in self.dense_layers:
            return None
        return MoeConfig(self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size, scoring="unit")


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
