"""The zllm checkpoint: a directory holding

    zllm.json         manifest: format/version, model spec, every tensor's scheme, shape and
                      stored arrays, tokenizer settings, file sizes and sha256 checksums
    tokenizer.json    Hugging Face tokenizers format (absent when the source had none)
    model.safetensors dense weights; a quantized tensor W is stored as W.qweight, W.scales
                      and (affine) W.offsets, laid out as quant/formats.py documents
    experts.bin       MoE models only: the routed experts, one aligned record per (layer, expert)
                      (quant/expert_file.py; indexed by the manifest's "experts" entry, which
                      carries the sha256 of its canonical form, "index_sha256", verified at load)

The manifest carries the sha256 of its own canonical form, "manifest_sha256" (`canonical_sha256`),
verified at load after every structural check: a flipped digit in the model spec (rope_theta, an
epsilon) passes those checks, and the digest refuses it. A hand edit is refused the same way: the
manifest is the converter's record of what it wrote, and settings a user may change are options of
the commands and of `edge.load`. Checkpoints written before the digest existed (within format
version 1) have no manifest_sha256 and load with the structural checks alone.

Writers create the directory under a temporary name beside its destination and rename it
when complete, so a directory named like a checkpoint is always a whole one.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from edge.core.errors import CheckpointError
from edge.core.json_text import parse_json
from quant import QuantizedTensor, Scheme
from quant.formats import describe_non_finite
from quant.safetensors_io import SafetensorsFile, SafetensorsFormatError

if TYPE_CHECKING:
    from edge.core.spec import LlamaSpec
    from quant.expert_file import ExpertIndex

FORMAT = "zllm"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
MANIFEST = "zllm.json"
MANIFEST_SHA256 = "manifest_sha256"  # the key of the manifest's digest of itself
TOKENIZER = "tokenizer.json"
WEIGHTS = "model.safetensors"


def stored_arrays(name: str, scheme: Scheme, shape: tuple[int, ...]) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The arrays (dtype, shape) a tensor of this scheme and logical shape is stored as."""
    if not scheme.is_quantized:
        return {name: (np.dtype(np.float16 if scheme.dtype == "f16" else np.float32), tuple(shape))}
    rows, cols = shape
    n_groups = -(-cols // scheme.group_size)
    arrays = {
        name + ".qweight": (np.dtype(np.uint8), (rows, n_groups, scheme.group_size * scheme.bits // 8)),
        name + ".scales": (scheme.scale_numpy_dtype, (rows, n_groups)),
    }
    if not scheme.symmetric:
        arrays[name + ".offsets"] = (scheme.scale_numpy_dtype, (rows, n_groups))
    return arrays


def sha256_file(path: str, chunk_bytes: int = 16 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def canonical_sha256(entry: dict, own_key: str) -> str:
    """The sha256 of a JSON object: of its JSON with keys sorted, no spaces and ASCII only, its own digest
    key `own_key` left out, so that the object as written and as parsed back give the same text."""
    canonical = json.dumps({key: value for key, value in entry.items() if key != own_key},
                           sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def sealed(manifest: dict) -> dict:
    """The manifest with its MANIFEST_SHA256 set to the digest of the rest (what the converter writes)."""
    manifest[MANIFEST_SHA256] = canonical_sha256(manifest, MANIFEST_SHA256)
    return manifest


def check_canonical_sha256(where: str, entry: dict, own_key: str, owner: str, edited: str) -> None:
    """Refuse an object whose digest under `own_key` is not a sha256 digest, or not that of the rest of
    the object (`edited` says what that means, e.g. "the expert index fails its sha256 check ..."). An
    object without the key (written before it existed) passes. `owner` names the object ("the
    manifest's")."""
    from edge.core.spec_dense import show

    if own_key not in entry:
        return
    stored = entry[own_key]
    if not (isinstance(stored, str) and len(stored) == 64 and all(c in "0123456789abcdef" for c in stored)):
        raise CheckpointError(f"{where}: {owner} {own_key} is {show(stored)}, not a sha256 digest "
                              "(64 lowercase hexadecimal digits); the checkpoint is damaged, convert the model again")
    if canonical_sha256(entry, own_key) != stored:
        raise CheckpointError(f"{where}: {edited}; convert the model again")


@dataclass
class Checkpoint:
    """An opened checkpoint: manifest plus zero-copy views of every tensor."""

    path: str
    manifest: dict
    tensors: dict[str, np.ndarray | QuantizedTensor]
    _files: list[SafetensorsFile]
    experts: "ExpertIndex | None" = None  # routed experts of a MoE model (experts.bin), else None
    spec: "LlamaSpec | None" = None  # the manifest's model spec, checked against the tensors

    @property
    def model_config(self) -> dict:
        return self.manifest["model"]

    @property
    def tokenizer_path(self) -> str | None:
        path = os.path.join(self.path, TOKENIZER)
        return path if os.path.isfile(path) else None

    @property
    def tokenizer_config(self) -> dict:
        return self.manifest.get("tokenizer", {})

    def close(self) -> None:
        self.tensors = {}
        for f in self._files:
            f.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_manifest(path: str) -> dict:
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a directory; a zllm checkpoint is a directory made by `zllm-edge convert`")
    if not os.path.isfile(manifest_path):
        raise CheckpointError(
            f"{path} has no {MANIFEST}; it is not a zllm checkpoint (make one with `zllm-edge convert SRC OUT`)"
        )
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = parse_json(f.read())
    except ValueError as exc:
        raise CheckpointError(f"{manifest_path} is not valid JSON ({exc}); the checkpoint is damaged, convert the "
                              "model again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{manifest_path}: expected format {FORMAT!r}, found {found!r}")
    version = manifest.get("format_version")
    if isinstance(version, bool) or version not in SUPPORTED_VERSIONS:
        supported = ", ".join(str(v) for v in SUPPORTED_VERSIONS)
        raise CheckpointError(
            f"{path}: zllm format version {version!r} is not supported (this zllm-edge reads version {supported}); "
            "convert the model again with this version of zllm-edge"
        )
    for key in ("model", "files", "tensors"):
        if not isinstance(manifest.get(key), dict):
            found = "missing" if key not in manifest else f"a {type(manifest[key]).__name__}"
            raise CheckpointError(f"{manifest_path}: the {key!r} entry should be an object, it is {found}; "
                                  "the checkpoint is damaged, convert the model again")
    experts = manifest.get("experts")
    if experts is not None and (not isinstance(experts, dict) or not isinstance(experts.get("file"), str)
                                or experts["file"] not in manifest["files"]):
        raise CheckpointError(f"{manifest_path}: the experts entry does not name a file the manifest lists; "
                              "the checkpoint is damaged, convert the model again")
    return manifest


def _verify_experts(path: str, experts, sha256: str) -> None:
    """Check every expert record's crc32 (naming a damaged one), then the whole file's sha256."""
    from quant.expert_file import read_expert_bytes

    fd = os.open(experts.path, os.O_RDONLY)
    try:
        for layer, layer_experts in sorted(experts.layers.items()):
            for expert in range(len(layer_experts.records)):
                read_expert_bytes(fd, experts, layer, expert, verify=True)
    finally:
        os.close(fd)
    if sha256_file(experts.path) != sha256:
        raise CheckpointError(f"{path}: {os.path.basename(experts.path)} fails its sha256 check outside its expert "
                              "records; the checkpoint is damaged")


def open_checkpoint(path: str, verify: bool = False) -> Checkpoint:
    """mmap a checkpoint; with `verify`, check every file's sha256 first."""
    path = os.fspath(path)
    manifest = read_manifest(path)
    files: dict[str, SafetensorsFile] = {}
    try:  # whatever is refused, the files opened so far are closed
        tensors = _open_tensors(path, manifest, verify, files)
        for name, tensor in tensors.items():
            check_finite(path, name, tensor)
        experts = None
        if manifest.get("experts") is not None:
            from quant.expert_file import ExpertIndex  # expert_file imports this module

            try:
                experts = ExpertIndex(path, manifest["experts"])
            except (KeyError, ValueError, TypeError) as exc:
                raise CheckpointError(f"{path}: the manifest's experts entry is malformed ({exc}); "
                                      "convert the model again") from None
            if verify:
                _verify_experts(path, experts, manifest["files"][os.path.basename(experts.path)]["sha256"])
        spec = check_shapes_against_spec(path, manifest, tensors, experts)
        if experts is not None:
            # last: the checks above name what they find; the digest refuses the edits they cannot see
            # (two entries swapped with their crc32s, a layout's arrays exchanged)
            from quant.expert_file import check_index_sha256

            check_index_sha256(path, manifest["experts"])
        _check_tokenizer_entry(path, manifest, spec.vocab_size)
        # last of all, for the same reason: what passed every check above and still differs from what the
        # converter wrote (a flipped digit of the spec, an edited chat template) is refused here
        check_canonical_sha256(os.path.join(path, MANIFEST), manifest, MANIFEST_SHA256, "the manifest's",
                               f"the manifest fails its sha256 check ({MANIFEST_SHA256}): it was edited or "
                               "damaged after conversion")
    except BaseException:
        for f in files.values():
            f.close()
        raise
    return Checkpoint(path, manifest, tensors, list(files.values()), experts, spec)


def check_finite(where: str, name: str, tensor: np.ndarray | QuantizedTensor) -> None:
    """Refuse a loaded tensor that holds NaN or infinity (a quantized tensor's scales and offsets, one per
    group; a float tensor's values), which conversion never writes: the model would compute NaN logits."""
    found = describe_non_finite(tensor)
    if found is not None:
        raise CheckpointError(f"{where}: tensor {name} holds a non-finite {found}; the checkpoint is damaged, "
                              "convert the model again")


def _open_tensors(path: str, manifest: dict, verify: bool, files: dict[str, SafetensorsFile]) -> dict:
    """Every dense tensor of the manifest as a view of its file (opened into `files`), after each
    file's size (and, with `verify`, sha256) matched the manifest."""
    try:
        for filename, info in manifest["files"].items():
            file_path = os.path.join(path, filename)
            if not os.path.isfile(file_path):
                state = "is not a file" if os.path.exists(file_path) else "is missing"
                raise CheckpointError(f"{path}: weight file {filename} {state}; convert the model again")
            if os.path.getsize(file_path) != info["bytes"]:
                raise CheckpointError(
                    f"{path}: {filename} has {os.path.getsize(file_path)} bytes, the manifest says {info['bytes']}; "
                    "the checkpoint is damaged, convert it again"
                )
            # the expert file is verified after its index is read: record checksums name the damaged expert
            is_expert_file = filename == (manifest.get("experts") or {}).get("file")
            if verify and not is_expert_file and sha256_file(file_path) != info["sha256"]:
                raise CheckpointError(f"{path}: {filename} fails its sha256 check; the checkpoint is damaged")
            if filename.endswith(".safetensors"):
                files[filename] = SafetensorsFile(file_path)
        tensors: dict[str, np.ndarray | QuantizedTensor] = {}
        for name, info in manifest["tensors"].items():
            st = files[info["file"]]
            scheme = Scheme.parse(info["scheme"])
            if scheme.is_quantized:
                arrays = {key: st.raw(key) for key in stored_arrays(name, scheme, tuple(info["shape"]))}
                tensors[name] = QuantizedTensor.from_arrays(scheme, tuple(info["shape"]), arrays, name)
            else:
                tensors[name] = st.raw(name)
        return tensors
    except SafetensorsFormatError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    except (KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{path}: manifest and weights disagree ({exc!r}); convert the model again") from None


def _check_tokenizer_entry(path: str, manifest: dict, vocab_size: int) -> None:
    """The manifest's tokenizer entry is an object whose special ids are tokens of the model (generation
    stops at eos_token_id and eog_token_ids, and a prompt may start with bos_token_id), and whose flags and
    chat template are of their types."""
    from edge.core.arguments import is_integer
    from edge.core.spec_dense import show

    where, damaged = os.path.join(path, MANIFEST), "the checkpoint is damaged, convert the model again"
    tokenizer = manifest.get("tokenizer", {})
    if not isinstance(tokenizer, dict):
        raise CheckpointError(f"{where}: the 'tokenizer' entry should be an object, it is {show(tokenizer)}; {damaged}")
    for key in ("bos_token_id", "eos_token_id", "eog_token_ids"):
        value = tokenizer.get(key)
        if value is None:
            continue
        listed = key == "eog_token_ids"
        ids = (value if isinstance(value, list) else None) if listed else [value]
        if ids is None or not all(is_integer(i, 0) and i < vocab_size for i in ids):
            raise CheckpointError(f"{where}: tokenizer: {key} is {show(value)}; expected "
                                  f"{'a list of token ids' if listed else 'a token id'} below vocab_size {vocab_size}, "
                                  f"or null; {damaged}")
    # what the tokenizer reads besides ids: a flag of another type would change meaning ("false" is true),
    # a template of another type fail only when a chat is rendered
    for key, valid, expected in (("add_bos_token", lambda v: isinstance(v, bool), "true or false"),
                                 ("add_eos_token", lambda v: isinstance(v, bool), "true or false"),
                                 ("chat_template", lambda v: isinstance(v, str), "a Jinja template string")):
        value = tokenizer.get(key)
        if value is not None and not valid(value):
            raise CheckpointError(f"{where}: tokenizer: {key} is {show(value)}; expected {expected}, or null; "
                                  f"{damaged}")
    if tokenizer.get("sampling") is not None:  # the conversation sampling its generation_config.json gave
        from edge.core.errors import InvalidArgumentError
        from edge.core.sampling_defaults import check_sampling

        try:
            check_sampling(tokenizer["sampling"])
        except InvalidArgumentError as exc:
            raise CheckpointError(f"{where}: tokenizer: {exc}; {damaged}") from None


def check_shapes_against_spec(path: str, manifest: dict, tensors: dict, experts: "ExpertIndex | None") -> "LlamaSpec":
    """Every tensor of an opened checkpoint, and each MoE layer's expert layout and count, against what the
    manifest's model spec gives them (edge/core/spec.py `spec_tensor_shapes`), so that a hand-edited or damaged
    manifest is a CheckpointError at load instead of a numpy error (or garbage) at generate time."""
    from edge.core.errors import ZllmError
    from edge.core.spec import shape_mismatches, spec_from_dict

    damaged = "the checkpoint is damaged, convert the model again"
    try:
        spec = spec_from_dict(manifest["model"])
        moe_layers = {layer: moe for layer in range(spec.num_hidden_layers)
                      if (moe := spec.moe_for_layer(layer)) is not None}
    except ZllmError as exc:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)}: model: {exc}; {damaged}") from None
    shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    if experts is not None:
        for layer, layer_experts in sorted(experts.layers.items()):
            moe = moe_layers.get(layer)
            if moe is None or len(layer_experts.records) != moe.num_experts:
                wanted = "no routed experts" if moe is None else f"{moe.num_experts} routed experts"
                raise CheckpointError(f"{path}: the expert index holds {len(layer_experts.records)} experts for layer "
                                      f"{layer}, but the model spec gives that layer {wanted}; {damaged}")
            # every expert of a layer shares one layout: expert 0's names stand for all of them
            for projection, layout in layer_experts.layout.projections.items():
                shapes[f"model.layers.{layer}.mlp.experts.0.{projection}.weight"] = layout.shape
                found = {key: (a.dtype, a.shape) for key, a in layout.arrays.items()}
                try:
                    needed = {key.lstrip("."): (np.dtype(dtype), tuple(shape))
                              for key, (dtype, shape) in stored_arrays("", layout.scheme, layout.shape).items()}
                except ValueError:  # not a matrix
                    needed = None
                if found != needed:
                    raise CheckpointError(
                        f"{path}: layer {layer}'s expert {projection} is a {layout.scheme} matrix of shape "
                        f"{list(layout.shape)}, but the expert index stores it as arrays "
                        f"{ {key: list(shape) for key, (_, shape) in found.items()} }; {damaged}")
        missing = sorted(set(moe_layers) - set(experts.layers))
        if missing:
            raise CheckpointError(f"{path}: the expert index has no experts for MoE layer {missing[0]}; {damaged}")
    problems = shape_mismatches(spec, shapes, first_expert_only=True)  # shapes name expert 0 of each layer
    if problems:
        more = f" ({len(problems) - 1} more tensors disagree too)" if len(problems) > 1 else ""
        raise CheckpointError(f"{path}: {problems[0]}{more}; the manifest's model spec and the weights disagree: "
                              f"{damaged}")
    return spec
