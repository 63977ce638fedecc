"""Virtual environments for execution providers that cannot share one Python environment.

onnxruntime-openvino replaces the onnxruntime package, and onnxruntime-qnn is a plugin pinned to
an onnxruntime of its own range, so they do not install side by side. Each one gets a virtualenv
under $XDG_CACHE_HOME/zllm-edge/venvs (default ~/.cache/zllm-edge/venvs), created once with
--system-site-packages (numpy, onnx and this project come from the main environment; only the
provider's wheel is installed) and reused by later runs. `zllm-edge bench --device npu:openvino`
and the provider tests run their ONNX Runtime code with that environment's python.

A provider whose wheel cannot be installed here (pip fails, no network) raises
ProviderEnvUnavailable with pip's error; nothing runs on another provider in its place.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from devices.base import DeviceUnavailableError

# The wheels, pinned: the versions this project's provider tests pass with.
PROVIDER_REQUIREMENTS = {"openvino": "onnxruntime-openvino==1.24.1", "qnn": "onnxruntime-qnn==2.7.0"}
PIP_TIMEOUT_SECONDS = 900


class ProviderEnvUnavailable(DeviceUnavailableError):
    """A provider's virtualenv cannot be built here; the message carries pip's reason."""


def venvs_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zllm-edge" / "venvs"


def provider_env_folder(provider: str) -> Path:
    requirement = PROVIDER_REQUIREMENTS[provider]
    return venvs_dir() / f"{provider}-{requirement.replace('==', '-')}"


def _python_in(folder: Path) -> Path:
    return folder / ("Scripts" if os.name == "nt" else "bin") / ("python.exe" if os.name == "nt" else "python")


def provider_env_python(provider: str, progress=None) -> Path:
    """The python of the provider's virtualenv, building it first when it is missing or incomplete.

    A `.installed` file holding the requirement marks a finished environment; one without it (an
    interrupted build) is cleared and built again."""
    if provider not in PROVIDER_REQUIREMENTS:
        raise ValueError(f"no separate environment is known for NPU provider {provider!r}; "
                         f"known: {', '.join(PROVIDER_REQUIREMENTS)}")
    requirement = PROVIDER_REQUIREMENTS[provider]
    folder = provider_env_folder(provider)
    python, done = _python_in(folder), folder / ".installed"
    if done.exists() and done.read_text() == requirement and python.exists():
        return python
    if progress:
        progress(f"building the {provider} environment {folder} (pip install {requirement})")
    created = subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--clear", str(folder)],
                             capture_output=True, text=True)
    if created.returncode:
        raise ProviderEnvUnavailable(f"cannot create a virtualenv at {folder} for {requirement}: "
                                     f"{created.stderr.strip()[-400:]}")
    try:
        installed = subprocess.run([str(python), "-m", "pip", "install", "-q", requirement],
                                   capture_output=True, text=True, timeout=PIP_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        raise ProviderEnvUnavailable(f"pip install {requirement} into {folder} did not finish within "
                                     f"{PIP_TIMEOUT_SECONDS} s") from None
    if installed.returncode:
        raise ProviderEnvUnavailable(f"cannot install {requirement} into {folder}: "
                                     f"{installed.stderr.strip()[-400:]}")
    done.write_text(requirement)
    return python


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
