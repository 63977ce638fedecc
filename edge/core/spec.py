"""Model specs: one dataclass per family, fields named exactly as in Hugging Face config.json.

`spec_from_dict` picks the family by `model_type` through a small alias table and ignores
keys it does not know, so a config.json written by any transformers version loads; each family's
dataclass checks its fields' types and ranges (edge/core/spec_dense.py FIELD_RULES).

`spec_tensor_shapes` is the one table of every weight a spec declares and the shape it must have,
[out, in] for matrices; the converter checks a source's tensors against it before writing anything,
and the checkpoint reader checks a checkpoint's tensors against it before the model uses them.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Mapping, NamedTuple

from edge.core.errors import ConversionError, UnsupportedModelError, ZllmError
from edge.core.moe import MoeConfig

# The families' dataclasses live beside this module; edge.spec is where the rest of the code imports them from.
from edge.core.spec_dense import Gemma3TextSpec, LlamaSpec, MistralSpec, Qwen2Spec, Qwen3Spec, show  # noqa: F401
from edge.core.spec_moe import (
    DeepseekV2Spec,
    DeepseekV3Spec,
    LlamaMoeSpec,
    MixtralSpec,
    OlmoeSpec,
    Qwen2MoeSpec,
    Qwen3MoeSpec,
)

SPEC_CLASSES: dict[str, type[LlamaSpec]] = {
    "llama": LlamaSpec,
    "mistral": MistralSpec,
    "qwen2": Qwen2Spec,
    "qwen3": Qwen3Spec,
    "gemma3_text": Gemma3TextSpec,
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
    # transformers < 4.53 wrote the pattern without its underscore, later ones with it
    "gemma3_text": {"_sliding_window_pattern": "sliding_window_pattern"},
}
MODEL_TYPE_ALIASES: dict[str, str] = {
    "smollm2": "llama",
}
SUPPORTED_MODEL_TYPES = sorted(SPEC_CLASSES)


def _normalize_rope(config: dict[str, Any]) -> dict[str, Any]:
    """transformers >= 5 writes `rope_parameters` (theta inside); older writes rope_theta + rope_scaling."""
    config = dict(config)
    for key in ("rope_parameters", "rope_scaling"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise ConversionError(f"{key} must be an object or null, got {show(config[key])}")
    rope = config.pop("rope_parameters", None)
    if rope and set(rope) <= {"full_attention", "sliding_attention"}:
        rope = _split_rope_by_layer_type(config, rope)
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
        if scaling["rope_type"] in ("llama3", "yarn", "longrope"):
            # transformers (`standardize_rope_params`, run before a config's extra keys become attributes):
            # max_position_embeddings stands in; a top-level original_max_position_embeddings key is ignored
            scaling.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
        config["rope_scaling"] = None if scaling["rope_type"] == "default" and len(scaling) == 1 else scaling
    return config


def _split_rope_by_layer_type(config: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any] | None:
    """transformers >= 5 gives Gemma 3 one rope_parameters per layer type: the full-attention layers'
    become rope_theta and rope_scaling, the sliding layers' base rope_local_base_freq (those rotate unscaled)."""
    for layer_type, parameters in rope.items():
        if not isinstance(parameters, dict):
            raise ConversionError(f"rope_parameters.{layer_type} must be an object, got {show(parameters)}")
    local = dict(rope.get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default" or set(local) - {"rope_type", "rope_theta"}:
        raise UnsupportedModelError(f"rope_parameters.sliding_attention {show(local)} is not supported: sliding "
                                    "layers rotate by the default rope of their own base")
    if "rope_theta" in local:
        config["rope_local_base_freq"] = local["rope_theta"]
    return dict(rope.get("full_attention") or {}) or None


# Families whose configs we recognise but whose attention we do not implement, and why.
UNSUPPORTED_FEATURES: dict[str, str] = {
    "gpt_oss": "its attention sinks (a learned per-head logit in every softmax) are not implemented",
    "gemma3": "this is Gemma 3's multimodal config (a vision tower beside the text decoder); convert a text-only "
              "checkpoint (model_type gemma3_text) or its GGUF",
}


def spec_from_dict(config: dict[str, Any], where: str | None = None, strict: bool = False) -> LlamaSpec:
    """Build the family's spec from a config.json dict (unknown keys are ignored).

    A malformed value is a ConversionError naming the field, prefixed with `where` (e.g. the path of
    config.json); a well-formed value naming something not implemented is an UnsupportedModelError.
    `strict` is for a model being converted: the fields that decide the weights' shapes must be given
    (REQUIRED_FIELDS), not taken from defaults, every MoE layer's routing is checked, and the special
    tokens must lie in the vocabulary."""
    prefix = f"{where}: " if where else ""
    if not isinstance(config, dict):
        raise ConversionError(f"{prefix}the config must be a JSON object, got {show(config)[:80]}")
    model_type = config.get("model_type")
    if model_type is None:
        raise UnsupportedModelError(
            f"config has no model_type; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if not isinstance(model_type, str):
        raise ConversionError(f"{prefix}model_type must be a string, got {show(model_type)}; supported model types: "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)}")
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
    try:
        config = _normalize_rope(config)
        for alias, field_name in FIELD_ALIASES.get(family, {}).items():
            if config.get(field_name) is None and config.get(alias) is not None:
                config[field_name] = config[alias]
        known = {f.name for f in dataclasses.fields(spec_class)}
        values = {k: v for k, v in config.items() if k in known and v is not None}
        values["model_type"] = family
        try:
            spec = spec_class(**values)
        except TypeError as exc:
            raise UnsupportedModelError(f"config for {model_type!r} is malformed: {exc}") from None
        except ConversionError as exc:
            # a value that defaults stood in for may be what is wrong: name what is missing first
            if strict and not isinstance(exc, UnsupportedModelError):
                _require(spec_class.REQUIRED_FIELDS, values, family)
            raise
        if strict:
            _require(spec_class.REQUIRED_FIELDS, values, family)
            for layer in range(spec.num_hidden_layers):
                spec.moe_for_layer(layer)  # MoeConfig checks the routing (top-k within the experts, groups)
            _require(spec.required_fields(), values, family)
            _check_special_tokens(spec)
    except ZllmError as exc:
        # what is unsupported is the model's, not the file's: those messages stand alone (e.g. model_type's)
        if not prefix or isinstance(exc, UnsupportedModelError):
            raise
        raise type(exc)(prefix + str(exc)) from None
    return spec


def _check_special_tokens(spec: LlamaSpec) -> None:
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(spec, key)
        problem = tokens_outside_vocab(key, value if isinstance(value, list) else [] if value is None else [value],
                                       spec.vocab_size)
        if problem:
            raise ConversionError(problem)


def tokens_outside_vocab(key: str, ids: list[int], vocab_size: int) -> str | None:
    """What is wrong when token id field `key` names an id beyond the vocabulary; None when none does."""
    outside = next((token for token in ids if token >= vocab_size), None)
    if outside is None:
        return None
    return f"{key} {outside} is not a token of the model: vocab_size is {vocab_size}; fix {key} (or vocab_size)"


def _require(fields: tuple[str, ...], values: dict[str, Any], family: str) -> None:
    missing = [name for name in fields if values.get(name) is None]
    if missing:
        raise ConversionError(
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing; a {family} config must give "
            f"{'it' if len(missing) == 1 else 'them'}: the weights' shapes depend on "
            f"{'it' if len(missing) == 1 else 'them'}, so no default can stand in")


# --- the weights a spec declares, and their shapes -------------------------------------------------
# D = hidden_size, V = vocab_size, I = intermediate size, Hq / Hkv = query / KV heads, Dh = head_dim,
# E = routed experts; MLA: H heads, Dn / R / Dv = nope / rope / value head dims, C = kv_lora_rank,
# Q = q_lora_rank. Matrices are [out, in], as in Hugging Face checkpoints.


class ExpectedShape(NamedTuple):
    shape: tuple[int, ...]
    because: str  # the config values that decide it, for messages: "hidden_size 64, 2 KV heads of 16"


def _matrix(rows: int, cols: int, because: str) -> ExpectedShape:
    return ExpectedShape((rows, cols), because)


def _vector(size: int, because: str) -> ExpectedShape:
    return ExpectedShape((size,), because)


def spec_layer_tensors(spec: LlamaSpec, layer: int) -> dict[str, ExpectedShape]:
    """Every weight a decoder layer of this spec owns (routed experts aside), in checkpoint order."""
    prefix = f"model.layers.{layer}."
    hidden = _vector(spec.hidden_size, f"hidden_size {spec.hidden_size}")
    tensors = {prefix + "input_layernorm.weight": hidden}
    if spec.attention_kind == "mla":
        tensors.update(mla_tensors(spec, prefix + "self_attn."))
    else:
        tensors.update(gqa_tensors(spec, prefix + "self_attn."))
    tensors[prefix + "post_attention_layernorm.weight"] = hidden
    if spec.sandwich_norms:  # Gemma: post_attention_layernorm normalises the attention's output
        tensors[prefix + "pre_feedforward_layernorm.weight"] = hidden
        tensors[prefix + "post_feedforward_layernorm.weight"] = hidden
    moe = spec.moe_for_layer(layer)
    if moe is not None:
        tensors.update(moe_block_tensors(spec, moe, prefix + "mlp."))
    else:
        tensors.update(ffn_tensors(spec.hidden_size, spec.intermediate_size, "intermediate_size", prefix + "mlp.",
                                   spec.mlp_bias))
    return tensors


def ffn_tensors(hidden: int, intermediate: int, intermediate_name: str, prefix: str,
                bias: bool = False) -> dict[str, ExpectedShape]:
    """A SwiGLU feed-forward block: gate_proj and up_proj [I, D], down_proj [D, I] (and their biases)."""
    because = f"hidden_size {hidden}, {intermediate_name} {intermediate}"
    tensors = {}
    for proj, rows, cols in (("gate_proj", intermediate, hidden), ("up_proj", intermediate, hidden),
                             ("down_proj", hidden, intermediate)):
        tensors[prefix + f"{proj}.weight"] = _matrix(rows, cols, because)
        if bias:
            tensors[prefix + f"{proj}.bias"] = _vector(rows, because)
    return tensors


def moe_block_tensors(spec: LlamaSpec, moe: MoeConfig, prefix: str) -> dict[str, ExpectedShape]:
    """The non-expert weights of a MoE block (router, shared experts); routed experts live in experts.bin."""
    experts = f"{moe.num_experts} routed experts"
    tensors = {prefix + "gate.weight": _matrix(moe.num_experts, spec.hidden_size,
                                               f"{experts}, hidden_size {spec.hidden_size}")}
    if moe.score_correction_bias:
        tensors[prefix + "gate.e_score_correction_bias"] = _vector(moe.num_experts, experts)
    if moe.shared_intermediate_size:
        tensors.update(ffn_tensors(spec.hidden_size, moe.shared_intermediate_size, "shared experts' intermediate size",
                                   prefix + f"{moe.shared_expert_name}."))
        if moe.shared_expert_gate:
            tensors[prefix + "shared_expert_gate.weight"] = _matrix(1, spec.hidden_size,
                                                                    f"hidden_size {spec.hidden_size}")
    return tensors


def spec_expert_tensors(spec: LlamaSpec, first_only: bool = False) -> dict[int, list[dict[str, ExpectedShape]]]:
    """Routed expert weights by MoE layer: layer -> per expert, its {gate_proj, up_proj, down_proj} names and
    shapes; `first_only`: expert 0's alone (every expert of a layer has the same shapes)."""
    experts = {}
    for layer in range(spec.num_hidden_layers):
        moe = spec.moe_for_layer(layer)
        if moe is not None:
            experts[layer] = [ffn_tensors(spec.hidden_size, moe.intermediate_size, "expert intermediate size",
                                          f"model.layers.{layer}.mlp.experts.{e}.")
                              for e in range(1 if first_only else moe.num_experts)]
    return experts


def spec_expert_tensor_names(spec: LlamaSpec) -> dict[int, list[list[str]]]:
    """Routed expert weights by MoE layer: layer -> per expert, its [gate_proj, up_proj, down_proj] names."""
    return {layer: [list(expert) for expert in experts] for layer, experts in spec_expert_tensors(spec).items()}


def spec_optional_tensors(spec: LlamaSpec) -> dict[str, ExpectedShape]:
    """Weights a checkpoint of this spec may carry or omit: a MoEfied router's fitted intercept."""
    if spec.model_type != "llama_moe":
        return {}
    return {f"model.layers.{layer}.mlp.gate.bias": _vector(moe.num_experts, f"{moe.num_experts} routed experts")
            for layer in range(spec.num_hidden_layers) if (moe := spec.moe_for_layer(layer)) is not None}


def spec_optional_tensor_names(spec: LlamaSpec) -> list[str]:
    """Weights a checkpoint of this spec may carry or omit: a MoEfied router's fitted intercept."""
    return list(spec_optional_tensors(spec))


def gqa_tensors(spec: LlamaSpec, prefix: str) -> dict[str, ExpectedShape]:
    """The attention weights of one MHA/GQA/MQA layer."""
    d, dh = spec.hidden_size, spec.head_dim
    heads = {"q_proj": (spec.num_attention_heads, f"{spec.num_attention_heads} heads of {dh}"),
             "k_proj": (spec.num_key_value_heads, f"{spec.num_key_value_heads} KV heads of {dh}"),
             "v_proj": (spec.num_key_value_heads, f"{spec.num_key_value_heads} KV heads of {dh}")}
    tensors = {}
    for proj, (n_heads, because) in heads.items():
        tensors[prefix + f"{proj}.weight"] = _matrix(n_heads * dh, d, f"hidden_size {d}, {because}")
        if spec.qkv_bias:
            tensors[prefix + f"{proj}.bias"] = _vector(n_heads * dh, because)
    if spec.qk_norm and spec.qk_norm_over_projection:  # OLMoE: over the whole q / k projection
        tensors[prefix + "q_norm.weight"] = _vector(spec.num_attention_heads * dh, heads["q_proj"][1])
        tensors[prefix + "k_norm.weight"] = _vector(spec.num_key_value_heads * dh, heads["k_proj"][1])
    elif spec.qk_norm:  # Qwen3: over each head
        tensors[prefix + "q_norm.weight"] = tensors[prefix + "k_norm.weight"] = _vector(dh, f"head_dim {dh}")
    tensors[prefix + "o_proj.weight"] = _matrix(d, spec.num_attention_heads * dh,
                                                f"hidden_size {d}, {heads['q_proj'][1]}")
    if spec.attention_bias:
        tensors[prefix + "o_proj.bias"] = _vector(d, f"hidden_size {d}")
    return tensors


def mla_tensors(spec: DeepseekV2Spec, prefix: str) -> dict[str, ExpectedShape]:
    """The attention weights of one MLA layer (transformers' DeepseekV2Attention / V3)."""
    d, heads, rank, rope = spec.hidden_size, spec.num_attention_heads, spec.kv_lora_rank, spec.qk_rope_head_dim
    nope, v = spec.qk_nope_head_dim, spec.v_head_dim
    q_rows = heads * (nope + rope)
    q_heads = f"{heads} heads of qk_nope_head_dim {nope} + qk_rope_head_dim {rope}"
    latent = f"kv_lora_rank {rank} + qk_rope_head_dim {rope}"
    tensors = {}
    if spec.q_lora_rank is None:
        tensors[prefix + "q_proj.weight"] = _matrix(q_rows, d, f"hidden_size {d}, {q_heads}")
    else:
        q_rank = spec.q_lora_rank
        tensors[prefix + "q_a_proj.weight"] = _matrix(q_rank, d, f"hidden_size {d}, q_lora_rank {q_rank}")
        if spec.attention_bias:
            tensors[prefix + "q_a_proj.bias"] = _vector(q_rank, f"q_lora_rank {q_rank}")
        tensors[prefix + "q_a_layernorm.weight"] = _vector(q_rank, f"q_lora_rank {q_rank}")
        tensors[prefix + "q_b_proj.weight"] = _matrix(q_rows, q_rank, f"q_lora_rank {q_rank}, {q_heads}")
    tensors[prefix + "kv_a_proj_with_mqa.weight"] = _matrix(rank + rope, d, f"hidden_size {d}, {latent}")
    if spec.attention_bias:
        tensors[prefix + "kv_a_proj_with_mqa.bias"] = _vector(rank + rope, latent)
    tensors[prefix + "kv_a_layernorm.weight"] = _vector(rank, f"kv_lora_rank {rank}")
    tensors[prefix + "kv_b_proj.weight"] = _matrix(
        heads * (nope + v), rank, f"kv_lora_rank {rank}, {heads} heads of qk_nope_head_dim {nope} + v_head_dim {v}")
    tensors[prefix + "o_proj.weight"] = _matrix(d, heads * v, f"hidden_size {d}, {heads} heads of v_head_dim {v}")
    if spec.attention_bias:
        tensors[prefix + "o_proj.bias"] = _vector(d, f"hidden_size {d}")
    return tensors


def spec_dense_tensors(spec: LlamaSpec) -> dict[str, ExpectedShape]:
    """Every weight of the spec that is not a routed expert or optional, in checkpoint order."""
    embeddings = _matrix(spec.vocab_size, spec.hidden_size,
                         f"vocab_size {spec.vocab_size}, hidden_size {spec.hidden_size}")
    tensors = {"model.embed_tokens.weight": embeddings}
    for layer in range(spec.num_hidden_layers):
        tensors.update(spec_layer_tensors(spec, layer))
    tensors["model.norm.weight"] = _vector(spec.hidden_size, f"hidden_size {spec.hidden_size}")
    if not spec.tie_word_embeddings:
        tensors["lm_head.weight"] = embeddings
    return tensors


# our names of a layer's tensors and of its routed experts': model.layers.L.... and model.layers.L.mlp.experts.E....
_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(?:mlp\.experts\.(\d+)\.)?")


def counts_beyond_tensors(spec: LlamaSpec, names: Iterable[str]) -> str | None:
    """What the spec counts beyond the tensors named `names`: more layers than they hold, or a MoE layer
    with more routed experts than they hold for it; None when neither. Checked before anything lists the
    spec's tensors, a list that grows with layers times experts."""
    experts: dict[str, set[str]] = {}  # layer -> its routed experts, as the names spell them
    for name in names:
        match = _LAYER_TENSOR.match(name)
        if match:
            found = experts.setdefault(match[1], set())
            if match[2] is not None:
                found.add(match[2])
    if spec.num_hidden_layers > len(experts):
        return (f"num_hidden_layers is {spec.num_hidden_layers}, but the weights hold the tensors of {len(experts)} "
                "layers")
    for layer in range(spec.num_hidden_layers):
        moe, held = spec.moe_for_layer(layer), len(experts.get(str(layer), ()))
        if moe is not None and moe.num_experts > held:
            return (f"{spec.EXPERTS_FIELD} is {moe.num_experts}, but the weights hold {held} routed experts for "
                    f"layer {layer}")
    return None


def spec_tensor_names(spec: LlamaSpec) -> list[str]:
    return list(spec_dense_tensors(spec))


def spec_tensor_shapes(spec: LlamaSpec, first_expert_only: bool = False) -> dict[str, ExpectedShape]:
    """Every weight name the spec declares (dense, optional and routed experts; of the experts, only
    each layer's expert 0 with `first_expert_only`) -> the shape it must have."""
    shapes = {**spec_dense_tensors(spec), **spec_optional_tensors(spec)}
    for experts in spec_expert_tensors(spec, first_expert_only).values():
        for expert in experts:
            shapes.update(expert)
    return shapes


def shape_mismatches(spec: LlamaSpec, shapes: Mapping[str, tuple[int, ...]], first_expert_only: bool = False
                     ) -> list[str]:
    """For each tensor in `shapes` (name -> shape) whose shape the spec does not allow, what is wrong:
    "tensor NAME has shape [a, b]; the config (hidden_size 64, ...) needs [c, d]". Names the spec does
    not declare are not this function's business (the callers list them). Of the routed experts, a
    checkpoint (one layout per layer) shows expert 0 only: `first_expert_only` spares building the rest."""
    expected = spec_tensor_shapes(spec, first_expert_only)
    problems = []
    for name, shape in shapes.items():
        want = expected.get(name)
        if want is not None and tuple(int(d) for d in shape) != want.shape:
            problems.append(f"tensor {name} has shape {list(shape)}; the config ({want.because}) "
                            f"needs {list(want.shape)}")
    return problems


def widest_ffn(spec) -> int:
    """The widest feed-forward intermediate of any layer: dense, or a MoE layer's expert with its shared experts."""
    moe = (spec.moe_for_layer(i) for i in range(spec.num_hidden_layers))
    return max([spec.intermediate_size] + [m.intermediate_size + m.shared_intermediate_size
                                           for m in moe if m is not None])


def widest_projection_input(spec) -> int:
    """The widest input any projection takes: the hidden size, the attention output or the widest FFN."""
    return max(spec.hidden_size, spec.num_attention_heads * spec.head_dim, widest_ffn(spec))
