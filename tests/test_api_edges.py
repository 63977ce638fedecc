"""Edges of the API and the CLI: every bad argument is a typed error with a message that says what was
wrong and what to do, checked before expensive work (conversion, loading, benchmarking); closed
sessions and models; abandoned generations; timings; damaged saved sessions; output paths.

Tiny models (no tokenizer) where ids suffice; SmolLM2 (the conftest fixture) where text is needed.
"""
from __future__ import annotations

import gc
import json
import math
import struct
import time

import numpy as np
import pytest
from test_cli import run_cli
from tiny_models import CONTEXT, random_prompt

import edge
import edge.cli
import edge.home
import edge.random_moe
from converters.convert import QuantPlan
from edge.core.errors import InvalidArgumentError, SessionError, ZllmError
from edge.generation import GenerationOptions
from streaming.budget import parse_budget

DENSE = ("llama_gqa_tied", QuantPlan(weights="f32"))
MOE = ("qwen3_moe_norm", QuantPlan(weights="int8"))  # as tests/test_bench_moe.py: converted once per run


@pytest.fixture(scope="module")
def dense_path(tiny_zoo) -> str:
    return tiny_zoo.converted(*DENSE)


@pytest.fixture(scope="module")
def moe_path(tiny_zoo) -> str:
    return tiny_zoo.converted(*MOE)


@pytest.fixture(scope="module")
def llama(dense_path):
    with edge.load(dense_path) as model:
        yield model


@pytest.fixture(scope="module")
def smollm2(smollm2_checkpoint):
    with edge.load(smollm2_checkpoint) as model:
        yield model


@pytest.fixture
def no_default_models(monkeypatch):
    """Any use of a built-in default model fails the test: arguments must be refused before it is built."""
    def refuse(*args, **kwargs):
        raise AssertionError("the default model was built before the arguments were checked")

    monkeypatch.setattr(edge.home, "default_model_checkpoint", refuse)
    monkeypatch.setattr(edge.home, "default_moe_checkpoint", refuse)
    monkeypatch.setattr(edge.random_moe, "random_moe_checkpoint", refuse)


def assert_cli_error(capsys, argv, message: str) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert (code, err) == (2, f"error: {message}\n"), out


# ---------------------------------------------------------------------------------- 1, 2: sampling, length, seed

BAD_GENERATION = [
    (dict(temperature=-1), "temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
    (dict(temperature=math.nan), "temperature must be a finite number >= 0 (0 = greedy), got nan"),
    (dict(top_k=-3), "top_k must be an integer >= 0 (0 = no limit), got -3"),
    (dict(top_k=2.5), "top_k must be an integer >= 0 (0 = no limit), got 2.5"),
    (dict(top_p=-0.1), "top_p must be a finite number in [0, 1] (1 = no limit), got -0.1"),
    (dict(top_p=1.5), "top_p must be a finite number in [0, 1] (1 = no limit), got 1.5"),
    (dict(top_p=math.nan), "top_p must be a finite number in [0, 1] (1 = no limit), got nan"),
    (dict(repetition_penalty=0), "repetition_penalty must be a finite number > 0 (1 = none), got 0.0"),
    (dict(repetition_penalty=-1), "repetition_penalty must be a finite number > 0 (1 = none), got -1.0"),
    (dict(repetition_penalty=math.nan), "repetition_penalty must be a finite number > 0 (1 = none), got nan"),
    (dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 0, got -1"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer >= 0, got 2.5"),
    (dict(seed=-2), "seed must be an integer >= -1 (-1: a random seed), got -2"),
    (dict(seed="abc"), "seed must be an integer >= -1 (-1: a random seed), got 'abc'"),
    (dict(stop=[1]), "stop must be a string or a list of strings, got 1 in [1]"),
]


@pytest.mark.parametrize("kwargs, message", BAD_GENERATION)
def test_bad_generation_arguments_are_typed_errors(llama, kwargs, message):
    with pytest.raises(InvalidArgumentError) as error:
        llama.generate([5, 6], **kwargs)
    assert str(error.value) == message
    assert isinstance(error.value, ZllmError) and isinstance(error.value, ValueError)
    assert not llama._sessions


@pytest.mark.parametrize("flag, value, message", [
    ("--temperature", "-1", BAD_GENERATION[0][1]),
    ("--top-k", "-3", BAD_GENERATION[2][1]),
    ("--top-p", "nan", BAD_GENERATION[6][1]),
    ("--repetition-penalty", "0", BAD_GENERATION[7][1]),
    ("--max-new-tokens", "-1", BAD_GENERATION[10][1]),
    ("--threads", "0", "threads must be a positive integer, got 0"),
    ("--kv-capacity", "0", "kv_capacity must be a positive integer, got 0"),
])
def test_cli_refuses_generation_arguments_before_loading(capsys, tmp_path, no_default_models, flag, value, message):
    missing = tmp_path / "no-such-checkpoint"  # loading it would fail with another message
    assert_cli_error(capsys, ["generate", missing, "Hello", flag, value], message)
    assert_cli_error(capsys, ["generate", "Hello", flag, value], message)  # the default model is not built


def test_cli_refuses_threads_for_a_device_without_them(capsys, tmp_path, no_default_models):
    message = "device 'reference' runs no threads of its own; --threads/threads= applies to the cpu and npu devices"
    assert_cli_error(capsys, ["generate", tmp_path / "no-such-checkpoint", "Hello", "--device", "reference",
                              "--threads", "2"], message)
    assert_cli_error(capsys, ["generate", "Hello", "--device", "reference", "--threads", "2"], message)


def test_seed_minus_one_is_a_random_seed(llama, capsys):
    assert GenerationOptions(seed=-1).seed is None and GenerationOptions(seed=7).seed == 7
    generation = llama.generate([5, 6], max_new_tokens=3, temperature=1.0, seed=-1)
    list(generation.steps())
    # sampling may draw the end-of-sequence token early (about 2 runs in 100 on this tiny model)
    assert len(generation.result.tokens) == 3 or generation.result.finish_reason == "eos"
    assert isinstance(generation.result.seed, int)  # the seed drawn, reported so the run can be repeated
    with pytest.raises(SystemExit):
        edge.cli.main(["generate", "--help"])
    assert "-1 (as in llama.cpp) or none: a random seed" in " ".join(capsys.readouterr().out.split())


# ---------------------------------------------------------------------------------- 3: closed sessions and models

def test_a_closed_session_says_so(llama):
    session = llama.session(capacity=8)
    session.prefill([5, 6])
    session.close()
    for use in (lambda: session.decode(1), lambda: session.position, lambda: session.capacity,
                lambda: session.reset(), lambda: session.save("unused")):
        with pytest.raises(SessionError) as error:
            use()
        assert str(error.value) == "the session is closed; open a new one with model.session()"
    session.close()  # closing again is harmless


def test_a_closed_model_says_so(dense_path):
    model = edge.load(dense_path)
    session = model.session(capacity=8)
    model.close()
    message = f"the model is closed; load {dense_path} again with edge.load()"
    for use in (lambda: model.generate([5], max_new_tokens=1), lambda: model.session(), model.stats,
                model.device_info, lambda: session.decode(5), lambda: model.chat([{"role": "user", "content": "x"}])):
        with pytest.raises(ZllmError) as error:
            use()
        assert str(error.value) == message
    model.close()


# ---------------------------------------------------------------------------------- 4: chat messages

@pytest.mark.parametrize("messages, message", [
    ([{"role": "user"}], "messages[0] has no 'content'"),
    ([{"role": "user", "content": 3}], "messages[0]'s 'content' must be text, a list of parts or null; it is 3"),
    (["hello"], 'messages must be a list of {"role": ..., "content": ...} dicts; messages[0] is str \'hello\''),
    ("hello", 'messages must be a list of {"role": ..., "content": ...} dicts, got str \'hello\''),
    ([], 'messages is empty; give a list of {"role": ..., "content": ...} dicts, e.g. '
         '[{"role": "user", "content": "Hi"}]'),
])
def test_malformed_chat_messages_are_refused_before_templating(smollm2, messages, message):
    with pytest.raises(InvalidArgumentError) as error:
        smollm2.chat(messages, max_new_tokens=1)
    assert str(error.value) == message


# ---------------------------------------------------------------------------------- 5: saved sessions

@pytest.fixture(scope="module")
def saved(llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("saved") / "s.zsession"
    with llama.session(capacity=16) as session:
        session.prefill(random_prompt(6, seed=1))
        session.save(path)
    return path


def test_damaged_lengths_and_cuts_are_named(llama, saved, tmp_path):
    data = saved.read_bytes()
    header_length = struct.unpack_from("<Q", data, 12)[0]
    huge = bytearray(data)
    huge[12:20] = struct.pack("<Q", 2 ** 62)
    cases = {
        "huge": (bytes(huge), f"the saved session is truncated (or its header length is damaged): the header should "
                              f"take {2 ** 62} bytes but {len(data) - 52} follow the preamble; save the session again"),
        "preamble": (data[:30], "the saved session is truncated: 30 bytes, fewer than its 52-byte preamble; save the "
                                "session again"),
        "magic": (data[:5], "the saved session is truncated: 5 bytes, fewer than its 52-byte preamble; save the "
                            "session again"),
        "header": (data[:60], f"the saved session is truncated (or its header length is damaged): the header should "
                              f"take {header_length} bytes but 8 follow the preamble; save the session again"),
    }
    for name, (content, message) in cases.items():
        damaged = tmp_path / name
        damaged.write_bytes(content)
        with pytest.raises(SessionError) as error:
            llama.load_session(damaged)
        assert str(error.value) == f"{damaged}: {message}", name
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(SessionError, match="empty is empty, not a saved zllm session; save one with"):
        llama.load_session(tmp_path / "empty")


def test_saving_into_a_missing_directory_is_refused(llama, tmp_path):
    target = tmp_path / "missing" / "s.zsession"
    with llama.session(capacity=8) as session:
        session.prefill([5, 6])
        with pytest.raises(SessionError) as error:
            session.save(target)
    assert str(error.value) == (f"cannot save the session to {target}: the directory {target.parent} does not "
                                "exist; create it first")


# ---------------------------------------------------------------------------------- 6, 7: output paths, calibrate

@pytest.mark.parametrize("argv, option", [
    (["bench", "--json", "{missing}/x.json"], "--json"),
    (["bench", "--memory-budget", "50%", "--plot", "{missing}/x.png"], "--plot"),
    (["calibrate", "--json", "{missing}/x.json"], "--json"),
    (["calibrate", "--trace", "{missing}/x.npz"], "--trace"),
])
def test_output_paths_are_checked_before_running(capsys, tmp_path, no_default_models, argv, option):
    missing = tmp_path / "missing"
    argv = [a.format(missing=missing) for a in argv]
    assert_cli_error(capsys, argv, f"{option} {argv[-1]}: cannot write there, the directory {missing} does not "
                                   "exist; choose a file in an existing, writable directory")


def test_route_trace_save_and_load_errors_are_typed(tmp_path):
    from streaming.calibration import RouteTrace
    from streaming.predictor import PredictorError

    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"\x80\x04junk" * 10)
    with pytest.raises(PredictorError) as error:
        RouteTrace.load(str(junk))
    assert str(error.value) == (f"{junk} is not a route trace (an npz archive written by zllm-edge calibrate); "
                                "record one with zllm-edge calibrate --trace FILE")
    trace = RouteTrace([], {}, {}, 1, {}, {}, np.zeros(0, np.int64), np.zeros(0, np.int64))
    with pytest.raises(PredictorError, match="cannot write the route trace to .*/missing/t.npz: No such file"):
        trace.save(str(tmp_path / "missing" / "t.npz"))


@pytest.mark.parametrize("argv, message", [
    (["--requests", "0"], "--requests must be at least 2, got 0: the mix is chosen on half of the requests and "
                          "reported on the other, held-out half"),
    (["--requests", "1"], "--requests must be at least 2, got 1: the mix is chosen on half of the requests and "
                          "reported on the other, held-out half"),
    (["--tokens", "0"], "--tokens 0 over --requests 8 leaves 0 tokens per request, which must exceed --prompt-tokens "
                        "32 so that each request decodes; raise --tokens or lower --requests"),
])
def test_calibrate_checks_its_counts_before_building_the_default_moe(capsys, no_default_models, argv, message):
    assert_cli_error(capsys, ["calibrate", *argv, "--quiet"], message)


def test_calibrate_names_the_flags_when_requests_exceed_the_context(capsys, moe_path):
    assert_cli_error(capsys, ["calibrate", moe_path, "--tokens", 200, "--requests", 2, "--prompt-tokens", 4, "--quiet"],
                     f"--tokens 200 over --requests 2 makes requests of 100 tokens, beyond the model's context of "
                     f"{CONTEXT}; lower --tokens or raise --requests")


# ---------------------------------------------------------------------------------- 8, 9: API types, stop strings

@pytest.mark.parametrize("kwargs, message", [
    (dict(device=None), "device None is not available; available devices: "),
    (dict(kv_capacity="abc"), "kv_capacity must be a positive integer, got 'abc'"),
    (dict(kv_capacity=1.5), "kv_capacity must be a positive integer, got 1.5"),
    (dict(threads="2", device="cpu"), "threads must be a positive integer, got '2'"),
    (dict(threads=-1, device="npu"), "threads must be a positive integer, got -1"),
    (dict(memory_budget=-1), "memory budget -1 must be a positive number of bytes, such as 512MB or 2GiB, or a share "
                             "of the expert bytes such as 50%"),
    (dict(memory_budget="0"), "memory budget '0' must be a positive number of bytes, such as 512MB or 2GiB, or a "
                              "share of the expert bytes such as 50%"),
])
def test_load_arguments_are_typed_errors(dense_path, kwargs, message):
    with pytest.raises(ZllmError) as error:
        edge.load(dense_path, **kwargs)
    assert str(error.value).startswith(message)


def test_moe_prefetch_threads_must_be_positive(moe_path):
    with pytest.raises(InvalidArgumentError, match=r"prefetch_threads must be an integer in \[1, 256\], got 0"):
        edge.load(moe_path, memory_budget="50%", prefetch_threads=0)


def test_float_budgets_are_bytes():
    assert parse_budget("1e9").bytes == 10 ** 9 and parse_budget(5e8).bytes == 5 * 10 ** 8
    assert parse_budget("1.5GiB").bytes == 3 * 2 ** 29


@pytest.mark.parametrize("call, message", [
    (lambda m: m.session(capacity=1.5), "capacity must be an integer, got 1.5"),
    (lambda m: m.session(capacity="10"), "capacity must be an integer, got '10'"),
    (lambda m: m.generate(None), "prompt must be text (a str) or a list of token ids, got None"),
    (lambda m: m.generate([]), "the prompt is empty; give some text or at least one token id"),
    (lambda m: m.decode(None), "token ids must be integers, got object values such as None"),
    (lambda m: m.encode(5), "encode takes text (a str), got int 5"),
])
def test_api_type_gaps_are_typed_errors(smollm2, call, message):
    with pytest.raises(InvalidArgumentError) as error:
        call(smollm2)
    assert str(error.value) == message


def test_one_stop_string_is_not_split_into_characters(smollm2):
    # greedy " Paris" is SmolLM2's first token here; a str split into characters would stop at " "
    for stop in (" Paris", [" Paris"]):
        generation = smollm2.generate("The capital of France is", max_new_tokens=3, stop=stop)
        assert "".join(generation) == ""
        result = generation.result
        assert (result.text, result.finish_reason, result.stop_string) == ("", "stop", " Paris")
        # tokens keep the token that completed the stop string (llama.cpp's `tokens` do too)
        assert len(result.tokens) == 1 and smollm2.decode(result.tokens).startswith(result.text + result.stop_string)


def test_generate_json_reports_the_stop_string(capsys, smollm2_checkpoint):
    code, out, err = run_cli(capsys, "generate", smollm2_checkpoint, "The capital of France is", "--max-new-tokens", 3,
                             "--stop", " Paris", "--json", "--quiet")
    assert code == 0, err
    report = json.loads(out)
    assert (report["text"], report["finish_reason"], report["stop_string"]) == ("", "stop", " Paris")
    assert len(report["tokens"]) == 1


# ------------------------------------------------------------------------- 10, 11: abandoned generations, timing

def test_an_abandoned_generation_gives_its_kv_positions_back_without_gc(dense_path):
    prompt = random_prompt(4, seed=2)
    with edge.load(dense_path, memory_budget="1GB", kv_capacity=40) as model:
        gc.disable()  # no collector: only reference counting may free the session
        try:
            for _ in model.generate(prompt, max_new_tokens=30).steps():
                break
            assert not model._sessions
            generation = model.generate(prompt, max_new_tokens=30)  # needs 34 of the 40 positions
            list(generation.steps())
            assert len(generation.result.tokens) == 30
            with model.generate(prompt, max_new_tokens=30) as held:
                next(held.steps())
                assert [s.capacity for s in model._sessions] == [34]
            assert not model._sessions
        finally:
            gc.enable()


def test_decode_time_excludes_the_consumers_time(llama):
    generation = llama.generate(random_prompt(4, seed=3), max_new_tokens=4)
    for _ in generation.steps():
        time.sleep(0.25)
    result = generation.result
    assert len(result.tokens) == 4
    assert 0 < result.decode_seconds < 0.5  # three tiny decode steps, not three sleeps (0.75 s)


# ---------------------------------------------------------------------------------- 12: budgeted bench warm-up

def test_budgeted_bench_with_a_short_run_and_a_failing_sweep(capsys, moe_path, tmp_path):
    code, out, err = run_cli(capsys, "bench", moe_path, "--memory-budget", "50%", "--strategies", "resident",
                             "--prompt-tokens", 2, "--new-tokens", 2, "--device", "reference", "--quiet")
    assert code == 0, err
    assert "refused" not in out  # the runtime warm-up fits the 4 KV positions the run reserves
    code, out, err = run_cli(capsys, "bench", moe_path, "--memory-budget", "1000", "--strategies", "ondemand",
                             "--prompt-tokens", 2, "--new-tokens", 2, "--device", "reference", "--quiet")
    assert code == 2 and "refused: device reference: memory budget 1000 bytes" in out
    assert err.startswith("error: no configuration could run: all 1 were refused (the first: device reference: "
                          "memory budget 1000 bytes") and err.count("\n") == 1


# ---------------------------------------------------------------------------------- 13, 14: messages

def test_budget_messages_state_the_real_capacity(moe_path):
    with edge.load(moe_path, memory_budget="50%", kv_capacity=8) as model:
        with model.session(capacity=4) as small:
            small.prefill([5, 6, 7, 8])
            with pytest.raises(SessionError) as error:
                small.decode(9)
            assert str(error.value).endswith("capacity of 4; open the session with model.session(capacity=...) (a saved "
                                             "one: model.load_session(path, capacity=...)) up to 8 (the KV positions "
                                             "the memory budget reserves)")
        with model.session(capacity=8) as full:
            full.prefill(list(range(5, 13)))
            with pytest.raises(SessionError) as error:
                full.decode(9)
            assert str(error.value).endswith("capacity of 8; the memory budget reserves 8 KV positions; start a new "
                                             "session, or load the model with a larger kv_capacity (--kv-capacity) "
                                             "and memory_budget")
            with pytest.raises(SessionError, match=r"load with a larger kv_capacity and memory_budget "
                                                   r"\(--kv-capacity, --memory-budget\)$"):
                model.session(capacity=2)
        with pytest.raises(SessionError) as error:
            model.generate(list(range(5, 15)), max_new_tokens=0)
        assert str(error.value) == ("the prompt has 10 tokens, more than the 8 KV positions the memory budget "
                                    "reserves; shorten the prompt or load the model with a larger kv_capacity "
                                    "(--kv-capacity)")


def test_prompts_longer_than_the_context_are_refused_even_without_new_tokens(llama):
    with pytest.raises(SessionError) as error:
        llama.generate(random_prompt(CONTEXT + 1), max_new_tokens=0)
    assert str(error.value) == (f"the prompt has {CONTEXT + 1} tokens, more than the model's context of {CONTEXT} "
                                "tokens; shorten the prompt")


def test_cli_messages_name_what_the_user_can_change(capsys, dense_path, moe_path, tmp_path, no_default_models):
    assert_cli_error(capsys, ["generate", "", "--max-new-tokens", 0],
                     "the prompt is empty; give the text to continue: zllm-edge generate [MODEL] PROMPT")
    # --quiet: a first load in this home compiles kernels and may say so on stderr before the error
    assert_cli_error(capsys, ["generate", dense_path, "Hello", "--quiet"],
                     f"{dense_path} has no tokenizer, so it cannot take text; convert the model from a source that "
                     "has one (a Hugging Face folder with tokenizer.json, or a GGUF file)")
    assert_cli_error(capsys, ["diff", dense_path, "1,2,3", "--ids", "--decode-steps", 100, "--quiet"],
                     f"the prompt's 3 tokens and --decode-steps 100 exceed the model's context of {CONTEXT} tokens; "
                     "shorten the prompt or lower --decode-steps")
    assert_cli_error(capsys, ["bench", dense_path, "--threads", 0], "--threads must be a positive integer, got 0")
    assert_cli_error(capsys, ["bench", dense_path, "--storage", "nvme", "--quiet"],
                     f"{dense_path} is a dense llama checkpoint; --storage benchmarks Mixture-of-Experts checkpoints "
                     "(try --random-moe)")
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"\x93NUMPY junk")
    assert_cli_error(capsys, ["calibrate", moe_path, "--trace", junk, "--no-save"],
                     f"{junk} is not a route trace (an npz archive written by zllm-edge calibrate); record one with "
                     "zllm-edge calibrate --trace FILE")


# ---------------------------------------------------------------------------------- 15: threads, kv_capacity

def test_the_reference_device_refuses_a_thread_count_as_the_gpu_does(dense_path, capsys):
    with pytest.raises(ZllmError) as error:
        edge.load(dense_path, threads=2)
    assert str(error.value) == ("device 'reference' runs no threads of its own; --threads/threads= applies to the "
                                "cpu and npu devices")
    # bench and diff cap the reference's host pools instead of passing it a count
    code, out, err = run_cli(capsys, "diff", dense_path, "1,2,3", "--ids", "--devices", "reference,reference",
                             "--threads", 1, "--decode-steps", 1)
    assert code == 0, err


def test_npu_refuses_more_threads_than_cpus():
    npu = pytest.importorskip("devices.npu.backend")
    with pytest.raises(ValueError, match="threads=100000 but this machine has"):
        npu.NpuSettings.parse(None, 100000)


def test_kv_capacity_without_a_budget_is_the_default_capacity(dense_path):
    with edge.load(dense_path, kv_capacity=16) as model:
        assert model.memory.kv_capacity == 16
        with model.session() as session:
            assert session.capacity == 16
        assert model.session(capacity=32).capacity == 32  # an explicit capacity may still use the context
        generation = model.generate(random_prompt(10, seed=4), max_new_tokens=20)
        list(generation.steps())
        # a generation's session holds at most kv_capacity positions: 10 of prompt, then 7 tokens
        # (the last one chosen at position 16 is not run)
        assert (len(generation.result.tokens), generation.result.finish_reason) == (7, "length")


def test_an_unknown_random_moe_shape_is_refused_before_anything_is_built(capsys, no_default_models):
    assert_cli_error(capsys, ["bench", "--random-moe", "gpt-5", "--memory-budget", "50%"],
                     "--random-moe 'gpt-5' is not a shape here; choose one of stress, olmoe-1b-7b, qwen3-30b-a3b")
