"""Text <-> token ids through the checkpoint's tokenizer.json, chat templates, and streaming
detokenization that never splits a multi-byte character."""
from __future__ import annotations

import json
from datetime import date

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edge.core.errors import CheckpointError, ZllmError
from edge.core.spec_dense import clipped


class TokenizerError(ZllmError):
    pass


class Tokenizer:
    def __init__(self, path: str, config: dict):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(path)
        except Exception as exc:  # tokenizers raises a plain Exception for a missing, corrupt or foreign file
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
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, loader=jinja2.BaseLoader(),
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: date.today().strftime(fmt))
        token = lambda tid: self._tok.id_to_token(tid) if tid is not None else ""  # noqa: E731
        # a template that does not parse or fails on these messages raises jinja2.TemplateError or
        # TypeError: edge/api.py `render_chat` retries with text-only contents, then names the failure
        try:
            context = {"tools": tools} if tools else {}  # as transformers: undefined when there are none
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
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
