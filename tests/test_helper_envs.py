"""Helper virtualenvs (devices/helper_envs.py) see the packages of the interpreter that creates them,
their own first, and are rebuilt when made by another interpreter. Nothing here runs pip: the
environments are created without it, and a package "installed" into one is a module written there.

Modules are located with importlib.util.find_spec (not imported), from a scratch working directory
and without PYTHONPATH, so that only what each interpreter's site gives it counts.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from devices import helper_envs
from kernels.cache_home import zllm_home

PROBED = ("numpy", "tqdm", "edge")  # tqdm is shadowed below: a pure-Python dependency nothing here imports
PROBE = ("import importlib.util, json, sys; "
         "print(json.dumps({m: getattr(importlib.util.find_spec(m), 'origin', None) for m in sys.argv[1:]}))")


def located(python: Path | str, cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([str(python), "-c", PROBE, *PROBED], capture_output=True, text=True, cwd=cwd, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def site_packages(python: Path) -> Path:
    result = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                            capture_output=True, text=True, check=True)
    return Path(result.stdout.strip())


def test_a_helper_env_sees_its_creators_packages_after_its_own(tmp_path):
    python = helper_envs.create_venv(tmp_path / "env", with_pip=False)
    parents = located(sys.executable, tmp_path)
    assert parents["numpy"] is not None and parents["tqdm"] is not None
    assert located(python, tmp_path) == parents  # this project too, when installed (editable: its finder)

    shadow = site_packages(python) / "tqdm" / "__init__.py"
    shadow.parent.mkdir()
    shadow.write_text("")
    helpers = located(python, tmp_path)
    assert helpers["tqdm"] == str(shadow)
    assert helpers["numpy"] == parents["numpy"]


def test_a_helper_env_that_does_not_inherit_sees_only_its_own(tmp_path):
    python = helper_envs.create_venv(tmp_path / "env", inherit=False, with_pip=False)
    assert located(python, tmp_path) == {"numpy": None, "tqdm": None, "edge": None}


def test_helper_envs_live_in_the_home_unless_moved(monkeypatch, tmp_path):
    monkeypatch.delenv(helper_envs.VENVS_VARIABLE, raising=False)
    assert helper_envs.helper_envs_dir() == Path(zllm_home()) / "venvs"
    monkeypatch.setenv(helper_envs.VENVS_VARIABLE, str(tmp_path))
    spec = helper_envs.HelperEnv(name="probe", requirements=("probe==1",))
    assert helper_envs.env_folder(spec) == tmp_path / f"probe-{helper_envs.creator_tag()}"


def test_an_env_built_by_another_interpreter_is_not_reused(monkeypatch, tmp_path):
    monkeypatch.setenv(helper_envs.VENVS_VARIABLE, str(tmp_path))
    spec = helper_envs.HelperEnv(name="probe", requirements=("probe==1",))
    folder = helper_envs.env_folder(spec)
    helper_envs.create_venv(folder, with_pip=False)
    assert not helper_envs.is_ready(spec)  # no marker: an interrupted build
    record = helper_envs.marker_record(spec)
    (folder / helper_envs.MARKER).write_text(json.dumps(record))
    assert helper_envs.is_ready(spec)
    other = {**record, "creator": {**record["creator"], "prefix": "/usr"}}
    (folder / helper_envs.MARKER).write_text(json.dumps(other))
    assert not helper_envs.is_ready(spec)
    changed = helper_envs.HelperEnv(name="probe", requirements=("probe==2",))
    (folder / helper_envs.MARKER).write_text(json.dumps(record))
    assert not helper_envs.is_ready(changed)
