"""Weight kinds the CPU kernels can multiply, and the descriptor row that tells a kernel where a
weight's arrays are.

A descriptor is an int64 row (columns W_*): kernels take weights as descriptors so that one
compiled signature serves every model, whatever its number of tensors and whatever mix of schemes
(int8 attention with int4 MLPs, say). The arrays it points at must outlive every call; the
backend keeps them referenced (devices/cpu/weights.py).
"""
from __future__ import annotations

import numpy as np

from kernels.cpu.llvm_ir import CHUNK, IrFormat

# Kinds, by the code stored in W_KIND. The *_F32SCALE kinds keep their scales (and offsets) as float32:
# GGUF's K-quants, kept as they are (quant/gguf_import.py).
(F32, F16, INT4_SYM, INT4_AFFINE, INT8_SYM, INT8_AFFINE,
 INT4_SYM_F32SCALE, INT4_AFFINE_F32SCALE, INT8_SYM_F32SCALE, INT8_AFFINE_F32SCALE) = range(10)

IR_FORMATS = {
    F32: IrFormat("f32", 32),
    F16: IrFormat("f16", 16),
    INT4_SYM: IrFormat("int4_sym", 4),
    INT4_AFFINE: IrFormat("int4_affine", 4, affine=True),
    INT8_SYM: IrFormat("int8_sym", 8),
    INT8_AFFINE: IrFormat("int8_affine", 8, affine=True),
    INT4_SYM_F32SCALE: IrFormat("int4_sym_f32scale", 4, scale_bytes=4),
    INT4_AFFINE_F32SCALE: IrFormat("int4_affine_f32scale", 4, affine=True, scale_bytes=4),
    INT8_SYM_F32SCALE: IrFormat("int8_sym_f32scale", 8, scale_bytes=4),
    INT8_AFFINE_F32SCALE: IrFormat("int8_affine_f32scale", 8, affine=True, scale_bytes=4),
}
KIND_NAMES = {kind: fmt.name for kind, fmt in IR_FORMATS.items()}
# (dtype, symmetric, scale dtype) of a quantized scheme -> kind; every group size (32, 64, 128) is served.
QUANTIZED_KINDS = {("int4", True, "f16"): INT4_SYM, ("int4", False, "f16"): INT4_AFFINE,
                   ("int8", True, "f16"): INT8_SYM, ("int8", False, "f16"): INT8_AFFINE,
                   ("int4", True, "f32"): INT4_SYM_F32SCALE, ("int4", False, "f32"): INT4_AFFINE_F32SCALE,
                   ("int8", True, "f32"): INT8_SYM_F32SCALE, ("int8", False, "f32"): INT8_AFFINE_F32SCALE}
FLOAT_KINDS = {np.dtype(np.float32): F32, np.dtype(np.float16): F16}

# Descriptor columns.
W_KIND = 0
W_ROWS = 1  # N
W_COLS = 2  # K
W_COLS_PADDED = 3  # K rounded up to whole groups (quantized) or to a chunk of 32 (floats)
W_DATA = 4  # address of codes [N, n_groups, group bytes] or of the floats [N, K]
W_ROW_BYTES = 5
W_SCALES = 6  # address of f16 (or f32: W_SCALE_BYTES) scales [N, n_groups], 0 for floats
W_OFFSETS = 7  # address of the offsets [N, n_groups], as the scales, 0 unless affine
W_GROUPS = 8  # groups per row
W_CHUNKS_PER_GROUP = 9  # group size / 32
W_MATVEC_FN = 10  # addresses of the kind's compiled kernels (kernels/cpu/linear.py attach_kernels)
W_GEMM_FN = 11
W_DEQUANTIZE_FN = 12
W_ACTIVATIONS = 13  # how decode prepares this weight's input: llvm_ir.ACT_F32, ACT_INT8 or ACT_INT8_VNNI
W_DEQUANTIZE_BF16_FN = 14  # the kind's dequantize into bf16 tiles, where prefill runs bf16 (else 0)
W_PREFILL_INT8 = 15  # 1 when prefill multiplies int8-quantized tokens (integer panels), else 0 (tiles)
W_SCALE_BYTES = 16  # 2 (f16) or 4 (f32) per scale and offset; 0 for floats
W_FIELDS = 17


def padded_cols(cols: int) -> int:
    """K rounded up to a whole chunk of 32: the length of every prepared input vector."""
    return -(-cols // CHUNK) * CHUNK


def describe_float(array: np.ndarray) -> np.ndarray:
    """Descriptor of a float32/float16 weight [N, K] (C-contiguous)."""
    rows, cols = array.shape
    row = np.zeros(W_FIELDS, np.int64)
    row[W_KIND] = FLOAT_KINDS[array.dtype]
    row[W_ROWS], row[W_COLS], row[W_COLS_PADDED] = rows, cols, padded_cols(cols)
    row[W_DATA] = array.ctypes.data
    row[W_ROW_BYTES] = cols * array.itemsize
    return row


def describe_quantized(kind: int, shape: tuple[int, int], group_size: int, codes: np.ndarray,
                       scales: np.ndarray, offsets: np.ndarray | None) -> np.ndarray:
    """Descriptor of a quantized weight: codes uint8 [N, n_groups, group bytes], scales (and offsets)
    [N, n_groups] of the kind's scale width (float16 as uint16 bits, or float32), all C-contiguous."""
    rows, cols = shape
    n_groups = scales.shape[1]
    row = np.zeros(W_FIELDS, np.int64)
    row[W_KIND] = kind
    row[W_ROWS], row[W_COLS], row[W_COLS_PADDED] = rows, cols, n_groups * group_size
    row[W_DATA] = codes.ctypes.data
    row[W_ROW_BYTES] = codes.shape[1] * codes.shape[2]
    row[W_SCALES] = scales.ctypes.data
    row[W_OFFSETS] = 0 if offsets is None else offsets.ctypes.data
    row[W_GROUPS] = n_groups
    row[W_CHUNKS_PER_GROUP] = group_size // CHUNK
    row[W_SCALE_BYTES] = IR_FORMATS[kind].scale_bytes
    return row
