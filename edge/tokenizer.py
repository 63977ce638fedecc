"""Text <-> token ids through the checkpoint's tokenizer.json, chat templates, and streaming
detokenization that never splits a multi-byte character."""
from __future__ import annotations

import functools
import inspect
import json
import re
import time
from datetime import date

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edge.core.errors import CheckpointError, ZllmError
from edge.core.spec_dense import clipped


class TokenizerError(ZllmError):
    pass


# What one rendering of a chat template may take. A template is a program from the model's files: a
# hostile or broken one (nested loops, '*' on a string, a huge width in a format) must end in an error,
# not hold a server's request or fill memory. Real templates take a few hundred steps.
TEMPLATE_STEPS = 1_000_000  # blocks entered: each pass of a loop's body, each macro call, each branch taken
TEMPLATE_SECONDS = 5.0
TEMPLATE_CHARACTERS = 1 << 24  # of the rendered text, and of any string or list made on the way
TEMPLATE_INTEGER_BITS = 1 << 16  # of a number made by '*' or '**' (Python's arithmetic is exact, and slow when huge)
_HUGE_WIDTH = re.compile(r"\d{%d,}" % len(str(TEMPLATE_CHARACTERS)))  # a width or precision in a format


class TemplateLimitError(TokenizerError):
    pass


class _SteppedCodeGenerator(CodeGenerator):
    """Compiles each block of a template (a loop's body, a branch, a macro's body) to begin with a call of
    environment.step(), so that a loop pays for every pass even when it calls and prints nothing."""

    def blockvisit(self, nodes, frame) -> None:
        self.writeline("environment.step()")
        super().blockvisit(nodes, frame)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox transformers renders chat templates in, with the limits above: steps and time are
    counted as the template runs, and an operation that would make a string or list past the size limit
    is refused before it allocates (repetition, powers, printf-style and str.format widths)."""

    code_generator_class = _SteppedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self, filters: dict, **options):
        super().__init__(**options)
        self._steps_left = TEMPLATE_STEPS
        self._deadline = time.monotonic() + TEMPLATE_SECONDS
        self.filters = {name: self._bounded(f) for name, f in {**self.filters, **filters}.items()}

    def step(self) -> None:
        self._steps_left -= 1
        if self._steps_left < 0:
            self._refuse(f"took more than {TEMPLATE_STEPS:,} steps")
        if time.monotonic() > self._deadline:
            self._refuse(f"ran for more than {TEMPLATE_SECONDS:g} s")

    def call_binop(self, context, operator, left, right):
        self.step()
        if operator == "*" and isinstance(left, int) and isinstance(right, int):  # a squaring loop's numbers
            self._check_bits(abs(left).bit_length() + abs(right).bit_length())
        elif operator == "*":
            for count, sequence in ((left, right), (right, left)):
                if isinstance(count, int) and hasattr(sequence, "__len__"):
                    self._check_size(len(sequence) * max(count, 0))
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            self._check_bits(abs(left).bit_length() * right)
        elif operator == "%" and isinstance(left, str):
            self._check_format(left)
        return self._checked(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (the sandbox's own signature)
        __self.step()
        receiver = getattr(inspect.unwrap(__obj), "__self__", None)  # str.format's string
        if isinstance(receiver, str):
            __self._check_format(receiver)
        __self._check_arguments(args, kwargs)
        return __self._checked(super().call(__context, __obj, *args, **kwargs))

    def render_bounded(self, source: str, **context) -> str:
        """The template rendered, its text counted as it comes."""
        pieces, size = [], 0
        for piece in self.from_string(source).generate(**context):
            size += len(piece)
            if size > TEMPLATE_CHARACTERS:
                self._refuse(f"wrote more than {TEMPLATE_CHARACTERS:,} characters")
            pieces.append(piece)
        return "".join(pieces)

    def _bounded(self, function):
        @functools.wraps(function)  # (keeps jinja's pass_context/pass_environment marks)
        def bounded(*args, **kwargs):
            self.step()
            self._check_arguments(args, kwargs)
            return self._checked(function(*args, **kwargs))
        return bounded

    def _check_arguments(self, args, kwargs) -> None:
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and abs(value) > TEMPLATE_CHARACTERS:  # a width, a count
                self._refuse(f"asked for a size of {value:,}")
            if isinstance(value, str) and "%" in value:  # the format filter's printf-style string
                self._check_format(value)

    def _check_format(self, text: str) -> None:
        if _HUGE_WIDTH.search(text) and ("%" in text or "{" in text):
            self._refuse("formats with a width or precision past its size limit")

    def _check_size(self, size: int) -> None:
        if size > TEMPLATE_CHARACTERS:
            self._refuse(f"would make a value of {size:,} characters or items")

    def _check_bits(self, bits: int) -> None:
        if bits > TEMPLATE_INTEGER_BITS:
            self._refuse(f"would make a number of about {bits:,} bits")

    def _checked(self, value):
        if isinstance(value, (str, list, tuple)) and len(value) > TEMPLATE_CHARACTERS:
            self._check_size(len(value))
        return value

    @staticmethod
    def _refuse(what: str):
        raise TemplateLimitError(f"the checkpoint's chat template {what}, past what one rendering may take; "
                                 "generate with a plain prompt, or convert the model from a source with a "
                                 "working template")


class Tokenizer:
    def __init__(self, path: str, config: dict):
        from tokenizers import Tokenizer as HFTokenizer

        try:  # read here, not by from_file: the library takes only UTF-8 paths, a folder's name may be any bytes
            with open(path, encoding="utf-8") as f:
                self._tok = HFTokenizer.from_str(f.read())
        except OSError as exc:
            raise CheckpointError(f"{path} cannot be read ({exc.strerror or exc}); the checkpoint is incomplete, "
                                  "convert the model again") from None
        except Exception as exc:  # a file not UTF-8, or tokenizers' plain Exception for a corrupt or foreign one
            raise CheckpointError(f"{path} cannot be loaded by the tokenizers library ({exc}); "
                                  "the checkpoint is damaged, convert the model again") from None
        self.path = path
        self.config = config
        self.bos_token_id = config.get("bos_token_id")
        self.eos_token_id = config.get("eos_token_id")
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.eog_token_ids = set(config.get("eog_token_ids") or [])
        if self.eos_token_id is not None:
            self.eog_token_ids.add(self.eos_token_id)
        self.chat_template = config.get("chat_template")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as exc:  # tokenizers raises a plain Exception, e.g. for a character without a token
            raise TokenizerError(f"{self.path} cannot encode the text ({_one_line(exc)}); pass token ids "
                                 "instead, or convert the model again from a tokenizer that can") from None
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        try:
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        except Exception as exc:  # tokenizers raises a plain Exception
            raise TokenizerError(f"{self.path} cannot decode the token ids {clipped(str(ids))} ({_one_line(exc)}); "
                                 "convert the model again from a tokenizer that can") from None

    def to_json(self) -> str:
        """The whole tokenizer as Hugging Face tokenizers' JSON (what a grammar engine reads)."""
        return self._tok.to_str()

    def token_text(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if not self.chat_template:
            raise TokenizerError("this checkpoint has no chat template; use generate() with a plain prompt")

        def raise_exception(message):
            raise TokenizerError(f"chat template refused the messages: {message}")

        # the environment transformers renders chat templates in (`_compile_jinja_template`): loop
        # controls ({% break %}, {% continue %}) and a tojson that keeps non-ASCII text and does not
        # HTML-escape, unlike jinja's own
        env = _BoundedSandbox(filters={"tojson": _tojson}, trim_blocks=True, lstrip_blocks=True,
                              loader=jinja2.BaseLoader(), extensions=["jinja2.ext.loopcontrols"])
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: date.today().strftime(fmt))
        token = lambda tid: self._tok.id_to_token(tid) if tid is not None else ""  # noqa: E731
        # a template that does not parse or fails on these messages raises jinja2.TemplateError or
        # TypeError: edge/api.py `render_chat` retries with text-only contents, then names the failure
        try:
            context = {"tools": tools} if tools else {}  # as transformers: undefined when there are none
            return env.render_bounded(
                self.chat_template, messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=token(self.bos_token_id), eos_token=token(self.eos_token_id), **context,
            )
        except (TypeError, jinja2.TemplateError, ZllmError):
            raise
        except Exception as exc:  # the template is a program from the model's files: any error of its is its own
            raise TokenizerError(f"the checkpoint's chat template failed ({type(exc).__name__}: {_one_line(exc)}); "
                                 "generate with a plain prompt, or convert the model from a source with a working "
                                 "template") from None


def _one_line(error: Exception) -> str:
    """An error's message for ours, on one line and cut short."""
    return clipped(" ".join(str(error).split()))


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class IncrementalDecoder:
    """Turns a growing id sequence into text pieces. Decodes a short window around the new
    ids so that tokenizers which treat word starts specially still render spaces right, and
    holds text back while it ends in an incomplete UTF-8 sequence (U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], context: int = 5):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - context, 0)
        self.read_offset = len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = decode(self.ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full_text[len(prefix_text) :]
        return ""
