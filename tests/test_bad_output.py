"""Where `zllm-edge convert` may write, and what a failed or stopped conversion leaves: OUT is refused
when writing there would destroy a source, the working directory or a directory of other data; a
failure (full disk, unwritable place, a weight that cannot be quantized, SIGTERM) removes the staging
directory and the parent directories made for it, and its message names what went wrong.
Also: damaged manifests are refused by `inspect` and usage mistakes print one `error:` line.
"""
from __future__ import annotations

import errno
import json
import os
import signal
from pathlib import Path

import pytest
from test_bad_input import assert_nothing_written, run_cli, tiny_checkpoint, tiny_checkpoint_template, tiny_llama  # noqa: F401

import edge
from converters import convert as convert_module
from converters.convert import QuantPlan, convert
from converters.hf_source import HFSource
from converters.safetensors_io import SafetensorsWriter
from edge.core.errors import CheckpointError, ConversionError
from quant.checkpoint import MANIFEST_SHA256, canonical_sha256

INT8 = QuantPlan(weights="int8")


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


# ---------------------------------------------------------------------------- where OUT may be


def test_empty_out_is_refused(tiny_llama, capsys):
    assert run_cli(capsys, "convert", tiny_llama, "", "--force") == (
        2, "", "error: OUT is empty; name the directory the checkpoint should be written to\n")


def copied_source(tmp_path, model) -> Path:
    """A copy of a Hugging Face folder at tmp_path/hf, to write around."""
    source = Path(tmp_path / "hf")
    source.mkdir()
    for name, data in contents(model).items():
        (source / name).write_bytes(data)
    return source


def test_force_never_replaces_the_source(tmp_path, tiny_llama):
    source = copied_source(tmp_path, tiny_llama)
    before = contents(source)
    for out in (source, tmp_path):  # the source itself, and a directory holding it
        with pytest.raises(ConversionError) as raised:
            convert(str(source), str(out), INT8, force=True, progress=False)
        assert str(raised.value) == (f"{out}: writing the checkpoint there would replace the source {source}; "
                                     "choose another OUT")
    assert contents(source) == before


def test_out_inside_the_source_folder_is_refused(tmp_path, tiny_llama):
    source = copied_source(tmp_path, tiny_llama)
    before = contents(source)
    out = source / "converted"
    with pytest.raises(ConversionError) as raised:
        convert(str(source), str(out), INT8, progress=False)
    assert str(raised.value) == (f"{out} lies inside the source folder {source}; the checkpoint would be written "
                                 "into the model it is converted from: choose an OUT outside it")
    assert contents(source) == before and not out.exists()


def test_force_never_replaces_a_directory_of_other_data(tmp_path, tiny_llama):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(ConversionError) as raised:
        convert(str(tiny_llama), str(out), INT8, force=True, progress=False)
    assert str(raised.value) == (f"{out} is a directory that is not a zllm checkpoint; --force replaces only a "
                                 "checkpoint, a file or an empty directory: remove it yourself or choose another OUT")
    assert (out / "precious.txt").read_text() == "keep me"


def test_force_never_replaces_the_working_directory(tmp_path, tiny_llama, monkeypatch):
    out = tmp_path / "empty"
    (out / "inner").mkdir(parents=True)
    monkeypatch.chdir(out / "inner")
    with pytest.raises(ConversionError) as raised:
        convert(str(tiny_llama), str(out), INT8, force=True, progress=False)
    assert str(raised.value) == f"{out}: --force would replace the current directory; choose another OUT"


@pytest.mark.parametrize("kind", ["file", "symlink", "empty directory"])
def test_force_replaces_a_file_a_link_or_an_empty_directory_without_litter(tmp_path, tiny_llama, kind):
    out = tmp_path / "out"
    target = tmp_path / "target.txt"
    target.write_text("the link's target stays")
    if kind == "file":
        out.write_text("old")
    elif kind == "symlink":
        out.symlink_to(target)
    else:
        out.mkdir()
    convert(str(tiny_llama), str(out), INT8, force=True, progress=False)
    assert (out / "zllm.json").is_file() and not out.is_symlink()
    assert target.read_text() == "the link's target stays"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "target.txt"]


def test_unwritable_out_is_a_typed_error(tmp_path, tiny_llama):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker / "ckpt"  # its parent is a file
    with pytest.raises(ConversionError) as raised:
        convert(str(tiny_llama), str(out), INT8, progress=False)
    assert str(raised.value).startswith(f"cannot write the checkpoint {out}: ")
    assert str(raised.value).endswith("; choose an OUT in a writable directory")


# ---------------------------------------------------------------------- failures leave nothing


def test_a_full_disk_leaves_nothing_and_says_so(tmp_path, tiny_llama, monkeypatch):
    def disk_full(self, key, array):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)

    monkeypatch.setattr(SafetensorsWriter, "write", disk_full)
    out = tmp_path / "made" / "for" / "ckpt"
    with pytest.raises(ConversionError) as raised:
        convert(str(tiny_llama), str(out), INT8, progress=False)
    message = str(raised.value)
    assert message.startswith(f"converting {tiny_llama} into {out} failed: No space left on device (")
    assert message.endswith("); nothing was written")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the parents made for OUT are gone too


def test_an_unquantizable_weight_is_named(tmp_path, tiny_llama, monkeypatch):
    real_load = HFSource.load

    def load_with_nan(self, name):
        value = real_load(self, name)
        if name == "model.layers.1.mlp.up_proj.weight":
            value = value.copy()
            value[2, 5] = float("nan")
        return value

    monkeypatch.setattr(HFSource, "load", load_with_nan)
    out = tmp_path / "ckpt"
    with pytest.raises(ConversionError) as raised:
        convert(str(tiny_llama), str(out), INT8, progress=False)
    assert str(raised.value) == ("tensor model.layers.1.mlp.up_proj.weight (int8_sym_g32): the source holds a "
                                 "non-finite value (nan) at index [2, 5]; its weights are damaged: download or export "
                                 "the model again")
    assert_nothing_written(out)


def test_sigterm_leaves_nothing(tmp_path, tiny_llama, monkeypatch, capsys):
    real_encode = convert_module._encode
    calls = []

    def encode_then_terminate(*args, **kwargs):
        calls.append(None)
        if len(calls) == 4:
            os.kill(os.getpid(), signal.SIGTERM)  # what `timeout`, docker stop and systemd send
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(convert_module, "_encode", encode_then_terminate)
    out = tmp_path / "made" / "ckpt"
    handler_before = signal.getsignal(signal.SIGTERM)
    assert run_cli(capsys, "convert", tiny_llama, out, "--quiet") == (128 + signal.SIGTERM, "", "terminated\n")
    assert 4 <= len(calls) < 21
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is handler_before  # the CLI put the handler back


def test_a_killed_conversions_staging_is_swept_by_the_next(tmp_path, tiny_llama):
    """SIGKILL skips every clean-up: the next conversion to the same OUT removes the staging of a
    process that is gone, and leaves a live process's (a conversion running now) alone."""
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f".ckpt.partial-{int(gone.stdout)}-abc123"
    live = tmp_path / f".ckpt.partial-{os.getpid()}-def456"
    other = tmp_path / f".other.partial-{int(gone.stdout)}-ghi789"  # another destination's: not ours to judge
    for folder in (dead, live, other):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    convert(tiny_llama, os.fspath(tmp_path / "ckpt"), QuantPlan(weights="f32"), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name, "ckpt"])


# --------------------------------------------------------------------------- usage mistakes


@pytest.mark.parametrize("argv, message", [
    (["convert", "a", "b", "--group-size", "48"],
     "error: zllm-edge convert: argument --group-size: invalid choice: 48 (choose from 32, 64, 128) "
     "(see zllm-edge convert --help)\n"),
    (["generate"], "error: zllm-edge generate: the following arguments are required: [MODEL] PROMPT "
                   "(see zllm-edge generate --help)\n"),
])
def test_usage_mistakes_print_one_error_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        run_cli(capsys, *argv)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", message)


def test_moefy_value_that_is_neither_e_k_nor_a_source(tmp_path, tiny_llama, capsys):
    code, _, stderr = run_cli(capsys, "convert", "--moefy", "abc", tiny_llama, tmp_path / "out")
    assert (code, stderr) == (2, "error: --moefy 'abc' not understood; expected E:K (experts per layer : experts "
                                 "chosen per token), e.g. 16:13, or no value for the default\n")
    code, _, stderr = run_cli(capsys, "convert", "--moefy", tmp_path / "missing.gguf", tmp_path / "out")
    assert (code, stderr) == (2, f"error: {tmp_path / 'missing.gguf'} does not exist; SRC is a Hugging Face model "
                                 "folder or a .gguf file\n")


@pytest.mark.parametrize("option", ["--weights", "--ffn"])
def test_an_empty_format_is_refused_not_ignored(option, tmp_path, tiny_llama, capsys):
    code, _, stderr = run_cli(capsys, "convert", tiny_llama, tmp_path / "out", option, "")
    assert code == 2 and stderr.startswith("error: ") and "'' not understood" in stderr
    assert_nothing_written(tmp_path / "out")


# ------------------------------------------------------------------------- damaged manifests


@pytest.mark.parametrize("edit, problem", [
    (lambda m: m.pop("model"), "the 'model' entry should be an object, it is missing"),
    (lambda m: m.update(tensors=[]), "the 'tensors' entry should be an object, it is a list"),
    (lambda m: m.update(files="model.safetensors"), "the 'files' entry should be an object, it is a str"),
])
def test_inspect_and_load_refuse_a_manifest_missing_its_parts(tiny_checkpoint, capsys, edit, problem):
    manifest_path = tiny_checkpoint / "zllm.json"
    manifest = json.loads(manifest_path.read_text())
    edit(manifest)
    manifest_path.write_text(json.dumps(manifest))
    message = f"{manifest_path}: {problem}; the checkpoint is damaged, convert the model again"
    assert run_cli(capsys, "inspect", tiny_checkpoint) == (2, "", f"error: {message}\n")
    with pytest.raises(CheckpointError) as raised:
        edge.load(str(tiny_checkpoint))
    assert str(raised.value) == message


def test_a_manifest_edited_after_conversion_fails_its_own_sha256(tiny_checkpoint, capsys):
    """A changed digit of the model spec passes every structural check (it is still a valid spec that fits
    the weights); the manifest's sha256 of itself refuses it, in `inspect` and at load. The digest is of
    the canonical JSON, not of the file's bytes: written again with another indentation, it loads."""
    manifest_path = tiny_checkpoint / "zllm.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest[MANIFEST_SHA256] == canonical_sha256(manifest, MANIFEST_SHA256)
    manifest_path.write_text(json.dumps(manifest, indent=4))
    edge.load(str(tiny_checkpoint)).close()
    manifest["model"]["rope_theta"] = float(manifest["model"]["rope_theta"]) + 1.0
    manifest_path.write_text(json.dumps(manifest))
    message = (f"{manifest_path}: the manifest fails its sha256 check (manifest_sha256): it was edited or damaged "
               "after conversion; convert the model again")
    assert run_cli(capsys, "inspect", tiny_checkpoint) == (2, "", f"error: {message}\n")
    with pytest.raises(CheckpointError) as raised:
        edge.load(str(tiny_checkpoint))
    assert str(raised.value) == message


@pytest.mark.parametrize("digest", ["0" * 63, "A" * 64, 7, None])
def test_a_manifest_digest_that_is_not_one_is_refused(tiny_checkpoint, digest):
    manifest_path = tiny_checkpoint / "zllm.json"
    manifest = json.loads(manifest_path.read_text())
    manifest[MANIFEST_SHA256] = digest
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as raised:
        edge.load(str(tiny_checkpoint))
    assert str(raised.value).startswith(f"{manifest_path}: the manifest's manifest_sha256 is ")
    assert str(raised.value).endswith(", not a sha256 digest (64 lowercase hexadecimal digits); the checkpoint is "
                                      "damaged, convert the model again")


def test_a_manifest_written_before_its_digest_loads(tiny_checkpoint):
    """Checkpoints of format version 1 written before the manifest carried its sha256 load as before."""
    manifest_path = tiny_checkpoint / "zllm.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest[MANIFEST_SHA256]
    manifest_path.write_text(json.dumps(manifest))
    with edge.load(str(tiny_checkpoint)) as model:
        assert model.spec.num_hidden_layers == manifest["model"]["num_hidden_layers"]


def test_inspect_checks_the_files_the_manifest_lists(tiny_checkpoint, capsys):
    (tiny_checkpoint / "model.safetensors").unlink()
    assert run_cli(capsys, "inspect", tiny_checkpoint) == (
        2, "", f"error: {tiny_checkpoint}: weight file model.safetensors is missing; convert the model again\n")
    (tiny_checkpoint / "model.safetensors").mkdir()
    assert run_cli(capsys, "inspect", tiny_checkpoint) == (
        2, "", f"error: {tiny_checkpoint}: weight file model.safetensors is not a file; convert the model again\n")


def test_a_version_of_the_wrong_type_is_shown_as_it_is(tiny_checkpoint, capsys):
    manifest_path = tiny_checkpoint / "zllm.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["format_version"] = "1"
    manifest_path.write_text(json.dumps(manifest))
    assert run_cli(capsys, "inspect", tiny_checkpoint) == (
        2, "", f"error: {tiny_checkpoint}: zllm format version '1' is not supported (this zllm-edge reads "
               "version 1); convert the model again with this version of zllm-edge\n")


def test_an_unreadable_source_is_a_typed_error(tmp_path, monkeypatch):
    from converters import gguf_source

    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")

    def refuse(self, path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(gguf_source.GGUFSource, "__init__", refuse)
    with pytest.raises(ConversionError) as raised:
        convert(str(source), str(tmp_path / "out"), INT8, progress=False)
    assert str(raised.value) == (f"{source}: cannot read {source}: Permission denied; check the file's permissions "
                                 "and the disk")
    assert_nothing_written(tmp_path / "out")
