"""Tiny GGUF files for tests, written with gguf.GGUFWriter the way llama.cpp's convert_hf_to_gguf.py
writes them: llama.cpp tensor names, experts stacked per projection, q/k rows permuted for the
llama architecture, metadata under `{arch}.` keys, and a minimal byte-level (gpt2) tokenizer.

    writer = gguf.GGUFWriter(path, "llama"); add_byte_level_tokenizer(writer, 260); ...; finish(writer)
    write_hf_model_gguf(hf_model, path, "qwen3moe", qtype_for=lambda name, values: Q.Q8_0)
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType

F32 = GGMLQuantizationType.F32


def byte_alphabet() -> list[str]:
    """The 256 symbols GPT-2's byte-level BPE spells bytes with, printable ones first."""
    alphabet = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    alphabet += [chr(c) for c in range(ord("¡"), ord("¬") + 1)] + [chr(c) for c in range(ord("®"), ord("ÿ") + 1)]
    return alphabet + [chr(256 + n) for n in range(256 - len(alphabet))]


def add_byte_level_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """A gpt2 tokenizer of `vocab_size` tokens: byte symbols (as many as fit), two merges ("th", "the"),
    filler tokens up to the size, and a control end-of-text token, which is the last id."""
    symbols = byte_alphabet()[: vocab_size - 3]
    fillers = [f"<unused{i}>" for i in range(vocab_size - 3 - len(symbols))]
    tokens = symbols + ["th", "the"] + fillers + ["<|endoftext|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (vocab_size - 1) + [gguf.TokenType.CONTROL])
    writer.add_token_merges(["t h", "th e"])
    writer.add_eos_token_id(vocab_size - 1)


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_cpp_permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute`: Hugging Face q/k rows -> GGUF rows.

    Hugging Face rotates the two halves of each head (rotate_half); llama.cpp rotates adjacent
    pairs, so its converter interleaves each head's rows. zllm's converter undoes this on import
    (converters/gguf_source.py), so the checkpoint holds q/k rows in Hugging Face order; applying
    this permutation to the checkpoint's rows brings them back to the GGUF order for comparison.
    """
    n = rows.shape[0]
    return rows.reshape(n_head, 2, n // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


# Hugging Face module names -> llama.cpp names (gguf-py tensor_mapping.py), per decoder layer.
HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# Gemma 3's names where they differ from the Llama lineage's, and its norms' shift (llama.cpp writes 1 + w)
HF_TO_GGUF_GEMMA3 = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                     "post_feedforward_layernorm": "post_ffw_norm"}
HF_TO_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}


def gguf_tensors_from_hf(model, arch: str, per_expert: bool = False) -> dict[str, np.ndarray]:
    """A transformers model's weights under llama.cpp names, as convert_hf_to_gguf.py lays them out.

    Experts (transformers' stacked gate_up_proj [E, 2I, D] and down_proj [E, D, I]) become
    blk.L.ffn_{gate,up,down}_exps [E, I, D] / [E, D, I], or with `per_expert` one 2-D tensor per
    expert, blk.L.ffn_{gate,up,down}.E (older Mixtral files)."""
    config = model.config
    out: dict[str, np.ndarray] = {}
    for name, tensor in model.state_dict().items():
        values = tensor.detach().numpy().astype(np.float32)
        if arch == "gemma3" and name.endswith("norm.weight"):
            values = values + np.float32(1.0)
        if name in HF_TO_GGUF_GLOBAL:
            if not (name == "lm_head.weight" and config.tie_word_embeddings):
                out[HF_TO_GGUF_GLOBAL[name]] = values
            continue
        _, _, layer, rest = name.split(".", 3)
        prefix = f"blk.{layer}."
        if rest == "mlp.experts.gate_up_proj":
            rows = values.shape[1] // 2
            stacks = {"gate": values[:, :rows], "up": values[:, rows:]}
        elif rest == "mlp.experts.down_proj":
            stacks = {"down": values}
        else:
            module, suffix = rest.rsplit(".", 1)
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = config.num_attention_heads if module.endswith("q_proj") else config.num_key_value_heads
                values = llama_cpp_permute(values, heads)
            if module == "mlp.shared_expert_gate":
                values = values.reshape(-1)  # llama.cpp reads it as a vector of hidden size
            names = {**HF_TO_GGUF_LAYER, **HF_TO_GGUF_GEMMA3} if arch == "gemma3" else HF_TO_GGUF_LAYER
            out[f"{prefix}{names[module]}.{suffix}"] = values
            continue
        for projection, stack in stacks.items():
            if per_expert:
                for expert, matrix in enumerate(stack):
                    out[f"{prefix}ffn_{projection}.{expert}.weight"] = np.ascontiguousarray(matrix)
            else:
                out[f"{prefix}ffn_{projection}_exps.weight"] = np.ascontiguousarray(stack)
    return out


def add_hf_metadata(writer: gguf.GGUFWriter, config) -> None:
    """The metadata convert_hf_to_gguf.py writes for a transformers config (dense and MoE keys)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    if "full_attention" in rope:  # Gemma 3: the global layers' rope; the sliding ones' base is not written
        rope = rope["full_attention"]
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config.layer_types])
        if rope.get("rope_type", "default") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_vocab_size(config.vocab_size)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if getattr(config, "norm_topk_prob", None) is not None:
        writer.add_expert_weights_norm(bool(config.norm_topk_prob))
    if getattr(config, "clip_qkv", None) is not None:
        writer.add_clamp_kqv(float(config.clip_qkv))


def write_hf_model_gguf(model, path: Path, arch: str,
                        qtype_for: Callable[[str, np.ndarray], GGMLQuantizationType] = lambda name, values: F32,
                        per_expert: bool = False, edit: Callable[[dict[str, np.ndarray]], None] | None = None,
                        blocks_for: Callable[[np.ndarray, GGMLQuantizationType], np.ndarray] = gguf.quants.quantize
                        ) -> Path:
    """Write a transformers model as a GGUF of architecture `arch`; `qtype_for(gguf_name, values)` picks
    each tensor's type (1-D tensors stay F32); `edit` may change the tensors before they are written;
    `blocks_for(values, qtype)` makes a quantized tensor's blocks (gguf's quantizer: the types it has)."""
    tensors = gguf_tensors_from_hf(model, arch, per_expert)
    if edit is not None:
        edit(tensors)
    writer = gguf.GGUFWriter(str(path), arch)
    add_hf_metadata(writer, model.config)
    add_byte_level_tokenizer(writer, model.config.vocab_size)
    for name, values in tensors.items():
        qtype = F32 if values.ndim == 1 else qtype_for(name, values)
        if qtype == F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, blocks_for(values, qtype), raw_dtype=qtype)
    finish(writer)
    return Path(path)
