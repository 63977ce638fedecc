"""Waking the model's thread when a read it waits for is published, instead of sleeping on a timer
(a sleep of tens of microseconds oversleeps by the kernel's timer slack, several times its length).

wake [WAKE_FIELDS] int64: W_WAITING (threads waiting now) and W_EVENT (a non-blocking eventfd; -1 for
a publisher no thread waits on: kernels/cpu/uring.py NO_WAKE, the Python cache's ring). A waiter
raises W_WAITING, looks once more at what it waits for, then polls the eventfd; whoever publishes a
read (kernels/cpu/uring.py ring_complete, the reader threads of kernels/cpu/readers.py) writes the
eventfd while W_WAITING is raised. Each side makes its write (the flag, the read's done word) with a
sequentially consistent read-modify-write before it reads the other's, so a waiter either sees the
read published or is woken.
"""
from __future__ import annotations

import numpy as np
from numba import types

from kernels.cpu.intrinsics import atomic_add, atomic_load
from kernels.cpu.runtime import helper

W_WAITING, W_EVENT = range(2)
WAKE_FIELDS = 2
POLLIN = 1

I32, I64, U64 = types.int32, types.int64, types.uint64
# ssize_t read(int fd, void *buf, size_t count) / write(...): an eventfd's 8-byte counter
_read = types.ExternalFunction("read", I64(I32, U64, U64))
_write = types.ExternalFunction("write", I64(I32, U64, U64))
# int ppoll(struct pollfd *fds, nfds_t nfds, const struct timespec *timeout, const sigset_t *sigmask)
_ppoll = types.ExternalFunction("ppoll", I32(U64, U64, U64, U64))


@helper
def wake_waiters(wake):
    """After publishing a read: wake the thread waiting for one, if any."""
    if wake[W_EVENT] >= 0 and atomic_load(wake.ctypes.data + 8 * W_WAITING) != 0:
        one = np.ones(1, np.uint64)
        _write(np.int32(wake[W_EVENT]), one.ctypes.data, 8)


@helper
def raise_waiting(wake, by):
    atomic_add(wake.ctypes.data + 8 * W_WAITING, by)


@helper
def await_wake(wake, seconds):
    """Block until a publisher wakes this thread or `seconds` pass (the flag raised by the caller, who
    looked once more after raising it); the eventfd is emptied for the next wait."""
    event = np.int32(wake[W_EVENT])
    nanoseconds = max(np.int64(seconds * 1e9), np.int64(1000))
    timeout = np.array([nanoseconds // 1000000000, nanoseconds % 1000000000], np.int64)  # struct timespec
    poll = np.array([np.int64(event) | (np.int64(POLLIN) << 32)], np.int64)  # struct pollfd {fd, events, revents}
    _ppoll(poll.ctypes.data, np.uint64(1), timeout.ctypes.data, np.uint64(0))
    counter = np.zeros(1, np.uint64)
    _read(event, counter.ctypes.data, 8)  # (non-blocking: nothing to read is no error)
