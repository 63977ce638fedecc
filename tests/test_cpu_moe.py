"""The CPU backend's one-call expert mixture (kernels/cpu/moe.py) against the numpy oracle.

T = tokens, D = hidden size, E = experts, A = active experts per token, I = expert intermediate size.
"""
from __future__ import annotations

import numpy as np
import pytest

from devices.cpu import CpuBackend
from devices.reference import ReferenceBackend
from edge.core.moe import ExpertWeights
from edge.moe import expert_mixture
from kernels.cpu import moe as moe_kernels
from quant import Scheme, quantize

SCHEMES = {
    "int4_sym_g32": Scheme("int4", 32, True),
    "int4_affine_g64": Scheme("int4", 64, False),
    "int8_sym_g32": Scheme("int8", 32, True),
    "int8_affine_g128": Scheme("int8", 128, False),
    "f16": None,
    "f32": None,
}


def stored(matrix: np.ndarray, scheme_name: str):
    """A float matrix as a checkpoint would store it under `scheme_name`."""
    if scheme_name == "f32":
        return matrix.astype(np.float32)
    if scheme_name == "f16":
        return matrix.astype(np.float16)
    return quantize(matrix, SCHEMES[scheme_name])


def random_experts(rng, n_experts: int, d_model: int, intermediate: int, scheme_name: str) -> dict[int, dict]:
    """{id: {"gate": [I, D], "up": [I, D], "down": [D, I]}} as stored."""
    def matrix(rows, cols):
        return stored((rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32), scheme_name)

    return {e: {"gate": matrix(intermediate, d_model), "up": matrix(intermediate, d_model),
                "down": matrix(d_model, intermediate)} for e in range(n_experts)}


def prepared(backend, experts: dict[int, dict]) -> dict[int, ExpertWeights]:
    return {e: ExpertWeights(**{name: backend.prepare_weight(w) for name, w in parts.items()})
            for e, parts in experts.items()}


def random_route(rng, n_tokens: int, n_experts: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """ids [T, A] (distinct per token) and weights [T, A] f32."""
    ids = np.stack([rng.permutation(n_experts)[:top_k] for _ in range(n_tokens)]).astype(np.int64)
    weights = rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)
    return ids, weights


def mixture_case(seed: int, n_experts: int, intermediate: int, scheme_name: str, n_tokens: int, top_k: int,
                 d_model: int = 64):
    """(a 2-thread CPU backend, stored experts, x [T, D], route ids and weights [T, A]) of a random case."""
    rng = np.random.default_rng(seed)
    experts = random_experts(rng, n_experts, d_model, intermediate, scheme_name)
    x = rng.standard_normal((n_tokens, d_model)).astype(np.float32)
    ids, weights = random_route(rng, n_tokens, n_experts, top_k)
    return CpuBackend(threads=2), experts, x, ids, weights


def mixtures(scheme_name, n_tokens, top_k, d_model, intermediate, threads=2, seed=0, activations="f32"):
    """(the CPU backend's mixture, the numpy oracle's) on random experts and routes."""
    rng = np.random.default_rng(seed)
    n_experts = 6
    experts = random_experts(rng, n_experts, d_model, intermediate, scheme_name)
    x = rng.standard_normal((n_tokens, d_model)).astype(np.float32)
    ids, weights = random_route(rng, n_tokens, n_experts, top_k)
    reference = ReferenceBackend()
    cpu = CpuBackend(threads=threads, variant=activations)
    expected = expert_mixture(reference, x, ids, weights, prepared(reference, experts))
    ours = cpu.expert_mixture(x, ids, weights, prepared(cpu, experts))
    return ours, expected


@pytest.mark.parametrize("scheme_name", list(SCHEMES))
@pytest.mark.parametrize("n_tokens, top_k", [(1, 1), (1, 4), (5, 2), (40, 3)])
def test_mixture_matches_the_numpy_oracle(scheme_name, n_tokens, top_k):
    # D = 96 and I = 70 (not a multiple of 32): padding of x and of every expert's hidden vector
    ours, expected = mixtures(scheme_name, n_tokens, top_k, d_model=96, intermediate=70)
    assert ours.shape == expected.shape and ours.dtype == np.float32
    # both sides multiply the same dequantized weights in f32; only the order of the sums differs
    # (each output is a sum over A experts of I-long dots of D-long dots)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(ours, expected, rtol=0, atol=2e-5 * scale)


@pytest.mark.parametrize("scheme_name", ["int4_sym_g32", "int4_affine_g64", "int8_sym_g32", "int8_affine_g128"])
def test_int8_decode_mixture_stays_within_the_input_rounding(scheme_name):
    """One token in the int8 variant: gate/up and then down round their inputs to int8 per block of
    32, each adding at most INT8_ACTIVATION_UNIT of relative error (the budget of `zllm-edge
    diff`, edge/diff.py), two matmuls in series; and it is that path, not the f32 one."""
    from edge.diff import INT8_ACTIVATION_UNIT, SAFETY

    ours, expected = mixtures(scheme_name, 1, top_k=3, d_model=96, intermediate=70, activations="int8")
    f32, _ = mixtures(scheme_name, 1, top_k=3, d_model=96, intermediate=70, activations="f32")
    scale = np.abs(expected).max()
    np.testing.assert_allclose(ours, expected, rtol=0, atol=SAFETY * 2 * INT8_ACTIVATION_UNIT * scale)
    assert not np.array_equal(ours, f32)


@pytest.mark.parametrize("n_tokens", [1, 3])
def test_mixture_with_hidden_size_64(n_tokens):
    ours, expected = mixtures("int4_sym_g32", n_tokens, top_k=2, d_model=64, intermediate=96)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=2e-5 * np.abs(expected).max())


@pytest.mark.parametrize("n_tokens", [1, 7])
def test_mixture_does_not_depend_on_the_thread_count(n_tokens):
    one, _ = mixtures("int4_affine_g64", n_tokens, top_k=3, d_model=96, intermediate=200, threads=1, seed=3)
    two, _ = mixtures("int4_affine_g64", n_tokens, top_k=3, d_model=96, intermediate=200, threads=2, seed=3)
    np.testing.assert_array_equal(one, two)


def test_mixture_does_not_depend_on_which_objects_hold_the_weights():
    # the same experts prepared twice (as a cache reload would) give the same bits
    cpu, experts, x, ids, weights = mixture_case(5, 4, 48, "int8_sym_g32", n_tokens=1, top_k=3)
    first = cpu.expert_mixture(x, ids, weights, prepared(cpu, experts))
    again = cpu.expert_mixture(x, ids, weights, {e: w for e, w in reversed(prepared(cpu, experts).items())})
    np.testing.assert_array_equal(first, again)


class Windowed(dict):
    """Expert weights of which only `window_size` are valid at once, as a small streaming cache
    hands them out: taking one more than the window invalidates the earliest taken."""

    def __init__(self, experts, window_size):
        super().__init__(experts)
        self.window_size = window_size
        self.taken = []

    def __getitem__(self, expert):
        self.taken.append(expert)
        live = self.taken[-self.window_size:]
        for stale in set(self.taken) - set(live):  # its buffer is reused: the codes change
            weights = dict.__getitem__(self, stale)
            for matrix in (weights.gate, weights.up, weights.down):
                matrix.arrays[0][...] = 0
        return dict.__getitem__(self, expert)


@pytest.mark.parametrize("n_tokens", [1, 9])
def test_a_window_of_experts_gives_the_same_bits_as_all_of_them(n_tokens):
    cpu, experts, x, ids, weights = mixture_case(7, 6, 40, "int4_sym_g32", n_tokens=n_tokens, top_k=4)
    whole = cpu.expert_mixture(x, ids, weights, prepared(cpu, experts))
    windowed = Windowed(prepared(cpu, experts), window_size=2)
    np.testing.assert_array_equal(cpu.expert_mixture(x, ids, weights, windowed), whole)
    assert windowed.taken == sorted(windowed.taken) and len(windowed.taken) == len(np.unique(ids))


def test_a_descriptor_table_that_does_not_match_the_route_is_refused():
    rng = np.random.default_rng(1)
    cpu = CpuBackend(threads=1)
    experts = prepared(cpu, random_experts(rng, 3, 64, 32, "f32"))
    table = np.stack([experts[0].gate.descriptor, experts[0].up.descriptor, experts[0].down.descriptor])
    x = np.zeros((1, 64), np.float32)
    out = np.zeros((1, 64), np.float32)
    with pytest.raises(ValueError) as error:
        moe_kernels.expert_mixture(table, np.array([0, 2]), x, np.array([[0, 2]]), np.ones((1, 2), np.float32), 1, out)
    assert str(error.value) == "expert_mixture: 2 expert ids for a descriptor table of 1 experts"
    with pytest.raises(ValueError) as error:
        moe_kernels.expert_mixture(table, np.array([1]), x, np.array([[0, 2]]), np.ones((1, 2), np.float32), 1, out)
    assert str(error.value) == "expert_mixture: experts [1] are not all in the route [0, 2]"
    with pytest.raises(ValueError) as error:
        moe_kernels.expert_mixture(table, np.array([0]), np.zeros((1, 32), np.float32), np.array([[0]]),
                                   np.ones((1, 1), np.float32), 1, out)
    assert str(error.value) == ("expert_mixture: x has 32 features but an expert's gate/up take [64] "
                                "and its down gives [64]")


class Arriving(dict):
    """Expert weights that arrive one by one, as a streaming source hands them over (ready_run):
    only the experts it has made ready may be taken."""

    def __init__(self, experts, runs):
        super().__init__(experts)
        self.runs = list(runs)  # the run lengths ready_run answers, in turn
        self.ready: set[int] = set()

    def ready_run(self, ids, start):
        n = min(self.runs.pop(0), len(ids) - start)
        self.ready.update(ids[start:start + n])
        return n

    def __getitem__(self, expert):
        assert expert in self.ready, f"expert {expert} taken before it was ready"
        return dict.__getitem__(self, expert)


@pytest.mark.parametrize("runs", [[1, 1, 1, 1, 1], [2, 1, 2], [1, 4], [5]])
def test_experts_taken_as_they_arrive_give_the_same_bits_as_all_at_once(runs):
    cpu, experts, x, ids, weights = mixture_case(11, 8, 40, "int4_affine_g64", n_tokens=1, top_k=5)
    whole = cpu.expert_mixture(x, ids, weights, prepared(cpu, experts))
    arriving = Arriving(prepared(cpu, experts), runs)
    np.testing.assert_array_equal(cpu.expert_mixture(x, ids, weights, arriving), whole)
    assert arriving.runs == [] and arriving.ready == set(ids[0].tolist())
