"""The GPU-side expert cache: routed experts uploaded into device buffers, bounded in bytes.

E = routed experts of a layer. An ExpertSource (streaming/) brings experts from SSD into host
memory, with its own cache, predictor and prefetcher; on the gpu device it hands the MoE block
the experts' stored bytes as host views (HostExpertWeights below), and this cache keeps the
uploaded copies keyed by (layer, expert id):

- a hit reuses the expert's device buffers (and the launches bound to them);
- a miss uploads the stored bytes (INT4/INT8 codes and f16 scales as stored, or f16/f32 floats)
  from the host mapping into new device buffers;
- to make room it evicts the least recently used experts, never one the current layer uses:
  every expert of a layer's route is recorded into one command buffer, so they must all be
  resident together. A capacity below one layer's E experts is refused when the model loads.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Mapping

import psutil

from devices.gpu.tensors import GpuMatrix, matrix_device_bytes

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# Without gpu_expert_cache, every expert is uploaded once if they take at most this share of the
# adapter's memory. wgpu does not report a GPU's memory size: for a discrete or integrated GPU the
# rule assumes ASSUMED_GPU_MEMORY (a small one); a CPU adapter (lavapipe) uses the host's RAM.
DEFAULT_MEMORY_SHARE = 0.5
ASSUMED_GPU_MEMORY = 4 * 1024**3


class ExpertCacheTooSmallError(ValueError):
    """A GPU expert cache that cannot hold one layer's experts at once."""

    def __init__(self, capacity_bytes: int, minimum_bytes: int, layer: int, num_experts: int):
        self.capacity_bytes, self.minimum_bytes = capacity_bytes, minimum_bytes
        super().__init__(
            f"a GPU expert cache of {capacity_bytes} bytes cannot hold one layer's experts: layer {layer} has "
            f"{num_experts} experts of {minimum_bytes // num_experts} bytes each on the device, so the minimum is "
            f"{minimum_bytes} bytes ({minimum_bytes / 1e6:.2f} MB); pass gpu_expert_cache of at least that")


class HostExpertWeights:
    """How an ExpertSource prepares expert weights for the gpu device: not at all. The stored views
    (QuantizedTensor or float arrays over the source's host buffers) go to the MoE block as they
    are, and the GPU expert cache uploads the ones it does not hold."""

    name = "gpu-host"

    @staticmethod
    def prepare_weight(weight):
        return weight

    load_weight = prepare_weight


@dataclass
class GpuExpert:
    """One routed expert's weights in device buffers."""

    key: tuple[int, int]  # (layer, expert)
    gate: GpuMatrix       # [I, D]
    up: GpuMatrix         # [I, D]
    down: GpuMatrix       # [D, I]
    nbytes: int
    bound: dict = field(default_factory=dict)  # launches bound to these buffers, by the executor's key

    def release(self) -> None:
        self.bound.clear()
        for matrix in (self.gate, self.up, self.down):
            matrix.release()


def expert_device_bytes(ctx, projections: Mapping[str, tuple]) -> int:
    """Device bytes of one expert whose projections are {name: (quant.Scheme, shape [N, K])}."""
    return sum(matrix_device_bytes(ctx, scheme, shape) for scheme, shape in projections.values())


class GpuExpertCache:
    """Uploaded experts keyed by (layer, expert id), at most `capacity_bytes` of device buffers."""

    def __init__(self, ctx, layers: Mapping[int, tuple[int, Mapping[str, tuple]]], capacity: int | float | None):
        """layers: {MoE layer: (E, {projection: (quant.Scheme, shape)})}. capacity: bytes, a share of
        every expert's bytes (a float in (0, 1]), or None for the default rule (DEFAULT_MEMORY_SHARE)."""
        self.ctx = ctx
        self.expert_bytes = {layer: expert_device_bytes(ctx, projections)
                             for layer, (_, projections) in layers.items()}
        self.all_bytes = sum(count * self.expert_bytes[layer] for layer, (count, _) in layers.items())
        widest = max(layers, key=lambda layer: layers[layer][0] * self.expert_bytes[layer])
        self.minimum_bytes = layers[widest][0] * self.expert_bytes[widest]
        if capacity is None:
            limit = int(DEFAULT_MEMORY_SHARE * self.adapter_memory_bytes())
            self.capacity_bytes = max(self.minimum_bytes, min(self.all_bytes, limit))
            self.capacity_rule = (f"every expert if they take at most {DEFAULT_MEMORY_SHARE:.0%} of the adapter's "
                                  f"{self.adapter_memory_bytes()} bytes, else that share")
        else:
            self.capacity_bytes = (math.ceil(capacity * self.all_bytes) if isinstance(capacity, float)
                                   else int(capacity))
            self.capacity_rule = "gpu_expert_cache"
        if self.capacity_bytes < self.minimum_bytes:
            raise ExpertCacheTooSmallError(self.capacity_bytes, self.minimum_bytes, widest, layers[widest][0])
        self._entries: OrderedDict[tuple[int, int], GpuExpert] = OrderedDict()  # least recently used first
        self.held_bytes = 0
        self.hits = self.misses = self.evictions = 0
        self.bytes_uploaded = 0
        self.upload_seconds = 0.0

    def adapter_memory_bytes(self) -> int:
        return psutil.virtual_memory().total if self.ctx.is_cpu else ASSUMED_GPU_MEMORY

    def fetch(self, layer: int, ids: list[int], experts: Mapping) -> list[GpuExpert]:
        """The device copies of `layer`'s experts `ids` (ascending), uploading those not held.

        `experts` is the ExpertSource's mapping for this layer: host views of each expert's stored
        weights. It is read in ascending id order, each expert right before its upload (which copies
        the bytes), so a source with a `window_size` smaller than the route stays valid."""
        in_use = {(layer, expert) for expert in ids}
        fetched = []
        for expert in ids:
            key = (layer, expert)
            entry = self._entries.get(key)
            if entry is not None:
                self.hits += 1
                self._entries.move_to_end(key)
            else:
                self.misses += 1
                entry = self._upload(key, experts[expert], in_use)
            fetched.append(entry)
        return fetched

    def _upload(self, key: tuple[int, int], host, in_use: set) -> GpuExpert:
        nbytes = self.expert_bytes[key[0]]
        # the capacity holds every expert of any one layer (checked at load), so evicting experts the
        # current layer does not use always makes room
        for victim in [k for k in self._entries if k not in in_use]:
            if self.held_bytes + nbytes <= self.capacity_bytes:
                break
            self._evict(victim)
        began = time.perf_counter()
        gate, up, down = (GpuMatrix(self.ctx, weight) for weight in (host.gate, host.up, host.down))
        self.upload_seconds += time.perf_counter() - began
        entry = GpuExpert(key, gate, up, down, gate.nbytes + up.nbytes + down.nbytes)
        self._entries[key] = entry
        self.held_bytes += entry.nbytes
        self.bytes_uploaded += entry.nbytes
        return entry

    def _evict(self, key: tuple[int, int]) -> None:
        self._drop(key)
        self.evictions += 1

    def _drop(self, key: tuple[int, int]) -> None:
        entry = self._entries.pop(key)
        self.held_bytes -= entry.nbytes
        entry.release()

    def forget_bound(self) -> None:
        """Drop the launches bound to cached experts: a new executor binds its own scratch buffers."""
        for entry in self._entries.values():
            entry.bound.clear()

    def stats(self) -> dict:
        requests = self.hits + self.misses
        return {"gpu_expert_hits": self.hits, "gpu_expert_misses": self.misses,
                "gpu_expert_hit_rate": self.hits / requests if requests else 0.0,
                "gpu_expert_evictions": self.evictions, "gpu_expert_bytes_uploaded": self.bytes_uploaded,
                "gpu_expert_bytes_held": self.held_bytes, "gpu_expert_cache_bytes": self.capacity_bytes,
                "gpu_expert_cache_minimum_bytes": self.minimum_bytes, "gpu_expert_bytes_all": self.all_bytes,
                "gpu_expert_upload_seconds": round(self.upload_seconds, 4)}

    def close(self) -> None:
        for key in list(self._entries):
            self._drop(key)
