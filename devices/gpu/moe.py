"""Mixture-of-Experts blocks inside the fused forward pass (forward.py).

T = tokens in the call, D = hidden size, E = routed experts of a layer, A = active experts per
token, I = one routed expert's intermediate size, Is = the shared expert's, J = distinct experts
the call's route uses (at most E).

A MoE layer is recorded in two parts, around one stop on the host:
1. with the layer's attention, bound once: the post-attention norm (-> normed [T, D]), the router
   logits [T, E] (+ bias), and the shared expert (-> shared [T, D]) with its gate logit [T, 1].
   The submission ends there; the host reads back the router logits and the residual stream.
2. the host routes through the model (edge's route(): the family's scoring and top-k, so the
   expert ids are those of the reference given the same logits), and the model's ExpertSource
   hands over the chosen experts (SSD -> host cache, predictor, prefetcher: unchanged from the
   cpu device). The GPU expert cache uploads the ones it does not hold. The route is written as
   slots: slot j is the j-th distinct expert in ascending id order, its tokens' rows and route
   weights at entries [j T, j T + Tj) of route_rows / route_weights and Tj in slot j's step
   uniform. Then, per slot in order: gather the expert's tokens' normed rows, gate and up
   linears, swiglu, down linear, and add route weight x output into routed [T, D] (experts in
   ascending id order, as the reference adds them). Last, hidden += routed + shared.
"""
from __future__ import annotations

import numpy as np

from devices.gpu.expert_cache import GpuExpert, GpuExpertCache
from devices.gpu.launches import Launches


class MoeScratch:
    """Buffers shared by every MoE layer of one executor, sized for the widest layer."""

    def __init__(self, executor, moe_layers: list):
        ctx, t, d = executor.ctx, executor.max_tokens, executor.dim
        scratch, linear_input = executor.scratch, executor.linear_input
        configs = [layer.moe.config for layer in moe_layers]
        self.max_experts = max(c.num_experts for c in configs)
        self.max_active = max(c.top_k for c in configs)
        widest = max(c.intermediate_size for c in configs)
        widest_shared = max(c.shared_intermediate_size for c in configs)
        self.router_logits = scratch(t * self.max_experts, "router_logits")  # [T, E]
        self.expert_x = linear_input(t * d, "expert_x")           # [Tj, D] one expert's tokens
        self.expert_gate = scratch(t * widest, "expert_gate")     # [Tj, I]
        self.expert_up = scratch(t * widest, "expert_up")
        self.expert_act = linear_input(t * widest, "expert_act")
        self.expert_out = scratch(t * d, "expert_out")            # [Tj, D]
        self.routed = scratch(t * d, "routed")                    # [T, D] the routed experts' mixture
        self.shared_gate = scratch(t * max(widest_shared, 1), "shared_gate")  # [T, Is]
        self.shared_up = scratch(t * max(widest_shared, 1), "shared_up")
        self.shared_act = linear_input(t * max(widest_shared, 1), "shared_act")
        self.shared_out = scratch(t * d, "shared_out")            # [T, D]
        self.shared_gate_logit = scratch(t, "shared_gate_logit")  # [T, 1]
        slots = min(self.max_experts, t * self.max_active)
        self.route_rows = ctx.storage(4 * slots * t, "route_rows")        # [J, T] u32
        self.route_weights = ctx.storage(4 * slots * t, "route_weights")  # [J, T] f32
        self.slot_steps = [ctx.uniform(np.zeros(4, np.uint32), f"slot_step{j}") for j in range(slots)]
        self.readback = ctx.readback_buffer(4 * t * (self.max_experts + d))  # router logits, then residual
        builder = executor.builder
        self.gathers = [builder.gather_rows(step, self.route_rows, executor.normed, self.expert_x, dim=d, first=j * t)
                        for j, step in enumerate(self.slot_steps)]
        self.scatters = [builder.scatter_add_rows(step, self.route_rows, self.route_weights, self.expert_out,
                                                  self.routed, dim=d, first=j * t)
                         for j, step in enumerate(self.slot_steps)]


class MoeLayerWork:
    """One MoE layer of the fused executor: its bound launches around the host stop."""

    def __init__(self, executor, index: int, layer, attention: Launches, tokens_per_group: int):
        self.executor, self.index = executor, index
        self.config = layer.moe.config
        ex, b, step, scratch = executor, executor.builder, executor.step, executor.moe
        moe = layer.moe

        def linear(x, weight, y, bias=None):
            return b.linear(step, x, weight, y, tokens_per_group=tokens_per_group, max_tokens=ex.max_tokens,
                            bias=None if bias is None else bias.buffer)

        self.before = Launches()
        self.before.extend(attention)
        self.before.extend(b.rms_norm(step, ex.hidden, layer.post_attention_norm.buffer, ex.normed, dim=ex.dim,
                                      eps=ex.eps))
        self.before.extend(linear(ex.normed, moe.router, scratch.router_logits, moe.router_bias))
        shared = gate = None
        if moe.shared_gate is not None:
            self.before.extend(linear(ex.normed, moe.shared_gate, scratch.shared_gate))
            self.before.extend(linear(ex.normed, moe.shared_up, scratch.shared_up))
            self.before.extend(b.swiglu(step, scratch.shared_gate, scratch.shared_up, scratch.shared_act,
                                        per_token=self.config.shared_intermediate_size))
            self.before.extend(linear(scratch.shared_act, moe.shared_down, scratch.shared_out))
            shared = scratch.shared_out
            if moe.shared_expert_gate is not None:  # Qwen2-MoE scales the shared expert per token
                self.before.extend(linear(ex.normed, moe.shared_expert_gate, scratch.shared_gate_logit))
                gate = scratch.shared_gate_logit
        self.combine = b.moe_combine(step, scratch.routed, ex.hidden, dim=ex.dim, shared=shared, shared_gate=gate)

    def read_router_logits(self, encoder, n_tokens: int) -> None:
        """Copy the router logits [T, E] and the residual stream [T, D] into the readback buffer."""
        scratch, ex = self.executor.moe, self.executor
        logits_bytes = 4 * n_tokens * self.config.num_experts
        encoder.copy_buffer_to_buffer(scratch.router_logits, 0, scratch.readback, 0, logits_bytes)
        encoder.copy_buffer_to_buffer(ex.hidden, 0, scratch.readback, logits_bytes, 4 * n_tokens * ex.dim)

    def routed_launches(self, n_tokens: int, cache: GpuExpertCache, route) -> tuple[Launches, np.ndarray, np.ndarray]:
        """After the host stop: route, fetch the experts, write the slots; the launches of the routed
        experts' mixture and the combine. Returns them with the route (ids [T, A], weights [T, A])."""
        ex, scratch, ctx = self.executor, self.executor.moe, self.executor.ctx
        n_experts = self.config.num_experts
        values = ctx.read(scratch.readback, 4 * n_tokens * (n_experts + ex.dim))
        router_logits = values[: n_tokens * n_experts].reshape(n_tokens, n_experts)
        residual = values[n_tokens * n_experts:].reshape(n_tokens, ex.dim)
        ids, route_weights, chosen = route(self.index, router_logits, residual)
        distinct = sorted(set(np.asarray(ids).ravel().tolist()))  # ascending, as the reference adds them
        experts = cache.fetch(self.index, distinct, chosen)

        rows = np.zeros((len(distinct), ex.max_tokens), np.uint32)
        weights = np.zeros((len(distinct), ex.max_tokens), np.float32)
        counts = []
        for slot, expert in enumerate(distinct):
            tokens, choices = np.nonzero(ids == expert)  # tokens routed to this expert, and in which of their A slots
            rows[slot, : len(tokens)] = tokens
            weights[slot, : len(tokens)] = route_weights[tokens, choices]
            counts.append(len(tokens))
            ctx.write(scratch.slot_steps[slot], np.array([len(tokens), 0, 0, 0], np.uint32))
        ctx.write(scratch.route_rows, rows)
        ctx.write(scratch.route_weights, weights)

        work = Launches()
        for slot, (expert, count) in enumerate(zip(experts, counts)):
            work.add_launch(_Counted(scratch.gathers[slot], count))
            work.add_launch(_Counted(self._expert_launches(expert, slot, count), count))
            work.add_launch(_Counted(scratch.scatters[slot], count))
        work.extend(self.combine)
        return work, ids, route_weights

    def _expert_launches(self, expert: GpuExpert, slot: int, count: int) -> Launches:
        """gate/up linears, swiglu and the down linear of one expert, bound to slot's step uniform and this
        executor's scratch (cached on the expert's device copy, so a hit binds nothing)."""
        tokens_per_group = 1 if count == 1 else self.executor.builder.tuning.prefill_tokens_per_group
        key = (id(self.executor.moe), slot, tokens_per_group, self.config.intermediate_size)
        if key not in expert.bound:
            ex, b, scratch = self.executor, self.executor.builder, self.executor.moe
            step = scratch.slot_steps[slot]

            def linear(x, weight, y):
                return b.linear(step, x, weight, y, tokens_per_group=tokens_per_group, max_tokens=ex.max_tokens)

            work = Launches()
            work.extend(linear(scratch.expert_x, expert.gate, scratch.expert_gate))
            work.extend(linear(scratch.expert_x, expert.up, scratch.expert_up))
            work.extend(b.swiglu(step, scratch.expert_gate, scratch.expert_up, scratch.expert_act,
                                 per_token=self.config.intermediate_size))
            work.extend(linear(scratch.expert_act, expert.down, scratch.expert_out))
            expert.bound[key] = work
        return expert.bound[key]


class _Counted:
    """Launches recorded for a fixed token count (an expert's tokens), whatever the call's."""

    def __init__(self, launches: Launches, n_tokens: int):
        self.launches, self.n_tokens = launches, n_tokens

    def encode(self, compute_pass, n_tokens: int) -> None:
        self.launches.encode(compute_pass, self.n_tokens)
