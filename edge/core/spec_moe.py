"""Mixture-of-Experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, MoEfied Llama) and DeepSeek-V2/V3
(MLA attention, grouped routing): one dataclass each, fields named exactly as in Hugging Face config.json."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from edge.core.errors import UnsupportedModelError
from edge.core.moe import MoeConfig
from edge.core.spec_dense import (
    MAX_EXPERTS,
    MAX_LAYERS,
    MAX_WIDTH,
    FieldRule,
    LlamaSpec,
    MistralSpec,
    Qwen2Spec,
    Qwen3Spec,
)


def _with_dense_ffn(spec: LlamaSpec, fields: tuple[str, ...]) -> tuple[str, ...]:
    """`fields`, plus intermediate_size when some layer keeps a dense feed-forward block."""
    dense = any(spec.moe_for_layer(layer) is None for layer in range(spec.num_hidden_layers))
    return fields + ("intermediate_size",) if dense else fields


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

    EXPERTS_FIELD: ClassVar[str] = "n_routed_experts"
    REQUIRED_FIELDS: ClassVar[tuple[str, ...]] = (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    FIELD_RULES: ClassVar[dict[str, FieldRule]] = {
        "q_lora_rank": FieldRule("count", nullable=True, maximum=MAX_WIDTH),
        "kv_lora_rank": FieldRule("count", maximum=MAX_WIDTH),
        "qk_nope_head_dim": FieldRule("size", maximum=MAX_WIDTH),
        "qk_rope_head_dim": FieldRule("count", maximum=MAX_WIDTH),
        "v_head_dim": FieldRule("count", maximum=MAX_WIDTH),
        "n_routed_experts": FieldRule("count", maximum=MAX_EXPERTS),
        "n_shared_experts": FieldRule("size", maximum=MAX_EXPERTS),
        "num_experts_per_tok": FieldRule("count", nullable=True, maximum=MAX_EXPERTS),  # null: every layer dense
        "moe_intermediate_size": FieldRule("count", maximum=MAX_WIDTH),
        "first_k_dense_replace": FieldRule("size", maximum=MAX_LAYERS),
        "moe_layer_freq": FieldRule("count", maximum=MAX_LAYERS),
        "routed_scaling_factor": FieldRule("positive"),
        "topk_method": FieldRule("text"),
        "n_group": FieldRule("count", nullable=True, maximum=MAX_EXPERTS),
        "topk_group": FieldRule("count", nullable=True, maximum=MAX_EXPERTS),
        "norm_topk_prob": FieldRule("flag"),
        "scoring_func": FieldRule("text"),
    }

    def required_fields(self) -> tuple[str, ...]:
        fields = self.REQUIRED_FIELDS
        if any(self.is_moe_layer(layer) for layer in range(self.num_hidden_layers)):
            fields += ("n_routed_experts", "n_shared_experts", "moe_intermediate_size")
        return _with_dense_ffn(self, fields)

    def _derive_fields(self) -> None:
        self.num_key_value_heads = self.num_attention_heads  # every head has its own K/V, rebuilt from the latent
        self.head_dim = self.qk_rope_head_dim

    def _check_consistency(self) -> None:
        if self.qk_rope_head_dim % 2:
            raise UnsupportedModelError(
                f"qk_rope_head_dim must be even for rotary embeddings, got {self.qk_rope_head_dim}")
        super()._check_consistency()
        self._check_routing()
        self._check_shared_expert_bias()

    def _check_shared_expert_bias(self) -> None:
        # transformers' DeepseekV2MLP follows mlp_bias, in the dense layers (supported) and as the MoE
        # layers' shared experts (even n_shared_experts 0 keeps down_proj's bias), whose biases a MoE
        # block has no place for: refused here rather than as tensors the config does not describe
        if self.mlp_bias and any(self.is_moe_layer(layer) for layer in range(self.num_hidden_layers)):
            raise UnsupportedModelError(
                f"{self.model_type} with mlp_bias true gives the shared experts of its MoE layers biases "
                "(mlp.shared_experts.*.bias), which are not supported; supported: mlp_bias false, or mlp_bias "
                "true with every layer dense (first_k_dense_replace >= num_hidden_layers)")

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

    FIELD_RULES: ClassVar[dict[str, FieldRule]] = {"rope_interleave": FieldRule("flag")}

    def _derive_fields(self) -> None:
        super()._derive_fields()
        # transformers' DeepseekV3MLP (dense layers and shared experts) has no biases whatever the
        # config says, unlike V2's: an mlp_bias key is ignored, so it is here
        self.mlp_bias = False

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
# Each says which layers are sparse and how their router scores experts (edge/core/moe.py `route`).


def _sparse_by_step(layer: int, num_experts: int, decoder_sparse_step: int, mlp_only_layers: list[int]) -> bool:
    """Qwen2-MoE / Qwen3-MoE: every decoder_sparse_step-th layer (1-based) is sparse, except mlp_only_layers."""
    return (layer not in mlp_only_layers and num_experts > 0 and decoder_sparse_step > 0
            and (layer + 1) % decoder_sparse_step == 0)


@dataclass
class MixtralSpec(MistralSpec):
    model_type: str = "mixtral"
    num_local_experts: int = 8
    num_experts_per_tok: int = 2

    EXPERTS_FIELD: ClassVar[str] = "num_local_experts"
    REQUIRED_FIELDS: ClassVar[tuple[str, ...]] = LlamaSpec.REQUIRED_FIELDS + (
        "num_local_experts", "num_experts_per_tok")
    FIELD_RULES: ClassVar[dict[str, FieldRule]] = {
        "num_local_experts": FieldRule("count", maximum=MAX_EXPERTS),
        "num_experts_per_tok": FieldRule("count", maximum=MAX_EXPERTS)}

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

    EXPERTS_FIELD: ClassVar[str] = "num_experts"
    REQUIRED_FIELDS: ClassVar[tuple[str, ...]] = (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts", "num_experts_per_tok",
        "moe_intermediate_size", "shared_expert_intermediate_size")
    FIELD_RULES: ClassVar[dict[str, FieldRule]] = {
        "qkv_bias": FieldRule("flag"),
        "num_experts": FieldRule("size", maximum=MAX_EXPERTS),  # 0: every layer dense
        "num_experts_per_tok": FieldRule("count", maximum=MAX_EXPERTS),
        "moe_intermediate_size": FieldRule("count", maximum=MAX_WIDTH),
        "shared_expert_intermediate_size": FieldRule("size", maximum=MAX_WIDTH),  # 0: no shared expert
        "norm_topk_prob": FieldRule("flag"),
        "decoder_sparse_step": FieldRule("count", maximum=MAX_LAYERS),
        "mlp_only_layers": FieldRule("layers"),
    }

    def required_fields(self) -> tuple[str, ...]:
        return _with_dense_ffn(self, self.REQUIRED_FIELDS)

    def moe_for_layer(self, layer: int) -> MoeConfig | None:
        if not _sparse_by_step(layer, self.num_experts, self.decoder_sparse_step, self.mlp_only_layers):
            return None
        return MoeConfig(self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size,
                         scoring="softmax", norm_topk_prob=self.norm_topk_prob,
                         shared_intermediate_size=self.shared_expert_intermediate_size, shared_expert_gate=True)

    def sliding_window_for_layer(self, layer: int) -> int | None:
        # transformers' Qwen2MoeConfig derives absent layer_types differently from dense Qwen2: the
        # even-numbered layers below max_window_layers slide
        if not (self.use_sliding_window and self.sliding_window) or self.layer_types is not None:
            return super().sliding_window_for_layer(layer)
        return self.sliding_window if layer % 2 == 0 and layer < self.max_window_layers else None


@dataclass
class Qwen3MoeSpec(Qwen3Spec):
    model_type: str = "qwen3_moe"
    DEFAULT_HEAD_DIM: ClassVar[int | None] = None  # its config has no head_dim field: derived as in Llama
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    EXPERTS_FIELD: ClassVar[str] = "num_experts"
    REQUIRED_FIELDS: ClassVar[tuple[str, ...]] = (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts", "num_experts_per_tok",
        "moe_intermediate_size")
    FIELD_RULES: ClassVar[dict[str, FieldRule]] = {
        "num_experts": FieldRule("size", maximum=MAX_EXPERTS),  # 0: every layer dense
        "num_experts_per_tok": FieldRule("count", maximum=MAX_EXPERTS),
        "moe_intermediate_size": FieldRule("count", maximum=MAX_WIDTH),
        "norm_topk_prob": FieldRule("flag"),
        "decoder_sparse_step": FieldRule("count", maximum=MAX_LAYERS),
        "mlp_only_layers": FieldRule("layers"),
    }

    def required_fields(self) -> tuple[str, ...]:
        return _with_dense_ffn(self, self.REQUIRED_FIELDS)

    def moe_for_layer(self, layer: int) -> MoeConfig | None:
        if not _sparse_by_step(layer, self.num_experts, self.decoder_sparse_step, self.mlp_only_layers):
            return None
        return MoeConfig(self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size,
                         scoring="softmax", norm_topk_prob=self.norm_topk_prob)

    def sliding_window_for_layer(self, layer: int) -> int | None:
        # transformers' Qwen3-MoE has neither layer_types nor max_window_layers: with
        # use_sliding_window every layer attends through the window
        return self.sliding_window if self.use_sliding_window and self.sliding_window else None


@dataclass
class OlmoeSpec(LlamaSpec):
    model_type: str = "olmoe"
    num_experts: int = 64
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    clip_qkv: float | None = None  # q, k, v clamped to [-clip_qkv, clip_qkv] after their projections

    EXPERTS_FIELD: ClassVar[str] = "num_experts"
    REQUIRED_FIELDS: ClassVar[tuple[str, ...]] = LlamaSpec.REQUIRED_FIELDS + ("num_experts", "num_experts_per_tok")
    FIELD_RULES: ClassVar[dict[str, FieldRule]] = {
        "num_experts": FieldRule("count", maximum=MAX_EXPERTS),
        "num_experts_per_tok": FieldRule("count", maximum=MAX_EXPERTS),
        "norm_topk_prob": FieldRule("flag"),
        "clip_qkv": FieldRule("positive", nullable=True),
    }

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

    EXPERTS_FIELD: ClassVar[str] = "num_experts"
    REQUIRED_FIELDS: ClassVar[tuple[str, ...]] = (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts", "num_experts_per_tok",
        "moe_intermediate_size")
    FIELD_RULES: ClassVar[dict[str, FieldRule]] = {
        "num_experts": FieldRule("count", maximum=MAX_EXPERTS),
        "num_experts_per_tok": FieldRule("count", maximum=MAX_EXPERTS),
        "moe_intermediate_size": FieldRule("size", maximum=MAX_WIDTH),
        "dense_layers": FieldRule("layers"),
    }

    def required_fields(self) -> tuple[str, ...]:
        return _with_dense_ffn(self, self.REQUIRED_FIELDS)

    def _check_consistency(self) -> None:
        super()._check_consistency()
        if self.moe_intermediate_size <= 0 and len(set(self.dense_layers)) < self.num_hidden_layers:
            raise UnsupportedModelError(
                f"llama_moe config has moe_intermediate_size {self.moe_intermediate_size}; expected the experts' "
                "intermediate size (> 0)")

    def moe_for_layer(self, layer: int) -> MoeConfig | None:
        if layer in self.dense_layers:
            return None
        return MoeConfig(self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size, scoring="unit")
