"""Expert streaming for Mixture-of-Experts models: store, bounded cache, predictor, prefetcher.

`open_expert_source` builds the ExpertSource (edge/core/moe.py) an expert strategy names:

    resident    every expert read once at load (streaming/resident.py)
    predictive  streamed through a bounded cache, with the predictor's prefetches (streaming/source.py)
    ondemand    streamed through a bounded LRU cache, loaded only when a layer needs them
    mmap        used in place from an mmap, the page cache bounded to the budget (streaming/paging.py)
"""
from __future__ import annotations

import importlib

from edge.core.errors import ZllmError
from edge.core.process_memory import runtime_memory
from streaming.options import StreamingOptions


def _imported(module: str):
    """A module of the expert streaming, imported on first use; what importing it adds (its kernels'
    libraries among it) is the runtime's memory, which the memory budget counts."""
    with runtime_memory.measure(f"imports {module}"):
        return importlib.import_module(module)


def open_expert_source(checkpoint, spec, backend, strategy: str, cache_bytes: int | None,
                       options: StreamingOptions = StreamingOptions(), compute_threads: int | None = None):
    """The ExpertSource for a MoE checkpoint under an expert strategy (the options' or a resolved one)
    and an expert cache size; `backend` prepares the experts' weights, and `compute_threads` are the CPU
    threads the model computes with (None: a device that schedules its own work), which the reads must
    not take a core from. Whatever the strategy, every expert's record is checked against its crc32
    when it is read (the resident source: once, at load)."""
    storage, policy, depth = options.storage, options.expert_policy, options.prefetch_depth
    index = checkpoint.experts
    layers = {layer: spec.moe_for_layer(layer) for layer in sorted(index.layers)}
    if strategy == "resident":
        ResidentExperts = _imported("streaming.resident").ResidentExperts
        # held for the model's lifetime, like its dense weights (a backend may place them: load_weight)
        return ResidentExperts(index, backend.load_weight)
    if strategy == "mmap":
        MappedExperts = _imported("streaming.paging").MappedExperts
        return MappedExperts(index, backend.prepare_weight, cache_bytes, storage=storage)
    if strategy not in ("predictive", "ondemand"):
        raise ZllmError(f"expert_strategy {strategy!r} is not known; choose one of predictive, ondemand, mmap, "
                        "resident")
    StreamingExperts = _imported("streaming.source").StreamingExperts
    if cache_bytes is None:  # no budget: a cache that can hold every expert
        from streaming.budget import entry_bytes
        cache_bytes = sum(len(index.layers[layer].records) * entry_bytes(index, layer) for layer in layers)
    if policy is None:
        policy = "nextuse" if strategy == "predictive" else "lru"
    predictor = None
    if strategy == "predictive":
        predictor_module = _imported("streaming.predictor")
        ExpertPredictor, SignalWeights = predictor_module.ExpertPredictor, predictor_module.SignalWeights
        _, routers = predictor_module.predictor_inputs(spec, checkpoint.tensors)
        predictor = ExpertPredictor(layers, routers, depth=depth,
                                    weights=SignalWeights.for_checkpoint(checkpoint.path),
                                    rms_norm_eps=spec.rms_norm_eps)
    elif policy == "forecast":
        raise ZllmError("expert_policy 'forecast' needs the expert predictor; use expert_strategy 'predictive' "
                        "or expert_policy 'lru' or 'lfu'")
    # streamed experts are always checked against their crc32: a damaged record must never become output
    slots = _imported("streaming.slots")
    refusal = slots.slot_engine_refusal(index, policy, options.expert_engine)
    if refusal is not None and options.expert_engine == "compiled":
        raise ZllmError(f"expert_engine 'compiled' cannot stream this model: {refusal}; use expert_engine 'auto' "
                        "or 'python'")
    if refusal is None:
        return slots.SlotExperts(index, backend.prepare_weight, layers, cache_bytes, storage=storage,
                                 predictor=predictor, policy=policy, depth=depth, verify=True,
                                 io_engine=options.io_engine, readers=options.prefetch_threads,
                                 compute_threads=compute_threads)
    return StreamingExperts(index, backend.prepare_weight, layers, cache_bytes, storage=storage, predictor=predictor,
                            policy=policy, depth=depth, threads=options.prefetch_threads, verify=True,
                            io_engine=options.io_engine, expert_engine_reason=refusal)


__all__ = ["open_expert_source"]
