"""The devices zllm-edge has, how one is created from its name, and the errors a device raises when
it cannot run here. The contract every backend implements is edge/core/contract.py."""
from __future__ import annotations

import importlib

from edge.core.contract import Backend


class DeviceUnavailableError(RuntimeError):
    """A backend cannot run on this machine (driver, runtime or hardware missing); the message
    says what is missing and how to get it. edge/ reports it as a typed error, never falls back."""


class AttentionUnsupportedError(DeviceUnavailableError):
    """The device has no kernels for the model's attention kind (e.g. MLA)."""

    def __init__(self, device: str, kind: str):
        super().__init__(f"device {device!r} does not implement {kind.upper()} attention (it runs MHA/GQA/MQA "
                         f"with float32 K/V caches); use device 'cpu' or 'reference'")


def check_llama_layers(model, device: str) -> None:
    """Refuse models that an executor of Llama-form layers with GQA attention would compute wrongly."""
    spec = model.spec
    if spec.attention_kind != "gqa":
        raise AttentionUnsupportedError(device, spec.attention_kind)
    if not spec.llama_layers:
        raise DeviceUnavailableError(
            f"device {device!r} does not implement {spec.model_type}'s decoder layer (scaled embeddings, (1 + w) "
            "and sandwich norms, a GELU-gated feed-forward, per-layer rotary bases); use device 'cpu' or 'reference'")


def has_moe_layers(model) -> bool:
    return model.moe is not None


# device kind -> "module:BackendClass". A device that is missing here, or whose backend cannot
# start on this machine, is an error: there is never a fallback to another device.
BACKENDS: dict[str, str] = {
    "reference": "devices.reference:ReferenceBackend",
    "cpu": "devices.cpu:CpuBackend",
    "gpu": "devices.gpu:GpuBackend",
    "npu": "devices.npu:NpuBackend",
}
THREADED_DEVICES = ("cpu", "npu")  # the others schedule their own work and refuse a thread count


def split_device_list(text: str) -> list[str]:
    """A comma-separated list of devices (`--device` / `--devices`) into device strings: a key=value
    setting belongs to the device before it (cpu,npu:qnn,allow_cpu_nodes=1 -> cpu, npu:qnn,allow_cpu_nodes=1)."""
    devices: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if devices and "=" in piece and ":" not in piece.partition("=")[0]:
            devices[-1] += "," + piece
        else:
            devices.append(piece)
    return devices


def device_name_problem(device) -> str | None:
    """What is wrong with a device name ("reference", "cpu", "npu:openvino"), or None: a kind that
    is not registered, or a ":" with no variant after it."""
    if not isinstance(device, str) or device.partition(":")[0] not in BACKENDS:
        return f"device {device!r} is not available; available devices: {', '.join(BACKENDS)}"
    kind, colon, variant = device.partition(":")
    if colon and not variant.strip():
        return f"device {device!r} names no variant after ':'; write {kind!r}, or {kind!r} followed by ':' and a variant"
    return None


def fastest_device() -> tuple[str, str | None]:
    """The device to run when none is named: "cpu" where its kernels run on this machine, else
    "reference", with why "cpu" cannot run (for the caller to say: the choice is never silent)."""
    try:
        from kernels.cpu import isa  # imports Numba: DeviceUnavailableError without it (devices/cpu)
        from devices.cpu.backend import CpuBackend  # noqa: F401
    except DeviceUnavailableError as exc:
        return "reference", str(exc)
    except ImportError as exc:
        return "reference", f"device 'cpu' needs numba and llvmlite ({exc}); pip install numba"
    isa.check_configuration()  # a bad ZLLM_EDGE_ISA is the user's to mend, not a reason to run elsewhere
    return "cpu", None


def create_backend(device: str, threads: int | None = None) -> Backend:
    """The backend for a device name such as "reference", "cpu" or "npu:openvino"."""
    problem = device_name_problem(device)
    if problem:
        raise ValueError(problem)
    kind, _, variant = device.partition(":")
    module_name, class_name = BACKENDS[kind].split(":")
    backend_class = getattr(importlib.import_module(module_name), class_name)
    return backend_class(threads=threads, variant=variant or None)
