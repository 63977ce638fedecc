"""What every source model reader hands the converter."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from quant import QuantizedTensor


@dataclass(frozen=True)
class SourceTensor:
    name: str                # our (Hugging Face) tensor name
    shape: tuple[int, ...]   # logical numpy shape: (N, K) for matrices, (N,) for vectors
    source_format: str       # "F32", "BF16", "Q4_1", ... as the source file stores it
    nbytes: int              # bytes the source file spends on it


@dataclass
class SourceTokenizer:
    tokenizer_json: str | None
    config: dict = field(default_factory=dict)  # bos/eos/eog ids, add_bos_token, chat_template
    # special token ids the source names outside the model's config, which the converter checks against the
    # vocabulary: field -> (the file that gives it, its ids), e.g. generation_config.json's eos_token_id
    special_ids: dict[str, tuple[str, list[int]]] = field(default_factory=dict)


class SourceModel(Protocol):
    config: dict              # config.json-style dict (model_type and HF field names)
    tokenizer: SourceTokenizer
    description: str          # one line naming the source, for zllm.json

    def tensors(self) -> list[SourceTensor]: ...

    def load(self, name: str) -> np.ndarray | QuantizedTensor:
        """The tensor as float32, or as a QuantizedTensor when the source holds a format we import losslessly."""
        ...

    def release(self, name: str) -> None:
        """Forget the tensor's mapped pages once it is written (bounds resident memory)."""
        ...

    def close(self) -> None: ...
