"""Compute kernels: Numba/llvmlite CPU kernels and the shader sources GPU backends dispatch."""
