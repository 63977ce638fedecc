"""CPU kernels: Numba with hand-written LLVM IR inner loops.

Importing this package configures Numba (cache directory, threading layer) before any kernel
module is imported; kernels compile lazily, on first use, or load from the cache.
"""
from kernels.cpu.runtime import configure_numba

configure_numba()
