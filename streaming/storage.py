"""Storage emulation: make expert reads take as long as they would on a given device.

A StorageModel is a bandwidth and a latency. It is applied on top of the real read: after the
bytes arrived from the real disk, the reader sleeps for whatever remains of the modelled time,
so a read is never faster than the model says and a slow real disk only makes it slower.

Concurrent reads share the device. An EmulatedDevice keeps a "busy until" clock: a read issued
at time t of n bytes completes at

    max(t + latency, busy_until) + n / bandwidth        and then busy_until = that time

so latencies of queued reads overlap (a device with a command queue) but their transfers are
serialised: four parallel prefetches get the device's bandwidth once, not four times.
"""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

from edge.core.arguments import parse_size, shown
from edge.core.errors import InvalidArgumentError


@dataclass(frozen=True)
class StorageModel:
    name: str
    bandwidth_bytes_per_s: float
    latency_s: float

    def read_seconds(self, n_bytes: int) -> float:
        """The time one read of n_bytes takes on an idle device."""
        return self.latency_s + n_bytes / self.bandwidth_bytes_per_s

    def describe(self) -> str:
        return f"{self.name} ({self.bandwidth_bytes_per_s / 1e6:g} MB/s, {self.latency_s * 1e6:g} us)"


PRESETS: dict[str, StorageModel] = {
    "nvme": StorageModel("nvme", 3.0e9, 80e-6),
    "ufs": StorageModel("ufs", 1.5e9, 150e-6),
    "emmc": StorageModel("emmc", 250e6, 300e-6),
    "sd": StorageModel("sd", 80e6, 1e-3),
}
NATIVE = "native"  # no emulation: the real device only

_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
# The slowest device an emulation models: beyond these a tiny model's reads would take hours, and
# time.sleep cannot take what a lying latency or a vanishing bandwidth would ask for.
MIN_BANDWIDTH = 1e6  # bytes per second
MAX_LATENCY = 1.0  # seconds
_USAGE = ("use one of native, " + ", ".join(PRESETS) +
          ", or custom:bw=SIZE,lat=TIME such as custom:bw=500MB,lat=200us (bandwidth per second)")


def _bandwidth(text: str, spec: str) -> float:
    value = parse_size(text.removesuffix("/s"))
    if value is None:
        raise InvalidArgumentError(f"storage {shown(spec)}: bandwidth {shown(text)} not understood; {_USAGE}")
    if value <= 0:
        raise InvalidArgumentError(f"storage {shown(spec)}: bandwidth must be positive; {_USAGE}")
    if value < MIN_BANDWIDTH:
        raise InvalidArgumentError(f"storage {shown(spec)}: bandwidth {shown(text)} is below the slowest an emulated "
                                   f"device may be, {MIN_BANDWIDTH / 1e6:g}MB per second; {_USAGE}")
    if value == float("inf"):
        raise InvalidArgumentError(f"storage {shown(spec)}: bandwidth {shown(text)} is not a finite size; {_USAGE}")
    return value


def _latency(text: str, spec: str) -> float:
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-zµ]*)", text.strip().lower())
    if not match or match.group(2) not in _TIME_UNITS:
        raise InvalidArgumentError(f"storage {shown(spec)}: latency {shown(text)} not understood; {_USAGE}")
    latency = float(match.group(1)) * _TIME_UNITS[match.group(2)]
    if latency > MAX_LATENCY:
        raise InvalidArgumentError(f"storage {shown(spec)}: latency {shown(text)} is longer than an emulated device "
                                   f"may take to start a read, {MAX_LATENCY:g}s; {_USAGE}")
    return latency


def parse_storage(value: "str | StorageModel | None") -> StorageModel | None:
    """A preset name, "custom:bw=500MB,lat=200us", a StorageModel, or None/"native" (no emulation)."""
    if value is None or isinstance(value, StorageModel):
        return value
    spec = str(value).strip()
    name = spec.lower()
    if name == NATIVE:
        return None
    if name in PRESETS:
        return PRESETS[name]
    if name.startswith("custom:"):
        fields = {}
        for part in spec[len("custom:"):].split(","):
            key, _, text = part.partition("=")
            fields[key.strip().lower()] = text
        if set(fields) != {"bw", "lat"}:
            raise InvalidArgumentError(f"storage {shown(spec)}: expected the fields bw and lat, found "
                                       f"{sorted(fields)}; {_USAGE}")
        bandwidth = _bandwidth(fields["bw"], spec)
        latency = _latency(fields["lat"], spec)
        return StorageModel(spec, bandwidth, latency)
    raise InvalidArgumentError(f"storage {shown(spec)} is not known; {_USAGE}")


class EmulatedDevice:
    """The shared "busy until" clock of one emulated device; `clock` and `sleep` are injectable
    so tests can check the timing with a fake clock."""

    def __init__(self, model: StorageModel, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.model = model
        self.clock = clock
        self.sleep = sleep
        self._busy_until = 0.0
        self._lock = threading.Lock()

    def schedule(self, n_bytes: int, issued_at: float) -> float:
        """Book a read of n_bytes issued at `issued_at`; returns when the emulated device finishes it."""
        return self.schedule_batch([n_bytes], issued_at)

    def schedule_batch(self, sizes: list[int], issued_at: float) -> float:
        """Book reads of these sizes issued together (a queue of commands); returns when the last finishes."""
        with self._lock:
            done = self._busy_until
            for n_bytes in sizes:
                done = max(issued_at + self.model.latency_s, done) + n_bytes / self.model.bandwidth_bytes_per_s
            self._busy_until = done
            return done

    def wait_until(self, done: float) -> float:
        """Sleep (releasing the GIL) until `done` on the clock; returns the seconds slept."""
        remaining = done - self.clock()
        if remaining > 0:
            self.sleep(remaining)
            return remaining
        return 0.0
