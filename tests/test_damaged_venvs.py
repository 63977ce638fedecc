"""Helper virtualenvs (devices/helper_envs.py; their package is a wheel made here, installed offline)
when they are damaged or cannot be written: a damaged env is found before it is used, said and built again;
a venvs folder, a provider env or a peer env that cannot be written is an error naming it, or an
unavailable peer."""
from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from home_damage import GARBAGE, REPO, home, unwritable

from devices import helper_envs
from edge.core.files import NotWritableError


PACKAGE_SOURCE = b"VALUE = 42\n"


def write_wheel(folder: Path) -> Path:
    """A wheel of the package zllm_probe_pkg (one module), for pip to install without a network."""
    files = {"zllm_probe_pkg/__init__.py": PACKAGE_SOURCE,
             "zllm_probe_pkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: zllm-probe-pkg\nVersion: 1.0\n",
             "zllm_probe_pkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                                                   b"Tag: py3-none-any\n"}

    def record(name: str, data: bytes) -> str:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        return f"{name},sha256={digest},{len(data)}"

    wheel = folder / "zllm_probe_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        lines = [*(record(name, data) for name, data in files.items()), "zllm_probe_pkg-1.0.dist-info/RECORD,,"]
        archive.writestr("zllm_probe_pkg-1.0.dist-info/RECORD", "\n".join(lines))
    return wheel


@pytest.fixture(scope="module")
def built_env(tmp_path_factory) -> tuple[helper_envs.HelperEnv, Path]:
    """A helper environment built by ensure_env (pip installs the wheel offline), once for the module:
    (its spec, the folder of environments it is in)."""
    venvs = tmp_path_factory.mktemp("built-venvs")
    spec = helper_envs.HelperEnv(name="probe-env", requirements=(str(write_wheel(venvs)),),
                                 pip_args=("--no-index", "--no-deps"), import_check="import zllm_probe_pkg")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(helper_envs.VENVS_VARIABLE, str(venvs))
        helper_envs.ensure_env(spec)
    return spec, venvs


@pytest.fixture
def env_copy(built_env, tmp_path, monkeypatch) -> tuple[helper_envs.HelperEnv, Path]:
    """A copy of the built environment of this test's own (spec, its folder)."""
    spec, venvs = built_env
    monkeypatch.setenv(helper_envs.VENVS_VARIABLE, str(tmp_path / "venvs"))
    folder = helper_envs.env_folder(spec)
    shutil.copytree(venvs / folder.name, folder, symlinks=True)
    assert helper_envs.is_ready(spec) and helper_envs.env_damage(spec) is None
    return spec, folder


def package_file(folder: Path) -> Path:
    return helper_envs.site_packages_in(folder) / "zllm_probe_pkg" / "__init__.py"


def replace_python(folder: Path, mode: int | None) -> None:
    """Remove the environment's python (a link to this interpreter: never chmod it), or put a file of
    `mode` in its place."""
    python = helper_envs.python_in(folder)
    python.unlink()
    if mode is not None:
        python.write_text("")
        python.chmod(mode)


ENV_DAMAGE = {
    "python missing": (lambda folder: replace_python(folder, None), "its python {python} is missing"),
    "python not executable": (lambda folder: replace_python(folder, 0o644), "its python {python} is not executable"),
    "a package file cut short": (lambda folder: os.truncate(package_file(folder), 3),
                                 "package zllm_probe_pkg-1.0 is half-installed: {module} has 3 bytes, its RECORD says "
                                 f"{len(PACKAGE_SOURCE)}"),
    "a package file of other bytes": (lambda folder: package_file(folder).write_bytes(b"VALUE = 41\n"),
                                      "package zllm_probe_pkg-1.0 is damaged: {module} is not the file its RECORD "
                                      "lists (its sha256 differs)"),
    "a package file missing": (lambda folder: package_file(folder).unlink(),
                               "package zllm_probe_pkg-1.0 is half-installed: {module} is missing"),
    "a package without its RECORD": (
        lambda folder: (helper_envs.site_packages_in(folder) / "zllm_probe_pkg-1.0.dist-info" / "RECORD").unlink(),
        "package zllm_probe_pkg-1.0 is half-installed: {site}/zllm_probe_pkg-1.0.dist-info/RECORD is missing"),
    "a RECORD of other bytes": (
        lambda folder: (helper_envs.site_packages_in(folder) / "zllm_probe_pkg-1.0.dist-info" / "RECORD").write_bytes(
            GARBAGE),
        "package zllm_probe_pkg-1.0 is damaged: {site}/zllm_probe_pkg-1.0.dist-info/RECORD cannot be read ('utf-8' "
        "codec can't decode byte 0x80 in position 0: invalid start byte)"),
    "the inheriting .pth missing": (
        lambda folder: (helper_envs.site_packages_in(folder) / helper_envs.INHERIT_PTH).unlink(),
        "{site}/" + helper_envs.INHERIT_PTH + " is missing or does not say what this interpreter's environment "
                                              "inherits"),
    "marker missing": (lambda folder: (folder / helper_envs.MARKER).unlink(),
                       f"its build did not finish: {helper_envs.MARKER} is missing"),
    "marker of other bytes": (lambda folder: (folder / helper_envs.MARKER).write_bytes(b"{\"requirements"),
                              "{marker} cannot be read (Unterminated string starting at: line 1 column 2 (char 1))"),
}


@pytest.mark.parametrize("damage", list(ENV_DAMAGE))
def test_a_damaged_helper_env_is_found_before_it_is_used(env_copy, damage):
    spec, folder = env_copy
    damage_env, said = ENV_DAMAGE[damage]
    damage_env(folder)
    site = helper_envs.site_packages_in(folder)
    assert not helper_envs.is_ready(spec)
    assert helper_envs.env_damage(spec) == said.format(python=helper_envs.python_in(folder), site=site,
                                                       module=package_file(folder), marker=folder / helper_envs.MARKER)


def test_a_damaged_helper_env_is_said_and_built_again(env_copy, capsys):
    spec, folder = env_copy
    os.truncate(package_file(folder), 3)
    capsys.readouterr()
    python = helper_envs.ensure_env(spec)
    assert capsys.readouterr().err == (
        f"helper environment {folder} is damaged (package zllm_probe_pkg-1.0 is half-installed: {package_file(folder)} "
        f"has 3 bytes, its RECORD says {len(PACKAGE_SOURCE)}); building it again\n")
    assert helper_envs.is_ready(spec)
    result = subprocess.run([str(python), "-c", "import zllm_probe_pkg; print(zllm_probe_pkg.VALUE)"],
                            capture_output=True, text=True)
    assert result.stdout == "42\n", result.stderr


def test_an_env_built_from_another_spec_is_stale_not_damaged(env_copy):
    spec, folder = env_copy
    changed = helper_envs.HelperEnv(name=spec.name, requirements=spec.requirements, pip_args=("--no-index",))
    assert helper_envs.env_damage(changed) is None and not helper_envs.is_ready(changed)


def test_a_venvs_folder_that_refuses_writes_is_an_error_naming_it_and_its_variable(tmp_path, monkeypatch, unwritable):
    venvs = tmp_path / "venvs"
    monkeypatch.setenv(helper_envs.VENVS_VARIABLE, str(venvs))
    unwritable.apply(venvs)
    spec = helper_envs.HelperEnv(name="probe-env", requirements=("zllm-probe-pkg==1.0",))
    with pytest.raises(helper_envs.HelperEnvNotWritable) as raised:
        helper_envs.ensure_env(spec)
    assert str(raised.value) == unwritable.message(helper_envs.env_folder(spec), helper_envs.VENVS_VARIABLE)
    assert isinstance(raised.value, NotWritableError) and isinstance(raised.value, helper_envs.HelperEnvUnavailable)


def test_a_provider_env_in_a_home_that_refuses_writes_is_an_error_naming_the_home(home, monkeypatch, unwritable):
    from devices.npu import provider_envs

    monkeypatch.delenv(helper_envs.VENVS_VARIABLE, raising=False)
    unwritable.apply(home)
    with pytest.raises(provider_envs.ProviderEnvNotWritable) as raised:
        provider_envs.provider_env_python("openvino")
    assert str(raised.value) == unwritable.message(provider_envs.provider_env_folder("openvino"))
    assert isinstance(raised.value, NotWritableError)


def test_a_peer_env_that_cannot_be_written_is_reported_as_an_unavailable_peer(tmp_path, monkeypatch, unwritable):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_envs
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    venvs = tmp_path / "venvs"
    monkeypatch.setenv(helper_envs.VENVS_VARIABLE, str(venvs))
    unwritable.apply(venvs)
    with pytest.raises(bench_envs.PeerUnavailable) as raised:
        bench_envs.ensure_env(bench_envs.ORT_GENAI, progress=None)
    assert isinstance(raised.value, NotWritableError)
    assert str(raised.value) == unwritable.message(helper_envs.env_folder(bench_envs.ORT_GENAI),
                                                   helper_envs.VENVS_VARIABLE)


def test_digests_are_computed_again_only_for_files_that_changed(env_copy, monkeypatch):
    spec, folder = env_copy
    assert (folder / helper_envs.VERIFIED).is_file()  # written by the check that found the copy whole
    hashed = []
    real = helper_envs._digest_matches
    monkeypatch.setattr(helper_envs, "_digest_matches", lambda location, listed: hashed.append(location) or
                        real(location, listed))
    assert helper_envs.env_damage(spec) is None and hashed == []
    package_file(folder).write_bytes(PACKAGE_SOURCE)  # the same bytes again: a new mtime
    assert helper_envs.env_damage(spec) is None and hashed == [package_file(folder)]
