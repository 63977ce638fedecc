"""`zllm-edge bench`: the report's keys and invariants on a tiny model (token-id prompt) and on
SmolLM2 (text prompt), alternation of devices, prompts, and refused requests.

Timings are not checked against any figure (benchmarks are not tests); what is checked is that
they are measured (positive, consistent with each other) and that the greedy tokens are exactly
those of an independent generation.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from tiny_models import VOCAB

import edge
import edge.cli
from converters.convert import QuantPlan
from edge.bench import benchmark_prompt, id_prompt, run_bench

TINY_CASE = "llama_gqa_tied"
DEVICE_KEYS = {
    "device", "device_info", "load_seconds", "weight_bytes", "rss_after_load_bytes",
    "cold_time_to_first_token_seconds", "runs", "peak_rss_bytes", "prefill_tokens_per_second",
    "decode_tokens_per_second", "time_to_first_token_seconds", "prefill_seconds", "decode_seconds", "tokens",
    "text", "tokens_identical_across_repeats",
    "device_upload_seconds", "device_memory_bytes", "device_memory",  # None where the device has no memory of its own
}
RUN_KEYS = {"prefill_seconds", "decode_seconds", "time_to_first_token_seconds", "prompt_tokens", "decode_steps",
            "decode_thread_seconds",
            "tokens", "text", "prefill_tokens_per_second", "decode_tokens_per_second"}


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_zoo):
    return tiny_zoo.converted(TINY_CASE, QuantPlan(weights="int4", group_size=32, symmetric=False))


def run_cli(capsys, *argv):
    capsys.readouterr()
    code = edge.cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_tiny_model_json_report(tiny_checkpoint, tmp_path, capsys):
    report_path = tmp_path / "bench.json"
    code, out, err = run_cli(capsys, "bench", tiny_checkpoint, "--prompt-tokens", 12, "--new-tokens", 6,
                             "--repeats", 2, "--json", report_path)
    assert code == 0
    report = json.loads(report_path.read_text())
    assert set(report) == {"model", "model_type", "prompt_tokens", "prompt_source", "new_tokens", "decode_steps",
                           "repeats", "threads", "devices", "ratios", "machine"}
    assert (report["prompt_tokens"], report["new_tokens"], report["decode_steps"], report["repeats"]) == (12, 6, 5, 2)
    assert report["prompt_source"].startswith("no tokenizer: 12 ids drawn by numpy default_rng(0)")
    assert list(report["devices"]) == ["reference"] and report["ratios"] == {}
    result = report["devices"]["reference"]
    assert set(result) == DEVICE_KEYS | {"greedy_tokens_agreeing_with_reference"}
    assert len(result["runs"]) == 2 and all(set(run) == RUN_KEYS for run in result["runs"])
    assert result["device_info"]["device"] == "reference"
    for run in result["runs"]:
        assert (run["prompt_tokens"], run["decode_steps"], len(run["tokens"])) == (12, 5, 6)
        assert run["prefill_seconds"] > 0 and run["decode_seconds"] > 0
        assert run["time_to_first_token_seconds"] >= run["prefill_seconds"]
        assert run["prefill_tokens_per_second"] == pytest.approx(12 / run["prefill_seconds"], rel=1e-12)
        assert run["decode_tokens_per_second"] == pytest.approx(5 / run["decode_seconds"], rel=1e-12)
    assert result["tokens_identical_across_repeats"] and result["greedy_tokens_agreeing_with_reference"] == 6
    assert result["text"] is None  # no tokenizer
    assert result["peak_rss_bytes"] >= result["rss_after_load_bytes"] > 0
    # the table went to stdout, progress to stderr
    assert "decode (tokens/s)" in out and "peak RSS (MB)" in out
    assert "[bench] repeat 2/2 reference: prefill" in err

    # The bench's greedy tokens are exactly those of an ordinary greedy generation from the same ids.
    prompt_ids, _ = benchmark_prompt(tiny_checkpoint, 12)
    with edge.load(tiny_checkpoint) as model:
        generation = model.generate(prompt_ids, max_new_tokens=6)
        list(generation)
    generated = generation.result.tokens
    assert generated == result["tokens"][: len(generated)]


def test_devices_alternate_and_ratios_compare_to_the_first(tiny_checkpoint, capsys):
    code, out, err = run_cli(capsys, "bench", tiny_checkpoint, "--device", "reference,reference",
                             "--prompt-tokens", 8, "--new-tokens", 3, "--repeats", 2, "--json", "-")
    assert code == 0
    report = json.loads(out)  # --json - : stdout holds only the JSON, the table goes to stderr
    assert list(report["devices"]) == ["reference", "reference#2"]
    assert report["devices"]["reference#2"]["device"] == "reference"
    ratios = report["ratios"]["reference#2/reference"]
    a, b = report["devices"]["reference"], report["devices"]["reference#2"]
    assert ratios["decode_tokens_per_second"] == pytest.approx(b["decode_tokens_per_second"] / a["decode_tokens_per_second"])
    assert a["tokens"] == b["tokens"] and b["greedy_tokens_agreeing_with_reference"] == 3
    repeats = [line.split(":")[0] for line in err.splitlines() if line.startswith("[bench] repeat")]
    assert repeats == ["[bench] repeat 1/2 reference", "[bench] repeat 1/2 reference#2",
                       "[bench] repeat 2/2 reference", "[bench] repeat 2/2 reference#2"]
    assert "reference#2/reference" in err


def test_id_prompt_is_deterministic_and_avoids_special_tokens():
    special = {0, 1, 2}
    ids = id_prompt(VOCAB, special, 50)
    assert ids == id_prompt(VOCAB, special, 50) and len(ids) == 50
    assert not special & set(ids) and all(0 <= i < VOCAB for i in ids)


def test_text_prompt_has_exactly_n_tokens_of_python_docs(smollm2_checkpoint):
    from pydoc_data.topics import topics

    with edge.load(smollm2_checkpoint) as model:
        body = model.tokenizer.encode(topics["execmodel"], add_special_tokens=False)
        for n in (1, 5, 128, len(body) + 3):
            ids, source = benchmark_prompt(str(smollm2_checkpoint), n)
            assert len(ids) == n
            expected = ([model.tokenizer.bos_token_id] if model.tokenizer.add_bos_token else []) + body * 2
            assert ids == expected[:n]
        assert source.startswith("pydoc_data.topics['execmodel'] of Python")
        assert model.decode(benchmark_prompt(str(smollm2_checkpoint), 6)[0]).startswith("Execution model")


def test_smollm2_bench_with_text_prompt(smollm2_checkpoint, capsys):
    code, out, err = run_cli(capsys, "bench", smollm2_checkpoint, "--prompt-tokens", 6, "--new-tokens", 3,
                             "--repeats", 1, "--json", "-", "--quiet")
    assert code == 0 and "decode (tokens/s)" in err and "[bench]" not in err
    report = json.loads(out)
    result = report["devices"]["reference"]
    assert report["prompt_tokens"] == 6 and len(result["tokens"]) == 3
    prompt_ids, _ = benchmark_prompt(str(smollm2_checkpoint), 6)
    with edge.load(smollm2_checkpoint) as model:
        session = model.session(capacity=16)
        expected = [int(np.argmax(session.prefill(prompt_ids)))]
        for _ in range(2):
            expected.append(int(np.argmax(session.decode(expected[-1]))))
        assert result["tokens"] == expected
        assert result["text"] == model.decode(expected)


def test_refusals(tiny_checkpoint, capsys):
    code, out, err = run_cli(capsys, "bench", tiny_checkpoint, "--device", "nope", "--prompt-tokens", 4,
                             "--new-tokens", 2, "--quiet")
    assert (code, out) == (2, "")
    assert err.startswith("error: device nope: device 'nope' is not available; available devices: reference")
    assert err.count("\n") == 1
    code, _, err = run_cli(capsys, "bench", tiny_checkpoint, "--prompt-tokens", 60, "--new-tokens", 5, "--quiet")
    assert (code, err) == (2, "error: 60 prompt + 5 new tokens exceed the model's context of 64 tokens; "
                              "lower --prompt-tokens or --new-tokens\n")
    code, _, err = run_cli(capsys, "bench", tiny_checkpoint, "--new-tokens", 0, "--quiet")
    assert (code, err) == (2, "error: --new-tokens and --repeats must be at least 1, got 0 and 3\n")
    with pytest.raises(edge.ZllmError, match="the prompt needs at least 1 token, got --prompt-tokens 0"):
        run_bench(tiny_checkpoint, ["reference"], prompt_tokens=0)


def test_reference_and_cpu_side_by_side(tiny_checkpoint, capsys):
    from devices.base import BACKENDS

    if "cpu" not in BACKENDS:
        pytest.skip("the cpu backend is not registered in devices.base.BACKENDS")
    code, out, err = run_cli(capsys, "bench", tiny_checkpoint, "--device", "reference,cpu", "--threads", 1,
                             "--prompt-tokens", 8, "--new-tokens", 4, "--repeats", 1, "--json", "-", "--quiet")
    assert code == 0
    report = json.loads(out)
    assert list(report["devices"]) == ["reference", "cpu"] and list(report["ratios"]) == ["cpu/reference"]
    assert report["devices"]["cpu"]["device_info"]["device"] == "cpu" and report["threads"] == 1
    assert len(report["devices"]["cpu"]["tokens"]) == 4
    header = next(line for line in err.splitlines() if line.startswith("metric"))
    assert header.split() == ["metric", "reference", "cpu", "cpu/reference"]
