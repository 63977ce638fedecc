"""device="cpu" end to end: the fused executor against the reference backend on every tiny model,
the SmolLM2 golden output, thread counts, the op-by-op path, observers, errors and the Numba cache.

Whole-model tolerance: the CPU backend and the reference compute the same f32 math in a different
summation order (vectorised, factored dequantization, split softmax). Each dot product has
K <= 128 terms, error ~ sqrt(K) * 2^-24 ~ 7e-7 relative, through ~10 dependent operations per
layer and 2 layers; measured <= 4e-6 absolute on logits of magnitude ~3 (about 1.3e-6 relative).
Tolerance: 1e-5 of the largest logit. Greedy tokens must be equal (a discrete result).
"""
from __future__ import annotations

import json
import re
import os
import subprocess
import sys

import numpy as np
import pytest
from tiny_models import CASE_NAMES, random_prompt

import edge
from converters.convert import QuantPlan
from edge.core.errors import ZllmError

REL_TOL = 1e-5
N_DECODE = 6
PLANS = {
    "f32": QuantPlan(weights="f32"),
    "int4_affine_g32": QuantPlan(weights="int4", group_size=32, symmetric=False),
}
# Every kind at once: int8 attention, int4 MLP, f16 embeddings, an untied f32 head where there is one.
MIXED = QuantPlan(weights="int4", group_size=64, symmetric=True,
                  overrides={"attention": "int8_affine_g128", "embeddings": "f16", "lm_head": "f32"})


def relative_error(ours: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(ours - expected).max() / np.abs(expected).max())


def run_protocol(model, prompt, n_decode=N_DECODE, feed=None, observer=None):
    """Prefill (all logits) then n_decode greedy steps; `feed` forces the tokens fed (the reference's)."""
    session = model.session(capacity=64)
    logits = [session.prefill(prompt, all_logits=True, observer=observer)]
    tokens = []
    for step in range(n_decode):
        token = int(logits[-1].reshape(-1, logits[-1].shape[-1])[-1].argmax())
        tokens.append(token)
        logits.append(session.decode(feed[step] if feed else token))
    return logits, tokens, session


@pytest.fixture(scope="module")
def load(tiny_zoo):
    opened = []

    def _load(case, plan, device, threads=None):
        model = edge.load(tiny_zoo.converted(case, plan), device=device, threads=threads)
        opened.append(model)
        return model

    yield _load
    for model in opened:
        model.close()


def decode_tolerance(device: str, plan: QuantPlan, n_layers: int) -> float:
    """REL_TOL where decode's matmul inputs stay f32; with int8 activations (device "cpu", the
    default variant, on quantized weights) the error budget `zllm-edge diff` gives the logits of an
    n_layers model whose quantized matmuls round their inputs to int8 (edge/diff.py)."""
    if device == "cpu:f32" or plan.weights in ("f32", "f16"):
        return REL_TOL
    from edge.diff import INT8_ACTIVATION_UNIT, MATMULS_IN_SERIES, SAFETY

    return SAFETY * MATMULS_IN_SERIES * np.sqrt(n_layers + 1) * INT8_ACTIVATION_UNIT


def assert_matches_reference(ours, tokens, expected, expected_tokens, tolerance):
    """Logits within `tolerance` of the largest one; greedy tokens equal wherever the reference's
    two best logits are further apart than the error either could have (discrete, exact)."""
    for step, (a, b) in enumerate(zip(ours, expected)):
        assert a.shape == b.shape and a.dtype == np.float32
        assert relative_error(a, b) <= tolerance, f"step {step}: {relative_error(a, b):.2e} > {tolerance:.2e}"
    for step, (token, expected_token) in enumerate(zip(tokens, expected_tokens)):
        last = expected[step].reshape(-1, expected[step].shape[-1])[-1]
        second, best = np.sort(last)[-2:]
        if best - second > 2 * tolerance * np.abs(last).max():
            assert token == expected_token, f"step {step}: token {token}, the reference's {expected_token}"


@pytest.mark.parametrize("device", ["cpu:f32", "cpu"])
@pytest.mark.parametrize("plan", list(PLANS), ids=str)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_tiny_model_matches_reference(load, case, plan, device):
    prompt = random_prompt(16, seed=1)
    reference_model = load(case, PLANS[plan], "reference")
    expected, expected_tokens, _ = run_protocol(reference_model, prompt)
    ours, tokens, session = run_protocol(load(case, PLANS[plan], device, threads=2), prompt, feed=expected_tokens)
    tolerance = decode_tolerance(device, PLANS[plan], reference_model.transformer.spec.num_hidden_layers)
    assert_matches_reference(ours, tokens, expected, expected_tokens, tolerance)
    if device == "cpu:f32":
        assert tokens == expected_tokens
    # prefill: f32 tiles and inputs in cpu:f32; in cpu, bf16 ones on quantized weights where the CPU
    # runs AVX-512 BF16 (inside the same per-matmul budget as decode's int8 inputs)
    assert relative_error(ours[0], expected[0]) <= (REL_TOL if device == "cpu:f32" else tolerance)
    assert session.position == session.cache.length == len(prompt) + N_DECODE
    # a prefill that asks only for the last token's logits (what generation does): its LM head is a
    # one-token product, which an int8 variant computes like decode
    last_only = load(case, PLANS[plan], device, threads=2).session(capacity=64).prefill(prompt)
    assert relative_error(last_only, expected[0][-1]) <= tolerance


@pytest.mark.parametrize("device", ["cpu:f32", "cpu"])
@pytest.mark.parametrize("case", ["llama_mha", "qwen2_swa_layer1", "qwen3_qknorm"])
def test_mixed_schemes_match_reference(load, case, device):
    """int8 attention, int4 MLPs (one input vector prepared for both orders of int8 codes), f16
    embeddings and an f32 head in one model."""
    prompt = random_prompt(12, seed=2)
    reference_model = load(case, MIXED, "reference")
    expected, expected_tokens, _ = run_protocol(reference_model, prompt)
    ours, tokens, _ = run_protocol(load(case, MIXED, device, threads=2), prompt, feed=expected_tokens)
    assert_matches_reference(ours, tokens, expected, expected_tokens,
                             decode_tolerance(device, MIXED, reference_model.transformer.spec.num_hidden_layers))


def test_append_prefill_and_decode_cross_the_window(load):
    """AppendPrefill (T > 1 at start > 0) and decode past a sliding window of 4, against the reference."""
    plan = PLANS["int4_affine_g32"]
    first, second = random_prompt(7, seed=3), random_prompt(9, seed=4)
    results = {}
    for device in ("reference", "cpu:f32"):
        session = load("mistral_swa4", plan, device, threads=2 if device != "reference" else None).session(capacity=64)
        session.prefill(first)
        appended = session.prefill(second, all_logits=True)
        decoded = session.decode(5)
        results[device] = (appended, decoded, session.position)
    assert results["cpu:f32"][2] == results["reference"][2] == len(first) + len(second) + 1
    for ours, expected in zip(results["cpu:f32"][:2], results["reference"][:2]):
        assert relative_error(ours, expected) <= REL_TOL


def test_one_and_two_threads_give_the_same_tokens(load):
    prompt = random_prompt(20, seed=5)
    _, one, _ = run_protocol(load("llama_gqa_tied", PLANS["int4_affine_g32"], "cpu", threads=1), prompt, n_decode=10)
    _, two, _ = run_protocol(load("llama_gqa_tied", PLANS["int4_affine_g32"], "cpu", threads=2), prompt, n_decode=10)
    assert one == two


@pytest.mark.parametrize("case", ["llama_rope_yarn", "qwen3_qknorm"])
def test_greedy_next_token_is_the_argmax_of_the_decoded_logits(load, case):
    """session.next_token (the fused executor picks the argmax from its scratch logits) gives the
    tokens that decode's copied logits give, step for step, and leaves the same position."""
    model = load(case, PLANS["int4_affine_g32"], "cpu", threads=2)
    prompt = random_prompt(12, seed=8)
    _, decoded, by_logits = run_protocol(model, prompt, n_decode=8)
    session = model.session(capacity=64)
    picked = [session.next_token(prompt)]
    for _ in range(7):
        picked.append(session.next_token([picked[-1]]))
    assert picked == decoded
    assert session.position == by_logits.position - 1  # run_protocol also fed its last token


def test_observer_sees_every_layer_like_the_reference(load):
    prompt = random_prompt(9, seed=6)
    seen = {}
    for device in ("reference", "cpu"):
        hidden = []
        run_protocol(load("qwen2_bias", PLANS["f32"], device), prompt, n_decode=0,
                     observer=lambda layer, h: hidden.append((layer, h.copy())))
        seen[device] = hidden
    assert [layer for layer, _ in seen["cpu"]] == [layer for layer, _ in seen["reference"]] == [0, 1]
    for (_, ours), (_, expected) in zip(seen["cpu"], seen["reference"]):
        assert ours.shape == expected.shape == (len(prompt), 64)
        assert relative_error(ours, expected) <= REL_TOL


def test_op_by_op_composition_with_cpu_kernels_matches_the_fused_executor(load):
    """Transformer.forward_ops on the CPU backend's op-level kernels (what the diff tool can call)
    equals the fused executor, and both fill the same KV layout."""
    model = load("llama_mqa", PLANS["int4_affine_g32"], "cpu", threads=2)
    prompt = np.array(random_prompt(11, seed=7))
    fused, by_ops = model.session(capacity=32), model.session(capacity=32)
    a = model.transformer.forward(prompt, fused.cache, all_logits=True)
    b = model.transformer.forward_ops(prompt, by_ops.cache, all_logits=True)
    assert relative_error(a, b) <= REL_TOL
    assert fused.cache.length == by_ops.cache.length == len(prompt)
    for (k1, v1), (k2, v2) in zip(fused.cache.layers, by_ops.cache.layers):
        assert relative_error(k1[: len(prompt)], k2[: len(prompt)]) <= REL_TOL
        assert relative_error(v1[: len(prompt)], v2[: len(prompt)]) <= REL_TOL
        assert not k1[len(prompt):].any() and not v1[len(prompt):].any()  # nothing written past the end
    # The first layer's values are the v projection of one normed prompt. The fused forward rounds
    # that input to int8 (integer-panel prefill) in the step that transposes it, linear() in its own
    # transpose stage: the same rounding and panels give the same bits.
    values_fused, values_by_ops = fused.cache.layers[0][1], by_ops.cache.layers[0][1]
    np.testing.assert_array_equal(values_fused[:len(prompt)].view(np.uint32),
                                  values_by_ops[:len(prompt)].view(np.uint32))


def test_device_info_reports_threads_and_layer(load):
    model = load("llama_mha", PLANS["f32"], "cpu", threads=1)
    run_protocol(model, random_prompt(4), n_decode=1)
    info = model.device_info()
    assert info["device"] == "cpu" and info["threads"] == 1
    assert info["threading_layer"] in ("omp", "tbb", "workqueue")
    assert info["numba_cache_dir"].startswith(os.environ["ZLLM_EDGE_HOME"])


def test_bad_thread_counts_and_variants_are_refused(tiny_zoo):
    path = tiny_zoo.converted("llama_mha", PLANS["f32"])
    with pytest.raises(ZllmError, match="threads must be a positive integer, got 0"):
        edge.load(path, device="cpu", threads=0)
    with pytest.raises(ZllmError, match="threads=4096 but Numba may start at most"):
        edge.load(path, device="cpu", threads=4096)
    with pytest.raises(ZllmError, match=r"device 'cpu' has the variants cpu:int8, cpu:f32 \(how matmuls on "
                                        r"quantized weights take their inputs: .*\); got 'cpu:fast'"):
        edge.load(path, device="cpu:fast")


@pytest.mark.parametrize("content", ["{garbage", '{"some cpu": "yes"}', "[]", "{" * 100_000])
def test_a_damaged_probe_file_is_said_and_probed_again(monkeypatch, tmp_path, capsys, content):
    from kernels.cpu import cpu_probe

    monkeypatch.setenv("ZLLM_EDGE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_probe, "_verdicts", {})
    monkeypatch.setattr(cpu_probe, "target_features", lambda: {"avx2": True})
    monkeypatch.setattr(cpu_probe.subprocess, "run", lambda *args, **kwargs: subprocess.CompletedProcess(
        args, 0, stdout="avx2 ok\n", stderr=""))
    (tmp_path / "cpu-probe.json").write_text(content)
    assert cpu_probe.runs("avx2")
    err = capsys.readouterr().err
    assert err.count(f"{tmp_path / 'cpu-probe.json'} ") == 1 and err.endswith("probing the CPU again\n")
    assert list(json.loads((tmp_path / "cpu-probe.json").read_text()).values()) == [True]  # written anew


def test_int8_dots_are_trusted_only_once_a_child_process_has_run_them(monkeypatch, tmp_path):
    """A CPU that advertises AVX-512 VNNI, AVX-VNNI and AVX2 but kills each probe (SIGILL) gets no
    int8 dot-product instruction: plain "cpu" then runs f32 activations (generic int8 code is the
    slower one) and says why, cpu:int8 runs the generic IR. The verdicts are kept per CPU in the home,
    so the next process does not start the children again; a CPU whose AVX2 child sums right gets
    vpmaddubsw and int8 by default."""
    from devices.cpu import CpuBackend
    from kernels.cpu import cpu_probe
    from kernels.cpu.llvm_ir import ACT_F32, ACT_INT8, ACT_INT8_AVX2

    monkeypatch.setenv("ZLLM_EDGE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_probe, "_verdicts", {})
    monkeypatch.setattr(cpu_probe, "target_features",
                        lambda: {"avx512vnni": True, "avx512bw": True, "avxvnni": True, "avx2": True})
    children = []

    def killed_by_sigill(*args, **kwargs):
        children.append(args[0][-1])
        return subprocess.CompletedProcess(args, -4, stdout="", stderr="")

    monkeypatch.setattr(cpu_probe.subprocess, "run", killed_by_sigill)
    assert [cpu_probe.runs(probe) for probe in ("vnni", "avxvnni", "avx2")] == [False] * 3
    assert len(children) == 3 and "child_main('avx2')" in children[2]
    monkeypatch.setattr(cpu_probe, "_verdicts", {})  # a new process: the verdicts come from the file
    assert cpu_probe.best_int8_dot() == ACT_INT8 and len(children) == 3
    assert list(json.loads((tmp_path / "cpu-probe.json").read_text()).values()) == [False] * 3
    default = CpuBackend(threads=1)
    assert default.activations == "f32" and default.activation_style == ACT_F32
    assert default.info()["variant_reason"] == ("no int8 dot-product instruction runs on this CPU, and generic "
                                                "int8 code is slower than f32")
    assert CpuBackend(threads=1, variant="int8").activation_style == ACT_INT8
    monkeypatch.setattr(cpu_probe, "target_features", lambda: {"sse4.2": True})  # LLVM would not emit them at all
    monkeypatch.setattr(cpu_probe, "_verdicts", {})
    assert cpu_probe.best_int8_dot() == ACT_INT8 and len(children) == 3

    (tmp_path / "cpu-probe.json").unlink()
    monkeypatch.setattr(cpu_probe, "_verdicts", {})
    monkeypatch.setattr(cpu_probe, "target_features", lambda: {"avx2": True})
    monkeypatch.setattr(cpu_probe.subprocess, "run", lambda *args, **kwargs: subprocess.CompletedProcess(
        args, 0, stdout="avx2 ok\n", stderr=""))
    default = CpuBackend(threads=1)
    assert default.activations == "int8" and default.activation_style == ACT_INT8_AVX2
    assert default.info()["variant_reason"] == "this CPU runs avx2 vpmaddubsw for int8 dot products"
    assert default.info()["int8_dot"] == "avx2 vpmaddubsw"


def test_bf16_prefill_is_trusted_only_once_a_child_process_has_run_it_and_measured_it_faster(monkeypatch, tmp_path):
    """AVX-512 BF16 is probed like the int8 dots, with a verdict of its own: a CPU that lists it but
    kills the probe keeps f32 prefill tiles. One whose child summed right gets bf16 tiles only if a
    second child measured them faster than f32 tiles (they are not on every CPU that has them)."""
    from devices.cpu import CpuBackend
    from kernels.cpu import cpu_probe

    monkeypatch.setenv("ZLLM_EDGE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_probe, "_verdicts", {})
    monkeypatch.setattr(cpu_probe, "target_features", lambda: {"avx512bf16": True, "avx512f": True})
    children = []

    def killed(*args, **kwargs):
        children.append(args[0][-1])
        return subprocess.CompletedProcess(args, -4, stdout="", stderr="")

    monkeypatch.setattr(cpu_probe.subprocess, "run", killed)
    assert cpu_probe.runs_bf16() is False and CpuBackend(threads=1, variant="int8").bf16_prefill is False
    assert len(children) == 1 and "child_main('bf16')" in children[0]

    def child(faster: bool):
        def run(*args, **kwargs):
            children.append(args[0][-1])
            if "bf16_faster" in args[0][-1]:
                return subprocess.CompletedProcess(args, 0, stdout="f32 2.0 ms, bf16 1.5 ms\nbf16_faster ok\n"
                                                   if faster else "f32 2.0 ms, bf16 2.5 ms\n", stderr="")
            return subprocess.CompletedProcess(args, 0, stdout="bf16 ok\n", stderr="")

        return run

    for faster in (False, True):
        monkeypatch.setattr(cpu_probe, "_verdicts", {})
        monkeypatch.setattr(cpu_probe.subprocess, "run", child(faster))
        (tmp_path / "cpu-probe.json").unlink(missing_ok=True)
        backend = CpuBackend(threads=1, variant="int8")
        assert cpu_probe.runs_bf16() is True and backend.bf16_prefill is faster
        assert backend.info()["prefill_tiles"] == ("bf16 (AVX-512 BF16, measured faster than f32 tiles here)" if faster
                                                   else "f32 (bf16 tiles measured slower on this CPU)")
        assert children[-1].endswith("child_main('bf16_faster')")
    assert CpuBackend(threads=1, variant="f32").bf16_prefill is False


def test_a_probe_that_cannot_run_is_reported_and_asked_again(monkeypatch, tmp_path):
    """A child that fails for another reason (here: exit status 1) gives no verdict: this process
    does without the instruction, with a warning, and nothing is kept, so the next process probes again."""
    from kernels.cpu import cpu_probe

    monkeypatch.setenv("ZLLM_EDGE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_probe, "_verdicts", {})
    monkeypatch.setattr(cpu_probe, "target_features", lambda: {"avx512vnni": True, "avx512bw": True})
    children = []

    def import_error(*args, **kwargs):
        children.append(args)
        return subprocess.CompletedProcess(args, 1, stdout="", stderr="ModuleNotFoundError: No module named 'numba'")

    monkeypatch.setattr(cpu_probe.subprocess, "run", import_error)
    with pytest.warns(RuntimeWarning, match=r"VNNI probe failed \(exit status 1: ModuleNotFoundError"):
        assert cpu_probe.runs("vnni") is False
    assert not (tmp_path / "cpu-probe.json").exists()
    monkeypatch.setattr(cpu_probe, "_verdicts", {})
    with pytest.warns(RuntimeWarning):
        assert cpu_probe.runs("vnni") is False
    assert len(children) == 2


def test_scheme_without_a_kernel_fails_at_load(tiny_zoo, monkeypatch):
    """If the kernel table lacks a tensor's scheme, loading fails and says which scheme and what exists."""
    from kernels.cpu import formats

    path = tiny_zoo.converted("llama_mha", QuantPlan(weights="int8", group_size=64, symmetric=False))
    monkeypatch.delitem(formats.QUANTIZED_KINDS, ("int8", False, "f16"))
    with pytest.raises(ZllmError, match=r"device 'cpu' has no kernel for a weight stored as int8_affine_g64 "
                                        r"\(shape \(\d+, \d+\)\); its kernels cover matrices in int4_sym_g"):
        edge.load(path, device="cpu")


def test_numba_cache_lives_in_the_zllm_home_not_beside_the_sources(load):
    import kernels.cpu

    run_protocol(load("llama_mha", PLANS["f32"], "cpu"), random_prompt(4), n_decode=1)
    cache_root = os.path.join(os.environ["ZLLM_EDGE_HOME"], "numba-cache")
    cached = [name for _, _, files in os.walk(cache_root) for name in files if name.endswith(".nbi")]
    assert cached, "no Numba index files under ZLLM_EDGE_HOME/numba-cache"
    source_dir = os.path.dirname(kernels.cpu.__file__)
    beside = [name for _, _, files in os.walk(source_dir) for name in files if name.endswith((".nbi", ".nbc"))]
    assert not beside, f"Numba wrote cache files beside the sources: {beside}"


def test_a_second_process_loads_kernels_from_the_cache(tiny_zoo, load):
    """Warm start: with the session's cache filled, a new process compiles nothing (it would take
    seconds; loading takes milliseconds) and gets the same logits."""
    path = tiny_zoo.converted("llama_mha", PLANS["int4_affine_g32"])
    prompt = random_prompt(5, seed=8)
    expected = load("llama_mha", PLANS["int4_affine_g32"], "cpu").session(capacity=16).prefill(prompt)
    script = (
        "import sys, json, numpy as np, edge\n"
        "model = edge.load(sys.argv[1], device='cpu')\n"
        "np.save(sys.argv[3], model.session(capacity=16).prefill(json.loads(sys.argv[2])))\n"
    )
    import numba

    out = os.path.join(os.environ["ZLLM_EDGE_HOME"], "second_process_logits.npy")
    # the home whose cache this process filled: <home>/numba-cache/<digest>
    home = os.path.dirname(os.path.dirname(numba.config.CACHE_DIR))
    env = dict(os.environ, ZLLM_EDGE_HOME=home, NUMBA_DEBUG_CACHE="1")
    result = subprocess.run([sys.executable, "-c", script, path, str(prompt), out], env=env, capture_output=True,
                            text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "[cache] data saved" not in result.stdout, "the second process compiled kernels instead of loading them"
    assert "[cache] data loaded" in result.stdout
    np.testing.assert_array_equal(np.load(out), expected)


@pytest.fixture(scope="module")
def smollm2_cpu(smollm2_checkpoint):
    with edge.load(smollm2_checkpoint, device="cpu", threads=2) as model:
        yield model


def test_smollm2_capital_of_france_begins_with_paris(smollm2_cpu):
    text = "".join(smollm2_cpu.generate("The capital of France is", max_new_tokens=4))
    assert text.startswith(" Paris"), text


def test_smollm2_greedy_ids_match_the_reference_up_to_first_near_tie(smollm2_checkpoint, smollm2_cpu):
    """The golden test of tests/test_real_model.py on device="cpu": greedy ids equal the reference's
    (which test_real_model checks against transformers) until the reference's first near-tie; the
    reference (slow: it dequantizes every weight per token) runs only that far."""
    from test_real_model import N_GREEDY, NEAR_TIE, PROMPT

    ids = smollm2_cpu.encode(PROMPT)
    expected = []
    with edge.load(smollm2_checkpoint, device="reference") as reference_model:
        session = reference_model.session(capacity=64)
        logits = session.prefill(ids)
        while len(expected) < N_GREEDY:
            top_two = np.sort(logits - np.logaddexp.reduce(logits))[-2:]
            if top_two[1] - top_two[0] < NEAR_TIE:
                break
            expected.append(int(logits.argmax()))
            logits = session.decode(expected[-1])
    assert expected, "the first step is already a near-tie; the test prompt cannot discriminate"
    generation = smollm2_cpu.generate(ids, max_new_tokens=N_GREEDY)
    list(generation)
    assert generation.result.tokens[: len(expected)] == expected


def test_smollm2_one_and_two_threads_give_the_same_bits(smollm2_checkpoint, smollm2_cpu):
    """Work is split across threads by rows and tasks, never inside a sum (a decode token's keys are
    cut by their count, kernels/cpu/attention.py decode_splits): the logits of a prefill and of
    greedy decode steps are the same bits at 1 thread as at 2, so are the tokens."""
    ids = smollm2_cpu.encode("Once upon a time")
    two = smollm2_cpu.generate(ids, max_new_tokens=12)
    list(two)
    with edge.load(smollm2_checkpoint, device="cpu", threads=1) as single:
        one = single.generate(ids, max_new_tokens=12)
        list(one)
        assert one.result.tokens == two.result.tokens
        sessions = [model.session(capacity=64) for model in (single, smollm2_cpu)]
        logits = [[session.prefill(ids, all_logits=True)] for session in sessions]
        for token in two.result.tokens[:6]:
            for session, steps in zip(sessions, logits):
                steps.append(session.decode(token))
    for at_one, at_two in zip(*logits):
        np.testing.assert_array_equal(at_one, at_two)


def test_weights_are_copied_into_huge_pages_and_experts_streamed_in_place(load):
    """Where the system has transparent huge pages the CPU backend copies a model's weights into them
    once (devices/cpu/memory.py): read-only, equal to the checkpoint's bytes, cache-line aligned (the
    parity tests above run on these copies). prepare_weight (streamed experts) never copies."""
    from devices.cpu.memory import HugePageArena
    from edge.core.process_memory import huge_pages_available
    from devices.cpu.weights import prepare_weight

    arena = HugePageArena(chunk_bytes=1 << 20)
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 255, (n, 24), dtype=np.uint8) for n in (5, 300, 2000)]  # the last needs its own chunk
    copies = [arena.copy(a) for a in arrays]
    for array, copy in zip(arrays, copies):
        np.testing.assert_array_equal(copy, array)
        assert not copy.flags.writeable and copy.ctypes.data % 64 == 0 and copy.ctypes.data != array.ctypes.data
    assert arena.copied_bytes == sum(a.nbytes for a in arrays)

    model = load("llama_mha", PLANS["int4_affine_g32"], "cpu", threads=1)
    info = model.device_info()
    assert (info["weight_bytes_in_huge_pages"] > 0) == huge_pages_available()
    weight = model.checkpoint.tensors["model.layers.0.mlp.up_proj.weight"]
    prepared = prepare_weight(weight)
    assert prepared.arrays[0].ctypes.data == weight.qweight.ctypes.data  # a view, not a copy


def test_a_kernel_compiled_now_is_said_and_one_loaded_from_the_cache_is_not():
    """The first run's compile is said on stderr while it runs (which kernel, the seconds so far) and when it
    ends; a load from the cache, which takes milliseconds, says nothing."""
    import io
    import time

    from kernels.cpu.runtime import CompileProgress

    progress = CompileProgress()
    progress.enabled, progress.stream, progress.SAY_AFTER = True, io.StringIO(), 0.05
    with progress.compiling("matvec"):
        pass
    assert progress.stream.getvalue() == "" and progress.compiled == 0
    with progress.compiling("forward"):
        time.sleep(0.5)
    lines = progress.stream.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert re.fullmatch(r"compiling cpu kernel forward \(0 compiled before it; the first run on this CPU compiles, "
                        r"later runs load them from .*numba-cache\): 0 s", lines[0]), lines[0]
    assert re.fullmatch(r"compiled cpu kernel forward in 0\.\d s", lines[1]), lines[1]
    assert progress.compiled == 1


def test_compile_progress_writes_to_stderr_as_it_is_when_the_compile_starts(monkeypatch):
    """Not the stream sys.stderr was when the module was imported: a caller that redirects stderr gets the lines."""
    import io
    import time

    from kernels.cpu.runtime import compile_progress as progress  # made at import, before capsys took stderr

    monkeypatch.setattr(progress, "enabled", True)
    monkeypatch.setattr(progress, "SAY_AFTER", 0.05)
    monkeypatch.setattr(progress, "compiled", progress.compiled)
    redirected = io.StringIO()
    monkeypatch.setattr(sys, "stderr", redirected)
    with progress.compiling("forward"):
        time.sleep(0.3)
    assert redirected.getvalue().startswith("compiling cpu kernel forward")


def test_a_first_load_runs_its_instruction_probes_side_by_side(monkeypatch, tmp_path):
    """On a new machine the widest int8 dot product and BF16 are probed at once: each child waits here until
    the other has started, which probes run one after the other would never do."""
    import threading

    from devices.cpu import CpuBackend
    from kernels.cpu import cpu_probe

    monkeypatch.setenv("ZLLM_EDGE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_probe, "_verdicts", {})
    monkeypatch.setattr(cpu_probe, "target_features",
                        lambda: {"avx512vnni": True, "avx512bw": True, "avx2": True, "avx512bf16": True})
    both_started = threading.Barrier(2, timeout=30)
    children = []

    def child(*args, **kwargs):
        probe = re.search(r"child_main\('(\w+)'\)", args[0][-1]).group(1)
        children.append(probe)
        if probe in ("vnni", "bf16"):
            both_started.wait()
        return subprocess.CompletedProcess(args, 0, stdout=f"{probe} ok\n", stderr="")

    monkeypatch.setattr(cpu_probe.subprocess, "run", child)
    backend = CpuBackend(threads=1)
    assert sorted(children[:2]) == ["bf16", "vnni"] and children[2:] == ["bf16_faster"]
    assert backend.activations == "int8" and backend.bf16_prefill
    verdicts = json.loads((tmp_path / "cpu-probe.json").read_text())
    assert sorted(verdicts.values()) == [True, True, True]
    children.clear()
    monkeypatch.setattr(cpu_probe, "_verdicts", {})
    CpuBackend(threads=1)  # kept: a second load probes nothing
    assert children == []
