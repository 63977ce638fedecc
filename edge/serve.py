"""`zllm-edge serve`: an OpenAI-compatible HTTP server over one loaded model (Starlette on uvicorn).

    POST /v1/chat/completions   messages through the checkpoint's chat template
    POST /v1/completions        a plain prompt
    GET  /v1/models             the one model served
    GET  /health                {"status": "ok", the requests generating now and the KV positions they hold}

Requests and responses are OpenAI's: `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `seed`,
`stop`, `stream` (server-sent events ending in `data: [DONE]`, with `stream_options.include_usage`), `usage`,
`finish_reason` "stop" / "length". Tokens are chosen by the library's own sampler (`model.generate`), so a
greedy request (`temperature: 0`) gives the tokens `zllm-edge generate` gives. A request that names no
sampling settings samples as the checkpoint's generation_config.json says, else with llama.cpp's and Ollama's
defaults (`Model.conversation_sampling`); fields a request sets win over either. Beside OpenAI's fields a
response carries llama-server's `timings` and the sampler's `seed`, so that any sample can be repeated.

Several clients: each request gets its own session (its own KV cache) and runs on a thread of its own; the
model's forward lock interleaves their prefill and decode steps, one step at a time, so every request gets
the tokens it would get alone. Under a memory budget the sessions share the KV positions it reserves: a
request waits until the positions it needs are free. A client that goes away stops its generation at the
next step, and its session (and KV) is freed at once.

Bad requests get OpenAI-style JSON errors ({"error": {"message", "type", "param", "code"}}) with a 4xx
status, and the server keeps serving.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass

from edge.constrained import Grammar, GrammarError
from edge.core.arguments import is_integer, is_number
from edge.core.errors import InvalidArgumentError, SessionError, ZllmError
from edge.tools import ToolsError, check_tools, parse_tool_calls, tool_call_grammar

MAX_BODY_BYTES = 4 << 20  # a request body larger than this is refused (413) before it is parsed
MAX_STOP_STRINGS = 4  # as OpenAI
ADMISSION_POLL_SECONDS = 0.1  # how often a request waiting for KV positions looks whether its client left
DISCONNECT_POLL_SECONDS = 0.25  # how often a non-streamed request looks whether its client left
CACHED_SESSIONS = 4  # finished requests' sessions kept for a request that continues their conversation
SESSION_HEADROOM = 1024  # positions a request's session holds beyond its own, for the conversation's next turns


class ApiError(Exception):
    """An error answered as OpenAI answers it: an HTTP status and {"error": {...}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


# --- requests ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """A checked completion request: what to generate and how."""

    prompt: str | list[dict]  # text (completions) or messages (chat)
    generation: dict           # keyword arguments of model.generate / model.chat
    stream: bool
    include_usage: bool
    tools: bool = False  # tools were offered: the reply's calls are parsed into tool_calls


def _optional(body: dict, name: str, check, message: str):
    value = body.get(name)
    if value is None:
        return None
    if not check(value):
        raise _invalid(name, f"{name} {message}, got {json.dumps(value)[:80]}")
    return value


def _max_tokens(body: dict, context: int) -> int | None:
    names = [n for n in ("max_completion_tokens", "max_tokens") if body.get(n) is not None]
    if len(names) == 2 and body["max_tokens"] != body["max_completion_tokens"]:
        raise _invalid("max_tokens", "max_tokens and max_completion_tokens differ; give one of them")
    if not names:
        return None
    name = names[0]
    value = _optional(body, name, lambda v: is_integer(v, 1), "must be an integer >= 1")
    if value > context:
        raise _invalid(name, f"{name} is {value}, more than the model's context of {context} tokens; "
                             f"ask for at most {context}")
    return int(value)


def _stop(body: dict) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    strings = [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise _invalid("stop", "stop must be a string or a list of strings")
    if len(strings) > MAX_STOP_STRINGS:
        raise _invalid("stop", f"stop holds {len(strings)} strings; at most {MAX_STOP_STRINGS} are allowed")
    return strings


def _refuse_unsupported(body: dict) -> None:
    """Parameters this server does not implement are refused by name, never ignored."""
    if body.get("n") not in (None, 1):
        raise _invalid("n", "n must be 1: one choice per request")
    for name in ("frequency_penalty", "presence_penalty"):
        value = body.get(name)
        if value is not None and (not is_number(value) or value != 0):
            raise _invalid(name, f"{name} is not supported; leave it out or give 0")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise _invalid("logprobs", "logprobs are not supported; leave logprobs and top_logprobs out")
    if body.get("logit_bias"):
        raise _invalid("logit_bias", "logit_bias is not supported; leave it out")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise _invalid("functions", "functions and function_call are OpenAI's older form; give tools and tool_choice")


def _grammar(body: dict) -> Grammar | None:
    """response_format -> the Grammar the reply must match: {"type": "text"} (none), {"type": "json_object"},
    or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}."""
    response_format = body.get("response_format")
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind == "json_schema":
        described = response_format.get("json_schema")
        schema = described.get("schema") if isinstance(described, dict) else None
        if not isinstance(schema, dict):
            raise _invalid("response_format", "response_format json_schema needs {\"json_schema\": {\"name\": ..., "
                                              "\"schema\": {...}}}")
        return Grammar.json_schema(schema)
    raise _invalid("response_format", f"response_format type {json.dumps(kind)[:40]} is not known; use text, "
                                      "json_object or json_schema")


def _with_parsed_arguments(message):
    """An assistant message's earlier tool calls as templates render them: OpenAI sends each call's arguments
    as JSON text, templates write them as an object (so does llama-server)."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not isinstance(calls, list):
        return message
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = json.loads(function["arguments"])
            except ValueError:
                raise _invalid("messages", f"a tool call's arguments are not JSON: {function['arguments'][:80]!r}") \
                    from None
            call = {**call, "function": {**function, "arguments": arguments}}
        parsed.append(call)
    return {**message, "tool_calls": parsed}


def _tools(body: dict, chat: bool, grammar: Grammar | None) -> tuple[list[dict] | None, Grammar | None]:
    """tools and tool_choice -> (the tools the template offers, the grammar a required call imposes)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise _invalid("tool_choice", "tool_choice asks for a tool call, and the request offers no tools")
        return None, grammar
    if not chat:
        raise _invalid("tools", "tools are offered through a chat template: use /v1/chat/completions")
    try:
        check_tools(tools)
        if choice in (None, "auto"):
            return tools, grammar
        if choice == "none":
            return None, grammar
        if grammar is not None:
            raise _invalid("tool_choice", "a required tool call and response_format cannot both shape the reply; "
                                          "give one of them")
        if choice == "required":
            return tools, tool_call_grammar(tools)
        function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _invalid("tool_choice", 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                                          '"function": {"name": ...}}')
        return tools, tool_call_grammar(tools, function["name"])
    except ToolsError as exc:
        raise _invalid("tool_choice" if "tool_choice" in str(exc) else "tools", str(exc)) from None


def parse_request(body, chat: bool, context: int, sampling: dict) -> Request:
    """A completions or chat completions request body -> Request, or ApiError(400) naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _refuse_unsupported(body)
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _invalid("messages", "messages must be a non-empty list of {\"role\", \"content\"} objects")
        prompt = [_with_parsed_arguments(message) for message in messages]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]  # a batch of one
        if not isinstance(prompt, str) or not prompt:
            raise _invalid("prompt", "prompt must be a non-empty string (one prompt per request)")
    generation = dict(sampling)  # what a request that sets no sampling field gets (the model's conversation sampling)
    sampling = {
        "temperature": _optional(body, "temperature", lambda v: is_number(v) and 0 <= v <= 2,
                                 "must be a number in [0, 2] (0 = greedy)"),
        "top_p": _optional(body, "top_p", lambda v: is_number(v) and 0 <= v <= 1, "must be a number in [0, 1]"),
        "top_k": _optional(body, "top_k", lambda v: is_integer(v, 0), "must be an integer >= 0 (0 = no limit)"),
        "min_p": _optional(body, "min_p", lambda v: is_number(v) and 0 <= v <= 1, "must be a number in [0, 1]"),
    }
    generation.update({name: value for name, value in sampling.items() if value is not None})
    seed = _optional(body, "seed", lambda v: is_integer(v) and -1 <= v < 2**63, "must be an integer in [-1, 2^63)")
    generation["seed"] = seed
    generation["stop"] = _stop(body)
    tools, generation["grammar"] = _tools(body, chat, _grammar(body))
    if tools is not None:
        generation["tools"] = tools
    max_tokens = _max_tokens(body, context)
    if max_tokens is not None:
        generation["max_new_tokens"] = max_tokens
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _invalid("stream", "stream must be true or false")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool)):
        raise _invalid("stream_options", "stream_options must be an object such as {\"include_usage\": true}")
    return Request(prompt, generation, stream, bool(options and options.get("include_usage")), tools is not None)


# --- KV positions under a memory budget --------------------------------------------------------------


class KvPositions:
    """The KV positions a memory budget reserves, shared by the requests' sessions: a request takes the
    positions its session will hold before it opens it, waiting while others hold them."""

    def __init__(self, total: int | None):
        self.total = total
        self.held = 0
        self._changed = threading.Condition()
        self.make_room = lambda: False  # frees an idle session's positions (SessionPool), True if it did

    def take(self, n: int, gone: threading.Event) -> bool:
        """Hold n positions, closing idle sessions kept for reuse before waiting for running requests;
        False if the client went away while waiting."""
        if self.total is None:
            return True
        while True:
            with self._changed:
                if self.held + n <= self.total:
                    self.held += n
                    return True
                if gone.is_set():
                    return False
            if not self.make_room():  # (outside the lock: closing a session gives its positions back)
                with self._changed:
                    if self.held + n > self.total:
                        self._changed.wait(ADMISSION_POLL_SECONDS)

    def give_back(self, n: int) -> None:
        if self.total is None:
            return
        with self._changed:
            self.held -= n
            self._changed.notify_all()


# --- sessions kept for the next turn -----------------------------------------------------------------


class SessionPool:
    """Sessions of finished requests, kept (at most `size`, the least recently used closed first) so that a
    request continuing a conversation reuses the KV of its earlier turns: a session is taken by a request
    whose prompt starts with the whole prompt the session answered (a continuation, not a request that
    merely shares a system prompt or repeats one: those compute from scratch, so that a request and its
    repetition get the same bits). Each holds its positions of a memory budget until it is reused or
    closed; a request that needs positions closes idle sessions before it waits for running ones."""

    def __init__(self, model, size: int, positions: KvPositions):
        self.model, self.size, self.positions = model, size, positions
        self._idle: list = []  # least recently used first
        self._lock = threading.Lock()
        positions.make_room = self.close_oldest

    def capacity(self, needed: int) -> int:
        """Positions of a request's session: what it needs plus room for the conversation's next turns,
        within the context and a memory budget's reservation."""
        ceiling = min(self.model.generation_limit()[0], self.positions.total or needed + SESSION_HEADROOM)
        return max(needed, min(needed + SESSION_HEADROOM, ceiling)) if self.size else needed

    def take(self, ids: list[int], capacity: int):
        """The idle session that holds the longest prefix of ids and has room for `capacity` positions
        (removed from the pool), or None."""
        with self._lock:
            continued = []  # (tokens reused, index)
            for index, (session, answered) in enumerate(self._idle):
                reused = session.reusable_prefix(ids)
                if session.capacity >= capacity and answered < len(ids) and reused >= answered:
                    continued.append((reused, index))
            if not continued:
                return None
            return self._idle.pop(max(continued)[1])[0]

    def put(self, session, answered: int) -> None:
        """Keep a session that answered a prompt of `answered` tokens."""
        with self._lock:
            self._idle.append((session, answered))
            over = self._idle[:-self.size] if self.size else list(self._idle)
            del self._idle[:len(over)]
        for old, _ in over:
            self._close(old)

    def discard(self, session) -> None:
        """Close a session taken from the pool or opened for it, giving its positions back."""
        self._close(session)

    def close_oldest(self) -> bool:
        with self._lock:
            oldest = self._idle.pop(0)[0] if self._idle else None
        if oldest is not None:
            self._close(oldest)
        return oldest is not None

    def _close(self, session) -> None:
        capacity = session.capacity
        session.close()
        self.positions.give_back(capacity)

    def __len__(self) -> int:
        with self._lock:
            return len(self._idle)


# --- running a generation ----------------------------------------------------------------------------


def _finish_reason(result) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def _usage(result) -> dict:
    prompt, completion = len(result.prompt_tokens), len(result.tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _timings(result) -> dict:
    """llama-server's timings: milliseconds and tokens per second of the prompt and of the generated tokens."""
    timings = result.timings
    reused = timings["prompt_tokens_reused"]
    return {"cache_n": reused, "prompt_n": len(result.prompt_tokens) - reused, "prompt_ms": 1e3 * timings["prefill_seconds"],
            "prompt_per_second": timings["prefill_tokens_per_second"],
            "predicted_n": len(result.tokens), "predicted_ms": 1e3 * timings["decode_seconds"],
            "predicted_per_second": timings["decode_tokens_per_second"]}


class Run:
    """One request's generation on a thread of its own. The thread hands out events through `deliver`
    (called on that thread): ("text", piece), then ("done", result) or ("error", ZllmError); setting `gone`
    stops it at the next step and closes the generation, which frees its session."""

    def __init__(self, generation, pool: SessionPool, deliver, running: "RunningRequests"):
        self.generation, self.pool, self.deliver, self.running = generation, pool, deliver, running
        self.positions = pool.positions
        self.gone = threading.Event()
        result = generation.result
        needed = min(len(result.prompt_tokens) + generation.options.max_new_tokens,
                     generation.model.generation_limit()[0])
        self.positions_needed = pool.capacity(needed)
        self.thread = threading.Thread(target=self._run, name="zllm-serve-request", daemon=True)
        running.add(self)
        self.thread.start()

    def _run(self) -> None:
        try:
            self._generate()
        finally:
            self.running.remove(self)

    def _generate(self) -> None:
        generation, model = self.generation, self.generation.model
        prompt = generation.result.prompt_tokens
        try:
            session = self.pool.take(prompt, self.positions_needed)
            if session is None:
                if not self.positions.take(self.positions_needed, self.gone):
                    return
                try:
                    session = model.session(capacity=self.positions_needed)
                except BaseException:
                    self.positions.give_back(self.positions_needed)
                    raise
            kept = False
            try:  # the request's generation, in the session it continues or the one opened for it
                generation.run_in(session)
                for step in generation.steps():
                    if self.gone.is_set():
                        break
                    if step.text:
                        self.deliver(("text", step.text))
                else:
                    self.deliver(("done", generation.result))
                    kept = True
            finally:
                generation.close()
                if kept and self.pool.size:
                    self.pool.put(session, len(prompt))
                else:  # a request stopped early or failed: its session is not kept
                    self.pool.discard(session)
        except ZllmError as exc:
            self.deliver(("error", exc))
        except Exception as exc:  # a defect: the client gets a 500, the server keeps serving
            self.deliver(("error", exc))


class RunningRequests:
    """The requests generating now (GET /health reports them)."""

    def __init__(self):
        self._runs: set[Run] = set()
        self._lock = threading.Lock()

    def add(self, run: Run) -> None:
        with self._lock:
            self._runs.add(run)

    def remove(self, run: Run) -> None:
        with self._lock:
            self._runs.discard(run)

    def __len__(self) -> int:
        with self._lock:
            return len(self._runs)


def _api_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, GrammarError):
        return ApiError(400, str(exc), param="response_format")
    if isinstance(exc, ToolsError):
        return ApiError(400, str(exc), param="tools")
    if isinstance(exc, (InvalidArgumentError, SessionError)):
        return ApiError(400, str(exc))
    if isinstance(exc, ZllmError):
        return ApiError(500, str(exc), kind="server_error")
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")


# --- the application --------------------------------------------------------------------------------


class Server:
    """The endpoints over one loaded model."""

    def __init__(self, model, model_name: str, api_key: str | None = None, cached_sessions: int = CACHED_SESSIONS):
        self.model, self.model_name, self.api_key = model, model_name, api_key
        self.created = int(time.time())
        budgeted = model.memory_budget is not None
        self.positions = KvPositions(model.session_ceiling() if budgeted else None)
        self.pool = SessionPool(model, cached_sessions, self.positions)
        self.running = RunningRequests()
        self.context = model.generation_limit()[0]
        self.sampling = model.conversation_sampling()[0]

    def app(self):
        from starlette.applications import Starlette
        from starlette.routing import Route

        routes = [Route("/health", self.health, methods=["GET"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"])]
        return Starlette(routes=routes, exception_handlers={404: self._not_found, 405: self._not_allowed})

    # --- plumbing --------------------------------------------------------------------------------
    @staticmethod
    def _error_response(error: ApiError):
        from starlette.responses import JSONResponse

        return JSONResponse(error.body(), status_code=error.status)

    async def _not_found(self, request, exc):
        return self._error_response(ApiError(404, f"no such endpoint: {request.method} {request.url.path}",
                                             code="not_found"))

    async def _not_allowed(self, request, exc):
        return self._error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                                             code="method_not_allowed"))

    def _authorize(self, request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key", kind="authentication_error")

    async def _body(self, request) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body has {declared} bytes, more than {MAX_BODY_BYTES}")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        try:
            return json.loads(raw, parse_constant=_refuse_constant)
        except (ValueError, RecursionError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None

    def _check_model(self, body) -> None:
        name = body.get("model") if isinstance(body, dict) else None
        if name is not None and name != self.model_name:
            raise ApiError(404, f"the model {json.dumps(name)[:80]} does not exist; this server serves "
                                f"{self.model_name!r} (GET /v1/models)", param="model", code="model_not_found")

    # --- endpoints -------------------------------------------------------------------------------
    async def health(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok", "requests_running": len(self.running), "sessions_kept": len(self.pool),
                             "kv_positions_held": self.positions.held, "kv_positions_reserved": self.positions.total})

    async def models(self, request):
        from starlette.responses import JSONResponse

        try:
            self._authorize(request)
        except ApiError as error:
            return self._error_response(error)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "zllm-edge"}]})

    async def chat_completions(self, request):
        return await self._complete(request, chat=True)

    async def completions(self, request):
        return await self._complete(request, chat=False)

    async def _complete(self, request, chat: bool):
        try:
            self._authorize(request)
            body = await self._body(request)
            self._check_model(body)
            parsed = parse_request(body, chat, self.context, self.sampling)
            generation = self._generation(parsed, chat)
        except (ApiError, ZllmError) as exc:
            return self._error_response(_api_error(exc))
        reply = Reply(self.model_name, chat, parsed.tools)
        if parsed.stream:
            return self._streamed(request, generation, reply, parsed.include_usage)
        return await self._whole(request, generation, reply)

    def _generation(self, parsed: Request, chat: bool):
        if chat:
            if not self.model.tokenizer.chat_template:
                raise ApiError(400, f"the model {self.model_name!r} has no chat template; use /v1/completions",
                               param="messages", code="no_chat_template")
            return self.model.chat(parsed.prompt, **parsed.generation)
        return self.model.generate(parsed.prompt, **parsed.generation)

    async def _whole(self, request, generation, reply: "Reply"):
        from starlette.responses import JSONResponse

        loop = asyncio.get_running_loop()
        finished = loop.create_future()
        pieces: list[str] = []

        def deliver(event):  # on the request's thread
            kind, value = event
            if kind == "text":
                pieces.append(value)
            elif not finished.done():
                loop.call_soon_threadsafe(lambda: finished.done() or finished.set_result(event))

        run = Run(generation, self.pool, deliver, self.running)
        try:
            while not finished.done():
                await asyncio.wait([finished], timeout=DISCONNECT_POLL_SECONDS)
                if not finished.done() and await request.is_disconnected():
                    run.gone.set()
                    return self._error_response(ApiError(499, "the client closed the request"))
        except asyncio.CancelledError:
            run.gone.set()
            raise
        kind, value = finished.result()
        if kind == "error":
            return self._error_response(_api_error(value))
        return JSONResponse(reply.whole("".join(pieces), value))

    def _streamed(self, request, generation, reply: "Reply", include_usage: bool):
        from starlette.responses import StreamingResponse

        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        run = Run(generation, self.pool, lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
                  self.running)

        async def stream():
            try:
                if reply.chat:
                    yield _sse(reply.chunk(role_only=True))
                held: list[str] = []  # with tools offered, the reply is parsed whole before it is sent
                while True:
                    kind, value = await events.get()
                    if kind == "text" and reply.tools:
                        held.append(value)
                    elif kind == "text":
                        yield _sse(reply.chunk(text=value))
                    elif kind == "done":
                        finish_reason = _finish_reason(value)
                        if reply.tools:
                            content, calls = reply.tool_calls("".join(held))
                            if content:
                                yield _sse(reply.chunk(text=content))
                            if calls:
                                yield _sse(reply.chunk(tool_calls=calls))
                                finish_reason = "tool_calls"
                        yield _sse(reply.chunk(finish_reason=finish_reason, result=value))
                        if include_usage:
                            yield _sse(reply.usage_chunk(value))
                        break
                    else:
                        yield _sse(_api_error(value).body())
                        break
                yield b"data: [DONE]\n\n"
            finally:  # finished, or the client went away (the response is cancelled): stop generating
                run.gone.set()

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


class Reply:
    """The response objects of one request, OpenAI's shapes for chat and for completions."""

    def __init__(self, model_name: str, chat: bool, tools: bool = False):
        self.model_name, self.chat, self.tools = model_name, chat, tools
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def _envelope(self, streamed: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if streamed and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name}

    def tool_calls(self, text: str) -> tuple[str | None, list[dict]]:
        """(the reply's text, its calls in OpenAI's shape) when tools were offered; (text, []) otherwise."""
        if not self.tools:
            return text, []
        content, calls = parse_tool_calls(text)
        return content, [{"id": "call_" + secrets.token_hex(12), "type": "function",
                          "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}
                         for call in calls]

    def whole(self, text: str, result) -> dict:
        if self.chat:
            content, calls = self.tool_calls(text)
            message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            choice = {"index": 0, "message": message,
                      "finish_reason": "tool_calls" if calls else _finish_reason(result)}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": _finish_reason(result)}
        return {**self._envelope(False), "choices": [choice], "usage": _usage(result), "timings": _timings(result),
                "seed": result.seed}

    def chunk(self, text: str = "", role_only: bool = False, finish_reason: str | None = None, result=None,
              tool_calls: list[dict] | None = None) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role_only else ({"content": text} if text else {})
            if tool_calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        chunk = {**self._envelope(True), "choices": [choice]}
        if result is not None:
            chunk.update({"timings": _timings(result), "seed": result.seed})
        return chunk

    def usage_chunk(self, result) -> dict:
        return {**self._envelope(True), "choices": [], "usage": _usage(result)}


# --- the command ------------------------------------------------------------------------------------


def add_arguments(p) -> None:
    from edge.cli import _add_load_args

    p.add_argument("model", nargs="?", default=None, help="a checkpoint, GGUF file or Hugging Face folder "
                                                           "(default: the built-in default model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: loopback only; 0.0.0.0 serves the network: give --api-key)")
    p.add_argument("--port", type=int, default=8080, help="TCP port (0: any free port, printed at start)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 request")
    p.add_argument("--model-name", default=None, help="the model's id in /v1/models (default: the folder's name)")
    p.add_argument("--cached-sessions", type=int, default=CACHED_SESSIONS,
                   help="finished requests' sessions (KV caches) kept, so that a request continuing a conversation "
                        "computes only what is new (timings.cache_n: the prompt tokens reused); 0: none "
                        f"(default {CACHED_SESSIONS})")
    _add_load_args(p)


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket (port 0: a free one), so that the address is known before serving."""
    if not is_integer(port, 0) or port > 65535:
        raise InvalidArgumentError(f"--port must be in [0, 65535], got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InvalidArgumentError(f"--host {host!r} is not an address this machine can listen on: {exc}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ZllmError(f"cannot listen on {host}:{port}: {exc.strerror}; choose another --port (0: any free one)") \
            from None
    sock.listen(128)
    return sock


def warm_up(model, quiet: bool) -> None:
    """Run what a request runs (a prefill, greedy and sampled decode steps) once before serving, so that
    the device's kernels are compiled or loaded now, not during the first client's request."""
    started = time.monotonic()
    if not quiet:
        print("warming up: the first run of a device compiles its kernels (a minute at most on a cold cache)",
              file=sys.stderr, flush=True)
    token = model.encode("Hello")[:1] or [0]
    for temperature in (0.0, 1.0):
        for _ in model.generate(token, max_new_tokens=2, temperature=temperature, seed=0):
            pass
    if not quiet:
        print(f"warmed up in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)


def cmd_serve(args) -> int:
    import os

    import uvicorn

    from edge.cli import _load_model

    if args.api_key is not None and not args.api_key:
        raise InvalidArgumentError("--api-key is empty; give a key, or leave --api-key out")
    if not is_integer(args.cached_sessions, 0):
        raise InvalidArgumentError(f"--cached-sessions must be an integer >= 0, got {args.cached_sessions}")
    sock = listening_socket(args.host, args.port)
    model = _load_model(args.model, args)
    name = args.model_name or os.path.basename(os.path.normpath(model.path))
    server = Server(model, name, api_key=args.api_key, cached_sessions=args.cached_sessions)
    warm_up(model, quiet=args.quiet)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"serving {name} on http://{shown}:{port}/v1 (device {model.device_info()['device']}; "
          f"{'API key required' if args.api_key else 'no API key'})", file=sys.stderr, flush=True)
    config = uvicorn.Config(server.app(), log_level="warning", lifespan="off", timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        model.close()
    return 0


