"""Our INT4/INT8 bytes through a one-node MatMulNBits graph equal the dequantized reference matmul.

Each case quantizes a random weight [N, K] with K = 200 (not a multiple of any group size, so the
last group of every row is zero-padded) and runs x [5, K] through a graph holding exactly one
MatMulNBits node (accuracy_level 0: float32 activations) on ONNX Runtime's CPU provider.

Bound, per output element n: |y_ort - y_exact| <= (K + 4) * 2^-24 * sum_k |x_k| * M_nk, where
y_exact = x . w in exact arithmetic over the float32 weights w that quant/ dequantizes, and
M_nk = |s (q - z)| (symmetric) or |s q| + |o| (affine). (K + 4) u bounds the float32 rounding of a
length-K dot product (K u), of forming each weight inside the kernel (one product, one
difference), and of the float zero point z = -o/s (|o| u); the group-offset form sums |s q| and
|o| terms separately, hence M. Measured errors are two to three orders below the bound.
"""
from __future__ import annotations

import numpy as np
import pytest

onnxruntime = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, numpy_helper  # noqa: E402

from devices import reference  # noqa: E402
from devices.npu import NpuBackend  # noqa: E402
from devices.npu.onnx_export import ExportOptions, GraphBuilder, linear  # noqa: E402
from devices.npu.onnx_weights import InlineWeights  # noqa: E402
from quant import QuantizedTensor  # noqa: E402
from quant.formats import CODECS, Scheme, quantize, symmetric_zero_point  # noqa: E402

UNIT_ROUNDOFF = 2.0 ** -24
N, K = 48, 200


def one_node_graph(weight: QuantizedTensor, affine_int4: str):
    b = GraphBuilder(InlineWeights())
    b.add_input("x", TensorProto.FLOAT, [1, "T", K])
    y = linear(b, "x", weight, None, "w", ExportOptions("contrib", affine_int4, accuracy_level=0))
    b.add_output(y, "y", TensorProto.FLOAT, [1, "T", N])
    return b.model("one_matmul_nbits", {})


def magnitude(weight: QuantizedTensor) -> np.ndarray:
    """M [N, K]: per-weight magnitude of the terms that are rounded (module docstring)."""
    codes = CODECS[weight.scheme.bits].unpack(weight.qweight).astype(np.float64)
    scales = weight.scales.astype(np.float64)[..., None]
    if weight.scheme.symmetric:
        terms = np.abs(scales * (codes - symmetric_zero_point(weight.scheme.bits)))
    else:
        terms = np.abs(scales * codes) + np.abs(weight.offsets.astype(np.float64))[..., None]
    return terms.reshape(N, -1)[:, :K]


CASES = [(bits, symmetric, group, mode)
         for bits in (4, 8) for symmetric in (True, False) for group in (32, 64, 128)
         for mode in (("group_offset", "zero_point") if bits == 4 and not symmetric else ("group_offset",))]


@pytest.mark.parametrize("bits,symmetric,group,affine_int4", CASES)
def test_matmul_nbits_equals_dequantized_matmul(bits, symmetric, group, affine_int4):
    rng = np.random.default_rng(bits * 1000 + group + symmetric)
    weight = rng.standard_normal((N, K)).astype(np.float32)
    weight[0, :group] = 0.5  # a constant group: affine scale 0 (the zero-point form rewrites it exactly)
    weight[1, :group] = 0.0
    quantized = quantize(weight, Scheme(f"int{bits}", group, symmetric))
    model = one_node_graph(quantized, affine_int4)

    nodes = [n.op_type for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert nodes == ["MatMulNBits"]
    # the B input is our bytes, unchanged (no requantization), unless a scale-0 group was rewritten
    b_input = next(i for i in model.graph.initializer if i.name == model.graph.node[0].input[1])
    stored = numpy_helper.to_array(b_input)
    assert stored.shape == quantized.qweight.shape
    rewritten_groups = (quantized.scales == 0) & (not symmetric and affine_int4 == "zero_point")
    np.testing.assert_array_equal(stored[~rewritten_groups], quantized.qweight[~rewritten_groups])

    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((5, K)).astype(np.float32)
    y = session.run(None, {"x": x[None]})[0][0]
    exact = x.astype(np.float64) @ quantized.dequantize().astype(np.float64).T
    bound = (K + 4) * UNIT_ROUNDOFF * (np.abs(x).astype(np.float64) @ magnitude(quantized).T)
    excess = np.abs(y - exact) - bound
    assert excess.max() <= 0, f"error exceeds the bound by {excess.max():.3g}"


def test_backend_operations_match_the_reference():
    """The op-level contract (each op one small graph on the provider) against the numpy oracle,
    in float32: bound 1e-5 relative to the largest output, a few ulps of accumulated rounding."""
    backend = NpuBackend(variant="cpu,accuracy_level=0")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    weight = quantize((0.1 * rng.standard_normal((96, 64))).astype(np.float32), Scheme("int4", 32, False))
    gain = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(96)).astype(np.float32)
    q = rng.standard_normal((5, 4, 16)).astype(np.float32)
    k = rng.standard_normal((9, 2, 16)).astype(np.float32)
    v = rng.standard_normal((9, 2, 16)).astype(np.float32)
    cos, sin = rng.standard_normal((2, 5, 8)).astype(np.float32)
    table = quantize(rng.standard_normal((20, 64)).astype(np.float32), Scheme("int4", 32, True))
    ids = np.array([3, 0, 19])
    pairs = {
        "linear": (backend.linear(x, weight, bias), reference.linear(x, weight, bias)),
        "rms_norm": (backend.rms_norm(x, gain, 1e-6), reference.rms_norm(x, gain, 1e-6)),
        "rope": (backend.rope(q, cos, sin), reference.rope(q, cos, sin)),
        "attention": (backend.attention(q, k, v, np.arange(4, 9), np.arange(9), 0.25, 3),
                      reference.attention(q, k, v, np.arange(4, 9), np.arange(9), 0.25, 3)),
        "swiglu": (backend.swiglu(x, x), reference.swiglu(x, x)),
        "embed": (backend.embed(table, ids), reference.embed(table, ids)),
    }
    for name, (ours, theirs) in pairs.items():
        assert ours.shape == theirs.shape, name
        assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(theirs).max(), name
    np.testing.assert_array_equal(pairs["embed"][0], pairs["embed"][1])  # dequantized in the same order: exact
