"""A large random Mixture-of-Experts model: the I/O stress case of `zllm-edge bench --random-moe`.

A Mixtral-architecture Hugging Face folder (config from transformers' MixtralConfig, f16 weights
drawn from a fixed seed, one safetensors shard per layer so that no more than one layer is in memory
while it is written), converted with INT8 attention and INT4 experts like any other source. Many
experts, tens of MB of experts per layer, no tokenizer (the benchmark feeds token ids).

Random weights alone make a degenerate model: the layers' outputs swamp the embeddings and greedy
decoding repeats one token, so every step routes to the same experts. Here the embeddings are of
unit scale (they dominate the residual stream) and the LM head is the embedding matrix with its rows
permuted, so the greedy next token is roughly a fixed random permutation of the current one: decoding
walks a long cycle of unrelated tokens and the routes change at every step, with no transition from
one token's experts to the next one's for a predictor to learn. Only the gate lookahead (the later
routers read the same token-dominated residual) sees anything.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass

import numpy as np

RANDOM_MOE_SEED = 0
WEIGHT_STD = 0.02


@dataclass(frozen=True)
class RandomMoeShape:
    layers: int = 8
    experts: int = 64
    top_k: int = 4
    hidden: int = 1024
    expert_intermediate: int = 512
    heads: int = 8
    kv_heads: int = 2
    vocab: int = 4096
    context: int = 1024

    @property
    def name(self) -> str:
        return (f"random-moe-{self.layers}x{self.experts}e-top{self.top_k}-h{self.hidden}-i{self.expert_intermediate}"
                f"-v{self.vocab}")


def write_random_moe_folder(folder: str, shape: RandomMoeShape, seed: int = RANDOM_MOE_SEED) -> str:
    """Write the Hugging Face folder (config.json + one safetensors shard per layer) and return it."""
    from safetensors.numpy import save_file
    from transformers import MixtralConfig

    config = MixtralConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.expert_intermediate,
                           num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                           num_key_value_heads=shape.kv_heads, num_local_experts=shape.experts,
                           num_experts_per_tok=shape.top_k, max_position_embeddings=shape.context,
                           tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * WEIGHT_STD).astype(np.float16)

    def gain() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(shape.hidden, dtype=np.float32)).astype(np.float16)

    head_dim = shape.hidden // shape.heads
    shards = shape.layers + 1
    for layer in range(shape.layers):
        p = f"model.layers.{layer}."
        tensors = {p + "input_layernorm.weight": gain(), p + "post_attention_layernorm.weight": gain(),
                   p + "self_attn.q_proj.weight": matrix(shape.hidden, shape.hidden),
                   p + "self_attn.k_proj.weight": matrix(shape.kv_heads * head_dim, shape.hidden),
                   p + "self_attn.v_proj.weight": matrix(shape.kv_heads * head_dim, shape.hidden),
                   p + "self_attn.o_proj.weight": matrix(shape.hidden, shape.hidden),
                   # a router of unit-scale rows: logits spread over the experts instead of a near-uniform softmax
                   p + "block_sparse_moe.gate.weight": matrix(shape.experts, shape.hidden) * np.float16(50)}
        for expert in range(shape.experts):
            e = f"{p}block_sparse_moe.experts.{expert}."
            tensors[e + "w1.weight"] = matrix(shape.expert_intermediate, shape.hidden)
            tensors[e + "w3.weight"] = matrix(shape.expert_intermediate, shape.hidden)
            tensors[e + "w2.weight"] = matrix(shape.hidden, shape.expert_intermediate)
        save_file(tensors, os.path.join(folder, f"model-{layer + 1:05d}-of-{shards:05d}.safetensors"))
        del tensors
    embed = rng.standard_normal((shape.vocab, shape.hidden), dtype=np.float32).astype(np.float16)  # unit scale
    embeddings = {"model.embed_tokens.weight": embed, "model.norm.weight": gain(),
                  "lm_head.weight": embed[rng.permutation(shape.vocab)] * np.float16(WEIGHT_STD)}
    save_file(embeddings, os.path.join(folder, f"model-{shards:05d}-of-{shards:05d}.safetensors"))
    with open(os.path.join(folder, "random_moe.json"), "w") as f:
        json.dump({"shape": asdict(shape), "seed": seed, "weight_std": WEIGHT_STD}, f, indent=1)
    return folder


def random_moe_checkpoint(home: str, shape: RandomMoeShape = RandomMoeShape(), progress: bool = True) -> str:
    """The random MoE's checkpoint under `home`/models, built and converted on first use."""
    from converters.convert import QuantPlan, convert

    path = os.path.join(home, "models", shape.name)
    if os.path.isfile(os.path.join(path, "zllm.json")):
        return path
    folder = path + ".hf-source"
    print(f"building the random MoE {shape.name} into {path} (first use)", file=sys.stderr)
    try:
        write_random_moe_folder(folder, shape)
        plan = QuantPlan(weights="int8", overrides={"experts": "int4"})
        summary = convert(folder, path, plan, force=True, progress=progress)
        print(summary.format(), file=sys.stderr)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return path
