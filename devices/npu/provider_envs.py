"""Virtual environments for execution providers that cannot share one Python environment.

onnxruntime-openvino replaces the onnxruntime package, and onnxruntime-qnn is a plugin pinned to
an onnxruntime of its own range, so they do not install side by side. Each one gets a helper
virtualenv with only the provider's wheel installed, created once and reused by later runs; numpy,
onnx and this project come from the interpreter that creates it, and its own onnxruntime comes first
(devices/helper_envs.py says how, where it lives and when it is rebuilt). `zllm-edge bench --device
npu:openvino` and the provider tests run their ONNX Runtime code with that environment's python.

A provider whose wheel cannot be installed here (pip fails, no network) raises
ProviderEnvUnavailable with pip's error; nothing runs on another provider in its place. A folder of
helper environments that cannot be written (read-only, full) raises ProviderEnvNotWritable, which is
also the ZllmError that names the folder and the variable that moves it.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from devices.base import DeviceUnavailableError
from devices.helper_envs import HelperEnv, HelperEnvNotWritable, HelperEnvUnavailable, ensure_env, env_folder
from edge.core.files import NotWritableError

# The wheels, pinned: the versions this project's provider tests pass with.
PROVIDER_REQUIREMENTS = {"openvino": "onnxruntime-openvino==1.24.1", "qnn": "onnxruntime-qnn==2.7.0"}


class ProviderEnvUnavailable(DeviceUnavailableError):
    """A provider's virtualenv cannot be built here; the message carries pip's reason."""


class ProviderEnvNotWritable(ProviderEnvUnavailable, NotWritableError):
    """The folder of helper environments cannot be written; the message names it and the variable."""


def provider_env_spec(provider: str) -> HelperEnv:
    if provider not in PROVIDER_REQUIREMENTS:
        raise ValueError(f"no separate environment is known for NPU provider {provider!r}; "
                         f"known: {', '.join(PROVIDER_REQUIREMENTS)}")
    requirement = PROVIDER_REQUIREMENTS[provider]
    return HelperEnv(name=f"{provider}-{requirement.replace('==', '-')}", requirements=(requirement,))


def provider_env_folder(provider: str) -> Path:
    return env_folder(provider_env_spec(provider))


def provider_env_python(provider: str, progress=None) -> Path:
    """The python of the provider's virtualenv, building it first when it is missing, incomplete or
    was built from another interpreter."""
    spec = provider_env_spec(provider)
    try:
        return ensure_env(spec, progress)
    except HelperEnvNotWritable as exc:
        raise ProviderEnvNotWritable(str(exc)) from None
    except HelperEnvUnavailable as exc:
        raise ProviderEnvUnavailable(str(exc)) from exc


def env_sys_path(python: Path) -> list[str]:
    """The module search path of the interpreter `python`, as it starts (its site-packages first)."""
    result = subprocess.run([str(python), "-c", "import json, sys; print(json.dumps(sys.path))"],
                            capture_output=True, text=True)
    if result.returncode:
        raise ProviderEnvUnavailable(f"{python} does not start: {result.stderr.strip()[-400:]}")
    return json.loads(result.stdout)


def verify_provider(device: str, info: dict) -> None:
    """Raise unless the npu model described by device_info() `info` runs where `device` asked.

    `npu:<provider>` must report that provider, and every graph's nodes must be on it unless the
    device string allows CPU nodes explicitly (allow_cpu_nodes=1)."""
    from devices.npu.providers import BY_KEY

    kind, _, variant = device.partition(":")
    requested = variant.split(",")[0]
    if kind != "npu" or requested in ("", "auto") or requested not in BY_KEY:
        return
    wanted = BY_KEY[requested].ep_name
    if info.get("provider") != wanted:
        raise DeviceUnavailableError(f"device {device!r} asked for {wanted}, but the model runs on "
                                     f"{info.get('provider')}")
    if info.get("allow_cpu_nodes"):
        return
    strays = {graph: sorted(set(eps) - {wanted}) for graph, eps in (info.get("placement") or {}).items()
              if set(eps) - {wanted}}
    if strays:
        raise DeviceUnavailableError(f"device {device!r}: graph nodes placed outside {wanted}: {strays}")
