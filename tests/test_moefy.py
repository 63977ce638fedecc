"""MoEfication (`zllm-edge convert --moefy`): a dense tiny Llama split into experts with a fitted router.

The tiny models take token ids only, so each test folder gets a character-level tokenizer.json
(one id per printable ASCII character) for the calibration text.
"""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from tiny_models import tiny_zoo  # noqa: F401

import edge
from converters.convert import QuantPlan, convert
from converters.moefy import DEFAULT_MOEFY, MoefiedSource, MoefySetting, parse_dense_layers, parse_moefy
from converters.moefy_calibrate import capture_ffn_inputs, dense_ffn, token_windows
from converters.moefy_fit import LayerMoefication, balanced_kmeans
from converters.source import SourceTensor, SourceTokenizer
from edge.cli import main
from edge.core.errors import ConversionError, UnsupportedModelError
from edge.moefy import moefy_convert
from quant import QuantizedTensor, Scheme, quantize
from quant.checkpoint import read_manifest
from quant.expert_file import ExpertIndex, raw_record, read_expert_bytes

F32 = QuantPlan(weights="f32")
FAST = dict(calibration_tokens=1024, heldout_tokens=256, progress=False)
PROMPT = "def moefy(layer):\n    return sorted(experts)"


def char_tokenizer_json(vocab_size: int) -> str:
    """A tokenizers WordLevel model over single characters: printable ASCII -> ids 3.., anything else <unk>."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for code in range(32, 127):
        if len(vocab) < vocab_size:
            vocab[chr(code)] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return tokenizer.to_str()


@pytest.fixture(scope="module")
def tiny_llama(tiny_zoo, tmp_path_factory) -> str:
    """The tiny MHA Llama (hidden 64, FFN 96, 2 layers) as an HF folder with a character tokenizer."""
    folder = tmp_path_factory.mktemp("moefy") / "llama_mha"
    shutil.copytree(tiny_zoo.hf_folder("llama_mha"), folder)
    with open(folder / "tokenizer.json", "w", encoding="utf-8") as f:
        f.write(char_tokenizer_json(tiny_zoo.case("llama_mha").make_config().vocab_size))
    return os.fspath(folder)


@pytest.fixture(scope="module")
def dense_checkpoint(tiny_llama, tmp_path_factory) -> str:
    out = os.fspath(tmp_path_factory.mktemp("moefy") / "dense")
    convert(tiny_llama, out, F32, progress=False)
    return out


def logits_of(path: str, ids: list[int]) -> np.ndarray:
    with edge.load(path, device="reference") as model:
        transformer = model.transformer
        return transformer.forward(np.asarray(ids), transformer.new_cache(len(ids)), True)


def test_every_expert_active_reproduces_the_dense_model(tiny_llama, dense_checkpoint, tmp_path):
    """K = E: the experts partition the FFN's neurons, so the MoEfied model is the dense one."""
    summary = moefy_convert(tiny_llama, os.fspath(tmp_path / "moe"), experts=4, top_k=4, dense_layers=(),
                            plan=F32, **FAST)
    manifest = read_manifest(os.fspath(tmp_path / "moe"))
    assert manifest["model"]["model_type"] == "llama_moe"
    assert (manifest["model"]["num_experts"], manifest["model"]["num_experts_per_tok"]) == (4, 4)
    assert manifest["model"]["moe_intermediate_size"] == 24 and manifest["model"]["dense_layers"] == []
    assert manifest["moefy"]["experts"] == 4 and set(manifest["moefy"]["clustering"]) == {"0", "1"}
    with edge.load(dense_checkpoint) as dense:
        ids = dense.encode(PROMPT)
    ours, reference = logits_of(os.fspath(tmp_path / "moe"), ids), logits_of(dense_checkpoint, ids)
    assert np.max(np.abs(ours - reference)) <= 1e-4 * np.max(np.abs(reference))
    assert summary.moe_perplexity == pytest.approx(summary.dense_perplexity, rel=1e-4)
    assert summary.active_fraction == 1.0


def stored_experts(path: str, layer: int) -> list[dict]:
    """Every expert of `layer` as the checkpoint's experts.bin stores it."""
    manifest = read_manifest(path)
    index = ExpertIndex(path, manifest["experts"])
    fd = os.open(index.path, os.O_RDONLY)
    try:
        experts = []
        for expert in range(len(index.layers[layer].records)):
            out = np.empty(index.layout(layer).raw_length, dtype=np.uint8)
            raw = raw_record(index, layer, expert, read_expert_bytes(fd, index, layer, expert), out)
            experts.append(index.layout(layer).decode(raw))
        return experts
    finally:
        os.close(fd)


def test_checkpoint_routes_like_the_fitted_moefication(tiny_llama, dense_checkpoint, tmp_path):
    """K < E: the converted checkpoint (router, experts, llama_moe block) computes the MoEfication of the
    dense model: its experts partition the dense neurons, and routing depends on the input."""
    out = os.fspath(tmp_path / "moe")
    summary = moefy_convert(tiny_llama, out, experts=4, top_k=1, dense_layers=(1,), plan=F32, **FAST)
    assert summary.setting == MoefySetting(4, 1, (1,))
    assert summary.active_fraction == pytest.approx((0.25 + 1.0) / 2)
    with edge.load(out, device="reference") as moe, edge.load(dense_checkpoint, device="reference") as dense:
        ids = np.asarray(moe.encode(PROMPT))
        assert "model.layers.1.mlp.down_proj.weight" in moe.checkpoint.tensors  # the dense layer stays dense
        router_weight = np.asarray(moe.checkpoint.tensors["model.layers.0.mlp.gate.weight"])
        router_bias = np.asarray(moe.checkpoint.tensors["model.layers.0.mlp.gate.bias"])
        dense_gate = np.asarray(dense.checkpoint.tensors["model.layers.0.mlp.gate_proj.weight"])
        neurons = np.array([[np.flatnonzero((dense_gate == row).all(axis=1))[0] for row in expert["gate_proj"]]
                            for expert in stored_experts(out, 0)])  # [E, N] recovered from the stored rows
        assert sorted(neurons.ravel().tolist()) == list(range(96))  # a partition of the dense neurons
        moefication = LayerMoefication(neurons, router_weight, router_bias, "", 0.0)
        ffn = dense_ffn(dense.checkpoint.tensors, 0)
        x = capture_ffn_inputs(dense.transformer, [ids])[0]  # layer 0's FFN input does not depend on routing
        assert len(np.unique(moefication.route(x, 1))) >= 2, "every token chose the same expert"

        def moefied_layer0(layer, x):
            return moefication.forward(ffn, x, moefication.route(x, 1)) if layer == 0 else None

        expected = dense.transformer.forward_ops(ids, dense.transformer.new_cache(len(ids)), True,
                                                 ffn_hook=moefied_layer0)
        ours = moe.transformer.forward(ids, moe.transformer.new_cache(len(ids)), True)
        plain = dense.transformer.forward(ids, dense.transformer.new_cache(len(ids)), True)
    assert np.max(np.abs(ours - expected)) <= 1e-4 * np.max(np.abs(expected))
    assert np.max(np.abs(ours - plain)) > 1e-2 * np.max(np.abs(plain))  # dropping 3 of 4 experts matters


def test_gate_and_up_rows_of_a_quantized_source_stay_bit_exact():
    """Splitting gate/up by rows copies their quantized blocks; down is split across groups (float32)."""
    rng = np.random.default_rng(0)
    scheme = Scheme("int4", 32, False)
    shapes = {"gate_proj": (64, 32), "up_proj": (64, 32), "down_proj": (32, 64)}
    weights = {f"model.layers.0.mlp.{proj}.weight": quantize(rng.standard_normal(shape).astype(np.float32), scheme)
               for proj, shape in shapes.items()}

    class Source:
        config = {"model_type": "llama"}
        tokenizer = SourceTokenizer(None)
        description = "test"

        def tensors(self):
            return [SourceTensor(n, w.shape, "Q4_1", w.nbytes) for n, w in weights.items()]

        def load(self, name):
            return weights[name]

        def release(self, name):
            pass

        def close(self):
            pass

    from edge.core.spec import LlamaSpec
    spec = LlamaSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1)
    neurons = np.stack([np.arange(1, 64, 2), np.arange(0, 64, 2)])  # odd neurons, even neurons
    fit = LayerMoefication(neurons, np.zeros((2, 32), np.float32), np.zeros(2, np.float32), "weights", 0.0)
    view = MoefiedSource(Source(), spec, 2, 1, (), {0: fit}, {})
    gate = view.load("model.layers.0.mlp.experts.1.gate_proj.weight")
    assert isinstance(gate, QuantizedTensor)
    assert np.array_equal(gate.qweight, weights["model.layers.0.mlp.gate_proj.weight"].qweight[0::2])
    down = view.load("model.layers.0.mlp.experts.0.down_proj.weight")
    assert np.array_equal(down, weights["model.layers.0.mlp.down_proj.weight"].dequantize()[:, 1::2])
    formats = {t.name: t.source_format for t in view.tensors()}
    assert formats["model.layers.0.mlp.experts.0.gate_proj.weight"] == "Q4_1"
    assert formats["model.layers.0.mlp.experts.0.down_proj.weight"] == "Q4_1 regrouped"
    source_plan = QuantPlan(weights="source")
    down = next(t for t in view.tensors() if t.name == "model.layers.0.mlp.experts.0.down_proj.weight")
    assert str(source_plan.scheme_for(down)) == "int8_sym_g32"  # requantized to 8 bits, not to a second 4-bit grid
    names = {t.name: t.shape for t in view.tensors()}
    assert names["model.layers.0.mlp.gate.weight"] == (2, 32) and names["model.layers.0.mlp.gate.bias"] == (2,)
    assert names["model.layers.0.mlp.experts.1.down_proj.weight"] == (32, 32)
    assert "model.layers.0.mlp.gate_proj.weight" not in names


def test_balanced_kmeans_makes_equal_experts_that_follow_the_structure():
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((4, 16))
    labels = np.repeat(np.arange(4), 8)
    points = centres[labels] + 0.05 * rng.standard_normal((32, 16))
    members = balanced_kmeans(points[rng.permutation(32)], 4)
    assert members.shape == (4, 8) and sorted(members.ravel().tolist()) == list(range(32))


def test_token_windows_are_full_and_round_robin():
    encode = lambda text: [ord(c) for c in text]  # noqa: E731
    windows = token_windows(encode, ["a" * 9, "b" * 4, "c" * 2], budget=100, window=4)
    assert ["".join(map(chr, w)) for w in windows] == ["aaaa", "bbbb", "aaaa"]


@pytest.mark.parametrize("text, message", [
    ("8", "--moefy '8' not understood; expected E:K (experts per layer : experts chosen per token), "
          "e.g. 16:13, or no value for the default"),
    ("8:x", "--moefy '8:x' not understood; expected E:K (experts per layer : experts chosen per token), "
            "e.g. 16:13, or no value for the default"),
])
def test_malformed_moefy_value(text, message):
    with pytest.raises(ConversionError) as info:
        parse_moefy(text)
    assert str(info.value) == message


def test_malformed_dense_layers():
    assert parse_dense_layers("0,-1") == (0, -1) and parse_dense_layers("auto:2") == "auto:2"
    assert parse_dense_layers("none") == ()
    with pytest.raises(ConversionError) as info:
        parse_dense_layers("first")
    assert str(info.value) == ("--moefy-dense-layers 'first' not understood; expected layer ids such as 0,29 "
                               "(negative counts from the end), auto:N (the N most sensitive layers) or none")


@pytest.mark.parametrize("experts, top_k, dense, plan, message", [
    (4, 5, (), F32, "--moefy 4:5 chooses 5 experts per token out of 4; K must be at most E"),
    (5, 2, (), F32, "--moefy 5:2: 5 experts do not split the intermediate size 96 evenly; "
                    "choose E among [2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]"),
    (4, 2, (), QuantPlan(weights="int4"),
     "--moefy 4:2 gives experts of 24 neurons, not a multiple of the experts' quantization group "
     "(int4_sym_g32); choose E among [1, 3] or store experts unquantized (--experts f16)"),
    (4, 2, (2,), F32, "dense layer 2 is out of range for a model of 2 layers (use 0..1, or negative ids from the end)"),
    (4, 2, (0, -1), F32, "dense layers [0, -1] (--moefy-dense-layers, default 0,-1) keep every layer of 2 dense; "
                        "nothing would be MoEfied: pass --moefy-dense-layers none or fewer layers"),
])
def test_bad_settings(tiny_llama, tmp_path, experts, top_k, dense, plan, message):
    with pytest.raises(ConversionError) as info:
        moefy_convert(tiny_llama, os.fspath(tmp_path / "out"), experts, top_k, dense, plan, **FAST)
    assert str(info.value) == message
    assert not os.path.exists(tmp_path / "out")


def test_moe_and_non_llama_sources_are_refused(tiny_zoo, tmp_path):
    mixtral = tiny_zoo.hf_folder("mixtral")
    with pytest.raises(UnsupportedModelError) as info:
        moefy_convert(mixtral, os.fspath(tmp_path / "a"), 4, 2, (), F32, **FAST)
    assert str(info.value) == (f"{mixtral} is already a Mixture-of-Experts model (mixtral); --moefy splits the FFNs "
                               "of a dense Llama model")
    qwen = tiny_zoo.hf_folder("qwen2_bias")
    with pytest.raises(UnsupportedModelError) as info:
        moefy_convert(qwen, os.fspath(tmp_path / "b"), 4, 2, (), F32, **FAST)
    assert str(info.value) == f"--moefy takes a dense Llama model (model_type 'llama'); {qwen} is 'qwen2'"


def test_cli_moefy(tiny_llama, tmp_path, capsys):
    out = os.fspath(tmp_path / "moe")
    assert main(["convert", tiny_llama, out, "--moefy", "4:2", "--moefy-dense-layers", "none", "--weights", "f32",
                 "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "moefied 4:2 dense layers [none]" in printed and "held-out perplexity" in printed
    assert read_manifest(out)["model"]["num_experts_per_tok"] == 2
    assert main(["convert", tiny_llama, os.fspath(tmp_path / "bad"), "--moefy", "4:9", "--quiet"]) == 2
    assert capsys.readouterr().err == "error: --moefy 4:9 chooses 9 experts per token out of 4; K must be at most E\n"


def test_auto_dense_layers_keep_the_most_sensitive_layer_dense(tiny_llama, tmp_path):
    out = os.fspath(tmp_path / "moe")
    summary = moefy_convert(tiny_llama, out, experts=4, top_k=1, dense_layers="auto:1", plan=F32, **FAST)
    assert len(summary.setting.dense_layers) == 1 and summary.setting.dense_layers[0] in (0, 1)
    manifest = read_manifest(out)
    assert manifest["model"]["dense_layers"] == list(summary.setting.dense_layers)
    assert list(manifest["moefy"]["clustering"]) == [str(1 - summary.setting.dense_layers[0])]


def test_cli_bare_moefy_is_the_default_and_malformed_values_are_errors(tiny_llama, tmp_path, capsys):
    # the tiny model has 2 layers, so the default's dense layers (first and last) leave nothing to MoEfy:
    # the error proves the bare --moefy took the default instead of swallowing SRC
    assert main(["convert", "--moefy", tiny_llama, os.fspath(tmp_path / "a"), "--weights", "f32", "--quiet"]) == 2
    dense = ", ".join(map(str, DEFAULT_MOEFY.dense_layers))
    expected = (f"error: dense layers [{dense}] (--moefy-dense-layers, default 0,-1) keep every layer of 2 dense; "
                "nothing would be MoEfied: pass --moefy-dense-layers none or fewer layers\n")
    assert capsys.readouterr().err == expected
    assert main(["convert", "--moefy", "8:x", tiny_llama, os.fspath(tmp_path / "b"), "--quiet"]) == 2
    assert capsys.readouterr().err == ("error: --moefy '8:x' not understood; expected E:K (experts per layer : "
                                       "experts chosen per token), e.g. 16:13, or no value for the default\n")
