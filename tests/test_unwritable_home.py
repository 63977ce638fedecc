"""Every writer of the home when it is read-only or full ends in a NotWritableError naming the path and
the variable that moves it: the CPU probe's verdicts and the default model's conversion (which also leaves
nothing behind when the disk fills up while it converts). The damaged model of the home and the damaged
cpu-probe.json are tested in tests/test_random_moe.py and tests/test_cpu_backend.py."""
from __future__ import annotations

import errno
import os
import subprocess

import pytest
from home_damage import home, Unwritable, unwritable

import edge
from edge.core.files import NotWritableError


def test_the_simulated_home_refuses_what_a_read_only_one_does(tmp_path, monkeypatch):
    refusal = Unwritable("read-only", monkeypatch)
    (tmp_path / "home" / "kept").mkdir(parents=True)
    (tmp_path / "home" / "kept" / "file").write_text("kept")
    refusal.apply(tmp_path / "home")
    kept = tmp_path / "home" / "kept" / "file"
    for write in (lambda: open(tmp_path / "home" / "new", "w"), lambda: (tmp_path / "home" / "new").write_text(""),
                  lambda: os.makedirs(tmp_path / "home" / "a" / "b"), lambda: os.remove(kept),
                  lambda: os.open(tmp_path / "home" / "new", os.O_CREAT | os.O_WRONLY),
                  lambda: os.replace(kept, tmp_path / "elsewhere")):
        with pytest.raises(OSError) as raised:
            write()
        assert raised.value.errno == errno.EROFS
    os.makedirs(tmp_path / "home" / "kept", exist_ok=True)  # an existing folder is no write
    assert kept.read_text() == "kept"
    (tmp_path / "outside").write_text("written")  # nothing else is refused



# ------------------------------------------------------------------------------------ the CPU probe


def test_a_probe_verdict_the_home_cannot_take_is_an_error_naming_the_file(home, monkeypatch, unwritable):
    from kernels.cpu import cpu_probe

    monkeypatch.setattr(cpu_probe, "_verdicts", {})
    monkeypatch.setattr(cpu_probe, "target_features", lambda: {"avx2": True})
    monkeypatch.setattr(cpu_probe.subprocess, "run", lambda *args, **kwargs: subprocess.CompletedProcess(
        args, 0, stdout="avx2 ok\n", stderr=""))
    unwritable.apply(home)
    for _ in range(2):  # not kept in the process either: every load says it
        with pytest.raises(NotWritableError) as raised:
            cpu_probe.runs("avx2")
        assert str(raised.value) == unwritable.message(home / "cpu-probe.json")
    assert not (home / "cpu-probe.json").exists()


# ----------------------------------------------------------------------------- the default model


@pytest.fixture
def tiny_default_model(tiny_zoo, monkeypatch) -> str:
    """The default model's source replaced by a tiny model (its conversion takes a second)."""
    import edge.home

    source = tiny_zoo.hf_folder("llama_mha")
    monkeypatch.setattr(edge.home, "default_model_gguf", lambda: source)
    return source


def test_the_default_model_in_a_home_that_refuses_writes_is_an_error_naming_the_folder(
        home, tiny_default_model, unwritable, capsys):
    import edge.cli
    from edge.home import DEFAULT_MODEL_NAME, default_model_checkpoint

    unwritable.apply(home)
    checkpoint = home / "models" / DEFAULT_MODEL_NAME
    with pytest.raises(NotWritableError) as raised:
        default_model_checkpoint(progress=False)
    assert str(raised.value) == unwritable.message(checkpoint)
    capsys.readouterr()
    assert edge.cli.main(["generate", "hello", "--max-new-tokens", "1"]) == 2
    assert capsys.readouterr().err == f"error: {unwritable.message(checkpoint)}\n"


def test_a_disk_that_fills_up_while_the_default_model_converts_is_an_error_and_leaves_nothing(
        home, tiny_default_model, monkeypatch):
    from converters.safetensors_io import SafetensorsWriter
    from edge.home import DEFAULT_MODEL_NAME, default_model_checkpoint

    real_write, calls = SafetensorsWriter.write, []

    def write_until_full(self, name, array):
        calls.append(name)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(self, name, array)

    monkeypatch.setattr(SafetensorsWriter, "write", write_until_full)
    checkpoint = home / "models" / DEFAULT_MODEL_NAME
    with pytest.raises(NotWritableError) as raised:
        default_model_checkpoint(progress=False)
    assert str(raised.value) == (f"cannot write {checkpoint}: no space left on device; free some space there or "
                                 f"set ZLLM_EDGE_HOME to a folder on another disk")
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == [f"{DEFAULT_MODEL_NAME}.lock"]
    monkeypatch.setattr(SafetensorsWriter, "write", real_write)  # space again: it converts
    assert default_model_checkpoint(progress=False) == str(checkpoint)


# ----------------------------------------------------------------------- what a command writes elsewhere


def test_a_report_or_predictor_file_a_folder_cannot_take_is_an_error_naming_the_file(tmp_path, unwritable):
    """Outputs outside the home (a bench report, a plot, a checkpoint's predictor.json) name the file and
    what to do instead; nothing is left half-written."""
    from edge.bench import emit_report
    from streaming.predictor import SignalWeights, write_predictor_file

    folder = tmp_path / "out"
    folder.mkdir()
    unwritable.apply(folder)
    reason = Unwritable.REASONS[unwritable.kind]
    with pytest.raises(NotWritableError, match=f"^cannot write {folder / 'report.json'}: {reason}; choose a file "
                                               "in a writable folder with free space$"):
        emit_report("table", {"a": 1}, str(folder / "report.json"))
    with pytest.raises(NotWritableError, match=f"^cannot write {folder / 'predictor.json'}: {reason}; calibrate "
                                               "with --no-save"):
        write_predictor_file(str(folder), SignalWeights.default(), {"tokens": 1})
    unwritable.restore()
    assert os.listdir(folder) == []
