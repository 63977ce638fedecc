"""The Vulkan device: adapter selection, device creation with the adapter's real limits, buffers.

wgpu picks whatever backend it finds (Vulkan, Metal, D3D12, OpenGL) and would run on OpenGL
without a word; this backend is Vulkan by contract, so adapters are filtered by backend and
the absence of a Vulkan adapter is an error that says how to get one.
"""
from __future__ import annotations

import weakref

import numpy as np

from devices.base import DeviceUnavailableError

VULKAN_INSTALL_HINT = (
    "install a Vulkan driver and loader: on Debian/Ubuntu `apt-get install mesa-vulkan-drivers libvulkan1` "
    "(Mesa's lavapipe runs Vulkan on the CPU when there is no GPU; with a GPU, its vendor's Vulkan driver)"
)

# Discrete GPUs first, lavapipe (a CPU device) last.
_ADAPTER_PREFERENCE = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "CPU": 3}


def import_wgpu():
    try:
        import wgpu
    except ImportError as error:
        raise DeviceUnavailableError(
            f"device 'gpu' needs the Python package wgpu ({error}); install it with `pip install wgpu`"
        ) from None
    return wgpu


def _restrict_instance_to_vulkan(wgpu) -> None:
    """Ask wgpu-native for a Vulkan-only instance, so that enumeration does not also start OpenGL.

    The adapter filter below is what guarantees Vulkan; this only avoids initialising other
    backends (and their log noise). It can be done once per process, before anything else has
    created wgpu's instance; afterwards the filter alone does the job.
    """
    try:
        from wgpu.backends.wgpu_native.extras import set_instance_extras

        set_instance_extras(backends=["Vulkan"])
    except (ImportError, RuntimeError):  # an instance already exists: keep it
        pass


def vulkan_adapters(wgpu) -> list:
    """Every adapter that wgpu reaches through Vulkan, in enumeration order."""
    _restrict_instance_to_vulkan(wgpu)
    adapters = wgpu.gpu.enumerate_adapters_sync()
    return [adapter for adapter in adapters if adapter.info.get("backend_type") == "Vulkan"]


def select_vulkan_adapter(variant: str | None):
    """The adapter for device "gpu" (the best Vulkan adapter) or "gpu:N" (the N-th one)."""
    wgpu = import_wgpu()
    adapters = vulkan_adapters(wgpu)
    if not adapters:
        others = sorted({a.info.get("backend_type", "?") for a in wgpu.gpu.enumerate_adapters_sync()})
        found = f"wgpu found adapters only for {', '.join(others)}" if others else "wgpu found none"
        raise DeviceUnavailableError(f"device 'gpu' needs a Vulkan adapter and {found}; {VULKAN_INSTALL_HINT}")
    if variant is None:
        return min(adapters, key=lambda a: _ADAPTER_PREFERENCE.get(a.info.get("adapter_type"), 4))
    if not variant.isdigit():
        raise ValueError(f"device 'gpu:{variant}' not understood: use 'gpu' or 'gpu:N' with N a Vulkan adapter index")
    index = int(variant)
    if index >= len(adapters):
        names = "; ".join(f"{i}: {a.info.get('device')}" for i, a in enumerate(adapters))
        raise DeviceUnavailableError(f"device 'gpu:{index}': there are {len(adapters)} Vulkan adapters ({names})")
    return adapters[index]


class GpuContext:
    """One wgpu device on a Vulkan adapter, its queue, and the buffers allocated on it."""

    def __init__(self, adapter):
        self.wgpu = import_wgpu()
        self.adapter = adapter
        self.adapter_info = dict(adapter.info)
        # wgpu's default limits are WebGPU's portable minimum (128 MiB bindings, 8 storage
        # buffers per stage, 16 KiB workgroup memory); ask for what the adapter really offers.
        limits = {key: value for key, value in adapter.limits.items() if value}
        self.device = adapter.request_device_sync(required_limits=limits)
        self.queue = self.device.queue
        self.limits = dict(self.device.limits)
        self.max_binding_bytes = int(self.limits["max-storage-buffer-binding-size"])
        self.max_workgroups = int(self.limits["max-compute-workgroups-per-dimension"])
        self.max_uniform_bytes = int(self.limits["max-uniform-buffer-binding-size"])
        self.uniform_alignment = int(self.limits["min-uniform-buffer-offset-alignment"])
        self.is_cpu = self.adapter_info.get("adapter_type") == "CPU"
        self.allocated_bytes = 0
        self.peak_allocated_bytes = 0

    # --- buffers ---------------------------------------------------------------------------
    def _track(self, buffer):
        """Count buffer's bytes as allocated until the buffer object is gone."""
        self.allocated_bytes += buffer.size
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        weakref.finalize(buffer, self._untrack, buffer.size)
        return buffer

    def _untrack(self, nbytes: int) -> None:
        self.allocated_bytes -= nbytes

    def storage(self, nbytes: int, label: str = "", copy_src: bool = False, input_window: int = 0):
        """A storage buffer of at least nbytes (rounded up to 16, never empty).

        input_window > 0: the buffer is also read through uniform windows of that many bytes at any
        offset up to nbytes (kernels/wgsl/linear_rows.wgsl), so it gets UNIFORM usage and that tail."""
        usage = self.wgpu.BufferUsage.STORAGE | self.wgpu.BufferUsage.COPY_DST
        if copy_src:
            usage |= self.wgpu.BufferUsage.COPY_SRC
        if input_window:
            usage |= self.wgpu.BufferUsage.UNIFORM
        size = max(16, (int(nbytes) + input_window + 15) // 16 * 16)
        return self._track(self.device.create_buffer(label=label, size=size, usage=usage))

    def upload(self, array: np.ndarray, label: str = "", copy_src: bool = False, input_window: int = 0):
        """A storage buffer holding array's bytes (any dtype; read-only mmap views are fine)."""
        data = np.ascontiguousarray(array)
        buffer = self.storage(data.nbytes, label, copy_src, input_window)
        if data.nbytes:
            self.write(buffer, data)
        return buffer

    def write(self, buffer, array: np.ndarray, offset_bytes: int = 0) -> None:
        data = np.ascontiguousarray(array)
        if data.nbytes % 4:  # wgpu copies whole words
            data = np.frombuffer(data.tobytes() + bytes(4 - data.nbytes % 4), np.uint8)
        self.queue.write_buffer(buffer, offset_bytes, data)

    def uniform(self, words: np.ndarray, label: str = ""):
        usage = self.wgpu.BufferUsage.UNIFORM | self.wgpu.BufferUsage.COPY_DST
        size = max(16, (words.nbytes + 15) // 16 * 16)
        buffer = self._track(self.device.create_buffer(label=label, size=size, usage=usage))
        self.queue.write_buffer(buffer, 0, np.ascontiguousarray(words))
        return buffer

    def readback_buffer(self, nbytes: int, label: str = "readback"):
        usage = self.wgpu.BufferUsage.MAP_READ | self.wgpu.BufferUsage.COPY_DST
        size = max(16, (int(nbytes) + 15) // 16 * 16)
        return self._track(self.device.create_buffer(label=label, size=size, usage=usage))

    @staticmethod
    def release(buffer) -> None:
        """Free the buffer's memory now rather than when Python collects it."""
        buffer.destroy()

    # --- submission ------------------------------------------------------------------------
    def read(self, staging, nbytes: int, dtype=np.float32) -> np.ndarray:
        """Wait for the queue's work (mapping waits for every submission that writes `staging`),
        then copy nbytes out of the mapped staging buffer."""
        size = (nbytes + 3) // 4 * 4
        staging.map_sync(self.wgpu.MapMode.READ, 0, size)
        try:
            data = np.frombuffer(staging.read_mapped(0, size, copy=False), dtype=np.uint8)[:nbytes].copy()
        finally:
            staging.unmap()
        return data.view(dtype)

    def download(self, buffer, nbytes: int, dtype=np.float32, offset_bytes: int = 0) -> np.ndarray:
        """The bytes of a storage buffer (COPY_SRC) after all submitted work: one copy, one wait."""
        staging = self.readback_buffer(nbytes)
        encoder = self.device.create_command_encoder()
        encoder.copy_buffer_to_buffer(buffer, offset_bytes, staging, 0, (nbytes + 3) // 4 * 4)
        self.queue.submit([encoder.finish()])
        try:
            return self.read(staging, nbytes, dtype)
        finally:
            self.release(staging)

    def info(self) -> dict:
        info = self.adapter_info
        return {
            "adapter": info.get("device"),
            "driver": info.get("description"),
            "vendor": info.get("vendor"),
            "adapter_type": info.get("adapter_type"),
            "backend": info.get("backend_type"),
            "wgpu": self.wgpu.__version__,
            "max_storage_buffer_binding_bytes": self.max_binding_bytes,
            "allocated_bytes": self.allocated_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
        }
