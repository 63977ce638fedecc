"""GGUF files whose counts, lengths, dimensions or offsets lie: each is refused with a ConversionError
whose exact message names what the file claims, at once and without a large allocation (gguf.GGUFReader
alone loops while memory grows on some of them).

Every case starts from test_bad_input's tiny GGUF and overwrites one number in place through a writable
GGUFReader; a new case is one line of CASES. In messages, {left} is the number of bytes the file holds
after the overwritten number, {body} after the 24-byte header, {data} the size of its tensor data section.
"""
from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import require_smollm2_gguf
from gguf_files import finish
from test_bad_input import assert_nothing_written, run_cli, run_cli_subprocess, write_tiny_gguf

import converters.gguf_check
from converters.convert import QuantPlan, convert
from converters.gguf_check import check_gguf
from converters.gguf_source import GGUFSource
from edge.core.errors import ConversionError

DAMAGED = "; the file is truncated or damaged, download or export it again"
MAX_SECONDS = 2.0
MAX_PEAK_BYTES = 2**20  # of traced memory; GGUFReader alone passed 8 GB on a lying count


def key_part(key: str, part: int, value: int):
    """Overwrite part `part` of metadata key `key` (0 name length, 1 name, 2 value type, then the value's
    parts: a string's length; an array's item type, count, items)."""
    def edit(reader):
        reader.fields[key].parts[part][0] = value
        return reader.fields[key].parts[part]
    return edit


def tensor_part(name: str, part: int, value, index: int | slice = 0):
    """Overwrite item `index` of part `part` of tensor `name`'s description (0 name length, 1 name,
    2 n_dims, 3 dims, 4 GGML type, 5 data offset)."""
    def edit(reader):
        parts = next(t for t in reader.tensors if t.name == name).field.parts
        parts[part][index] = value
        return parts[part]
    return edit


def retyped_to_array(key: str):
    """Retype string key `key` to an array: its length and first 4 bytes of text become the item type and count."""
    def edit(reader):
        key_part(key, 2, gguf.GGUFValueType.ARRAY)(reader)
        return reader.fields[key].parts[4][:4]
    return edit


def bytes_after(reader, part: np.ndarray) -> int:
    return len(reader.data) - (part.ctypes.data + part.nbytes - reader.data.ctypes.data)


# "llam": general.architecture's string length (5) and text, read as an array's item type and count
ARCH_AS_COUNT = int.from_bytes(b"\0\0\0\0llam", "little")

CASES = [
    pytest.param(key_part("GGUF.tensor_count", 0, 2**40),
                 "the header claims 1099511627776 tensors (at least 26388279066624 bytes) but only {body} bytes "
                 "follow it", id="tensor-count-2**40"),
    pytest.param(key_part("GGUF.kv_count", 0, 2**40),
                 "the header claims 1099511627776 metadata keys (at least 14293651161088 bytes) but only {body} "
                 "bytes follow it", id="key-count-2**40"),
    pytest.param(key_part("tokenizer.ggml.tokens", 4, 2**63 - 1),
                 "metadata key 'tokenizer.ggml.tokens' claims 9223372036854775807 STRING array items "
                 "(at least 73786976294838206456 bytes) but only {left} bytes follow", id="string-array-2**63-1"),
    pytest.param(key_part("tokenizer.ggml.token_type", 4, 2**32),
                 "metadata key 'tokenizer.ggml.token_type' claims 4294967296 INT32 array items (17179869184 bytes) "
                 "but only {left} bytes follow", id="int32-array-2**32"),
    pytest.param(key_part("tokenizer.ggml.merges", 4, 2**64 - 1),
                 "metadata key 'tokenizer.ggml.merges' claims 18446744073709551615 STRING array items "
                 "(at least 147573952589676412920 bytes) but only {left} bytes follow", id="string-array-2**64-1"),
    pytest.param(retyped_to_array("general.architecture"),
                 f"metadata key 'general.architecture' claims {ARCH_AS_COUNT} INT32 array items "
                 f"({ARCH_AS_COUNT * 4} bytes) but only {{left}} bytes follow", id="string-retyped-to-array"),
    pytest.param(key_part("llama.block_count", 2, 13),
                 "metadata key 'llama.block_count' has value type 13, which GGUF does not define",
                 id="unknown-value-type"),
    pytest.param(key_part("tokenizer.ggml.tokens", 3, 99),
                 "metadata key 'tokenizer.ggml.tokens' has value type 99, which GGUF does not define",
                 id="unknown-array-item-type"),
    pytest.param(key_part("tokenizer.ggml.model", 3, 2**40),
                 "metadata key 'tokenizer.ggml.model' claims a string of 1099511627776 bytes but only {left} bytes "
                 "follow", id="string-length-2**40"),
    pytest.param(key_part("general.architecture", 0, 2**63),
                 "the name of metadata key #0 claims 9223372036854775808 bytes but only {left} bytes follow",
                 id="key-name-length-2**63"),
    pytest.param(tensor_part("token_embd.weight", 0, 2**32),
                 "the name of tensor #0 claims 4294967296 bytes but only {left} bytes follow",
                 id="tensor-name-length-2**32"),
    pytest.param(tensor_part("token_embd.weight", 2, 200),
                 "tensor 'token_embd.weight' claims 200 dimensions; a GGML tensor has at most 4", id="n-dims-200"),
    pytest.param(tensor_part("token_embd.weight", 3, [2**20, 2**20], index=slice(None)),
                 "tensor 'token_embd.weight' (F32, GGUF shape [1048576, 1048576]) claims 4398046511104 bytes at data "
                 "offset 0 but the data section holds only {data} bytes", id="tensor-2**40-elements"),
    pytest.param(tensor_part("output_norm.weight", 3, 72),  # the last tensor, 8 values longer
                 "tensor 'output_norm.weight' (F32, GGUF shape [72]) claims 288 bytes at data offset 189952 "
                 "but the data section holds only {data} bytes", id="last-tensor-a-little-longer"),
    pytest.param(tensor_part("output_norm.weight", 5, 2**40),
                 "tensor 'output_norm.weight' (F32, GGUF shape [64]) claims 256 bytes at data offset 1099511627776 "
                 "but the data section holds only {data} bytes", id="data-offset-past-the-end"),
    pytest.param(tensor_part("blk.0.attn_q.weight", 3, 0, index=1),
                 "tensor 'blk.0.attn_q.weight' has GGUF shape [64, 0], with an empty dimension", id="empty-dimension"),
    pytest.param(tensor_part("token_embd.weight", 4, 99),
                 "tensor 'token_embd.weight' has GGML type 99, which the gguf package does not define",
                 id="unknown-ggml-type"),
    pytest.param(tensor_part("token_embd.weight", 4, gguf.GGMLQuantizationType.Q4_K),
                 "tensor 'token_embd.weight' (Q4_K) has rows of 64 values, not a multiple of its block size 256",
                 id="row-not-whole-blocks"),
    # left to GGUFReader, which refuses them itself
    pytest.param(tensor_part("blk.0.attn_v.weight", 1, ord("k"), index=11),
                 "gguf.GGUFReader cannot read it (Found duplicated tensor with name blk.0.attn_k.weight)",
                 id="duplicate-tensor-name"),
    pytest.param(key_part("llama.block_count", 1, 0xFF),
                 "gguf.GGUFReader cannot read it ('utf-8' codec can't decode byte 0xff in position 0: invalid start "
                 "byte)", id="key-name-not-utf8"),
]


def damaged_gguf(path: Path, edit) -> tuple[Path, dict]:
    """write_tiny_gguf(path) with one number overwritten by `edit`; the {left}, {body} and {data} of its message."""
    reader = gguf.GGUFReader(write_tiny_gguf(path), "r+")
    sizes = {"body": len(reader.data) - 24, "data": len(reader.data) - reader.data_offset}
    sizes["left"] = bytes_after(reader, edit(reader))
    reader.data.flush()
    del reader
    return path, sizes


def refusal(path: Path) -> tuple[str, float, int]:
    """GGUFSource(path)'s ConversionError message, the seconds it took and the peak of traced memory."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(ConversionError) as raised:
            GGUFSource(str(path))
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return str(raised.value), seconds, peak


@pytest.mark.parametrize("edit, finding", CASES)
def test_lying_number_is_refused_at_once(edit, finding, tmp_path):
    path, sizes = damaged_gguf(tmp_path / "bad.gguf", edit)
    message, seconds, peak = refusal(path)
    assert message == "bad.gguf: " + finding.format(**sizes) + DAMAGED
    assert seconds < MAX_SECONDS
    assert peak < MAX_PEAK_BYTES


def test_convert_refuses_and_writes_nothing(tmp_path):
    path, _ = damaged_gguf(tmp_path / "bad.gguf", key_part("tokenizer.ggml.tokens", 4, 2**63 - 1))
    out = tmp_path / "out" / "ckpt"
    with pytest.raises(ConversionError) as raised:
        convert(str(path), str(out), QuantPlan(weights="int8"), progress=False)
    assert str(raised.value).startswith("bad.gguf: metadata key 'tokenizer.ggml.tokens' claims 9223372036854775807 ")
    assert_nothing_written(out)


def test_cli_prints_one_error_line(tmp_path, capsys):
    path, _ = damaged_gguf(tmp_path / "bad.gguf", tensor_part("token_embd.weight", 2, 200))
    out = tmp_path / "ckpt"
    code, stdout, stderr = run_cli(capsys, "convert", path, out, "--quiet")
    assert (code, stdout, stderr) == (2, "", "error: bad.gguf: tensor 'token_embd.weight' claims 200 dimensions; "
                                             f"a GGML tensor has at most 4{DAMAGED}\n")
    assert_nothing_written(out)


def test_cli_subprocess_refuses_a_key_retyped_to_an_array(tmp_path):
    # the fuzzer's finding: GGUFReader looped on this file while its memory passed 8 GB
    path, sizes = damaged_gguf(tmp_path / "bad.gguf", retyped_to_array("general.architecture"))
    out = tmp_path / "ckpt"
    result = run_cli_subprocess("convert", path, out, "--quiet")
    assert (result.returncode, result.stdout, result.stderr) == (2, "", (
        f"error: bad.gguf: metadata key 'general.architecture' claims {ARCH_AS_COUNT} INT32 array items "
        f"({ARCH_AS_COUNT * 4} bytes) but only {sizes['left']} bytes follow{DAMAGED}\n"))
    assert_nothing_written(out)


# ------------------------------------------------------------------------ limits on honest counts


def test_too_many_metadata_values(tmp_path, monkeypatch):
    # an honest count still costs GGUFReader about 1 KB per array item; the limit is lowered to the tiny file
    path = write_tiny_gguf(tmp_path / "many.gguf")
    reader = gguf.GGUFReader(path)
    n_keys = len(reader.fields) - 3  # less the header's version, tensor count and key count
    limit = n_keys + 260 + 100  # the 260 tokens pass, the 260 token types do not
    monkeypatch.setattr(converters.gguf_check, "MAX_METADATA_VALUES", limit)
    with pytest.raises(ConversionError) as raised:
        check_gguf(str(path))
    assert str(raised.value) == (
        f"many.gguf: metadata key 'tokenizer.ggml.token_type' claims 260 INT32 array items, which brings the metadata "
        f"to {n_keys + 520} values (keys and array items), more than the {limit} this reader accepts{DAMAGED}")


def test_too_many_tensors(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "many.gguf")
    monkeypatch.setattr(converters.gguf_check, "MAX_TENSORS", 10)
    with pytest.raises(ConversionError) as raised:
        check_gguf(str(path))
    assert str(raised.value) == (
        f"many.gguf: the header claims 11 tensors, more than the 10 this reader accepts{DAMAGED}")


def metadata_only_gguf(path: Path, edit, endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    edit(writer)
    finish(writer)
    return path


@pytest.mark.parametrize("endianess", list(gguf.GGUFEndian))
def test_valid_file_passes_in_either_byte_order(endianess, tmp_path):
    def add(writer):
        writer.add_token_list(["a", "bc", ""])
        writer.add_array("nested", [[1, 2], [3]])
        writer.add_custom_alignment(64)
        writer.add_tensor("x", np.ones((3, 8), np.float32))
        writer.add_tensor("y", np.ones(8, np.float32))
    path = metadata_only_gguf(tmp_path / "ok.gguf", add, endianess)
    check_gguf(str(path))
    assert [t.name for t in gguf.GGUFReader(path).tensors] == ["x", "y"]


@pytest.mark.parametrize("depth, refused", [(4, False), (5, True)])
def test_nested_arrays(depth, refused, tmp_path):
    value = [1]
    for _ in range(depth - 1):
        value = [value, value]
    path = metadata_only_gguf(tmp_path / "nested.gguf", lambda writer: writer.add_array("nested", value))
    if not refused:
        check_gguf(str(path))
        return
    with pytest.raises(ConversionError) as raised:
        check_gguf(str(path))
    assert str(raised.value) == f"nested.gguf: metadata key 'nested' nests arrays more than 4 deep{DAMAGED}"


@pytest.mark.parametrize("add, finding", [
    (lambda writer: writer.add_uint32(gguf.Keys.General.ALIGNMENT, 48), "is 48; expected a power of two"),
    (lambda writer: writer.add_uint64(gguf.Keys.General.ALIGNMENT, 32),
     "is stored as UINT64; expected a UINT32 power of two"),
])
def test_bad_alignment(add, finding, tmp_path):
    path = metadata_only_gguf(tmp_path / "aligned.gguf", add)
    with pytest.raises(ConversionError) as raised:
        check_gguf(str(path))
    assert str(raised.value) == f"aligned.gguf: metadata key 'general.alignment' {finding}{DAMAGED}"


def test_real_file_passes_quickly():
    start = time.perf_counter()
    check_gguf(str(require_smollm2_gguf()))
    assert time.perf_counter() - start < MAX_SECONDS
