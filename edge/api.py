"""`edge.load` and the Model it returns."""
from __future__ import annotations

from edge.core.process_memory import peak_rss_bytes, release_free_heap, resident_bytes, runtime_memory

# What the imports below add (numpy, numba, llvmlite and the modules of the runtime) is the runtime's
# memory, which the budget counts (edge/core/process_memory.py): so they come after this measure.
_IMPORTS_BEGAN = resident_bytes()

import logging
import os
import threading
import weakref

from devices.base import DeviceUnavailableError, create_backend
from edge.constrained import Grammar
from edge.core.arguments import integer, path_argument, shown
from edge.core.errors import (
    CheckpointError,
    ExpertCacheError,
    InvalidArgumentError,
    SessionError,
    UnsupportedModelError,
    ZllmError,
)
from edge.generation import Generation, GenerationOptions
from edge.model import Transformer
from edge.options import LoadOptions
from edge.saved_session import restore_session
from edge.session import Session, check_token_ids
from edge.tokenizer import Tokenizer, TokenizerError
from quant import QuantizedTensor
from quant.checkpoint import open_checkpoint
from streaming.budget import SCRATCH_TOKENS, parse_budget, plan_memory

runtime_memory.record("imports edge.api", resident_bytes() - _IMPORTS_BEGAN)

DEFAULT_SESSION_CAPACITY = 4096
log = logging.getLogger("zllm.edge")


_TOKENIZER_BYTES: dict[tuple, int] = {}  # (path, size, mtime) -> resident bytes its first load added


def load_tokenizer(path: str | None, config: dict) -> tuple[Tokenizer | None, int]:
    """The checkpoint's tokenizer, and the memory it takes for the memory budget: what loading it added
    to the resident set the first time this process loaded that file (the tokenizers library does not
    report its memory; SmolLM2's takes ~34 MB). Later loads count the same figure, so a model's budget
    does not depend on what the allocator kept from an earlier load."""
    if path is None:
        return None, 0
    status = os.stat(path)
    key = (os.path.realpath(path), status.st_size, status.st_mtime_ns)
    if key in _TOKENIZER_BYTES:
        return Tokenizer(path, config), _TOKENIZER_BYTES[key]
    release_free_heap()  # so that the tokenizer's allocations grow the resident set, not reuse freed memory
    before = resident_bytes()
    tokenizer = Tokenizer(path, config)
    _TOKENIZER_BYTES[key] = max(0, resident_bytes() - before)
    return tokenizer, _TOKENIZER_BYTES[key]


class Model:
    def __init__(self, path: str, options: LoadOptions):
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidArgumentError(f"path must be a checkpoint directory (a str or os.PathLike), got {shown(path)}")
        if not os.fspath(path):  # not the current directory
            raise InvalidArgumentError("path is empty; name a checkpoint directory made by `zllm-edge convert`")
        path_argument("path", path)  # a name the operating system can take
        self._closed = False
        # one forward pass at a time: threads sharing the model interleave their sessions step by step,
        # and the backend, its scratch and the expert source see one caller (edge/session.py)
        self.forward_lock = threading.RLock()
        self.path = os.fspath(path)
        self.options = options
        # a session's default capacity (and a generation's most); a budget reserves this many positions
        self.kv_capacity = options.kv_capacity
        self.checkpoint = open_checkpoint(self.path, verify=options.verify)
        self.experts = None
        try:
            self._open(options)
        except BaseException:  # a refused device, format or budget: nothing stays mapped or running
            if self.experts is not None:
                self.experts.close()
            self.checkpoint.close()
            self._closed = True
            raise

    def _open(self, options: LoadOptions) -> None:
        """Everything Model() does once the checkpoint is open (it closes the checkpoint if this fails)."""
        streaming = options.streaming
        self.spec = self.checkpoint.spec
        self.weight_bytes = sum(  # every tensor that is not a routed expert (those live in experts.bin)
            t.nbytes for t in self.checkpoint.tensors.values()
        )
        experts = self.checkpoint.experts
        if experts is None and streaming.expert_strategy is not None:
            raise InvalidArgumentError(f"expert_strategy {shown(streaming.expert_strategy)} applies to "
                                       f"Mixture-of-Experts models; {self.path} is a dense {self.spec.model_type} model")
        context = self.spec.max_position_embeddings
        if options.kv_capacity is not None and options.kv_capacity > context:
            raise InvalidArgumentError(f"kv_capacity must be in [1, {context}] (the model's context), "
                                       f"got {options.kv_capacity}")
        self.expert_strategy = streaming.expert_strategy or (
            "predictive" if options.memory_budget is not None else "resident")
        self.tokenizer, self._tokenizer_bytes = load_tokenizer(self.checkpoint.tokenizer_path,
                                                               self.checkpoint.tokenizer_config)
        try:
            with runtime_memory.measure(f"backend {options.device}"):
                self.backend = create_backend(options.device, threads=options.threads)
        except ValueError as exc:  # a variant or thread count the device does not take
            raise InvalidArgumentError(str(exc)) from None
        except DeviceUnavailableError as exc:
            raise ZllmError(str(exc)) from None
        self.compute_threads = self.backend.compute_threads(self.spec, SCRATCH_TOKENS)  # each with its own scratch
        # one budget: runtime + dense weights + tokenizer + KV reservation + scratch + expert cache
        # (streaming/budget.py), first with the runtime loaded so far
        self.memory = self._plan_memory(options, self.expert_strategy)
        if (streaming.expert_strategy is None and experts is not None and self.memory.expert_cache_bytes is not None
                and self.memory.expert_cache_bytes >= self.memory.expert_bytes):
            # the budget holds every expert: nothing to stream or predict, so none of their per-layer cost
            self.expert_strategy = "resident"
            self.memory = self._plan_memory(options, "resident")
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()
        self.device = options.device
        try:
            self.experts = self._expert_source(options)
            self._configure_device_expert_cache(options.gpu_expert_cache)
            self.transformer = Transformer(self.spec, self.checkpoint.tensors, self.backend, experts=self.experts,
                                           kv_format=options.kv_cache)
            if not self.transformer.forward_path.startswith("fused") and self.backend.name != "reference":
                log.warning("device %r runs %s op by op (%s)", self.backend.name, os.path.basename(self.path),
                            self.transformer.forward_path.removeprefix("ops: "))
        except KeyError as exc:
            raise CheckpointError(f"{self.path}: tensor {exc.args[0]} is missing; convert the model again") from None
        except DeviceUnavailableError as exc:  # e.g. the device has no kernel for a tensor's scheme
            raise ZllmError(f"{self.path}: {exc}") from None
        # The kernels the model runs loaded as its forward was built, after the expert cache was sized: the
        # plan is made again with them, and the cache takes what is left (or the budget is refused).
        self.memory = self._plan_memory(options, self.expert_strategy)
        self.memory_budget = self.memory.budget_bytes
        if self.experts is not None and self.memory.expert_cache_bytes is not None:
            self.experts.resize_cache(self.memory.expert_cache_bytes)
        # End-of-generation ids live in the manifest, so generation from ids stops without a tokenizer too.
        tok_config = self.checkpoint.tokenizer_config
        self.eog_token_ids = set(tok_config.get("eog_token_ids") or [])
        if tok_config.get("eos_token_id") is not None:
            self.eog_token_ids.add(tok_config["eos_token_id"])

    def _plan_memory(self, options: LoadOptions, strategy: str):
        """The memory plan of this model under `strategy`, counting the runtime as loaded now."""
        streaming = options.streaming
        return plan_memory(self.spec, self.weight_bytes, self.checkpoint.experts, options.memory_budget, strategy,
                           streaming.prefetch_threads, options.kv_capacity, options.kv_cache, self._tokenizer_bytes,
                           streaming.prefetch_depth, self.compute_threads, runtime_memory.total())

    def _expert_source(self, options: LoadOptions):
        """Where MoE layers get their routed experts: all of them in memory (None for a dense model)."""
        is_moe = any(self.spec.moe_for_layer(i) is not None for i in range(self.spec.num_hidden_layers))
        if not is_moe:
            return None
        if not self.backend.capabilities.runs_moe:
            raise UnsupportedModelError(
                f"device {self.device.partition(':')[0]!r} does not run Mixture-of-Experts models yet; "
                "use device 'cpu' or 'reference'")
        if self.checkpoint.experts is None:
            raise CheckpointError(f"{self.path}: the {self.spec.model_type} model has MoE layers but the checkpoint "
                                  "has no experts entry; convert the model again")
        from streaming import open_expert_source

        # a device that runs experts on another backend (npu: the CPU backend) has them prepared for it
        expert_backend = self.backend.expert_backend
        return open_expert_source(self.checkpoint, self.spec, expert_backend, self.expert_strategy,
                                  self.memory.expert_cache_bytes, options.streaming,
                                  compute_threads=self.backend.capabilities.threads)

    def _configure_device_expert_cache(self, size: int | str | None) -> None:
        """A device that keeps experts in its own memory (gpu) sizes that cache from the experts' shapes
        and schemes: bytes, a size ("64MB") or "P%" of every expert's device bytes; None: its default."""
        if not self.backend.capabilities.expert_cache or self.experts is None:
            if size is not None:
                raise InvalidArgumentError(f"gpu_expert_cache applies to Mixture-of-Experts models on device 'gpu'; "
                                           f"{self.path} on device {self.device!r} has no GPU expert cache")
            return

        try:
            size = parse_budget(size)
        except ZllmError as exc:
            raise ZllmError(f"gpu_expert_cache: {exc}") from None
        capacity = None if size is None else (size.bytes if size.bytes is not None else size.expert_percent / 100)
        layers = {layer: (len(experts.records), {name: (p.scheme, p.shape)
                                                 for name, p in experts.layout.projections.items()})
                  for layer, experts in self.checkpoint.experts.layers.items()}
        try:
            self.backend.configure_expert_cache(layers, capacity)
        except ValueError as exc:
            raise ExpertCacheError(f"{self.path}: {exc}") from None

    # --- sessions -------------------------------------------------------------------------
    def require_open(self) -> None:
        if self._closed:
            raise ZllmError(f"the model is closed; load {self.path} again with edge.load()")

    def session_ceiling(self) -> int:
        """The most KV positions one session may hold: the memory budget's reservation, else the context."""
        context = self.spec.max_position_embeddings
        return min(self.memory.kv_capacity, context) if self.memory_budget is not None else context

    def generation_limit(self) -> tuple[int, str]:
        """The most positions a generation's session takes, and a message's words for that limit and
        its remedy ("the prompt has N tokens, more than ...")."""
        larger = "shorten the prompt or load the model with a larger kv_capacity (--kv-capacity)"
        if self.memory_budget is not None:
            ceiling = self.session_ceiling()
            return ceiling, f"the {ceiling} KV positions the memory budget reserves; {larger}"
        if self.kv_capacity is not None:
            return self.kv_capacity, f"the model's kv_capacity of {self.kv_capacity} positions; {larger}"
        context = self.spec.max_position_embeddings
        return context, f"the model's context of {context} tokens; shorten the prompt"

    def session(self, capacity: int | None = None) -> Session:
        """A new session of `capacity` KV positions (default: the model's kv_capacity, else
        min(context, 4096); under a memory budget, what the budget's reservation has left)."""
        self.require_open()
        limit = self.spec.max_position_embeddings
        if capacity is not None:
            capacity = integer("capacity", capacity)
        if self.memory_budget is not None:  # sessions share the KV positions the budget reserved
            left = self.memory.kv_capacity - sum(s.capacity for s in self._sessions)
            capacity = left if capacity is None else capacity
            if capacity > left or left <= 0:
                raise SessionError(
                    f"a session of {capacity} positions does not fit the memory budget: it reserves "
                    f"{self.memory.kv_capacity} KV positions and open sessions hold {self.memory.kv_capacity - left}; "
                    f"close a session (or an unfinished generation: generation.close()), or load with a larger "
                    f"kv_capacity and memory_budget (--kv-capacity, --memory-budget)")
        if capacity is None:
            capacity = self.kv_capacity if self.kv_capacity is not None else min(limit, DEFAULT_SESSION_CAPACITY)
        if not 0 < capacity <= limit:
            raise InvalidArgumentError(f"session capacity must be in [1, {limit}] (the model's context), "
                                       f"got {capacity}")
        session = Session(self, capacity)
        self._sessions.add(session)
        return session

    def release_session(self, session: Session) -> None:
        """Forget a closed session, so that its KV positions count against the budget no more."""
        self._sessions.discard(session)

    # --- text -----------------------------------------------------------------------------
    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise TokenizerError(f"{self.path} has no tokenizer; pass token ids instead of text")
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise InvalidArgumentError(f"encode takes text (a str), got {type(text).__name__} {shown(text)}")
        check_unicode("the text", text)
        return self._require_tokenizer().encode(text)

    def decode(self, ids) -> str:
        tokenizer = self._require_tokenizer()
        return tokenizer.decode(check_token_ids(ids, self.spec.vocab_size, InvalidArgumentError).tolist())

    def generate(self, prompt: str | list[int], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
                 seed: int | None = None, stop: str | list[str] | None = None, min_p: float = 0.0,
                 grammar: Grammar | None = None, session: "Session | None" = None) -> Generation:
        """Stream text pieces: `for piece in model.generate(...)`; `.result` has ids and timings.
        seed None or -1: a random seed; stop: a string or a list of strings (the text ends before
        the first one that appears; GenerationResult says what `tokens` then hold); min_p: keep the
        tokens at least min_p times as likely as the likeliest; grammar: an edge.Grammar the text must
        match (a JSON schema, any JSON object, a regular expression, a Lark grammar); session: generate
        in this open session (model.session(capacity)), which keeps the KV of the prompt's first tokens
        that it holds already (an earlier turn of the conversation, prompt and reply) and stays open
        after the generation; `result.timings["prompt_tokens_reused"]` says how many. Without one, a
        session of its own opens and closes with the generation."""
        self.require_open()
        options = GenerationOptions.of(max_new_tokens, temperature, top_k, top_p, repetition_penalty, seed, stop,
                                       min_p, grammar)
        if options.stop and self.tokenizer is None:  # without text there is nothing a stop string could match
            raise InvalidArgumentError(f"stop strings need text, and {self.path} has no tokenizer; stop on token ids "
                                       "instead: iterate generation.steps() and close() it at the ids you want")
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        elif prompt is None or isinstance(prompt, (bytes, dict)) or not hasattr(prompt, "__len__"):
            raise InvalidArgumentError(f"prompt must be text (a str) or a list of token ids, got {shown(prompt)}")
        else:
            ids = check_token_ids(prompt, self.spec.vocab_size, InvalidArgumentError).tolist()
        if session is not None and not isinstance(session, Session):
            raise InvalidArgumentError(f"session must be a Session from model.session(), got {shown(session)}")
        return Generation(self, ids, options, session)

    def chat(self, messages: list[dict], tools: list[dict] | None = None, **kwargs) -> Generation:
        """Apply the checkpoint's chat template to messages and generate the assistant's reply. tools:
        OpenAI's function definitions, offered through a template that takes them (edge/tools.py; the
        reply's calls: edge.parse_tool_calls(text)); a template that does not is a ToolsError."""
        self.require_open()
        _check_messages(messages)
        tokenizer = self._require_tokenizer()
        if tools is not None:
            from edge.tools import check_tools, require_tool_format

            check_tools(tools)
            require_tool_format(self)
        for i, message in enumerate(messages):
            for key, value in message.items():
                if isinstance(value, str):
                    check_unicode(f"messages[{i}][{shown(key)}]", value)
        text = render_chat(tokenizer, messages, tools)
        check_unicode("the chat template's output", text)  # e.g. a text part of a list content
        return self.generate(tokenizer.encode(text, add_special_tokens=False), **kwargs)

    def conversation_sampling(self) -> tuple[dict, str]:
        """What a conversation that sets no sampling field samples with (`zllm-edge chat`, the server),
        and where that comes from: the checkpoint's own settings (its Hugging Face generation_config.json)
        when it has them, else llama.cpp's and Ollama's defaults (edge/sampling.py)."""
        from edge.sampling import CONVERSATION_SAMPLING

        own = self.checkpoint.tokenizer_config.get("sampling")
        if own is not None:
            return dict(own), "the checkpoint's generation_config.json"
        return dict(CONVERSATION_SAMPLING), "llama.cpp's and Ollama's defaults"

    # --- reporting ------------------------------------------------------------------------
    def device_info(self) -> dict:
        """The device and backend, and which forward path this model runs on it: "fused" (the device's
        executor) or "ops: <why>" (edge's op-by-op composition on the same device's operations)."""
        self.require_open()
        info = {"requested": self.device, **self.backend.info(), "forward": self.transformer.forward_path}
        ring = self._ring_buffer_note()
        if ring is not None:
            info["forward_long_sessions"] = ring
        if self.expert_strategy == "predictive" and self.experts is not None:  # (a dense model has no experts)
            info["expert_forecast"] = self.experts.forecast_path()
        return info

    def _ring_buffer_note(self) -> str | None:
        """Sessions longer than a sliding window keep only the window in ring buffers, which only the
        op-by-op composition reads: a fused device runs those sessions op by op."""
        windows = [self.spec.sliding_window_for_layer(i) for i in range(self.spec.num_hidden_layers)]
        windows = [w for w in windows if w is not None and w < self.spec.max_position_embeddings]
        if not windows or not self.transformer.forward_path.startswith("fused") \
                or not self.backend.capabilities.ring_buffers:
            return None
        return f"ops: sessions of more than {min(windows)} positions (ring-buffered sliding-window layers)"

    def stats(self) -> dict:
        self.require_open()
        rss, peak = resident_bytes(), peak_rss_bytes()
        return {
            "weight_bytes": self.weight_bytes,
            "quantized_tensors": sum(isinstance(t, QuantizedTensor) for t in self.checkpoint.tensors.values()),
            "rss_bytes": rss,
            "peak_rss_bytes": rss if peak is None else peak,  # no high-water mark kept: the RSS now
            "budget_bytes": self.memory_budget,
            "memory_plan": self.memory.to_dict(),
            "runtime_bytes_by_kind": runtime_memory.by_kind(),  # what the plan's runtime_bytes counted, now
            **(self.experts.stats() if self.experts is not None else {}),
            **(self.backend.expert_stats() if self.backend.capabilities.expert_cache else {}),
        }

    def load_session(self, path, capacity: int | None = None) -> Session:
        """A session restored from `session.save(path)`: KV state, position and tokens, no prefill.
        The file must come from this model (same manifest) and KV format; capacity defaults to the
        saved session's."""
        self.require_open()
        return restore_session(self, path, capacity)

    def close(self) -> None:
        """Close every open session, the expert source and the checkpoint; later calls raise ZllmError."""
        with self.forward_lock:  # (not under a forward pass of another thread)
            if self._closed:
                return
            for session in list(self._sessions):
                session.close()
            self._closed = True
            self.transformer = None
            if self.experts is not None:
                self.experts.close()
            self.checkpoint.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_messages(messages) -> None:
    """Chat messages are a non-empty list of {"role": str, "content": ...} dicts; refused here with the
    culprit named, rather than as a template engine's error about an undefined attribute."""
    shape = 'a list of {"role": ..., "content": ...} dicts'
    if not isinstance(messages, (list, tuple)):
        raise InvalidArgumentError(f"messages must be {shape}, got {type(messages).__name__} {shown(messages)}")
    if not messages:
        raise InvalidArgumentError(f"messages is empty; give {shape}, "
                                   'e.g. [{"role": "user", "content": "Hi"}]')
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidArgumentError(f"messages must be {shape}; messages[{i}] is {type(message).__name__} "
                                       f"{shown(message)}")
        if not isinstance(message.get("role"), str):
            found = "has none" if "role" not in message else f"is {shown(message['role'])}"
            raise InvalidArgumentError(f"messages[{i}] needs a string 'role'; its 'role' {found}")
        # content: text, a list of parts, or None beside tool calls, as chat templates take them
        if "content" not in message and "tool_calls" not in message:
            raise InvalidArgumentError(f"messages[{i}] has no 'content'")
        if not isinstance(message.get("content"), (str, list, type(None))):
            raise InvalidArgumentError(f"messages[{i}]'s 'content' must be text, a list of parts or null; "
                                       f"it is {shown(message['content'])}")


def check_unicode(what: str, text: str) -> None:
    """Refuse text with a lone surrogate (InvalidArgumentError), which no tokenizer can encode: on the command
    line it is a byte that is not UTF-8, kept by Python's surrogateescape (U+DC80-U+DCFF stand for 0x80-0xFF)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        found = (f"the byte 0x{code - 0xDC00:02x}, which is not UTF-8" if 0xDC80 <= code <= 0xDCFF
                 else f"the lone surrogate U+{code:04X}")
        raise InvalidArgumentError(f"{what} is not valid Unicode: character {exc.start} is {found}; give UTF-8 "
                                   "text (on the command line, check the terminal's encoding)") from None


def render_chat(tokenizer: Tokenizer, messages, tools: list[dict] | None = None) -> str:
    """The chat template applied to messages. A template that concatenates `content` as a string
    cannot take a list of parts or null: then, as llama.cpp does for templates without typed content,
    it gets each list's text parts joined by newlines (and "" for null). Whatever the template still
    cannot render is a TokenizerError naming the template's complaint."""
    import jinja2

    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    except jinja2.TemplateSyntaxError as exc:  # no messages can help
        raise TokenizerError(f"the checkpoint's chat template is not valid Jinja ({exc}, line {exc.lineno}); "
                             "generate with a plain prompt, or convert the model from a source with a valid "
                             "template") from None
    except (TypeError, jinja2.TemplateError) as exc:
        failure = exc
    flat = _text_content(messages)
    if flat is not None:
        try:
            return tokenizer.apply_chat_template(flat, add_generation_prompt=True, tools=tools)
        except (TypeError, jinja2.TemplateError) as exc:
            failure = exc
    raise TokenizerError(f"the checkpoint's chat template cannot render these messages ({type(failure).__name__}: "
                         f"{failure}); give each message's 'content' as text") from None


def _text_content(messages) -> list[dict] | None:
    """messages with list contents flattened to their text parts (joined by newlines) and null contents as "",
    or None when no message has either. A part that is not text is refused (InvalidArgumentError)."""
    if all(isinstance(m.get("content"), str) or "content" not in m for m in messages):
        return None
    flat = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if content is None:  # null (or absent) beside tool calls
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if isinstance(part, str):
                    texts.append(part)
                elif (isinstance(part, dict) and part.get("type", "text") == "text"
                      and isinstance(part.get("text"), str)):
                    texts.append(part["text"])
                else:
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise InvalidArgumentError(f"messages[{i}]['content'][{j}] is a {shown(kind)} part; this "
                                               f"model's chat template takes text only: give text parts "
                                               '({"type": "text", "text": ...}) or a string')
            content = "\n".join(texts)
        flat.append({**message, "content": content})
    return flat


def load(path, *positional, options: LoadOptions | None = None, **settings) -> Model:
    """Open a zllm checkpoint (mmap, no copy of the weights) on a device.

    The settings are LoadOptions.of's keyword arguments: device ("reference", "cpu", "cpu:f32", "gpu",
    "npu:openvino", ...), threads, memory_budget, kv_capacity, kv_cache, verify, the expert streaming
    options of a MoE model (storage, expert_strategy, expert_policy, prefetch_depth, prefetch_threads),
    gpu_expert_cache, io_engine and expert_engine (the first ones may be given by position, in that order:
    edge.load(path, "cpu"));
    edge/options.py says what each takes. Or pass one LoadOptions as `options`.
    """
    if options is None:
        options = LoadOptions.from_settings(positional, settings)
    elif not isinstance(options, LoadOptions) or positional or settings:
        raise InvalidArgumentError(f"edge.load takes settings or options=LoadOptions(...), not both; "
                                   f"got options={shown(options)} and {len(positional)} positional, {sorted(settings)}")
    return Model(path, options)
