"""How every CPU kernel is compiled: cache directory, threading layer, fastmath flags, and the
lazily compiled, explicitly typed kernel wrapper.

Numba's cache goes to `<ZLLM_EDGE_HOME or ~/.cache/zllm-edge>/numba-cache/<digest of these
sources>`. Numba picks a cache locator per function when its decorator runs and tries a
user-provided `numba.config.CACHE_DIR` first; without one it would write `__pycache__` beside the
sources, which fails on a read-only install. Every cached kernel here is decorated lazily, right
after `use_cache_dir()` sets that directory.
"""
from __future__ import annotations

import hashlib
import os
import threading

import numba
from numba import types

from kernels.cache_home import zllm_home

# The flags LLVM may use on float math. Reassociation and contraction let loops vectorize and
# fuse multiply-adds; "nnan"/"ninf" are left out on purpose: attention masks are -inf.
FASTMATH = frozenset({"nsz", "arcp", "contract", "afn", "reassoc"})

# The same flags spelled for hand-written LLVM IR (kernels/cpu/llvm_ir.py).
IR_FASTMATH = tuple(sorted(FASTMATH))

# Options of every jitted function. error_model="numpy": a float division by zero gives inf/nan
# as in numpy instead of raising; the check Numba would otherwise insert keeps LLVM from
# vectorising any loop that divides (it made SiLU 5x slower).
JIT_OPTIONS = dict(nogil=True, fastmath=set(FASTMATH), error_model="numpy")

# Threading layers in the order we prefer them. Measured on a 2-core Zen 4 (benchmarks/cpu_decode.py
# prints the layer in use): GNU OpenMP scales a streaming reduction from 30 to 56 GB/s at 2 threads,
# workqueue does not scale at all; tbb is taken next when the `tbb` package is installed.
THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
SPINS_AFTER_REGION = 10_000  # a pool thread's busy-wait after a parallel region (configure_numba)

_lock = threading.Lock()


def numba_cache_dir() -> str:
    return os.path.join(zllm_home(), "numba-cache")


def kernels_source_digest() -> str:
    """A digest of every source file of kernels/cpu.

    Numba invalidates a cached kernel when the kernel's own file changes, not when a helper or an
    IR generator it calls from another file does; keying the cache directory by all the sources
    makes any change start from a clean cache instead of loading stale machine code."""
    folder = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as source:
                digest.update(name.encode() + b"\0" + source.read())
    return digest.hexdigest()[:16]


def use_cache_dir() -> str:
    """Point Numba's cache at numba_cache_dir()/<source digest> (created if missing); returns it.

    Numba reads NUMBA_CACHE_DIR into numba.config.CACHE_DIR only when it is first imported, and a
    function's cache locator is fixed when its decorator runs. Every cached kernel here is decorated
    lazily, on first use, right after this runs: so the directory follows ZLLM_EDGE_HOME as it is
    when a kernel is first needed, not as it was when the package was imported."""
    cache_dir = os.path.join(numba_cache_dir(), _source_digest())
    os.makedirs(cache_dir, exist_ok=True)
    numba.config.CACHE_DIR = cache_dir
    return cache_dir


_digest = None


def _source_digest() -> str:
    global _digest
    if _digest is None:
        _digest = kernels_source_digest()
    return _digest


def configure_numba() -> None:
    """Choose the threading layer and wait policy; runs when kernels/cpu is imported, before any
    parallel kernel has started (Numba and libgomp read these at their first parallel launch)."""
    with _lock:
        # A layer chosen explicitly (NUMBA_THREADING_LAYER) wins; otherwise our priority order.
        if os.environ.get("NUMBA_THREADING_LAYER") is None:
            numba.config.THREADING_LAYER_PRIORITY = list(THREADING_LAYER_PRIORITY)
        # After a parallel region a pool thread spins GOMP_SPINCOUNT times, then sleeps. OpenMP's
        # default (300k spins, milliseconds) burns a core that Python, loading threads or other
        # processes need; passive waiting alone (0 spins) makes every launch wake a sleeping thread,
        # ~50 us here: twice the time of a MoE layer's three-region expert kernel. 10k spins (~0.5 ms
        # on Zen 4) outlast the Python between a decode's launches (0.1-0.3 ms): measured on the
        # MoEfied SmolLM2, 2 threads, all experts resident, 68 -> 137-153 tok/s; dense decode a few
        # percent. libgomp reads both when Numba first loads its OpenMP layer (the first parallel
        # kernel); an explicit spin count wins over the wait policy.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        os.environ.setdefault("GOMP_SPINCOUNT", str(SPINS_AFTER_REGION))


def readonly(dtype, ndim: int, layout: str = "C") -> types.Array:
    """The Numba type of a read-only array (an mmap view of the checkpoint)."""
    return types.Array(dtype, ndim, layout, readonly=True)


def mutable(dtype, ndim: int, layout: str = "C") -> types.Array:
    return types.Array(dtype, ndim, layout)


class Kernel:
    """A Numba kernel with explicit signatures, compiled (or loaded from the cache) on first call.

    Eager `@njit(signature)` compiles when the module is imported, so importing the backend would
    pay for every kernel whether a model needs it or not. This compiles the declared signatures the
    first time the kernel is called and then refuses any other types, so a wrong dtype or a writable
    array where the signature says read-only fails with Numba's typing error instead of compiling a
    new specialisation silently."""

    def __init__(self, function, signatures, parallel: bool = False, name: str | None = None,
                 optimization: int | None = None, keep_gil: bool = False):
        self.function = function
        self.signatures = list(signatures)
        self.parallel = parallel
        self.optimization = optimization
        self.keep_gil = keep_gil
        self.__name__ = name or function.__name__
        self.__doc__ = function.__doc__
        self._dispatcher = None

    @property
    def dispatcher(self):
        if self._dispatcher is None:
            with _lock:
                if self._dispatcher is None:
                    use_cache_dir()
                    options = dict(JIT_OPTIONS, nogil=not self.keep_gil)
                    dispatcher = numba.njit(cache=True, parallel=self.parallel, **options)(self.function)
                    default_level = numba.config.OPT
                    if self.optimization is not None:
                        numba.config.OPT = self.optimization
                    try:
                        for signature in self.signatures:
                            dispatcher.compile(signature)
                    finally:
                        numba.config.OPT = default_level
                    dispatcher.disable_compile()
                    self._dispatcher = dispatcher
        return self._dispatcher

    def __call__(self, *args):
        return self.dispatcher(*args)

    @property
    def is_compiled(self) -> bool:
        return self._dispatcher is not None


def kernel(*signatures, parallel: bool = False, optimization: int | None = None, keep_gil: bool = False):
    """Decorator: a lazily compiled Kernel with these explicit signatures (and, if given, this LLVM
    optimisation level instead of Numba's default 3).

    Kernels release the GIL, so that other threads (the expert loaders) run while they compute.
    `keep_gil` is for kernels of a few microseconds on the model's thread: releasing the GIL there
    hands it to a waiting loader, and taking it back waits for that loader's Python to finish,
    which costs far more than the kernel itself."""

    def wrap(function):
        return Kernel(function, signatures, parallel=parallel, optimization=optimization, keep_gil=keep_gil)

    return wrap


def helper(function):
    """A jitted helper that kernels call. Not cached on its own: it is compiled into each calling
    kernel, whose cache entry holds it, so a warm start never needs it separately. (Inlining
    helpers at Numba IR level instead tripled the fused kernel's cold compile.)"""
    return numba.njit(**JIT_OPTIONS)(function)


def threading_info() -> dict:
    """The threading layer in use (known once a parallel kernel has run) and the thread count."""
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet
        layer = None
    return {"threading_layer": layer, "threads": numba.get_num_threads(),
            "max_threads": numba.config.NUMBA_NUM_THREADS}
