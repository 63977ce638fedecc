"""Model composition: embedding -> decoder layers -> final norm -> LM head.

T = tokens in this call, D = hidden size, Hq / Hkv = query / key-value heads, Dh = head dim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from edge.kv_cache import KVCache
from edge.rope import RopeTable
from edge.spec import LlamaSpec


@dataclass
class LayerWeights:
    input_norm: object
    q: object
    k: object
    v: object
    o: object
    q_bias: object | None
    k_bias: object | None
    v_bias: object | None
    o_bias: object | None
    q_norm: object | None
    k_norm: object | None
    post_attention_norm: object
    gate: object
    up: object
    down: object
    gate_bias: object | None
    up_bias: object | None
    down_bias: object | None
    sliding_window: int | None


class Transformer:
    """A decoder-only transformer of the Llama lineage, run by one backend."""

    def __init__(self, spec: LlamaSpec, tensors: dict, backend):
        self.spec = spec
        self.backend = backend

        def weight(name: str, required: bool = True):
            if name not in tensors:
                if required:
                    raise KeyError(name)
                return None
            return backend.prepare_weight(tensors[name])

        self.embed_tokens = weight("model.embed_tokens.weight")
        self.final_norm = weight("model.norm.weight")
        self.lm_head = self.embed_tokens if spec.tie_word_embeddings else weight("lm_head.weight")
        self.layers = []
        for i in range(spec.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(LayerWeights(
                input_norm=weight(p + "input_layernorm.weight"),
                q=weight(p + "self_attn.q_proj.weight"),
                k=weight(p + "self_attn.k_proj.weight"),
                v=weight(p + "self_attn.v_proj.weight"),
                o=weight(p + "self_attn.o_proj.weight"),
                q_bias=weight(p + "self_attn.q_proj.bias", False),
                k_bias=weight(p + "self_attn.k_proj.bias", False),
                v_bias=weight(p + "self_attn.v_proj.bias", False),
                o_bias=weight(p + "self_attn.o_proj.bias", False),
                q_norm=weight(p + "self_attn.q_norm.weight", False),
                k_norm=weight(p + "self_attn.k_norm.weight", False),
                post_attention_norm=weight(p + "post_attention_layernorm.weight"),
                gate=weight(p + "mlp.gate_proj.weight"),
                up=weight(p + "mlp.up_proj.weight"),
                down=weight(p + "mlp.down_proj.weight"),
                gate_bias=weight(p + "mlp.gate_proj.bias", False),
                up_bias=weight(p + "mlp.up_proj.bias", False),
                down_bias=weight(p + "mlp.down_proj.bias", False),
                sliding_window=spec.sliding_window_for_layer(i),
            ))
        self.rope = RopeTable(spec)
        self.attention_scale = 1.0 / math.sqrt(spec.head_dim)
        self._fused_forward = backend.compile_forward(self)

    def new_cache(self, capacity: int) -> KVCache:
        spec = self.spec
        return KVCache(self.backend, spec.num_hidden_layers, spec.num_key_value_heads, spec.head_dim, capacity)

    def forward(self, ids: np.ndarray, cache: KVCache, all_logits: bool, observer=None) -> np.ndarray:
        """Run ids through the backend's fused executor if it has one, else op by op."""
        run = self._fused_forward or self.forward_ops
        return run(ids, cache, all_logits, observer)

    def forward_ops(self, ids: np.ndarray, cache: KVCache, all_logits: bool, observer=None,
                    ffn_hook=None) -> np.ndarray:
        """Run ids (placed after the cache's valid positions) through the model; fills the cache.

        Returns logits [T, V] when all_logits, else [V] for the last token. `observer(layer, hidden)`
        sees the residual stream after each layer (the diff tool uses it). `ffn_hook(layer, x)` sees
        each feed-forward block's input x [T, D] (after its norm) and may return a replacement for
        the block's output [T, D], or None to run the block (MoEfication calibrates through it).
        """
        be, spec = self.backend, self.spec
        start = cache.length
        n_tokens = len(ids)
        positions = np.arange(start, start + n_tokens)
        key_positions = np.arange(start + n_tokens)
        cos, sin = self.rope.cos_sin(positions)
        hidden = be.embed(self.embed_tokens, ids)  # [T, D]
        for index, layer in enumerate(self.layers):
            x = be.rms_norm(hidden, layer.input_norm, spec.rms_norm_eps)
            q = be.linear(x, layer.q, layer.q_bias).reshape(n_tokens, spec.num_attention_heads, spec.head_dim)
            k = be.linear(x, layer.k, layer.k_bias).reshape(n_tokens, spec.num_key_value_heads, spec.head_dim)
            v = be.linear(x, layer.v, layer.v_bias).reshape(n_tokens, spec.num_key_value_heads, spec.head_dim)
            if layer.q_norm is not None:  # Qwen3 normalises each head before rotating it
                q = be.rms_norm(q, layer.q_norm, spec.rms_norm_eps)
                k = be.rms_norm(k, layer.k_norm, spec.rms_norm_eps)
            q, k = be.rope(q, cos, sin), be.rope(k, cos, sin)
            cache.write(index, start, k, v)
            keys, values = cache.view(index, start + n_tokens)
            attended = be.attention(q, keys, values, positions, key_positions, self.attention_scale,
                                    layer.sliding_window)  # [T, Hq, Dh]
            hidden = hidden + be.linear(attended.reshape(n_tokens, -1), layer.o, layer.o_bias)
            x = be.rms_norm(hidden, layer.post_attention_norm, spec.rms_norm_eps)
            replaced = ffn_hook(index, x) if ffn_hook is not None else None
            if replaced is not None:
                hidden = hidden + replaced
            else:
                gate = be.linear(x, layer.gate, layer.gate_bias)
                up = be.linear(x, layer.up, layer.up_bias)
                hidden = hidden + be.linear(be.swiglu(gate, up), layer.down, layer.down_bias)
            if observer is not None:
                observer(index, hidden)
        cache.length = start + n_tokens
        if not all_logits:
            hidden = hidden[-1:]
        logits = be.linear(be.rms_norm(hidden, self.final_norm, spec.rms_norm_eps), self.lm_head)
        return logits if all_logits else logits[0]
