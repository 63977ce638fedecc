"""ONNX graphs of a zllm decoder: embedding -> layers -> final norm -> LM head, in chunks of layers.

Dimensions: S = tokens in this call, C = KV capacity (positions the cache holds), P = positions
already in the cache, D = hidden size, Hq / Hkv = query / key-value heads, Dh = head dim,
V = vocabulary, R = rows whose logits are returned. Batch is always 1.

Quantized weights go to `com.microsoft::MatMulNBits` as stored (devices/npu/onnx_weights.py).
Two forms of the same math, chosen by `ExportOptions.attention`:

- "contrib": ONNX Runtime's fused contrib ops. `GroupQueryAttention` applies RoPE itself
  (cos/sin caches computed by edge's RopeTable, so every rope scaling is honoured) and writes the
  new keys/values in place into the KV buffers (past and present bound to the same memory);
  `SimplifiedLayerNormalization` / `SkipSimplifiedLayerNormalization` fuse RMSNorm with the
  residual add. Shapes are dynamic.
- "standard": only standard ONNX ops besides MatMulNBits, for providers that do not take the
  contrib ops (OpenVINO, QNN, ...). RoPE is explicit (cos/sin of this call's positions are
  inputs), attention reads the whole cache [C] plus the new rows under an additive mask that the
  caller computes (causal order, valid length, sliding window), and the graph returns the new
  keys/values for the caller to write into the cache. Shapes may be fixed (static S, C, R).

Mixture-of-Experts layers: a graph ends at a MoE layer's router (GraphShape.moe_out). Attention,
norms, the router logits and any shared expert run in the graph; the routed experts run where the
caller puts them (devices/npu runs them on the CPU backend, streamed from the expert source), and
the block's output comes back as the next graph's `moe_in` (GraphShape.moe_in).

The graph interface (names are the contract with devices/npu):

  inputs   input_ids int64 [1, S] (chunk with the embedding) | hidden_in f32 [1, S, D] (later chunks)
           moe_in f32 [1, S, D]          after a MoE layer: its block's output, added to hidden_in
           past_key.{i}, past_value.{i} f32 [1, Hkv, C, Dh]       every layer i of the chunk (BNSH)
           contrib:  seqlens_k int32 [1] = P + S - 1, total_sequence_length int32 [] = P + S,
                     cos_cache, sin_cache f32 [C, Dh/2]
           standard: cos, sin f32 [S, Dh/2], attention_mask f32 [S, C + S] (0 visible, -inf not)
           logits_rows int64 [R]                                  chunk with the LM head
  outputs  hidden_out f32 [1, S, D]     the residual stream after the chunk's last layer
           logits f32 [R, V]             chunk with the LM head
           ffn_in f32 [1, S, D], router_logits f32 [1, S, E]   chunk ending at a MoE layer: its
                                         block's input (after the norm) and router logits; the routed
                                         experts run outside the graph, hidden_out is the residual
                                         stream entering the block
           shared_expert_out f32 [1, S, D]   the same, when the layer has a shared expert (gated)
           contrib:  present_key.{i}, present_value.{i} [1, Hkv, C, Dh]   (the past buffers)
           standard: new_key.{i}, new_value.{i} [1, Hkv, S, Dh]
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from devices.npu.onnx_weights import (
    AFFINE_INT4_MODES,
    embedding_arrays,
    float_matrix_t,
    float_vector,
    matmul_nbits_arrays,
    uses_group_offset,
)
from quant import QuantizedTensor
from quant.formats import symmetric_zero_point

EXPORTER_VERSION = 1


def _exporter_source_digest() -> str:
    """sha256 of this module and of onnx_weights.py: a cached graph from other exporter code is stale."""
    digest = hashlib.sha256()
    for module_path in (__file__, os.path.join(os.path.dirname(__file__), "onnx_weights.py")):
        with open(module_path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


EXPORTER_DIGEST = _exporter_source_digest()
IR_VERSION = 8  # ONNX 1.13: read by every onnxruntime release that has the contrib ops used here
OPSET = 18
CONTRIB = "com.microsoft"
ATTENTION_FORMS = ("contrib", "standard")
FLOAT = TensorProto.FLOAT


@dataclass(frozen=True)
class ExportOptions:
    """How weights and attention are expressed (the same for every graph of one model)."""

    attention: str = "contrib"
    affine_int4: str = "group_offset"
    accuracy_level: int = 0  # MatMulNBits: 0 = float32 activations; 4 = int8 activations (fast on CPU)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_FORMS:
            raise ValueError(f"attention must be one of {ATTENTION_FORMS}, got {self.attention!r}")
        if self.affine_int4 not in AFFINE_INT4_MODES:
            raise ValueError(f"affine_int4 must be one of {AFFINE_INT4_MODES}, got {self.affine_int4!r}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"accuracy_level must be 0..4, got {self.accuracy_level}")


@dataclass(frozen=True)
class GraphShape:
    """Which part of the model one graph holds, and its fixed dimensions (None = dynamic)."""

    first_layer: int
    end_layer: int  # exclusive
    embed: bool
    head: bool
    tokens: int | None = None  # S
    capacity: int | None = None  # C
    logits_rows: int | None = None  # R
    moe_in: bool = False  # the previous layer's MoE block ran outside: its output arrives as moe_in
    moe_out: bool = False  # the last layer is a MoE layer: the graph stops at its router

    @property
    def key(self) -> str:
        def dim(value):
            return "dyn" if value is None else str(value)

        parts = [f"L{self.first_layer}-{self.end_layer}", "E" if self.embed else "", "H" if self.head else "",
                 "MoEin" if self.moe_in else "", "MoEout" if self.moe_out else "",
                 f"S{dim(self.tokens)}", f"C{dim(self.capacity)}", f"R{dim(self.logits_rows)}" if self.head else ""]
        return "_".join(p for p in parts if p)


# --- building blocks ------------------------------------------------------------------------------

@dataclass
class GraphBuilder:
    """Collects nodes, inputs, outputs and initializers; hands out unique value names."""

    weights: object  # ExternalWeightFile or InlineWeights
    nodes: list = field(default_factory=list)
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    initializers: dict = field(default_factory=dict)
    group_sums: dict = field(default_factory=dict)  # (input, group size) -> its group sums
    _counts: dict = field(default_factory=dict)

    def fresh(self, base: str) -> str:
        count = self._counts.get(base, 0)
        self._counts[base] = count + 1
        return base if count == 0 else f"{base}_{count}"

    def op(self, op_type: str, inputs: list[str], name: str, n_outputs: int = 1, domain: str = "",
           outputs: list[str] | None = None, **attributes):
        """Add a node; returns its output name (or a list of names when it has several).

        `outputs` names the outputs explicitly (graph outputs that callers bind by name)."""
        node_name = self.fresh(name)
        if outputs is None:
            outputs = [node_name if i == 0 else f"{node_name}:{i}" for i in range(n_outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=node_name, domain=domain, **attributes))
        return outputs[0] if len(outputs) == 1 else outputs

    def constant(self, values, dtype, name: str) -> str:
        """A small inline initializer (shapes, axes, scalars)."""
        array = np.asarray(values, dtype=dtype)
        if name not in self.initializers:
            self.initializers[name] = onnx.numpy_helper.from_array(array, name)
        return name

    def weight(self, name: str, make_array) -> str:
        if name not in self.initializers:
            self.initializers[name] = self.weights.tensor(name, make_array)
        return name

    def add_input(self, name: str, elem_type: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def add_output(self, value: str, name: str, elem_type: int, shape: list) -> None:
        if value != name:
            self.nodes.append(helper.make_node("Identity", [value], [name], name=self.fresh(f"{name}/identity")))
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def model(self, graph_name: str, metadata: dict[str, str]) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, graph_name, self.inputs, self.outputs, list(self.initializers.values()))
        model = helper.make_model(graph, ir_version=IR_VERSION, producer_name="zllm-edge",
                                  opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(CONTRIB, 1)])
        helper.set_model_props(model, metadata)
        return model


def linear(b: GraphBuilder, x: str, weight, bias, key: str, options: ExportOptions) -> str:
    """x [.., K] times weight [N, K] transposed, plus bias [N] -> [.., N]."""
    name = f"{key}/linear"
    if isinstance(weight, QuantizedTensor):
        return _matmul_nbits(b, x, weight, bias, key, options)
    matrix = b.weight(f"{key}.weight_t", lambda: float_matrix_t(weight))
    if np.asarray(weight).dtype == np.float16:
        matrix = b.op("Cast", [matrix], f"{key}/to_f32", to=FLOAT)
    y = b.op("MatMul", [x, matrix], name)
    if bias is not None:
        y = b.op("Add", [y, b.weight(f"{key}.bias", lambda: float_vector(bias))], f"{key}/bias")
    return y


def _matmul_nbits(b: GraphBuilder, x: str, weight: QuantizedTensor, bias, key: str, options: ExportOptions) -> str:
    scheme = weight.scheme
    n_rows, k = weight.shape
    group_offset = uses_group_offset(weight, options.affine_int4)
    cache: dict = {}

    # Groups with scale 0 get rewritten codes and scales (onnx_weights.py); those arrays then differ
    # from the stored ones and must not share their names (a tied embedding reads the stored ones).
    rewritten = not scheme.symmetric and not group_offset and bool((weight.scales == 0).any())

    def role(name: str):
        def make():
            if "arrays" not in cache:  # lower the weight once, whichever role is asked for first
                cache["arrays"] = matmul_nbits_arrays(weight, options.affine_int4)
            return cache["arrays"][name]
        stored_name = f"{name}_zero_point_form" if rewritten and name in ("qweight", "scales") else name
        return b.weight(f"{key}.{stored_name}", make)

    inputs = [x, role("qweight"), role("scales")]
    if not scheme.symmetric:
        inputs.append(role("zero_points_u8") if group_offset else role("zero_points"))
    if bias is not None:  # inputs: A, B, scales, zero_points, g_idx (deprecated), bias
        inputs += [""] * (5 - len(inputs)) + [b.weight(f"{key}.bias", lambda: float_vector(bias))]
    y = b.op("MatMulNBits", inputs, f"{key}/matmul_nbits", domain=CONTRIB, K=k, N=n_rows, bits=scheme.bits,
             block_size=scheme.group_size, accuracy_level=options.accuracy_level)
    if not group_offset:
        return y
    # exact affine part: sum x over each group of the K axis, times the offsets o^T [G, N]
    offset_term = b.op("MatMul", [group_sums(b, x, k, weight.n_groups, scheme.group_size, key), role("offsets_t")],
                       f"{key}/offset_matmul")
    return b.op("Add", [y, offset_term], f"{key}/add_offsets")


def group_sums(b: GraphBuilder, x: str, k: int, n_groups: int, group_size: int, key: str) -> str:
    """x [1, S, K] summed over each group of K -> [1, S, G]; computed once per input and group size
    (q/k/v, and gate/up, read the same x)."""
    cache_key = (x, group_size)
    if cache_key not in b.group_sums:
        padded = n_groups * group_size
        if padded != k:  # x is [1, S, K]: pads for all three axes (OpenVINO does not take Pad's axes input)
            pads = b.constant([0, 0, 0, 0, 0, padded - k], np.int64, f"pad_{k}_to_{padded}")
            x = b.op("Pad", [x, pads], f"{key}/pad_groups")
        grouped = b.op("Reshape", [x, b.constant([0, 0, n_groups, group_size], np.int64,
                                                 f"shape_groups_{n_groups}x{group_size}")], f"{key}/groups")
        b.group_sums[cache_key] = b.op("ReduceSum", [grouped, b.constant([-1], np.int64, "axes_last")],
                                       f"{key}/group_sums", keepdims=0)
    return b.group_sums[cache_key]


def rms_norm(b: GraphBuilder, x: str, gain, eps: float, key: str, options: ExportOptions) -> str:
    """x / sqrt(mean(x^2) + eps) * gain over the last axis."""
    gamma = b.weight(f"{key}.weight", lambda: float_vector(gain))
    if options.attention == "contrib":
        return b.op("SimplifiedLayerNormalization", [x, gamma], f"{key}/rms_norm", axis=-1, epsilon=eps, stash_type=1)
    # The row is scaled by its largest |x| first: x^2 overflows float16 beyond |x| = 256, and providers
    # that run float graphs at float16 (QNN's HTP) saturate the mean square (SmolLM2's residual stream
    # reaches |x| ~ 22,700: the norm's output came out 60x too large). With u = x / m for any m > 0,
    # x / sqrt(mean(x^2) + eps) = u / sqrt(mean(u^2) + (sqrt(eps) / m)^2). m = max|x| / 4 keeps
    # |u| <= 4 (the sum of u^2 stays below float16's 65504 up to 4094 columns) and 1/m a float16
    # normal number for every |x| <= 65504 (HTP divides by multiplying with the reciprocal and flushes
    # subnormals: m = max|x| turned rows with |x| > 16384 into zeros); m >= sqrt(eps) keeps the eps
    # term <= 1, and it underflows to 0 where it is negligible.
    axes = b.constant([-1], np.int64, "axes_last")
    sqrt_eps = b.constant(np.float32(np.sqrt(eps)), np.float32, f"sqrt_eps_{eps!r}")
    peak = b.op("ReduceMax", [b.op("Abs", [x], f"{key}/abs"), axes], f"{key}/peak_abs", keepdims=1)
    quarter = b.constant(np.float32(0.25), np.float32, "quarter")
    peak = b.op("Max", [b.op("Mul", [peak, quarter], f"{key}/quarter_peak"), sqrt_eps], f"{key}/scale_divisor")
    unit = b.op("Div", [x, peak], f"{key}/unit")
    variance = b.op("ReduceMean", [b.op("Mul", [unit, unit], f"{key}/square"), axes], f"{key}/mean_square", keepdims=1)
    eps_ratio = b.op("Div", [sqrt_eps, peak], f"{key}/eps_ratio")
    scaled_eps = b.op("Mul", [eps_ratio, eps_ratio], f"{key}/scaled_eps")
    root = b.op("Sqrt", [b.op("Add", [variance, scaled_eps], f"{key}/add_eps")], f"{key}/sqrt")
    return b.op("Mul", [b.op("Div", [unit, root], f"{key}/normalize"), gamma], f"{key}/scale")


class Residual:
    """The residual stream with the latest branch output not yet added (so contrib graphs can fuse
    the add into SkipSimplifiedLayerNormalization)."""

    def __init__(self, hidden: str):
        self.hidden = hidden
        self.pending: str | None = None

    def add(self, branch: str) -> None:
        self.pending = branch

    def norm(self, b: GraphBuilder, gain, eps: float, key: str, options: ExportOptions) -> str:
        if self.pending is not None and options.attention == "contrib":
            gamma = b.weight(f"{key}.weight", lambda: float_vector(gain))
            normed, _, _, total = b.op("SkipSimplifiedLayerNormalization", [self.pending, self.hidden, gamma],
                                       f"{key}/skip_rms_norm", n_outputs=4, domain=CONTRIB, epsilon=eps)
            self.hidden, self.pending = total, None
            return normed
        return rms_norm(b, self.settle(b, key), gain, eps, key, options)

    def settle(self, b: GraphBuilder, key: str) -> str:
        if self.pending is not None:
            self.hidden = b.op("Add", [self.hidden, self.pending], f"{key}/residual")
            self.pending = None
        return self.hidden


def embed(b: GraphBuilder, ids: str, table, key: str) -> str:
    """Rows of the embedding table for ids [1, S] -> [1, S, D], dequantized in the graph exactly as
    quant/ does it: s * (q - z) for symmetric codes, s * q + o for affine ones, in float32."""
    arrays: dict = {}

    def role(name: str):
        def make():
            if not arrays:
                arrays.update(embedding_arrays(table))
            return arrays[name]
        return b.weight(f"{key}.{name}", make)

    if not isinstance(table, QuantizedTensor):
        rows = b.op("Gather", [role("table"), ids], f"{key}/gather", axis=0)
        if np.asarray(table).dtype == np.float16:
            rows = b.op("Cast", [rows], f"{key}/to_f32", to=FLOAT)
        return rows
    scheme = table.scheme
    codes = b.op("Gather", [role("qweight"), ids], f"{key}/gather_codes", axis=0)  # [1, S, G, bytes]
    # uint8 -> int32 -> float32: QNN's HTP casts uint8 straight to float as a truth value (any nonzero
    # code became 1.0, measured on onnxruntime-qnn 2.7.0's HTP simulator); through int32 it is exact.
    codes = b.op("Cast", [b.op("Cast", [codes], f"{key}/codes_i32", to=TensorProto.INT32)], f"{key}/codes_f32",
                 to=FLOAT)
    if scheme.bits == 4:
        # nibbles in float arithmetic, exact for 0..255 (bitwise ops are not taken by every provider)
        high = b.op("Floor", [b.op("Div", [codes, b.constant(np.float32(16), np.float32, "f32_16")],
                                   f"{key}/div_16")], f"{key}/high_nibbles")
        low = b.op("Sub", [codes, b.op("Mul", [high, "f32_16"], f"{key}/high_times_16")], f"{key}/low_nibbles")
        axis = b.constant([-1], np.int64, "axes_last")
        pairs = b.op("Concat", [b.op("Unsqueeze", [low, axis], f"{key}/low_pairs"),
                                b.op("Unsqueeze", [high, axis], f"{key}/high_pairs")], f"{key}/pairs", axis=-1)
        codes = b.op("Reshape", [pairs, b.constant([0, 0, 0, -1], np.int64, "shape_flatten_pairs")], f"{key}/codes")
    scales = b.op("Unsqueeze", [b.op("Gather", [role("scales"), ids], f"{key}/gather_scales", axis=0),
                                b.constant([-1], np.int64, "axes_last")], f"{key}/scales")
    if scheme.symmetric:
        zero_point = b.constant(np.float32(symmetric_zero_point(scheme.bits)), np.float32, f"zero_point_{scheme.bits}")
        values = b.op("Mul", [scales, b.op("Sub", [codes, zero_point], f"{key}/centre")], f"{key}/dequantize")
    else:
        offsets = b.op("Unsqueeze", [b.op("Gather", [role("offsets"), ids], f"{key}/gather_offsets", axis=0),
                                     b.constant([-1], np.int64, "axes_last")], f"{key}/offsets")
        values = b.op("Add", [b.op("Mul", [scales, codes], f"{key}/scale"), offsets], f"{key}/dequantize")
    hidden_size = table.shape[1]
    rows = b.op("Reshape", [values, b.constant([0, 0, -1], np.int64, "shape_merge_groups")], f"{key}/rows")
    if table.n_groups * scheme.group_size != hidden_size:
        rows = b.op("Slice", [rows, b.constant([0], np.int64, "zero_1d"),
                              b.constant([hidden_size], np.int64, f"end_{hidden_size}"),
                              b.constant([-1], np.int64, "axes_last")], f"{key}/drop_padding")
    return rows


# --- attention ------------------------------------------------------------------------------------

def _split_heads(b: GraphBuilder, x: str, heads: int, head_dim: int, key: str) -> str:
    return b.op("Reshape", [x, b.constant([0, 0, heads, head_dim], np.int64, f"shape_heads_{heads}x{head_dim}")],
                f"{key}/split_heads")


def _head_norm(b: GraphBuilder, x: str, gain, heads: int, spec, key: str, options: ExportOptions) -> str:
    """Qwen3's per-head RMSNorm of q or k [1, S, H*Dh], before RoPE."""
    per_head = _split_heads(b, x, heads, spec.head_dim, key)
    normed = rms_norm(b, per_head, gain, spec.rms_norm_eps, key, options)
    return b.op("Reshape", [normed, b.constant([0, 0, -1], np.int64, "shape_merge_heads")], f"{key}/merge_heads")


def attention_contrib(b: GraphBuilder, q: str, k: str, v: str, index: int, window: int | None, spec,
                      scale: float) -> str:
    """GroupQueryAttention: RoPE from the cos/sin caches, new K/V written in place at P..P+S-1."""
    attended, _, _ = b.op("GroupQueryAttention",
                [q, k, v, f"past_key.{index}", f"past_value.{index}", "seqlens_k", "total_sequence_length",
                 "cos_cache", "sin_cache"],
                f"layers.{index}/attention", domain=CONTRIB,
                outputs=[f"layers.{index}/attention", f"present_key.{index}", f"present_value.{index}"],
                num_heads=spec.num_attention_heads, kv_num_heads=spec.num_key_value_heads, do_rotary=1,
                rotary_interleaved=0, scale=float(scale), local_window_size=-1 if window is None else int(window))
    return attended


def rotate(b: GraphBuilder, x: str, cos: str, sin: str, key: str) -> str:
    """Half-split RoPE of x [1, S, H, Dh] with cos/sin [1, S, 1, Dh/2]: [x1*c - x2*s, x2*c + x1*s]."""
    x1, x2 = b.op("Split", [x], f"{key}/halves", n_outputs=2, axis=-1, num_outputs=2)
    first = b.op("Sub", [b.op("Mul", [x1, cos], f"{key}/x1_cos"), b.op("Mul", [x2, sin], f"{key}/x2_sin")],
                 f"{key}/first_half")
    second = b.op("Add", [b.op("Mul", [x2, cos], f"{key}/x2_cos"), b.op("Mul", [x1, sin], f"{key}/x1_sin")],
                  f"{key}/second_half")
    return b.op("Concat", [first, second], f"{key}/rotated", axis=-1)


def attention_standard(b: GraphBuilder, q4: str, k4: str, v4: str, index: int, window: int | None, spec,
                       scale: float) -> str:
    """Attention over the cache [C] and the new rows [S] with standard ops; mask from the caller.

    q4 [1, S, Hq, Dh] and k4 [1, S, Hkv, Dh] are already rotated. Returns [1, S, Hq*Dh]; outputs
    new_key.{i} / new_value.{i} [1, Hkv, S, Dh] for the caller to write into the cache."""
    key = f"layers.{index}/attention"
    heads_first = dict(perm=[0, 2, 1, 3])
    q = b.op("Transpose", [q4], f"{key}/q_heads_first", **heads_first)  # [1, Hq, S, Dh]
    new_k = b.op("Transpose", [k4], f"{key}/k_heads_first", outputs=[f"new_key.{index}"], **heads_first)
    new_v = b.op("Transpose", [v4], f"{key}/v_heads_first", outputs=[f"new_value.{index}"], **heads_first)
    keys = b.op("Concat", [f"past_key.{index}", new_k], f"{key}/keys", axis=2)  # [1, Hkv, C+S, Dh]
    values = b.op("Concat", [f"past_value.{index}", new_v], f"{key}/values", axis=2)
    return attend(b, q, keys, values, f"grouped_{mask_input_name(window)}", spec.num_attention_heads,
                  spec.num_key_value_heads, spec.head_dim, scale, key)


def attend(b: GraphBuilder, q: str, keys: str, values: str, grouped_mask: str, n_heads: int, n_kv_heads: int,
           head_dim: int, scale: float, key: str) -> str:
    """softmax(q k^T * scale + mask) v for q [1, Hq, S, Dh] over keys/values [1, Hkv, L, Dh] -> [1, S, Hq*Dh].

    grouped_mask [group*S, L] is the additive mask [S, L] repeated once per query head of a group."""
    # query heads that share a key/value head are adjacent: [1, Hq, S, Dh] -> [1, Hkv, group*S, Dh]
    grouped_q = b.op("Reshape", [q, b.constant([0, n_kv_heads, -1, head_dim], np.int64,
                                               f"shape_group_queries_{n_kv_heads}x{head_dim}")], f"{key}/group_queries")
    scores = b.op("MatMul", [grouped_q, b.op("Transpose", [keys], f"{key}/keys_t", perm=[0, 1, 3, 2])],
                  f"{key}/scores")
    scores = b.op("Mul", [scores, b.constant(np.float32(scale), np.float32, "attention_scale")], f"{key}/scaled")
    scores = b.op("Add", [scores, grouped_mask], f"{key}/masked")
    probs = b.op("Softmax", [scores], f"{key}/softmax", axis=-1)
    out = b.op("MatMul", [probs, values], f"{key}/weighted_values")  # [1, Hkv, group*S, Dh]
    out = b.op("Reshape", [out, b.constant([0, n_heads, -1, head_dim], np.int64,
                                           f"shape_ungroup_queries_{n_heads}x{head_dim}")], f"{key}/ungroup")
    out = b.op("Transpose", [out], f"{key}/tokens_first", perm=[0, 2, 1, 3])
    return b.op("Reshape", [out, b.constant([0, 0, -1], np.int64, "shape_merge_heads")], f"{key}/merge_heads")


def mask_input_name(window: int | None) -> str:
    """The mask input for layers with this sliding window (None: full causal attention)."""
    return "attention_mask" if window is None else f"attention_mask_window_{window}"


def _standard_attention_inputs(b: GraphBuilder, spec, tokens, capacity, windows: set) -> None:
    """cos/sin of this call's positions as [1, S, 1, Dh/2], and one mask per distinct sliding window,
    repeated for the query heads that share a key/value head."""
    half = spec.head_dim // 2
    b.add_input("cos", FLOAT, [tokens, half])
    b.add_input("sin", FLOAT, [tokens, half])
    shape = b.constant([1, -1, 1, half], np.int64, "shape_rope_broadcast")
    b.op("Reshape", ["cos", shape], "cos_broadcast", outputs=["cos_broadcast"])
    b.op("Reshape", ["sin", shape], "sin_broadcast", outputs=["sin_broadcast"])
    total = capacity + tokens if isinstance(tokens, int) and isinstance(capacity, int) else "C+S"
    group = spec.num_attention_heads // spec.num_key_value_heads
    for window in sorted(windows, key=lambda w: -1 if w is None else w):
        name = b.add_input(mask_input_name(window), FLOAT, [tokens, total])
        b.op("Tile", [name, b.constant([group, 1], np.int64, "mask_repeats")], f"grouped_{name}",
             outputs=[f"grouped_{name}"])


def uses_group_query_attention(spec, options: ExportOptions) -> bool:
    """Contrib graphs use GroupQueryAttention when it takes the model's head size (ONNX Runtime's
    kernels need a multiple of 16); otherwise their attention is the standard form, with the same
    inputs, outputs and caller duties as standard graphs."""
    return options.attention == "contrib" and spec.head_dim % 16 == 0


# --- layers and whole graphs ----------------------------------------------------------------------

def decoder_layer(b: GraphBuilder, residual: Residual, index: int, layer, spec, scale: float,
                  options: ExportOptions) -> dict[str, str]:
    """One layer onto the residual stream. A MoE layer stops at its router and returns the values its
    routed experts need ({"ffn_in", "router_logits"}, plus "shared_expert_out"); a dense layer returns {}."""
    p, eps = f"layers.{index}", spec.rms_norm_eps
    x = residual.norm(b, layer.input_norm, eps, f"{p}.input_norm", options)
    q = linear(b, x, layer.q, layer.q_bias, f"{p}.q", options)
    k = linear(b, x, layer.k, layer.k_bias, f"{p}.k", options)
    v = linear(b, x, layer.v, layer.v_bias, f"{p}.v", options)
    if spec.qk_norm_over_projection:  # OLMoE normalises the whole projection, not each head
        q = rms_norm(b, q, layer.q_norm, eps, f"{p}.q_norm", options)
        k = rms_norm(b, k, layer.k_norm, eps, f"{p}.k_norm", options)
    if spec.clip_qkv is not None:  # OLMoE
        low = b.constant(np.float32(-spec.clip_qkv), np.float32, f"clip_low_{spec.clip_qkv!r}")
        high = b.constant(np.float32(spec.clip_qkv), np.float32, f"clip_high_{spec.clip_qkv!r}")
        q, k, v = (b.op("Clip", [t, low, high], f"{p}.{name}/clip") for t, name in ((q, "q"), (k, "k"), (v, "v")))
    per_head_norm = layer.q_norm is not None and not spec.qk_norm_over_projection  # Qwen3
    hq, hkv = spec.num_attention_heads, spec.num_key_value_heads
    if uses_group_query_attention(spec, options):
        if per_head_norm:
            q = _head_norm(b, q, layer.q_norm, hq, spec, f"{p}.q_norm", options)
            k = _head_norm(b, k, layer.k_norm, hkv, spec, f"{p}.k_norm", options)
        attended = attention_contrib(b, q, k, v, index, layer.sliding_window, spec, scale)
    else:  # the caller's attention mask carries causality, the valid length and any sliding window
        q4 = _split_heads(b, q, hq, spec.head_dim, f"{p}.q")
        k4 = _split_heads(b, k, hkv, spec.head_dim, f"{p}.k")
        v4 = _split_heads(b, v, hkv, spec.head_dim, f"{p}.v")
        if per_head_norm:
            q4 = rms_norm(b, q4, layer.q_norm, eps, f"{p}.q_norm", options)
            k4 = rms_norm(b, k4, layer.k_norm, eps, f"{p}.k_norm", options)
        q4 = rotate(b, q4, "cos_broadcast", "sin_broadcast", f"{p}.q_rope")
        k4 = rotate(b, k4, "cos_broadcast", "sin_broadcast", f"{p}.k_rope")
        attended = attention_standard(b, q4, k4, v4, index, layer.sliding_window, spec, scale)
    residual.add(linear(b, attended, layer.o, layer.o_bias, f"{p}.o", options))
    x = residual.norm(b, layer.post_attention_norm, eps, f"{p}.post_attention_norm", options)
    if layer.moe is not None:
        residual.settle(b, f"{p}/moe")
        return moe_router(b, x, layer.moe, p, options)
    residual.add(swiglu_ffn(b, x, layer.gate, layer.up, layer.down, layer.gate_bias, layer.up_bias,
                            layer.down_bias, p, options))
    return {}


def swiglu_ffn(b: GraphBuilder, x: str, gate, up, down, gate_bias, up_bias, down_bias, key: str,
               options: ExportOptions) -> str:
    """down(silu(gate(x)) * up(x))."""
    gated = linear(b, x, gate, gate_bias, f"{key}.gate", options)
    upped = linear(b, x, up, up_bias, f"{key}.up", options)
    silu = b.op("Mul", [gated, b.op("Sigmoid", [gated], f"{key}/sigmoid")], f"{key}/silu")
    return linear(b, b.op("Mul", [silu, upped], f"{key}/swiglu"), down, down_bias, f"{key}.down", options)


def moe_router(b: GraphBuilder, x: str, moe, p: str, options: ExportOptions) -> dict[str, str]:
    """The parts of a MoE block that need no routed expert: router logits x @ router^T (+ bias), and
    the shared expert, scaled per token by sigmoid(x @ g) where the family has that gate (Qwen2-MoE)."""
    values = {"ffn_in": x, "router_logits": linear(b, x, moe.router, moe.router_bias, f"{p}.router", options)}
    if moe.shared_gate is not None:
        shared = swiglu_ffn(b, x, moe.shared_gate, moe.shared_up, moe.shared_down, None, None, None,
                            f"{p}.shared_expert", options)
        if moe.shared_expert_gate is not None:
            gate = linear(b, x, moe.shared_expert_gate, None, f"{p}.shared_expert_gate", options)  # [1, S, 1]
            shared = b.op("Mul", [shared, b.op("Sigmoid", [gate], f"{p}/shared_expert_sigmoid")],
                          f"{p}/shared_expert_gated")
        values["shared_expert_out"] = shared
    return values


def export_graph(model, shape: GraphShape, options: ExportOptions, weights) -> onnx.ModelProto:
    """One graph: the layers [first_layer, end_layer) of `model`, with the embedding and/or the head.

    `model` is anything with the fields of edge.model.Transformer that matter here: spec, layers,
    embed_tokens, final_norm, lm_head, attention_scale. Weights go through `weights` (a store from
    devices/npu/onnx_weights.py)."""
    spec = model.spec
    if not 0 <= shape.first_layer <= shape.end_layer <= spec.num_hidden_layers:
        raise ValueError(f"layer range [{shape.first_layer}, {shape.end_layer}) is outside the model's "
                         f"{spec.num_hidden_layers} layers")
    moe_layers = [i for i in range(shape.first_layer, shape.end_layer) if model.layers[i].moe is not None]
    if moe_layers != ([shape.end_layer - 1] if shape.moe_out else []):
        raise ValueError(f"graph {shape.key}: a graph ends at its one MoE layer, whose routed experts run outside "
                         f"it (moe_out); it holds MoE layers {moe_layers}")
    b = GraphBuilder(weights)
    tokens = shape.tokens or "S"
    capacity = shape.capacity or "C"
    if shape.embed:
        hidden = embed(b, b.add_input("input_ids", TensorProto.INT64, [1, tokens]), model.embed_tokens, "embed_tokens")
    else:
        hidden = b.add_input("hidden_in", FLOAT, [1, tokens, spec.hidden_size])
    layers = range(shape.first_layer, shape.end_layer)
    group_query_attention = uses_group_query_attention(spec, options)
    if layers and group_query_attention:
        b.add_input("seqlens_k", TensorProto.INT32, [1])
        b.add_input("total_sequence_length", TensorProto.INT32, [])
        b.add_input("cos_cache", FLOAT, [capacity, spec.head_dim // 2])
        b.add_input("sin_cache", FLOAT, [capacity, spec.head_dim // 2])
    elif layers:
        windows = {model.layers[i].sliding_window for i in layers}
        _standard_attention_inputs(b, spec, tokens, capacity, windows)
    cache_shape = [1, spec.num_key_value_heads, capacity, spec.head_dim]
    for i in layers:
        b.add_input(f"past_key.{i}", FLOAT, cache_shape)
        b.add_input(f"past_value.{i}", FLOAT, cache_shape)
    residual = Residual(hidden)
    if shape.moe_in:  # the MoE block of layer first_layer - 1 ran outside the graph
        residual.add(b.add_input("moe_in", FLOAT, [1, tokens, spec.hidden_size]))
    moe_values: dict[str, str] = {}
    for i in layers:
        moe_values = decoder_layer(b, residual, i, model.layers[i], spec, model.attention_scale, options)
    hidden = residual.settle(b, "final")
    b.add_output(hidden, "hidden_out", FLOAT, [1, tokens, spec.hidden_size])
    for name, value in moe_values.items():
        width = spec.moe_for_layer(shape.end_layer - 1).num_experts if name == "router_logits" else spec.hidden_size
        b.add_output(value, name, FLOAT, [1, tokens, width])
    if shape.head:
        rows = b.add_input("logits_rows", TensorProto.INT64, [shape.logits_rows or "R"])
        selected = b.op("Gather", [hidden, rows], "head/select_rows", axis=1)  # [1, R, D]
        normed = rms_norm(b, selected, model.final_norm, spec.rms_norm_eps, "final_norm", options)
        head_key = "embed_tokens" if model.lm_head is model.embed_tokens else "lm_head"
        logits = linear(b, normed, model.lm_head, None, head_key, options)
        logits = b.op("Reshape", [logits, b.constant([-1, spec.vocab_size], np.int64, "shape_logits")], "head/rows")
        b.add_output(logits, "logits", FLOAT, [shape.logits_rows or "R", spec.vocab_size])
    for i in layers:
        if group_query_attention:
            b.outputs.append(helper.make_tensor_value_info(f"present_key.{i}", FLOAT, cache_shape))
            b.outputs.append(helper.make_tensor_value_info(f"present_value.{i}", FLOAT, cache_shape))
        else:
            new_shape = [1, spec.num_key_value_heads, tokens, spec.head_dim]
            b.outputs.append(helper.make_tensor_value_info(f"new_key.{i}", FLOAT, new_shape))
            b.outputs.append(helper.make_tensor_value_info(f"new_value.{i}", FLOAT, new_shape))
    metadata = {"zllm_exporter_version": str(EXPORTER_VERSION), "zllm_exporter_digest": EXPORTER_DIGEST,
                "zllm_graph": shape.key,
                "zllm_attention": options.attention, "zllm_affine_int4": options.affine_int4,
                "zllm_accuracy_level": str(options.accuracy_level)}
    return b.model(f"zllm_{shape.key}", metadata)
