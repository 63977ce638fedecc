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
cleared and built again. Before one is reused it is checked (env_damage): its python is there and
executable, the .pth that makes it inherit says what it should, and every file its own packages'
RECORDs list is there with that size and sha256 (a file's digest is computed again only when its size or
mtime changed since it last matched: VERIFIED keeps those); a damaged one is said in one line on stderr and
built again. pip's output goes to <env>/install.log; a failed build raises HelperEnvUnavailable with
the log's last lines, a finished one whose import check fails HelperEnvBroken, and a folder that
cannot be written (read-only, full) HelperEnvNotWritable, which names it and the variable that moves it.
"""
from __future__ import annotations

import base64
import hashlib
import importlib.metadata
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

from edge.core.files import NotWritableError, is_not_writable, not_writable, write_atomically
from kernels.cache_home import HOME_VARIABLE, zllm_home

MARKER = "zllm-helper-env.json"
VERIFIED = "zllm-verified-files.json"  # {path: [size, mtime_ns]} of package files whose digest matched RECORD
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


class HelperEnvNotWritable(HelperEnvUnavailable, NotWritableError):
    """The folder of helper virtualenvs cannot be written (read-only, full): a HelperEnvUnavailable to
    the callers that report why an environment is missing, a ZllmError naming the folder and the
    variable that moves it to everyone else."""


def _not_writable(folder: Path, error: OSError) -> HelperEnvNotWritable:
    variable = VENVS_VARIABLE if os.environ.get(VENVS_VARIABLE) else HOME_VARIABLE
    return HelperEnvNotWritable(str(not_writable(folder, error, variable)))


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


def site_packages_in(folder: Path) -> Path:
    """A helper environment's own site-packages (it runs this interpreter's Python version)."""
    if os.name == "nt":
        return folder / "Lib" / "site-packages"
    return folder / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


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
        if is_not_writable(exc):
            raise _not_writable(folder, exc) from None
        raise HelperEnvUnavailable(f"cannot create a virtualenv at {folder}: {exc}") from exc
    python = python_in(folder)
    if inherit:
        own = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                             capture_output=True, text=True)
        if own.returncode:
            raise HelperEnvUnavailable(f"the new virtualenv's python {python} does not start: {own.stderr[-400:]}")
        try:
            Path(own.stdout.strip(), INHERIT_PTH).write_text(inherit_line())
        except OSError as exc:
            if is_not_writable(exc):
                raise _not_writable(folder, exc) from None
            raise
    return python


def inherit_line() -> str:
    """The .pth line that makes a helper see this interpreter's packages after its own. One line:
    site runs a .pth line that starts with "import"; addsitedir processes each folder's own .pth files
    too (editable installs), where a path line would only be appended."""
    calls = "; ".join(f"site.addsitedir({d!r})" for d in inherited_site_dirs())
    return f"import site; {calls}\n"


def marker_record(spec: HelperEnv) -> dict:
    """What the marker of `spec`'s environment holds when it was built by this interpreter."""
    return {"requirements": list(spec.requirements), "pip_args": list(spec.pip_args),
            "build_env": dict(spec.build_env), "inherit": spec.inherit,
            "creator": {"prefix": sys.prefix, "executable": sys.executable,
                        "python": platform.python_version()},
            "inherited_site_dirs": inherited_site_dirs() if spec.inherit else []}


def is_ready(spec: HelperEnv) -> bool:
    """Whether `spec`'s environment is built, from what it asks for, and undamaged."""
    folder = env_folder(spec)
    try:
        recorded = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return recorded == marker_record(spec) and env_damage(spec) is None


def env_damage(spec: HelperEnv) -> str | None:
    """What is damaged in `spec`'s environment (None: nothing found). One that is not there is not
    damaged, nor is one built from something else (it is rebuilt as stale); one whose build never
    finished (no marker) is."""
    folder = env_folder(spec)
    if not folder.is_dir():
        return None
    marker = folder / MARKER
    try:
        recorded = json.loads(marker.read_text())
    except FileNotFoundError:
        return f"its build did not finish: {MARKER} is missing"
    except (OSError, ValueError, RecursionError) as exc:
        return f"{marker} cannot be read ({exc})"
    if recorded != marker_record(spec):
        return None
    python = python_in(folder)
    if not python.exists():  # (a link to an interpreter that is gone counts)
        return f"its python {python} is missing"
    if not os.access(python, os.X_OK):
        return f"its python {python} is not executable"
    own = site_packages_in(folder)
    if spec.inherit:
        pth = own / INHERIT_PTH
        try:
            inherits = pth.read_text() == inherit_line()
        except OSError:
            inherits = False
        if not inherits:
            return f"{pth} is missing or does not say what this interpreter's environment inherits"
    return _package_damage(own, folder / VERIFIED)


def _package_damage(site_packages: Path, verified_path: Path) -> str | None:
    """A file an installed package's RECORD lists that is missing, of another size (an install cut short, a
    file removed or truncated since) or of other bytes (overwritten); None when every one is as listed."""
    try:
        verified = json.loads(verified_path.read_text())
    except (OSError, ValueError, RecursionError):
        verified = {}
    if not isinstance(verified, dict):
        verified = {}
    damage, checked = _record_damage(site_packages, verified)
    if damage is None and checked != verified:
        try:  # a folder that cannot take it only means the digests are computed again next time
            write_atomically(verified_path, lambda f: json.dump(checked, f))
        except OSError:
            pass
    return damage


def _record_damage(site_packages: Path, verified: dict) -> tuple[str | None, dict]:
    """(the first damage found or None, {path: [size, mtime_ns]} of every file found as listed)."""
    checked = {}
    for info in sorted(site_packages.glob("*.dist-info")):
        dist, name = importlib.metadata.PathDistribution(info), info.name.removesuffix(".dist-info")
        try:
            files = dist.files
        except (ValueError, TypeError) as exc:  # (importlib's reading of a RECORD that is no CSV of 3 columns)
            return f"package {name} is damaged: {info / 'RECORD'} cannot be read ({exc})", checked
        if files is None:
            return f"package {name} is half-installed: {info / 'RECORD'} is missing", checked
        for file in files:
            if file.size is None:  # RECORD itself, and the bytecode Python writes again when it must
                continue
            location = Path(dist.locate_file(file))
            try:
                status = location.stat()
            except OSError:
                return f"package {name} is half-installed: {location} is missing", checked
            if status.st_size != file.size:
                return (f"package {name} is half-installed: {location} has {status.st_size} bytes, its RECORD says "
                        f"{file.size}"), checked
            stamp = [status.st_size, status.st_mtime_ns]
            unverified = file.hash is not None and verified.get(str(location)) != stamp
            if unverified and not _digest_matches(location, file.hash):
                return (f"package {name} is damaged: {location} is not the file its RECORD lists (its "
                        f"{file.hash.mode} differs)"), checked
            checked[str(location)] = stamp
    return None, checked


def _digest_matches(location: Path, listed) -> bool:
    """Whether a file's digest is RECORD's (urlsafe base64 without padding, as wheels write it)."""
    try:
        digest = hashlib.new(listed.mode)
    except ValueError:  # an algorithm this Python lacks: nothing to compare with
        return True
    try:
        with open(location, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return False
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode() == listed.value


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
    damage = env_damage(spec)
    if damage is not None:
        print(f"helper environment {folder} is damaged ({damage}); building it again", file=sys.stderr)
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
    except OSError as exc:
        if is_not_writable(exc):
            raise _not_writable(folder, exc) from None
        raise
    if done.returncode:
        raise HelperEnvUnavailable(f"cannot install {requirements} into {folder} (pip exit {done.returncode}); "
                                   f"last lines of {log_path}:\n{_log_tail(log_path)}")
    if spec.import_check:
        check = subprocess.run([str(python), "-c", spec.import_check], capture_output=True, text=True, env=env)
        if check.returncode:
            raise HelperEnvBroken(f"{folder} was built but `{spec.import_check}` fails there:\n"
                                  f"{check.stderr[-2000:]}")
    try:
        (folder / MARKER).write_text(json.dumps(marker_record(spec), indent=1))
    except OSError as exc:
        if is_not_writable(exc):
            raise _not_writable(folder, exc) from None
        raise
    if progress:
        progress(f"helper environment {folder.name} ready after {time.perf_counter() - started:.0f} s")
    return python
