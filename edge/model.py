"""Model composition: embedding -> decoder layers -> final norm -> LM head.

T = tokens in this call, D = hidden size, Hq / Hkv = query / key-value heads, Dh = head dim.
"""
from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import numpy as np

from edge.attention import MlaWeights, gqa_attention, load_mla_weights, mla_attention
from edge.core.contract import ForwardModel
from edge.core.kv import cache_slots
from edge.core.logits import check_finite_logits
from edge.core.moe import ExpertSource, MoeLayerWeights
from edge.core.spec import LlamaSpec
from edge.kv_cache import KVCache, check_kv_format
from edge.moe import ExpertMixer, moe_block
from edge.rope import RopeTable


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
    post_attention_norm: object  # the feed-forward block's input norm (Gemma: pre_feedforward_layernorm)
    gate: object
    up: object
    down: object
    gate_bias: object | None
    up_bias: object | None
    down_bias: object | None
    sliding_window: int | None
    moe: MoeLayerWeights | None = None  # set on MoE layers, whose gate/up/down are then None
    mla: MlaWeights | None = None  # set on MLA layers (DeepSeek), whose q/k/v/o fields are then None
    # Gemma's sandwich norms: the attention's and the feed-forward's outputs normalised before the residual add
    attention_output_norm: object | None = None
    ffn_output_norm: object | None = None
    rope_theta: float | None = None  # the layer's rotary base where it is not the model's (Gemma's sliding layers)


def _forward_ops_of(transformer: "Transformer"):
    """The transformer's op-by-op composition for its executor, without keeping the transformer alive
    (it holds the executor)."""
    reference = weakref.ref(transformer)

    def forward_ops(ids, cache, all_logits: bool, observer=None):
        return reference().forward_ops(ids, cache, all_logits, observer)

    return forward_ops


class Transformer:
    """A decoder-only transformer of the Llama lineage, run by one backend."""

    def __init__(self, spec: LlamaSpec, tensors: dict, backend, experts: ExpertSource | None = None,
                 kv_format: str = "f32"):
        self.spec = spec
        self.backend = backend
        check_kv_format(kv_format, backend)
        self.kv_format = kv_format  # storage of GQA K/V, or of MLA's latent (quant/kv_formats.py)
        self.mla_form: str | None = None  # MLA: None = naive prefill + absorbed decode; or force one form
        load_weight = backend.load_weight  # (a backend may place them)

        def weight(name: str, required: bool = True):
            if name not in tensors:
                if required:
                    raise KeyError(name)
                return None
            return load_weight(tensors[name])

        def float_weight(name: str) -> np.ndarray:
            if name not in tensors:
                raise KeyError(name)
            tensor = tensors[name]
            return tensor.dequantize() if hasattr(tensor, "dequantize") else np.asarray(tensor, dtype=np.float32)

        mla = spec.attention_kind == "mla"

        def norm_weight(name: str, required: bool = True):
            """A norm's scale as the backends multiply by it: norm_offset + weight (Gemma's 1 + w, added in
            float32 as transformers adds it)."""
            if not spec.norm_offset or name not in tensors:
                return weight(name, required)
            return load_weight(np.float32(spec.norm_offset) + np.asarray(tensors[name], dtype=np.float32))

        sandwich = spec.sandwich_norms
        self.embed_tokens = weight("model.embed_tokens.weight")
        self.embedding_scale = None if spec.embedding_scale is None else np.float32(spec.embedding_scale)
        self.final_norm = norm_weight("model.norm.weight")
        self.lm_head = self.embed_tokens if spec.tie_word_embeddings else weight("lm_head.weight")
        self.layers = []
        for i in range(spec.num_hidden_layers):
            p = f"model.layers.{i}."
            moe = spec.moe_for_layer(i)
            dense_ffn = moe is None
            self.layers.append(LayerWeights(
                input_norm=norm_weight(p + "input_layernorm.weight"),
                q=None if mla else weight(p + "self_attn.q_proj.weight"),
                k=None if mla else weight(p + "self_attn.k_proj.weight"),
                v=None if mla else weight(p + "self_attn.v_proj.weight"),
                o=None if mla else weight(p + "self_attn.o_proj.weight"),
                q_bias=weight(p + "self_attn.q_proj.bias", False),
                k_bias=weight(p + "self_attn.k_proj.bias", False),
                v_bias=weight(p + "self_attn.v_proj.bias", False),
                o_bias=weight(p + "self_attn.o_proj.bias", False),
                q_norm=norm_weight(p + "self_attn.q_norm.weight", False),
                k_norm=norm_weight(p + "self_attn.k_norm.weight", False),
                post_attention_norm=norm_weight(p + ("pre_feedforward_layernorm.weight" if sandwich
                                                     else "post_attention_layernorm.weight")),
                gate=weight(p + "mlp.gate_proj.weight", dense_ffn),
                up=weight(p + "mlp.up_proj.weight", dense_ffn),
                down=weight(p + "mlp.down_proj.weight", dense_ffn),
                gate_bias=weight(p + "mlp.gate_proj.bias", False),
                up_bias=weight(p + "mlp.up_proj.bias", False),
                down_bias=weight(p + "mlp.down_proj.bias", False),
                sliding_window=spec.sliding_window_for_layer(i),
                moe=None if dense_ffn else self._moe_weights(moe, p + "mlp.", weight, tensors),
                mla=load_mla_weights(spec, weight, float_weight, p + "self_attn.") if mla else None,
                attention_output_norm=norm_weight(p + "post_attention_layernorm.weight") if sandwich else None,
                ffn_output_norm=norm_weight(p + "post_feedforward_layernorm.weight") if sandwich else None,
                rope_theta=spec.rope_theta_for_layer(i) if spec.rope_theta_for_layer(i) != spec.rope_theta else None,
            ))
        moe_layers = {index: layer.moe for index, layer in enumerate(self.layers) if layer.moe is not None}
        if experts is None and moe_layers:
            raise ValueError(f"{spec.model_type} has Mixture-of-Experts layers; pass an ExpertSource as `experts`")
        self.moe = ExpertMixer(backend, moe_layers, experts) if moe_layers else None
        self.rope = RopeTable(spec)
        # layers with a rotary base of their own rotate by it unscaled (edge/core/spec_dense.py rope_theta_for_layer)
        self.layer_ropes = {theta: RopeTable(dataclasses.replace(spec, rope_theta=theta, rope_scaling=None))
                            for theta in {layer.rope_theta for layer in self.layers} - {None}}
        self.attention_scale = spec.attention_scale
        self._fused_forward, self.forward_path = backend.compile_forward(ForwardModel(
            spec=spec, layers=self.layers, embed_tokens=self.embed_tokens, final_norm=self.final_norm,
            lm_head=self.lm_head, rope=self.rope, attention_scale=self.attention_scale, kv_format=kv_format,
            moe=self.moe, forward_ops=_forward_ops_of(self), layer_ropes=self.layer_ropes))

    @property
    def experts(self) -> ExpertSource | None:
        """Where MoE layers get their routed experts' weights (a source may be swapped: route recording);
        None for a dense model."""
        return self.moe.source if self.moe is not None else None

    @experts.setter
    def experts(self, source: ExpertSource | None) -> None:
        if self.moe is None:
            raise ValueError(f"{self.spec.model_type} has no Mixture-of-Experts layers to take experts from")
        self.moe.source = source

    @staticmethod
    def _moe_weights(moe, prefix: str, weight, tensors: dict) -> MoeLayerWeights:
        shared = moe.shared_intermediate_size > 0
        shared_prefix = prefix + moe.shared_expert_name + "."
        correction = prefix + "gate.e_score_correction_bias"
        return MoeLayerWeights(
            config=moe,
            router=weight(prefix + "gate.weight"),
            router_bias=weight(prefix + "gate.bias", False),
            # used by the numpy routing code on every backend, so kept as a host f32 array
            correction_bias=np.asarray(tensors[correction], dtype=np.float32) if moe.score_correction_bias else None,
            shared_gate=weight(shared_prefix + "gate_proj.weight") if shared else None,
            shared_up=weight(shared_prefix + "up_proj.weight") if shared else None,
            shared_down=weight(shared_prefix + "down_proj.weight") if shared else None,
            shared_expert_gate=weight(prefix + "shared_expert_gate.weight") if shared and moe.shared_expert_gate else None,
        )

    def new_cache(self, capacity: int) -> KVCache:
        ring_buffers = self.backend.capabilities.ring_buffers
        return KVCache(self.backend, cache_slots(self.spec, self.kv_format, capacity, ring_buffers), capacity)

    def forward(self, ids: np.ndarray, cache: KVCache, all_logits: bool, observer=None) -> np.ndarray:
        """Run ids through the backend's fused executor if it has one, else op by op. Fused
        executors read K/V over every position (in a format their backend compiled them for); a
        cache with ring-buffered sliding layers (a session longer than the window) runs op by op on
        the same backend."""
        fused = self._fused_forward if cache.full_kv else None
        run = fused or self.forward_ops
        return run(ids, cache, all_logits, observer)

    def forward_next_token(self, ids: np.ndarray, cache: KVCache) -> int:
        """Run ids like `forward` and return the greedy next token: the argmax of the last token's logits,
        ties to the lowest id. A fused executor with `next_token` picks it on the device and reads back
        only the id; otherwise it is taken from the logits, once they are checked to be finite."""
        fused = self._fused_forward if cache.full_kv else None
        if fused is not None and self.backend.capabilities.greedy_on_device:
            return fused.next_token(ids, cache)
        logits = self.forward(ids, cache, all_logits=False)
        check_finite_logits(logits, cache.length - 1, self.backend.name)
        return int(np.argmax(logits))

    def forward_ops(self, ids: np.ndarray, cache: KVCache, all_logits: bool, observer=None,
                    ffn_hook=None) -> np.ndarray:
        """Run ids (placed after the cache's valid positions) through the model; fills the cache.

        Returns logits [T, V] when all_logits, else [V] for the last token. `observer(layer, hidden)`
        sees the residual stream after each layer (the diff tool uses it); after a MoE layer it also
        gets the route as keywords: expert_ids [T, A] and expert_weights [T, A]. `ffn_hook(layer, x)` sees
        each feed-forward block's input x [T, D] (after its norm) and may return a replacement for
        the block's output [T, D], or None to run the block (MoEfication calibrates through it).
        """
        be, spec = self.backend, self.spec
        start = cache.length
        n_tokens = len(ids)
        positions = np.arange(start, start + n_tokens)
        cos_sin = self.rope.cos_sin(positions)
        layer_cos_sin = {theta: rope.cos_sin(positions) for theta, rope in self.layer_ropes.items()}
        hidden = be.embed(self.embed_tokens, ids)  # [T, D]
        if self.embedding_scale is not None:
            hidden = hidden * self.embedding_scale
        if n_tokens == 1 and self.moe is not None:  # (the source may prefetch from the token's embedding)
            embedding = hidden[0]
            self.moe.begin_token(lambda: embedding)
        for index, layer in enumerate(self.layers):
            x = be.rms_norm(hidden, layer.input_norm, spec.rms_norm_eps)
            cos, sin = cos_sin if layer.rope_theta is None else layer_cos_sin[layer.rope_theta]
            if layer.mla is not None:
                attended = mla_attention(be, spec, layer.mla, x, cache, index, start, positions, cos, sin,
                                         self.mla_form)
            else:
                attended = gqa_attention(be, spec, layer, x, cache, index, start, positions, cos, sin,
                                         self.attention_scale)
            if layer.attention_output_norm is not None:
                attended = be.rms_norm(attended, layer.attention_output_norm, spec.rms_norm_eps)
            hidden = hidden + attended
            x = be.rms_norm(hidden, layer.post_attention_norm, spec.rms_norm_eps)
            replaced = ffn_hook(index, x) if ffn_hook is not None else None
            routing = {}  # a MoE layer's route, for the observer
            if replaced is not None:
                hidden = hidden + replaced
            elif layer.moe is not None:
                moe_out, expert_ids, expert_weights = moe_block(be, index, x, hidden, layer.moe, self.experts)
                hidden = hidden + moe_out
                routing = {"expert_ids": expert_ids, "expert_weights": expert_weights}
            else:
                gate = be.linear(x, layer.gate, layer.gate_bias)
                up = be.linear(x, layer.up, layer.up_bias)
                gated = be.swiglu(gate, up) if spec.ffn_activation == "silu" else be.gelu_tanh_gated(gate, up)
                ffn_out = be.linear(gated, layer.down, layer.down_bias)
                if layer.ffn_output_norm is not None:
                    ffn_out = be.rms_norm(ffn_out, layer.ffn_output_norm, spec.rms_norm_eps)
                hidden = hidden + ffn_out
            if observer is not None:
                observer(index, hidden, **routing)
        cache.length = start + n_tokens
        if not all_logits:
            hidden = hidden[-1:]
        logits = be.linear(be.rms_norm(hidden, self.final_norm, spec.rms_norm_eps), self.lm_head)
        return logits if all_logits else logits[0]
