"""One memory budget: how a byte budget splits into dense weights, KV cache, scratch and expert cache.

    budget = runtime + dense + tokenizer + kv + scratch + staging + predictor + expert cache

A budget means the whole process, less the interpreter and the package's import.

runtime  the runtime's own memory: the modules a load imports (numpy, numba, llvmlite, the device's
         backend), Numba and the kernels it compiled or loaded, thread pools (edge/core/process_memory.py
         measures each part the first time the process loads it)
dense    every tensor that is not a routed expert (the safetensors file; mmap-backed, counted whole)
tokenizer  what loading the tokenizer added to the process's resident set (edge/api.py measures it:
         the tokenizers library does not report its memory; SmolLM2's takes ~34 MB, more than its
         weights' share of many budgets)
kv       the KV cache the budget reserves: `kv_capacity` positions (default BUDGET_KV_CAPACITY, at most
         the model's context) over every layer in the KV format asked for (without counting the savings
         of sliding-window ring buffers); sessions whose capacities add up to more than this are
         refused (edge/api.py)
scratch  activations of one forward call of up to SCRATCH_TOKENS tokens: hidden states, projections,
         attention scores over the reserved KV positions, and the logits; and per compute thread, the
         tile a prefill gemm dequantizes weights into (kernels/cpu/linear.py tile_scratch_rows)
staging  per reading thread (the loading threads, and the model's thread, which reads its misses itself),
         a compressed record before it is decompressed and zstd's output
predictor  the expert predictor's arrays (predictive strategy): float32 routers, each layer's routers
         of the layers ahead stacked, transition counts, drift (predictor_bytes)
cache    the expert cache (streaming/cache.py charges buffer + ENTRY_OVERHEAD per expert)

A budget "P%" means everything that is not an expert plus a cache holding P% of all experts.
The minimum working set is the budget whose cache holds, for the largest layer, top_k experts plus
one per loading thread (so a layer's experts and concurrent loads fit at once), or every expert of
that layer if that is fewer; the "mmap" strategy
needs top_k experts and no loading threads; "resident" needs every expert.
"""
from __future__ import annotations

import math
import numbers
import re
from dataclasses import asdict, dataclass

from edge.core.arguments import parse_size, shown
from edge.core.contract import ComputeThreads
from edge.core.errors import InvalidArgumentError, ZllmError
from edge.core.spec import widest_ffn
from edge.core.kv import kv_bytes_per_token
from quant.expert_file import ExpertIndex
from streaming.cache import ENTRY_OVERHEAD
from streaming.store import aligned_length

BUDGET_KV_CAPACITY = 1024  # positions the budget reserves for KV by default
SCRATCH_TOKENS = 64        # tokens of one forward call the scratch reservation covers
STRATEGIES = ("predictive", "ondemand", "mmap", "resident")


@dataclass(frozen=True)
class Budget:
    """A parsed memory_budget: bytes, or a percentage of the expert bytes."""
    bytes: int | None = None
    expert_percent: float | None = None

    def __str__(self) -> str:
        return f"{self.expert_percent:g}%" if self.expert_percent is not None else f"{self.bytes} bytes"


_NUMBER = r"([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"  # 512, 1.5, 1e9, 5E8


def parse_budget(value: "int | float | str | None") -> Budget | None:
    """512MB, 1.5GiB, a number of bytes (1e9 and 5e8 too), or "P%" (non-expert bytes + P% of the experts)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise InvalidArgumentError(f"memory budget {shown(value)} not understood; use bytes, a size such as 512MB, "
                                   "or a share of the expert bytes such as 50%")
    if isinstance(value, str):
        percent = re.fullmatch(rf"\s*{_NUMBER}\s*%\s*", value)
        if percent:
            share = float(percent.group(1))
            if not 0 < share <= 100:
                raise InvalidArgumentError(f"memory budget {shown(value)}: a share of the expert bytes must be in "
                                           "(0%, 100%]")
            return Budget(expert_percent=share)
        size = parse_size(value)
        if size is None:
            raise InvalidArgumentError(f"memory budget {shown(value)} not understood; use bytes, a size such as 512MB "
                                       "or 2GiB, or a share of the expert bytes such as 50%")
    else:
        size = int(value) if isinstance(value, numbers.Integral) else float(value)
    if not math.isfinite(size) or size < 1:  # -1 would plan a negative cache; 0 holds nothing
        raise InvalidArgumentError(f"memory budget {shown(value)} must be a positive number of bytes, such as 512MB "
                                   "or 2GiB, or a share of the expert bytes such as 50%")
    return Budget(bytes=int(size))


def scratch_bytes(spec, kv_capacity: int, compute_threads: ComputeThreads | int = 1) -> int:
    """Activations of one forward call of SCRATCH_TOKENS tokens (float32), and each compute thread's own
    scratch as its backend states it (ComputeThreads; a bare count: threads with none of their own)."""
    if not isinstance(compute_threads, ComputeThreads):
        compute_threads = ComputeThreads(compute_threads)
    heads = spec.num_attention_heads
    per_token = (6 * spec.hidden_size + 3 * heads * spec.head_dim + 3 * widest_ffn(spec) + spec.vocab_size
                 + heads * kv_capacity)  # residual/norm/attention buffers, FFN, logits, attention scores
    return SCRATCH_TOKENS * per_token * 4 + compute_threads.count * compute_threads.scratch_bytes_each


def predictor_bytes(spec, layers: list[int], depth: int) -> int:
    """The arrays streaming/predictor.py's ExpertPredictor keeps for these MoE layers looking `depth` ahead."""
    total = 0
    widest = max((spec.moe_for_layer(layer).num_experts for layer in layers), default=0)  # (the tables' rows)
    reach = max(1, min(depth, len(layers) - 1))  # the most MoE layers a forecast looks ahead (its tables' depth)
    for position, layer in enumerate(layers):
        config = spec.moe_for_layer(layer)
        experts = config.num_experts
        ahead = sum(spec.moe_for_layer(target).num_experts for target in layers[position + 1: position + 1 + depth])
        total += 4 * (experts * spec.hidden_size + spec.hidden_size + experts)  # router, norm gain, bias (f32)
        if position == 0:  # its router folded with its norm gain, for the embedding's forecast
            total += 4 * (experts * spec.hidden_size + experts)
        total += 4 * ahead * (spec.hidden_size + 3)  # the targets' stacked routers, bias, drift, raw lookahead
        total += 8 * (2 * widest * widest + 2 * widest)  # transitions, frequencies and needs (f64)
        total += 8 * (3 * reach + 8 + 2 * config.top_k + (reach + 1) * (config.top_k + 2))  # routes, sets, flags
    return total + 8 * (2 + 3 * (reach + 1) + 3) if layers else 0  # decode accuracy, status


def entry_bytes(index: ExpertIndex, layer: int) -> int:
    """What the expert cache charges for one expert of `layer`."""
    return aligned_length(index.layout(layer).raw_length) + ENTRY_OVERHEAD


@dataclass(frozen=True)
class MemoryPlan:
    budget_bytes: int | None
    runtime_bytes: int
    dense_bytes: int
    tokenizer_bytes: int
    kv_bytes: int
    kv_capacity: int
    scratch_bytes: int
    staging_bytes: int
    predictor_bytes: int
    expert_bytes: int             # every expert as the cache would charge it
    expert_cache_bytes: int | None  # None: no budget (every expert may be held)
    minimum_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def plan_memory(spec, dense_bytes: int, index: ExpertIndex | None, budget: "int | str | None", strategy: str,
                loading_threads: int, kv_capacity: int | None = None, kv_format: str = "f32",
                tokenizer_bytes: int = 0, prefetch_depth: int = 2,
                compute_threads: ComputeThreads | int = 1, runtime_bytes: int = 0) -> MemoryPlan:
    """Split `budget` for a model; refuses a budget below the minimum working set (ZllmError)."""
    parsed = parse_budget(budget)
    context = spec.max_position_embeddings
    kv_capacity = min(context, BUDGET_KV_CAPACITY) if kv_capacity is None else int(kv_capacity)
    if not 0 < kv_capacity <= context:
        raise ZllmError(f"kv_capacity must be in [1, {context}] (the model's context), got {kv_capacity}")
    try:
        kv = kv_capacity * kv_bytes_per_token(spec, kv_format)
    except ValueError as exc:  # an unknown KV format
        raise ZllmError(str(exc)) from None
    scratch = scratch_bytes(spec, kv_capacity, compute_threads)
    if index is None:  # dense model: weights + KV + scratch
        if parsed is not None and parsed.expert_percent is not None:
            raise ZllmError(f"memory budget {parsed}: a share of the expert bytes needs a Mixture-of-Experts model; "
                            "give this dense model a budget in bytes such as 512MB")
        minimum = runtime_bytes + dense_bytes + tokenizer_bytes + kv + scratch
        plan = MemoryPlan(None if parsed is None else parsed.bytes, runtime_bytes, dense_bytes, tokenizer_bytes, kv,
                          kv_capacity, scratch, 0, 0, 0, None, minimum)
        _refuse_below_minimum(plan, f"{runtime_bytes} bytes of runtime, {dense_bytes} bytes of weights, "
                                    f"{tokenizer_bytes} bytes of tokenizer, {kv} "
                                    f"bytes of KV cache ({kv_capacity} positions) and {scratch} bytes of scratch")
        return plan
    if strategy not in STRATEGIES:
        raise ZllmError(f"expert_strategy {strategy!r} is not known; choose one of {', '.join(STRATEGIES)}")
    layers = sorted(index.layers)
    all_experts = sum(len(index.layers[layer].records) * entry_bytes(index, layer) for layer in layers)
    largest = max(layers, key=lambda layer: entry_bytes(index, layer))
    top_k = max(spec.moe_for_layer(layer).top_k for layer in layers)
    staging = predictor = 0
    if strategy == "resident":
        working, what = all_experts, "every expert (resident)"
    elif strategy == "mmap":
        working, what = top_k * entry_bytes(index, largest), f"{top_k} experts of layer {largest} at once (top_k)"
    else:
        if index.compression:  # per thread: the compressed record, and zstd's output before it is copied
            staging = (loading_threads + 1) * (aligned_length(max(r.length for layer in layers
                                                            for r in index.layers[layer].records))
                                         + index.largest_raw_record)
        if strategy == "predictive":
            predictor = predictor_bytes(spec, layers, prefetch_depth)
        # a cache holding all of a layer's experts never waits on its loading threads for room
        in_flight = min(top_k + loading_threads, len(index.layers[largest].records))
        working = in_flight * entry_bytes(index, largest)
        what = (f"{in_flight} experts of layer {largest} at once (top_k {top_k} + {loading_threads} loading threads, "
                f"of its {len(index.layers[largest].records)})"
                + (f" and {staging} bytes of decompression staging" if staging else ""))
    fixed = runtime_bytes + dense_bytes + tokenizer_bytes + kv + scratch + staging + predictor
    minimum = fixed + working
    if parsed is None:
        cache = None
        budget_bytes = None
    elif parsed.expert_percent is not None:
        cache = math.ceil(all_experts * parsed.expert_percent / 100)
        budget_bytes = fixed + cache  # refused below if the share holds fewer experts than needed at once
    else:
        budget_bytes = parsed.bytes
        cache = budget_bytes - fixed
    plan = MemoryPlan(budget_bytes, runtime_bytes, dense_bytes, tokenizer_bytes, kv, kv_capacity, scratch, staging,
                      predictor, all_experts, None if cache is None else min(cache, all_experts), minimum)
    _refuse_below_minimum(plan, f"{runtime_bytes} bytes of runtime, {dense_bytes} bytes of non-expert weights, "
                                f"{tokenizer_bytes} bytes of tokenizer, "
                                f"{kv} bytes of KV cache ({kv_capacity} positions), {scratch} bytes of scratch"
                                + (f", {predictor} bytes of expert predictor" if predictor else "")
                                + f" and {working} bytes for {what}")
    return plan


def _refuse_below_minimum(plan: MemoryPlan, parts: str) -> None:
    if plan.budget_bytes is not None and plan.budget_bytes < plan.minimum_bytes:
        raise ZllmError(f"memory budget {plan.budget_bytes} bytes ({_mb(plan.budget_bytes)}) is below this model's "
                        f"minimum working set of {plan.minimum_bytes} bytes ({_mb(plan.minimum_bytes)}): {parts}; "
                        f"raise memory_budget to at least {plan.minimum_bytes} bytes")
