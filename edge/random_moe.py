"""Large random Mixture-of-Experts models: `zllm-edge bench --random-moe [SHAPE]`.

SHAPES names them: "stress" (the default, the I/O stress case) and the shapes of the MoEs people
run, "olmoe-1b-7b" (OLMoE-1B-7B: 16 layers, hidden 2048, 64 experts of 1024, top-8) and
"qwen3-30b-a3b" (Qwen3-30B-A3B: 48 layers, hidden 2048, 128 experts of 768, top-8). Each is a
Mixtral-architecture model with the named model's sizes (layers, hidden, experts, expert width,
top-k, heads, vocabulary); the named models' own details (OLMoE's q/k norms, Qwen3's q/k norms and
head_dim 128 with 32 query heads) are not reproduced: the shape decides what streaming reads and
computes, and that is what these models are for. No tokenizer (the benchmark feeds token ids).

"stress" is written as a Hugging Face folder (config.json as transformers' MixtralConfig has it, f16 weights
drawn from a fixed seed, one safetensors shard per layer so that no more than one layer is in memory
while it is written) and converted with INT8 attention and INT4 experts like any other source. The
named shapes hold tens of GB of f16 experts, more than is worth writing to convert: their source
(RandomMoeSource) hands the converter each expert already in INT4 (random codes, scales giving the
same weight spread), which it stores as it is, and the rest as float32, which it quantizes to INT8.

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

from edge.core.files import built_once
from edge.home import first_use, is_checkpoint

RANDOM_MOE_SEED = 0
WEIGHT_STD = 0.02
# RandomMoeSource: the output projections (attention's o_proj, the experts' down_proj) are drawn at
# OUTPUT_GAIN / sqrt(fan_in * layers), so that all layers together add about OUTPUT_GAIN to the
# unit-scale embedding in the residual stream, whatever the width and depth; at WEIGHT_STD a deep,
# wide shape's layers swamp the embedding and greedy decoding repeats one token
OUTPUT_GAIN = 0.5


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
    label: str = ""  # the model whose shape this is ("" for the stress case)

    @property
    def name(self) -> str:
        prefix = f"random-{self.label}" if self.label else "random-moe"
        return (f"{prefix}-{self.layers}x{self.experts}e-top{self.top_k}-h{self.hidden}-i{self.expert_intermediate}"
                f"-v{self.vocab}")

    @property
    def expert_int4_bytes(self) -> int:
        """Bytes of the INT4 experts (codes and g32 f16 scales of gate, up and down)."""
        values = self.layers * self.experts * 3 * self.hidden * self.expert_intermediate
        return values // 2 + values // 32 * 2


SHAPES = {
    "stress": RandomMoeShape(),
    "olmoe-1b-7b": RandomMoeShape(layers=16, experts=64, top_k=8, hidden=2048, expert_intermediate=1024, heads=16,
                                  kv_heads=16, vocab=50304, context=4096, label="olmoe-1b-7b"),
    "qwen3-30b-a3b": RandomMoeShape(layers=48, experts=128, top_k=8, hidden=2048, expert_intermediate=768, heads=32,
                                    kv_heads=4, vocab=151936, context=4096, label="qwen3-30b-a3b"),
}


def mixtral_config(shape: RandomMoeShape) -> dict:
    """The config.json fields of a Mixtral model of this shape (what transformers' MixtralConfig writes)."""
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": shape.vocab,
            "hidden_size": shape.hidden, "intermediate_size": shape.expert_intermediate,
            "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads, "hidden_act": "silu",
            "max_position_embeddings": shape.context, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "num_local_experts": shape.experts, "num_experts_per_tok": shape.top_k}


def write_random_moe_folder(folder: str, shape: RandomMoeShape, seed: int = RANDOM_MOE_SEED) -> str:
    """Write the Hugging Face folder (config.json + one safetensors shard per layer) and return it."""
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(mixtral_config(shape), f, indent=1)
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
    """The random MoE's checkpoint under `home`/models, built and converted on first use (the stress
    shape through a Hugging Face folder, the named shapes from RandomMoeSource)."""
    from converters.convert import QuantPlan, convert

    path = os.path.join(home, "models", shape.name)

    def build() -> None:
        plan = QuantPlan(weights="int8", overrides={"experts": "int4"})
        print(f"building the random MoE {shape.name} into {path} ({first_use(path)}; "
              f"{shape.expert_int4_bytes / 1e9:.1f} GB of INT4 experts)", file=sys.stderr)
        if shape.label:
            from converters.source import SourceTensor

            expert = SourceTensor("model.layers.0.mlp.experts.0.gate_proj.weight",
                                  (shape.expert_intermediate, shape.hidden), "random", 0)
            summary = convert(RandomMoeSource(shape, plan.scheme_for(expert)), path, plan, force=True,
                              progress=progress)
            print(summary.format(), file=sys.stderr)
            return
        folder = path + ".hf-source"
        try:
            write_random_moe_folder(folder, shape)
            summary = convert(folder, path, plan, force=True, progress=progress)
            print(summary.format(), file=sys.stderr)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    return built_once(path, is_checkpoint, build, "building the random MoE")


class RandomMoeSource:
    """A SourceModel (converters/source.py) of a random Mixtral of `shape` whose tensors are made when
    the converter asks for them, each from its own seed (the tensor's name and `seed`), so that building
    the model holds one tensor at a time and gives the same checkpoint every time. Experts come as INT4
    QuantizedTensors of `expert_scheme` (the converter stores them as they are); the rest as float32,
    with the stress case's design (unit-scale embeddings, an LM head of permuted embedding rows,
    routers of unit-scale rows) and output projections scaled to the depth (OUTPUT_GAIN)."""

    def __init__(self, shape: RandomMoeShape, expert_scheme, seed: int = RANDOM_MOE_SEED):
        from converters.source import SourceTokenizer, SourceTensor

        self.shape, self.scheme, self.seed = shape, expert_scheme, seed
        self.config = mixtral_config(shape)
        self.tokenizer = SourceTokenizer(None, {"bos_token_id": 1, "eos_token_id": 2})
        self.description = f"random {shape.label or 'stress'} MoE shape {shape.name} (seed {seed})"
        d, inter, head_dim = shape.hidden, shape.expert_intermediate, shape.hidden // shape.heads
        shapes = {"model.embed_tokens.weight": (shape.vocab, d)}
        for layer in range(shape.layers):
            p = f"model.layers.{layer}."
            shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                           p + "self_attn.q_proj.weight": (shape.heads * head_dim, d),
                           p + "self_attn.k_proj.weight": (shape.kv_heads * head_dim, d),
                           p + "self_attn.v_proj.weight": (shape.kv_heads * head_dim, d),
                           p + "self_attn.o_proj.weight": (d, shape.heads * head_dim),
                           p + "mlp.gate.weight": (shape.experts, d)})
            for expert in range(shape.experts):  # (our names: the converter's Mixtral reader maps w1/w3/w2 so)
                e = f"{p}mlp.experts.{expert}."
                shapes.update({e + "gate_proj.weight": (inter, d), e + "up_proj.weight": (inter, d),
                               e + "down_proj.weight": (d, inter)})
        shapes.update({"model.norm.weight": (d,), "lm_head.weight": (shape.vocab, d)})
        self._shapes = shapes
        self._tensors = [SourceTensor(name, dims, "random", 4 * int(np.prod(dims))) for name, dims in shapes.items()]

    def tensors(self):
        return list(self._tensors)

    def _rng(self, name: str) -> np.random.Generator:
        import zlib

        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def load(self, name: str):
        from quant import QuantizedTensor

        dims = self._shapes[name]
        if name == "lm_head.weight":  # the embedding's rows, permuted, at the weights' scale (drawn again,
            embed = self.load("model.embed_tokens.weight")  # not held through the whole conversion)
            return embed[self._rng(name).permutation(self.shape.vocab)] * np.float32(WEIGHT_STD)
        rng = self._rng(name)
        if len(dims) == 1:
            return (1.0 + 0.1 * rng.standard_normal(dims, dtype=np.float32)).astype(np.float32)
        if name == "model.embed_tokens.weight":
            return rng.standard_normal(dims, dtype=np.float32)
        std = WEIGHT_STD
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std = OUTPUT_GAIN / np.sqrt(dims[1] * self.shape.layers)
        if ".experts." in name:
            rows, cols = dims
            group = self.scheme.group_size
            # codes 1..15 about the zero point 8: values -7..7, zero mean (codes 0..15 would have a mean of
            # -0.5, which every layer turns into a push along one direction that ends in one repeated
            # token), spread sqrt((15^2 - 1) / 12) = 4.32: scales giving `std`
            nibbles = rng.integers(1, 16, (rows, cols // group, group), dtype=np.uint8)
            codes = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
            scales = np.full((rows, cols // group), std / 4.32, np.float16)
            return QuantizedTensor(self.scheme, dims, codes, scales)
        values = rng.standard_normal(dims, dtype=np.float32) * np.float32(std)
        return values * np.float32(50) if name.endswith("mlp.gate.weight") else values

    def release(self, name: str) -> None:
        pass

    def close(self) -> None:
        pass
