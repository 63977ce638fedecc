"""SlotExperts: the streamed ExpertSource whose cache, loads and waits run in compiled calls.

T = tokens, A = active experts per token, E = routed experts of a layer, S = slots.

It does what StreamingExperts (streaming/source.py) does, with the expert cache held as a slot table
in plain arrays (kernels/cpu/expert_slots.py): per MoE layer of a decode step the model's thread makes
one compiled call (slot_decode_layer) that pins the route's cached experts, reserves slots for the
misses by the eviction policy and submits their reads ahead of every prefetch, runs the predictor's
observe and gate forecast on its arrays (kernels/cpu/forecast.py), and queues and submits the
prefetches; and, while it mixes the experts in ascending id order, one call per run of delivered
experts that waits for the next one. A prefill's route, or a forecast the predictor's general path
makes, takes one call to pin and one to queue. Reads go through io_uring (issued inline by the submitting call
where the compute threads take every core, else by the kernel's workers), collected by one completion thread
(kernels/cpu/uring.py ring_complete), or where io_uring does not run (or io_engine 'threads' asks)
through reader threads (kernels/cpu/readers.py reader_loop); both are compiled loops that never
return to Python and check each record's crc32. So no Python runs per expert read, on any thread.

Slots are buffers of one size (the largest expert record, page aligned) in one anonymous mapping
reserved for every expert of the model and touched only as slots fill: the memory follows the
slots used, and slots given up (a smaller cache) are handed back to the system.

Used where records are stored uncompressed and the policy is one the slot table implements (lru,
lfu, nextuse); `open_expert_source` says which engine it chose, and why, in
`model.stats()["expert_engine"]`, and `io_engine` which reads. The weights a slot holds are the same
bytes decoded the same way as on every other path, so results are bit-identical to the all-resident
run.
"""
from __future__ import annotations

import errno
import mmap
import os
import threading

import numpy as np

from edge.core.errors import ZllmError
from edge.core.moe import ExpertWeights, MoeConfig, distinct_experts
from edge.core.process_memory import HUGE_PAGE, huge_pages_available
from kernels.cpu.wake import W_EVENT, WAKE_FIELDS
from quant.expert_file import ExpertIndex
from streaming.cache import ENTRY_OVERHEAD
from streaming.predictor import ExpertPredictor
from streaming.prefetch import DEFAULT_THREADS, RING_DEPTH, WAIT_SLEEPS
from streaming.source import PREFETCH_WIDTH, LayerPasses, RouteWindow, prepared_expert
from streaming.stats import StreamingCounters
from streaming.store import IO_DIRECT, PAGE, ExpertReadError, ExpertStore, aligned_length

ENGINE = "compiled slot table"
_NO_SLOTS = np.zeros(0, np.int64)


def slot_engine_refusal(index: ExpertIndex, policy: str, expert_engine: str = "auto") -> str | None:
    """None when SlotExperts can stream this checkpoint, else why StreamingExperts does."""
    from kernels.cpu import expert_slots

    if expert_engine == "python":
        return "expert_engine 'python' asked for"
    if index.compression is not None:
        return "compressed records are decompressed by reader threads"
    if policy not in expert_slots.POLICY_CODES:
        return f"expert_policy {policy!r} is served by the Python cache"
    if not hasattr(os, "eventfd"):  # (Linux's; a thread waiting for a read blocks on one)
        return "this platform has no eventfd"
    return None


class RingIO:
    """Reads through io_uring: the slot table submits them, one completion thread (a compiled loop,
    kernels/cpu/uring.py ring_complete) publishes them."""

    name = "io_uring"

    def __init__(self, depth: int = RING_DEPTH):
        from kernels.cpu import readers, uring

        self._uring = uring
        self.depth = depth
        self.threads = 1
        self.lanes = np.zeros((0, readers.LANE_FIELDS), np.int64)
        self._ring = np.zeros(uring.RING_BYTES, np.uint8)
        status = uring.ring_init(self._ring.ctypes.data, 2 * depth)
        if status < 0:
            raise OSError(-status, "io_uring_setup failed")
        self.address = self._ring.ctypes.data
        self._error = 0
        self._thread = None

    def start(self, addresses, lengths, verify: bool, results, crcs, done, wake) -> None:
        def complete():
            self._error = self._uring.ring_complete(self.address, addresses, lengths, verify, results, crcs, done,
                                                    wake)

        # compiled (or loaded from the cache) now, where the memory budget's plan counts them, not when used
        self._uring.ring_complete.dispatcher, self._uring.ring_stop.dispatcher
        self._thread = threading.Thread(target=complete, name="zllm-io-uring", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def error(self) -> OSError | None:
        """Why the completion thread stopped, once it has."""
        return OSError(-self._error, "the io_uring completion thread stopped") if self._error else None

    def stop(self) -> None:
        if self.alive() and self._uring.ring_stop(self.address) == 0:
            self._thread.join()
        self._uring.ring_exit(self.address)


class ReaderIO:
    """Reads through `count` reader threads, each a compiled loop (kernels/cpu/readers.py reader_loop)
    with one read of its own in flight: for kernels and sandboxes without io_uring."""

    name = "threads"

    def __init__(self, count: int):
        from kernels.cpu import readers

        self._readers = readers
        self.depth = self.threads = count
        self.address = 0
        self.lanes = np.zeros((count, readers.LANE_FIELDS), np.int64)
        self._events = []
        try:
            for r in range(count):
                self._events.append(os.eventfd(0))
                self.lanes[r, readers.L_EVENT] = self._events[-1]
        except OSError:
            self._close_events()
            raise
        self._threads: list[threading.Thread] = []

    def start(self, addresses, lengths, verify: bool, results, crcs, done, wake) -> None:
        loop = self._readers.reader_loop
        loop.dispatcher, self._readers.reader_stop.dispatcher  # (as RingIO.start)
        self._threads = [threading.Thread(target=loop, args=(self.lanes, r, addresses, lengths, verify, results, crcs,
                                                             done, wake), name=f"zllm-expert-reader-{r}", daemon=True)
                         for r in range(self.threads)]
        for thread in self._threads:
            thread.start()

    def alive(self) -> bool:
        return all(thread.is_alive() for thread in self._threads)

    def error(self) -> OSError | None:
        return None if self.alive() else OSError(errno.EIO, "an expert reader thread stopped")

    def stop(self) -> None:
        for r, thread in enumerate(self._threads):
            if thread.is_alive():
                self._readers.reader_stop(self.lanes, r)
        for thread in self._threads:
            thread.join()
        self._close_events()

    def _close_events(self) -> None:
        for event in self._events:
            os.close(event)
        self._events = []


def open_io(io_engine: str, readers: int) -> tuple[RingIO | ReaderIO, str | None]:
    """The slot table's I/O engine for `io_engine` ("auto", "io_uring", "threads") and why it is not
    io_uring (None when it is)."""
    from kernels.cpu import uring

    reason = "io_engine 'threads' asked for" if io_engine == "threads" else uring.unavailable_reason()
    if reason is None:
        return RingIO(), None
    if io_engine == "io_uring":
        raise ZllmError(f"io_engine 'io_uring' cannot run here: {reason}; use io_engine 'auto' or 'threads'")
    return ReaderIO(readers), reason


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the system tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class SlotExperts(LayerPasses):
    def __init__(self, index: ExpertIndex, prepare_weight, layers: dict[int, MoeConfig], cache_bytes: int,
                 storage=None, predictor=None, policy: str = "nextuse", depth: int = 2, verify: bool = True,
                 direct_io: bool = True, store: ExpertStore | None = None, prefetch_width: float = PREFETCH_WIDTH,
                 io_engine: str = "auto", readers: int = DEFAULT_THREADS, compute_threads: int | None = None):
        from kernels.cpu import expert_slots as ks

        self._ks = ks
        self.index = index
        self._prepare_weight = prepare_weight
        self.layers = dict(sorted(layers.items()))
        self._start_passes(self.layers, predictor, depth)
        self.prefetch_width = prefetch_width
        self.policy = policy
        self.store = store or ExpertStore(index, storage, verify=verify, direct_io=direct_io)
        self.slot_bytes = max(self.store.buffer_bytes(layer) for layer in self.layers)
        self.max_slots = sum(len(index.layers[layer].records) for layer in self.layers)
        self.capacity_bytes = int(cache_bytes)
        capacity = self._slots_for(cache_bytes)
        if capacity < 1:
            raise ZllmError(f"an expert record needs {self.slot_bytes + ENTRY_OVERHEAD} bytes, more than the whole "
                            f"expert cache ({cache_bytes} bytes); raise memory_budget")
        # One reservation for every slot the model could use; pages are only backed as slots fill.
        self._mapping = mmap.mmap(-1, self.max_slots * self.slot_bytes,
                                  flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0))
        self._advise_pages(capacity)
        self.slab = np.frombuffer(self._mapping, np.uint8)
        base = self.slab.ctypes.data
        if base % PAGE:
            raise ZllmError("the expert slab is not page aligned; O_DIRECT reads need aligned buffers")
        n_experts = max(config.num_experts for config in self.layers.values())
        self.slots = np.zeros((self.max_slots, ks.SLOT_FIELDS), np.int64)
        self.slots[:, ks.S_LAYER] = -1
        self.times = np.zeros((self.max_slots, ks.SLOT_TIMES), np.float64)
        self.experts_table = np.zeros((len(self.order), n_experts, ks.EXPERT_FIELDS), np.int64)
        self.experts_table[:, :, ks.X_SLOT] = ks.NO_SLOT
        for ordinal, layer in enumerate(self.order):
            for expert, record in enumerate(index.layers[layer].records):
                self.experts_table[ordinal, expert, ks.X_OFFSET] = record.offset
                self.experts_table[ordinal, expert, ks.X_LENGTH] = record.length
                self.experts_table[ordinal, expert, ks.X_CRC] = record.crc32
        self.visits = np.zeros(len(self.order), np.int64)
        self.gaps = np.full((len(self.order), n_experts), float(len(self.order)))  # (no use, no visit yet)
        self.ahead = np.zeros(len(self.order), np.float64)
        self.state = np.zeros(ks.STATE_FIELDS, np.int64)
        self.clocks = np.zeros(ks.CLOCK_FIELDS, np.float64)
        self.queue = np.zeros(self.max_slots, np.int64)
        self.io, self.io_engine_reason = open_io(io_engine, readers)
        # the thread waiting for a read is woken when one is published (kernels/cpu/wake.py)
        self.wake = np.zeros(WAKE_FIELDS, np.int64)
        self.wake[W_EVENT] = os.eventfd(0, os.EFD_NONBLOCK)
        self.flight = np.zeros(self.io.depth, np.int64)
        self.addresses = (base + self.slot_bytes * np.arange(self.max_slots, dtype=np.uint64)).astype(np.uint64)
        self.lengths = np.zeros(self.max_slots, np.int64)
        self.results = np.zeros(self.max_slots, np.int64)
        self.crcs = np.zeros(self.max_slots, np.uint32)
        self.done = np.zeros(self.max_slots, np.int64)
        s = self.state
        s[ks.G_RING], s[ks.G_VERIFY], s[ks.G_POLICY] = self.io.address, int(verify), ks.POLICY_CODES[policy]
        s[ks.G_DEPTH], s[ks.G_CAPACITY], s[ks.G_LAYERS] = self.io.depth, capacity, len(self.order)
        s[ks.G_ORDINAL] = -1
        s[ks.G_INLINE_READS] = int(compute_threads is not None and compute_threads >= usable_cores())
        self._sync_store()
        if self.store.storage is not None:
            self.clocks[ks.C_LATENCY] = self.store.storage.latency_s
            self.clocks[ks.C_BANDWIDTH] = self.store.storage.bandwidth_bytes_per_s
        self._table = (self.slots, self.times, self.experts_table, self.visits, self.gaps, self.ahead, self.state,
                       self.clocks, self.queue, self.flight, self.addresses, self.lengths, self.results, self.crcs,
                       self.done, self.io.lanes, self.wake)
        self._prepared: dict[tuple[int, tuple], ExpertWeights] = {}  # (slot, layout signature) -> weights
        self._signature = {layer: index.layout(layer).signature for layer in self.layers}
        self._order_scratch = np.zeros(n_experts, np.int64)
        self._plans: dict[tuple, tuple] = {}  # _prefetch_plan's, by place
        self._decode_plans: dict[tuple[int, int], tuple] = {}  # (layer, depth) -> a decode step's prefetch plan
        # a one-token route's predictor work runs inside the slot table's call where the predictor's
        # decode step is compiled (its tables, by the same MoE layer ordinals)
        self._compiled_predictor = isinstance(predictor, ExpertPredictor) and predictor.order == self.order
        self._packed: dict[tuple, tuple] = {}  # signature -> pack_slots' (rows per slot, made, a route's rows)
        self._run_length = np.zeros(1, np.int64)  # (slot_ready_rows answers a run's length here too)
        self._current: SlotLayer | None = None
        self._closed = False
        for compiled in (ks.slot_acquire, ks.slot_prefetch, ks.slot_ready_run, ks.slot_ready_rows, ks.slot_drain,
                         ks.slot_decode_layer):
            compiled.dispatcher  # compiled (or loaded from the cache) now, not at the first layer
        self.io.start(self.addresses, self.lengths, self.store.verify, self.results, self.crcs, self.done, self.wake)

    def _sync_store(self) -> None:
        """The store's file and read mode (it turns to buffered reads where O_DIRECT is refused)."""
        ks = self._ks
        direct = self.store.io_mode == IO_DIRECT
        self.state[ks.G_FD], self.state[ks.G_BUFFERED] = self.store.fd, int(not direct)
        lengths = self.experts_table[:, :, ks.X_LENGTH]
        self.experts_table[:, :, ks.X_SPAN] = aligned_length(lengths) if direct else lengths

    # --- sizes ---------------------------------------------------------------------------------
    def _advise_pages(self, capacity: int) -> None:
        """2 MB pages over the whole ones within the first `capacity` slots (the kernels then stream an
        expert without a TLB miss every 4 KB), 4 KB pages past them: no page reaches beyond the budget."""
        if not huge_pages_available():
            return
        span = capacity * self.slot_bytes // HUGE_PAGE * HUGE_PAGE
        if span:
            self._mapping.madvise(mmap.MADV_HUGEPAGE, 0, span)
        if len(self._mapping) > span:
            self._mapping.madvise(mmap.MADV_NOHUGEPAGE, span, len(self._mapping) - span)

    def _slots_for(self, cache_bytes: int) -> int:
        return min(self.max_slots, int(cache_bytes) // (self.slot_bytes + ENTRY_OVERHEAD))

    @property
    def capacity(self) -> int:
        return int(self.state[self._ks.G_CAPACITY])

    def buffer(self, slot: int, layer: int) -> np.ndarray:
        """The raw record bytes of `layer`'s expert in `slot`."""
        begin = slot * self.slot_bytes
        return self.slab[begin: begin + self.index.layout(layer).raw_length]

    def pack_slots(self, layer: int, slots: np.ndarray, pack) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The backend's packed form of `layer`'s layout: (pack(weights) [R, F] of each slot, whether each
        slot's is made, room for a route's rows one after another), with those of `slots` (delivered)
        made. They are made once per slot and layout (they point into the slot's buffer, whatever expert
        the slot holds, as the prepared weights do)."""
        signature = self._signature[layer]
        packed = self._packed.get(signature)
        missing = slots.tolist() if packed is None else slots[~packed[1][slots]].tolist()
        for slot in missing:
            rows = pack(self.weights(slot, layer, int(self.slots[slot, self._ks.S_EXPERT])))
            if packed is None:  # (the packed form's shape is the backend's)
                packed = self._packed[signature] = (
                    np.zeros((self.max_slots, *rows.shape), rows.dtype), np.zeros(self.max_slots, bool),
                    np.zeros((self.experts_table.shape[1] * rows.shape[0], rows.shape[1]), rows.dtype))
            packed[0][slot], packed[1][slot] = rows, True
        return packed

    def weights(self, slot: int, layer: int, expert: int) -> ExpertWeights:
        """The backend's weights of the record in `slot` (prepared once per slot and layout: they point
        into the slot's buffer, whatever expert it holds)."""
        key = (slot, self._signature[layer])
        weights = self._prepared.get(key)
        if weights is None:
            weights = self._prepared[key] = prepared_expert(self.index, self._prepare_weight, layer, expert,
                                                            self.buffer(slot, layer))
        return weights

    # --- the ExpertSource --------------------------------------------------------------------------
    def _stall_seconds(self) -> float:
        return float(self.clocks[self._ks.C_STALL])

    def experts(self, layer: int, expert_ids: np.ndarray, residual: np.ndarray,
                router_logits: np.ndarray | None = None) -> "SlotLayer":
        if self._closed:
            raise ZllmError("the expert source is closed")
        ks = self._ks
        position = self._position(layer, len(expert_ids))
        finished, self._current = self._current, None
        release, finished_ordinal = _NO_SLOTS, -1
        if finished is not None:
            release, finished_ordinal = finished.detach(), finished.ordinal
        self.state[ks.G_POSITION] = position
        ids = distinct_experts(expert_ids)
        if ids and (ids[0] < 0 or ids[-1] >= self.layers[layer].num_experts):
            raise ZllmError(f"layer {layer} has experts 0..{self.layers[layer].num_experts - 1}, the route asks for "
                            f"{ids}")
        room = self.capacity
        step = None
        if self._compiled_predictor and room >= len(ids):
            step = self.predictor.decode_arguments(layer, expert_ids, residual, router_logits)
        if step is not None:  # the predictor's work runs inside the slot table's call
            plan = self._decode_plans.get((layer, self.depth))
            if plan is None:
                targets = (*self.predictor.targets(layer), *self._next_pass_targets())
                plan = self._decode_plans[layer, self.depth] = self._prefetch_plan(targets, 1)
            self._current = SlotLayer(self, layer, ids, room, release, finished_ordinal, (step, plan, room - len(ids)))
            return self._current
        self._current = SlotLayer(self, layer, ids, room, release, finished_ordinal)
        if self.predictor is not None:
            forecast = self.predictor.observe_and_forecast(layer, expert_ids, residual, router_logits)
            forecast.update({first: self.predictor.need_vector(first) for first in self._next_pass_targets()})
            self._schedule(forecast, room - len(ids), len(expert_ids))
        return self._current

    def _schedule(self, forecast: dict[int, np.ndarray], free_slots: int, n_tokens: int) -> None:
        """Queue prefetches of the likeliest experts of the layers ahead, nearest layer first (one call)."""
        if free_slots <= 0 or not forecast:
            return
        chosen, targets, widths, distances, sizes, need, rows = self._prefetch_plan(tuple(forecast), n_tokens)
        for k, target in enumerate(chosen):
            need[k, :sizes[k]] = forecast[target]
        self._ks.slot_prefetch(*self._table, targets, widths, distances, sizes, need, rows, free_slots,
                               self._order_scratch)

    def _prefetch_plan(self, forecast_layers: tuple[int, ...], n_tokens: int):
        """The prefetch arrays for a forecast of these layers, made from here: (the layers within reach,
        nearest first; their ordinals, widths, distances and sizes; their need rows [n, E], to fill, and
        the row of each). They depend only on where the model is, so they are made once per (place,
        layers, depth, tokens)."""
        key = (self._last_ordinal, forecast_layers, self.depth, n_tokens, self.prefetch_width)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        here = self._last_ordinal
        reach = sorted((self._layers_until(target), target) for target in forecast_layers)
        chosen = [target for distance, target in reach if distance <= self.depth]
        widths = [int(np.ceil(self.layers[target].top_k * (1 if self._ordinal[target] <= here else n_tokens)
                              * self.prefetch_width)) for target in chosen]
        plan = self._plans[key] = (
            chosen, np.array([self._ordinal[target] for target in chosen], np.int64), np.array(widths, np.int64),
            np.array([self._layers_until(target) for target in chosen], np.int64),
            np.array([self.layers[target].num_experts for target in chosen], np.int64),
            np.zeros((len(chosen), self.experts_table.shape[1]), np.float64), np.arange(len(chosen), dtype=np.int64))
        return plan

    def begin_request(self) -> None:
        if self.predictor is not None:
            self.predictor.begin_request()

    def begin_token(self, embedding) -> None:
        """Before a decode step's layer 0: queue the first MoE layer's likeliest experts by the token's
        embedding (the last layer's route stays pinned until the first MoE layer runs)."""
        if self.predictor is None or self._closed or self._last_ordinal is None:
            return
        pinned = len(self._current.ids) if self._current is not None else 0
        self._schedule(self.predictor.token_forecast(embedding()), self.capacity - pinned, 1)

    def resize_cache(self, cache_bytes: int) -> None:
        """A new bound: slots past it are emptied (and their pages given back) once nothing uses them."""
        ks = self._ks
        capacity = self._slots_for(cache_bytes)
        if capacity < 1:
            raise ZllmError(f"an expert record needs {self.slot_bytes + ENTRY_OVERHEAD} bytes, more than the whole "
                            f"expert cache ({cache_bytes} bytes); raise memory_budget")
        self.capacity_bytes = int(cache_bytes)
        old = self.capacity
        if capacity < old:
            if self._current is not None:
                self.release_current()
            ks.slot_drain(*self._table, WAIT_SLEEPS)
            for s in range(capacity, old):
                layer = int(self.slots[s, ks.S_LAYER])
                if layer >= 0:
                    self.experts_table[layer, self.slots[s, ks.S_EXPERT], ks.X_SLOT] = ks.NO_SLOT
                    self.state[ks.G_USED_SLOTS] -= 1
                self.slots[s, ks.S_LAYER], self.slots[s, ks.S_STATE] = -1, ks.EMPTY
            self._prepared = {key: w for key, w in self._prepared.items() if key[0] < capacity}
            for _, made, _ in self._packed.values():
                made[capacity:] = False
            self._mapping.madvise(mmap.MADV_DONTNEED, capacity * self.slot_bytes, (old - capacity) * self.slot_bytes)
        self._advise_pages(capacity)
        self.state[ks.G_CAPACITY] = capacity

    def release_current(self) -> None:
        if self._current is not None:
            self._current._release_pins()

    def stats(self) -> dict:
        ks, s, c = self._ks, self.state, self.clocks
        counters = StreamingCounters(hits=int(s[ks.G_HITS]), misses=int(s[ks.G_MISSES]),
                                     late_prefetches=int(s[ks.G_LATE]), stall_seconds=float(c[ks.C_STALL]))
        store = self.store.stats()
        stats = counters.to_dict(io_seconds=float(c[ks.C_IO_SECONDS]))
        stats.update({"expert_source": self.strategy, "expert_policy": self.policy, "expert_engine": ENGINE,
                      "io_engine_reason": self.io_engine_reason,
                      "bytes_read": int(s[ks.G_BYTES_READ]) + store["bytes_read"],
                      "io_mode": store["io_mode"], "storage": store["storage"],
                      "expert_cache_bytes": self.capacity_bytes,
                      "expert_cache_peak_bytes": int(s[ks.G_PEAK_SLOTS]) * (self.slot_bytes + ENTRY_OVERHEAD),
                      "expert_evictions": int(s[ks.G_EVICTIONS]),
                      "prefetches_evicted_unused": int(s[ks.G_UNUSED_PREFETCHES]),
                      "prefetch_depth": self.lookahead.most if self.lookahead is not None else 0,
                      "prefetch_lookahead": self.depth,
                      "prefetch_lookahead_changes": self.lookahead.changes if self.lookahead is not None else 0,
                      "prefetches_queued": int(s[ks.G_PREFETCHES_QUEUED]),
                      "prefetches_loaded": int(s[ks.G_PREFETCHES_LOADED]),
                      "prefetches_cancelled": int(s[ks.G_PREFETCHES_CANCELLED]),
                      "prefetches_skipped_full": int(s[ks.G_PREFETCHES_SKIPPED]),
                      "demand_loads": int(s[ks.G_MISSES]), "prefetch_threads": self.io.threads,
                      "io_engine": self.io.name,
                      "io_uring_reads_refused": int(s[ks.G_SUBMISSIONS_REFUSED]),
                      "expert_reads": int(s[ks.G_READS]) + store["reads"],
                      "expert_read_calls": int(s[ks.G_READS]) + store["read_calls"],
                      "expert_reads_again": store["reads_again"],
                      "emulated_wait_seconds": float(c[ks.C_EMULATED_WAIT]) + store["emulated_wait_seconds"]})
        if self.predictor is not None:
            stats.update(self.predictor.stats())
        else:
            stats.update({"predictor_precision": None, "predictor_recall": None})
        return stats

    # --- failures ------------------------------------------------------------------------------------
    def recover(self, slot: int, layer: int, expert: int) -> None:
        """Slot's read failed, came back short or damaged: read it again here (a fault on the way passes)
        or raise its typed error (the slot is then read again by the next layer that needs it)."""
        ks = self._ks
        error = self.io.error()
        if error is not None:
            raise self.store.read_error(layer, expert, self.index.record(layer, expert), error)
        self.store.read_again(layer, expert, self.buffer(slot, layer))
        self._sync_store()
        self.slots[slot, ks.S_STATE] = ks.READY

    def completion_alive(self) -> bool:
        return self.io.alive()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.release_current()
        while self._ks.slot_drain(*self._table, WAIT_SLEEPS) and self.io.alive():
            pass  # the kernel may still write into the slots' buffers
        self.io.stop()
        os.close(int(self.wake[W_EVENT]))
        self.store.close()


class SlotLayer(RouteWindow):
    """The experts one layer's route needs, pinned in their slots: expert id -> ExpertWeights.

    A route that needs more distinct experts than the cache has slots (a long prefill under a small
    budget) gets a rolling window: the first ones in ascending id order are pinned up front, and handing
    out a later one releases the earliest one handed out (the MoE block uses each expert's weights right
    after it gets them, in ascending id order)."""

    def __init__(self, source: SlotExperts, layer: int, ids: list[int], room: int, release: np.ndarray,
                 finished: int = -1, decode_step: tuple | None = None):
        self.source, self.layer, self.ids = source, layer, ids
        self.ordinal = source._ordinal[layer]
        self.room = max(room, 1)
        self.whole = self.room >= len(ids)  # every expert of the route pinned at once
        self._index = {expert: i for i, expert in enumerate(ids)}
        self._ready: dict[int, ExpertWeights] = {}
        self._slots = np.array(ids[: self.room], np.int64)  # (their slots, once acquired)
        self._acquire(release, self._slots, finished, decode_step)
        self._held = dict(zip(ids[: self.room], self._slots.tolist()))  # pinned: expert -> slot
        self._handed_out: list[int] = []

    def _acquire(self, release: np.ndarray, out: np.ndarray, finished: int = -1, decode_step: tuple | None = None
                 ) -> None:
        """Pin the slots of the experts `out` (overwritten with them), unpinning `release` and counting a
        visit of the MoE layer (ordinal) `finished`. With a decode step (the predictor's arguments, the
        prefetch plan, the free slots), the predictor observes and forecasts the route and the
        prefetches are queued in the same call (slot_decode_layer)."""
        source = self.source
        ks = source._ks
        if decode_step is None:
            outcome = ks.slot_acquire(*source._table, release, finished, self.ordinal, 0, len(out), out)
        else:
            arguments, (_, targets, widths, distances, sizes, _, _), free_slots = decode_step
            outcome = ks.slot_decode_layer(*source._table, *arguments, release, finished, self.ordinal, out, targets,
                                           widths, distances, sizes, free_slots, source._order_scratch)
        if outcome == ks.FULL:
            raise ZllmError(f"the expert cache ({source.capacity} slots of {source.slot_bytes} bytes) cannot hold "
                            f"layer {self.layer} expert {int(out[-1])}: every slot is pinned by the layer being "
                            f"computed; raise memory_budget")

    def detach(self) -> np.ndarray:
        """The slots this layer pinned, for the next call to release; it hands out nothing more."""
        whole = self.whole and self._held  # (every slot of the route, in order)
        pins = self._slots if whole else np.fromiter(self._held.values(), np.int64, len(self._held))
        self._held, self._ready, self._handed_out = {}, {}, []
        return pins

    def _release_pins(self) -> None:
        self.source.slots[self.detach(), self.source._ks.S_PINS] -= 1
        if self.source._current is self:
            self.source._current = None

    def _wait(self, run: np.ndarray, start: int) -> int:
        """slot_ready_run on `run` from `start`, with failed reads read again (or raised)."""
        source = self.source
        while True:
            n = source._ks.slot_ready_run(*source._table, run, start, WAIT_SLEEPS)
            if n > 0:
                return n
            self._not_ready(n, run, start)

    def _not_ready(self, outcome: int, run: np.ndarray, start: int) -> None:
        """After a wait that answered FAILURE or NOT_YET for run[start]: read it again here (a fault on the
        way passes), or raise its typed error, or that the I/O engine stopped."""
        source = self.source
        ks = source._ks
        slot = int(run[start])
        expert = int(source.slots[slot, ks.S_EXPERT])
        if outcome == ks.FAILURE:
            try:
                source.recover(slot, self.layer, expert)
            except BaseException:
                self._release_pins()
                raise
        elif not source.completion_alive():
            self._release_pins()
            error = source.io.error()
            raise ExpertReadError(f"{source.index.path}: reading layer {self.layer} expert {expert} did not "
                                  f"complete: {error}; check the disk holding the checkpoint")

    def ready_run(self, ids: list[int], start: int) -> int:
        """How many of the experts ids[start:] (ascending, this route's) are loaded in a row, at least one:
        waits for ids[start]. A consumer that mixes experts in ascending id order computes with the loaded
        ones while the others are read."""
        if not self._whole_route(ids):
            self[ids[start]]
            return 1
        return self._wait(self._slots, start)

    def ready_rows(self, pack, ids: list[int], start: int) -> tuple[int, np.ndarray | None]:
        """ready_run(ids, start) and the packed rows of that run (SlotExperts.pack_slots), one expert's
        after another: (n, rows [n * R, F], valid until the next call), in one compiled call; rows None
        where the route is not pinned whole (the consumer then takes each expert's weights)."""
        if not self._whole_route(ids):
            return self.ready_run(ids, start), None
        source = self.source
        ks = source._ks
        while True:
            packed = source._packed.get(source._signature[self.layer])
            if packed is None:  # the first run of this layout: its rows give the packed form's shape
                source.pack_slots(self.layer, self._slots[start: start + self._wait(self._slots, start)], pack)
                continue
            rows, made, out = packed
            n = ks.slot_ready_rows(*source._table, self._slots, start, WAIT_SLEEPS, rows, made, out,
                                   source._run_length)
            if n > 0:
                return n, out[: n * rows.shape[1]]
            if n == ks.UNPACKED:
                source.pack_slots(self.layer, self._slots[start: start + int(source._run_length[0])], pack)
            else:
                self._not_ready(n, self._slots, start)

    def _whole_route(self, ids: list[int]) -> bool:
        """Whether `ids` are this route's, every one pinned (so its slots are waited on as a run)."""
        return self.whole and (ids is self.ids or list(ids) == self.ids)

    def __getitem__(self, expert: int) -> ExpertWeights:
        weights = self._ready.get(expert)
        if weights is not None:
            return weights
        expert = int(expert)
        if expert not in self._index:
            raise KeyError(f"layer {self.layer} expert {expert} is not in this route; it needs {self.ids}")
        slot = self._held.get(expert)
        if slot is None:  # rolling window: free the earliest expert handed out
            release = _NO_SLOTS
            if len(self._held) >= self.room and self._handed_out:
                oldest = self._handed_out.pop(0)
                release = np.array([self._held.pop(oldest)], np.int64)
                self._ready.pop(oldest, None)
            out = np.array([expert], np.int64)
            self._acquire(release, out)
            slot = self._held[expert] = int(out[0])
        self._wait(np.array([slot], np.int64), 0)
        weights = self._ready[expert] = self.source.weights(slot, self.layer, expert)
        if expert not in self._handed_out:
            self._handed_out.append(expert)
        return weights
