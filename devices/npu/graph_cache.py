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

weights.json, the folder's index, records the fingerprint it was written for (checkpoint digest,
exporter version and source digest: sha256 of devices/npu/onnx_export.py and onnx_weights.py), each
array's place in weights.bin, the size and sha256 of weights.bin, the sha256 of each graph and its
own. A folder whose fingerprint differs is stale: emptied and exported again without a word. A
damaged one (weights.json that does not parse or whose sha256 does not match, weights.bin cut short
or overwritten, a graph whose sha256 differs, a graph the index does not record) is said in one line
on stderr and exported again: the graph, or when the weights or their index are hit every graph. weights.bin is hashed once per load,
as fast as the disk reads it. Writers hold a lock file; the weights and the index recording a graph
are durable before the graph appears, atomically (written aside, then renamed). A home that cannot
be written (read-only, full) is a NotWritableError naming the folder and ZLLM_EDGE_HOME.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys

import numpy as np
import onnx

from devices.npu.onnx_export import EXPORTER_DIGEST, EXPORTER_VERSION, ExportOptions, GraphShape, export_graph
from devices.npu.onnx_weights import ExternalWeightFile, WeightFileError, file_sha256, index_problem
from edge.core.files import exclusive, is_not_writable
from kernels.cache_home import home_not_writable, zllm_home
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


@dataclasses.dataclass(frozen=True)
class _Problem:
    """Why a graph cannot be used as it is on disk."""

    said: str | None  # damage, said on stderr; None: missing or stale, exported again without a word
    whole_folder: bool  # the weights or their index: every graph beside them is exported again


class GraphCache:
    def __init__(self, model, options: ExportOptions, root: str | None = None):
        self.model = model
        self.options = options
        self.digest = model_digest(model)
        self.folder = os.path.join(root or cache_root(), self.digest[:32], f"v{EXPORTER_VERSION}-{options.affine_int4}")
        self.fingerprint = {"digest": self.digest, "exporter_version": EXPORTER_VERSION,
                            "exporter_digest": EXPORTER_DIGEST, "affine_int4": options.affine_int4}
        self.built: list[str] = []  # graphs written by this process (the rest came from the cache)
        self._verified_data: tuple[int, str] | None = None  # (size, sha256) weights.bin was found to match

    def graph_name(self, shape: GraphShape) -> str:
        return f"{self.options.attention}-acc{self.options.accuracy_level}-{shape.key}.onnx"

    def path(self, shape: GraphShape) -> str:
        """The graph's file, built now if it is missing, stale or damaged."""
        path = os.path.join(self.folder, self.graph_name(shape))
        if self._problem(path) is None:
            return path
        try:
            with self._locked():
                problem = self._problem(path)  # another process may have built it while we waited
                if problem is not None:
                    self._rebuild(shape, path, problem)
        except OSError as exc:
            if not is_not_writable(exc):
                raise
            raise home_not_writable(self.folder, exc) from None
        return path

    def _problem(self, path: str) -> _Problem | None:
        index = self._checked_index()
        if isinstance(index, _Problem):
            return index
        if not os.path.isfile(path):
            return _Problem(None, whole_folder=False)
        recorded = index["graphs"].get(os.path.basename(path))
        if recorded is None:
            return _Problem(f"{path} is damaged (weights.json records no such graph)", whole_folder=False)
        if file_sha256(path, os.path.getsize(path)) != recorded:
            return _Problem(f"{path} is damaged (its sha256 differs from the one weights.json records: "
                            f"cut short or overwritten)", whole_folder=False)
        return None

    def _checked_index(self) -> dict | _Problem:
        """weights.json, read now (another process may have added graphs), once weights.bin is found to
        match what it records; or why they cannot be used. weights.bin is hashed once per load, and
        again only when another process has added weights since."""
        index_path = os.path.join(self.folder, ExternalWeightFile.INDEX)
        data_path = os.path.join(self.folder, ExternalWeightFile.DATA)
        try:
            with open(index_path, encoding="utf-8") as f:
                index = json.load(f)
        except FileNotFoundError:
            if os.path.exists(data_path):  # (the index is written after the weights)
                return _Problem(f"{index_path} is missing beside {data_path} (an interrupted export)",
                                whole_folder=True)
            return _Problem(None, whole_folder=True)  # nothing exported yet
        except (OSError, ValueError, RecursionError) as exc:
            return _Problem(f"{index_path} is damaged ({exc})", whole_folder=True)
        problem = index_problem(index)
        if problem is not None:
            return _Problem(f"{index_path} is damaged ({problem})", whole_folder=True)
        if index["fingerprint"] != self.fingerprint:
            return _Problem(None, whole_folder=True)  # another exporter or model: stale
        data = (index["data"]["size"], index["data"]["sha256"])
        if data != self._verified_data:
            size = data[0]
            actual = os.path.getsize(data_path) if os.path.isfile(data_path) else None
            if actual is None or actual < size:
                return _Problem(f"{data_path} is damaged ({'missing' if actual is None else f'{actual} bytes'}; "
                                f"{index_path} records {size})", whole_folder=True)
            if file_sha256(data_path, size) != data[1]:
                return _Problem(f"{data_path} is damaged (its sha256 differs from the one {index_path} records: "
                                f"overwritten)", whole_folder=True)
            self._verified_data = data
        return index

    def _rebuild(self, shape: GraphShape, path: str, problem: _Problem) -> None:
        if problem.said:
            print(f"{problem.said}; exporting {'every graph of the model' if problem.whole_folder else 'it'} again",
                  file=sys.stderr)
        if problem.whole_folder:
            self._wipe()
        self._build(shape, path)

    def _build(self, shape: GraphShape, path: str) -> None:
        try:
            weights = ExternalWeightFile(self.folder, self.fingerprint)
        except WeightFileError:  # changed since it was checked, by something that does not take the lock
            self._wipe()
            weights = ExternalWeightFile(self.folder, self.fingerprint)
        temporary = path + ".tmp"
        try:
            model = export_graph(self.model, shape, self.options, weights)
            onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                                "zllm_digest": self.digest})
            content = model.SerializeToString()
            with open(temporary, "wb") as f:
                f.write(content)
            weights.record_graph(os.path.basename(path), hashlib.sha256(content).hexdigest())
            weights.close()  # the weights and the index recording the graph durable before the graph appears
            os.replace(temporary, path)
        finally:
            weights.close()
            if os.path.exists(temporary):
                os.remove(temporary)
        self._verified_data = (weights.data["size"], weights.data["sha256"])  # (hashed as it was written)
        self.built.append(os.path.basename(path))

    def _wipe(self) -> None:
        self._verified_data = None
        for name in os.listdir(self.folder):
            if name != ".lock":
                target = os.path.join(self.folder, name)
                shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)

    def _locked(self):
        return exclusive(os.path.join(self.folder, ".lock"), f"writing the ONNX graph cache {self.folder}")
