"""`zllm-edge serve` (edge/serve.py): started on 127.0.0.1, port 0, in a subprocess, and spoken to with the
real `openai` package and raw HTTP. SmolLM2 on the cpu device, one thread."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import edge  # noqa: E402

START_SECONDS = 600  # a cold Numba cache compiles the cpu kernels first (a minute; more on a busy machine)
KV_CAPACITY = 512
SERVE_ARGS = ["--device", "cpu", "--threads", "1", "--kv-capacity", str(KV_CAPACITY)]


class ServerProcess:
    """`zllm-edge serve` in a subprocess; `url` once it said where it listens."""

    def __init__(self, checkpoint, *extra: str):
        command = [sys.executable, "-m", "edge.cli", "serve", str(checkpoint), "--port", "0", *SERVE_ARGS, *extra]
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.lines: list[str] = []
        found = threading.Event()
        self.url = None

        def read():
            for line in self.process.stderr:
                self.lines.append(line)
                match = re.match(r"serving .* on (http://[^\s{}]+)/v1 ", line)
                if match and self.url is None:
                    self.url = match.group(1)
                    found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(START_SECONDS):
            self.stop()
            pytest.fail(f"the server did not start: {''.join(self.lines)[-2000:]}")

    def client(self, **kwargs):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kwargs.pop("api_key", "none"), max_retries=0,
                             timeout=120, **kwargs)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


@pytest.fixture(scope="module")
def server(smollm2_checkpoint):
    process = ServerProcess(smollm2_checkpoint)
    yield process
    process.stop()
    # SIGTERM: uvicorn finishes the requests in flight, then the command ends as the CLI ends on SIGTERM
    assert process.process.returncode == 128 + signal.SIGTERM, "".join(process.lines)[-2000:]
    assert "Traceback" not in "".join(process.lines)


@pytest.fixture(scope="module")
def local_model(smollm2_checkpoint):
    """The same checkpoint and device in this process: what `zllm-edge generate` gives."""
    with edge.load(str(smollm2_checkpoint), device="cpu", threads=1, kv_capacity=KV_CAPACITY) as model:
        yield model


def _greedy(model, prompt, max_new_tokens: int, chat: bool = False) -> str:
    if chat:
        generation = model.chat(prompt, max_new_tokens=max_new_tokens)
    else:
        generation = model.generate(prompt, max_new_tokens=max_new_tokens)
    return "".join(generation)


def _model_name(server) -> str:
    return server.client().models.list().data[0].id


def test_health_and_models(server, smollm2_checkpoint):
    assert server.health() == {"status": "ok", "requests_running": 0, "sessions_kept": 0, "kv_positions_held": 0,
                               "kv_positions_reserved": None}
    models = server.client().models.list().data
    assert [m.id for m in models] == [os.path.basename(str(smollm2_checkpoint))]


def test_a_greedy_completion_says_paris_and_equals_generate(server, local_model):
    prompt = "The capital of France is"
    completion = server.client().completions.create(model=_model_name(server), prompt=prompt, max_tokens=12,
                                                    temperature=0)
    text = completion.choices[0].text
    assert text.startswith(" Paris")
    assert text == _greedy(local_model, prompt, 12)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.prompt_tokens == len(local_model.encode(prompt))
    assert completion.usage.completion_tokens == 12


def test_chat_streamed_and_whole_give_the_same_reply(server, local_model):
    messages = [{"role": "user", "content": "Name three colours."}]
    client = server.client()
    whole = client.chat.completions.create(model=_model_name(server), messages=messages, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model=_model_name(server), messages=messages, max_tokens=24,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reply = whole.choices[0].message
    assert reply.role == "assistant"
    assert reply.content == streamed == _greedy(local_model, messages, 24, chat=True)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


CITY = {"type": "object", "additionalProperties": False, "required": ["capital", "country"],
        "properties": {"capital": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24}}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_response_validates(server, stream):
    jsonschema = pytest.importorskip("jsonschema")
    client = server.client()
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    kwargs = dict(model=_model_name(server), max_tokens=80, seed=3, response_format=response_format,
                  messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}])
    if stream:
        chunks = client.chat.completions.create(stream=True, **kwargs)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    jsonschema.validate(json.loads(text), CITY)


def test_a_json_object_response_parses(server):
    reply = server.client().chat.completions.create(
        model=_model_name(server), max_tokens=120, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe a cat as a JSON object with two short fields."}])
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # cut by max_tokens: a prefix of an object
        assert reply.choices[0].message.content.lstrip().startswith("{")


def test_a_stream_ends_with_done(server):
    body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_sampling_with_a_seed_repeats(server):
    client = server.client()
    kwargs = dict(model=_model_name(server), prompt="My favourite food is", max_tokens=10, temperature=1.0, seed=7)
    first, second = (client.completions.create(**kwargs).choices[0].text for _ in range(2))
    assert first == second


def test_concurrent_streams_each_get_the_tokens_they_get_alone(server, local_model):
    prompts = ["The capital of France is", "One, two, three,", "def fibonacci(n):", "The sky is"]
    expected = [_greedy(local_model, p, 16) for p in prompts]
    client = server.client()

    def stream(prompt):
        chunks = client.completions.create(model=_model_name(server), prompt=prompt, max_tokens=16, temperature=0,
                                           stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(stream, prompts)) == expected


def test_a_client_that_disconnects_stops_its_generation(server):
    body = {"prompt": "1, 2, 3, 4, 5, 6, 7,", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert server.health()["requests_running"] == 1
    deadline = time.monotonic() + 10
    while server.health()["requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.health()["requests_running"] == 0
    # and it still serves
    assert server.client().completions.create(model=_model_name(server), prompt="Hi", max_tokens=2,
                                              temperature=0).choices[0].text


def _post(server, path: str, content: bytes | str, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=content, timeout=60,
                      headers={"content-type": "application/json", **(headers or {})})


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "must be a JSON object"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "prompt must be a non-empty string"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", "prompt must be a non-empty string"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", "temperature must be a number"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, None, "NaN is not a JSON number"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens must be an integer >= 1"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens", "more than the model's context"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens", "must be an integer"),
    ("/v1/completions", {"prompt": "hi", "top_p": 3}, 400, "top_p", "top_p must be a number in [0, 1]"),
    ("/v1/completions", {"prompt": "hi", "seed": "x"}, 400, "seed", "seed must be an integer"),
    ("/v1/completions", {"prompt": "hi", "stop": [1]}, 400, "stop", "stop must be a string or a list of strings"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream", "stream must be true or false"),
    ("/v1/completions", {"prompt": "hi", "n": 3}, 400, "n", "n must be 1"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    ("/v1/completions", {"prompt": "word " * 600, "max_tokens": 1}, 400, None, "more than the model's kv_capacity"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model", 'the model "gpt-4" does not exist'),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "messages must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, None, "content"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages", "messages must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     400, "tools", "tools[0] must be {\"type\": \"function\", \"function\""),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "xml"}}, 400, "response_format", 'type "xml" is not known'),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     400, "response_format", "json_schema needs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     400, "response_format", "the json schema grammar cannot be compiled"),
    ("/v1/nowhere", {}, 404, None, "no such endpoint"),
]


@pytest.mark.parametrize("path, body, status, param, message", BAD_REQUESTS,
                         ids=[f"{i}-{case[4][:30]}" for i, case in enumerate(BAD_REQUESTS)])
def test_a_bad_request_gets_an_openai_error_and_the_server_keeps_serving(server, path, body, status, param, message):
    content = body if isinstance(body, bytes) else json.dumps(body)
    response = _post(server, path, content)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"]
    assert error["param"] == param
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in response.text
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_an_oversized_body_is_refused_before_it_is_read(server):
    response = _post(server, "/v1/completions", b"{" + b" " * (5 << 20) + b"}")
    assert response.status_code == 413
    assert "more than" in response.json()["error"]["message"]


def test_a_wrong_method_is_refused(server):
    response = httpx.get(f"{server.url}/v1/completions", timeout=10)
    assert response.status_code == 405
    assert response.json()["error"]["message"] == "GET is not allowed on /v1/completions"


def test_an_api_key_is_checked_on_every_request(smollm2_checkpoint):
    server = ServerProcess(smollm2_checkpoint, "--api-key", "s3cret")
    try:
        with pytest.raises(openai.AuthenticationError, match="invalid or missing API key"):
            server.client(api_key="wrong").models.list()
        response = _post(server, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 1}))
        assert response.status_code == 401
        good = server.client(api_key="s3cret")
        assert good.completions.create(model=_model_name_with(good), prompt="Hi", max_tokens=1, temperature=0)
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # health needs no key
    finally:
        server.stop()


def _model_name_with(client) -> str:
    return client.models.list().data[0].id


def test_requests_wait_for_kv_positions_under_a_memory_budget(smollm2_checkpoint):
    """Two requests that each need more than half of the KV positions the budget reserves: the second waits
    for the first to finish instead of failing, and both get their tokens."""
    server = ServerProcess(smollm2_checkpoint, "--memory-budget", "2GB")
    try:
        reserved = server.health()["kv_positions_reserved"]
        assert reserved == KV_CAPACITY
        client = server.client()
        name = _model_name_with(client)
        prompt = "The capital of France is"
        asks = KV_CAPACITY // 2 + 50

        def complete(_):
            return client.completions.create(model=name, prompt=prompt, max_tokens=asks, temperature=0,
                                             stop=["\n\n\n\n\n\n"]).choices[0].text

        with ThreadPoolExecutor(2) as pool:
            first, second = pool.map(complete, range(2))
        assert first == second and first.startswith(" Paris")
        health = server.health()  # what is held now is held by the sessions kept for a next turn
        assert health["requests_running"] == 0 and health["sessions_kept"] >= 1
        assert health["kv_positions_held"] == KV_CAPACITY * health["sessions_kept"]
    finally:
        server.stop()


def test_serve_refuses_a_port_it_cannot_use(smollm2_checkpoint):
    result = subprocess.run([sys.executable, "-m", "edge.cli", "serve", str(smollm2_checkpoint), "--port", "70000"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --port must be in [0, 65535], got 70000"


def test_a_conversation_continued_reuses_the_kv_of_its_earlier_turns(server, local_model):
    """The second turn's prompt starts with the first turn's prompt and reply: the server continues the first
    request's session (timings.cache_n tokens reused, only the rest computed) and answers what the library
    answers when the same session continues (model.chat(..., session=))."""
    client = server.client()
    messages = [{"role": "user", "content": "Name a large city in Japan."}]
    first = client.chat.completions.create(model=_model_name(server), messages=messages, max_tokens=12,
                                           temperature=0)
    with local_model.session(capacity=KV_CAPACITY) as session:
        assert "".join(local_model.chat(messages, max_new_tokens=12, session=session)) == \
            first.choices[0].message.content
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And one in Brazil?"}]
        raw = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                         json={"messages": messages, "max_tokens": 12, "temperature": 0}).json()
        assert "choices" in raw, raw
        expected = local_model.chat(messages, max_new_tokens=12, session=session)
        assert raw["choices"][0]["message"]["content"] == "".join(expected)
    reused = expected.result.timings["prompt_tokens_reused"]
    assert reused > len(local_model.encode(first.choices[0].message.content)), reused
    assert raw["timings"]["cache_n"] == reused
    assert raw["timings"]["cache_n"] + raw["timings"]["prompt_n"] == len(expected.result.prompt_tokens)
    assert server.health()["sessions_kept"] >= 1
