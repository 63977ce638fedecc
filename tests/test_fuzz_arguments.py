"""Property-based fuzzing of the arguments of the Python API (edge.load and its settings, sessions,
generation, sampling, chat, saved sessions) and of the command line (every subcommand but `serve`,
whose accepted arguments start a server that does not return).

Arguments out of range, NaN and infinities, huge integers, values of the wrong type (a str for an int,
a float for an int, a bool, None, lists, nested lists, numpy scalars and arrays of another dtype or
shape), huge and empty strings, lone surrogates and bytes that are not UTF-8, unknown devices and
variants: each call either does what it was asked, and its result is checked, or is refused with the
project's typed error, a one-line message; an argument of a type the call does not take is an
InvalidArgumentError. Never another exception, and never a hang (each call runs under an alarm). The
command line answers with exit status 2 and a last stderr line `error: ...`, never a traceback.

Seeded (`derandomize`) and bounded, so CI runs the same examples every time; a longer local run:
ZLLM_EDGE_FUZZ_EXAMPLES=1000 python -m pytest tests/test_fuzz_arguments.py. Cases that once broke an
argument check stay as explicit `@example`s (the regression corpus), or as exact-message tests in
tests/test_surface_edges.py.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import math
import numbers
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from test_bad_input import TINY_GGUF_VOCAB, write_tiny_gguf
from tiny_models import CONTEXT, VOCAB, random_prompt, tiny_zoo  # noqa: F401

import edge
import edge.cli
import edge.home
import edge.random_moe
from converters.convert import QuantPlan, convert
from edge.core.arguments import is_integer
from edge.api import Model
from edge.core.errors import InvalidArgumentError, ZllmError
from edge.options import LoadOptions
from edge.sampling import SamplingParams, sample_token
from streaming.budget import STRATEGIES
from streaming.cache import POLICIES
from streaming.options import EXPERT_ENGINES, IO_ENGINES

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = int(os.environ.get("ZLLM_EDGE_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=30_000,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large, HealthCheck.large_base_example])
# the subcommands that measure or record (worker processes, sweeps): fewer examples, longer deadline
SLOW_FUZZ = settings(FUZZ, max_examples=max(EXAMPLES // 4, 10), deadline=180_000)
# without a model: thousands of examples cost a second
CHEAP_FUZZ = settings(FUZZ, max_examples=EXAMPLES * 10, deadline=5_000)
HANG_SECONDS = 150  # a call that has not returned by then hangs

# ---------------------------------------------------------------------------------- values

SURROGATES = ["\ud800", "\udfff", "\udc80", "\udcff"]  # lone ones; U+DC80-U+DCFF are argv's bytes that are not UTF-8
TEXT = st.text(st.one_of(st.characters(), st.sampled_from(SURROGATES + ["\x00", "\n", "é", "😀"])), max_size=12)
ODD = [None, True, False, 0, -1, 1, 2, 2**31, 2**63, 2**64, 10**30, -2**63 - 1, 0.0, -0.0, 0.5, 1.5, 5e-324, 1e308,
       math.nan, math.inf, -math.inf, "", " ", "0", "1", "-1", "nan", "inf", "1e400", "x", "\ud800", "\udcff", "\x00",
       "a" * 100_000, b"", b"x", bytearray(b"\x01"), [], [1], [[1]], [[1, 2], [3]], [None], ["1"], {}, {"a": 1}, (),
       {1, 2}, object(), 1j, np.int64(3), np.int8(-1), np.uint64(2**63), np.float32(math.nan), np.float64(2.5),
       np.bool_(True), np.array(2), np.array([1, 2]), np.array([[1]]), np.array([1.5]), np.array(["1"]), np.zeros(0),
       np.zeros((2, 0))]


def odd_values():
    return st.one_of(st.sampled_from(ODD), st.integers(), st.floats(), TEXT,
                     st.lists(st.integers(-3, 2**64), max_size=3))


def numbers_and_odd_values():
    return st.one_of(st.integers(-3, 10), st.floats(),
                     st.sampled_from([0, 1, 2**63, 10**30, 5e-324, 1e-320, 1e308, -0.0, 0.999, 1.0]), odd_values())


def token_ids():
    """Valid ids, ids outside the vocabulary, more than the context holds, and arrays of other dtypes and shapes."""
    dtypes = st.sampled_from([np.int8, np.int32, np.int64, np.uint8, np.uint64, np.float32, np.float64, np.bool_,
                              np.dtype("<U2")])
    return st.one_of(
        st.lists(st.integers(0, VOCAB - 1), max_size=CONTEXT + 2),
        st.lists(st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([-1, VOCAB, 2**63, 2**64, 10**30, -2**63 - 1])),
                 min_size=1, max_size=4),
        hnp.arrays(dtypes, hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=4)),
        odd_values())


def bool_like(value) -> bool:
    return isinstance(value, (bool, np.bool_))


def size_like(value) -> bool:
    """What a memory budget is written as: None, text, or a number (bools are not)."""
    return value is None or isinstance(value, str) or (isinstance(value, numbers.Real) and not bool_like(value))


def name_or_none(value) -> bool:
    return value is None or isinstance(value, str)


# ---------------------------------------------------------------------------------- checks

class Hang(BaseException):
    """A call ran past HANG_SECONDS (a BaseException: no `except Exception` of the code under test takes it)."""


@contextlib.contextmanager
def no_hang(seconds: int = HANG_SECONDS):
    def alarm(signum, frame):
        raise Hang(f"the call did not return within {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def outcome(call, wrong_type: bool = False):
    """call()'s result, or the ZllmError it raised, which must say in one line what was wrong; an argument
    of a type the call does not take must be refused as an InvalidArgumentError."""
    with no_hang():
        try:
            return call()
        except ZllmError as error:
            message = str(error)
            assert message.strip() and "\n" not in message and "Traceback" not in message, repr(message)
            if wrong_type:
                assert isinstance(error, InvalidArgumentError), f"{type(error).__name__}: {message}"
            return error


def refused(result) -> bool:
    """Whether a call was refused; counted (hypothesis --hypothesis-show-statistics) to show how many ran."""
    count(f"refused: {type(result).__name__}" if isinstance(result, ZllmError) else "accepted")
    return isinstance(result, ZllmError)


def count(what: str) -> None:
    if currently_in_test_context():  # the exact-message tests call the same helpers outside hypothesis
        event(what)


# ---------------------------------------------------------------------------------- models

@pytest.fixture(scope="module")
def dense_path(tiny_zoo) -> str:
    return tiny_zoo.converted("llama_gqa_tied", QuantPlan(weights="f32"))  # as tests/test_api_edges.py


@pytest.fixture(scope="module")
def moe_path(tiny_zoo) -> str:
    return tiny_zoo.converted("qwen3_moe_norm", QuantPlan(weights="int8"))


@pytest.fixture(scope="module")
def warm_cpu(dense_path) -> None:
    """The cpu device's first start in a process probes the machine: done here, not inside an example's
    deadline."""
    edge.load(dense_path, device="cpu").close()


@pytest.fixture(scope="module")
def llama(dense_path):
    with edge.load(dense_path) as model:
        yield model


TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
TEXT_VOCAB = TINY_GGUF_VOCAB


def write_text_gguf(path: Path) -> Path:
    """A 1-layer Llama with a byte-level tokenizer and a chat template: text in, text out, fast on the reference."""
    return write_tiny_gguf(path, context=CONTEXT, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def text_files(tmp_path_factory) -> tuple[str, str]:
    """(the GGUF, its conversion)."""
    folder = tmp_path_factory.mktemp("fuzz_arguments")
    source = write_text_gguf(folder / "text.gguf")
    convert(str(source), str(folder / "text"), QuantPlan(weights="source"), progress=False)
    return str(source), str(folder / "text")


@pytest.fixture(scope="module")
def text_model(text_files):
    with edge.load(text_files[1]) as model:
        yield model


# ---------------------------------------------------------------------------------- edge.load

LOAD_SETTINGS = list(inspect.signature(LoadOptions.of).parameters)
STREAMING_SETTINGS = {"storage", "expert_strategy", "expert_policy", "prefetch_depth", "prefetch_threads", "io_engine",
                      "expert_engine"}
TAKES = {  # the types each setting takes; any other is an InvalidArgumentError
    "device": lambda v: isinstance(v, str), "threads": lambda v: v is None or is_integer(v),
    "memory_budget": size_like, "verify": bool_like, "storage": name_or_none, "expert_strategy": name_or_none,
    "expert_policy": name_or_none, "prefetch_depth": is_integer, "prefetch_threads": is_integer,
    "kv_capacity": lambda v: v is None or is_integer(v), "kv_cache": lambda v: isinstance(v, str),
    "gpu_expert_cache": size_like, "io_engine": lambda v: isinstance(v, str),
    "expert_engine": lambda v: isinstance(v, str),
}
assert set(TAKES) == set(LOAD_SETTINGS), "a new edge.load setting: say which types it takes"
SETTING_WORDS = ["reference", "cpu", "cpu:f32", "cpu:int8", "cpu:", "cpu:int9", "cpu:f32:f32", "reference:x",
                 "npu:", "npu:bogus", "CPU", " cpu", "cpu\x00", "f32", "f16", "int8", "f8", *STRATEGIES, *POLICIES,
                 "native", "nvme", "sd", "NVME", "custom:bw=500MB,lat=200us", "custom:bw=1,lat=1us",
                 "custom:bw=1GB,lat=99999999999999999999s", "custom:bw=1e400MB,lat=1us", "custom:bw=5MB",
                 "custom:", *IO_ENGINES, *EXPERT_ENGINES, "50%", "0%", "100%", "150%", "1GB", "1e9", "-1", "1e400",
                 "512MB", "1.5GiB", "0.5", "lots"]


TAKEN = {  # values each setting takes, so that loads also get past the checks, and run
    "device": ["reference", "cpu", "cpu:f32", "cpu:int8"], "threads": [None, 1, 2, np.int64(1)],
    "memory_budget": [None, "1GB", 2e9, "50%", "100%"], "kv_capacity": [None, 1, 8, CONTEXT, np.int32(16)],
    "kv_cache": ["f32", "f16", "int8"], "verify": [False, True, np.bool_(True)],
    "storage": [None, "native", "nvme", "custom:bw=500MB,lat=100us"], "expert_strategy": [None, *STRATEGIES],
    "expert_policy": [None, "lru", "lfu", "cycle", "nextuse"], "prefetch_depth": [1, 2, 3, 2**63],
    "prefetch_threads": [1, 4, 256], "gpu_expert_cache": [None], "io_engine": list(IO_ENGINES),
    "expert_engine": list(EXPERT_ENGINES),
}
assert set(TAKEN) == set(LOAD_SETTINGS)
LOAD_SETTING = st.sampled_from(LOAD_SETTINGS).flatmap(lambda name: st.tuples(st.just(name), st.one_of(
    st.sampled_from(TAKEN[name]), st.sampled_from(TAKEN[name]), st.sampled_from(SETTING_WORDS), odd_values())))


@FUZZ
@given(setting=LOAD_SETTING, moe=st.booleans())
# each once a traceback, a hang, or a value silently taken for another
@example(setting=("storage", "custom:bw=1GB,lat=99999999999999999999999999999999s"), moe=True)  # OverflowError
@example(setting=("storage", "custom:bw=1,lat=1us"), moe=True)  # 1 byte/s: the first read never ended
@example(setting=("prefetch_threads", 2**63), moe=True)  # tried to start 2**63 loading threads
@example(setting=("prefetch_depth", 2**63), moe=True)  # sized the predictor's tables by it
@example(setting=("expert_strategy", ""), moe=True)  # "", 0, [] and {} were taken as the default
@example(setting=("expert_strategy", []), moe=True)
@example(setting=("expert_policy", "x"), moe=True)  # ignored by the mmap and resident strategies
@example(setting=("storage", "x"), moe=False)  # ignored by a dense model
@example(setting=("verify", "no"), moe=False)  # a string taken as True
@example(setting=("memory_budget", [1]), moe=False)  # a ZllmError, not an InvalidArgumentError
@example(setting=("kv_capacity", 2**63), moe=False)  # the same
@example(setting=("device", "cpu:int9"), moe=False)
@example(setting=("device", "reference:x"), moe=False)
@example(setting=("threads", 2**63), moe=False)
@example(setting=("gpu_expert_cache", "lots"), moe=True)  # refused only on a gpu, and as a ZllmError
def test_load_settings(dense_path, moe_path, warm_cpu, setting, moe):
    name, value = setting
    settings = {name: value}
    if name == "threads":
        settings["device"] = "cpu"  # a device that takes a thread count
    if moe and name in STREAMING_SETTINGS:
        settings["memory_budget"] = "50%"  # streamed experts: the setting is used
    model = outcome(lambda: edge.load(moe_path if moe else dense_path, **settings), wrong_type=not TAKES[name](value))
    if refused(model):
        return
    with model:
        assert model.options.verify in (True, False)
        if model.backend.name != "reference":  # the cpu device's first forward compiles its kernels (minutes)
            return
        logits = outcome(lambda: model.session(capacity=8).prefill([1, 2, 3]))
        assert not refused(logits), logits
        assert logits.shape == (VOCAB,) and np.isfinite(logits).all()


@FUZZ
@given(path=st.one_of(st.sampled_from(["", "\x00", "a\x00b", "\ud800", "\udcff", "missing", "a" * 5000]),
                      st.text(st.sampled_from(list("abc_ -/") + ["\udcff", "\ud800", "\x00", "é"]), max_size=20),
                      odd_values()))
@example(path="\ud800")  # "is not a directory": the path cannot even be asked for
@example(path="")  # the current directory was tried as a checkpoint
def test_load_paths(path):
    """Paths that name no checkpoint (a line break in a path is left out: quant/checkpoint.py's messages
    show paths as written)."""
    if isinstance(path, str) and "\n" in path:
        return
    model = outcome(lambda: edge.load(path), wrong_type=not isinstance(path, str) or not path or "\x00" in path)
    assert refused(model) or model.close() is None


STREAMING = {  # values the streaming settings take
    "expert_strategy": st.sampled_from([None, *STRATEGIES]),
    "expert_policy": st.sampled_from([None, *POLICIES]),
    "storage": st.one_of(st.sampled_from([None, "native", "nvme", "ufs", "emmc", "sd"]),
                         st.builds("custom:bw={},lat={}".format, st.sampled_from(["1MB", "100MB", "2GiB/s", "1e9"]),
                                   st.sampled_from(["0us", "100us", "1ms", "0.5ms"]))),
    "prefetch_depth": st.one_of(st.integers(1, 4), st.just(2**63)),
    "prefetch_threads": st.one_of(st.integers(1, 4), st.just(256)),
    "io_engine": st.sampled_from(IO_ENGINES),
    "expert_engine": st.sampled_from(EXPERT_ENGINES),
}
WILD_STORAGE = st.builds("custom:bw={}{},lat={}{}".format, st.one_of(st.integers(-5, 10**12), st.floats(0, 1e30)),
                         st.sampled_from(["", "B", "KB", "MB", "GB", "GiB", "MB/s", "xB"]),
                         st.one_of(st.integers(0, 10**20), st.floats(0, 1e30)),
                         st.sampled_from(["s", "ms", "us", "ns", "", "h"]))


@FUZZ
@given(values=st.fixed_dictionaries(STREAMING),
       odd=st.one_of(st.none(), st.tuples(st.sampled_from(sorted(STREAMING)), st.one_of(odd_values(), WILD_STORAGE))),
       budget=st.sampled_from([None, "25%", "50%", "100%", "1%", "1GB"]))
@example(values=dict(expert_strategy="ondemand", expert_policy=None, storage=None, prefetch_depth=2,
                     prefetch_threads=4, io_engine="threads", expert_engine="auto"), odd=("prefetch_threads", 2**63),
         budget="50%")
@example(values=dict(expert_strategy="predictive", expert_policy=None, storage=None, prefetch_depth=2,
                     prefetch_threads=4, io_engine="auto", expert_engine="compiled"),
         odd=("storage", "custom:bw=1e-300B,lat=0s"), budget="50%")
def test_streaming_settings(moe_path, values, odd, budget):
    settings = dict(values)
    if odd is not None:
        settings[odd[0]] = odd[1]
    wrong_type = not all(name_or_none(settings[name]) for name in ("expert_strategy", "expert_policy", "storage")) or \
        not (is_integer(settings["prefetch_depth"]) and is_integer(settings["prefetch_threads"])
             and isinstance(settings["io_engine"], str) and isinstance(settings["expert_engine"], str))
    model = outcome(lambda: edge.load(moe_path, memory_budget=budget, **settings), wrong_type=wrong_type)
    if refused(model):
        return
    with model:
        with model.session(capacity=8) as session:
            first = session.prefill([1, 2, 3])
            second = session.decode(int(first.argmax()))
        assert np.isfinite(first).all() and np.isfinite(second).all()


# ---------------------------------------------------------------------------------- sessions

@FUZZ
@given(capacity=st.one_of(st.integers(), numbers_and_odd_values()))
@example(capacity=0)  # a SessionError once, though no session was open
@example(capacity=np.int8(-1))
def test_session_capacity(llama, capacity):
    session = outcome(lambda: llama.session(capacity=capacity), wrong_type=True)  # every refusal is the argument's
    if refused(session):
        assert not llama._sessions
        return
    with session:
        assert session.capacity == (CONTEXT if capacity is None else int(capacity))
    assert not llama._sessions


@FUZZ
@given(ids=token_ids(), all_logits=st.one_of(st.booleans(), odd_values()))
@example(ids=[[1, 2], [3]], all_logits=False)  # numpy's ValueError
@example(ids=np.array([[1, 2]]), all_logits=False)  # a 2-D array was flattened
@example(ids=bytearray(b"\x01"), all_logits=False)  # bytes were taken as ids
@example(ids=2**63, all_logits=False)  # "token id -9223372036854775808 is outside the vocabulary"
@example(ids=[10**30], all_logits=False)  # "token ids must be integers, got object values such as 10**30"
@example(ids=[1], all_logits="no")  # a string taken as True
@example(ids=np.array([], dtype="<U2"), all_logits=False)  # numpy's UFuncNoLoopError, in a first version of the fixes
def test_prefill_arguments(llama, ids, all_logits):
    with llama.session(capacity=CONTEXT) as session:
        logits = outcome(lambda: session.prefill(ids, all_logits=all_logits), wrong_type=not bool_like(all_logits))
        if refused(logits):
            assert session.position == 0 and session.tokens == []
            return
        given_ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        assert session.tokens == given_ids and session.position == len(given_ids)
        assert logits.shape == ((len(given_ids), VOCAB) if all_logits else (VOCAB,))
        assert np.isfinite(logits).all()


@FUZZ
@given(token=st.one_of(st.integers(-2, VOCAB + 1), token_ids()))
@example(token=[1, 2])  # ran two tokens
@example(token=(7,))
def test_decode_argument(llama, token):
    with llama.session(capacity=CONTEXT) as session:
        session.prefill([5])
        logits = outcome(lambda: session.decode(token))
        if refused(logits):
            assert session.tokens == [5]
            return
        assert session.tokens == [5, int(token)] and logits.shape == (VOCAB,) and np.isfinite(logits).all()


# ---------------------------------------------------------------------------------- generation and sampling

# every keyword of Model.generate but the prompt and the stop strings (test_text_generation's)
SAMPLING = [name for name in inspect.signature(Model.generate).parameters if name not in ("self", "prompt", "stop")]


@FUZZ
@given(settings=st.dictionaries(st.sampled_from(SAMPLING), numbers_and_odd_values(), max_size=4))
@example(settings={"temperature": 1.0, "repetition_penalty": 1e-320})  # NaN probabilities: numpy's ValueError
@example(settings={"temperature": 1e308, "top_p": 1e-320, "max_new_tokens": 10**30})
def test_generate_arguments(llama, settings):
    prompt = random_prompt(4)
    generation = outcome(lambda: llama.generate(prompt, **settings), wrong_type=True)
    if refused(generation):
        assert not llama._sessions
        return
    with generation:
        steps = outcome(lambda: list(generation.steps()))
    assert not refused(steps), steps
    result = generation.result
    limit = settings.get("max_new_tokens", 128)
    assert len(result.tokens) <= min(limit, CONTEXT - len(prompt) + 1)
    assert all(0 <= t < VOCAB for t in result.tokens)
    assert result.finish_reason in ("eos", "length")
    assert not llama._sessions


@CHEAP_FUZZ
@given(temperature=numbers_and_odd_values(), top_k=numbers_and_odd_values(), top_p=numbers_and_odd_values(),
       penalty=numbers_and_odd_values(), min_p=numbers_and_odd_values(),
       logits=hnp.arrays(np.float64, st.integers(1, 40), elements=st.floats(-1e30, 1e30)),
       seen=st.lists(st.integers(0, 39), max_size=5), seed=st.integers(0, 2**32))
@example(temperature=1.0, top_k=0, top_p=1.0, penalty=1e-320, min_p=0.0, logits=np.array([1.0, -2.0, 0.5]),
         seen=[0, 1], seed=0)  # inf - inf: NaN probabilities, numpy's ValueError
@example(temperature=1.0, top_k=0, top_p=1.0, penalty=1e308, min_p=0.0, logits=np.array([-1.0, -2.0]), seen=[0, 1],
         seed=0)  # every logit -inf
def test_sampling_parameters(temperature, top_k, top_p, penalty, min_p, logits, seen, seed):
    params = outcome(lambda: SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                            repetition_penalty=penalty, min_p=min_p), wrong_type=True)
    if refused(params):
        return
    seen = np.array([i for i in seen if i < len(logits)], dtype=np.int64)
    token = sample_token(logits, params, np.random.default_rng(seed), seen)
    assert 0 <= token < len(logits)
    if params.temperature == 0:
        penalized = logits.copy()
        for i in set(seen.tolist()):
            penalized[i] = penalized[i] / penalty if penalized[i] > 0 else penalized[i] * penalty
        assert penalized[token] == penalized.max()


# ---------------------------------------------------------------------------------- text

@FUZZ
@given(prompt=st.one_of(TEXT, odd_values()), stop=st.one_of(st.none(), TEXT, st.lists(TEXT, max_size=3), odd_values()),
       max_new_tokens=st.integers(0, 6))
@example(prompt="caf\udce9", stop=None, max_new_tokens=2)  # a byte that is not UTF-8, as argv gives it
@example(prompt="the", stop="\ud800", max_new_tokens=2)
def test_text_generation(text_model, prompt, stop, max_new_tokens):
    generation = outcome(lambda: text_model.generate(prompt, max_new_tokens=max_new_tokens, stop=stop))
    if refused(generation):
        assert not text_model._sessions
        return
    with generation:
        pieces = outcome(lambda: list(generation))
    assert not refused(pieces), pieces
    result = generation.result
    assert "".join(pieces) == result.text and len(result.tokens) <= max_new_tokens
    for string in [stop] if isinstance(stop, str) else list(stop) if stop is not None else []:
        assert not string or string not in result.text
    assert not text_model._sessions


@FUZZ
@given(value=st.one_of(TEXT, odd_values(), token_ids()))
@example(value="\ud800")
@example(value=[[1, 2], [3]])
def test_encode_and_decode(text_model, value):
    ids = outcome(lambda: text_model.encode(value), wrong_type=not isinstance(value, str))
    if not refused(ids):
        assert all(0 <= i < TEXT_VOCAB for i in ids)
        assert text_model.decode(ids) == value  # a byte-level vocabulary spells any text
    text = outcome(lambda: text_model.decode(value))
    assert refused(text) or isinstance(text, str)


ROLES = st.one_of(st.sampled_from(["user", "assistant", "system"]), TEXT, odd_values())
PARTS = st.one_of(TEXT, st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]),
                                               "text": st.one_of(TEXT, odd_values())}), odd_values())
CONTENTS = st.one_of(TEXT, st.none(), st.lists(PARTS, max_size=3), odd_values())
MESSAGES = st.one_of(
    st.lists(st.one_of(st.fixed_dictionaries({"role": ROLES, "content": CONTENTS}),
                       st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "name"]),
                                       st.one_of(TEXT, odd_values()), max_size=3),
                       odd_values()), max_size=3),
    odd_values())


@FUZZ
@given(messages=MESSAGES)
@example(messages=[{"role": "user", "content": "caf\udce9"}])
@example(messages=[{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}])
def test_chat_messages(text_model, messages):
    generation = outcome(lambda: text_model.chat(messages, max_new_tokens=2))
    if refused(generation):
        assert not text_model._sessions
        return
    with generation:
        pieces = outcome(lambda: list(generation))
    assert not refused(pieces), pieces
    assert not text_model._sessions


# ---------------------------------------------------------------------------------- saved sessions

# no "." at all: a name cannot climb out of the test's directory with ".."
NAME_CHARACTERS = st.sampled_from(list("abcXYZ019 _-/") + ["\x00", "\udcff", "\ud800", "é", "\n"])


@FUZZ
@given(name=st.one_of(st.text(NAME_CHARACTERS, max_size=300), odd_values()),
       capacity=st.one_of(st.none(), st.integers(-2, CONTEXT + 2), numbers_and_odd_values()))
@example(name="\ud800", capacity=None)  # UnicodeEncodeError
@example(name="a\x00b", capacity=None)  # ValueError: embedded null byte
@example(name="s", capacity="10")
@example(name="x\n/y", capacity=None)  # the path's line break split the message
def test_saved_session_paths(llama, name, capacity):
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/{name}" if isinstance(name, str) else name
        with llama.session(capacity=8) as session:
            session.prefill([3, 4, 5])
            saved = outcome(lambda: session.save(path), wrong_type=not isinstance(name, str))
        written = [os.path.join(root, f) for root, _, files in os.walk(folder) for f in files]
        if refused(saved):
            assert written == []  # nothing half-written
            return
        assert len(written) == 1 and os.path.samefile(written[0], path)
        restored = outcome(lambda: llama.load_session(path, capacity=capacity),
                           wrong_type=capacity is not None and not is_integer(capacity))
        if refused(restored):
            assert not llama._sessions
            return
        with restored:
            assert restored.tokens == [3, 4, 5] and restored.capacity == (8 if capacity is None else int(capacity))
    assert not llama._sessions


# ---------------------------------------------------------------------------------- command line

def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = edge.cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


PARSERS = subcommand_parsers()
FAST_COMMANDS = ("generate", "chat", "inspect", "diff", "convert", "formats")
SLOW_COMMANDS = ("bench", "calibrate")
# serve is left out: its accepted command lines start a server that runs until stopped
assert set(PARSERS) - {"serve"} == set(FAST_COMMANDS + SLOW_COMMANDS), "a new subcommand: fuzz it here"
PATH_OPTIONS = {"json", "plot", "trace"}  # written to: names inside the example's working directory
# Devices: the reference, and refused names and variants; the cpu device's arguments are fuzzed through the
# API (test_load_settings), where its kernels are compiled before the examples, not inside one.
CLI_WORDS = ["0", "1", "2", "-1", "3", "64", "65", "nan", "inf", "-inf", "1e400", "1e-320", "5e-324", "0.5", "1.5",
             str(2**63), str(10**30), str(-2**63), "", " ", "x", "\udcff", "caf\udce9", "a" * 10_000, "reference",
             "cpu:", "cpu:int9", "npu:", "npu:bogus", "reference,bogus", "reference,reference", ",", "f16",
             "int8", "int4", "int4_affine_g64", "source", "50%", "100%", "1GB", "nvme", "custom:bw=1,lat=1us",
             "custom:bw=1GB,lat=99999999999999999999s", "predictive", "mmap", "lru", "forecast", "io_uring",
             "threads", "auto:1", "none", "stress", "1,2,3", "-", "--", "-x"]
ARGV_TEXT = st.text(st.one_of(st.characters(exclude_characters="\x00"),
                              st.sampled_from(["\udc80", "\udcff", "\udce9"])), max_size=12)  # what a command line can carry: no NUL, lone surrogates only for bytes
CLI_VALUES = st.one_of(st.sampled_from(CLI_WORDS), st.integers().map(str), st.floats().map(str), ARGV_TEXT)
FILE_NAMES = st.one_of(st.sampled_from(["out.json", "out.png", "trace.npz", "-", "", "missing/x.json", "\udcff.json",
                                        "a" * 300]), st.text(st.sampled_from(list("abc_ \udcff")), max_size=8))
# --moefy values that are refused before the (minute-long) MoEfication would start
MOEFY_VALUES = st.sampled_from(["0:0", "4:0", "99999999999999999999:1", "4:9", "x", "4:2:1", "\udcff", "-4:2", "nan:1"])
WEIGHTS = ["f32", "f16", "int8", "int4", "source", "int4_affine_g64", "int8_sym_g128"]
PLAUSIBLE = {  # values an option takes, so that command lines also get past the checks and run
    "device": ["reference", "reference,reference"], "devices": ["reference,reference"],
    "memory_budget": ["50%", "100%", "1GB", "25%,100%"], "gpu_expert_cache": ["64MB", "50%"],
    "storage": ["nvme", "native", "custom:bw=500MB,lat=100us"], "strategies": ["predictive", "resident,ondemand"],
    "weights": WEIGHTS, **{f"override_{kind}": WEIGHTS for kind in ("embeddings", "attention", "ffn", "lm_head",
                                                                      "experts", "router")},
    "moefy_dense_layers": ["none", "0", "auto:1"], "random_moe": ["stress"],
}
SMALL_RUNS = {"bench": ["--prompt-tokens", "4", "--new-tokens", "3", "--repeats", "1"],
              "calibrate": ["--tokens", "32", "--requests", "2", "--prompt-tokens", "4"]}
PROMPTS = st.one_of(st.sampled_from(["the cat", "1,2,3", "", "a" * 200]), st.text(max_size=12), ARGV_TEXT)


def option_values(action: argparse.Action):
    """What a command line gives an option: a value it takes, or anything."""
    if action.dest == "moefy":
        return MOEFY_VALUES
    if action.dest in PATH_OPTIONS:
        return FILE_NAMES
    if action.choices:
        plausible = st.sampled_from([str(c) for c in action.choices])
    elif action.type is int:
        plausible = st.integers(-1, CONTEXT + 2).map(str)
    elif action.type is float:
        plausible = st.one_of(st.sampled_from(["0", "0.7", "1", "1.5"]), st.floats(-1, 3).map(str))
    elif action.dest in PLAUSIBLE:
        plausible = st.sampled_from(PLAUSIBLE[action.dest])
    else:  # free text: --system, --stop
        plausible = st.text(max_size=8)
    return st.one_of(plausible, plausible, CLI_VALUES)


@pytest.fixture(scope="module")
def cli_models(moe_path, text_files, tmp_path_factory) -> dict[str, str]:
    """The paths command lines name: the text model (also the default model), a private copy of the MoE
    (the default MoE: calibrate writes into it), the dense model without a tokenizer, the GGUF."""
    folder = tmp_path_factory.mktemp("cli_models")
    moe = shutil.copytree(moe_path, folder / "moe")
    return {"text": text_files[1], "moe": str(moe), "gguf": text_files[0]}


@pytest.fixture(scope="module")
def default_models(cli_models):
    """The built-in default models are the tiny ones: a command line without MODEL builds nothing. A command
    line without --device runs on the default device (cpu where it runs): the kernels it needs for these
    models are compiled here, not inside the first example's deadline (or only when an earlier test file
    happened to compile them)."""
    from devices.base import fastest_device

    device, _ = fastest_device()
    for name in ("text", "moe"):
        with edge.load(cli_models[name], device=device) as model:
            for _ in model.generate([1, 2], max_new_tokens=2).steps():  # a prefill and a decode step
                pass
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(edge.home, "default_model_checkpoint", lambda *a, **k: cli_models["text"])
        patch.setattr(edge.home, "default_moe_checkpoint", lambda *a, **k: cli_models["moe"])
        patch.setattr(edge.random_moe, "random_moe_checkpoint", lambda *a, **k: cli_models["moe"])
        yield cli_models


@st.composite
def command_lines(draw, commands: tuple[str, ...], models: dict[str, str], dense: str):
    command = draw(st.sampled_from(commands))
    parser = PARSERS[command]
    text_model = models["moe"] if command == "calibrate" else models["text"]  # the model the command runs
    model = st.sampled_from([text_model] * 4 + [models["text"], models["moe"], dense, "", "missing", models["gguf"],
                                                "\udcff"])
    argv = [command]
    if command in ("generate", "diff"):
        argv += [draw(model)] if draw(st.booleans()) else []
        argv.append(draw(PROMPTS))
    elif command in ("chat", "bench", "calibrate"):
        argv += [draw(model)] if draw(st.booleans()) else []
    elif command == "inspect":
        argv.append(draw(model))
    elif command == "convert":
        argv += [draw(st.sampled_from([models["gguf"], models["text"], "missing", ""])), draw(FILE_NAMES)]
    if command in SMALL_RUNS and draw(st.booleans()):  # a run that fits the tiny models (options below override it)
        argv += SMALL_RUNS[command]
    options = [a for a in parser._actions if a.option_strings and a.dest not in ("help", "quiet")]
    for action in draw(st.lists(st.sampled_from(options), max_size=3, unique_by=lambda a: a.dest)) if options else []:
        flag = action.option_strings[-1]
        if action.nargs == 0:
            argv.append(flag)
            continue
        value = draw(option_values(action))
        argv += [f"{flag}={value}"] if draw(st.booleans()) else [flag, value]
    if any("--quiet" in a.option_strings for a in parser._actions):
        argv.append("--quiet")  # stderr holds the error line alone
    return argv


def run_command_line(argv: list[str], stdin: str = "") -> tuple[int, str, str]:
    """edge.cli.main(argv) in a fresh working directory: (exit status, stdout, stderr), checked: 0, 1 (diff:
    the devices diverge) or 2 with a last stderr line `error: ...`; never a traceback. The streams are
    strict UTF-8 ones, as a terminal's are, read back with argv's bytes as they were written."""
    streams = {name: io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)
               for name in ("stdout", "stderr")}
    with tempfile.TemporaryDirectory() as cwd, contextlib.chdir(cwd), no_hang():
        saved = sys.stdin, sys.stdout, sys.stderr
        sys.stdin, sys.stdout, sys.stderr = io.StringIO(stdin), streams["stdout"], streams["stderr"]
        try:
            code = edge.cli.main(argv)
        except SystemExit as exit:  # a usage error: argparse's, printed as one `error:` line
            code = exit.code
        finally:
            sys.stdin, sys.stdout, sys.stderr = saved
    out, err = (streams[name].buffer.getvalue().decode("utf-8", "surrogateescape") for name in ("stdout", "stderr"))
    count(f"{argv[0]}: exit status {code}")
    assert code in (0, 1, 2), (code, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    if code == 2:
        lines = err.splitlines()
        assert lines and lines[-1].startswith("error: "), err[-2000:]
        assert sum(line.startswith("error") for line in lines) == 1, err[-2000:]
    return code, out, err


@FUZZ
@given(data=st.data())
def test_command_lines(default_models, dense_path, data):
    argv = data.draw(command_lines(FAST_COMMANDS, default_models, dense_path), label="argv")
    stdin = "\n".join(data.draw(st.lists(st.one_of(st.text(max_size=12), ARGV_TEXT), max_size=2), label="stdin lines"))
    run_command_line(argv, stdin)


@SLOW_FUZZ
@given(data=st.data())
def test_measuring_command_lines(default_models, dense_path, data):
    run_command_line(data.draw(command_lines(SLOW_COMMANDS, default_models, dense_path), label="argv"))


@pytest.mark.parametrize("argv, message", [
    (["generate", "", "Hi"], "MODEL is empty; name a checkpoint directory, or leave MODEL out for the default model"),
    (["convert", "", "out"], "SRC is empty; name a Hugging Face model folder or a .gguf file"),  # was " does not exist"
    (["bench", "{text}", "--prompt-tokens", "99999999999999", "--quiet"],  # was a MemoryError
     "99999999999999 prompt + 128 new tokens exceed the model's context of 64 tokens; lower --prompt-tokens or "
     "--new-tokens"),
    (["bench", "{text}", "--repeats", str(10**18), "--quiet"],  # ran for ever
     f"--repeats must be at most 100, got {10**18}: the median of more runs says nothing new, and a count that "
     "large would run for days"),
    (["calibrate", "{moe}", "--depth", "99999999999999999", "--tokens", "64", "--requests", "2", "--prompt-tokens",
      "4", "--no-save", "--quiet"],  # replayed 10**17 lookaheads
     "--depth 99999999999999999 looks further ahead than the model's 2 MoE layers; give --depth of at most 2"),
    (["diff", "{text}", "caf\udce9", "--quiet"],  # the tokenizers library's TypeError
     "the text is not valid Unicode: character 3 is the byte 0xe9, which is not UTF-8; give UTF-8 text (on the "
     "command line, check the terminal's encoding)"),
    (["diff", "{text}", "1,2,99999999999999999999", "--ids", "--quiet"],  # "got object values such as 1"
     "token id 99999999999999999999 is outside the vocabulary [0, 260)"),
    (["diff", "{text}", "hi", "--devices=--", "--quiet"],  # argparse gave the option [], a str's AttributeError
     "diff compares exactly two devices, got 1: --"),
    (["bench", "--prompt-tokens=--", "--quiet"],  # [] < 1: TypeError
     "zllm-edge bench: argument --prompt-tokens: invalid int value: '--' (see zllm-edge bench --help)"),
    (["calibrate", "{moe}", "--json", "a" * 250, "--no-save", "--quiet"],  # an OSError once the recording was done
     f"--json {'a' * 250}: cannot write there, file name too long; choose a file in an existing, writable directory"),
    (["inspect", "no\nsuch"],  # the path's line break split the error line
     "no\\nsuch is not a directory; a zllm checkpoint is a directory made by `zllm-edge convert`"),
    (["generate", "{text}", "Hi", "--storage", "x", "--quiet"],  # ignored by a dense model
     "storage 'x' is not known; use one of native, nvme, ufs, emmc, sd, or custom:bw=SIZE,lat=TIME such as "
     "custom:bw=500MB,lat=200us (bandwidth per second)"),
])
def test_command_lines_that_once_failed(default_models, argv, message):
    argv = [a.format(**default_models) for a in argv]
    code, out, err = run_command_line(argv)
    assert (code, err) == (2, f"error: {message}\n")


# ---------------------------------------------------------------------------------- real command lines

def run_bytes(*argv: bytes, stdin: bytes = b"", cwd: Path) -> subprocess.CompletedProcess:
    """`python -m edge.cli` with argv as raw bytes, in a UTF-8 locale whose standard streams are strict
    (PYTHONIOENCODING), as a desktop terminal's are."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PYTHONIOENCODING": "utf-8", "LC_ALL": "C.UTF-8"}
    return subprocess.run([sys.executable, "-m", "edge.cli", *argv], cwd=cwd, env=env, input=stdin,
                          capture_output=True, timeout=300)


def test_bytes_that_are_not_utf8_on_a_real_command_line(text_files, tmp_path):
    _, text = text_files
    odd = tmp_path / os.fsdecode(b"model-\xff")
    odd.symlink_to(text)  # a checkpoint whose name is not UTF-8
    named = os.fsencode(odd)

    result = run_bytes(b"generate", text.encode(), b"caf\xe9", cwd=tmp_path)
    assert (result.returncode, result.stdout) == (2, b"")
    assert result.stderr == (b"error: the text is not valid Unicode: character 3 is the byte 0xe9, which is not "
                             b"UTF-8; give UTF-8 text (on the command line, check the terminal's encoding)\n")

    result = run_bytes(b"generate", text.encode(), b"Hi", b"--device", b"cpu\xff", b"--quiet", cwd=tmp_path)
    assert (result.returncode, result.stderr) == (
        2, b"error: device 'cpu\\udcff' is not available; available devices: reference, cpu, gpu, npu\n")

    result = run_bytes(b"generate", text.encode(), b"Hi", b"--memory-budget", b"5\xff", b"--quiet", cwd=tmp_path)
    assert (result.returncode, result.stderr) == (
        2, b"error: memory budget '5\\udcff' not understood; use bytes, a size such as 512MB or 2GiB, or a share of "
           b"the expert bytes such as 50%\n")

    result = run_bytes(b"generat\xff", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.startswith(b"error: zllm-edge: argument command: invalid choice")
    assert result.stderr.count(b"\n") == 1

    # the path is printed back as the bytes it was given (it was a UnicodeEncodeError on a strict stdout)
    result = run_bytes(b"inspect", named, cwd=tmp_path)
    assert (result.returncode, result.stderr) == (0, b"")
    assert result.stdout.startswith(named + b": zllm format 1, from gguf:text.gguf\n")

    # and it runs: its tokenizer is read by a path that is not UTF-8 either
    result = run_bytes(b"generate", named, b"Hi", b"--max-new-tokens", b"2", b"--device", b"reference", b"--quiet",
                       cwd=tmp_path)
    assert (result.returncode, result.stderr) == (0, b"")

    result = run_bytes(b"convert", text_files[0].encode(), b"out-\xff", b"--quiet", cwd=tmp_path)
    assert (result.returncode, result.stderr) == (0, b""), result.stderr
    assert (tmp_path / os.fsdecode(b"out-\xff") / "zllm.json").is_file()


def test_a_chat_line_that_is_not_utf8_is_refused_by_name(text_files, tmp_path):
    """stdin is strict too: the line's byte was a UnicodeDecodeError traceback."""
    result = run_bytes(b"chat", text_files[1].encode(), b"--max-new-tokens", b"2", b"--quiet", stdin=b"caf\xe9\n",
                       cwd=tmp_path)
    assert (result.returncode, result.stdout) == (2, b"")
    assert result.stderr == (b"error: the line read from stdin is not valid Unicode: character 3 is the byte 0xe9, "
                             b"which is not UTF-8; give UTF-8 text (on the command line, check the terminal's "
                             b"encoding)\n")
