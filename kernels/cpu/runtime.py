"""How every CPU kernel is compiled: cache directory, threading layer, fastmath flags, and the
lazily compiled, explicitly typed kernel wrapper.

Numba's cache goes to `<ZLLM_EDGE_HOME or ~/.cache/zllm-edge>/numba-cache/<digest of these
sources>`, and only there: Numba's own locators would fall back to `__pycache__` beside the sources
(which fails on a read-only install) when that folder cannot be written. Every cached kernel here is
created lazily, right after `use_cache_dir()` sets that directory, with a cache whose files carry a
checksum (see "The disk cache, checked" below): a damaged file is said and its kernel compiled again.
A home that cannot be written costs a warning line and a compile in each process, nothing else.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import sys
import threading
import time

import llvmlite.binding as llvm
import numba
from numba import types
from numba.core import sigutils
from numba.core.caching import (CompileResultCacheImpl, FunctionCache, IndexDataCacheFile, UserProvidedCacheLocator,
                                _cache_log)
from numba.core.ccallback import CFunc
from numba.core.codegen import JITCodeLibrary
from numba.core.registry import CPUDispatcher
from numba.core.serialize import dumps

from edge.core.process_memory import runtime_memory
from kernels.cache_home import home_not_writable, zllm_home
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
    when a kernel is first needed, not as it was when the package was imported. A directory that
    cannot be created is said when the first kernel fails to be saved there (_CheckedCache)."""
    cache_dir = os.path.join(numba_cache_dir(), _source_digest())
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError:
        pass  # kernels are compiled all the same; saving the first one says why they are not kept
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


class _HelperLibrary(_SelfContainedLibrary):
    """A helper's library as LLVM IR only: every kernel that calls the helper links a private copy
    and optimises it in place (above), so optimising the helper on its own and making machine code
    for it would be work no kernel uses (it was most of a cold start's compile time). Finalizing
    links the helpers it calls and stops there; its functions have no address."""

    def finalize(self):
        from numba.core.compiler_lock import require_global_compiler_lock

        require_global_compiler_lock()
        self._raise_if_finalized()
        for library in dict.fromkeys(self._linking_libraries):
            self._reload_init.update(library._reload_init)
            self._final_module.link_in(library._get_module_for_linking(), preserve=True)
        self._final_module.verify()
        self._finalized = True

    def get_pointer_to_function(self, name):
        return 0  # no machine code: a Python call of a helper goes through _HelperDispatcher.__call__


@contextlib.contextmanager
def _ir_only_libraries():
    """Within self_contained_compilation: the libraries made now are _HelperLibrary ones."""
    from numba.core.registry import cpu_target

    context = cpu_target.target_context
    codegen = context.codegen()
    previous = codegen._library_class, context.__dict__.get("get_executable")
    codegen._library_class = _HelperLibrary
    context.get_executable = _address_free_executable
    try:
        yield
    finally:
        codegen._library_class = previous[0]
        if previous[1] is None:
            del context.get_executable
        else:
            context.get_executable = previous[1]


def _address_free_executable(library, fndesc, env):
    """CPUContext.get_executable for a _HelperLibrary: the function object that stands for the
    overload (the key kernels' lowering finds it by), with no machine code behind it."""
    from numba import _dynfunc

    return _dynfunc.make_function(fndesc.lookup_module(), fndesc.qualname.split(".")[-1],
                                  f"IR-only helper {fndesc.qualname!r}", 0, env, (library,))


class _HelperDispatcher(CPUDispatcher):
    """A helper's dispatcher. The overloads a kernel's compilation asks for are IR only
    (_HelperLibrary); a call from Python (a test of the helper) runs a separately compiled copy
    with machine code, compiled self-contained as a kernel is."""

    def compile(self, sig):
        with self_contained_compilation(), _ir_only_libraries():
            return super().compile(sig)

    def __call__(self, *args, **kwargs):
        callable_copy = self.__dict__.get("_callable_copy")
        if callable_copy is None:
            callable_copy = self._callable_copy = _CallableHelper(py_func=self.py_func, locals={},
                                                                  targetoptions=dict(self.targetoptions))
        return callable_copy(*args, **kwargs)


class _CallableHelper(CPUDispatcher):
    """A helper compiled with machine code, for calls from Python."""

    def compile(self, sig):
        with self_contained_compilation():
            return super().compile(sig)


# --------------------------------------------------------------------------------------------
# The disk cache, checked
#
# Numba's cache files are pickles read back unchecked: a truncated or overwritten index or data file
# raises from pickle at the kernel's first call, and machine code damaged inside an intact pickle is
# loaded and run (it crashed the process when tried). Here each file holds a sha256 of its contents
# ahead of them and is used only when they match; a damaged one is said on stderr, once, and its
# kernel compiled again, the new file replacing it. A data file also holds the index key it was
# written for: two processes saving the same kernel's signatures at once can otherwise leave one
# signature's name pointing at the other's code. A cache that cannot be written is said once; the
# kernels compiled are used all the same.

CACHE_FILE_MAGIC = b"zllm-edge numba cache 1\n"
_said: set[str] = set()  # paths (damaged files, unwritable folders) already said in this process


def _say_once(path: str, message: str) -> None:
    if path not in _said:
        _said.add(path)
        print(message, file=sys.stderr)


class _CheckedCacheFile(IndexDataCacheFile):
    """Numba's index and data files, each checksummed (see above)."""

    def save(self, key, data):
        overloads = self._load_index()
        data_name = overloads.get(key)
        if data_name is None:
            taken = set(overloads.values())
            data_name = next(name for name in map(self._data_name, range(1, len(taken) + 2)) if name not in taken)
        self._save_data(data_name, (key, data))  # the code first: an index never names a file not yet there
        if overloads.get(key) != data_name:
            self._save_index({**overloads, key: data_name})

    def load(self, key):
        data_name = self._load_index().get(key)
        if data_name is None:
            return None
        path = self._data_path(data_name)
        if not os.path.exists(path):
            self._say(path, f"is missing, though its index {self._index_path} names it")
            return None
        payload = self._read(path)
        if payload is None:
            return None
        stored_key, data = pickle.loads(payload)
        if stored_key != key:
            self._say(path, "holds the code of another signature (written over by another process)")
            return None
        _cache_log("[cache] data loaded from %r", path)
        return data

    def _load_index(self):
        payload = self._read(self._index_path)
        if payload is None:
            return {}
        version, stamp, overloads = pickle.loads(payload)
        _cache_log("[cache] index loaded from %r", self._index_path)
        if version != self._version or stamp != self._source_stamp:
            return {}  # another Numba, or the kernel's source changed: compiled again and replaced
        return overloads

    def _save_index(self, overloads):
        self._write(self._index_path, dumps((self._version, self._source_stamp, overloads)))
        _cache_log("[cache] index saved to %r", self._index_path)

    def _save_data(self, name, data):
        path = self._data_path(name)
        self._write(path, dumps(data))
        _cache_log("[cache] data saved to %r", path)

    def _write(self, path: str, payload: bytes) -> None:
        with self._open_for_write(path) as f:  # (written aside, then renamed)
            f.write(CACHE_FILE_MAGIC + hashlib.sha256(payload).digest() + payload)

    def _read(self, path: str) -> bytes | None:
        """A cache file's payload; None when it is missing, or damaged (said)."""
        try:
            with open(path, "rb") as f:
                content = f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            self._say(path, f"cannot be read ({exc.strerror or exc})")
            return None
        header = len(CACHE_FILE_MAGIC) + hashlib.sha256().digest_size
        if not content:
            problem = "empty"
        elif not content.startswith(CACHE_FILE_MAGIC[:len(content)]):
            problem = "not a zllm-edge kernel cache file"
        elif len(content) <= header:
            problem = f"cut short at {len(content)} bytes"
        elif hashlib.sha256(content[header:]).digest() != content[len(CACHE_FILE_MAGIC):header]:
            problem = "its contents do not match their sha256: cut short or overwritten"
        else:
            return content[header:]
        self._say(path, f"is damaged ({problem})")
        return None

    def _say(self, path: str, what: str) -> None:
        _say_once(path, f"the kernel cache file {path} {what}; compiling the kernel again")


class _HomeCacheLocator(UserProvidedCacheLocator):
    """numba.config.CACHE_DIR (use_cache_dir()), never a folder beside the sources: a folder that
    cannot be written is found out, and said, when a kernel is saved."""

    @classmethod
    def from_function(cls, py_func, py_file):
        return cls(py_func, py_file)


class _HomeCacheImpl(CompileResultCacheImpl):
    _locator_classes = [_HomeCacheLocator]


class _CheckedCache(FunctionCache):
    """Numba's per-function cache with checked files, in the home only; a failed save is said, once
    per folder, and the kernel just compiled used all the same."""

    _impl_class = _HomeCacheImpl

    def __init__(self, py_func):
        super().__init__(py_func)
        self._cache_file = _CheckedCacheFile(self._cache_path, self._impl.filename_base,
                                             self._impl.locator.get_source_stamp())

    def save_overload(self, sig, data):
        try:
            super().save_overload(sig, data)
        except OSError as exc:
            _say_once(self._cache_path, f"warning: {home_not_writable(self._cache_path, exc)} (until then each "
                                        f"process compiles its kernels anew)")


class _KernelDispatcher(CPUDispatcher):
    """A kernel's dispatcher, cached in the home with checked files."""

    def enable_caching(self):
        self._cache = _CheckedCache(self.py_func)


class _CachedCFunc(CFunc):
    """A C callback cached in the home with checked files."""

    def enable_caching(self):
        self._cache = _CheckedCache(self._pyfunc)


# --------------------------------------------------------------------------------------------
# Saying what compiles
#
# A kernel found in the cache loads in milliseconds; one compiled now takes seconds, the fused
# forward most of the first run. A compile still running after SAY_AFTER seconds is said on stderr:
# which kernel, how many this process compiled before it, and the seconds so far (rewritten in place
# on a terminal, once a line otherwise), then the time it took. Off until a front end turns it on
# (the command line does, unless --quiet): a library says nothing on its own.


class CompileProgress:
    SAY_AFTER = 1.0  # seconds: longer than any load from the cache
    TICK = 1.0

    def __init__(self):
        self.enabled = False
        self.stream = None  # None: sys.stderr as it is when a compile starts (a caller may have replaced it)
        self.compiled = 0  # kernels this process compiled (not loaded) so far

    @contextlib.contextmanager
    def compiling(self, what: str):
        if not self.enabled:
            yield
            return
        started, done = time.monotonic(), threading.Event()
        said = threading.Event()
        stream = self.stream or sys.stderr
        live = getattr(stream, "isatty", lambda: False)()
        before = self.compiled

        def say() -> None:
            if done.wait(self.SAY_AFTER):
                return
            said.set()
            while True:
                line = (f"compiling cpu kernel {what} ({before} compiled before it; the first run on this CPU "
                        f"compiles, later runs load them from {numba_cache_dir()}): "
                        f"{time.monotonic() - started:.0f} s")
                _write(stream, ("\r" + line) if live else line + "\n")
                if not live or done.wait(self.TICK):
                    return

        ticker = threading.Thread(target=say, name="zllm-compile-progress", daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()
            if said.is_set():
                self.compiled += 1
                ending = f"compiled cpu kernel {what} in {time.monotonic() - started:.1f} s"
                _write(stream, ("\r\x1b[K" + ending + "\n") if live else ending + "\n")


def _write(stream, text: str) -> None:
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError):  # a closed or broken stderr must not stop the compile
        pass


compile_progress = CompileProgress()


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
                    options = dict(JIT_OPTIONS, nogil=not self.keep_gil, parallel=self.parallel, nopython=True,
                                   boundscheck=None)  # (what numba.njit passes)
                    dispatcher = _KernelDispatcher(py_func=self.function, locals={}, targetoptions=options)
                    dispatcher.enable_caching()
                    # the machine code and LLVM's tables stay in the process: the memory budget counts them
                    with compile_progress.compiling(self.__name__.strip("_")), \
                            runtime_memory.measure(f"kernel {self.function.__module__}.{self.__name__}"), \
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


def cfunc(signature, function, *, ordered: bool = False):
    """A cached C callback of `function` (kernels/cpu/linear.py calls them through descriptors; it makes
    each one once per process). What numba.cfunc(signature, cache=True) does, with the checked cache.
    `ordered`: no fast-math, as for helpers (below): Numba's fast-math flags reach the IR intrinsics
    inlined into the callback too, and would let LLVM fuse a product and a sum that must round apart."""
    use_cache_dir()
    options = dict(JIT_OPTIONS, fastmath=False) if ordered else dict(JIT_OPTIONS)
    with compile_progress.compiling(function.__name__.strip("_")), \
            runtime_memory.measure(f"kernel {function.__module__}.{function.__qualname__} {signature} {id(function)}"), \
            self_contained_compilation():
        callback = _CachedCFunc(function, sigutils.normalize_signature(signature), locals={}, options=options)
        callback.enable_caching()
        callback.compile()
        return callback


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
