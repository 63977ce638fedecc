"""The expert cache: experts held in memory up to a byte bound, with a pluggable eviction policy.

An entry is one (layer, expert): the buffer its raw record was read into and the ExpertWeights the
backend prepared from views of that buffer. The cache charges each entry its buffer plus a fixed
ENTRY_OVERHEAD for the prepared weights (descriptors, Python objects); buffers of evicted entries
are kept in a free list and reused for the next expert of the same size, so memory does not churn,
and free buffers stay charged until they are dropped to make room for a buffer of another size.

Entries in use by the layer being computed are pinned and never evicted; entries being loaded are
never evicted; an entry a prefetch loaded for a layer not reached yet is evictable by a demand
load but not by another prefetch.

Not thread-safe on its own: callers hold `cache.lock` (a Condition the loaders notify).
"""
from __future__ import annotations

import heapq
import itertools
import threading
from typing import Callable

import numpy as np

from edge.core.errors import ZllmError
from edge.core.moe import ExpertWeights
from streaming.store import aligned_empty

ENTRY_OVERHEAD = 4096  # bytes charged per entry for its prepared weights beside the buffer
LOADING, READY, FAILED = "loading", "ready", "failed"
Key = tuple[int, int]  # (layer, expert)


class Entry:
    def __init__(self, key: Key, buffer: np.ndarray, address: int):
        self.key = key
        self.buffer = buffer
        self.address = address  # buffer.ctypes.data, which numpy takes microseconds to compute
        self.state = LOADING  # READY or FAILED once its load is published (the cache's lock is notified)
        self.weights: ExpertWeights | None = None
        self.error: BaseException | None = None
        self.pins = 0
        self.last_use = 0
        self.needed_at = -1  # pass position of the layer a prefetch loaded it for; -1 once used
        self.rank_item: tuple | None = None  # its current item in a policy's heap (NextUsePolicy)

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes + ENTRY_OVERHEAD

    def __repr__(self) -> str:
        return f"Entry(layer={self.key[0]}, expert={self.key[1]}, {self.state}, pins={self.pins})"


class LruPolicy:
    """Evict the entry used longest ago."""
    name = "lru"

    def rank(self, entry: Entry, frequency: int) -> tuple:
        return (entry.last_use,)


class LfuPolicy:
    """Evict the entry requested least often (counts survive eviction), ties by LRU."""
    name = "lfu"

    def rank(self, entry: Entry, frequency: int) -> tuple:
        return (frequency, entry.last_use)


class ForecastPolicy:
    """Evict the entry with the lowest predicted need (the predictor's need vector), ties by LRU."""
    name = "forecast"

    def __init__(self, need_vector: Callable[[int], np.ndarray]):
        self.need_vector = need_vector

    def rank(self, entry: Entry, frequency: int) -> tuple:
        layer, expert = entry.key
        return (float(self.need_vector(layer)[expert]), entry.last_use)


class CyclePolicy:
    """Evict the expert whose layer the model reaches last from where it is now. Every token visits the
    layers in order, pass after pass, so this is Belady's optimal policy at layer granularity; ties by
    the predictor's need when there is a predictor, then by LRU.

    The layer order is the whole ranking's first key, so the victim is found layer by layer (the
    furthest first) among a layer's few entries, instead of sorting every cached expert."""
    name = "cycle"

    def __init__(self, layers_until: Callable[[int], int], need_vector: Callable[[int], np.ndarray] | None = None):
        self.layers_until = layers_until  # layer -> MoE layers until the model computes it again
        self.need_vector = need_vector
        self._order: list[int] = []
        self._order_state: tuple | None = None

    def victim(self, by_layer: dict[int, dict[int, Entry]], for_prefetch: bool, position: int,
               needed_at: int = -1) -> Entry | None:
        """The evictable entry of the layer reached last (`needed_at`, a prefetch's target, is not
        compared: the cycle order knows layers, not when an entry is next used)."""
        if not by_layer:
            return None
        # the order changes only when the model moves to another layer (or a layer joins the cache)
        state = (len(by_layer), self.layers_until(min(by_layer)))
        if state != self._order_state:
            self._order = sorted(by_layer, key=self.layers_until, reverse=True)
            self._order_state = state
        for layer in self._order:
            entries = by_layer[layer]
            if not entries:
                continue
            need = self.need_vector(layer).tolist() if self.need_vector is not None else None
            best, best_rank = None, None
            for expert, entry in entries.items():  # evictions run once per expert read: no per-entry calls
                if entry.pins or entry.state == LOADING or (for_prefetch and entry.needed_at >= position):
                    continue
                rank = (0.0 if need is None else need[expert], entry.last_use)
                if best is None or rank < best_rank:
                    best, best_rank = entry, rank
            if best is not None:
                return best
        return None


class NextUsePolicy:
    """Evict the expert whose next use is expected furthest ahead.

    The model visits the n MoE layers in a cycle. An expert of a layer the model reaches in d layers,
    used by a share p of that layer's visits so far (smoothed: (uses + 1) / (visits + 2)), is next
    used d + n (1 - p) / p layers from now on average: each visit that passes it over costs a whole
    cycle. With p = 1 this is the cycle order (Belady's choice when every visit uses every cached
    expert); an expert its layer seldom uses goes before a popular one of a farther layer. Replaying
    200 recorded decode steps of the default MoEfied SmolLM2 (16 experts, top 13) through a cache of
    50% of the experts, on demand: Belady's floor 142 reads per token, the cycle order 215, this 168
    (25%: 253 / 298 / 278; 75%: 42 / 140 / 73; `python benchmarks/moe_read_floor.py MOE --budget P%`).

    An entry's key, the absolute layer position of its expected next use, only changes when its layer
    is visited; so it is computed when the entry is admitted and again after each visit of its layer,
    and kept in a heap whose stale items are skipped (and dropped when they outnumber live ones).
    A visited layer is re-ranked when the next victim is chosen, not when the visit ends: the key is
    absolute, so it comes out the same, and a cache that has room (a large budget) never ranks."""
    name = "nextuse"

    def __init__(self, layers_until: Callable[[int], int], n_layers: int, position: Callable[[], int]):
        self.layers_until = layers_until  # layer -> MoE layers until the model computes it again (n: now)
        self.n_layers = n_layers
        self.position = position          # the model's absolute layer position
        self.visits: dict[int, int] = {}
        self._visited: set[int] = set()   # layers visited since their entries were last ranked
        self._heap: list[tuple] = []
        self._sequence = itertools.count()
        self.cache: ExpertCache | None = None

    def attach(self, cache: "ExpertCache") -> None:
        self.cache = cache

    def _push_layer(self, layer: int, entries) -> None:
        """Rank these entries of `layer` by their expected next use and push them."""
        position = self.position()
        next_visit = position + self.layers_until(layer) % self.n_layers  # the layer computed now: 0
        visits, uses, n, heap = self.visits.get(layer, 0) + 2, self.cache.uses, self.n_layers, self._heap
        for entry in entries:
            if entry.needed_at >= position:  # prefetched for a layer ahead: expected where the predictor placed it
                expected = float(entry.needed_at)
            else:  # (a prefetch its layer passed over is re-ranked like any other entry)
                p = (uses.get(entry.key, 0) + 1) / visits
                expected = next_visit + n * (1.0 - p) / p
            entry.rank_item = item = (-expected, entry.last_use, next(self._sequence), entry)
            heapq.heappush(heap, item)

    def admitted(self, entry: Entry) -> None:
        self._push_layer(entry.key[0], (entry,))

    def layer_done(self, layer: int) -> None:
        """The model finished a visit of `layer`: its entries' next visit is a cycle later."""
        self.visits[layer] = self.visits.get(layer, 0) + 1
        self._visited.add(layer)

    def _rank_visited(self) -> None:
        for layer in self._visited:
            self._push_layer(layer, self.cache.by_layer.get(layer, {}).values())
        self._visited.clear()
        if len(self._heap) > 4 * len(self.cache.entries) + 64:
            self._heap = [entry.rank_item for entry in self.cache.entries.values() if entry.rank_item is not None]
            heapq.heapify(self._heap)

    def victim(self, by_layer: dict[int, dict[int, Entry]], for_prefetch: bool, position: int,
               needed_at: int = -1) -> Entry | None:
        """The entry expected to be used furthest ahead; for a prefetch for the layer at `needed_at`,
        only one expected later than that (admission: evicting an expert needed sooner than the one
        prefetched costs a read before the prefetch saves one), else None and the prefetch is skipped."""
        if self._visited:
            self._rank_visited()
        passed_over = []
        try:
            while self._heap:
                item = heapq.heappop(self._heap)
                entry = item[3]
                if entry.rank_item is not item or self.cache.entries.get(entry.key) is not entry:
                    continue  # re-ranked since, or gone
                if not ExpertCache.evictable(entry, for_prefetch, position):
                    passed_over.append(item)
                    continue
                if for_prefetch and needed_at >= 0 and -item[0] <= needed_at:
                    passed_over.append(item)  # the furthest evictable one is needed before the prefetch
                    return None
                entry.rank_item = None
                return entry
            return None
        finally:
            for item in passed_over:
                heapq.heappush(self._heap, item)


POLICIES = ("lru", "lfu", "forecast", "cycle", "nextuse")


def make_policy(name: str, need_vector: Callable[[int], np.ndarray] | None = None,
                layers_until: Callable[[int], int] | None = None, n_layers: int = 0,
                position: Callable[[], int] | None = None):
    if name == "lru":
        return LruPolicy()
    if name == "lfu":
        return LfuPolicy()
    if name == "cycle" and layers_until is not None:
        return CyclePolicy(layers_until, need_vector)
    if name == "nextuse" and layers_until is not None and position is not None:
        return NextUsePolicy(layers_until, n_layers, position)
    if name == "forecast":
        if need_vector is None:
            raise ZllmError("expert_policy 'forecast' needs the expert predictor; use expert_strategy='predictive' "
                            "or another expert_policy (lru, lfu)")
        return ForecastPolicy(need_vector)
    raise ZllmError(f"expert_policy {name!r} is not known; choose one of {', '.join(POLICIES)}")


class ExpertCache:
    def __init__(self, capacity_bytes: int, policy=None, on_buffer_dropped: Callable[[int], None] | None = None):
        self.capacity_bytes = int(capacity_bytes)
        self.policy = policy or LruPolicy()
        self.on_buffer_dropped = on_buffer_dropped  # told the address of a free buffer released for good
        self.lock = threading.Condition()
        self.entries: dict[Key, Entry] = {}
        self.by_layer: dict[int, dict[int, Entry]] = {}  # the same entries, layer -> expert -> entry
        self._free: dict[int, list[tuple[np.ndarray, int]]] = {}  # size -> (buffer, its address)
        self._charged = 0          # live entries (buffer + overhead) + free buffers
        self._clock = 0
        self.uses: dict[Key, int] = {}  # layer visits that used each expert (kept after eviction: lfu, nextuse)
        self.evictions = 0
        self.unused_prefetches = 0  # prefetched entries evicted before any layer used them
        self.peak_charged = 0
        self._ranking: list[Entry] | None = None  # eviction order, computed once per step
        if hasattr(self.policy, "attach"):
            self.policy.attach(self)

    # --- accounting ---------------------------------------------------------------------------
    @property
    def charged_bytes(self) -> int:
        return self._charged

    def capacity_entries(self, buffer_bytes: int) -> int:
        """How many experts with buffers of this size the cache holds."""
        return self.capacity_bytes // (buffer_bytes + ENTRY_OVERHEAD)

    def get(self, key: Key) -> Entry | None:
        return self.entries.get(key)

    def layer_done(self, layer: int) -> None:
        """The model finished computing `layer` (its pins are released): the policy may re-rank."""
        done = getattr(self.policy, "layer_done", None)
        if done is not None:
            done(layer)

    def touch(self, entry: Entry) -> None:
        self._clock += 1
        entry.last_use = self._clock
        entry.needed_at = -1
        self.uses[entry.key] = self.uses.get(entry.key, 0) + 1

    def pin_cached(self, layer: int, experts: list[int]) -> tuple[dict[int, Entry], list[int]]:
        """Pin and touch the entries of these experts of `layer` that are cached (ready or loading):
        -> ({expert: entry}, the experts not cached). A layer's whole route in one pass, for the hits.
        An entry whose load failed counts as not cached: the caller loads it again (`discard_failed`)."""
        cached, found, missing = self.by_layer.get(layer, {}), {}, []
        for expert in experts:
            entry = cached.get(expert)
            if entry is None or entry.state == FAILED:
                missing.append(expert)
                continue
            entry.pins += 1
            self.touch(entry)
            found[expert] = entry
        return found, missing

    # --- making room --------------------------------------------------------------------------
    @staticmethod
    def evictable(entry: Entry, for_prefetch: bool, position: int) -> bool:
        """Not pinned, not loading, and not a prefetch for a layer still ahead when a prefetch asks
        (CyclePolicy.victim writes the same test inline: it runs once per cached entry)."""
        if entry.pins or entry.state == LOADING:
            return False
        return not (for_prefetch and entry.needed_at >= position)

    def _drop_free_buffers(self, keep_size: int) -> bool:
        """Release free buffers of other sizes than keep_size; True if any were released."""
        if not self._free or (len(self._free) == 1 and keep_size in self._free):  # (the common case: one size)
            return False
        sizes = [s for s in self._free if s != keep_size and self._free[s]]
        for size in sizes:
            buffers = self._free.pop(size)
            self._charged -= size * len(buffers)
            if self.on_buffer_dropped is not None:
                for _, address in buffers:
                    self.on_buffer_dropped(address)
        return bool(sizes)

    def new_step(self) -> None:
        """The model moved to another layer: ranks (recency, frequency, the predictor's need) may have
        changed. Within a step they do not change for evictable entries (the entries a step touches are
        the ones it pins), so the eviction order is computed once per step, not once per eviction."""
        self._ranking = None

    def _victim(self, for_prefetch: bool, position: int, needed_at: int = -1) -> Entry | None:
        # A policy either finds its victim itself (cycle, nextuse) or ranks entries, sorted here once per step.
        if hasattr(self.policy, "victim"):
            return self.policy.victim(self.by_layer, for_prefetch, position, needed_at)
        for rebuilt in (False, True):
            if self._ranking is None or rebuilt:  # rebuilt: entries loaded since may be evictable now
                candidates = [e for e in self.entries.values() if not e.pins and e.state != LOADING]
                self._ranking = sorted(candidates, key=lambda e: self.policy.rank(e, self.uses.get(e.key, 0)))
            for i, entry in enumerate(self._ranking):
                if self.entries.get(entry.key) is entry and self.evictable(entry, for_prefetch, position):
                    del self._ranking[i]
                    return entry
        return None

    def _take_buffer(self, size: int, for_prefetch: bool, position: int,
                     needed_at: int = -1) -> tuple[np.ndarray, int] | None:
        """(a buffer of `size` bytes charged to the cache, its address), evicting entries if needed; None if
        impossible now."""
        while True:
            recycled = bool(self._free.get(size))
            need = ENTRY_OVERHEAD if recycled else size + ENTRY_OVERHEAD
            if self._charged + need <= self.capacity_bytes:
                self._charged += need
                if recycled:
                    return self._free[size].pop()
                buffer = aligned_empty(size)
                return buffer, buffer.ctypes.data
            if self._drop_free_buffers(keep_size=size):
                continue
            victim = self._victim(for_prefetch, position, needed_at)
            if victim is None:
                return None
            self.unused_prefetches += victim.needed_at >= 0
            self.remove(victim)
            self.evictions += 1

    def reserve(self, key: Key, buffer_bytes: int, for_prefetch: bool, position: int,
                needed_at: int = -1, wait_for_loads: Callable[[], None] | None = None) -> Entry | None:
        """A new LOADING entry for key. A prefetch gets None when no room can be made now; a demand
        load waits until loads in flight finish and make their entries evictable, by calling
        `wait_for_loads()` (the loading engine's way; by default waiting on `lock`, which whoever
        publishes a load notifies). `needed_at`: a prefetch's position of the layer it is loaded for."""
        if buffer_bytes + ENTRY_OVERHEAD > self.capacity_bytes:
            raise ZllmError(f"an expert of layer {key[0]} needs {buffer_bytes + ENTRY_OVERHEAD} bytes, more than the "
                            f"whole expert cache ({self.capacity_bytes} bytes); raise memory_budget")
        while True:
            taken = self._take_buffer(buffer_bytes, for_prefetch, position, needed_at)
            if taken is not None:
                break
            if for_prefetch:
                return None
            if not any(e.state == LOADING for e in self.entries.values()):
                pinned = sum(e.nbytes for e in self.entries.values() if e.pins)
                raise ZllmError(f"the expert cache ({self.capacity_bytes} bytes) cannot hold layer {key[0]} expert "
                                f"{key[1]}: {pinned} bytes are pinned by the layer being computed; raise memory_budget")
            (wait_for_loads or self.lock.wait)()
        entry = Entry(key, *taken)
        entry.needed_at = needed_at
        self.entries[key] = entry
        self.by_layer.setdefault(key[0], {})[key[1]] = entry
        admitted = getattr(self.policy, "admitted", None)
        if admitted is not None:
            admitted(entry)
        self.peak_charged = max(self.peak_charged, self._charged)
        return entry

    def discard_failed(self, key: Key) -> None:
        """Forget key's entry if its load failed and no layer holds it: a prefetch that failed before any
        layer needed its expert is not that layer's error; the layer reads the expert again, and reports
        what that read finds."""
        entry = self.entries.get(key)
        if entry is not None and entry.state == FAILED and not entry.pins:
            self.remove(entry)

    def remove(self, entry: Entry) -> None:
        """Forget an entry (evicted, or failed and reported); its buffer goes to the free list."""
        if self.entries.get(entry.key) is entry:
            del self.entries[entry.key]
            del self.by_layer[entry.key[0]][entry.key[1]]
            self._charged -= ENTRY_OVERHEAD
            self._free.setdefault(entry.buffer.nbytes, []).append((entry.buffer, entry.address))
            entry.weights = None

    # --- loading results (called by the loader with `lock` held) --------------------------------
    def mark_ready(self, entry: Entry, weights: ExpertWeights, notify: bool = True) -> None:
        """Publish a load; a loader publishing a batch notifies once, for the last entry."""
        entry.weights, entry.state = weights, READY
        if notify:
            self.lock.notify_all()

    def mark_failed(self, entry: Entry, error: BaseException, notify: bool = True) -> None:
        entry.error, entry.state = error, FAILED
        if notify:
            self.lock.notify_all()

    def wait_loaded(self, entry: Entry, timeout: float | None = None) -> bool:
        """Block until the entry's load is published (READY or FAILED); False if `timeout` passed first."""
        with self.lock:
            return self.lock.wait_for(lambda: entry.state != LOADING, timeout)
