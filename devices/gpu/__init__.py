"""The `gpu` device: Vulkan compute through wgpu, WGSL kernels from kernels/wgsl."""
from devices.gpu.backend import GpuBackend

__all__ = ["GpuBackend"]
