"""`edge.load` and the Model it returns."""
from __future__ import annotations

import os
import re

import psutil

from converters.checkpoint import open_checkpoint
from devices.base import DeviceUnavailableError, create_backend
from edge.errors import CheckpointError, SessionError, ZllmError
from edge.generation import Generation
from edge.model import Transformer
from edge.sampling import SamplingParams
from edge.session import Session
from edge.spec import spec_from_dict
from edge.tokenizer import Tokenizer, TokenizerError
from quant import QuantizedTensor

DEFAULT_SESSION_CAPACITY = 4096
_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}


def parse_bytes(value: int | str | None) -> int | None:
    """512MB, 1.5GiB, or a plain number of bytes."""
    if value is None or isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMG]I?B|B)?\s*", str(value), re.IGNORECASE)
    if not match:
        raise ZllmError(f"memory budget {value!r} not understood; use bytes or a size such as 512MB or 2GiB")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").upper()])


class Model:
    def __init__(self, path: str, device: str = "reference", threads: int | None = None,
                 memory_budget: int | str | None = None, verify: bool = False):
        self.path = os.fspath(path)
        self.checkpoint = open_checkpoint(self.path, verify=verify)
        self.spec = spec_from_dict(self.checkpoint.model_config)
        self.weight_bytes = sum(
            t.nbytes for t in self.checkpoint.tensors.values()
        )
        self.memory_budget = parse_bytes(memory_budget)
        if self.memory_budget is not None and self.memory_budget < self.weight_bytes:
            raise ZllmError(
                f"memory budget {self.memory_budget} bytes is below this model's minimum working set: "
                f"{self.weight_bytes} bytes of weights (plus KV cache); raise the budget to at least that"
            )
        try:
            self.backend = create_backend(device, threads=threads)
        except (ValueError, DeviceUnavailableError) as exc:
            raise ZllmError(str(exc)) from None
        self.device = device
        try:
            self.transformer = Transformer(self.spec, self.checkpoint.tensors, self.backend)
        except KeyError as exc:
            raise CheckpointError(f"{self.path}: tensor {exc.args[0]} is missing; convert the model again") from None
        except DeviceUnavailableError as exc:  # e.g. the device has no kernel for a tensor's scheme
            raise ZllmError(f"{self.path}: {exc}") from None
        tok_path = self.checkpoint.tokenizer_path
        self.tokenizer = Tokenizer(tok_path, self.checkpoint.tokenizer_config) if tok_path else None
        # End-of-generation ids live in the manifest, so generation from ids stops without a tokenizer too.
        tok_config = self.checkpoint.tokenizer_config
        self.eog_token_ids = set(tok_config.get("eog_token_ids") or [])
        if tok_config.get("eos_token_id") is not None:
            self.eog_token_ids.add(tok_config["eos_token_id"])

    # --- sessions -------------------------------------------------------------------------
    def session(self, capacity: int | None = None) -> Session:
        limit = self.spec.max_position_embeddings
        capacity = min(limit, DEFAULT_SESSION_CAPACITY) if capacity is None else capacity
        if not 0 < capacity <= limit:
            raise SessionError(f"session capacity must be in [1, {limit}] (the model's context), got {capacity}")
        return Session(self, capacity)

    # --- text -----------------------------------------------------------------------------
    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise TokenizerError(f"{self.path} has no tokenizer; pass token ids instead of text")
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        return self._require_tokenizer().encode(text)

    def decode(self, ids) -> str:
        return self._require_tokenizer().decode(ids)

    def generate(self, prompt: str | list[int], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
                 seed: int | None = None, stop: list[str] | None = None) -> Generation:
        """Stream text pieces: `for piece in model.generate(...)`; `.result` has ids and timings."""
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        params = SamplingParams(temperature, top_k, top_p, repetition_penalty)
        return Generation(self, ids, max_new_tokens, params, seed, stop)

    def chat(self, messages: list[dict], **kwargs) -> Generation:
        """Apply the checkpoint's chat template to messages and generate the assistant's reply."""
        tokenizer = self._require_tokenizer()
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate(tokenizer.encode(text, add_special_tokens=False), **kwargs)

    # --- reporting ------------------------------------------------------------------------
    def device_info(self) -> dict:
        return {"requested": self.device, **self.backend.info()}

    def stats(self) -> dict:
        return {
            "weight_bytes": self.weight_bytes,
            "quantized_tensors": sum(isinstance(t, QuantizedTensor) for t in self.checkpoint.tensors.values()),
            "rss_bytes": psutil.Process().memory_info().rss,
            "budget_bytes": self.memory_budget,
        }

    def close(self) -> None:
        self.transformer = None
        self.checkpoint.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(path, device: str = "reference", threads: int | None = None,
         memory_budget: int | str | None = None, verify: bool = False) -> Model:
    """Open a zllm checkpoint (mmap, no copy of the weights) on a device."""
    return Model(path, device=device, threads=threads, memory_budget=memory_budget, verify=verify)
