"""The CPU backend: Numba kernels (kernels/cpu) behind the backend contract, and a fused forward."""
from devices.cpu.backend import CpuBackend

__all__ = ["CpuBackend"]
