"""The zllm checkpoint on disk, checked with the reference libraries rather than with our reader:

- model.safetensors opens with the `safetensors` package and holds exactly the arrays zllm.json
  lists, with their dtypes and shapes (and, for --weights f32, the source's values bit for bit);
- zllm.json's size and sha256 describe model.safetensors;
- edge.load hands out read-only views of a memory map, not copies;
- GGUF Q4_0 / Q4_1 / Q8_0 tensors survive the whole converter bit-exactly: the checkpoint's
  dequantized values equal gguf.quants.dequantize of the source (a tiny GGUF written here with
  all three types, and the real SmolLM2 Q4_1 GGUF with its Q4_1 and Q8_0 tensors).
"""
from __future__ import annotations

import collections
import hashlib
import json
import math
import mmap
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf_files import add_byte_level_tokenizer, finish, llama_cpp_permute
from safetensors import safe_open

import edge
from converters.convert import QuantPlan, convert
from quant import QuantizedTensor
from quant.checkpoint import open_checkpoint

SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "U8": np.uint8}

# GGUF type -> the zllm scheme it must import as, without requantization (DESIGN.md).
LOSSLESS = {"Q4_0": "int4_sym_g32", "Q4_1": "int4_affine_g32", "Q8_0": "int8_sym_g32"}

# llama.cpp -> Hugging Face tensor names, as llama.cpp's gguf-py tensor_mapping.py lists them.
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                     "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str) -> str:
    if gguf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[gguf_name]
    _, layer, kind, suffix = gguf_name.split(".")
    return f"model.layers.{layer}.{GGUF_LAYER_NAMES[kind]}.{suffix}"


def bits(a: np.ndarray) -> np.ndarray:
    """float32 bit patterns, so that equality is bit-exactness (and NaN == NaN, -0 != +0)."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def expected_arrays(name: str, scheme: str, shape: list[int]) -> dict[str, tuple[type, tuple[int, ...]]]:
    """The stored arrays of one tensor, from the layout quant/checkpoint.py documents:
    W.qweight uint8 [N, groups, group_size * bits / 8], W.scales float16 [N, groups],
    W.offsets float16 [N, groups] for affine schemes; a float tensor is stored as itself."""
    if scheme in ("f32", "f16"):
        return {name: (np.float32 if scheme == "f32" else np.float16, tuple(shape))}
    dtype, kind, group = scheme.split("_")
    group_size, n_bits = int(group[1:]), int(dtype[3:])
    n_rows, k = shape
    groups = math.ceil(k / group_size)
    arrays = {f"{name}.qweight": (np.uint8, (n_rows, groups, group_size * n_bits // 8)),
              f"{name}.scales": (np.float16, (n_rows, groups))}
    if kind == "affine":
        arrays[f"{name}.offsets"] = (np.float16, (n_rows, groups))
    return arrays


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def reaches_mmap(array: np.ndarray) -> bool:
    """Whether an array's chain of bases ends in a memory map (i.e. it is a view, not a copy)."""
    base = array
    while base is not None:
        if isinstance(base, mmap.mmap):
            return True
        base = getattr(base, "base", None)
    return False


# ------------------------------------------------------------------------------- sources


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # K = 96 (down_proj) is not a multiple of 64 or 128: the last group of those schemes is padded.
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    folder = tmp_path_factory.mktemp("hf") / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def write_tiny_quantized_gguf(path: Path) -> tuple[Path, dict[str, str]]:
    """A 3-layer Llama GGUF whose matrices use Q4_0, Q4_1 and Q8_0 (every type on q and on k, so the
    row un-permutation is checked for each), with a minimal byte-level tokenizer. Returns the path
    and each tensor's GGUF type."""
    hidden, ffn, heads, kv_heads, vocab = 64, 96, 4, 2, 260
    head_dim = hidden // heads
    rng = np.random.default_rng(7)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(3)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    add_byte_level_tokenizer(writer, vocab)
    Q = GGMLQuantizationType
    types: dict[str, str] = {}

    def matrix(name: str, n: int, k: int, qtype: GGMLQuantizationType) -> None:
        values = rng.normal(0, 0.1, (n, k)).astype(np.float32)
        values[0, :32] = 0.0  # an all-zero block (scale 0)
        values[1, 5] = 3.0  # an outlier
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        types[name] = qtype.name

    def vector(name: str, n: int) -> None:
        writer.add_tensor(name, (1 + 0.1 * rng.normal(size=n)).astype(np.float32))
        types[name] = "F32"

    matrix("token_embd.weight", vocab, hidden, Q.Q8_0)
    per_layer = [(Q.Q4_0, Q.Q4_1, Q.Q8_0), (Q.Q8_0, Q.Q4_0, Q.Q4_1), (Q.Q4_1, Q.Q8_0, Q.Q4_0)]
    for layer, (a, b, c) in enumerate(per_layer):
        p = f"blk.{layer}."
        vector(p + "attn_norm.weight", hidden)
        matrix(p + "attn_q.weight", heads * head_dim, hidden, a)
        matrix(p + "attn_k.weight", kv_heads * head_dim, hidden, b)
        matrix(p + "attn_v.weight", kv_heads * head_dim, hidden, c)
        matrix(p + "attn_output.weight", hidden, hidden, a)
        vector(p + "ffn_norm.weight", hidden)
        matrix(p + "ffn_gate.weight", ffn, hidden, b)
        matrix(p + "ffn_up.weight", ffn, hidden, c)
        matrix(p + "ffn_down.weight", hidden, ffn, a)
    vector("output_norm.weight", hidden)
    matrix("output.weight", vocab, hidden, Q.Q4_1)
    finish(writer)
    return path, types


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    return write_tiny_quantized_gguf(tmp_path_factory.mktemp("gguf") / "tiny-quantized.gguf")


PLANS = {
    "f32": QuantPlan(weights="f32"),
    "f16": QuantPlan(weights="f16"),
    "int8": QuantPlan(weights="int8"),
    "int4-affine-g64": QuantPlan(weights="int4", group_size=64, symmetric=False),
    "mixed": QuantPlan(weights="int4", group_size=128,
                       overrides={"attention": "int8_affine_g32", "embeddings": "f16", "lm_head": "int8"}),
}


@pytest.fixture(scope="module")
def tiny_checkpoints(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    paths = {}
    for key, plan in PLANS.items():
        paths[key] = root / key
        convert(str(tiny_llama), str(paths[key]), plan, progress=False)
    return paths


# ------------------------------------------------------------ the files, read by reference tools


def check_safetensors_matches_manifest(checkpoint: Path) -> dict:
    """model.safetensors, opened by the safetensors package, holds exactly the arrays zllm.json lists."""
    manifest = json.loads((checkpoint / "zllm.json").read_text())
    assert (manifest["format"], manifest["format_version"]) == ("zllm", 1)
    listed: dict[str, dict] = {}
    for name, info in manifest["tensors"].items():
        assert info["file"] == "model.safetensors"
        arrays = info["arrays"]
        # what zllm.json lists is the documented layout of the tensor's scheme and shape
        assert {key: (np.dtype(SAFETENSORS_DTYPES[a["dtype"]]), tuple(a["shape"])) for key, a in arrays.items()} == {
            key: (np.dtype(dtype), shape) for key, (dtype, shape) in
            expected_arrays(name, info["scheme"], info["shape"]).items()
        }, name
        listed.update(arrays)
    with safe_open(str(checkpoint / "model.safetensors"), framework="numpy") as f:
        assert set(f.keys()) == set(listed)
        assert f.metadata() == {"format": "zllm"}
        for key, info in listed.items():
            array = f.get_tensor(key)
            assert (array.dtype, list(array.shape)) == (np.dtype(SAFETENSORS_DTYPES[info["dtype"]]), info["shape"]), key
    return manifest


@pytest.mark.parametrize("plan", PLANS)
def test_tiny_checkpoint_opens_in_safetensors(plan, tiny_checkpoints):
    manifest = check_safetensors_matches_manifest(tiny_checkpoints[plan])
    assert manifest["model"]["model_type"] == "llama"
    assert manifest["model"]["num_hidden_layers"] == 2


def test_mixed_plan_schemes(tiny_checkpoints):
    manifest = json.loads((tiny_checkpoints["mixed"] / "zllm.json").read_text())
    schemes = {name: t["scheme"] for name, t in manifest["tensors"].items()}
    assert schemes["model.embed_tokens.weight"] == "f16"
    assert schemes["lm_head.weight"] == "int8_sym_g128"
    assert schemes["model.layers.1.self_attn.k_proj.weight"] == "int8_affine_g32"
    assert schemes["model.layers.1.mlp.down_proj.weight"] == "int4_sym_g128"
    assert schemes["model.layers.1.input_layernorm.weight"] == "f32"


def test_f32_checkpoint_holds_the_source_values_exactly(tiny_llama, tiny_checkpoints):
    manifest = json.loads((tiny_checkpoints["f32"] / "zllm.json").read_text())
    with safe_open(str(tiny_llama / "model.safetensors"), framework="numpy") as source, \
            safe_open(str(tiny_checkpoints["f32"] / "model.safetensors"), framework="numpy") as stored:
        assert set(stored.keys()) == set(source.keys()) == set(manifest["tensors"])
        for name in source.keys():
            expected = source.get_tensor(name)
            assert expected.dtype == np.float32
            np.testing.assert_array_equal(bits(stored.get_tensor(name)), bits(expected), err_msg=name)


def test_f16_checkpoint_holds_the_source_values_rounded_to_f16(tiny_llama, tiny_checkpoints):
    with safe_open(str(tiny_llama / "model.safetensors"), framework="numpy") as source, \
            safe_open(str(tiny_checkpoints["f16"] / "model.safetensors"), framework="numpy") as stored:
        for name in source.keys():
            expected = source.get_tensor(name)
            if expected.ndim == 1:  # norm weights stay f32
                np.testing.assert_array_equal(stored.get_tensor(name), expected, err_msg=name)
            else:
                np.testing.assert_array_equal(stored.get_tensor(name), expected.astype(np.float16), err_msg=name)


@pytest.mark.parametrize("plan", PLANS)
def test_manifest_checksum_and_size(plan, tiny_checkpoints):
    checkpoint = tiny_checkpoints[plan]
    manifest = json.loads((checkpoint / "zllm.json").read_text())
    weights = checkpoint / "model.safetensors"
    assert manifest["files"] == {"model.safetensors": {"bytes": weights.stat().st_size, "sha256": sha256(weights)}}


def test_smollm2_checkpoint_files(smollm2_checkpoint):
    manifest = check_safetensors_matches_manifest(smollm2_checkpoint)
    weights = smollm2_checkpoint / "model.safetensors"
    assert manifest["files"]["model.safetensors"]["sha256"] == sha256(weights)
    assert manifest["tokenizer"]["file"] == "tokenizer.json"
    from tokenizers import Tokenizer

    Tokenizer.from_file(str(smollm2_checkpoint / "tokenizer.json"))  # a valid tokenizers file


# ------------------------------------------------------------------------- zero-copy loading


@pytest.mark.parametrize("plan", ["f32", "int4-affine-g64", "mixed"])
def test_load_hands_out_read_only_mmap_views(plan, tiny_checkpoints):
    model = edge.load(str(tiny_checkpoints[plan]))
    try:
        tensors = model.checkpoint.tensors
        assert set(tensors) == set(json.loads((tiny_checkpoints[plan] / "zllm.json").read_text())["tensors"])
        for name, tensor in tensors.items():
            if isinstance(tensor, QuantizedTensor):
                arrays = [tensor.qweight, tensor.scales] + ([] if tensor.offsets is None else [tensor.offsets])
            else:
                arrays = [tensor]
            for array in arrays:
                assert not array.flags.writeable, name
                assert reaches_mmap(array), f"{name} is a copy, not a view of the checkpoint's memory map"
        # and the views hold what the reference reader reads
        with safe_open(str(tiny_checkpoints[plan] / "model.safetensors"), framework="numpy") as f:
            for name, tensor in tensors.items():
                if isinstance(tensor, QuantizedTensor):
                    np.testing.assert_array_equal(tensor.qweight, f.get_tensor(name + ".qweight"))
                    np.testing.assert_array_equal(tensor.scales, f.get_tensor(name + ".scales"))
                else:
                    np.testing.assert_array_equal(tensor, f.get_tensor(name))
    finally:
        model.close()


def test_smollm2_load_is_zero_copy(smollm2_checkpoint):
    model = edge.load(str(smollm2_checkpoint))
    try:
        for name, tensor in model.checkpoint.tensors.items():
            array = tensor.qweight if isinstance(tensor, QuantizedTensor) else tensor
            assert not array.flags.writeable and reaches_mmap(array), name
        # 96 MB of weights are mapped, not read: the model's own arrays add nothing to the heap
        assert model.stats()["weight_bytes"] == sum(t.nbytes for t in model.checkpoint.tensors.values())
    finally:
        model.close()


# ------------------------------------------------------------------- GGUF bit-exact round trip


def check_gguf_round_trip(gguf_path: Path, checkpoint: Path) -> dict[str, int]:
    """Every tensor of the GGUF, dequantized by the gguf package, equals the checkpoint's tensor
    (dequantized by zllm) bit for bit. Returns how many tensors of each GGUF type were compared."""
    reader = gguf.GGUFReader(str(gguf_path))
    heads = int(reader.fields["llama.attention.head_count"].contents())
    kv_heads = int(reader.fields["llama.attention.head_count_kv"].contents())
    manifest = json.loads((checkpoint / "zllm.json").read_text())
    compared: dict[str, int] = {}
    with open_checkpoint(str(checkpoint)) as ckpt:
        assert len(ckpt.tensors) == len(reader.tensors)
        for source in reader.tensors:
            name = hf_name(source.name)
            kind = source.tensor_type.name
            shape = tuple(int(d) for d in reversed(source.shape))  # GGUF lists dimensions fastest first
            expected = np.asarray(gguf.quants.dequantize(source.data, source.tensor_type), np.float32).reshape(shape)
            stored = ckpt.tensors[name]
            info = manifest["tensors"][name]
            assert info["source_format"] == kind
            if kind in LOSSLESS:
                assert isinstance(stored, QuantizedTensor), name
                assert info["scheme"] == LOSSLESS[kind]
                assert (info["max_abs_error"], info["rel_rms_error"]) == (0.0, 0.0)
                values = stored.dequantize()
            else:
                assert info["scheme"] == "f32"
                values = np.asarray(stored)
            if ".self_attn.q_proj." in name:
                values = llama_cpp_permute(values, heads)
            elif ".self_attn.k_proj." in name:
                values = llama_cpp_permute(values, kv_heads)
            assert values.shape == shape, name
            np.testing.assert_array_equal(bits(values), bits(expected), err_msg=f"{name} ({kind})")
            compared[kind] = compared.get(kind, 0) + 1
    return compared


def test_tiny_gguf_q4_0_q4_1_q8_0_round_trip_bit_exact(tiny_gguf, tmp_path, capsys):
    path, types = tiny_gguf
    out = tmp_path / "ckpt"
    import edge.cli

    assert edge.cli.main(["convert", str(path), str(out), "--weights", "source", "--quiet"]) == 0
    assert f"{len(types)} tensors kept bit-exact, 0 (re)quantized or cast" in capsys.readouterr().out
    compared = check_gguf_round_trip(path, out)
    assert compared == dict(collections.Counter(types.values()))
    assert compared == {"Q4_0": 7, "Q4_1": 8, "Q8_0": 8, "F32": 7}
    q_and_k_types = {types[f"blk.{layer}.attn_{qk}.weight"] for layer in range(3) for qk in "qk"}
    assert q_and_k_types == {"Q4_0", "Q4_1", "Q8_0"}
    check_safetensors_matches_manifest(out)


def test_tiny_gguf_q_and_k_rows_are_in_hugging_face_order(tiny_gguf, tmp_path):
    """The un-permutation gives the Hugging Face layout: head h's first half of rotary rows come first."""
    path, _ = tiny_gguf
    out = tmp_path / "ckpt"
    convert(str(path), str(out), QuantPlan(weights="f32"), progress=False)
    reader = gguf.GGUFReader(str(path))
    source = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    gguf_rows = gguf.quants.dequantize(source.data, source.tensor_type).reshape(64, 64)
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        hf_rows = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    head_dim = 16
    # GGUF row 2i of head h is Hugging Face row i of that head; GGUF row 2i+1 is row i + head_dim/2.
    for h in range(4):
        for i in range(head_dim // 2):
            np.testing.assert_array_equal(hf_rows[h * head_dim + i], gguf_rows[h * head_dim + 2 * i])
            np.testing.assert_array_equal(hf_rows[h * head_dim + head_dim // 2 + i],
                                          gguf_rows[h * head_dim + 2 * i + 1])


def test_smollm2_round_trip_bit_exact(smollm2_gguf, smollm2_checkpoint):
    compared = check_gguf_round_trip(smollm2_gguf, smollm2_checkpoint)
    # SmolLM2-135M Q4_1: token_embd in Q8_0, the 210 other matrices in Q4_1, 61 norm vectors in F32
    assert compared == {"Q8_0": 1, "Q4_1": 210, "F32": 61}
