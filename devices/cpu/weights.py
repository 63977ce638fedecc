"""Weights as the CPU kernels take them: the checkpoint's own arrays (mmap views, or for a model's
resident weights one copy of them in huge pages: devices/cpu/memory.py; never expanded to f32) plus
the descriptor row that tells a kernel where they are.

A CpuWeight keeps its arrays referenced for as long as it lives: descriptors hold raw addresses,
so the arrays must not be freed (or their mmap closed) while a kernel may read them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from devices.base import DeviceUnavailableError
from devices.cpu.memory import HugePageArena
from kernels.cpu import formats as wf
from kernels.cpu.linear import attach_kernels
from kernels.cpu.llvm_ir import ACT_F32
from quant import GROUP_SIZES, QuantizedTensor


class MissingKernelError(DeviceUnavailableError):
    """A tensor is stored in a form the CPU backend has no kernel for."""


def supported_formats() -> str:
    groups = ",".join(map(str, GROUP_SIZES))
    quantized = ", ".join(f"{dtype}_{'sym' if sym else 'affine'}_g{{{groups}}}{'_f32scale' if scales == 'f32' else ''}"
                          for dtype, sym, scales in wf.QUANTIZED_KINDS)
    floats = ", ".join(str(dtype) for dtype in wf.FLOAT_KINDS)
    return f"matrices in {quantized}, {floats}; vectors in any float dtype"


@dataclass(eq=False)
class CpuWeight:
    """A 2-D weight [N, K]: `descriptor` (kernels/cpu/formats.py) and the arrays it points into."""

    descriptor: np.ndarray
    arrays: tuple
    scheme: str
    shape: tuple[int, int]

    @property
    def kind(self) -> int:
        return int(self.descriptor[wf.W_KIND])

    def __repr__(self) -> str:
        return f"CpuWeight({self.scheme}, shape={self.shape})"


def _contiguous(array: np.ndarray, arena: HugePageArena | None = None) -> np.ndarray:
    # Checkpoint views are C-contiguous already; anything else is copied once, here, never per call.
    if arena is not None:
        return arena.copy(array)
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def prepare_weight(weight, activations: int = ACT_F32, arena: HugePageArena | None = None,
                   bf16_prefill: bool = False):
    """QuantizedTensor or float matrix -> CpuWeight whose decode input is prepared in activation
    style `activations` (kernels/cpu/llvm_ir.py ACT_*) and whose prefill tiles are bf16 when
    `bf16_prefill` (quantized weights only); a float vector (norm gain, bias) -> float32 array.
    With an `arena` a matrix's arrays are copied into its huge pages (devices/cpu/memory.py)."""
    if isinstance(weight, QuantizedTensor):
        scheme = weight.scheme
        kind = wf.QUANTIZED_KINDS.get((scheme.dtype, scheme.symmetric, scheme.scale_dtype))
        if kind is None or scheme.group_size not in GROUP_SIZES:
            raise MissingKernelError(
                f"device 'cpu' has no kernel for a weight stored as {scheme} (shape {weight.shape}); "
                f"its kernels cover {supported_formats()}. Convert the model with a supported --weights, "
                f"or load it with device='reference'")
        codes = _contiguous(weight.qweight, arena)
        scales = _contiguous(weight.scales, arena)
        offsets = None if weight.offsets is None else _contiguous(weight.offsets, arena)
        if scales.dtype == np.float16:  # Numba has no float16: kernels read the bits
            scales, offsets = scales.view(np.uint16), None if offsets is None else offsets.view(np.uint16)
        descriptor = wf.describe_quantized(kind, weight.shape, scheme.group_size, codes, scales, offsets)
        attach_kernels(descriptor, activations, bf16_prefill)
        return CpuWeight(descriptor, (codes, scales, offsets), str(scheme), weight.shape)
    if isinstance(weight, np.ndarray) and weight.ndim == 1 and weight.dtype.kind == "f":
        return np.ascontiguousarray(weight, dtype=np.float32)  # a few KB; kernels read f32 vectors
    if isinstance(weight, np.ndarray) and weight.ndim == 2 and weight.dtype in wf.FLOAT_KINDS:
        matrix = _contiguous(weight, arena)
        view = matrix.view(np.uint16) if matrix.dtype == np.float16 else matrix
        descriptor = attach_kernels(wf.describe_float(matrix), activations)
        return CpuWeight(descriptor, (matrix, view), wf.KIND_NAMES[wf.FLOAT_KINDS[matrix.dtype]], matrix.shape)
    what = f"{weight.dtype} array of shape {weight.shape}" if isinstance(weight, np.ndarray) else type(weight).__name__
    raise MissingKernelError(
        f"device 'cpu' has no kernel for a {what}; its kernels cover {supported_formats()}. "
        f"Convert the model again, or load it with device='reference'")


def as_vector(weight) -> np.ndarray:
    """A norm gain or bias as the float32 vector the kernels read."""
    if isinstance(weight, CpuWeight):
        raise MissingKernelError(f"device 'cpu' expected a vector (norm gain or bias), got a {weight.scheme} "
                                 f"matrix of shape {weight.shape}")
    return np.ascontiguousarray(weight, dtype=np.float32)
