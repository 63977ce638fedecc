"""Helper virtualenvs: packages that cannot share the project's Python environment.

onnxruntime-openvino replaces the onnxruntime package, onnxruntime-qnn pins an onnxruntime of its own,
and some benchmark peers (onnxruntime-genai, a portable llama-cpp-python build) are kept out of the
project's environment. Each gets a helper virtualenv holding only its own packages and, when it
inherits (the default), every other package of the interpreter that created it: numpy, onnx, torch
and this project come from there.

Inheriting: `python -m venv --system-site-packages` run from a virtualenv exposes the *base*
interpreter's site-packages, not the virtualenv's, so a helper made from a project venv could not
import onnx or torch. A helper is therefore made without system site packages and gets one .pth file
that calls site.addsitedir() on each site-packages directory of the creating interpreter
(site.getsitepackages(), plus its user site when it enables one). addsitedir also processes those
directories' own .pth files, which is how an editable install of this project (a __editable__
finder) is found; a plain path line would not do that. Python reads the .pth after the helper's own
site-packages is on sys.path, so the helper's packages come first (onnxruntime-openvino's onnxruntime
shadows the creator's). Paths the creator has only through PYTHONPATH are not inherited: callers that
run this project from a source tree pass PYTHONPATH themselves.

Location, one rule for every helper environment: $ZLLM_EDGE_VENVS/<name>-<tag> when that variable is
set, else <home>/venvs/<name>-<tag>, where <home> is the project's home (kernels/cache_home.py:
ZLLM_EDGE_HOME, else $XDG_CACHE_HOME/zllm-edge, else ~/.cache/zllm-edge). <tag> is a hash of the
creating interpreter's sys.prefix, so two interpreters sharing one cache each get their own
environment instead of rebuilding each other's. The tests give every session a fresh ZLLM_EDGE_HOME
but point ZLLM_EDGE_VENVS at the user's own venvs folder (tests/conftest.py): a helper costs minutes of
pip, paid once per machine rather than once per test session.

Reuse: a marker file records what the environment was built from (requirements, pip arguments and
environment, the creating interpreter and the site directories it inherits). An environment whose
marker is missing (an interrupted build, one made by an older version of this module) or differs is
cleared and built again. pip's output goes to <env>/install.log; a failed build raises
HelperEnvUnavailable with the log's last lines, a finished one whose import check fails HelperEnvBroken.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import site
import subprocess
import sys
import time
import venv
from dataclasses import dataclass, field
from pathlib import Path

from kernels.cache_home import zllm_home

MARKER = "zllm-helper-env.json"
# Python reads a site-packages folder's .pth files in name order: this one sorts after those the
# helper's own packages install, so their entries stay ahead of the inherited ones.
INHERIT_PTH = "zz-zllm-edge-inherit.pth"
VENVS_VARIABLE = "ZLLM_EDGE_VENVS"
LOG_TAIL_LINES = 12


class HelperEnvUnavailable(RuntimeError):
    """A helper virtualenv cannot be built here (venv or pip failed, no network); the message says
    which step failed and why."""


class HelperEnvBroken(RuntimeError):
    """A helper virtualenv was built but its import check fails there: what it installed or inherits
    does not work together, which another attempt would not change."""


@dataclass(frozen=True)
class HelperEnv:
    name: str
    requirements: tuple[str, ...]
    pip_args: tuple[str, ...] = ()
    build_env: dict = field(default_factory=dict)  # environment variables for pip (e.g. CMAKE_ARGS)
    inherit: bool = True  # see the creating interpreter's packages (module docstring)
    import_check: str = ""  # a Python statement that must run in the finished environment
    pip_timeout_s: float = 900.0


def helper_envs_dir() -> Path:
    explicit = os.environ.get(VENVS_VARIABLE)
    return Path(os.path.abspath(explicit)) if explicit else Path(zllm_home()) / "venvs"


def creator_tag() -> str:
    return hashlib.sha256(sys.prefix.encode()).hexdigest()[:8]


def env_folder(spec: HelperEnv) -> Path:
    return helper_envs_dir() / f"{spec.name}-{creator_tag()}"


def python_in(folder: Path) -> Path:
    return folder / ("Scripts" if os.name == "nt" else "bin") / ("python.exe" if os.name == "nt" else "python")


def inherited_site_dirs() -> list[str]:
    """The site-packages folders of this interpreter that a helper it creates sees after its own."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def create_venv(folder: Path, inherit: bool = True, with_pip: bool = True) -> Path:
    """An empty virtualenv at `folder` (cleared first) that, with `inherit`, sees this interpreter's
    packages after its own; returns its python."""
    try:
        venv.EnvBuilder(clear=True, with_pip=with_pip, symlinks=os.name != "nt").create(folder)
    except subprocess.CalledProcessError as exc:  # ensurepip, its output as bytes
        output = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) else str(exc.output or "")
        raise HelperEnvUnavailable(f"cannot create a virtualenv at {folder}: {exc.cmd} exited {exc.returncode}: "
                                   f"{output[-400:]}") from exc
    except OSError as exc:
        raise HelperEnvUnavailable(f"cannot create a virtualenv at {folder}: {exc}") from exc
    python = python_in(folder)
    if inherit:
        dirs = inherited_site_dirs()
        own = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                             capture_output=True, text=True)
        if own.returncode:
            raise HelperEnvUnavailable(f"the new virtualenv's python {python} does not start: {own.stderr[-400:]}")
        # One line: site runs a .pth line that starts with "import"; addsitedir processes each folder's
        # own .pth files too (editable installs), where a path line would only be appended.
        calls = "; ".join(f"site.addsitedir({d!r})" for d in dirs)
        Path(own.stdout.strip(), INHERIT_PTH).write_text(f"import site; {calls}\n")
    return python


def marker_record(spec: HelperEnv) -> dict:
    """What the marker of `spec`'s environment holds when it was built by this interpreter."""
    return {"requirements": list(spec.requirements), "pip_args": list(spec.pip_args),
            "build_env": dict(spec.build_env), "inherit": spec.inherit,
            "creator": {"prefix": sys.prefix, "executable": sys.executable,
                        "python": platform.python_version()},
            "inherited_site_dirs": inherited_site_dirs() if spec.inherit else []}


def is_ready(spec: HelperEnv) -> bool:
    folder = env_folder(spec)
    try:
        recorded = json.loads((folder / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return recorded == marker_record(spec) and python_in(folder).exists()


def _log_tail(path: Path) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-LOG_TAIL_LINES:])
    except OSError:
        return "(no log)"


def ensure_env(spec: HelperEnv, progress=None) -> Path:
    """The python of `spec`'s helper environment, building it first when it is missing, incomplete or
    was built from something else (see the module docstring)."""
    folder = env_folder(spec)
    python = python_in(folder)
    if is_ready(spec):
        return python
    log_path = folder / "install.log"
    requirements = " ".join(spec.requirements)
    if progress:
        progress(f"building helper environment {folder} (pip install {requirements}); log: {log_path}")
    started = time.perf_counter()
    create_venv(folder, inherit=spec.inherit)
    env = {**os.environ, **spec.build_env, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
    env.pop("PYTHONPATH", None)  # the environment sees what its own site gives it, nothing else
    command = [str(python), "-m", "pip", "install", *spec.pip_args, *spec.requirements]
    try:
        with open(log_path, "w") as log:
            log.write(" ".join(command) + "\n" + json.dumps(spec.build_env) + "\n")
            log.flush()
            done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  timeout=spec.pip_timeout_s)
    except subprocess.TimeoutExpired:
        raise HelperEnvUnavailable(f"pip install {requirements} into {folder} did not finish within "
                                   f"{spec.pip_timeout_s:.0f} s; log: {log_path}") from None
    if done.returncode:
        raise HelperEnvUnavailable(f"cannot install {requirements} into {folder} (pip exit {done.returncode}); "
                                   f"last lines of {log_path}:\n{_log_tail(log_path)}")
    if spec.import_check:
        check = subprocess.run([str(python), "-c", spec.import_check], capture_output=True, text=True, env=env)
        if check.returncode:
            raise HelperEnvBroken(f"{folder} was built but `{spec.import_check}` fails there:\n"
                                  f"{check.stderr[-2000:]}")
    (folder / MARKER).write_text(json.dumps(marker_record(spec), indent=1))
    if progress:
        progress(f"helper environment {folder.name} ready after {time.perf_counter() - started:.0f} s")
    return python
