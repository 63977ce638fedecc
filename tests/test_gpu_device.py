"""The gpu device is Vulkan or nothing: adapter selection, device info, and clear errors."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_support import open_gpu

import edge
from converters.convert import QuantPlan
from devices.base import DeviceUnavailableError, create_backend
from edge.core.errors import ZllmError

REPO = Path(__file__).resolve().parent.parent
NO_VULKAN = (
    "device 'gpu' needs a Vulkan adapter and wgpu found adapters only for OpenGL; install a Vulkan driver and "
    "loader: on Debian/Ubuntu `apt-get install mesa-vulkan-drivers libvulkan1` (Mesa's lavapipe runs Vulkan on the "
    "CPU when there is no GPU; with a GPU, its vendor's Vulkan driver)"
)


@pytest.fixture(scope="module")
def gpu():
    return open_gpu()


def test_the_adapter_is_vulkan_and_info_names_it(gpu):
    info = gpu.info()
    assert info["device"] == "gpu"
    assert info["backend"] == "Vulkan"
    assert info["adapter"] and info["driver"]  # e.g. "llvmpipe (LLVM 15.0.6, 256 bits)", "Mesa 22.3.6 ..."
    # the device was opened with the adapter's own limits, not WebGPU's portable defaults
    assert info["max_storage_buffer_binding_bytes"] == gpu.ctx.adapter.limits["max-storage-buffer-binding-size"]
    assert gpu.ctx.limits["max-storage-buffers-per-shader-stage"] >= 8


def test_create_backend_gpu_by_name(gpu):
    backend = create_backend("gpu:0")
    assert backend.info()["backend"] == "Vulkan"


class FakeAdapter:
    def __init__(self, backend_type: str):
        self.info = {"backend_type": backend_type, "device": "llvmpipe", "adapter_type": "CPU"}


def without_vulkan(monkeypatch):
    """wgpu enumerates only an OpenGL adapter, as on a machine with Mesa's GL but no Vulkan driver."""
    import wgpu

    monkeypatch.setattr(wgpu.gpu, "enumerate_adapters_sync", lambda: [FakeAdapter("OpenGL")])


def test_no_vulkan_adapter_is_a_clear_error_not_an_opengl_fallback(monkeypatch):
    pytest.importorskip("wgpu")
    from devices.gpu import GpuBackend

    without_vulkan(monkeypatch)
    with pytest.raises(DeviceUnavailableError) as error:
        GpuBackend()
    assert str(error.value) == NO_VULKAN


def test_edge_load_reports_missing_vulkan_as_a_typed_error(monkeypatch, tiny_zoo):
    pytest.importorskip("wgpu")
    path = tiny_zoo.converted("llama_gqa_tied", QuantPlan(weights="f32"))
    without_vulkan(monkeypatch)
    with pytest.raises(ZllmError) as error:
        edge.load(path, device="gpu")
    assert str(error.value) == NO_VULKAN


def test_a_machine_whose_vulkan_loader_finds_no_driver(tmp_path):
    # Not simulated: the Vulkan loader itself is pointed at a driver manifest that does not exist.
    pytest.importorskip("wgpu")
    code = ("from devices.gpu import GpuBackend\n"
            "from devices.base import DeviceUnavailableError\n"
            "try:\n    GpuBackend()\nexcept DeviceUnavailableError as error:\n    print(error)\n")
    missing = str(tmp_path / "no_such_icd.json")
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "VK_ICD_FILENAMES": missing, "VK_DRIVER_FILES": missing, "PYTHONPATH": python_path}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == NO_VULKAN.replace("wgpu found adapters only for OpenGL", "wgpu found none")


def test_bad_variants_and_threads_are_refused(gpu):
    from devices.gpu import GpuBackend

    with pytest.raises(ValueError, match=r"^device 'gpu:fast' not understood: use 'gpu' or 'gpu:N'"):
        GpuBackend(variant="fast")
    with pytest.raises(DeviceUnavailableError, match=r"^device 'gpu:99': there are \d+ Vulkan adapters \(0: "):
        GpuBackend(variant="99")
    with pytest.raises(ValueError, match=r"^device 'gpu' schedules its own work; --threads/threads= applies to the cpu"):
        GpuBackend(threads=2)
