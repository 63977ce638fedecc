"""The `npu` device: zllm models as ONNX graphs on ONNX Runtime execution providers (backend.py)."""
from devices.npu.backend import NpuBackend, NpuSettings

__all__ = ["NpuBackend", "NpuSettings"]
