"""The streamed experts' slot table in compiled calls: lookup, pins, eviction, reads (through io_uring
or reader threads) and waiting for them, with no Python per expert read.

L = MoE layers (by ordinal), E = the most routed experts of a layer, S = slots (cache entries).

Every piece of state is a plain array the caller owns (streaming/slots.py):

    slots   [S, SLOT_FIELDS] int64   the (layer, expert) a slot holds, its state, pins, last use, the
                                     position of the layer a prefetch loaded it for, queue priority
    times   [S, SLOT_TIMES] float64  when its read was issued, when the emulated device delivers it,
                                     a prefetch's predictor score
    experts [L, E, EXPERT_FIELDS]    per (layer, expert): its slot, how many layer visits used it,
                                     and where its record lies (offset, span to read, length, crc32)
    visits  [L]                      how many times each layer has been computed
    gaps    [L, E] float64           nextuse's n (1 - p) / p of each expert (below), kept up to date
    ahead   [L] float64              MoE layers from the one computed now until each is computed again
    state   [STATE_FIELDS] int64     the I/O engine and ring, the file, the policy, the clock, counters
    clocks  [CLOCK_FIELDS] float64   the emulated device (busy until, latency, bandwidth), stall time
    queue   [S]   slots reserved and waiting for the I/O engine (demand loads first, then prefetches
                  by layer distance and score);  flight [depth]: slots whose read is out
    lanes   [R, LANE_FIELDS]  the reader threads' rows (kernels/cpu/readers.py; none with io_uring)
    wake    [WAKE_FIELDS]     how a thread waiting for a read is woken (kernels/cpu/wake.py)

A slot's buffer is `slab + slot * slot_bytes`. Reads go through io_uring, whose tag of a read is its
slot, so kernels/cpu/uring.py ring_complete (the completion thread) publishes results[slot],
crcs[slot] and done[slot]; or, where io_uring does not run, through reader threads
(kernels/cpu/readers.py reader_loop) that publish them the same way. A read is delivered (READY) when
it is published, its bytes and crc32 are whole, and the emulated device (if any) would have
delivered it: max(issued + latency, busy until) + bytes / bandwidth, booked when the read goes out.
A read that failed, came back short or damaged is FAILED; the caller reads it again
and raises its typed error.

Eviction (a demand load takes any unpinned, delivered slot; a prefetch also spares slots prefetched
for a layer still ahead):
    lru      the slot used longest ago
    lfu      the fewest uses, ties by lru
    nextuse  the latest expected next use: a layer reached in d layers whose visits used the expert
             with share p = (uses + 1) / (visits + 2) is next used d + n (1 - p) / p layers ahead
             (streaming/cache.py NextUsePolicy), a prefetched expert at its layer; a prefetch is
             admitted only when its victim is expected later than the prefetch's own layer.
"""
from __future__ import annotations

import numpy as np
from numba import types

from kernels.cpu import forecast
from kernels.cpu.intrinsics import atomic_load, monotonic_seconds, spin_pause
from kernels.cpu.readers import lane_idle, post_read
from kernels.cpu.wake import await_wake, raise_waiting
from kernels.cpu.runtime import helper, kernel, mutable, readonly
from kernels.cpu.uring import IOSQE_ASYNC, WAIT_MICROSECONDS, _get_sqe, _prep_read, _set_data, _set_flags
from kernels.cpu.uring import _sq_ready, submit_queued, void_entry

# slots[s, ...]
(S_LAYER, S_EXPERT, S_STATE, S_PINS, S_LAST_USE, S_NEEDED_AT, S_DISTANCE, S_PREFETCHED, S_SEQUENCE) = range(9)
SLOT_FIELDS = 9
# times[s, ...]
T_ISSUED, T_DUE, T_SCORE, T_SEEN = range(4)  # T_SEEN: first seen published, before its emulated delivery
SLOT_TIMES = 4
# a slot's states
EMPTY, QUEUED, LOADING, READY, FAILED = range(5)
# experts[l, e, ...]
X_SLOT, X_USES, X_OFFSET, X_SPAN, X_LENGTH, X_CRC = range(6)
EXPERT_FIELDS = 6
# state[...]: settings, then counters
(G_RING, G_FD, G_VERIFY, G_BUFFERED, G_POLICY, G_DEPTH, G_CAPACITY, G_LAYERS, G_POSITION, G_ORDINAL, G_CLOCK,
 G_SEQUENCE, G_QUEUED, G_IN_FLIGHT, G_HITS, G_MISSES, G_LATE, G_EVICTIONS, G_UNUSED_PREFETCHES,
 G_PREFETCHES_QUEUED, G_PREFETCHES_LOADED, G_PREFETCHES_CANCELLED, G_PREFETCHES_SKIPPED, G_READS, G_BYTES_READ,
 G_SUBMISSIONS_REFUSED, G_PEAK_SLOTS, G_USED_SLOTS, G_INLINE_READS) = range(29)
STATE_FIELDS = 29  # (every miss is a demand load and every read one read call: G_MISSES and G_READS count both)
# clocks[...]
C_BUSY_UNTIL, C_LATENCY, C_BANDWIDTH, C_STALL, C_IO_SECONDS, C_EMULATED_WAIT = range(6)
CLOCK_FIELDS = 6
LRU, LFU, NEXTUSE = range(3)
POLICY_CODES = {"lru": LRU, "lfu": LFU, "nextuse": NEXTUSE}
NO_SLOT = -1
# What the calls answer besides a count (negative, so that a count is never mistaken for one).
FULL = -1          # acquire: no slot can be freed, every one is pinned by the layer being computed
NOT_YET = -2       # wait: the read is still out after the sleeps allowed; the caller checks the I/O engine
FAILURE = -3       # wait: the read failed, came back short or damaged (the caller reads it again to learn why)
UNPACKED = -4      # wait: delivered, but a slot of the run has no descriptor rows yet (the caller makes them)
SPINS_BEFORE_SLEEP = 200
POSIX_FADV_DONTNEED = 4

_I64, _F64 = types.int64, types.float64
_posix_fadvise = types.ExternalFunction("posix_fadvise", types.int32(types.int32, _I64, _I64, types.int32))
_SLOTS, _TIMES, _EXPERTS = mutable(_I64, 2), mutable(_F64, 2), mutable(_I64, 3)
_VISITS, _STATE, _CLOCKS, _QUEUE, _FLIGHT = (mutable(_I64, 1), mutable(_I64, 1), mutable(_F64, 1), mutable(_I64, 1),
                                             mutable(_I64, 1))
_ADDRESSES, _LENGTHS, _RESULTS, _CRCS, _DONE = (readonly(types.uint64, 1), mutable(_I64, 1), readonly(_I64, 1),
                                                readonly(types.uint32, 1), mutable(_I64, 1))
_GAPS, _AHEAD, _LANES, _WAKE = mutable(_F64, 2), mutable(_F64, 1), mutable(_I64, 2), mutable(_I64, 1)
_TABLE = (_SLOTS, _TIMES, _EXPERTS, _VISITS, _GAPS, _AHEAD, _STATE, _CLOCKS, _QUEUE, _FLIGHT, _ADDRESSES, _LENGTHS,
          _RESULTS, _CRCS, _DONE, _LANES, _WAKE)


@helper
def _expected_use(slots, gaps, ahead, state, s):
    """The layer position at which the expert in slot s is expected to be used next (nextuse)."""
    position = state[G_POSITION]
    if slots[s, S_NEEDED_AT] >= position:  # prefetched for a layer ahead: expected there
        return np.float64(slots[s, S_NEEDED_AT])
    layer = slots[s, S_LAYER]
    return position + ahead[layer] + gaps[layer, slots[s, S_EXPERT]]


@helper
def _gap(experts, visits, state, layer, expert):
    """n (1 - p) / p, p = (uses + 1) / (visits + 2): the layers an expert's next use is expected to lie
    beyond its layer's next visit."""
    n_layers = state[G_LAYERS]
    return n_layers * ((visits[layer] + 2.0) / (experts[layer, expert, X_USES] + 1.0) - 1.0)


@helper
def _victim(slots, experts, gaps, ahead, state, for_prefetch, needed_at):
    """An empty slot, else the policy's victim among the evictable ones; NO_SLOT when none may go (for a
    prefetch under nextuse: none expected later than its layer `needed_at`)."""
    position, policy = state[G_POSITION], state[G_POLICY]
    best, best_key, best_tie = NO_SLOT, 0.0, 0
    for s in range(state[G_CAPACITY]):
        slot_state = slots[s, S_STATE]
        if slot_state == EMPTY:
            return s
        if slots[s, S_PINS] > 0 or (slot_state != READY and slot_state != FAILED):
            continue
        if for_prefetch and slots[s, S_NEEDED_AT] >= position:
            continue
        last_use = slots[s, S_LAST_USE]
        if policy == NEXTUSE:  # the largest expected use, ties by the least recent
            key = -_expected_use(slots, gaps, ahead, state, s)
        elif policy == LFU:
            key = np.float64(experts[slots[s, S_LAYER], slots[s, S_EXPERT], X_USES])
        else:
            key = 0.0
        if best == NO_SLOT or key < best_key or (key == best_key and last_use < best_tie):
            best, best_key, best_tie = s, key, last_use
    if best != NO_SLOT and for_prefetch and policy == NEXTUSE and needed_at >= 0 and -best_key <= needed_at:
        return NO_SLOT  # evicting it would cost a read before the prefetch saves one
    return best


@helper
def _evict(slots, times, experts, state, s):
    """Empty slot s (a delivered or failed entry, or an empty slot)."""
    if slots[s, S_STATE] != EMPTY:
        layer, expert = slots[s, S_LAYER], slots[s, S_EXPERT]
        experts[layer, expert, X_SLOT] = NO_SLOT
        state[G_EVICTIONS] += 1
        state[G_UNUSED_PREFETCHES] += slots[s, S_PREFETCHED]
        state[G_USED_SLOTS] -= 1
    slots[s, S_STATE] = EMPTY
    slots[s, S_LAYER] = -1
    slots[s, S_PINS] = 0
    slots[s, S_PREFETCHED] = 0


@helper
def _touch(slots, experts, visits, gaps, state, s):
    state[G_CLOCK] += 1
    slots[s, S_LAST_USE] = state[G_CLOCK]
    slots[s, S_NEEDED_AT] = -1
    slots[s, S_PREFETCHED] = 0
    layer, expert = slots[s, S_LAYER], slots[s, S_EXPERT]
    experts[layer, expert, X_USES] += 1
    gaps[layer, expert] = _gap(experts, visits, state, layer, expert)


@helper
def _reserve(slots, times, experts, state, queue, layer, expert, s, distance, score, needed_at):
    """Slot s (emptied by the caller's choice) now holds (layer, expert), queued for the I/O engine."""
    _evict(slots, times, experts, state, s)
    slots[s, S_LAYER], slots[s, S_EXPERT], slots[s, S_STATE] = layer, expert, QUEUED
    slots[s, S_DISTANCE], slots[s, S_NEEDED_AT] = distance, needed_at
    slots[s, S_PREFETCHED] = 1 if distance > 0 else 0
    state[G_SEQUENCE] += 1
    slots[s, S_SEQUENCE] = state[G_SEQUENCE]
    times[s, T_SCORE] = score
    experts[layer, expert, X_SLOT] = s
    queue[state[G_QUEUED]] = s
    state[G_QUEUED] += 1
    state[G_USED_SLOTS] += 1
    state[G_PEAK_SLOTS] = max(state[G_PEAK_SLOTS], state[G_USED_SLOTS])


@helper
def _first_queued(slots, times, state, queue):
    """The queue's index of its head: demand loads (distance 0) first, then the nearest layer, the
    highest score, the oldest."""
    best = -1
    for i in range(state[G_QUEUED]):
        s = queue[i]
        if best < 0:
            best = i
            continue
        b = queue[best]
        if (slots[s, S_DISTANCE], -times[s, T_SCORE], slots[s, S_SEQUENCE]) < \
                (slots[b, S_DISTANCE], -times[b, T_SCORE], slots[b, S_SEQUENCE]):
            best = i
    return best


@helper
def _unqueue(state, queue, i):
    state[G_QUEUED] -= 1
    queue[i] = queue[state[G_QUEUED]]


@helper
def _drop_last_prefetch(slots, times, experts, state, queue):
    """Cancel the queued prefetch that would be read last and -> its slot (emptied); NO_SLOT if none."""
    last = -1
    for i in range(state[G_QUEUED]):
        s = queue[i]
        if slots[s, S_DISTANCE] == 0:
            continue
        if last < 0:
            last = i
            continue
        b = queue[last]
        if (slots[s, S_DISTANCE], -times[s, T_SCORE], slots[s, S_SEQUENCE]) > \
                (slots[b, S_DISTANCE], -times[b, T_SCORE], slots[b, S_SEQUENCE]):
            last = i
    if last < 0:
        return NO_SLOT
    s = queue[last]
    _unqueue(state, queue, last)
    _forget_queued(slots, experts, state, s)
    return s


@helper
def _forget_queued(slots, experts, state, s):
    """Slot s, queued and taken off the queue, is empty again (a prefetch cancelled)."""
    experts[slots[s, S_LAYER], slots[s, S_EXPERT], X_SLOT] = NO_SLOT
    slots[s, S_STATE] = EMPTY
    slots[s, S_LAYER] = -1
    slots[s, S_PREFETCHED] = 0
    state[G_USED_SLOTS] -= 1
    state[G_PREFETCHES_CANCELLED] += slots[s, S_DISTANCE] > 0


@helper
def _book(clocks, n_bytes, now):
    """When the emulated device delivers a read of n_bytes issued now (0: no emulation)."""
    if clocks[C_BANDWIDTH] <= 0.0:
        return 0.0
    due = max(now + clocks[C_LATENCY], clocks[C_BUSY_UNTIL]) + n_bytes / clocks[C_BANDWIDTH]
    clocks[C_BUSY_UNTIL] = due
    return due


@helper
def _start(slots, times, state, clocks, flight, lengths, s, now):
    """Slot s's read went out now: LOADING, in flight, booked on the emulated device."""
    slots[s, S_STATE] = LOADING
    times[s, T_ISSUED] = now
    times[s, T_DUE] = _book(clocks, lengths[s], now)
    times[s, T_SEEN] = 0.0
    flight[state[G_IN_FLIGHT]] = s
    state[G_IN_FLIGHT] += 1


@helper
def _submit(slots, times, experts, state, clocks, queue, flight, addresses, lengths, done, lanes):
    """Hand the queue's head to the I/O engine (the reader threads when there are lanes, else the ring)
    while fewer than `depth` reads are in flight; -> reads that went out."""
    if lanes.shape[0] > 0:
        return _post(slots, times, experts, state, clocks, queue, flight, lengths, done, lanes)
    return _submit_to_ring(slots, times, experts, state, clocks, queue, flight, addresses, lengths, done)


@helper
def _post(slots, times, experts, state, clocks, queue, flight, lengths, done, lanes):
    """Hand the queue's head to idle reader threads, one read each; -> reads posted."""
    n = 0
    for r in range(lanes.shape[0]):
        if state[G_QUEUED] == 0 or state[G_IN_FLIGHT] >= state[G_DEPTH]:
            break
        if not lane_idle(lanes, r):
            continue
        i = _first_queued(slots, times, state, queue)
        s = queue[i]
        _unqueue(state, queue, i)
        record = experts[slots[s, S_LAYER], slots[s, S_EXPERT]]
        lengths[s] = record[X_LENGTH]
        done[s] = 0
        _start(slots, times, state, clocks, flight, lengths, s, monotonic_seconds())
        post_read(lanes, r, s, state[G_FD], record[X_OFFSET], record[X_SPAN])
        n += 1
    return n


@helper
def _submit_to_ring(slots, times, experts, state, clocks, queue, flight, addresses, lengths, done):
    """Hand the queue's head to the ring while fewer than `depth` reads are in flight; -> reads the
    kernel took. Reads it did not take (interrupted, out of resources: tried again a few times) become
    no-ops in the ring and go back to the queue for the next call. Each read is issued inline by this
    call where state[G_INLINE_READS] (the compute threads take every core: a kernel worker would take
    one from them), else handed to the kernel's workers (IOSQE_ASYNC), which then run on a free core."""
    ring = np.uint64(state[G_RING])
    picked = np.empty(state[G_DEPTH], np.int64)
    sqes = np.empty(state[G_DEPTH], np.uint64)
    n = 0
    while state[G_QUEUED] > 0 and state[G_IN_FLIGHT] + n < state[G_DEPTH]:
        i = _first_queued(slots, times, state, queue)
        s = queue[i]
        sqe = _get_sqe(ring)
        if sqe == 0:
            break
        record = experts[slots[s, S_LAYER], slots[s, S_EXPERT]]
        lengths[s] = record[X_LENGTH]
        done[s] = 0
        _prep_read(sqe, np.int32(state[G_FD]), addresses[s], np.uint32(record[X_SPAN]), np.uint64(record[X_OFFSET]))
        _set_data(sqe, np.uint64(s))
        _set_flags(sqe, np.uint32(0 if state[G_INLINE_READS] else IOSQE_ASYNC))
        picked[n], sqes[n] = s, sqe
        n += 1
        _unqueue(state, queue, i)
    if n == 0:
        return 0
    submit_queued(ring)
    left = min(n, np.int64(_sq_ready(ring)))  # ours were queued last: the ones not taken
    now = monotonic_seconds()
    for k in range(n):
        s = picked[k]
        if k < n - left:
            _start(slots, times, state, clocks, flight, lengths, s, now)
        else:
            void_entry(sqes[k])
            queue[state[G_QUEUED]] = s
            state[G_QUEUED] += 1
            state[G_SUBMISSIONS_REFUSED] += 1
    return n - left


@helper
def _collect(slots, times, experts, state, clocks, flight, results, crcs, done):
    """Deliver every read in flight that the completion thread has published and the emulated device
    would have delivered by now: READY when whole (and its crc32 matches), else FAILED. -> delivered."""
    now = monotonic_seconds()
    delivered = 0
    i = 0
    while i < state[G_IN_FLIGHT]:
        s = flight[i]
        if atomic_load(done.ctypes.data + 8 * s) == 0:
            i += 1
            continue
        if now < times[s, T_DUE]:  # read, and held back until the emulated device would deliver it
            if times[s, T_SEEN] == 0.0:
                times[s, T_SEEN] = now
            i += 1
            continue
        if times[s, T_SEEN] > 0.0:
            clocks[C_EMULATED_WAIT] += times[s, T_DUE] - times[s, T_SEEN]
        state[G_IN_FLIGHT] -= 1
        flight[i] = flight[state[G_IN_FLIGHT]]
        record = experts[slots[s, S_LAYER], slots[s, S_EXPERT]]
        got = max(min(results[s], record[X_LENGTH]), 0)
        if state[G_BUFFERED] and got > 0:  # honest I/O where O_DIRECT was refused: drop the pages read
            _posix_fadvise(np.int32(state[G_FD]), record[X_OFFSET], record[X_LENGTH], np.int32(POSIX_FADV_DONTNEED))
        state[G_READS] += 1
        state[G_BYTES_READ] += got
        clocks[C_IO_SECONDS] += now - times[s, T_ISSUED]
        whole = got == record[X_LENGTH] and (state[G_VERIFY] == 0 or np.int64(crcs[s]) == record[X_CRC])
        slots[s, S_STATE] = READY if whole else FAILED
        state[G_PREFETCHES_LOADED] += whole and slots[s, S_DISTANCE] > 0
        delivered += 1
    return delivered


@helper
def _next_due(times, state, flight, done):
    """The earliest time a published read in flight is delivered (its emulated due time; 0 without
    emulation), inf when none is published yet."""
    due = np.inf
    for i in range(state[G_IN_FLIGHT]):
        s = flight[i]
        if atomic_load(done.ctypes.data + 8 * s) != 0:
            due = min(due, times[s, T_DUE])
    return due


@helper
def _wait_for_delivery(slots, times, experts, state, clocks, queue, flight, addresses, lengths, results, crcs,
                       done, lanes, wake, s, sleeps):
    """Until slot s is READY or FAILED: collect, submit; spin a little, then block until a read is
    published (kernels/cpu/wake.py) or one the emulated device holds is due. -> READY, FAILED, or
    NOT_YET after `sleeps` x WAIT_MICROSECONDS (the caller checks that the I/O engine still runs)."""
    spins = 0
    deadline = monotonic_seconds() + sleeps * WAIT_MICROSECONDS * 1e-6
    while True:
        _collect(slots, times, experts, state, clocks, flight, results, crcs, done)
        _submit(slots, times, experts, state, clocks, queue, flight, addresses, lengths, done, lanes)
        slot_state = slots[s, S_STATE]
        if slot_state == READY or slot_state == FAILED:
            return slot_state
        spins += 1
        if spins < SPINS_BEFORE_SLEEP:
            spin_pause()
            continue
        now = monotonic_seconds()
        if now >= deadline:
            return NOT_YET
        raise_waiting(wake, 1)
        until = min(_next_due(times, state, flight, done), deadline)  # (looked at after raising the flag)
        if state[G_IN_FLIGHT] == 0:  # nothing out to wake this thread: the ring refused, try again soon
            until = min(until, now + WAIT_MICROSECONDS * 1e-6)
        if until > now:
            await_wake(wake, until - now)
        raise_waiting(wake, -1)


@helper
def _acquire(slots, times, experts, visits, gaps, ahead, state, clocks, queue, flight, addresses, lengths,
                 results, crcs, done, lanes, wake, release, finished, layer, ids_begin, ids_end, out):
    """The layer with ordinal `layer` at position state[G_POSITION] needs experts out[ids_begin:ids_end]
    (ascending ids; overwritten with their slots): unpin the slots in `release`, count a visit of the
    layer `finished` (an ordinal; -1: none), pin each needed expert's
    slot (a hit), or reserve one and queue its read ahead of every prefetch (a miss), evicting by the
    policy (or taking a queued prefetch's), waiting for reads in flight when every other slot is pinned or
    loading; submit. -> misses, or FULL when no slot could be freed: then none of out[ids_begin:ids_end]
    stays pinned and out[ids_end - 1] is the expert that found none."""
    for s in release:
        slots[s, S_PINS] -= 1
    n_layers = state[G_LAYERS]
    if finished >= 0:  # the layer computed last: one more visit, and its experts' gaps
        visits[finished] += 1
        for e in range(gaps.shape[1]):
            gaps[finished, e] = _gap(experts, visits, state, finished, e)
    if state[G_ORDINAL] != layer:
        state[G_ORDINAL] = layer
        for other in range(n_layers):
            ahead[other] = (other - layer) % n_layers  # MoE layers until it is computed again (0: now)
    position = state[G_POSITION]
    # queued prefetches for a layer the model has passed are dropped (reads in flight complete)
    i = 0
    while i < state[G_QUEUED]:
        s = queue[i]
        if slots[s, S_DISTANCE] > 0 and slots[s, S_NEEDED_AT] < position:
            _unqueue(state, queue, i)
            _forget_queued(slots, experts, state, s)
        else:
            i += 1
    _collect(slots, times, experts, state, clocks, flight, results, crcs, done)
    misses = 0
    for k in range(ids_begin, ids_end):
        expert = out[k]
        s = experts[layer, expert, X_SLOT]
        if s != NO_SLOT and slots[s, S_STATE] == FAILED and slots[s, S_PINS] == 0:
            _evict(slots, times, experts, state, s)  # a failed read is read again by whoever needs it
            s = NO_SLOT
        if s != NO_SLOT:
            state[G_HITS] += 1
            slot_state = slots[s, S_STATE]
            state[G_LATE] += slot_state == QUEUED or slot_state == LOADING
            if slot_state == QUEUED:
                slots[s, S_DISTANCE] = 0  # a prefetch not yet in the ring becomes a demand load
        else:
            while True:
                s = _victim(slots, experts, gaps, ahead, state, False, -1)
                if s == NO_SLOT:
                    s = _drop_last_prefetch(slots, times, experts, state, queue)
                if s != NO_SLOT or state[G_IN_FLIGHT] == 0:
                    break
                _wait_for_delivery(slots, times, experts, state, clocks, queue, flight, addresses, lengths, results,
                                   crcs, done, lanes, wake, flight[0], 1 << 40)
            if s == NO_SLOT:  # this call's pins go, and the caller learns which expert found no room
                for j in range(ids_begin, k):
                    slots[out[j], S_PINS] -= 1
                out[ids_end - 1] = expert
                return FULL
            _reserve(slots, times, experts, state, queue, layer, expert, s, 0, 0.0, -1)
            state[G_MISSES] += 1
            misses += 1
        slots[s, S_PINS] += 1
        _touch(slots, experts, visits, gaps, state, s)
        out[k] = s
    _submit(slots, times, experts, state, clocks, queue, flight, addresses, lengths, done, lanes)
    return misses


@kernel(_I64(*_TABLE, mutable(_I64, 1), _I64, _I64, _I64, _I64, mutable(_I64, 1)))
def slot_acquire(slots, times, experts, visits, gaps, ahead, state, clocks, queue, flight, addresses, lengths,
                 results, crcs, done, lanes, wake, release, finished, layer, ids_begin, ids_end, out):
    """_acquire, on its own (a prefill's route, a route without the compiled decode step)."""
    return _acquire(slots, times, experts, visits, gaps, ahead, state, clocks, queue, flight, addresses, lengths,
                    results, crcs, done, lanes, wake, release, finished, layer, ids_begin, ids_end, out)


@helper
def _queue_prefetches(slots, times, experts, visits, gaps, ahead, state, clocks, queue, flight, addresses, lengths,
                      results, crcs, done, lanes, wake, targets, widths, distances, sizes, need, rows, free_slots,
                      order):
    """Queue prefetches for the layers ahead, nearest first: for target t (ordinal targets[t], reached in
    distances[t] layers), its widths[t] likeliest experts by need[rows[t], :sizes[t]] (ties to the
    lower id; none with need 0), within `free_slots` slots beside the layer's own (each likely expert
    takes its share, cached or not); an expert cached or queued is skipped, and one the policy finds no
    victim for is skipped (counted). `order` is scratch of the most experts of a target. -> queued."""
    position = state[G_POSITION]
    queued = 0
    for t in range(targets.shape[0]):
        if free_slots <= 0:
            break
        target, size, scores = targets[t], sizes[t], need[rows[t]]
        width = min(size, widths[t], free_slots)
        forecast.largest_first(scores, size, width, order)  # the likeliest first, ties to the lower id
        while width > 0 and scores[order[width - 1]] <= 0.0:
            width -= 1
        free_slots -= width
        needed_at = position + distances[t]
        for k in range(width):
            expert = order[k]
            if experts[target, expert, X_SLOT] != NO_SLOT:
                continue
            s = _victim(slots, experts, gaps, ahead, state, True, needed_at)
            if s == NO_SLOT:
                state[G_PREFETCHES_SKIPPED] += 1
                continue
            _reserve(slots, times, experts, state, queue, target, expert, s, distances[t], scores[expert], needed_at)
            state[G_PREFETCHES_QUEUED] += 1
            queued += 1
    _submit(slots, times, experts, state, clocks, queue, flight, addresses, lengths, done, lanes)
    return queued


_PLAN = (readonly(_I64, 1),) * 4  # a prefetch plan: targets, widths, distances, sizes


@kernel(_I64(*_TABLE, *_PLAN, readonly(_F64, 2), readonly(_I64, 1), _I64, mutable(_I64, 1)))
def slot_prefetch(slots, times, experts, visits, gaps, ahead, state, clocks, queue, flight, addresses, lengths,
                  results, crcs, done, lanes, wake, targets, widths, distances, sizes, need, rows, free_slots, order):
    """_queue_prefetches, on its own (a forecast not made by the compiled decode step)."""
    return _queue_prefetches(slots, times, experts, visits, gaps, ahead, state, clocks, queue, flight, addresses,
                             lengths, results, crcs, done, lanes, wake, targets, widths, distances, sizes, need, rows,
                             free_slots, order)


@kernel(_I64(*_TABLE, *forecast.DECODE_ARGUMENT_TYPES, mutable(_I64, 1), _I64, _I64, mutable(_I64, 1), *_PLAN,
             _I64, mutable(_I64, 1)))
def slot_decode_layer(slots, times, experts, visits, gaps, ahead, state, clocks, queue, flight, addresses, lengths,
                      results, crcs, done, lanes, wake, routers, bias, drift, raw, spans, n_targets, mix, sizes_all,
                      top_k, temporal, spatial, frequency, previous, previous_len, route, route_len, looked, pending,
                      pending_valid, need, need_valid, next_mix, accuracy, status, p, route_ids, logits, rate, x, eps,
                      release, finished, layer, out, targets, widths, distances, sizes, free_slots, order):
    """A decode step's whole expert-source work at the MoE layer with ordinal `layer` (the predictor's
    position p), in one call: _acquire the distinct ids `out` (their slots, out), then the predictor's
    observe and gate forecast of the token's route `route_ids` (kernels/cpu/forecast.py), the next-token
    estimate of the layers ahead that are not forecast, and _queue_prefetches of the plan's targets by
    their need. -> misses, or FULL as _acquire (nothing else is done then)."""
    misses = _acquire(slots, times, experts, visits, gaps, ahead, state, clocks, queue, flight, addresses, lengths,
                      results, crcs, done, lanes, wake, release, finished, layer, 0, out.shape[0], out)
    if misses == FULL:
        return FULL
    forecast.observe_decode(routers, bias, drift, raw, spans, n_targets, mix, sizes_all, top_k, temporal, spatial,
                            frequency, previous, previous_len, route, route_len, looked, pending, pending_valid,
                            need, need_valid, next_mix, accuracy, status, p, route_ids, logits, rate)
    forecast.forecast_decode(routers, bias, drift, raw, spans, n_targets, mix, sizes_all, top_k, temporal, spatial,
                             frequency, previous, previous_len, route, route_len, looked, pending, pending_valid,
                             need, need_valid, next_mix, accuracy, status, p, x, eps)
    for t in range(targets.shape[0]):
        q = targets[t]
        if not need_valid[q]:
            in_use = route[q, :route_len[q]] if q == p else route[q, :0]
            forecast.next_token_need(routers, bias, drift, raw, spans, n_targets, mix, sizes_all, top_k, temporal,
                                     spatial, frequency, previous, previous_len, route, route_len, looked, pending,
                                     pending_valid, need, need_valid, next_mix, accuracy, status, q, in_use)
    _queue_prefetches(slots, times, experts, visits, gaps, ahead, state, clocks, queue, flight, addresses, lengths,
                      results, crcs, done, lanes, wake, targets, widths, distances, sizes, need, targets, free_slots,
                      order)
    return misses


@helper
def _ready_run(slots, times, experts, visits, gaps, ahead, state, clocks, queue, flight, addresses, lengths,
               results, crcs, done, lanes, wake, run, start, sleeps):
    """Wait (without the GIL) until the slot run[start] is delivered, then -> how many of run[start:] are
    delivered in a row (at least 1); FAILURE when run[start]'s read failed, NOT_YET when it is still out
    after `sleeps` sleeps. The time waited is I/O stall."""
    s = run[start]
    if slots[s, S_STATE] != READY:
        started = monotonic_seconds()
        outcome = _wait_for_delivery(slots, times, experts, state, clocks, queue, flight, addresses, lengths,
                                     results, crcs, done, lanes, wake, s, sleeps)
        clocks[C_STALL] += monotonic_seconds() - started
        if outcome == FAILED:
            return FAILURE
        if outcome == NOT_YET:
            return NOT_YET
    else:
        _collect(slots, times, experts, state, clocks, flight, results, crcs, done)
        _submit(slots, times, experts, state, clocks, queue, flight, addresses, lengths, done, lanes)
    n = 1
    while start + n < run.shape[0] and slots[run[start + n], S_STATE] == READY:
        n += 1
    return n


@kernel(_I64(*_TABLE, readonly(_I64, 1), _I64, _I64))
def slot_ready_run(slots, times, experts, visits, gaps, ahead, state, clocks, queue, flight, addresses, lengths,
                   results, crcs, done, lanes, wake, run, start, sleeps):
    """_ready_run, on its own (a consumer that takes each expert's weights)."""
    return _ready_run(slots, times, experts, visits, gaps, ahead, state, clocks, queue, flight, addresses, lengths,
                      results, crcs, done, lanes, wake, run, start, sleeps)


@kernel(_I64(*_TABLE, readonly(_I64, 1), _I64, _I64, readonly(_I64, 3), readonly(types.boolean, 1), mutable(_I64, 2),
             mutable(_I64, 1)))
def slot_ready_rows(slots, times, experts, visits, gaps, ahead, state, clocks, queue, flight, addresses, lengths,
                    results, crcs, done, lanes, wake, run, start, sleeps, rows, made, out, run_length):
    """_ready_run, and the run's descriptor rows: rows[s] [R, F] of each slot s of it (made[s]), one after
    another into out -> the run's length (also in run_length[0]); UNPACKED when a slot of the run has no
    rows yet (the caller makes them and asks again), FAILURE or NOT_YET as _ready_run."""
    n = _ready_run(slots, times, experts, visits, gaps, ahead, state, clocks, queue, flight, addresses, lengths,
                   results, crcs, done, lanes, wake, run, start, sleeps)
    if n < 0:
        return n
    run_length[0] = n
    for i in range(n):
        if not made[run[start + i]]:
            return UNPACKED
    per_slot = rows.shape[1]
    for i in range(n):
        out[per_slot * i: per_slot * (i + 1)] = rows[run[start + i]]
    return n


@kernel(_I64(*_TABLE, _I64))
def slot_drain(slots, times, experts, visits, gaps, ahead, state, clocks, queue, flight, addresses, lengths, results,
               crcs, done, lanes, wake, sleeps):
    """Drop every queued read and wait until none is in flight (closing, resizing): -> reads still in
    flight after `sleeps` sleeps each (0: drained)."""
    while state[G_QUEUED] > 0:
        s = queue[0]
        _unqueue(state, queue, 0)
        _forget_queued(slots, experts, state, s)
    while state[G_IN_FLIGHT] > 0:
        if _wait_for_delivery(slots, times, experts, state, clocks, queue, flight, addresses, lengths, results, crcs,
                              done, lanes, wake, flight[0], sleeps) == NOT_YET:
            break
    return state[G_IN_FLIGHT]
