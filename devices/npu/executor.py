"""Running a model's ONNX graphs: chunks of layers, KV buffers bound through IOBinding.

The executor is what NpuBackend.compile_forward returns: a callable with the signature of
edge.model.Transformer.forward_ops, `(ids, cache, all_logits, observer) -> logits`.

KV cache: each layer's keys/values live in one float32 buffer [1, Hkv, C, Dh] (BNSH, the layout
GroupQueryAttention reads); the cache's per-layer arrays [C, Hkv, Dh] are transposed views of those
buffers, so edge's KVCache reads and writes the same memory. Positions [0, cache.length) are valid;
a call appends after them and advances cache.length, as in the op-by-op composition.
- contrib graphs bind past_key.i and present_key.i to the same buffer: the op writes the new rows
  in place at positions P..P+S-1;
- standard graphs read the whole buffer under a mask (positions < P visible, causal order among
  the new rows, the layer's sliding window) and return the new rows, which are copied in here.

Granularity: the model is cut into graphs of `layers_per_graph` layers (0 = one graph for the
whole model), and after every Mixture-of-Experts layer. `observer(layer, hidden)` is called after
each graph with the index of its last layer and the residual stream [T, D] after that layer: with
layers_per_graph=1 it sees every layer, as the op-by-op composition does; with coarser graphs only
the chunk boundaries (every MoE layer is one).

Mixture-of-Experts layers: a graph ends at a MoE layer's router (attention, norms, router logits
and any shared expert run on the provider). Here the route is chosen (edge's routing, through the
model), the routed experts come from the model's ExpertSource (resident or streamed) and run on
the backend's expert backend (the CPU backend's expert_mixture); the block's output goes into the
next graph as `moe_in`, which adds it to the residual stream. The observer also gets that layer's
route as keywords expert_ids [T, A] and expert_weights [T, A], as in the op-by-op composition.

Static shapes (providers that compile for fixed sizes): one token runs the decode graph (S=1);
longer inputs run in prefill chunks of S=N tokens, the last one right-padded (padded rows are
masked out of every valid row and never written to the cache).
"""
from __future__ import annotations

import numpy as np

from devices.npu.onnx_export import GraphShape, mask_input_name, uses_group_query_attention
from devices.npu.providers import create_session, placement

MASKED = np.float32(-np.inf)


class KVLayoutError(TypeError):
    """The KV cache handed to the NPU executor was not allocated by the NPU backend."""


def allocate_kv(capacity: int, kv_heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Views [C, Hkv, Dh] of BNSH buffers [1, Hkv, C, Dh] (np.zeros: pages are mapped as they fill)."""
    keys = np.zeros((1, kv_heads, capacity, head_dim), np.float32)
    values = np.zeros((1, kv_heads, capacity, head_dim), np.float32)
    return keys[0].transpose(1, 0, 2), values[0].transpose(1, 0, 2)


def bnsh_buffer(view: np.ndarray) -> np.ndarray:
    buffer = view.base
    expected = (1, view.shape[1], view.shape[0], view.shape[2])
    if not isinstance(buffer, np.ndarray) or buffer.shape != expected or not buffer.flags.c_contiguous:
        raise KVLayoutError("the KV cache was not allocated by the npu backend (expected views of "
                            f"float32 buffers {list(expected)}); open sessions through the model loaded on 'npu'")
    return buffer


class Chunk:
    """One graph and its session."""

    def __init__(self, shape: GraphShape, path: str, session):
        self.shape = shape
        self.path = path
        self.session = session
        self.input_names = {i.name for i in session.get_inputs()}
        self.output_names = [o.name for o in session.get_outputs()]

    @property
    def layers(self) -> range:
        return range(self.shape.first_layer, self.shape.end_layer)


class NpuExecutor:
    def __init__(self, model, cache, runtime, settings, embed):
        self.model = model
        self.embed = embed  # the backend's embedding lookup, for the expert source's forecast of a decode step
        self.spec = model.spec
        self.graph_cache = cache
        self.runtime = runtime
        self.settings = settings
        # how attention and the KV cache are handled: "contrib" = GroupQueryAttention writing in place
        self.attention = "contrib" if uses_group_query_attention(self.spec, cache.options) else "standard"
        n_layers = self.spec.num_hidden_layers
        self.moe_layers = {i for i, layer in enumerate(model.layers) if layer.moe is not None}
        self.layer_ranges = graph_ranges(n_layers, settings.layers_per_graph or n_layers, self.moe_layers)
        self._chunks: dict[tuple, list[Chunk]] = {}
        self._rope_caches: dict[tuple[int, bool], tuple[np.ndarray, np.ndarray]] = {}  # (capacity, long) -> cos, sin
        self.ort = runtime.ort
        if not settings.static_shapes:
            self.chunks(None, None, None)  # build and load now, so that edge.load reports any failure

    # --- graphs ---------------------------------------------------------------------------------
    def chunks(self, tokens: int | None, capacity: int | None, rows: int | None) -> list[Chunk]:
        key = (tokens, capacity, rows)
        if key not in self._chunks:
            chunks = []
            for index, (first, end) in enumerate(self.layer_ranges):
                last = index == len(self.layer_ranges) - 1
                shape = GraphShape(first, end, embed=index == 0, head=last, tokens=tokens, capacity=capacity,
                                   logits_rows=rows if last else None, moe_in=first - 1 in self.moe_layers,
                                   moe_out=end > first and end - 1 in self.moe_layers)
                path = self.graph_cache.path(shape)
                session = create_session(self.runtime, path, self.settings.threads, self.settings.allow_cpu_nodes,
                                         spinning=not self.moe_layers)  # experts run between MoE graphs
                chunks.append(Chunk(shape, path, session))
            self._chunks[key] = chunks
        return self._chunks[key]

    def placement(self) -> dict[str, dict]:
        return {chunk.shape.key: placement(chunk.session) for chunks in self._chunks.values() for chunk in chunks}

    # --- forward --------------------------------------------------------------------------------
    def __call__(self, ids: np.ndarray, cache, all_logits: bool, observer=None) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        start, n_tokens = cache.length, len(ids)
        buffers = [(bnsh_buffer(k), bnsh_buffer(v)) for k, v in cache.layers]
        if not self.settings.static_shapes:
            pieces = [(0, n_tokens, n_tokens)]  # (offset, valid tokens, graph tokens)
        elif n_tokens == 1:
            pieces = [(0, 1, 1)]
        else:
            size = self.settings.prefill_chunk
            pieces = [(o, min(size, n_tokens - o), size) for o in range(0, n_tokens, size)]
        if n_tokens == 1 and self.moe_layers:  # (the source may prefetch from the token's embedding)
            self.model.moe.begin_token(lambda: self.embed(self.model.embed_tokens, ids)[0])
        logits, observed, routes = [], {}, {}
        for offset, valid, tokens in pieces:
            is_last = offset + valid == n_tokens
            rows = np.arange(valid) if all_logits else np.array([valid - 1])
            piece_logits, hidden, piece_routes = self._run_piece(ids[offset:offset + valid], start + offset, tokens,
                                                                 rows, buffers, cache.capacity,
                                                                 keep_hidden=observer is not None)
            if all_logits or is_last:
                logits.append(piece_logits[: len(rows)])
            for layer, rows_hidden in hidden.items():
                observed.setdefault(layer, []).append(rows_hidden)
            for layer, route in piece_routes.items():
                routes.setdefault(layer, []).append(route)
        cache.length = start + n_tokens
        if observer is not None:
            for layer in sorted(observed):
                route = {}
                if layer in routes:
                    expert_ids, expert_weights = zip(*routes[layer])
                    route = {"expert_ids": np.concatenate(expert_ids), "expert_weights": np.concatenate(expert_weights)}
                observer(layer, np.concatenate(observed[layer]), **route)
        result = np.concatenate(logits)
        return result if all_logits else result[-1]

    def _run_piece(self, ids, start: int, tokens: int, rows: np.ndarray, buffers, capacity: int, keep_hidden: bool):
        """Run `ids` (valid rows; padded to `tokens` for static graphs) at positions start.. through every chunk."""
        valid = len(ids)
        static = self.settings.static_shapes
        graph_rows = len(rows)
        if static and graph_rows > 1:
            graph_rows = tokens  # all-logits pieces take every row of the fixed shape
            rows = np.arange(tokens)
        chunks = self.chunks(tokens if static else None, capacity if static else None, graph_rows if static else None)
        padded = np.zeros((1, tokens), np.int64)
        padded[0, :valid] = ids
        shared = self._attention_feeds(start, valid, tokens, capacity)
        hidden_value, hidden_rows, logits = None, {}, None
        moe_block, routes = None, {}  # the last MoE block's output [1, S, D]; layer -> (ids, weights)
        for chunk in chunks:
            binding = chunk.session.io_binding()
            feeds = dict(shared)
            if chunk.shape.embed:
                feeds["input_ids"] = padded
            if chunk.shape.head:
                feeds["logits_rows"] = rows.astype(np.int64)
            for name, array in feeds.items():
                if name in chunk.input_names:
                    binding.bind_cpu_input(name, array)
            if hidden_value is not None:
                binding.bind_ortvalue_input("hidden_in", hidden_value)
            if chunk.shape.moe_in:
                binding.bind_cpu_input("moe_in", moe_block)
            for name in chunk.output_names:
                if not name.startswith("present_"):
                    binding.bind_output(name)
            for layer in chunk.layers:
                keys, values = (self.ort.OrtValue.ortvalue_from_numpy(b) for b in buffers[layer])
                binding.bind_ortvalue_input(f"past_key.{layer}", keys)
                binding.bind_ortvalue_input(f"past_value.{layer}", values)
                if self.attention == "contrib":  # the op writes the new rows into the same buffers
                    binding.bind_ortvalue_output(f"present_key.{layer}", keys)
                    binding.bind_ortvalue_output(f"present_value.{layer}", values)
            chunk.session.run_with_iobinding(binding)
            outputs = dict(zip([n for n in chunk.output_names if not n.startswith("present_")],
                               binding.get_outputs()))
            hidden_value = outputs["hidden_out"]
            if chunk.shape.moe_out:
                layer = chunk.layers[-1]
                moe_block, routes[layer] = self._moe_block(layer, outputs, valid, tokens)
                if keep_hidden:  # the residual stream after the whole layer, as the next graph adds it
                    hidden_rows[layer] = hidden_value.numpy()[0, :valid] + moe_block[0, :valid]
            elif keep_hidden and chunk.layers:
                hidden_rows[chunk.layers[-1]] = hidden_value.numpy()[0, :valid].copy()
            if self.attention == "standard":
                for layer in chunk.layers:
                    keys, values = buffers[layer]
                    keys[0, :, start:start + valid] = outputs[f"new_key.{layer}"].numpy()[0, :, :valid]
                    values[0, :, start:start + valid] = outputs[f"new_value.{layer}"].numpy()[0, :, :valid]
            if chunk.shape.head:
                logits = outputs["logits"].numpy()
        return logits, hidden_rows, routes

    def _moe_block(self, layer: int, outputs: dict, valid: int, tokens: int):
        """The MoE block of `layer` from its graph's outputs: route the valid rows, run their routed
        experts outside the graph, add the shared expert the graph computed. Returns the block's
        output [1, S, D] (padded rows 0) and the route (ids [T, A], weights [T, A])."""
        def rows(name: str) -> np.ndarray:
            return outputs[name].numpy()[0, :valid]

        # residual: the stream entering the block (the expert predictor reads it), x: after its norm
        out, ids, weights = self.model.moe.routed(layer, rows("ffn_in"), rows("hidden_out"), rows("router_logits"))
        if "shared_expert_out" in outputs:
            out = out + rows("shared_expert_out")  # [T, D], in the op-by-op composition's order
        block = np.zeros((1, tokens, self.spec.hidden_size), np.float32)
        block[0, :valid] = out
        return block, (ids, weights)

    def _attention_feeds(self, start: int, valid: int, tokens: int, capacity: int) -> dict[str, np.ndarray]:
        if self.attention == "contrib":
            cos, sin = self._rope_cache(capacity, start + valid)
            return {"seqlens_k": np.array([start + valid - 1], np.int32),
                    "total_sequence_length": np.array(start + valid, np.int32),
                    "cos_cache": cos, "sin_cache": sin}
        cos, sin = self.model.rope.cos_sin(np.arange(start, start + tokens), call_end=start + valid)  # rows past valid: padding
        feeds = {"cos": cos, "sin": sin}
        for window in {layer.sliding_window for layer in self.model.layers}:
            feeds[mask_input_name(window)] = attention_mask(start, valid, tokens, capacity, window)
        return feeds

    def _rope_cache(self, capacity: int, call_end: int) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin of every position of the cache, as a call ending at `call_end` rotates them (longrope's
        factors depend on the call's end: one table for calls within its original context, one beyond)."""
        key = (capacity, self.model.rope.uses_long(call_end))
        if key not in self._rope_caches:
            self._rope_caches[key] = self.model.rope.cos_sin(np.arange(capacity), call_end=call_end)
        return self._rope_caches[key]


def graph_ranges(n_layers: int, step: int, moe_layers: set[int]) -> list[tuple[int, int]]:
    """The layer range [first, end) of each graph: `step` layers each, cut after every MoE layer (its
    routed experts run outside the graphs); after a last MoE layer, a graph of the head alone."""
    ranges, first = [], 0
    for end in range(1, n_layers + 1):
        if end - first == step or end - 1 in moe_layers or end == n_layers:
            ranges.append((first, end))
            first = end
    if n_layers - 1 in moe_layers:
        ranges.append((n_layers, n_layers))
    return ranges


def attention_mask(start: int, valid: int, tokens: int, capacity: int, window: int | None) -> np.ndarray:
    """Additive mask [S, C + S]: query s (position start + s) sees cache slot j < start and new row i <= s,
    each within the sliding window when there is one. Padded rows (s >= valid) see themselves only."""
    row = np.arange(tokens)[:, None]  # query s, at position start + s
    slot = np.arange(capacity)[None, :]  # cache slot j holds position j
    new = np.arange(tokens)[None, :]  # new row i, at position start + i
    sees_cache = (slot < start) & (row >= 0)
    sees_new = new <= row
    if window is not None:
        sees_cache &= start + row - slot < window
        sees_new &= row - new < window
    sees_cache[valid:] = False
    sees_new[valid:] = np.eye(tokens, dtype=bool)[valid:]
    visible = np.concatenate([sees_cache, sees_new], axis=1)
    return np.where(visible, np.float32(0), MASKED).astype(np.float32)
