"""Dense decoder families of the Llama lineage (Llama, Mistral, Qwen2, Qwen3): one dataclass each,
fields named exactly as in Hugging Face config.json. The registry and readers live in edge/spec.py."""
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
