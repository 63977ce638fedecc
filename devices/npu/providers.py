"""ONNX Runtime execution providers: which exist here, which one runs, and where each node went.

Priority when `device="npu"` picks for itself (the first available wins):

    qnn (Qualcomm Hexagon HTP) > openvino (Intel NPU/GPU/CPU) > vitisai (AMD Ryzen AI)
    > coreml (Apple Neural Engine) > directml (Windows GPUs/NPUs) > cpu (ONNX Runtime's CPU provider)

A provider comes either built into the installed onnxruntime (onnxruntime-openvino,
onnxruntime-directml, ...) or as a plugin library shipped by a Python package (onnxruntime-qnn,
onnxruntime-ep-openvino), which is registered with onnxruntime here. Nothing falls back silently:
an explicitly requested provider that is missing is a DeviceUnavailableError, a provider that
cannot take every node of a graph fails the load unless CPU placement is allowed explicitly, and
the automatic choice of the CPU provider is logged and reported by device_info().
"""
from __future__ import annotations

import importlib
import logging
import platform
from collections import Counter
from dataclasses import dataclass

from devices.base import DeviceUnavailableError

log = logging.getLogger("zllm.npu")


@dataclass(frozen=True)
class Provider:
    key: str  # the name after "npu:" in a device string
    ep_name: str  # onnxruntime's name
    attention: str  # graph form it takes (devices/npu/onnx_export.py): "contrib" or "standard"
    static_shapes: bool  # compiles for fixed shapes (decode S=1, prefill chunks S=N)
    plugin_module: str | None  # Python package shipping it as a plugin EP library, if any
    how_to_get: str
    verified_here: bool  # exercised by this project's tests


PROVIDERS: tuple[Provider, ...] = (
    Provider("qnn", "QNNExecutionProvider", "standard", True, "onnxruntime_qnn",
             "pip install onnxruntime-qnn (a plugin for onnxruntime >= 1.24; HTP simulator on x86-64 Linux)", True),
    Provider("openvino", "OpenVINOExecutionProvider", "standard", False, "onnxruntime_ep_openvino",
             "pip install onnxruntime-openvino (replaces onnxruntime) or the plugin onnxruntime-ep-openvino", True),
    Provider("vitisai", "VitisAIExecutionProvider", "standard", True, None,
             "AMD Ryzen AI Software (its onnxruntime-vitisai build)", False),
    Provider("coreml", "CoreMLExecutionProvider", "standard", True, None,
             "onnxruntime on macOS (CoreML is built into the macOS wheels)", False),
    Provider("directml", "DmlExecutionProvider", "contrib", False, None,
             "pip install onnxruntime-directml (Windows)", False),
    Provider("cpu", "CPUExecutionProvider", "contrib", False, None, "part of every onnxruntime", True),
)
PRIORITY = tuple(p.key for p in PROVIDERS)
BY_KEY = {p.key: p for p in PROVIDERS}

# QNN's HTP library on an x86-64 host is Qualcomm's HTP simulator; it needs to be told which chip
# to simulate. Snapdragon X Elite: SoC model 60, HTP architecture v73.
QNN_SIMULATOR_DEFAULTS = {"soc_model": "60", "htp_arch": "73"}


def import_onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise DeviceUnavailableError(
            "device 'npu' runs graphs with ONNX Runtime, which is not installed; "
            "install it with `pip install 'zllm-edge[npu]'` (onnxruntime and onnx)"
        ) from None
    return onnxruntime


# onnxruntime keeps registered plugin libraries for the life of the process; mirror that here so a
# library is registered once however many models load.
_REGISTERED_PLUGINS: dict[str, str] = {}


def _register_plugins(ort) -> dict[str, str]:
    """Register every installed plugin EP package; returns ep_name -> library path."""
    if not hasattr(ort, "register_execution_provider_library"):
        return {}
    for provider in PROVIDERS:
        if provider.plugin_module is None or provider.ep_name in _REGISTERED_PLUGINS:
            continue
        try:
            module = importlib.import_module(provider.plugin_module)
        except ImportError:
            continue
        library = module.get_library_path()
        ort.register_execution_provider_library(provider.ep_name, library)
        _REGISTERED_PLUGINS[provider.ep_name] = library
    return dict(_REGISTERED_PLUGINS)


@dataclass
class ProviderRuntime:
    """A provider that exists in this process, and how to attach it to a session."""

    provider: Provider
    ort: object
    plugin_devices: list  # OrtEpDevice objects for a plugin EP; empty for a built-in one
    options: dict[str, str]
    notes: list[str]

    @property
    def name(self) -> str:
        return self.provider.ep_name


def available_providers(ort) -> dict[str, list]:
    """ep_name -> plugin devices ([] for providers built into onnxruntime), for every known provider here."""
    found: dict[str, list] = {name: [] for name in ort.get_available_providers()}
    plugins = _register_plugins(ort)
    if plugins:
        for device in ort.get_ep_devices():
            if device.ep_name in plugins:
                found.setdefault(device.ep_name, []).append(device)
    return {p.ep_name: found[p.ep_name] for p in PROVIDERS if p.ep_name in found}


def choose_provider(ort, requested: str | None, user_options: dict[str, str]) -> ProviderRuntime:
    """The provider for `npu` (requested None: by PRIORITY) or `npu:<requested>`."""
    present = available_providers(ort)
    present_keys = [p.key for p in PROVIDERS if p.ep_name in present]
    notes: list[str] = []
    if requested is None:
        provider = BY_KEY[present_keys[0]]  # the CPU provider is always present
        if provider.key == "cpu":
            message = (f"device 'npu': no NPU execution provider in onnxruntime {ort.__version__} "
                       f"(looked for {', '.join(PRIORITY[:-1])}); running on ONNX Runtime's CPU provider")
            log.warning(message)
            notes.append(message)
    else:
        if requested not in BY_KEY:
            raise ValueError(f"unknown NPU provider {requested!r} in device 'npu:{requested}'; "
                             f"known: {', '.join(PRIORITY)}")
        provider = BY_KEY[requested]
        if provider.ep_name not in present:
            raise DeviceUnavailableError(
                f"device 'npu:{requested}' needs onnxruntime's {provider.ep_name}, which this installation "
                f"(onnxruntime {ort.__version__}) does not have (it has: {', '.join(present_keys)}); "
                f"to get it: {provider.how_to_get}"
            )
    options = _default_options(ort, provider, present.get(provider.ep_name, []), notes)
    options.update(user_options)
    return ProviderRuntime(provider, ort, present.get(provider.ep_name, []), options, notes)


def _default_options(ort, provider: Provider, plugin_devices: list, notes: list[str]) -> dict[str, str]:
    if provider.key == "openvino":
        devices = openvino_devices(ort, plugin_devices)
        device = "NPU" if "NPU" in devices else "CPU"
        if device != "NPU":
            message = (f"OpenVINO reports no NPU (devices: {', '.join(devices) or 'none'}); "
                       "it runs on OpenVINO's CPU plugin at float32 precision (ACCURACY)")
            log.warning(message)
            notes.append(message)
        return {"device_type": device, "precision": "ACCURACY" if device == "CPU" else "FP16"}
    if provider.key == "qnn":
        options = {"backend_path": _qnn_library("QnnHtp"), "enable_htp_fp16_precision": "1"}
        if platform.machine().lower() in ("x86_64", "amd64"):
            options.update(QNN_SIMULATOR_DEFAULTS)
            notes.append("QNN HTP on an x86-64 host is Qualcomm's HTP simulator "
                         f"(soc_model {QNN_SIMULATOR_DEFAULTS['soc_model']}, v{QNN_SIMULATOR_DEFAULTS['htp_arch']}), "
                         "at float16 precision")
        return options
    return {}


def openvino_devices(ort, plugin_devices: list) -> list[str]:
    if plugin_devices:
        return sorted({d.ep_metadata.get("ov_device", "") for d in plugin_devices} - {""})
    capi = getattr(ort, "capi", None)
    lister = getattr(getattr(capi, "_pybind_state", None), "get_available_openvino_device_ids", None)
    return sorted(lister()) if lister else []


def _qnn_library(name: str) -> str:
    try:
        module = importlib.import_module("onnxruntime_qnn")
    except ImportError:
        return f"lib{name}.so"  # a build with QNN built in finds it on the library path
    return getattr(module, f"get_qnn_{name[3:].lower()}_path")()


def session_options(runtime: ProviderRuntime, threads: int | None, allow_cpu_nodes: bool, spinning: bool = True):
    ort = runtime.ort
    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    if not spinning:
        # onnxruntime's idle workers spin after a run by default; when other kernels run on the same
        # cores between graphs (a MoE model's experts on the CPU backend), that spinning takes their
        # cores: 9 -> 36-240 ms per decoded token (8-layer, 64-expert random MoE, a busy 2-core machine)
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    if runtime.provider.key != "cpu" and not allow_cpu_nodes:
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    return so


def create_session(runtime: ProviderRuntime, path: str | bytes, threads: int | None, allow_cpu_nodes: bool,
                   spinning: bool = True):
    """An InferenceSession for the graph at `path` (or serialized graph bytes) on the runtime's provider,
    with nodes on the CPU provider only if allowed, and idle workers spinning unless told not to."""
    ort = runtime.ort
    so = session_options(runtime, threads, allow_cpu_nodes, spinning)
    try:
        if runtime.plugin_devices:
            # a plugin device is already one device: the device choice is not an option there
            options = {k: v for k, v in runtime.options.items() if k != "device_type"}
            so.add_provider_for_devices(_pick_plugin_devices(runtime), options)
            return ort.InferenceSession(path, so)
        return ort.InferenceSession(path, so, providers=[runtime.name], provider_options=[runtime.options])
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidArgument types
        if runtime.provider.key == "cpu":
            raise
        raise DeviceUnavailableError(
            f"{runtime.name} could not take the graph {path if isinstance(path, str) else '(in memory)'}: {str(exc).strip()[:800]} "
            f"(to run the nodes it rejects on the CPU provider, say so explicitly: 'npu:{runtime.provider.key},"
            f"allow_cpu_nodes=1')"
        ) from None


def _pick_plugin_devices(runtime: ProviderRuntime) -> list:
    if runtime.provider.key == "openvino":
        wanted = runtime.options.get("device_type", "CPU")
        chosen = [d for d in runtime.plugin_devices if d.ep_metadata.get("ov_device") == wanted]
        if not chosen:
            raise DeviceUnavailableError(f"OpenVINO plugin has no {wanted} device "
                                         f"(it has: {', '.join(openvino_devices(runtime.ort, runtime.plugin_devices))})")
        return chosen[:1]
    return runtime.plugin_devices[:1]


def placement(session) -> dict[str, dict]:
    """Which provider runs which nodes: ep_name -> {"nodes": count, "ops": {op_type: count}}."""
    report: dict[str, dict] = {}
    for subgraph in session.get_provider_graph_assignment_info():
        entry = report.setdefault(subgraph.ep_name, {"nodes": 0, "ops": Counter()})
        for node in subgraph.get_nodes():
            entry["nodes"] += 1
            entry["ops"][node.op_type] += 1
    return {ep: {"nodes": e["nodes"], "ops": dict(sorted(e["ops"].items()))} for ep, e in report.items()}
