"""Mixture-of-Experts GGUF files: llama.cpp's expert layout -> our per-expert tensors and HF config fields.

llama.cpp stores a MoE layer's routed experts stacked, one tensor per projection:

    blk.L.ffn_gate_exps.weight   GGUF ne [D, I, E]  -> numpy [E, I, D]
    blk.L.ffn_up_exps.weight     GGUF ne [D, I, E]  -> numpy [E, I, D]
    blk.L.ffn_down_exps.weight   GGUF ne [I, D, E]  -> numpy [E, D, I]

(E = experts, I = expert intermediate size, D = hidden size). Older Mixtral files hold one 2-D
tensor per expert instead, `blk.L.ffn_gate.E.weight` / `ffn_up.E` / `ffn_down.E`. Either way each
expert becomes its own tensor `model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`, read as a
slice of the mmap'd stack so that one expert at a time is in memory.

GGUF architectures: "llama" with an expert count (Mixtral), "qwen2moe", "qwen3moe", "olmoe".
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from edge.core.arguments import is_integer, is_number
from edge.core.errors import ConversionError, UnsupportedModelError
from edge.core.spec_dense import MAX_LAYERS
from quant.expert_file import expert_tensor_name

# GGUF architecture -> our model_type, for architectures that are always MoE.
# "llama" with a nonzero {arch}.expert_count is Mixtral (llama.cpp writes Mixtral as "llama").
MOE_ARCHITECTURES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}
LLAMA_MOE_MODEL_TYPE = "mixtral"

# Whether top-k weights are renormalised when the file has no {arch}.expert_weights_norm key:
# llama.cpp hard-codes it per architecture (src/models/*.cpp, build_moe_ffn's norm_w argument).
DEFAULT_EXPERT_WEIGHTS_NORM = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}
GATING_SOFTMAX = 1  # gguf.ExpertGatingFuncType.SOFTMAX; every family here scores experts with a softmax

# llama.cpp MoE tensor names -> Hugging Face module names (gguf-py tensor_mapping.py, reversed).
MOE_LAYER_TENSORS = {
    "ffn_gate_inp": "mlp.gate",  # router: Mixtral block_sparse_moe.gate, Qwen-MoE / OLMoE mlp.gate
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",  # Qwen2-MoE shared expert
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # Qwen2-MoE shared expert's sigmoid gate
}
EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
STACKED_EXPERTS = re.compile(r"^blk\.(\d+)\.(ffn_gate_exps|ffn_up_exps|ffn_down_exps)\.weight$")
PER_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")  # older Mixtral files
ROUTER = re.compile(r"^blk\.(\d+)\.ffn_gate_inp\.weight$")


@dataclass(frozen=True)
class ExpertSlice:
    """One expert's projection: `tensor` (a GGUFReader tensor), indexed by `index` when it is a stack."""

    tensor: object
    index: int | None


def moe_model_type(arch: str, expert_count: int) -> str | None:
    """Our model_type for a MoE GGUF, or None when the file is a dense model."""
    if arch in MOE_ARCHITECTURES:
        return MOE_ARCHITECTURES[arch]
    if arch == "llama" and expert_count > 0:
        return LLAMA_MOE_MODEL_TYPE
    return None


def expert_slices(tensors: dict, file_name: str, arch: str, expert_count: int) -> dict[str, ExpertSlice]:
    """Our per-expert name -> ExpertSlice, for every routed expert in the file, after checking that each
    MoE layer (one with a router blk.L.ffn_gate_inp.weight) holds all its experts' gate, up and down.

    tensors: GGUF tensor name -> GGUFReader tensor."""
    layers: dict[int, dict[str, ExpertSlice]] = {}
    for name, tensor in tensors.items():
        stacked, single = STACKED_EXPERTS.match(name), PER_EXPERT.match(name)
        if stacked:
            layer, projection = int(stacked[1]), EXPERT_STACKS[stacked[2]]
            if len(tensor.shape) != 3:
                raise ConversionError(
                    f"{file_name}: {name} has GGUF shape {list(map(int, tensor.shape))}; stacked experts are 3-D "
                    "[D, I, E]; export the GGUF file again")
            n_stacked = int(tensor.shape[-1])  # GGUF lists the expert count last
            if n_stacked != expert_count:
                raise ConversionError(
                    f"{file_name}: {name} stacks {n_stacked} experts (GGUF shape {list(map(int, tensor.shape))}) "
                    f"but {arch}.expert_count is {expert_count}; the metadata and the tensors disagree, "
                    "export the GGUF file again")
            for expert in range(n_stacked):
                layers.setdefault(layer, {})[expert_tensor_name(layer, expert, projection)] = ExpertSlice(tensor, expert)
        elif single:
            layer, projection, expert = int(single[1]), f"{single[2]}_proj", int(single[3])
            if expert >= expert_count:
                raise ConversionError(
                    f"{file_name}: {name} is expert {expert} but {arch}.expert_count is {expert_count}; "
                    "the metadata and the tensors disagree, export the GGUF file again")
            layers.setdefault(layer, {})[expert_tensor_name(layer, expert, projection)] = ExpertSlice(tensor, None)
    routers = {int(match[1]) for match in map(ROUTER.match, tensors) if match}
    for layer in sorted(routers | set(layers)):
        router = f"blk.{layer}.ffn_gate_inp.weight"
        if layer not in routers:
            raise ConversionError(
                f"{file_name}: layer {layer} holds routed experts but no router {router}; "
                "export the GGUF file again")
        n_routed = int(tensors[router].shape[-1])  # router rows = experts
        if n_routed != expert_count:
            raise ConversionError(
                f"{file_name}: {router} routes to {n_routed} experts but {arch}.expert_count is {expert_count}; "
                "the metadata and the tensors disagree, export the GGUF file again")
        present = layers.get(layer, {})
        missing = [expert_tensor_name(layer, e, p) for e in range(expert_count) for p in EXPERT_STACKS.values()
                   if expert_tensor_name(layer, e, p) not in present]
        if missing:
            stacks = ", ".join(f"blk.{layer}.{s}.weight" for s in EXPERT_STACKS)
            raise ConversionError(
                f"{file_name}: MoE layer {layer} lacks {len(missing)} expert weights, e.g. {missing[0]}; "
                f"a MoE layer needs the stacked experts {stacks} "
                f"(or blk.{layer}.ffn_gate.E.weight, ffn_up.E, ffn_down.E for every expert E)")
    return {name: part for layer_parts in layers.values() for name, part in layer_parts.items()}


def moe_config_fields(model_type: str, arch: str, meta, config: dict, has_tensor) -> dict:
    """The HF config fields of a MoE family, from llama.cpp's metadata keys.

    meta(key, default): the value of `{arch}.key`; config: the dense fields already read (hidden
    size, feed_forward_length as intermediate_size, layer count); has_tensor(hf_name): whether the
    file holds that tensor (after renaming)."""
    def integer(key: str, default: int | None = None, minimum: int = 0) -> int | None:
        value = meta(key, default)
        if value is not None and not is_integer(value, minimum):
            raise ConversionError(f"GGUF key '{arch}.{key}' is {value!r}; expected an integer >= {minimum}")
        return value

    expert_count = integer("expert_count", 0)
    used = integer("expert_used_count", minimum=1)
    if used is None:
        raise ConversionError(f"the GGUF file has {arch}.expert_count {expert_count} but no {arch}.expert_used_count; "
                              "export the GGUF file again")
    gating = integer("expert_gating_func")
    if gating is not None and gating != GATING_SOFTMAX:
        raise UnsupportedModelError(
            f"GGUF {arch}.expert_gating_func {gating} is not supported for {model_type}; "
            f"supported: {GATING_SOFTMAX} (softmax)")
    norm_topk_prob = bool(meta("expert_weights_norm", DEFAULT_EXPERT_WEIGHTS_NORM[arch]))
    expert_size = integer("expert_feed_forward_length", config["intermediate_size"], minimum=1)
    if config["num_hidden_layers"] > MAX_LAYERS:  # the spec refuses it too, but only after these loops ran
        raise ConversionError(f"GGUF key '{arch}.block_count' is {config['num_hidden_layers']}; expected at most "
                              f"{MAX_LAYERS} (far above any real model's)")
    # llama.cpp puts no sparse step in the file: a layer without a router keeps its dense FFN.
    dense_layers = [layer for layer in range(config["num_hidden_layers"])
                    if not has_tensor(f"model.layers.{layer}.mlp.gate.weight")]
    if model_type == LLAMA_MOE_MODEL_TYPE:
        if not norm_topk_prob or dense_layers:
            raise UnsupportedModelError(
                f"a llama GGUF with experts is read as Mixtral, which renormalises top-k weights in every layer; "
                f"this file has expert_weights_norm {norm_topk_prob} and dense layers {dense_layers}")
        return {"num_local_experts": expert_count, "num_experts_per_tok": used, "intermediate_size": expert_size}
    fields = {"num_experts": expert_count, "num_experts_per_tok": used, "norm_topk_prob": norm_topk_prob}
    if model_type == "olmoe":
        if dense_layers:
            raise UnsupportedModelError(f"OLMoE has a MoE block in every layer; this GGUF has dense layers {dense_layers}")
        clamp = meta("attention.clamp_kqv")
        if clamp is not None and not (is_number(clamp) and clamp > 0):
            raise ConversionError(f"GGUF key '{arch}.attention.clamp_kqv' is {clamp!r}; expected a positive number")
        return {**fields, "intermediate_size": expert_size, "clip_qkv": None if clamp is None else float(clamp)}
    fields.update(moe_intermediate_size=expert_size, decoder_sparse_step=1, mlp_only_layers=dense_layers)
    if model_type == "qwen2_moe":
        shared = integer("expert_shared_feed_forward_length", 0)
        if shared == 0 and any(has_tensor(f"model.layers.{layer}.mlp.shared_expert.up_proj.weight")
                               for layer in range(config["num_hidden_layers"])):
            raise ConversionError(f"the GGUF file holds shared experts (ffn_*_shexp) but no "
                                  f"{arch}.expert_shared_feed_forward_length; export the GGUF file again")
        fields.update(shared_expert_intermediate_size=shared,
                      qkv_bias=has_tensor("model.layers.0.self_attn.q_proj.bias"))
    return fields
