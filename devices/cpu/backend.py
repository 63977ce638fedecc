"""CpuBackend: the backend contract (devices/base.py) on Numba kernels, plus a fused forward.

Every op-level method runs a kernel from kernels/cpu; none of them falls back to the numpy
reference. `compile_forward` returns the fused executor (devices/cpu/executor.py) that runs a
whole forward pass in one compiled call.
"""
from __future__ import annotations

import os
import platform
import threading

import numpy as np

from devices.base import DeviceUnavailableError
from devices.cache_buffers import CacheBuffer, KvCodec, StoredRows
from devices.cpu.memory import HugePageArena
from devices.cpu.weights import CpuWeight, as_vector, prepare_weight
from edge.core.contract import Capabilities, ComputeThreads
from edge.core.kv import KV_FORMATS
from edge.core.moe import as_chosen
from edge.core.process_memory import huge_pages_available
from edge.core.spec import widest_projection_input

try:
    import numba

    import kernels.cpu  # noqa: F401  (configures Numba's cache and threading before kernels load)
    from kernels.cpu import attention as attention_kernels
    from kernels.cpu import attention_stored as stored_attention_kernels
    from kernels.cpu import elementwise, isa, kv_quant
    from kernels.cpu import linear as linear_kernels
    from kernels.cpu import moe as moe_kernels
    from kernels.cpu.cpu_probe import best_int8_dot, bf16_prefill_is_faster, probe_first_needs, runs_bf16
    from kernels.cpu.formats import padded_cols
    from kernels.cpu.llvm_ir import ACT_F32, ACT_INT8, INT8_DOTS
    from kernels.cpu.llvm_prefill import integer_prefill_runs
    from kernels.cpu.runtime import threading_info
except ImportError as exc:  # pragma: no cover - numba is a declared dependency
    raise DeviceUnavailableError(f"device 'cpu' needs numba and llvmlite ({exc}); pip install numba") from None


_launching = threading.local()  # the Numba thread count this thread last set
# Multiply-adds below which an op-by-op kernel runs on the calling thread alone (use_threads):
# splitting in two pays once half the kernel's time (~10 G multiply-adds/s on one core) exceeds the
# ~100 us it takes to wake a sleeping pool thread. On the MoEfied SmolLM2 at 2 threads this took
# op-by-op decode from 33 to 52-54 tok/s (1 thread: 60); decode projections (576 x 576) stay on
# one thread, the LM head splits.
PARALLEL_MIN_WORK = 1 << 21


def _thread_count(threads: int | None) -> int:
    available = numba.config.NUMBA_NUM_THREADS
    if threads is None:
        return available
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    if threads > available:
        raise ValueError(f"threads={threads} but Numba may start at most {available} threads on this machine "
                         f"(NUMBA_NUM_THREADS); pass threads <= {available}")
    return threads


# How decode multiplies quantized weights, by device variant ("cpu" alone: the fastest here, below).
ACTIVATION_VARIANTS = ("int8", "f32")
ACTIVATION_HELP = ("int8 quantizes each decode matmul input to int8 per block of 32 values and sums integer "
                   "products, as llama.cpp does, an input error of at most 1/254 of the block's largest value, and "
                   "multiplies prefill's tiles in bf16 where the CPU runs AVX-512 BF16; f32 keeps every input in f32")


def default_activations() -> tuple[str, str]:
    """The variant plain "cpu" runs, and why: int8 where this CPU runs an integer dot-product
    instruction (it reads a quarter of f32's input bytes and sums 4x as many products per
    instruction), f32 where only generic vector code would sum int8 products (slower than f32)."""
    style = best_int8_dot()
    if style == ACT_INT8:
        return "f32", "no int8 dot-product instruction runs on this CPU, and generic int8 code is slower than f32"
    return "int8", f"this CPU runs {INT8_DOTS[style].name} for int8 dot products"

NUMBA_KV_CODEC = KvCodec(kv_quant.quantize_int8, kv_quant.dequantize_int8, kv_quant.widen_halves)


def prefill_tile_bytes(spec, tokens: int) -> int:
    """One compute thread's prefill scratch for a call of `tokens` tokens: its tile (tile_scratch_rows rows
    as wide as the widest projection input) and its block of results (devices/cpu/executor.py allocates
    both)."""
    tile = linear_kernels.tile_scratch_rows(tokens) * padded_cols(widest_projection_input(spec))
    return 4 * (tile + linear_kernels.BLOCK_FLOATS)


class CpuBackend:
    name = "cpu"

    def __init__(self, threads: int | None = None, variant: str | None = None):
        isa.check_configuration()  # a bad ZLLM_EDGE_ISA, or a target the JIT cannot serve
        if variant is not None and variant not in ACTIVATION_VARIANTS:
            raise ValueError(f"device 'cpu' has the variants {', '.join(f'cpu:{v}' for v in ACTIVATION_VARIANTS)} "
                             f"(how matmuls on quantized weights take their inputs: {ACTIVATION_HELP}); "
                             f"got 'cpu:{variant}'")
        if variant in (None, "int8"):
            probe_first_needs()  # a first load on this machine runs its instruction probes side by side
        if variant is None:
            self.activations, self.variant_reason = default_activations()
        else:
            self.activations, self.variant_reason = variant, f"asked for (cpu:{variant})"
        self.activation_style = ACT_F32 if self.activations == "f32" else best_int8_dot()
        # prefill of quantized weights in bf16 (f32 sums) where the CPU runs AVX-512 BF16 and it was
        # measured faster than f32 tiles; cpu:f32 keeps f32 everywhere (the parity tests' variant)
        self.bf16_prefill = self.activations != "f32" and bf16_prefill_is_faster()
        if self.bf16_prefill:
            self.prefill_reason = "bf16 (AVX-512 BF16, measured faster than f32 tiles here)"
        elif self.activations != "f32" and runs_bf16():
            self.prefill_reason = "f32 (bf16 tiles measured slower on this CPU)"
        else:
            self.prefill_reason = "f32"
        # int4 and int8 weights prefill on integer panels wherever an int8 dot product runs: the tokens
        # quantized as decode quantizes its vector, the weight's codes as stored
        self.integer_prefill = integer_prefill_runs(self.activation_style)
        if self.integer_prefill:
            self.prefill_reason = ("int8 activations times int4 and int8 codes "
                                   f"({INT8_DOTS[self.activation_style].name})")
        self.threads = _thread_count(threads)
        # sliding layers may keep only their window (run op by op); f16 and int8 K/V read as stored
        self.capabilities = Capabilities(kv_formats=KV_FORMATS, cache_buffers=True, ring_buffers=True, stored_attention=True,
                                         expert_mixture=True, greedy_on_device=True, threads=self.threads)
        self.weight_arena = HugePageArena() if huge_pages_available() else None
        self._largest_expert = (0, 0, 0)  # (K_max, I, padded I) over the experts packed (_expert_table)
        numba.set_num_threads(self.threads)
        _launching.threads = self.threads

    def use_threads(self, work: int | None = None) -> int:
        """Set the thread count of the next kernel launch and return it: this backend's, or 1 for a
        launch of fewer than PARALLEL_MIN_WORK multiply-adds. Op-by-op decode launches dozens of small
        kernels per layer, and handing work to a pool thread (which may have gone to sleep after its
        spin, kernels/cpu/runtime.py) costs more than such a kernel saves by splitting. Numba's count is per
        calling thread, and setting it costs more than a small kernel: only when it changes."""
        threads = self.threads if work is None or work >= PARALLEL_MIN_WORK else 1
        if getattr(_launching, "threads", None) != threads:
            numba.set_num_threads(threads)
            _launching.threads = threads
        return threads

    # --- weights -------------------------------------------------------------------------------
    def prepare_weight(self, weight):
        return prepare_weight(weight, self.activation_style, bf16_prefill=self.bf16_prefill)

    @property
    def expert_backend(self):
        return self

    def load_weight(self, weight):
        """prepare_weight for a weight the model holds for its lifetime: a matrix's arrays are copied
        once into huge pages where the system has them (devices/cpu/memory.py), streamed experts
        (prepare_weight on views of the expert cache's buffers) never are."""
        return prepare_weight(weight, self.activation_style, self.weight_arena, self.bf16_prefill)

    def _matrix(self, weight) -> CpuWeight:
        if not isinstance(weight, CpuWeight):
            weight = self.prepare_weight(weight)
            if not isinstance(weight, CpuWeight):
                raise ValueError("expected a 2-D weight [N, K], got a vector")
        return weight

    # --- the contract's operations ---------------------------------------------------------------
    def embed(self, table, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        rows = elementwise.embed(self._matrix(table).descriptor, ids)
        return rows.reshape(*ids.shape, rows.shape[-1])

    def linear(self, x: np.ndarray, weight, bias=None) -> np.ndarray:
        weight = self._matrix(weight)
        x = np.asarray(x, dtype=np.float32)
        flat = x.reshape(-1, x.shape[-1])
        threads = self.use_threads(flat.shape[0] * weight.shape[0] * weight.shape[1])
        y = linear_kernels.linear(weight.descriptor, flat, None if bias is None else as_vector(bias), threads)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def rms_norm(self, x: np.ndarray, weight, eps: float) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        flat = x.reshape(-1, x.shape[-1])
        out = np.empty_like(flat)
        self.use_threads()
        elementwise.rms_norm_kernel(flat, as_vector(weight), np.float32(eps), out)
        return out.reshape(x.shape)

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        rotated = np.array(x, dtype=np.float32, order="C")  # a copy: the contract returns a new array
        elementwise.rope_kernel(rotated, np.ascontiguousarray(cos, dtype=np.float32),
                                np.ascontiguousarray(sin, dtype=np.float32))
        return rotated

    def attention(self, q, k, v, q_positions, k_positions, scale, window):
        threads = self.use_threads(q.shape[0] * len(k_positions) * q.shape[1] * q.shape[2])
        return attention_kernels.attention(q, k, v, q_positions, k_positions, scale, window, threads)

    def attention_over_cache(self, q, keys: StoredRows, values: StoredRows, q_positions, k_positions, scale, window):
        """Attention that reads f16 / int8 K/V as stored, widening each row in the kernel."""
        threads = self.use_threads(q.shape[0] * len(k_positions) * q.shape[1] * q.shape[2])
        if keys.format == "f32":
            return attention_kernels.attention(q, keys.data, values.data, q_positions, k_positions, scale, window,
                                               threads)
        return stored_attention_kernels.stored_attention(q, keys.format, keys.group, keys.data, keys.scales,
                                                         values.data, values.scales, q_positions, k_positions,
                                                         scale, window, threads)

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        gate = np.ascontiguousarray(gate, dtype=np.float32)
        out = np.empty_like(gate)
        elementwise.swiglu_kernel(gate.reshape(-1), np.ascontiguousarray(up, dtype=np.float32).reshape(-1),
                                  out.reshape(-1))
        return out

    def gelu_tanh_gated(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        gate = np.ascontiguousarray(gate, dtype=np.float32)
        out = np.empty_like(gate)
        elementwise.gelu_tanh_gated_kernel(gate.reshape(-1), np.ascontiguousarray(up, dtype=np.float32).reshape(-1),
                                           out.reshape(-1))
        return out

    def expert_mixture(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, experts) -> np.ndarray:
        """The routed experts' mixture of a MoE layer, one compiled call per batch of experts
        (kernels/cpu/moe.py): x [T, D], ids / weights [T, A], experts {id: ExpertWeights} -> [T, D].

        A source that keeps only `window_size` experts' weights valid at once (edge/core/moe.py
        ChosenExperts) is read that many experts at a time, in ascending id order; the kernel adds
        them in the same order either way, so the result does not depend on the window."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        ids = np.asarray(ids)
        experts = as_chosen(experts)
        window = experts.window_size
        if len(x) == 1 and (window is None or window >= ids.shape[-1]):
            return self._one_token_mixture(x, ids.reshape(-1), np.asarray(weights).reshape(-1), experts)
        distinct = np.unique(ids)  # ascending
        window = window or len(distinct)
        out = np.zeros(x.shape, np.float32)  # [T, D]
        for begin in range(0, len(distinct), window):
            batch = distinct[begin:begin + window]
            chosen = [experts[int(expert)] for expert in batch]  # referenced until the kernel returns
            matrices = [self._matrix(matrix) for w in chosen for matrix in (w.gate, w.up, w.down)]
            descriptors = np.concatenate([m.descriptor for m in matrices]).reshape(3 * len(batch), -1)
            work = np.asarray(ids).shape[-1] * sum(m.shape[0] * m.shape[1] for m in matrices) * len(x) // len(batch)
            threads = self.use_threads(work)
            moe_kernels.expert_mixture(descriptors, batch, x, ids, weights, threads, out)
        return out

    def _one_token_mixture(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, experts) -> np.ndarray:
        """A decode step's mixture: a token's A ids are distinct (top-k), so its experts in ascending id
        order and their weights are one argsort; each expert's descriptor rows are packed once.

        A source that streams experts (`ready_run`) hands them over run by run, as they are loaded:
        each run is one kernel call adding to the same output in ascending id order, so the sum is
        the same to the bit as one call over all of them."""
        order = np.argsort(ids)
        ascending = ids[order].tolist()
        coeffs = np.ascontiguousarray(weights[order], np.float32)
        out = np.zeros(x.shape, np.float32)
        start = 0
        ready_rows = getattr(experts, "ready_rows", None)
        while start < len(ascending):
            if ready_rows is not None:  # the run and its descriptor rows [3 * n, W_FIELDS], in one call
                n, table = ready_rows(self._expert_table, ascending, start)
            else:
                n, table = experts.ready_run(ascending, start), None
            if table is None:
                chosen = [experts[expert] for expert in ascending[start:start + n]]  # referenced until the kernel returns
                table = np.concatenate([self._expert_table(w) for w in chosen])
            # scratch for the largest expert packed so far (extra zero padding changes no sum)
            shape = (len(ascending), x.shape[1], *self._largest_expert)
            scratch = getattr(_launching, "decode_scratch", None)
            if scratch is None or not scratch.holds(shape):
                scratch = _launching.decode_scratch = moe_kernels.DecodeScratch(*shape)
            work = 3 * x.shape[1] * self._largest_expert[1] * n  # multiply-adds, at most
            moe_kernels.mixture_decode(table, x, coeffs[start:start + n], self.use_threads(work), out, scratch)
            start += n
        return out

    def _expert_table(self, expert) -> np.ndarray:
        """An expert's gate, up, down descriptor rows [3, W_FIELDS], packed and checked on first use."""
        if expert.packed is None:
            matrices = [self._matrix(m) for m in (expert.gate, expert.up, expert.down)]  # own the arrays the rows point into
            table = np.stack([m.descriptor for m in matrices])
            moe_kernels.check_expert_table(table)
            expert.packed = (table, matrices)
            self._largest_expert = tuple(max(a, b) for a, b in zip(self._largest_expert,
                                                                   moe_kernels.DecodeScratch.expert_shape(table)))
        return expert.packed[0]

    def softmax(self, scores: np.ndarray) -> np.ndarray:
        """Softmax over the last axis (attention's kernel; exposed for tests and the diff tool)."""
        scores = np.ascontiguousarray(scores, dtype=np.float32)
        flat = scores.reshape(-1, scores.shape[-1])
        out = np.empty_like(flat)
        elementwise.softmax_kernel(flat, out)
        return out.reshape(scores.shape)

    def allocate_kv(self, capacity: int, kv_heads: int, head_dim: int):
        # [capacity, Hkv, Dh] float32, C-contiguous: the layout both edge's op-by-op KVCache.write and
        # the fused kernel use. np.zeros maps pages lazily, so memory follows the valid length.
        return (np.zeros((capacity, kv_heads, head_dim), np.float32),
                np.zeros((capacity, kv_heads, head_dim), np.float32))

    def allocate_cache(self, rows: int, heads: int, dim: int, fmt: str) -> CacheBuffer:
        # f16 / int8 K/V and ring buffers: op-by-op attention reads them as stored (attention_over_cache),
        # the fused executor an f16 buffer over every position too; MLA latents are read back dequantized
        return CacheBuffer(rows, heads, dim, fmt, NUMBA_KV_CODEC)

    def head_matmul(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        self.use_threads()
        return attention_kernels.head_matmul(x, w)

    def compute_threads(self, spec, tokens: int) -> ComputeThreads:
        return ComputeThreads(self.threads, prefill_tile_bytes(spec, tokens))

    def compile_forward(self, model):
        from devices.cpu.executor import KV_DTYPES, FusedForward

        # the fused executor composes Llama-like attention over float32 or float16 K/V; the rest runs
        # op by op on the same Numba kernels
        spec = model.spec
        if spec.attention_kind != "gqa":
            return None, f"ops: {spec.attention_kind.upper()} attention"
        if model.kv_format not in KV_DTYPES:
            return None, f"ops: {model.kv_format} KV cache"
        if spec.qk_norm_over_projection:
            return None, "ops: q/k norm over the whole projection"
        if spec.clip_qkv is not None:
            return None, "ops: clip_qkv"
        if len(model.layer_ropes or {}) > 1:
            return None, "ops: more than two rotary bases"
        if spec.sandwich_norms and model.moe is not None:
            return None, "ops: output norms around Mixture-of-Experts blocks"
        return FusedForward(model, self), "fused"

    def info(self) -> dict:
        import llvmlite.binding as llvm

        return {
            "device": "cpu",
            "backend": "numba kernels with hand-written LLVM IR inner loops",
            "threads": self.threads,
            **{k: v for k, v in threading_info().items() if k != "threads"},
            "weight_kernels": linear_kernels.KIND_KERNELS.compiled_kinds(),
            "cpu": llvm.get_host_cpu_name(),
            "machine": platform.machine(),
            "cores": os.cpu_count(),
            # where the model's weights live: copied into transparent huge pages, or views of the mmap
            "weight_pages": "2 MB (transparent huge pages)" if self.weight_arena else "4 KB (mmap of the checkpoint)",
            "weight_bytes_in_huge_pages": self.weight_arena.copied_bytes if self.weight_arena else 0,
            # the instruction-set level the kernels are compiled for (ZLLM_EDGE_ISA caps it)
            "isa": isa.target_level(),
            "isa_capped": isa.requested_level() is not None,
            "activations": self.activations,
            "variant_reason": self.variant_reason,
            "int8_dot": None if self.activation_style == ACT_F32 else INT8_DOTS[self.activation_style].name,
            # for `zllm-edge diff`: f32 sums; the inputs of decode's quantized matmuls (and of prefill's on
            # integer panels) rounded to int8 per block of 32 (half a step of 127) or kept; prefill's other
            # quantized matmuls in bf16 (inputs within int8's budget, the dequantized weights rounded by
            # up to 2^-8) or in f32
            "arithmetic": {"accumulation": 2.0 ** -24,
                           "activations": {"f32": 0.0, "f16": 0.0,
                                           "quantized": 0.0 if self.activation_style == ACT_F32 else 1.0 / 254.0},
                           "weights": {"f32": 0.0, "f16": 0.0,
                                       "quantized": 2.0 ** -8 if self.bf16_prefill and not self.integer_prefill
                                       else 0.0}},
            "prefill_tiles": self.prefill_reason,
            "numba": numba.__version__,
            "llvm": ".".join(map(str, llvm.llvm_version_info)),
            "numba_cache_dir": numba.config.CACHE_DIR,
        }
