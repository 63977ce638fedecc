"""Opening the gpu device in tests, and the error bounds its results are held to.

The gpu tests run everywhere: without a GPU, Mesa's lavapipe is a real Vulkan device
(`apt-get install mesa-vulkan-drivers libvulkan1`, which .ci/run does). They skip, with the
reason shown, only where no Vulkan driver can be found at all.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from devices.base import DeviceUnavailableError

UNIT_ROUNDOFF = 2.0**-24  # f32: |fl(a op b) - (a op b)| <= u |a op b|


VULKAN_ICD_FOLDERS = ("/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d", "/usr/local/share/vulkan/icd.d")


def vulkan_driver_installed() -> bool:
    """A Vulkan driver registered with the loader (an ICD manifest), e.g. lavapipe's lvp_icd.*.json."""
    return any(Path(folder).is_dir() and any(Path(folder).glob("*.json")) for folder in VULKAN_ICD_FOLDERS)


def open_gpu(**kwargs):
    """A GpuBackend; skipped where no Vulkan driver is installed, a failure where one is but does not work."""
    pytest.importorskip("wgpu", reason="the gpu device needs the Python package wgpu (pip install wgpu)")
    from devices.gpu import GpuBackend

    try:
        return GpuBackend(**kwargs)
    except DeviceUnavailableError as error:
        if vulkan_driver_installed():
            pytest.fail(f"a Vulkan driver is installed but the gpu device cannot open it: {error}")
        pytest.skip(f"no Vulkan driver on this machine: {error}")


def dot_error_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Bound on |ours - reference| for y = x @ w.T computed in f32 in two different orders.

    Each side's summation error is at most gamma_K * sum_k |x_k w_k| with gamma_K ~ K u, whatever
    the order; the weights themselves may differ by one rounding (s * q + o fused or not), adding
    u * sum_k |x_k w_k|. Elementwise: (2K + 2) u * (|x| @ |w|.T).
    """
    k = x.shape[-1]
    return (2 * k + 2) * UNIT_ROUNDOFF * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T)


def assert_within(ours: np.ndarray, reference: np.ndarray, bound, what: str) -> None:
    assert ours.shape == reference.shape, f"{what}: shape {ours.shape} != {reference.shape}"
    assert ours.dtype == np.float32, f"{what}: dtype {ours.dtype}"
    assert np.isfinite(ours).all(), f"{what}: non-finite values"
    error = np.abs(ours.astype(np.float64) - reference)
    excess = error - bound
    worst = np.unravel_index(np.argmax(excess), excess.shape) if excess.size else ()
    assert (excess <= 0).all(), (
        f"{what}: error {error[worst]:.3e} above its bound {np.broadcast_to(bound, error.shape)[worst]:.3e} at {worst}"
    )
