"""How every CPU kernel is compiled: cache directory, threading layer, fastmath flags, and the
lazily compiled, explicitly typed kernel wrapper.

Numba's cache goes to `<ZLLM_EDGE_HOME or ~/.cache/zllm-edge>/numba-cache/<digest of these
sources>`. Numba picks a cache locator per function when its decorator runs and tries a
user-provided `numba.config.CACHE_DIR` first; without one it would write `__pycache__` beside the
sources, which fails on a read-only install. Every cached kernel here is decorated lazily, right
after `use_cache_dir()` sets that directory.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import threading

import llvmlite.binding as llvm
import numba
from numba import types
from numba.core.codegen import JITCodeLibrary
from numba.core.registry import CPUDispatcher

from edge.core.process_memory import runtime_memory
from kernels.cache_home import zllm_home
from kernels.cpu.isa import configure_codegen

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
        configure_codegen()
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


# --------------------------------------------------------------------------------------------
# Self-contained compilation: a kernel's bits depend on its sources and target, never on history
#
# Numba compiles each helper a kernel calls as a library of its own, links a copy of it into the
# kernel's module with weak (linkonce_odr) linkage, and lets the JIT resolve the kernel's calls by
# symbol name, first definition wins. So a kernel compiled now calls the helper's own library
# (optimised once), while the same kernel loaded from the cache calls its linked copy (optimised
# again inside the kernel), or another cached kernel's copy, whichever was loaded first: with
# fast-math reductions those give different bits. The linked copies are made internal to each
# kernel before it is optimised, so a kernel only ever calls its own copies; and every library of
# the project is optimised at one level, so a helper's IR does not depend on which kernel happened
# to compile it first.

KERNEL_OPT = 3  # LLVM optimisation level of every kernel, helper and linked copy


class _SelfContainedLibrary(JITCodeLibrary):
    """A code library whose linked-in functions are private copies (see above)."""

    def _optimize_final_module(self):
        for function in self._final_module.functions:
            if not function.is_declaration and function.linkage == llvm.Linkage.linkonce_odr:
                function.linkage = "internal"
        super()._optimize_final_module()


@contextlib.contextmanager
def self_contained_compilation():
    """Compile (or load from the cache) with _SelfContainedLibrary at KERNEL_OPT. Holds Numba's
    compiler lock, so no other thread's compilation sees these settings; reentrant (a helper
    compiles while its kernel does)."""
    from numba.core.compiler_lock import global_compiler_lock
    from numba.core.registry import cpu_target

    codegen = cpu_target.target_context.codegen()
    with global_compiler_lock:
        previous = (codegen.__dict__.get("_library_class"), numba.config.OPT)
        codegen._library_class = _SelfContainedLibrary
        numba.config.OPT = KERNEL_OPT
        try:
            yield
        finally:
            if previous[0] is None:
                del codegen._library_class
            else:
                codegen._library_class = previous[0]
            numba.config.OPT = previous[1]


class _HelperDispatcher(CPUDispatcher):
    """A helper's dispatcher: it compiles self-contained whoever asks, a kernel or a test."""

    def compile(self, sig):
        with self_contained_compilation():
            return super().compile(sig)


class Kernel:
    """A Numba kernel with explicit signatures, compiled (or loaded from the cache) on first call.

    Eager `@njit(signature)` compiles when the module is imported, so importing the backend would
    pay for every kernel whether a model needs it or not. This compiles the declared signatures the
    first time the kernel is called and then refuses any other types, so a wrong dtype or a writable
    array where the signature says read-only fails with Numba's typing error instead of compiling a
    new specialisation silently."""

    def __init__(self, function, signatures, parallel: bool = False, name: str | None = None,
                 keep_gil: bool = False):
        self.function = function
        self.signatures = list(signatures)
        self.parallel = parallel
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
                    # the machine code and LLVM's tables stay in the process: the memory budget counts them
                    with runtime_memory.measure(f"kernel {self.function.__module__}.{self.__name__}"), \
                            self_contained_compilation():
                        for signature in self.signatures:
                            dispatcher.compile(signature)
                    dispatcher.disable_compile()
                    self._dispatcher = dispatcher
        return self._dispatcher

    def __call__(self, *args):
        return self.dispatcher(*args)

    @property
    def is_compiled(self) -> bool:
        return self._dispatcher is not None


def kernel(*signatures, parallel: bool = False, keep_gil: bool = False):
    """Decorator: a lazily compiled Kernel with these explicit signatures.

    Kernels release the GIL, so that other threads (the expert loaders) run while they compute.
    `keep_gil` is for kernels of a few microseconds on the model's thread: releasing the GIL there
    hands it to a waiting loader, and taking it back waits for that loader's Python to finish,
    which costs far more than the kernel itself."""

    def wrap(function):
        return Kernel(function, signatures, parallel=parallel, keep_gil=keep_gil)

    return wrap


def cfunc(signature, function):
    """A cached C callback of `function` (kernels/cpu/linear.py calls them through descriptors; it makes
    each one once per process)."""
    use_cache_dir()
    with runtime_memory.measure(f"kernel {function.__module__}.{function.__qualname__} {signature} "
                                f"{id(function)}"), self_contained_compilation():
        return numba.cfunc(signature, cache=True, **JIT_OPTIONS)(function)


def helper(function=None, *, ordered: bool = False):
    """A jitted helper that kernels call. Not cached on its own: it is compiled into each calling
    kernel, whose cache entry holds its private copy, so a warm start never needs it separately.
    (Inlining helpers at Numba IR level instead tripled the fused kernel's cold compile.)

    `ordered`: plain IEEE arithmetic, no fast-math. LLVM may then neither reassociate nor fuse its
    operations, so the helper gives the same bits inlined into any kernel, on any instruction set:
    for the steps that two code paths must agree on exactly (a norm before a cached K/V)."""

    def wrap(function):
        options = dict(JIT_OPTIONS, nopython=True, fastmath=False) if ordered else dict(JIT_OPTIONS, nopython=True)
        return _HelperDispatcher(py_func=function, locals={}, targetoptions=options)

    return wrap if function is None else wrap(function)


def threading_info() -> dict:
    """The threading layer in use (known once a parallel kernel has run) and the thread count."""
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet
        layer = None
    return {"threading_layer": layer, "threads": numba.get_num_threads(),
            "max_threads": numba.config.NUMBA_NUM_THREADS}
