"""The fused forward executor that CpuBackend.compile_forward returns.

It packs the model once at load into the tables kernels/cpu/forward.py reads (weight descriptors,
one f32 array of norm gains and biases, a layer table), keeps scratch buffers sized for the
longest call so far, and runs a whole forward pass as one compiled call; with an observer, one
call per layer so that the observer sees the residual stream in between.

A Mixture-of-Experts model runs one compiled call per stretch of layers that ends at a MoE layer:
the call ends with that layer's router logits, and between calls the model's MoE runner
(edge/core/contract.py) routes the layer as on every device, takes its experts from the model's
expert source (resident, paged or streamed) and mixes them in one compiled call (kernels/cpu/moe.py);
the shared expert, if any, is added op by op.
"""
from __future__ import annotations

import threading
import weakref

import numpy as np

from devices.cpu.weights import CpuWeight, MissingKernelError, as_vector
from edge.core.logits import check_finite_logits
from kernels.cpu import formats as wf
from kernels.cpu import forward as fk
from kernels.cpu.attention import MAX_DECODE_SPLITS, scratch_floats
from kernels.cpu.linear import (BLOCK_FLOATS, padded_tokens, pairs_length, quantized_tokens_shape, sums_length,
                                tile_scratch_rows)

KV_DTYPES = {"f32": np.float32, "f16": np.float16}  # the K/V storage the fused kernel reads


def _kv_array(buffer) -> np.ndarray:
    """The array of a layer's keys or values: allocate_kv's float32 array, or an f16 CacheBuffer's storage."""
    return buffer if isinstance(buffer, np.ndarray) else buffer.storage["values"]


class _ModelTables:
    """Descriptors, params and the layer table of one model (read by every call)."""

    def __init__(self, model):
        spec = model.spec
        self.weights: list[CpuWeight] = []  # kept referenced: descriptors point into their arrays
        self._vectors: list[np.ndarray] = []
        self._params_length = 0
        layer_rows = []
        for layer in model.layers:
            row = np.full(fk.LAYER_FIELDS, fk.NO_PARAM, np.int64)
            row[fk.L_INPUT_NORM] = self._vector(layer.input_norm)
            row[fk.L_POST_NORM] = self._vector(layer.post_attention_norm)
            ffn = (((fk.L_ROUTER, layer.moe.router),) if layer.moe is not None else
                   ((fk.L_GATE, layer.gate), (fk.L_UP, layer.up), (fk.L_DOWN, layer.down)))
            for column, weight in ((fk.L_Q, layer.q), (fk.L_K, layer.k), (fk.L_V, layer.v), (fk.L_O, layer.o), *ffn):
                row[column] = self._matrix(weight)
            if layer.moe is not None and layer.moe.router_bias is not None:
                row[fk.L_ROUTER_BIAS] = self._vector(layer.moe.router_bias)
            for column, vector in ((fk.L_Q_BIAS, layer.q_bias), (fk.L_K_BIAS, layer.k_bias),
                                   (fk.L_V_BIAS, layer.v_bias), (fk.L_O_BIAS, layer.o_bias),
                                   (fk.L_Q_NORM, layer.q_norm), (fk.L_K_NORM, layer.k_norm),
                                   (fk.L_GATE_BIAS, layer.gate_bias), (fk.L_UP_BIAS, layer.up_bias),
                                   (fk.L_DOWN_BIAS, layer.down_bias)):
                if vector is not None:
                    row[column] = self._vector(vector)
            row[fk.L_WINDOW] = layer.sliding_window or 0
            for column, norm in ((fk.L_ATTN_OUT_NORM, layer.attention_output_norm),
                                 (fk.L_FFN_OUT_NORM, layer.ffn_output_norm)):
                if norm is not None:
                    row[column] = self._vector(norm)
            row[fk.L_ACTIVATION] = fk.GELU_TANH if spec.ffn_activation == "gelu_tanh" else fk.SILU
            row[fk.L_ROPE_TABLE] = 0 if layer.rope_theta is None else 1  # (compile_forward allows one such base)
            layer_rows.append(row)
        self.layers = np.stack(layer_rows) if layer_rows else np.zeros((0, fk.LAYER_FIELDS), np.int64)
        self.dims = np.zeros(fk.MODEL_FIELDS, np.int64)
        self.dims[fk.M_HIDDEN] = spec.hidden_size
        self.dims[fk.M_HEADS] = spec.num_attention_heads
        self.dims[fk.M_KV_HEADS] = spec.num_key_value_heads
        self.dims[fk.M_HEAD_DIM] = spec.head_dim
        self.dims[fk.M_INTERMEDIATE] = spec.intermediate_size
        self.dims[fk.M_VOCAB] = spec.vocab_size
        self.dims[fk.M_EMBED] = self._matrix(model.embed_tokens)
        self.dims[fk.M_LM_HEAD] = self._matrix(model.lm_head)  # tied: the same quantized table
        self.dims[fk.M_FINAL_NORM] = self._vector(model.final_norm)
        self.dims[fk.M_KV_BYTES] = np.dtype(KV_DTYPES[model.kv_format]).itemsize
        self.dims[fk.M_LAYERS] = spec.num_hidden_layers
        self.dims[fk.M_EMBED_SCALE] = (fk.NO_PARAM if spec.embedding_scale is None
                                       else self._vector(np.array([spec.embedding_scale], np.float32)))
        self.descriptors = np.stack([w.descriptor for w in self.weights])
        self.params = np.concatenate(self._vectors) if self._vectors else np.zeros(0, np.float32)
        self.max_cols_padded = int(self.descriptors[:, wf.W_COLS_PADDED].max())
        self.max_rows = int(self.descriptors[:, wf.W_ROWS].max())
        dense, moe = self.layers[:, fk.L_GATE], self.layers[:, fk.L_ROUTER]
        self.max_intermediate = int(self.descriptors[dense[dense != fk.NO_PARAM], wf.W_ROWS].max(initial=0))
        self.max_router_rows = int(self.descriptors[moe[moe != fk.NO_PARAM], wf.W_ROWS].max(initial=0))
        self.embedding_cols_padded = int(self.descriptors[self.dims[fk.M_EMBED], wf.W_COLS_PADDED])
        for name, index in (("embedding", fk.M_EMBED), ("LM head", fk.M_LM_HEAD)):
            descriptor = self.descriptors[self.dims[index]]
            if descriptor[wf.W_COLS] != spec.hidden_size or descriptor[wf.W_ROWS] != spec.vocab_size:
                raise MissingKernelError(f"the {name} is [{descriptor[wf.W_ROWS]}, {descriptor[wf.W_COLS]}], "
                                         f"expected [{spec.vocab_size}, {spec.hidden_size}]")

    def _matrix(self, weight) -> int:
        if not isinstance(weight, CpuWeight):
            raise MissingKernelError(f"device 'cpu' expected a weight matrix prepared by its backend, got {weight!r}")
        for index, known in enumerate(self.weights):
            if known is weight:  # a tied LM head is the embedding itself
                return index
        self.weights.append(weight)
        return len(self.weights) - 1

    def _vector(self, weight) -> int:
        vector = as_vector(weight)
        offset = self._params_length
        self._vectors.append(vector)
        self._params_length += vector.size
        return offset


class _Scratch:
    """Buffers of one executor, grown (never shrunk) to the longest call and largest cache seen."""

    def __init__(self, tables: _ModelTables, spec, n_threads: int):
        self.tables, self.spec, self.n_threads = tables, spec, n_threads
        self.tokens = 0
        self.capacity = 0
        k_padded = tables.max_cols_padded
        # each thread's prepared input vector (decode), and its row for a replicated step's output
        self.x_natural = np.zeros((n_threads, k_padded), np.float32)
        self.x_pairs = np.zeros((n_threads, pairs_length(k_padded)), np.float32)
        self.x_sums = np.zeros((n_threads, sums_length(k_padded)), np.float32)
        self.replicas = np.zeros((n_threads, max(spec.hidden_size, spec.num_attention_heads * spec.head_dim)),
                                 np.float32)
        self.blocks = np.zeros((n_threads, BLOCK_FLOATS), np.float32)
        self.row_scratch = np.zeros(tables.max_rows, np.float32)
        self.embed_scratch = np.zeros((1, tables.embedding_cols_padded), np.float32)
        self.sync = np.zeros((fk.sync_rows(spec.num_hidden_layers), fk.SYNC_STRIDE), np.int64)
        self.clock = np.zeros(fk.sync_rows(spec.num_hidden_layers) + 1, np.float64)

    def ensure(self, n_tokens: int, capacity: int) -> None:
        spec, n = self.spec, self.n_threads
        if n_tokens > self.tokens:
            t = max(n_tokens, 1)
            q_width = spec.num_attention_heads * spec.head_dim
            kv_width = spec.num_key_value_heads * spec.head_dim
            self.hidden = np.zeros((t, spec.hidden_size), np.float32)
            self.branch = np.zeros((t, spec.hidden_size), np.float32)  # o / down output before its norm (Gemma)
            self.normed = np.zeros((t, spec.hidden_size), np.float32)
            self.qkv = np.zeros((t, q_width + 2 * kv_width), np.float32)
            self.attn = np.zeros((t, q_width), np.float32)
            intermediate = max(self.tables.max_intermediate, 1)
            self.gate = np.zeros((t, intermediate), np.float32)
            self.up = np.zeros((t, intermediate), np.float32)
            self.router_logits = np.zeros((t, max(self.tables.max_router_rows, 1)), np.float32)
            # prefill's transposed gate/up [I, T]: the down projection reads gate_t as its xt, so it has
            # that weight's padded K rows (the rows past I stay zero) and xt's padded token columns
            down_rows = max(self.tables.max_cols_padded, intermediate) if t > 1 else 1
            self.gate_t = np.zeros((down_rows, padded_tokens(t) if t > 1 else 1), np.float32)
            self.up_t = np.zeros_like(self.gate_t)
            self.logits = np.zeros((t, spec.vocab_size), np.float32)
            self.xt = np.zeros((self.tables.max_cols_padded, padded_tokens(t)), np.float32)
            # xt (or gate_t) quantized for the weights prefilled on integer panels (linear.quantize_tokens)
            self.xq = np.zeros(quantized_tokens_shape(self.tables.max_cols_padded, t) if t > 1 else (1, 1),
                               np.float32)
            # prefill tiles only when a call has more than one token
            tile_rows = tile_scratch_rows(t) if t > 1 else 1
            self.tiles = np.zeros((n, tile_rows, self.tables.max_cols_padded), np.float32)
            # attention partials: one per (token, head) in prefill, per (head, KV split) in decode
            n_items = spec.num_attention_heads * (t if t > 1 else MAX_DECODE_SPLITS)
            self.peaks = np.zeros(n_items, np.float32)
            self.totals = np.zeros(n_items, np.float32)
            self.accs = np.zeros((n_items, spec.head_dim), np.float32)
            self.tokens = t
        if capacity > self.capacity:
            # per thread: an attention item's scores and accumulators (kernels/cpu/attention.py)
            self.scores = np.zeros((n, scratch_floats(spec.num_attention_heads, capacity, spec.head_dim)), np.float32)
            self.key_positions = np.arange(capacity, dtype=np.int64)
            self.capacity = capacity


class FusedForward:
    """(ids, cache, all_logits, observer) -> logits, with the semantics of Transformer.forward_ops."""

    def __init__(self, model, backend):
        self.backend = backend
        self.spec = model.spec
        self.rope = model.rope
        # the sliding layers' rotary table where their base differs (Gemma), else None
        self.layer_rope = next(iter(model.layer_ropes.values()), None) if model.layer_ropes else None
        self.eps = np.float32(self.spec.rms_norm_eps)
        self.scale = np.float32(model.attention_scale)
        self.tables = _ModelTables(model)
        self.kv_format = model.kv_format
        self.moe = model.moe  # routes a MoE layer, fetches and mixes its experts
        self.embed_tokens = model.embed_tokens
        self.moe_layers = {index: layer.moe for index, layer in enumerate(model.layers) if layer.moe is not None}
        self.scratch = _Scratch(self.tables, self.spec, backend.threads)
        self._kv_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()  # scratch buffers are shared: one call at a time
        self._last_call = None

    def _kv_table(self, cache) -> np.ndarray:
        table = self._kv_tables.get(cache)
        if table is None:
            spec = self.spec
            expected = (cache.capacity, spec.num_key_value_heads, spec.head_dim)
            dtype = np.dtype(KV_DTYPES[self.kv_format])
            rows = []
            for layer in cache.layers:
                arrays = [_kv_array(buffer) for buffer in layer]
                for buffer in arrays:
                    if buffer.shape != expected or buffer.dtype != dtype or not buffer.flags.c_contiguous:
                        raise ValueError(f"KV buffer {buffer.dtype}{list(buffer.shape)} is not the CPU backend's "
                                         f"{dtype}{list(expected)} layout; open sessions through this model")
                rows.append((arrays[0].ctypes.data, arrays[1].ctypes.data))
            table = np.array(rows, dtype=np.int64).reshape(-1, 2)
            self._kv_tables[cache] = table
        return table

    def __call__(self, ids, cache, all_logits: bool, observer=None) -> np.ndarray:
        with self._lock:
            logits = self._forward(ids, cache, all_logits, observer)
            return logits[:len(ids)].copy() if all_logits else logits[0].copy()

    def next_token(self, ids, cache) -> int:
        """Run ids like __call__ and return the greedy next token (the argmax of the last token's
        logits, ties to the lowest id), read from the scratch logits without copying them, once they are
        checked to be finite (argmax of NaN logits is an arbitrary token)."""
        with self._lock:
            logits = self._forward(ids, cache, False, None)[0]
            check_finite_logits(logits, cache.length - 1, self.backend.name)
            return int(np.argmax(logits))

    def _forward(self, ids, cache, all_logits: bool, observer) -> np.ndarray:
        """Run ids (with the lock held); the logits stay in scratch (row 0: the last token's)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        n_tokens = len(ids)
        start = cache.length
        cos, sin = self.rope.cos_sin_span(start, n_tokens)
        if self.layer_rope is not None:  # the kernel takes n_tokens rows per table
            local_cos, local_sin = self.layer_rope.cos_sin_span(start, n_tokens)
            cos, sin = np.concatenate([cos, local_cos]), np.concatenate([sin, local_sin])
        n_layers = self.spec.num_hidden_layers
        kv = self._kv_table(cache)
        scratch = self.scratch
        scratch.ensure(n_tokens, cache.capacity)
        ends = self._call_ends(n_layers, per_layer=observer is not None)
        if n_tokens == 1 and self.moe is not None:  # (the source may prefetch from the token's embedding)
            self.moe.begin_token(lambda: self.backend.embed(self.embed_tokens, ids)[0])
        first = 0
        for call, last in enumerate(ends):
            self.backend.use_threads()  # a MoE block's kernels may have set fewer
            self._run(ids, kv, start, cos, sin, first, last, call == 0, call == len(ends) - 1, all_logits)
            if last > first:
                layer = last - 1
                routing = self._mix_experts(layer, n_tokens) if layer in self.moe_layers else {}
                if observer is not None:
                    observer(layer, scratch.hidden[:n_tokens].copy(), **routing)
            first = last
        cache.length = start + n_tokens
        return scratch.logits

    def _call_ends(self, n_layers: int, per_layer: bool) -> list[int]:
        """Where each compiled call of a forward pass stops: after every MoE layer (or every layer),
        and at the end. The last call also runs the final norm and LM head, so when the last layer
        is a MoE layer (whose experts are added after its call) the head gets a call of its own."""
        ends = list(range(1, n_layers + 1)) if per_layer else [layer + 1 for layer in sorted(self.moe_layers)]
        if not ends or ends[-1] != n_layers or n_layers - 1 in self.moe_layers:
            ends.append(n_layers)
        return ends

    def _mix_experts(self, layer: int, n_tokens: int) -> dict:
        """The MoE block of `layer` after its call: route its router logits, mix the chosen experts (and
        the shared expert) of the post-attention norm's output, add them to the residual stream."""
        s, weights = self.scratch, self.moe_layers[layer]
        x, hidden = s.normed[:n_tokens], s.hidden[:n_tokens]
        router_logits = s.router_logits[:n_tokens, :weights.config.num_experts].copy()
        # the expert source may keep what it is given (the predictor learns from it): copies, not scratch views
        out, ids, route_weights = self.moe.block(layer, x, hidden.copy(), router_logits)
        hidden += out
        return {"expert_ids": ids, "expert_weights": route_weights}

    def last_step_times(self) -> list[tuple[int, str, float]]:
        """(layer or -1, step, seconds) of the last compiled call (benchmarks/cpu_profile.py)."""
        if self._last_call is None:
            return []
        return fk.step_durations(self.scratch.clock, *self._last_call)

    def _run(self, ids, kv, start, cos, sin, first, last, run_embedding, run_head, all_logits):
        t, s = self.tables, self.scratch
        fk.forward_kernel(
            t.descriptors, t.layers, t.params, t.dims, self.eps, self.scale, kv, ids, start, cos, sin,
            first, last, run_embedding, run_head, all_logits, self.backend.threads,
            s.hidden, s.normed, s.qkv, s.attn, s.gate, s.up, s.gate_t, s.up_t, s.xt, s.xq, s.x_natural, s.x_pairs,
            s.x_sums, s.tiles, s.blocks, s.row_scratch, s.embed_scratch, s.scores, s.peaks, s.totals, s.accs,
            s.key_positions, s.sync, s.clock, s.router_logits, s.logits, s.replicas, s.branch)
        self._last_call = (first, last, run_embedding)
