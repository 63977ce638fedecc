"""Graphs built once per model and kept on disk.

Layout, under $ZLLM_EDGE_HOME/onnx (default ~/.cache/zllm-edge/onnx; edge/home.py documents the
variable):

    <digest>/v<exporter version>-<affine form>/
        weights.bin, weights.json      every weight array, written once, shared by all graphs
        <form>-acc<level>-<shape key>.onnx   one graph per attention form (which follows from the
                                       provider), accuracy level, layer chunk and fixed shape; the
                                       key marks chunks that end at a MoE layer's router (MoEout) or
                                       take the previous MoE block's output (MoEin)

<digest> is the checkpoint's sha256: the sha256 of its zllm.json, which records the sha256 of every
weight file (found through the memory-mapped weights, so nothing is hashed again at load); a model
whose weights are not mapped from a checkpoint is keyed by the sha256 of its weight bytes.

A graph is stale, and rebuilt, when its recorded exporter version, exporter source digest (sha256
of devices/npu/onnx_export.py and onnx_weights.py) or checkpoint digest differs from the current
ones, or its weight references point outside weights.bin; a weight file whose index does not
match is removed with every graph beside it. Writers hold a lock file, and each graph appears
atomically (written aside, then renamed).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil

import numpy as np
import onnx

from devices.npu.onnx_export import EXPORTER_DIGEST, EXPORTER_VERSION, ExportOptions, GraphShape, export_graph
from devices.npu.onnx_weights import ExternalWeightFile, WeightFileError
from edge.core.files import exclusive
from kernels.cache_home import zllm_home
from quant import QuantizedTensor

MANIFEST = "zllm.json"


def cache_root() -> str:
    return os.path.join(zllm_home(), "onnx")


def _model_arrays(model):
    """Every array the graphs read, in a fixed order."""
    def arrays(weight):
        if isinstance(weight, QuantizedTensor):
            return [a for a in (weight.qweight, weight.scales, weight.offsets) if a is not None]
        if isinstance(weight, np.ndarray):
            return [weight]
        if dataclasses.is_dataclass(weight):  # a MoE layer's router and shared expert
            return [a for field in vars(weight).values() for a in arrays(field)]
        return []  # None, a window size, a MoE config's numbers

    yield from arrays(model.embed_tokens)
    for layer in model.layers:
        yield from arrays(layer)
    yield from arrays(model.final_norm)
    yield from arrays(model.lm_head)


def model_digest(model) -> str:
    """The checkpoint's sha256 (see module docstring)."""
    files = {os.path.abspath(a.filename) for a in _model_arrays(model) if isinstance(a, np.memmap) and a.filename}
    folders = {os.path.dirname(f) for f in files}
    if len(folders) == 1:
        manifest = os.path.join(folders.pop(), MANIFEST)
        if os.path.isfile(manifest):
            with open(manifest, "rb") as f:
                return hashlib.sha256(f.read()).hexdigest()
    digest = hashlib.sha256(json.dumps(model.spec.to_dict(), sort_keys=True, default=str).encode())
    for array in _model_arrays(model):
        digest.update(f"{array.dtype}{array.shape}".encode())
        digest.update(memoryview(np.ascontiguousarray(array)).cast("B"))
    return digest.hexdigest()


class GraphCache:
    def __init__(self, model, options: ExportOptions, root: str | None = None):
        self.model = model
        self.options = options
        self.digest = model_digest(model)
        self.folder = os.path.join(root or cache_root(), self.digest[:32], f"v{EXPORTER_VERSION}-{options.affine_int4}")
        self.fingerprint = {"digest": self.digest, "exporter_version": EXPORTER_VERSION,
                            "exporter_digest": EXPORTER_DIGEST, "affine_int4": options.affine_int4}
        self.built: list[str] = []  # graphs written by this process (the rest came from the cache)

    def graph_name(self, shape: GraphShape) -> str:
        return f"{self.options.attention}-acc{self.options.accuracy_level}-{shape.key}.onnx"

    def path(self, shape: GraphShape) -> str:
        """The graph's file, built now if it is missing or stale."""
        path = os.path.join(self.folder, self.graph_name(shape))
        if self._is_current(path):
            return path
        with self._locked():
            if not self._is_current(path):  # another process may have built it while we waited
                self._build(shape, path)
        return path

    def _is_current(self, path: str) -> bool:
        if not os.path.isfile(path):
            return False
        try:
            model = onnx.load(path, load_external_data=False)
        except Exception:  # a truncated or foreign file: rebuild it
            return False
        props = {p.key: p.value for p in model.metadata_props}
        if (props.get("zllm_exporter_version") != str(EXPORTER_VERSION) or props.get("zllm_digest") != self.digest
                or props.get("zllm_exporter_digest") != EXPORTER_DIGEST):
            return False
        if not self._weight_index_matches():
            return False
        data = os.path.join(self.folder, ExternalWeightFile.DATA)
        size = os.path.getsize(data) if os.path.isfile(data) else 0
        for tensor in model.graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                entry = {e.key: e.value for e in tensor.external_data}
                if int(entry["offset"]) + int(entry["length"]) > size:
                    return False
        return True

    def _weight_index_matches(self) -> bool:
        try:
            with open(os.path.join(self.folder, ExternalWeightFile.INDEX), encoding="utf-8") as f:
                return json.load(f).get("fingerprint") == self.fingerprint
        except (OSError, ValueError, AttributeError):
            return False

    def _build(self, shape: GraphShape, path: str) -> None:
        try:
            weights = ExternalWeightFile(self.folder, self.fingerprint)
        except (WeightFileError, json.JSONDecodeError, KeyError, TypeError):
            self._wipe()  # a weight file from another exporter or an interrupted write: start again
            weights = ExternalWeightFile(self.folder, self.fingerprint)
        try:
            model = export_graph(self.model, shape, self.options, weights)
        finally:
            weights.close()  # data made durable before any graph that points into it appears
        onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                            "zllm_digest": self.digest})
        temporary = path + ".tmp"
        onnx.save(model, temporary)
        os.replace(temporary, path)
        self.built.append(os.path.basename(path))

    def _wipe(self) -> None:
        for name in os.listdir(self.folder):
            if name != ".lock":
                target = os.path.join(self.folder, name)
                shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)

    def _locked(self):
        return exclusive(os.path.join(self.folder, ".lock"), f"writing the ONNX graph cache {self.folder}")
