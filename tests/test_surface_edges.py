"""Regression tests for the user-facing surface on inputs the other tests do not show: extreme sampling
parameters, argument types of saved sessions and edge.load, a refused load that leaves nothing open,
chat messages whose content a string-concatenating template cannot take, CLI arguments that must be
refused before a default model is built, and outputs written all or nothing.

Tiny models (no tokenizer) where ids suffice; SmolLM2 (the conftest fixture) for the chat template,
with max_new_tokens=0 so that nothing runs through the slow reference backend.
"""
from __future__ import annotations

import io
import json
import os
import sys
import warnings

import numpy as np
import pytest
from test_api_edges import assert_cli_error, dense_path, llama, moe_path, no_default_models  # noqa: F401
from test_cli import run_cli
from tiny_models import random_prompt

import edge
import edge.api
import edge.cli
from devices.base import BACKENDS
from devices.reference import ReferenceBackend, as_float32
from edge.core.errors import InvalidArgumentError, ZllmError
from edge.sampling import SamplingParams, sample_token
from edge.tokenizer import TokenizerError

# ---------------------------------------------------------------------------------- sampling extremes

@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-300, 1e-30])
def test_a_tiny_temperature_is_greedy_not_nan(temperature):
    logits = np.random.default_rng(7).standard_normal(1000) * 20
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow / invalid-value warnings either
        for seed in range(5):
            token = sample_token(logits, SamplingParams(temperature=temperature), np.random.default_rng(seed))
            assert token == int(np.argmax(logits))


def test_a_tiny_temperature_generates_the_greedy_tokens(llama):
    prompt = random_prompt(5)
    greedy = llama.generate(prompt, max_new_tokens=4)
    list(greedy)
    tiny = llama.generate(prompt, max_new_tokens=4, temperature=5e-324, seed=3)
    list(tiny)
    assert tiny.result.tokens == greedy.result.tokens


def test_top_p_zero_keeps_only_the_most_likely_token(llama):
    """As llama.cpp's and transformers' top-p (min_keep 1): not refused, and greedy whatever the seed."""
    logits = np.random.default_rng(1).standard_normal(500)
    for seed in range(10):
        assert sample_token(logits, SamplingParams(temperature=2.0, top_p=0.0),
                            np.random.default_rng(seed)) == int(np.argmax(logits))
    prompt = random_prompt(5)
    greedy = llama.generate(prompt, max_new_tokens=4)
    list(greedy)
    sampled = llama.generate(prompt, max_new_tokens=4, temperature=1.5, top_p=0, seed=11)
    list(sampled)
    assert sampled.result.tokens == greedy.result.tokens


@pytest.mark.parametrize("seed", [None, -1])
def test_a_random_seed_is_reported_and_repeats_the_run(llama, seed):
    """As llama.cpp prints the seed it drew: a run with a random seed can be repeated from result.seed."""
    prompt = random_prompt(5)
    drawn = llama.generate(prompt, max_new_tokens=6, temperature=1.5, seed=seed)
    list(drawn)
    assert isinstance(drawn.result.seed, int) and 0 <= drawn.result.seed < 2**32
    again = llama.generate(prompt, max_new_tokens=6, temperature=1.5, seed=drawn.result.seed)
    list(again)
    assert again.result.tokens == drawn.result.tokens and again.result.seed == drawn.result.seed


def test_generate_json_reports_the_seed(capsys, smollm2_checkpoint):
    code, out, err = run_cli(capsys, "generate", smollm2_checkpoint, "Hi", "--max-new-tokens", 1, "--seed", 42,
                             "--temperature", 0.7, "--json", "--quiet")
    assert code == 0, err
    assert json.loads(out)["seed"] == 42


def test_stop_strings_on_a_model_without_a_tokenizer_are_refused(llama):
    """They could never match (there is no text): refused, not silently ignored."""
    with pytest.raises(InvalidArgumentError) as error:
        llama.generate(random_prompt(3), stop=["\n"])
    assert str(error.value) == (f"stop strings need text, and {llama.path} has no tokenizer; stop on token ids "
                                "instead: iterate generation.steps() and close() it at the ids you want")
    assert not llama._sessions


# ---------------------------------------------------------------------------------- argument types

@pytest.mark.parametrize("capacity, message", [
    ("10", "capacity must be a positive integer, got '10'"),
    (1.5, "capacity must be a positive integer, got 1.5"),
    (0, "capacity must be a positive integer, got 0"),
])
def test_a_restored_session_capacity_is_checked_as_an_argument(llama, tmp_path, capacity, message):
    with llama.session(capacity=8) as session:
        session.prefill([3, 4, 5])
        session.save(tmp_path / "s.zsession")
    with pytest.raises(InvalidArgumentError) as error:
        llama.load_session(tmp_path / "s.zsession", capacity=capacity)
    assert str(error.value) == message
    assert not llama._sessions


def test_session_paths_must_be_paths(llama):
    with llama.session(capacity=4) as session:
        with pytest.raises(InvalidArgumentError) as error:
            session.save(None)
        assert str(error.value) == "path must be a file path (a str or os.PathLike), got None"
    with pytest.raises(InvalidArgumentError) as error:
        llama.load_session(None)
    assert str(error.value) == "path must be a file path (a str or os.PathLike), got None"


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_cache="f8"), "kv_cache 'f8' is unknown; choose one of f32, f16, int8"),
    (dict(kv_cache=None), "kv_cache None is unknown; choose one of f32, f16, int8"),
])
def test_a_bad_kv_cache_is_an_argument_error_before_the_checkpoint_opens(dense_path, monkeypatch, kwargs, message):
    monkeypatch.setattr(edge.api, "open_checkpoint", lambda *a, **k: pytest.fail("the checkpoint was opened"))
    with pytest.raises(InvalidArgumentError) as error:
        edge.load(dense_path, **kwargs)
    assert str(error.value) == message


def test_load_needs_a_path():
    with pytest.raises(InvalidArgumentError) as error:
        edge.load(None)
    assert str(error.value) == "path must be a checkpoint directory (a str or os.PathLike), got None"


def test_a_refused_load_closes_the_checkpoint(dense_path, monkeypatch):
    opened = []
    real = edge.api.open_checkpoint

    def spy(*args, **kwargs):
        opened.append(real(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(edge.api, "open_checkpoint", spy)
    with pytest.raises(ZllmError, match="expert_strategy 'ondemand' applies to Mixture-of-Experts models"):
        edge.load(dense_path, expert_strategy="ondemand")
    assert len(opened) == 1 and opened[0].tensors == {}  # Checkpoint.close() ran: no mapping left behind


# ---------------------------------------------------------------------------------- chat content

@pytest.fixture(scope="module")
def smollm2(smollm2_checkpoint):
    with edge.load(smollm2_checkpoint) as model:
        yield model


def rendered_prompt(model, messages) -> str:
    generation = model.chat(messages, max_new_tokens=0)  # templated and tokenized, nothing computed
    list(generation)
    return model.tokenizer.decode(generation.result.prompt_tokens, skip_special_tokens=False)


def test_chat_content_parts_reach_a_string_template_as_text(smollm2):
    """SmolLM2's template concatenates content as a string; parts and null become text, as in llama.cpp."""
    as_text = rendered_prompt(smollm2, [{"role": "user", "content": "Hi\nthere"}])
    as_parts = rendered_prompt(smollm2, [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                                       {"type": "text", "text": "there"}]}])
    assert as_parts == as_text
    with_tool_call = rendered_prompt(smollm2, [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]},
        {"role": "user", "content": "again"},
    ])
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>user\nagain<|im_end|>" in with_tool_call


def test_chat_parts_that_are_not_text_are_refused(smollm2):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]
    with pytest.raises(InvalidArgumentError) as error:
        smollm2.chat(messages)
    assert str(error.value) == ("messages[0]['content'][0] is a 'image_url' part; this model's chat template takes "
                                'text only: give text parts ({"type": "text", "text": ...}) or a string')


def test_a_template_that_does_not_parse_is_a_tokenizer_error(smollm2, monkeypatch):
    monkeypatch.setattr(smollm2.tokenizer, "chat_template", "{% for m in messages %}{{ m }}")
    with pytest.raises(TokenizerError, match=r"^the checkpoint's chat template is not valid Jinja \(.*, line 1\); "
                                             r"generate with a plain prompt, or convert the model from a source with "
                                             r"a valid template$"):
        smollm2.chat([{"role": "user", "content": "Hi"}])


def test_a_template_that_cannot_render_is_a_tokenizer_error(smollm2, monkeypatch):
    monkeypatch.setattr(smollm2.tokenizer, "chat_template", "{{ messages[0]['content'] + 1 }}")
    with pytest.raises(TokenizerError, match=r"^the checkpoint's chat template cannot render these messages "
                                             r"\(TypeError: .*\); give each message's 'content' as text$"):
        smollm2.chat([{"role": "user", "content": "Hi"}])


def test_chat_without_a_template_is_refused_before_reading_input(capsys, smollm2_checkpoint, monkeypatch):
    real = edge.cli._load_for_text

    def without_template(*args):
        model = real(*args)
        model.tokenizer.chat_template = None
        return model

    monkeypatch.setattr(edge.cli, "_load_for_text", without_template)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n"))
    assert_cli_error(capsys, ["chat", smollm2_checkpoint, "--quiet"],
                     f"{smollm2_checkpoint} has no chat template, so it cannot chat; use zllm-edge generate with a "
                     "plain prompt")
    assert sys.stdin.read() == "Hi\n"  # the user's first message was not taken and then dropped


def test_text_that_is_not_unicode_is_an_argument_error(smollm2, capsys, no_default_models):
    with pytest.raises(InvalidArgumentError) as error:
        smollm2.generate("lone \ud800 surrogate")
    assert str(error.value) == ("the text is not valid Unicode: character 5 is the lone surrogate U+D800; give UTF-8 "
                                "text (on the command line, check the terminal's encoding)")
    with pytest.raises(InvalidArgumentError) as error:
        smollm2.chat([{"role": "user", "content": "caf\udce9"}])
    assert str(error.value) == ("messages[0]['content'] is not valid Unicode: character 3 is the byte 0xe9, which is "
                                "not UTF-8; give UTF-8 text (on the command line, check the terminal's encoding)")
    # a Latin-1 byte on a UTF-8 command line reaches Python as U+DCE9 (surrogateescape)
    assert_cli_error(capsys, ["generate", "caf\udce9", "--quiet"],  # refused before the default model is built
                     "the text is not valid Unicode: character 3 is the byte 0xe9, which is not UTF-8; give UTF-8 "
                     "text (on the command line, check the terminal's encoding)")
    assert_cli_error(capsys, ["chat", "--system", "caf\udce9", "--quiet"],
                     "--system is not valid Unicode: character 3 is the byte 0xe9, which is not UTF-8; give UTF-8 "
                     "text (on the command line, check the terminal's encoding)")
    assert_cli_error(capsys, ["generate", "Hi", "--stop", "caf\udce9", "--quiet"],
                     "stop string 'caf\\udce9' is not valid Unicode (it holds a lone surrogate, such as a byte that is "
                     "not UTF-8 on the command line); give UTF-8 text")


# ---------------------------------------------------------------------------------- CLI: refused before work

@pytest.mark.parametrize("argv, message", [
    (["bench", "--device", "cpu,bogus"],
     "device bogus: device 'bogus' is not available; available devices: reference, cpu, gpu, npu"),
    (["bench", "--json", ""], "--json needs a file name, got an empty one"),
    (["bench", "--memory-budget", "50%", "--device", "bogus"],
     "device 'bogus' is not available; available devices: reference, cpu, gpu, npu"),
    (["bench", "--random-moe", "--memory-budget", "50%", "--repeats", "6"],
     "the MoE benchmark runs at most 5 repeats (one distinct prompt each, plus the warm-up's), got --repeats 6"),
    (["bench", "--memory-budget", "50%", "--prefetch-depth", "0"], "prefetch_depth must be a positive integer, got 0"),
    (["bench", "--memory-budget", "50%", "--plot", "{tmp}/sweep.svg"],
     "--plot {tmp}/sweep.svg: the file is written as PNG; name a .png file"),
    (["bench", "--memory-budget", "50%", "--plot", "-"], "--plot -: the file is written as PNG; name a .png file"),
    (["calibrate", "--device", "bogus"],
     "device 'bogus' is not available; available devices: reference, cpu, gpu, npu"),
    (["calibrate", "--trace", "-"], "--trace names a file (npz); it cannot be '-' (stdout)"),
    (["calibrate", "--json", ""], "--json needs a file name, got an empty one"),
    (["diff", "Hello", "--devices", "reference,bogus"],
     "device 'bogus' is not available; available devices: reference, cpu, gpu, npu"),
    (["diff", "Hello", "--devices", "reference,cpu", "--threads", "0"], "--threads must be a positive integer, got 0"),
    (["diff", "Hello", "--decode-steps", "-1"], "--decode-steps must be >= 0, got -1"),
    (["bench", "--device", "cpu:"],
     "device cpu:: device 'cpu:' names no variant after ':'; write 'cpu', or 'cpu' followed by ':' and a variant"),
    (["generate", "Hi", "--device", "cpu:"],
     "device 'cpu:' names no variant after ':'; write 'cpu', or 'cpu' followed by ':' and a variant"),
    (["diff", "Hello", "--devices", "reference,npu:"],
     "device 'npu:' names no variant after ':'; write 'npu', or 'npu' followed by ':' and a variant"),
])
def test_cli_arguments_are_refused_before_a_default_model_is_built(capsys, tmp_path, no_default_models, argv,
                                                                  message):
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert_cli_error(capsys, [*argv, "--quiet"], message.format(tmp=tmp_path))


class NanFromLayer(ReferenceBackend):
    """device "nanfrom:K": the reference with nan in mlp.down_proj of layer K (a broken kernel's output)."""

    name = "nanfrom"

    def __init__(self, threads=None, variant=None):
        super().__init__(threads)
        self.layer = int(variant or 0)

    def compile_forward(self, transformer):
        layer = transformer.layers[self.layer]
        layer.down = np.full_like(as_float32(layer.down), np.nan)
        return None, "ops"

    def info(self):
        return {**super().info(), "device": "nanfrom", "arithmetic": {"accumulation": 2.0 ** -24}}


def test_diff_flags_a_device_that_produces_nan(capsys, dense_path, monkeypatch):
    """nan fails every comparison: it used to pass `rel_max_abs > tolerance` as 'within tolerance'."""
    monkeypatch.setitem(BACKENDS, "nanfrom", f"{__name__}:NanFromLayer")
    ids = ",".join(map(str, random_prompt(4)))
    code, out, err = run_cli(capsys, "diff", dense_path, ids, "--ids", "--devices", "reference,nanfrom:1",
                             "--decode-steps", 1)
    assert (code, err) == (1, "")
    assert out.rstrip().endswith("first divergence: prefill, layer 1")
    code, out, err = run_cli(capsys, "diff", dense_path, ids, "--ids", "--devices", "reference,nanfrom:1", "--json")
    assert (code, err) == (1, "")
    report = json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert report["first_divergence"] == {"pass": "prefill", "layer": 1}
    assert report["passes"][0]["layers"][1]["rel_max_abs"] is None and report["passes"][0]["layers"][1]["exceeds"]


# ---------------------------------------------------------------------------------- outputs, all or nothing

def test_a_failed_json_report_leaves_the_previous_file(tmp_path, capsys):
    from edge.bench import emit_report

    target = tmp_path / "report.json"
    target.write_text('{"old": true}')
    with pytest.raises(TypeError):
        emit_report("table", {"bad": object()}, str(target))  # json.dump fails half way through
    assert target.read_text() == '{"old": true}'
    assert sorted(os.listdir(tmp_path)) == ["report.json"]  # no temporary left behind
    emit_report("table", {"new": 1}, str(target))
    assert json.loads(target.read_text()) == {"new": 1}
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_calibrate_json_dash_prints_json_on_stdout(capsys, moe_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "calibrate", moe_path, "--tokens", 16, "--requests", 2, "--prompt-tokens", 4,
                             "--depth", 1, "--no-save", "--quiet", "--json", "-")
    assert code == 0, err
    assert "recall" in json.dumps(json.loads(out))  # stdout is the JSON alone; the table went to stderr
    assert not os.path.exists(tmp_path / "-")


def test_calibrate_writes_its_trace_whole(capsys, moe_path, tmp_path, monkeypatch):
    import streaming.calibration

    def interrupted(f, **arrays):  # Ctrl-C halfway through writing the archive
        f.write(b"PK\x03\x04 half an archive")
        raise KeyboardInterrupt

    monkeypatch.setattr(streaming.calibration.np, "savez_compressed", interrupted)
    trace = tmp_path / "trace.npz"
    code, out, err = run_cli(capsys, "calibrate", moe_path, "--tokens", 16, "--requests", 2, "--prompt-tokens", 4,
                             "--depth", 1, "--no-save", "--quiet", "--trace", trace)
    assert (code, err) == (130, "interrupted\n")
    assert os.listdir(tmp_path) == []  # a later run records again instead of replaying half a trace


# ---------------------------------------------------------------------------------- what argument fuzzing found
# (tests/test_fuzz_arguments.py): each was a traceback, a hang, a value silently taken for another, or a refusal of
# another type than InvalidArgumentError

_STORAGE_USAGE = ("use one of native, nvme, ufs, emmc, sd, or custom:bw=SIZE,lat=TIME such as "
                  "custom:bw=500MB,lat=200us (bandwidth per second)")


@pytest.mark.parametrize("moe, settings, message", [
    (True, dict(memory_budget="50%", storage="custom:bw=1GB,lat=99999999999999999999s"),  # time.sleep's OverflowError
     f"storage 'custom:bw=1GB,lat=99999999999999999999s': latency '99999999999999999999s' is longer than an emulated "
     f"device may take to start a read, 1s; {_STORAGE_USAGE}"),
    (True, dict(memory_budget="50%", storage="custom:bw=1,lat=1us"),  # 1 byte/s: the first read never ended
     f"storage 'custom:bw=1,lat=1us': bandwidth '1' is below the slowest an emulated device may be, 1MB per second; "
     f"{_STORAGE_USAGE}"),
    (True, dict(memory_budget="50%", prefetch_threads=2**63, io_engine="threads"),  # started threads for ever
     "prefetch_threads must be an integer in [1, 256], got 9223372036854775808"),
    (True, dict(expert_strategy=""),  # "", 0, [] and {} were the default strategy
     "expert_strategy '' is not known; choose one of predictive, ondemand, mmap, resident"),
    (True, dict(memory_budget="50%", expert_strategy="mmap", expert_policy="x"),  # ignored by mmap and resident
     "expert_policy 'x' is not known; choose one of lru, lfu, forecast, cycle, nextuse"),
    (False, dict(storage="x"), f"storage 'x' is not known; {_STORAGE_USAGE}"),  # ignored by a dense model
    (False, dict(verify="no"), "verify must be True or False, got 'no'"),  # a string taken as True
    (False, dict(memory_budget=[1]),  # a ZllmError
     "memory budget [1] not understood; use bytes, a size such as 512MB, or a share of the expert bytes such as 50%"),
    (False, dict(kv_capacity=2**63), "kv_capacity must be in [1, 64] (the model's context), got 9223372036854775808"),
    (False, dict(device="reference:x"), "device 'reference' has no variants, got 'reference:x'"),  # a ZllmError
    (True, dict(gpu_expert_cache="lots"),  # refused only on a gpu
     "gpu_expert_cache: memory budget 'lots' not understood; use bytes, a size such as 512MB or 2GiB, or a share of "
     "the expert bytes such as 50%"),
])
def test_load_settings_the_fuzzing_found(dense_path, moe_path, moe, settings, message):
    with pytest.raises(InvalidArgumentError) as error:
        edge.load(moe_path if moe else dense_path, **settings)
    assert str(error.value) == message


@pytest.mark.parametrize("call, error_type, message", [
    (lambda s: s.prefill([[1, 2], [3]]), InvalidArgumentError,  # numpy's ValueError
     "token ids must be one flat sequence of integers, got [[1, 2], [3]]"),
    (lambda s: s.prefill(np.array([[1, 2]])), InvalidArgumentError,  # flattened
     "token ids must be one sequence (a list or a 1-D array), got an array of shape (1, 2)"),
    (lambda s: s.prefill(bytearray(b"\x01")), InvalidArgumentError,  # taken as the id 1
     "token ids must be integers, got bytearray bytearray(b'\\x01')"),
    (lambda s: s.prefill(2**63), edge.SessionError,  # named -9223372036854775808
     "token id 9223372036854775808 is outside the vocabulary [0, 160)"),
    (lambda s: s.prefill([10**30]), edge.SessionError,  # "token ids must be integers"
     "token id 1000000000000000000000000000000 is outside the vocabulary [0, 160)"),
    (lambda s: s.prefill([1], all_logits="no"), InvalidArgumentError,  # a string taken as True
     "all_logits must be True or False, got 'no'"),
    (lambda s: s.decode([1, 2]), InvalidArgumentError,  # ran two tokens
     "decode takes one token id (an int), got [1, 2]; run several with prefill"),
    (lambda s: s.save("\ud800"), InvalidArgumentError,  # UnicodeEncodeError
     "path '\\ud800' cannot be a file name: character 0 is the lone surrogate U+D800; give a path the file system "
     "can encode"),
    (lambda s: s.save("a\x00b"), InvalidArgumentError,  # ValueError: embedded null byte
     "path 'a\\x00b' holds a NUL character, which no file name can; give a path without it"),
    (lambda s: s.save("/no\nsuch/s.zsession"), edge.SessionError,  # the path's line break split the message
     "cannot save the session to '/no\\nsuch/s.zsession': the directory '/no\\nsuch' does not exist; create it first"),
    (lambda s: s.model.session(capacity=0), InvalidArgumentError,  # a SessionError, with no session open
     "session capacity must be in [1, 64] (the model's context), got 0"),
    (lambda s: s.model.generate([1], stop=np.array([[1], [2]])), InvalidArgumentError,  # numpy's repr: two lines
     "stop must be a string or a list of strings, got array([1]) in array([[1], [2]])"),
])
def test_session_arguments_the_fuzzing_found(llama, call, error_type, message):
    with llama.session(capacity=8) as session:
        with pytest.raises(error_type) as error:
            call(session)
        assert str(error.value) == message
        assert session.tokens == []


@pytest.mark.parametrize("path, message", [
    ("", "path is empty; name a checkpoint directory made by `zllm-edge convert`"),  # tried the current directory
    ("\ud800", "path '\\ud800' cannot be a file name: character 0 is the lone surrogate U+D800; give a path the file "
                "system can encode"),  # "is not a directory"
])
def test_load_paths_the_fuzzing_found(path, message):
    with pytest.raises(InvalidArgumentError) as error:
        edge.load(path)
    assert str(error.value) == message


def test_a_repetition_penalty_that_overflows_still_samples():
    """A subnormal penalty divides a logit to +inf: inf - inf was NaN probabilities, numpy's ValueError."""
    logits = np.array([1.0, -2.0, 0.5, 3.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in range(5):
            token = sample_token(logits, SamplingParams(temperature=1.0, repetition_penalty=1e-320),
                                 np.random.default_rng(seed), seen=np.array([0, 2]))
            assert token in (0, 2)  # both +inf: shared, the others have probability 0


@pytest.mark.parametrize("argv, message", [
    (["bench", "{dense}", "--prompt-tokens", "99999999999999"],  # made that prompt first: MemoryError
     "99999999999999 prompt + 128 new tokens exceed the model's context of 64 tokens; lower --prompt-tokens or "
     "--new-tokens"),
    (["bench", "{dense}", "--repeats", "1000000000000000000"],  # ran for ever
     "--repeats must be at most 100, got 1000000000000000000: the median of more runs says nothing new, and a count "
     "that large would run for days"),
    (["calibrate", "{moe}", "--depth", "99999999999999999", "--tokens", "64", "--requests", "2", "--prompt-tokens",
      "4", "--no-save"],  # replayed 10**17 lookaheads
     "--depth 99999999999999999 looks further ahead than the model's 2 MoE layers; give --depth of at most 2"),
    (["inspect", "no\nsuch"],  # the path's line break split the error line
     "no\\nsuch is not a directory; a zllm checkpoint is a directory made by `zllm-edge convert`"),
    (["generate", "", "Hi"], "MODEL is empty; name a checkpoint directory, or leave MODEL out for the default model"),
])
def test_command_lines_the_fuzzing_found(capsys, dense_path, moe_path, no_default_models, argv, message):
    argv = [a.format(dense=dense_path, moe=moe_path) for a in argv]
    assert_cli_error(capsys, [*argv, *(["--quiet"] if argv[0] in ("bench", "calibrate") else [])], message)
