"""Dense decoder families of the Llama lineage (Llama, Mistral, Qwen2, Qwen3, Gemma 3): one dataclass each,
fields named exactly as in Hugging Face config.json. The registry and readers live in edge/core/spec.py.

Every spec checks its fields when it is built: each field's type and range in one table per class
(FIELD_RULES, merged along the class hierarchy), then what the fields must satisfy together
(`_check_consistency`). A malformed value is a ConversionError naming the field, what it must be and
what it is; a well-formed value this code does not implement is an UnsupportedModelError."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, ClassVar

from edge.core.arguments import is_integer, is_number
from edge.core.errors import ConversionError, UnsupportedModelError
from edge.core.moe import MoeConfig

# --- field rules ----------------------------------------------------------------------------------

# The largest value each kind of size may take: several times the largest released model's (126 layers,
# hidden 18432, FFN 73728, 128 heads, vocabulary 262144, 512 experts, a 10M-token context), and small
# enough that what loops over layers and experts, or sizes a table by the context, stays cheap. A value
# beyond them is a damaged config, which would otherwise run until killed.
MAX_LAYERS = 1024
MAX_WIDTH = 1 << 18  # hidden, intermediate, head and latent dimensions
MAX_HEADS = 1024
MAX_VOCAB = 1 << 21
MAX_POSITIONS = 1 << 24
MAX_EXPERTS = 4096
# rms_norm_eps: real models use 1e-5 or 1e-6; a huge one swamps mean(x^2) and scales every activation,
# and so every logit, to 0
MAX_NORM_EPS = 1.0


def _is_layer_list(value, spec) -> bool:
    # bounded by the layer count: each layer of the model is tested for membership
    return (isinstance(value, (list, tuple)) and len(value) <= spec.num_hidden_layers
            and all(is_integer(v) and 0 <= v < spec.num_hidden_layers for v in value))


# kind -> (test, what a value must be). The test also gets the spec, for ranges that depend on it.
FIELD_KINDS: dict[str, tuple[Any, str]] = {
    "count": (lambda v, spec: is_integer(v, 1), "a positive integer"),
    "size": (lambda v, spec: is_integer(v, 0), "a non-negative integer"),
    "positive": (lambda v, spec: is_number(v) and v > 0, "a positive number"),
    "non_negative": (lambda v, spec: is_number(v) and v >= 0, "a non-negative number"),
    "flag": (lambda v, spec: isinstance(v, bool), "true or false"),
    "text": (lambda v, spec: isinstance(v, str), "a string"),
    "layers": (_is_layer_list, "a list of at most num_hidden_layers layer indices in [0, num_hidden_layers)"),
    "layer_types": (lambda v, spec: isinstance(v, (list, tuple)) and all(isinstance(t, str) for t in v),
                    "a list of strings"),
    "token_ids": (lambda v, spec: is_integer(v, 0) or (isinstance(v, (list, tuple))
                                                        and all(is_integer(i, 0) for i in v)),
                  "a token id (a non-negative integer) or a list of them"),
    "rope_scaling": (lambda v, spec: isinstance(v, dict), "an object"),
}


@dataclass(frozen=True)
class FieldRule:
    kind: str  # a key of FIELD_KINDS
    nullable: bool = False  # null (None) is allowed and means "absent"
    maximum: float | None = None  # the largest value allowed (MAX_LAYERS, ...)


def check_value(name: str, value, rule: FieldRule, spec) -> None:
    """Refuse `value` unless it is of the rule's kind and at most its maximum (null is left to the caller)."""
    test, what = FIELD_KINDS[rule.kind]
    if not test(value, spec):
        raise ConversionError(f"{name} must be {what}{' or null' if rule.nullable else ''}, got {show(value)}")
    if rule.maximum is not None and value > rule.maximum:
        raise ConversionError(f"{name} must be at most {show(rule.maximum)} (far above any real model's), "
                              f"got {show(value)}")


SHOWN_CHARACTERS = 80  # a message stays one readable line whatever a damaged config holds


def clipped(text: str) -> str:
    """`text`, cut to SHOWN_CHARACTERS for a message."""
    return text if len(text) <= SHOWN_CHARACTERS else text[:SHOWN_CHARACTERS] + "..."


def show(value) -> str:
    """A config value as config.json spells it ("2", 2.0, [1, 2], true), for messages; long ones cut short."""
    try:
        return clipped(json.dumps(value))
    except (TypeError, ValueError):
        return clipped(repr(value))


def _normalized(value, kind: str):
    """Plain Python values (numpy scalars from GGUF metadata become int/float) so that to_dict is JSON."""
    if kind in ("count", "size"):
        return int(value)
    if kind in ("positive", "non_negative"):
        return int(value) if is_integer(value) else float(value)
    if kind in ("layers", "layer_types"):
        return [int(v) if is_integer(v) else v for v in value]
    if kind == "token_ids" and isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    if kind == "token_ids":
        return int(value)
    return value


# rope_type -> the parameters its inverse frequencies need (edge/rope.py `rope_inv_freq`)
ROPE_PARAMETERS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    # NTK scaling that transformers applies only to sequences longer than max_position_embeddings,
    # which no session reaches (capacity <= context): within the context it is the default rope
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor",),  # as transformers requires
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "freq_factors": ("factors",),
}
# rope parameters that are lists of one positive divisor per rotary pair (head_dim / 2 values)
ROPE_FACTOR_LISTS = {"freq_factors": ("factors",), "longrope": ("short_factor", "long_factor")}
# optional numeric rope parameters and what they must be
ROPE_NUMBERS = {"factor": FieldRule("positive"), "low_freq_factor": FieldRule("positive"),
                "high_freq_factor": FieldRule("positive"),
                "original_max_position_embeddings": FieldRule("count", maximum=MAX_POSITIONS),
                "attention_factor": FieldRule("positive"), "beta_fast": FieldRule("positive"),
                "beta_slow": FieldRule("positive"), "mscale": FieldRule("non_negative"),
                "mscale_all_dim": FieldRule("non_negative")}


def _check_rope_scaling(spec: "LlamaSpec") -> None:
    scaling = spec.rope_scaling
    if scaling is None:
        return
    rope_type = scaling.get("rope_type", "default")
    if not isinstance(rope_type, str) or rope_type not in ROPE_PARAMETERS:
        raise UnsupportedModelError(
            f"rope_scaling.rope_type {show(rope_type)} is not supported; supported: {', '.join(ROPE_PARAMETERS)}")
    missing = [p for p in ROPE_PARAMETERS[rope_type] if scaling.get(p) is None]
    if missing:
        them = "it" if len(missing) == 1 else "them"
        raise ConversionError(f"rope_scaling of type {rope_type!r} needs {', '.join(missing)}; add {them} to the "
                              "config's rope_scaling (or rope_parameters)")
    for key, rule in ROPE_NUMBERS.items():
        if scaling.get(key) is not None:
            check_value(f"rope_scaling.{key}", scaling[key], rule, spec)
    if rope_type == "llama3" and scaling["low_freq_factor"] >= scaling["high_freq_factor"]:
        raise ConversionError(
            f"rope_scaling.low_freq_factor ({show(scaling['low_freq_factor'])}) must be below high_freq_factor "
            f"({show(scaling['high_freq_factor'])})")
    for key in ROPE_FACTOR_LISTS.get(rope_type, ()):
        factors, pairs = scaling[key], spec.head_dim // 2
        if not isinstance(factors, (list, tuple)):
            got = show(factors)
        elif len(factors) != pairs:
            got = f"{len(factors)} values"
        else:
            got = next((show(f) for f in factors if not (is_number(f) and f > 0)), None)
        if got is not None:
            raise ConversionError(f"rope_scaling.{key} must be {pairs} positive numbers (one per rotary pair of "
                                  f"head_dim {spec.head_dim}), got {got}")


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
    pad_token_id: int | list[int] | None = None

    # The field that counts a MoE layer's routed experts (None: a dense family)
    EXPERTS_FIELD: ClassVar[str | None] = None
    # Fields a converted config must give: they decide the weights' shapes, so no default can stand in
    # for them. Fields needed only by some layouts are added by `required_fields`.
    REQUIRED_FIELDS: ClassVar[tuple[str, ...]] = (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    # Each class lists its own fields; `field_rules` merges them along the class hierarchy.
    FIELD_RULES: ClassVar[dict[str, FieldRule]] = {
        "vocab_size": FieldRule("count", maximum=MAX_VOCAB),
        "hidden_size": FieldRule("count", maximum=MAX_WIDTH),
        "intermediate_size": FieldRule("count", maximum=MAX_WIDTH),
        "num_hidden_layers": FieldRule("count", maximum=MAX_LAYERS),
        "num_attention_heads": FieldRule("count", maximum=MAX_HEADS),
        "num_key_value_heads": FieldRule("count", nullable=True, maximum=MAX_HEADS),
        "head_dim": FieldRule("count", nullable=True, maximum=MAX_WIDTH),
        "max_position_embeddings": FieldRule("count", maximum=MAX_POSITIONS),
        "rms_norm_eps": FieldRule("positive", maximum=MAX_NORM_EPS),
        "rope_theta": FieldRule("positive"),
        "rope_scaling": FieldRule("rope_scaling", nullable=True),
        "tie_word_embeddings": FieldRule("flag"),
        "attention_bias": FieldRule("flag"),
        "mlp_bias": FieldRule("flag"),
        "hidden_act": FieldRule("text"),
        "bos_token_id": FieldRule("token_ids", nullable=True),
        "eos_token_id": FieldRule("token_ids", nullable=True),
        "pad_token_id": FieldRule("token_ids", nullable=True),
    }

    def __post_init__(self) -> None:
        self._check_fields()
        self._derive_fields()
        self._check_consistency()

    @classmethod
    def field_rules(cls) -> dict[str, FieldRule]:
        rules: dict[str, FieldRule] = {}
        for klass in reversed(cls.__mro__):
            rules.update(vars(klass).get("FIELD_RULES", {}))
        return rules

    def required_fields(self) -> tuple[str, ...]:
        """The fields a converted config must give (REQUIRED_FIELDS, and any this layout adds)."""
        return self.REQUIRED_FIELDS

    def _check_fields(self) -> None:
        """Each field's type and range, as FIELD_RULES says; values are normalised to plain Python types."""
        for name, rule in self.field_rules().items():
            value = getattr(self, name)
            if value is None and rule.nullable:
                continue
            # layer lists are checked against num_hidden_layers, which is checked before them
            check_value(name, value, rule, self)
            setattr(self, name, _normalized(value, rule.kind))

    def _derive_fields(self) -> None:
        """Fields transformers derives when the config leaves them out."""
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConversionError(
                    f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                    f"{self.num_attention_heads}, and the config gives no head_dim; fix num_attention_heads, "
                    "or give head_dim if the heads really are narrower")
            self.head_dim = self.hidden_size // self.num_attention_heads

    def _check_consistency(self) -> None:
        """What the fields must satisfy together."""
        self._check_activation()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConversionError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}); each KV head must serve a whole group of "
                "query heads: fix num_key_value_heads"
            )
        if self.head_dim % 2:
            raise ConversionError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        _check_rope_scaling(self)

    def _check_activation(self) -> None:
        if self.hidden_act not in ("silu", "swish"):
            raise UnsupportedModelError(
                f"hidden_act {self.hidden_act!r} is not supported for {self.model_type}; supported: silu"
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

    def rope_theta_for_layer(self, layer: int) -> float:
        """The rotary base of a layer's attention: rope_theta, with rope_scaling; a layer with another base
        (Gemma 3's sliding ones) rotates by it unscaled."""
        return self.rope_theta

    @property
    def attention_scale(self) -> float:
        """What the attention scores q . k are multiplied by."""
        return self.head_dim ** -0.5

    # The decoder layer's form. Llama's: x + attn(norm(x)), then x + ffn(norm(x)) with a SwiGLU
    # feed-forward, norms scaling by their weight. Gemma's differs in each of these (Gemma3TextSpec).
    @property
    def norm_offset(self) -> float:
        """RMSNorm scales by (norm_offset + weight): 0 for Llama, 1 for Gemma."""
        return 0.0

    @property
    def embedding_scale(self) -> float | None:
        """What the embedding rows are multiplied by (None: nothing)."""
        return None

    @property
    def sandwich_norms(self) -> bool:
        """True: the attention and feed-forward outputs are normalised again before the residual add."""
        return False

    @property
    def ffn_activation(self) -> str:
        """The gated feed-forward's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, tanh-approximated)."""
        return "silu"

    @property
    def llama_layers(self) -> bool:
        """Whether every layer has the Llama form (the fused executors of gpu and npu compose only that)."""
        return (self.norm_offset == 0 and self.embedding_scale is None and not self.sandwich_norms
                and self.ffn_activation == "silu"
                and all(self.rope_theta_for_layer(i) == self.rope_theta for i in range(self.num_hidden_layers)))

    def moe_for_layer(self, layer: int) -> "MoeConfig | None":
        """How the layer's feed-forward block routes to experts; None for a dense block."""
        return None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class MistralSpec(LlamaSpec):
    model_type: str = "mistral"
    sliding_window: int | None = None

    FIELD_RULES: ClassVar[dict[str, FieldRule]] = {
        "sliding_window": FieldRule("count", nullable=True, maximum=MAX_POSITIONS)}

    def _derive_fields(self) -> None:
        super()._derive_fields()
        # transformers' Mistral (and Mixtral) build every projection without a bias, whatever the
        # config says: an attention_bias / mlp_bias key there is ignored, so it is here
        self.attention_bias = self.mlp_bias = False

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

    FIELD_RULES: ClassVar[dict[str, FieldRule]] = {
        "use_sliding_window": FieldRule("flag"),
        "sliding_window": FieldRule("size", nullable=True, maximum=MAX_POSITIONS),  # 0 or null: no window
        "max_window_layers": FieldRule("size", maximum=MAX_LAYERS),
        "layer_types": FieldRule("layer_types", nullable=True),
    }

    def _derive_fields(self) -> None:
        super()._derive_fields()
        # transformers' Qwen2 has q/k/v biases always (qkv_bias), never an o_proj or MLP bias: its
        # config has no attention_bias / mlp_bias switch, and a key of that name is ignored
        self.attention_bias = self.mlp_bias = False

    def _check_consistency(self) -> None:
        super()._check_consistency()
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
    # transformers' Qwen3Config defaults head_dim to 128, not hidden_size / num_attention_heads
    DEFAULT_HEAD_DIM: ClassVar[int | None] = 128

    def _derive_fields(self) -> None:
        if self.head_dim is None and self.DEFAULT_HEAD_DIM is not None:
            self.head_dim = self.DEFAULT_HEAD_DIM
        attention_bias = self.attention_bias
        super()._derive_fields()
        # unlike Qwen2, q/k/v and o_proj biases follow attention_bias (as in Llama); the MLP has none
        self.attention_bias = attention_bias

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return True


@dataclass
class Gemma3TextSpec(LlamaSpec):
    """Gemma 3's text decoder (transformers' Gemma3TextConfig): embeddings scaled by sqrt(hidden_size),
    RMSNorm by (1 + weight), the attention and feed-forward outputs normalised again before each
    residual add, q/k norms per head, scores scaled by query_pre_attn_scalar ** -0.5, a GELU-tanh gated
    feed-forward, and sliding-window layers (all but every sliding_window_pattern-th, unless
    layer_types says) whose rotary base is rope_local_base_freq."""

    model_type: str = "gemma3_text"
    vocab_size: int = 262208
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int | None = 4
    head_dim: int | None = 256
    max_position_embeddings: int = 131072
    rope_theta: float = 1000000.0
    tie_word_embeddings: bool = True
    hidden_act: str = "gelu_pytorch_tanh"
    hidden_activation: str | None = "gelu_pytorch_tanh"
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    sliding_window_pattern: int = 6
    layer_types: list[str] | None = None
    rope_local_base_freq: float = 10000.0
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    use_bidirectional_attention: bool = False

    FIELD_RULES: ClassVar[dict[str, FieldRule]] = {
        "hidden_activation": FieldRule("text", nullable=True),
        "query_pre_attn_scalar": FieldRule("positive"),
        "sliding_window": FieldRule("size", nullable=True, maximum=MAX_POSITIONS),
        "sliding_window_pattern": FieldRule("count", maximum=MAX_LAYERS),
        "layer_types": FieldRule("layer_types", nullable=True),
        "rope_local_base_freq": FieldRule("positive"),
        "final_logit_softcapping": FieldRule("positive", nullable=True),
        "attn_logit_softcapping": FieldRule("positive", nullable=True),
        "use_bidirectional_attention": FieldRule("flag"),
    }
    ACTIVATIONS: ClassVar[tuple[str, ...]] = ("gelu_pytorch_tanh", "gelu_tanh")

    def _derive_fields(self) -> None:
        super()._derive_fields()
        if self.layer_types is None:  # transformers: every sliding_window_pattern-th layer attends globally
            self.layer_types = ["sliding_attention" if (i + 1) % self.sliding_window_pattern else "full_attention"
                                for i in range(self.num_hidden_layers)]

    def _check_activation(self) -> None:
        # transformers' Gemma 3 takes hidden_activation (hidden_act is an older name, read when it is absent)
        activation = self.hidden_activation or self.hidden_act
        if activation not in self.ACTIVATIONS:
            raise UnsupportedModelError(f"hidden_activation {activation!r} is not supported for {self.model_type}; "
                                        f"supported: {', '.join(self.ACTIVATIONS)}")

    def _check_consistency(self) -> None:
        super()._check_consistency()
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(self, name) is not None:
                raise UnsupportedModelError(f"{name} {show(getattr(self, name))} is not supported for "
                                            f"{self.model_type} (Gemma 2's tanh soft-capping is not implemented)")
        if self.use_bidirectional_attention:
            raise UnsupportedModelError(f"use_bidirectional_attention is not supported for {self.model_type}: "
                                        "zllm-edge runs causal decoders")
        check_layer_types(self)

    def sliding_window_for_layer(self, layer: int) -> int | None:
        if not self.sliding_window or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def rope_theta_for_layer(self, layer: int) -> float:
        return self.rope_local_base_freq if self.layer_types[layer] == "sliding_attention" else self.rope_theta

    @property
    def attention_scale(self) -> float:
        return float(self.query_pre_attn_scalar) ** -0.5

    @property
    def qk_norm(self) -> bool:
        return True

    @property
    def norm_offset(self) -> float:
        return 1.0

    @property
    def embedding_scale(self) -> float:
        return self.hidden_size ** 0.5

    @property
    def sandwich_norms(self) -> bool:
        return True

    @property
    def ffn_activation(self) -> str:
        return "gelu_tanh"


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
