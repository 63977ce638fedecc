"""The fused forward pass: a whole call recorded into one command buffer, one submission.

T = tokens in this call (at most `max_tokens`; longer prompts run in several submissions),
D = hidden size, Hq / Hkv = query / key-value heads, Dh = head dim, I = intermediate size,
V = vocabulary.

Weights and the KV cache stay in device buffers. Per call the host writes the step uniform
(T, start), the token ids and the rotary cos/sin of the call's positions (edge's RopeTable,
so that rope scaling lives in one place), then reads back only the logits. The per-layer
work is bound once per KV cache (bind groups reference the cache's buffers) and per kind of
call (decode, T = 1, uses matrix-vector kernels; prefill uses matrix-matrix ones).

Mixture-of-Experts layers (moe.py) end the submission after their router: the host routes, the
model's ExpertSource brings the chosen experts, the backend's GPU expert cache uploads the ones it
does not hold, and the next submission runs the routed experts and carries on.
"""
from __future__ import annotations

import weakref

import numpy as np

from devices.gpu.launches import Launches
from devices.gpu.moe import MoeLayerWork, MoeScratch
from devices.gpu.tensors import GpuKV, GpuMatrix

MAX_TOKENS_PER_SUBMISSION = 128


class FusedForward:
    def __init__(self, backend, model):
        self.ctx, self.builder = backend.ctx, backend.builder
        # what the executor needs from the model, not the model itself (which holds this
        # executor): no reference cycle, so device buffers go when the model does
        self.layers, self.rope = model.layers, model.rope
        self.final_norm, self.lm_head = model.final_norm, model.lm_head
        self.attention_scale = model.attention_scale
        spec = model.spec
        for name in ("embed_tokens", "lm_head"):
            if not isinstance(getattr(model, name), GpuMatrix):
                raise TypeError(f"the GPU executor needs {name} prepared by the gpu backend")
        self.dim = spec.hidden_size
        self.q_heads, self.kv_heads, self.head_dim = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
        self.qk_norm_over_projection = spec.qk_norm_over_projection  # OLMoE: q/k norm over the whole projection
        self.clip_qkv = spec.clip_qkv  # OLMoE: q, k, v clamped after their projections
        self.intermediate = spec.intermediate_size
        self.vocab = model.lm_head.shape[0]
        self.eps = float(spec.rms_norm_eps)
        ctx = self.ctx
        moe_layers = [layer for layer in self.layers if layer.moe is not None]
        moe_widths = [width for layer in moe_layers for width in (
            layer.moe.config.num_experts, layer.moe.config.intermediate_size, layer.moe.config.shared_intermediate_size)]
        widest_row = max(self.vocab, self.intermediate, self.q_heads * self.head_dim, self.dim, *moe_widths)
        self.max_tokens = max(1, min(MAX_TOKENS_PER_SUBMISSION, ctx.max_binding_bytes // (4 * widest_row)))

        t, d, q_width, kv_width = self.max_tokens, self.dim, self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        scratch, linear_input = self.scratch, self.linear_input
        self.step = ctx.uniform(np.zeros(4, np.uint32), "step")
        self.ids = ctx.storage(4 * t, "ids")
        self.cos = ctx.storage(4 * t * (self.head_dim // 2), "cos")
        self.sin = ctx.storage(4 * t * (self.head_dim // 2), "sin")
        self.positions = ctx.upload(np.arange(spec.max_position_embeddings, dtype=np.int32), "positions")
        self.hidden = scratch(t * d, "hidden")      # [T, D] the residual stream
        self.normed = linear_input(t * d, "normed")  # [T, D]
        self.q_raw = scratch(t * q_width, "q")      # [T, Hq, Dh] projected
        self.q_normed = scratch(t * q_width, "q_normed")
        self.q_rotated = scratch(t * q_width, "q_rotated")
        self.k_raw = scratch(t * kv_width, "k")     # [T, Hkv, Dh] projected
        self.k_normed = scratch(t * kv_width, "k_normed")
        if self.clip_qkv is not None:  # projections before the clamp (values then go into the cache)
            self.q_clipped = scratch(t * q_width, "q_clipped")
            self.k_clipped = scratch(t * kv_width, "k_clipped")
            self.v_raw = scratch(t * kv_width, "v")
        self.attended = linear_input(t * q_width, "attended")
        self.gate = scratch(t * self.intermediate, "gate")  # [T, I]
        self.up = scratch(t * self.intermediate, "up")
        self.activated = linear_input(t * self.intermediate, "activated")
        self.logits_last = scratch(self.vocab, "logits")  # [V]
        self.logits_all = None  # [T, V], allocated when first asked for
        self.staging = ctx.readback_buffer(4 * self.vocab)
        self.staging_all = None
        self.one_row = ctx.uniform(np.array([1, 0, 0, 0], np.uint32), "one_row")  # the argmax's step: one row
        self.next_token_id = ctx.storage(16, "next_token", copy_src=True)
        self.staging_token = ctx.readback_buffer(4)
        self.moe = MoeScratch(self, moe_layers) if moe_layers else None
        self.expert_cache = backend.expert_cache if moe_layers else None
        if self.expert_cache is not None:
            self.expert_cache.forget_bound()
        # MoE layers route on the host through the model (edge's routing and its ExpertSource)
        self.moe_runner = model.moe  # routes MoE layers and fetches their experts (edge/core/contract.py)
        self._embed = self.builder.embed(self.step, self.ids, model.embed_tokens, self.hidden)
        self._embed_tokens, self._ops = model.embed_tokens, backend.ops  # a decode token's embedding on the host
        self._plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._heads: dict[str, Launches] = {}

    def scratch(self, n_floats: int, label: str):
        return self.ctx.storage(4 * n_floats, label, copy_src=True)

    def linear_input(self, n_floats: int, label: str):
        """Scratch that feeds linear layers: readable through the CPU kernel's uniform windows too."""
        return self.ctx.storage(4 * n_floats, label, copy_src=True, input_window=self.builder.input_window)

    # --- binding ---------------------------------------------------------------------------------
    def _attention_launches(self, layer, kv: tuple[GpuKV, GpuKV], tokens_per_group: int) -> Launches:
        """Input norm, attention, output projection added into the residual stream."""
        b, step = self.builder, self.step
        kv_width, q_width, dh = self.kv_heads * self.head_dim, self.q_heads * self.head_dim, self.head_dim
        keys, values = kv[0].buffer, kv[1].buffer

        def linear(x, weight, y, **options):
            return b.linear(step, x, weight, y, tokens_per_group=tokens_per_group, max_tokens=self.max_tokens,
                            **options)

        work = Launches()
        work.extend(b.rms_norm(step, self.hidden, layer.input_norm.buffer, self.normed, dim=self.dim, eps=self.eps))
        work.extend(linear(self.normed, layer.q, self.q_raw, bias=_bias(layer.q_bias)))
        work.extend(linear(self.normed, layer.k, self.k_raw, bias=_bias(layer.k_bias)))
        if self.clip_qkv is None:  # values go straight into the cache, at the call's first position
            work.extend(linear(self.normed, layer.v, values, bias=_bias(layer.v_bias), y_start_stride=kv_width))
        else:
            work.extend(linear(self.normed, layer.v, self.v_raw, bias=_bias(layer.v_bias)))
        q, k = self.q_raw, self.k_raw
        if layer.q_norm is not None:
            if self.qk_norm_over_projection:  # OLMoE normalises the whole projection
                q_rows, k_rows, q_dim, k_dim = 1, 1, q_width, kv_width
            else:  # Qwen3 normalises each head before rotating it
                q_rows, k_rows, q_dim, k_dim = self.q_heads, self.kv_heads, dh, dh
            work.extend(b.rms_norm(step, q, layer.q_norm.buffer, self.q_normed, dim=q_dim, eps=self.eps,
                                   rows_per_token=q_rows))
            work.extend(b.rms_norm(step, k, layer.k_norm.buffer, self.k_normed, dim=k_dim, eps=self.eps,
                                   rows_per_token=k_rows))
            q, k = self.q_normed, self.k_normed
        if self.clip_qkv is not None:
            work.extend(b.clamp(step, q, self.q_clipped, per_token=q_width, limit=self.clip_qkv))
            work.extend(b.clamp(step, k, self.k_clipped, per_token=kv_width, limit=self.clip_qkv))
            work.extend(b.clamp(step, self.v_raw, values, per_token=kv_width, limit=self.clip_qkv,
                                y_start_stride=kv_width))
            q, k = self.q_clipped, self.k_clipped
        work.extend(b.rope(step, q, self.cos, self.sin, self.q_rotated, heads=self.q_heads, head_dim=dh))
        work.extend(b.rope(step, k, self.cos, self.sin, keys, heads=self.kv_heads, head_dim=dh,
                           y_start_stride=kv_width))
        work.extend(b.attention(step, self.q_rotated, keys, values, self.positions, self.positions, self.attended,
                                q_heads=self.q_heads, kv_heads=self.kv_heads, head_dim=dh,
                                scale=self.attention_scale, window=layer.sliding_window, follow_step=True))
        work.extend(linear(self.attended, layer.o, self.hidden, bias=_bias(layer.o_bias), accumulate=True))
        return work

    def _layer_launches(self, index: int, layer, kv: tuple[GpuKV, GpuKV], tokens_per_group: int):
        """A dense layer's Launches, or a MoE layer's MoeLayerWork (launches around a host stop)."""
        attention = self._attention_launches(layer, kv, tokens_per_group)
        if layer.moe is not None:
            return MoeLayerWork(self, index, layer, attention, tokens_per_group)
        b, step = self.builder, self.step

        def linear(x, weight, y, **options):
            return b.linear(step, x, weight, y, tokens_per_group=tokens_per_group, max_tokens=self.max_tokens,
                            **options)

        work = attention
        work.extend(b.rms_norm(step, self.hidden, layer.post_attention_norm.buffer, self.normed, dim=self.dim,
                               eps=self.eps))
        work.extend(linear(self.normed, layer.gate, self.gate, bias=_bias(layer.gate_bias)))
        work.extend(linear(self.normed, layer.up, self.up, bias=_bias(layer.up_bias)))
        work.extend(b.swiglu(step, self.gate, self.up, self.activated, per_token=self.intermediate))
        work.extend(linear(self.activated, layer.down, self.hidden, bias=_bias(layer.down_bias), accumulate=True))
        return work

    def _plan(self, cache, decode: bool) -> list:
        plans = self._plans.setdefault(cache, {})
        if decode not in plans:
            tokens_per_group = 1 if decode else self.builder.tuning.prefill_tokens_per_group
            plans[decode] = [self._layer_launches(index, layer, kv, tokens_per_group)
                             for index, (layer, kv) in enumerate(zip(self.layers, cache.layers))]
        return plans[decode]

    def _head(self, which: str) -> Launches:
        """Final norm and LM head: for the last token ("last"), every token ("all"), or the last token's
        argmax ("token": greedy decoding reads back one id instead of V logits)."""
        if which not in self._heads:
            b, step = self.builder, self.step
            work = b.rms_norm(step, self.hidden, self.final_norm.buffer, self.normed, dim=self.dim, eps=self.eps)
            if which in ("last", "token"):
                work.extend(b.linear(step, self.normed, self.lm_head, self.logits_last, last_token_only=True,
                                     max_tokens=self.max_tokens))
                if which == "token":  # ties go to the lowest id, as numpy's argmax
                    work.extend(b.rows_kernel("argmax", self.one_row, self.logits_last, self.next_token_id,
                                              cols=self.vocab))
            else:
                self.logits_all = self.ctx.storage(4 * self.max_tokens * self.vocab, "logits_all", copy_src=True)
                self.staging_all = self.ctx.readback_buffer(4 * self.max_tokens * self.vocab)
                work.extend(b.linear(step, self.normed, self.lm_head, self.logits_all,
                                     tokens_per_group=b.tuning.prefill_tokens_per_group, max_tokens=self.max_tokens))
            self._heads[which] = work
        return self._heads[which]

    # --- running ---------------------------------------------------------------------------------
    def __call__(self, ids: np.ndarray, cache, all_logits: bool, observer=None) -> np.ndarray:
        for keys, values in cache.layers:
            if not (isinstance(keys, GpuKV) and isinstance(values, GpuKV) and keys.ctx is self.ctx):
                raise TypeError("the GPU executor needs a KV cache allocated by this gpu backend (backend.allocate_kv)")
        ids = np.asarray(ids).reshape(-1)
        self._begin_token(ids)
        observed = [[] for _ in self.layers] if observer is not None else None
        routes = [[] for _ in self.layers] if observer is not None else None
        pieces, call_end = [], cache.length + len(ids)
        for begin in range(0, len(ids), self.max_tokens):
            chunk = ids[begin : begin + self.max_tokens]
            is_last = begin + len(chunk) == len(ids)
            head = "all" if all_logits else ("last" if is_last else None)
            logits = self._run(chunk, cache, head, observed, routes, call_end)
            if all_logits:
                pieces.append(logits)
        if observer is not None:  # each layer's output for all the call's tokens, as forward_ops gives it
            for index, parts in enumerate(observed):
                routing = {}
                if routes[index]:  # a MoE layer's route, as forward_ops gives it
                    routing = {"expert_ids": np.concatenate([r[0] for r in routes[index]]),
                               "expert_weights": np.concatenate([r[1] for r in routes[index]])}
                observer(index, np.concatenate(parts), **routing)
        return np.concatenate(pieces) if all_logits else logits

    def next_token(self, ids: np.ndarray, cache) -> int:
        """Run ids like __call__ and return the greedy next token, the argmax of the last token's logits
        computed on the device: one id is read back instead of the logits."""
        ids = np.asarray(ids).reshape(-1)
        self._begin_token(ids)
        call_end = cache.length + len(ids)
        for begin in range(0, len(ids), self.max_tokens):
            chunk = ids[begin : begin + self.max_tokens]
            token = self._run(chunk, cache, "token" if begin + len(chunk) == len(ids) else None, None,
                              call_end=call_end)
        return int(token)

    def _begin_token(self, ids: np.ndarray) -> None:
        """Before a decode step's layer 0: the expert source may prefetch from the token's embedding
        (ExpertSource.begin_token), read back from this device only if the source asks for it."""
        if len(ids) == 1 and self.moe_runner is not None:
            self.moe_runner.begin_token(lambda: self._ops.embed(self._embed_tokens, ids)[0])

    def _route(self, index: int, router_logits: np.ndarray, residual: np.ndarray):
        return self.moe_runner.route(index, router_logits, residual)

    def _run(self, ids: np.ndarray, cache, head: str | None, observed: list | None,
             routes: list | None = None, call_end: int | None = None) -> np.ndarray | int | None:
        """One submission for up to max_tokens tokens (one more after each MoE layer's router, and one per
        layer when `observed` collects layer outputs). Returns what `head` asks for: logits, the next token
        id ("token"), or nothing (None: a prompt chunk before the last). `call_end`: one past the last
        position of the whole call this chunk belongs to (longrope rotates a call by where it ends)."""
        ctx, n_tokens, start = self.ctx, len(ids), cache.length
        cos, sin = self.rope.cos_sin(np.arange(start, start + n_tokens), call_end=call_end)
        ctx.write(self.step, np.array([n_tokens, start, 0, 0], np.uint32))
        ctx.write(self.ids, ids.astype(np.uint32))
        ctx.write(self.cos, cos)
        ctx.write(self.sin, sin)
        layers = self._plan(cache, decode=n_tokens == 1)

        encoder = ctx.device.create_command_encoder()
        compute_pass = encoder.begin_compute_pass()
        self._embed.encode(compute_pass, n_tokens)
        for index, work in enumerate(layers):
            if isinstance(work, MoeLayerWork):
                work.before.encode(compute_pass, n_tokens)
                compute_pass.end()
                work.read_router_logits(encoder, n_tokens)
                ctx.queue.submit([encoder.finish()])
                routed, expert_ids, expert_weights = work.routed_launches(n_tokens, self.expert_cache, self._route)
                if routes is not None:
                    routes[index].append((expert_ids, expert_weights))
                encoder = ctx.device.create_command_encoder()
                encoder.clear_buffer(self.moe.routed, 0, 4 * n_tokens * self.dim)
                compute_pass = encoder.begin_compute_pass()
                routed.encode(compute_pass, n_tokens)
            else:
                work.encode(compute_pass, n_tokens)
            if observed is not None:  # read each layer's output back: one submission per layer
                compute_pass.end()
                ctx.queue.submit([encoder.finish()])
                observed[index].append(ctx.download(self.hidden, 4 * n_tokens * self.dim).reshape(n_tokens, self.dim))
                encoder = ctx.device.create_command_encoder()
                compute_pass = encoder.begin_compute_pass()
        logits = None
        if head is not None:
            self._head(head).encode(compute_pass, n_tokens)
        compute_pass.end()
        if head == "token":
            encoder.copy_buffer_to_buffer(self.next_token_id, 0, self.staging_token, 0, 4)
        elif head is not None:
            last = head == "last"
            source, staging = (self.logits_last, self.staging) if last else (self.logits_all, self.staging_all)
            rows = 1 if head == "last" else n_tokens
            encoder.copy_buffer_to_buffer(source, 0, staging, 0, 4 * rows * self.vocab)
        ctx.queue.submit([encoder.finish()])
        cache.length = start + n_tokens
        if head is None:
            return None
        if head == "token":
            return int(ctx.read(self.staging_token, 4, np.uint32)[0])
        logits = ctx.read(staging, 4 * rows * self.vocab).reshape(rows, self.vocab)
        return logits[0] if head == "last" else logits


def _bias(vector):
    return None if vector is None else vector.buffer
