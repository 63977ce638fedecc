"""`zllm-edge bench --memory-budget` and `zllm-edge calibrate` on a tiny MoE: report keys, the plot,
bit-identical tokens across strategies, refused budgets; calibration writes predictor.json.

Speeds are not checked (benchmarks are not tests)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from tiny_models import tiny_zoo  # noqa: F401

import edge
import edge.cli
from edge.bench_moe import RSS_TOLERANCE
from converters.convert import QuantPlan
from streaming.floor import POLICIES, demand_reads, read_seconds
from streaming.predictor import PREDICTOR_FILE, SignalWeights
from streaming.storage import parse_storage

FIRST_RUN_SLACK = 8_000_000
MOE_CASE = "qwen3_moe_norm"  # 2 MoE layers, top-2 of 8 experts
ROW_KEYS = {"strategy", "budget", "budget_bytes", "expert_cache_bytes", "expert_bytes", "expert_share", "memory_plan",
            "load_seconds", "decode_tokens_per_second", "prefill_tokens_per_second", "hit_rate", "expert_hits",
            "expert_misses", "bytes_read", "io_stall_seconds", "stall_fraction", "io_hidden_fraction",
            "predictor_precision", "predictor_recall", "predictor_recall_by_distance", "storage", "io_mode",
            "peak_rss_bytes", "baseline_rss_bytes", "peak_rss_over_baseline_bytes", "import_baseline_rss_bytes",
            "peak_rss_over_import_bytes", "process_within_budget", "tokens",
            "runs", "tokens_match_resident", "greedy_tokens_agreeing_with_resident", "decode_vs_resident"}


@pytest.fixture(scope="module")
def moe_checkpoint(tiny_zoo):
    return tiny_zoo.converted(MOE_CASE, QuantPlan(weights="int8"))


def run_cli(capsys, *argv):
    capsys.readouterr()
    code = edge.cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_budget_sweep_reports_every_strategy(moe_checkpoint, tmp_path, capsys):
    report_path, plot_path = tmp_path / "report.json", tmp_path / "budget.png"
    code, out, err = run_cli(capsys, "bench", moe_checkpoint, "--memory-budget", "50%,100%,1KB", "--storage", "nvme",
                             "--prompt-tokens", 6, "--new-tokens", 8, "--repeats", 2, "--json", report_path,
                             "--plot", plot_path, "--quiet")
    assert code == 0, err
    report = json.loads(report_path.read_text())
    assert report["storage"] == "nvme" and report["budgets"] == ["50%", "100%", "1KB"]
    assert report["interpreter_baseline_rss_bytes"] > 0
    configs = {(row["strategy"], row["budget"]): row for row in report["configs"]}
    assert set(configs) == {("resident", "100%")} | {(s, b) for s in ("mmap", "ondemand", "predictive")
                                                     for b in ("50%", "100%", "1KB")}
    for strategy in ("mmap", "ondemand", "predictive"):
        refused = configs[(strategy, "1KB")]
        assert refused["error"].startswith("device reference: memory budget 1000 bytes (0.0 MB) is below this "
                                           "model's minimum working set of ")
        for budget in ("50%", "100%"):
            row = configs[(strategy, budget)]
            assert ROW_KEYS - {"decode_vs_mmap"} <= set(row)
            assert row["tokens_match_resident"]  # streaming never changes a token
            assert len(row["tokens"]) == 2 and all(len(t) == 8 for t in row["tokens"])
            assert row["expert_hits"] + row["expert_misses"] > 0 and 0 <= row["hit_rate"] <= 1
            assert row["decode_vs_mmap"] == pytest.approx(
                row["decode_tokens_per_second"] / configs[("mmap", budget)]["decode_tokens_per_second"])
            assert (row["predictor_recall"] is None) == (strategy != "predictive")
            # the budget counts the runtime and holds the process: a tiny model's budget is mostly runtime, and
            # library code pages and heap first touched by the first run (a few MB) are measured by no part
            assert row["memory_plan"]["runtime_bytes"] > 0
            assert row["peak_rss_over_import_bytes"] <= row["budget_bytes"] * (1 + RSS_TOLERANCE) + FIRST_RUN_SLACK
    assert configs[("predictive", "50%")]["expert_share"] == pytest.approx(0.5, abs=0.01)
    assert configs[("resident", "100%")]["hit_rate"] == 1.0
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tokens = resident" in out and "refused: device reference: memory budget 1000 bytes" in out


@pytest.mark.parametrize("budgets, message", [
    ("150%", "memory budget '150%': a share of the expert bytes must be in (0%, 100%]"),
    ("50%,lots", "memory budget 'lots' not understood; use bytes, a size such as 512MB or 2GiB, or a share of the "
                 "expert bytes such as 50%"),
    (",", "--memory-budget ',' names no budget; give e.g. 25%,50%,75%,100% or 512MB"),
])
def test_bad_budgets_are_refused(moe_checkpoint, capsys, budgets, message):
    code, _, err = run_cli(capsys, "bench", moe_checkpoint, "--memory-budget", budgets, "--quiet")
    assert code == 2 and err == f"error: {message}\n"


def test_bench_refuses_bad_strategy_and_dense_models(moe_checkpoint, tiny_zoo, capsys):
    code, _, err = run_cli(capsys, "bench", moe_checkpoint, "--memory-budget", "50%", "--strategies", "fast")
    assert code == 2 and err == ("error: --strategies 'fast': unknown ['fast']; choose from resident, mmap, ondemand, "
                                 "predictive\n")
    dense = tiny_zoo.converted("llama_gqa_tied", QuantPlan(weights="f32"))
    code, _, err = run_cli(capsys, "bench", dense, "--memory-budget", "50%", "--quiet")
    assert code == 2 and err.endswith("is a dense llama checkpoint; --memory-budget benchmarks Mixture-of-Experts "
                                      "checkpoints (try --random-moe)\n")


def test_calibrate_records_replays_and_saves_weights(moe_checkpoint, tmp_path, capsys):
    checkpoint = tmp_path / "moe"
    shutil.copytree(moe_checkpoint, checkpoint)  # predictor.json must not leak into the shared checkpoint
    trace, figures = tmp_path / "trace.npz", tmp_path / "calibration.json"
    code, out, err = run_cli(capsys, "calibrate", checkpoint, "--tokens", 64, "--requests", 4, "--prompt-tokens", 4,
                             "--trace", trace, "--json", figures, "--quiet")
    assert code == 0, err
    result = json.loads(figures.read_text())
    assert result["tokens"] == 64 and result["requests"] == 4 and result["phase"] == "decode"
    assert list(result["distances"]) == ["1"]  # two MoE layers: one layer ahead at most
    rows = result["distances"]["1"]
    assert {"best", "best without gate", "gate only", "temporal only", "spatial only", "frequency only",
            "default"} <= set(rows)
    assert 0 <= rows["best"]["held_out"]["recall"] <= 1
    assert f"predictor weights saved to {checkpoint / PREDICTOR_FILE}" in out
    assert SignalWeights.for_checkpoint(str(checkpoint)).to_dict() == result["weights"]

    # the saved trace replays without running the model, to the same figures
    code, out, err = run_cli(capsys, "calibrate", checkpoint, "--trace", trace, "--json", figures, "--no-save")
    assert code == 0, err
    assert json.loads(figures.read_text())["distances"] == result["distances"]


def test_calibrate_refuses_a_trace_of_another_model(moe_checkpoint, tiny_zoo, tmp_path, capsys):
    trace = tmp_path / "trace.npz"
    code, _, err = run_cli(capsys, "calibrate", moe_checkpoint, "--tokens", 16, "--requests", 2, "--prompt-tokens", 2,
                           "--trace", trace, "--no-save", "--quiet")
    assert code == 0, err
    other = tiny_zoo.converted("mixtral", QuantPlan(weights="f32"))  # 4 experts where the trace's model has 8
    code, _, err = run_cli(capsys, "calibrate", other, "--trace", trace, "--no-save", "--quiet")
    assert code == 2 and err.startswith(f"error: {trace} was recorded on another model: its MoE layers (layer: "
                                        "(experts, top_k)) are {0: (8, 2), 1: (8, 2)}, ")
    assert err.endswith("has {0: (4, 2), 1: (4, 2)}; record a trace of this model (--trace with a new file name)\n")
    assert not (tmp_path / "mixtral" / "predictor.json").exists()


def test_calibration_prompts_are_as_many_and_as_long_as_asked(smollm2_checkpoint):
    from edge.calibrate import calibration_prompts
    from streaming.predictor import PredictorError

    with edge.load(smollm2_checkpoint) as model:
        prompts, _ = calibration_prompts(model.tokenizer, 8, 256)
        assert len(prompts) == 8 and all(len(prompt) == 256 for prompt in prompts)
        with pytest.raises(PredictorError, match="^400 requests of 256 prompt tokens need as many pydoc topics"):
            calibration_prompts(model.tokenizer, 400, 256)


def test_calibrate_refuses_a_dense_model(tiny_zoo, capsys):
    dense = tiny_zoo.converted("llama_gqa_tied", QuantPlan(weights="f32"))
    code, _, err = run_cli(capsys, "calibrate", dense, "--tokens", 16, "--requests", 2, "--prompt-tokens", 2, "--quiet")
    assert code == 2 and err == (f"error: {dense} is a dense llama model; only MoE models have routes to record\n")


def test_random_moe_decodes_to_changing_routes(tmp_path):
    import edge
    from edge.random_moe import RandomMoeShape, random_moe_checkpoint
    from streaming.calibration import record_trace

    shape = RandomMoeShape(layers=2, experts=8, top_k=2, hidden=64, expert_intermediate=32, heads=4, kv_heads=2,
                           vocab=256, context=128)
    path = random_moe_checkpoint(str(tmp_path), shape, progress=False)
    assert path == str(tmp_path / "models" / "random-moe-2x8e-top2-h64-i32-v256")
    assert not (tmp_path / "models" / (shape.name + ".hf-source")).exists()  # the source folder is removed
    with edge.load(path, device="reference") as model:
        assert model.spec.moe_for_layer(1).num_experts == 8
        trace = record_trace(model, [[5, 6, 7, 8]], new_tokens=40, depth=1)
    decode_routes = trace.routes[0][4:]  # [39, 2]: one row per decode step
    distinct = {tuple(sorted(route)) for route in decode_routes}
    assert len(distinct) >= 15  # of the 28 possible pairs: no cycle of a repeated token
    repeated = np.mean([set(a) == set(b) for a, b in zip(decode_routes, decode_routes[1:])])
    assert repeated < 0.3


def test_every_streamed_row_has_its_bound(moe_checkpoint, tmp_path, capsys):
    """bound = 1 / max(the resident token time, the Belady floor's reads on the slower of the emulated
    device and the real disk beneath it)."""
    report_path = tmp_path / "report.json"
    code, out, err = run_cli(capsys, "bench", moe_checkpoint, "--memory-budget", "50%,100%", "--storage", "nvme",
                             "--strategies", "resident,ondemand", "--prompt-tokens", 6, "--new-tokens", 8,
                             "--json", report_path, "--quiet")
    assert code == 0, err
    configs = {(row["strategy"], row["budget"]): row for row in json.loads(report_path.read_text())["configs"]}
    resident_seconds = 1 / configs[("resident", "100%")]["decode_tokens_per_second"]
    nvme = parse_storage("nvme")
    for budget in ("50%", "100%"):
        row = configs[("ondemand", budget)]
        bound = row["bound"]
        assert bound["resident_seconds_per_token"] == pytest.approx(resident_seconds)
        assert bound["disk"]["emulated_bandwidth_bytes_per_second"] == nvme.bandwidth_bytes_per_s
        assert bound["disk"]["native_bandwidth_bytes_per_second"] > 0
        on = bound["floor_seconds_per_token_on"]
        assert set(on) == {"nvme", "native"}
        assert bound["floor_seconds_per_token"] == max(on.values())
        slowest = max(on, key=on.get)
        assert bound["limited_by"] == ("compute" if resident_seconds >= on[slowest] else f"disk ({slowest})")
        assert bound["tokens_per_second"] == pytest.approx(
            1 / max(resident_seconds, bound["floor_seconds_per_token"]))
        assert row["fraction_of_bound"] == pytest.approx(row["decode_tokens_per_second"] / bound["tokens_per_second"])
    # a cache that holds every expert reads nothing an omniscient cache would not: each expert once at most
    assert configs[("ondemand", "100%")]["bound"]["floor_reads_per_token"] <= \
        configs[("ondemand", "50%")]["bound"]["floor_reads_per_token"]
    assert configs[("ondemand", "50%")]["bound"]["floor_reads_per_token"] > 0
    assert configs[("ondemand", "50%")]["expert_reads_per_token"] > 0
    assert configs[("resident", "100%")]["expert_reads_per_token"] is None  # (it reads nothing while decoding)
    assert "bound t/s" in out and "of bound" in out


def test_belady_reads_no_more_than_any_online_policy():
    rng = np.random.default_rng(5)
    layers, per_layer = [0, 1, 2], 3
    uses = [(layer, int(e)) for _ in range(40) for layer in layers
            for e in sorted(rng.choice(8, per_layer, replace=False))]
    per_token = len(layers) * per_layer
    reads = {policy: demand_reads(uses, layers, per_token, 10, policy) for policy in POLICIES}
    assert reads["belady"] == min(reads.values())
    assert demand_reads(uses, layers, per_token, 24, "belady") == len(set(uses))  # everything fits: cold misses only
    # uses not counted only fill the cache: with all of them seen before, a cache that holds them reads nothing
    warm = uses + uses
    assert demand_reads(warm, layers, per_token, 24, "belady", [False] * len(uses) + [True] * len(uses)) == 0
    assert demand_reads(warm, layers, per_token, 10, "belady", [True] * len(warm)) == \
        demand_reads(warm, layers, per_token, 10, "belady")
    with pytest.raises(ValueError, match="belady"):
        demand_reads(uses, layers, per_token, 10, "lru", [True] * len(uses))
    assert read_seconds(10, 4096, 4096 * 1e3, 1e-3, depth=4) == pytest.approx(10 / 1e3 + 3 * 1e-3)
