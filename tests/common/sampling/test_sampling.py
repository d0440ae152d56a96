"""Tests of common/sampling/distributions.py: logits -> distributions, SamplingParams, SparseDistribution, sample."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from common.sampling.distributions import SamplingParams, SparseDistribution, logits_to_probs, sample


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """All tensors here are tiny: torch's intra-op thread pool only adds wake-up latency, which on a
    busy 2-core machine reaches milliseconds per op. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


# --------------------------------------------------------------------------------------------
# SamplingParams
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.5), dict(temperature=-1e-9), dict(temperature=math.nan),
    dict(top_p=0.0), dict(top_p=-0.1), dict(top_p=1.0001), dict(top_p=2.0), dict(top_p=math.nan),
    dict(top_k=-1), dict(top_k=-100),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_sampling_params_rejects_invalid(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, greedy", [
    (dict(), True),
    (dict(temperature=0.0, top_k=3, top_p=0.5), True),
    (dict(temperature=1e-6), False),
    (dict(temperature=0.7, top_k=0, top_p=1.0), False),
    (dict(temperature=1.5, top_k=50, top_p=1e-9, seed=7), False),
])
def test_sampling_params_accepts_valid(kwargs, greedy):
    assert SamplingParams(**kwargs).greedy is greedy


# --------------------------------------------------------------------------------------------
# logits_to_probs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.0, 3.0])
def test_temperature_scaling_matches_softmax(temperature):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 50, generator=gen) * 3
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature))
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    torch.testing.assert_close(probs.double(), expected, rtol=1e-5, atol=1e-7)
    # A float32 sum of 50 terms is good to a few ulps (eps = 1.2e-7), and how many depends on the CPU's kernels.
    torch.testing.assert_close(probs.sum(-1).double(), torch.ones(3, 4, dtype=torch.float64), rtol=0, atol=1e-6)


def test_low_precision_logits_give_float32_probs():
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(2)).bfloat16()
    probs = logits_to_probs(logits, SamplingParams(temperature=0.8))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.softmax(logits.float() / 0.8, dim=-1))


def test_greedy_is_one_hot_argmax():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 7, 33, generator=gen)
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, top_k=2, top_p=0.3)):
        probs = logits_to_probs(logits, params)
        assert probs.dtype == torch.float32 and probs.shape == logits.shape
        expected = torch.nn.functional.one_hot(logits.argmax(-1), 33).float()
        assert torch.equal(probs, expected)
    # a tie still gives a one-hot distribution on one of the maximal tokens
    tied = logits_to_probs(torch.tensor([1.0, 3.0, 3.0, -2.0]), SamplingParams())
    assert tied.sum() == 1.0 and ((tied == 0) | (tied == 1)).all() and tied[1] + tied[2] == 1.0


@pytest.mark.parametrize("top_k", [1, 2, 5, 29, 30, 31, 1000])
def test_top_k_keeps_exactly_k(top_k):
    vocab = 30
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(20, vocab, generator=gen) * 2
    probs = logits_to_probs(logits, SamplingParams(temperature=0.9, top_k=top_k))
    kept = min(top_k, vocab)
    assert ((probs > 0).sum(-1) == kept).all()
    full = torch.softmax(logits.double() / 0.9, dim=-1)
    for row in range(len(logits)):
        top = set(torch.topk(logits[row], kept).indices.tolist())
        assert _support(probs[row]) == top
        expected = torch.zeros(vocab, dtype=torch.float64)
        idx = torch.tensor(sorted(top))
        expected[idx] = full[row, idx] / full[row, idx].sum()
        torch.testing.assert_close(probs[row].double(), expected, rtol=1e-5, atol=1e-7)


def test_top_k_zero_disables_truncation():
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=1.3, top_k=0)
    torch.testing.assert_close(logits_to_probs(logits, params), torch.softmax(logits / 1.3, dim=-1))


def _brute_force_top_p(probs: np.ndarray, top_p: float) -> set[int]:
    """The smallest set of tokens whose mass reaches top_p, by trying every subset (small V only).

    Among the subsets of that smallest size the one of largest mass is taken: it is the unique
    answer for distinct probabilities (the top tokens) and the only sensible tie-break.
    """
    vocab = len(probs)
    best: tuple[int, float, tuple[int, ...]] | None = None
    for size in range(1, vocab + 1):
        for subset in itertools.combinations(range(vocab), size):
            mass = probs[list(subset)].sum()
            if mass >= top_p and (best is None or mass > best[1]):
                best = (size, mass, subset)
        if best is not None:
            return set(best[2])
    raise AssertionError("unreachable: the full vocabulary has mass 1")


def _near_boundary(probs: np.ndarray, top_p: float, margin: float = 1e-5) -> bool:
    """Whether some prefix of the sorted distribution has mass within `margin` of top_p (float-ambiguous)."""
    cumulative = np.cumsum(np.sort(probs)[::-1])
    return bool(np.any(np.abs(cumulative - top_p) < margin))


def test_top_p_matches_brute_force():
    gen = torch.Generator().manual_seed(6)
    checked = 0
    sizes = set()
    for _ in range(400):
        vocab = int(torch.randint(2, 9, (), generator=gen))
        temperature = float(torch.rand((), generator=gen)) * 1.5 + 0.5
        top_p = float(torch.rand((), generator=gen)) * 0.98 + 0.01
        logits = torch.randn(vocab, generator=gen) * float(torch.rand((), generator=gen) * 3 + 0.3)
        reference = torch.softmax(logits.double() / temperature, dim=-1).numpy()
        if _near_boundary(reference, top_p):
            continue
        expected_support = _brute_force_top_p(reference, top_p)
        probs = logits_to_probs(logits, SamplingParams(temperature=temperature, top_p=top_p))
        assert _support(probs) == expected_support, (logits, temperature, top_p)
        expected = np.zeros(vocab)
        idx = sorted(expected_support)
        expected[idx] = reference[idx] / reference[idx].sum()
        np.testing.assert_allclose(probs.double().numpy(), expected, rtol=1e-5, atol=1e-7)
        assert len(expected_support) >= 1
        sizes.add(len(expected_support))
        checked += 1
    assert checked >= 350
    assert {1, 2, 3} <= sizes and max(sizes) >= 6  # truncation at many different depths


def test_top_p_after_top_k_matches_brute_force():
    """top-k first, then top-p on the renormalised top-k distribution."""
    gen = torch.Generator().manual_seed(7)
    checked = 0
    for _ in range(100):
        vocab = int(torch.randint(3, 9, (), generator=gen))
        top_k = int(torch.randint(1, vocab, (), generator=gen))
        top_p = float(torch.rand((), generator=gen)) * 0.98 + 0.01
        logits = torch.randn(vocab, generator=gen) * 1.5
        full = torch.softmax(logits.double(), dim=-1)
        top = torch.topk(logits, top_k).indices
        truncated = torch.zeros(vocab, dtype=torch.float64)
        truncated[top] = full[top] / full[top].sum()
        reference = truncated.numpy()
        if _near_boundary(reference[reference > 0], top_p):
            continue
        probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p))
        assert _support(probs) == _brute_force_top_p(reference, top_p)
        checked += 1
    assert checked >= 80


def test_top_p_mass_exactly_reaching_p_stops_there():
    """Dyadic probabilities are exact in float32: a prefix whose mass equals top_p is complete."""
    logits = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()
    assert torch.softmax(logits, -1).tolist() == [0.5, 0.25, 0.125, 0.125]
    for top_p, expected in [(0.5, [1.0, 0, 0, 0]), (0.75, [2 / 3, 1 / 3, 0, 0])]:
        probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        torch.testing.assert_close(probs, torch.tensor(expected))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.875))
    assert (probs > 0).sum() == 3 and probs[0] > 0 and probs[1] > 0  # one of the two tied 0.125s
    assert logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8751)).min() > 0


def test_top_p_always_keeps_at_least_one_token():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(50, 40, generator=gen) * 4
    for top_p in (1e-12, 1e-6, 0.01):
        probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        assert ((probs > 0).sum(-1) >= 1).all()
        assert torch.isfinite(probs).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(50))
    tiny = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=1e-12))
    assert torch.equal(tiny, torch.nn.functional.one_hot(logits.argmax(-1), 40).float())
    # a dominant token alone reaches top_p: exactly that token is kept
    dominant = logits_to_probs(torch.tensor([10.0, 0.0, 0.0, 0.0]), SamplingParams(temperature=1.0, top_p=0.9))
    assert torch.equal(dominant, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_top_p_one_disables_truncation():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(9)) * 5
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=1.0)),
                               torch.softmax(logits, dim=-1))


# --------------------------------------------------------------------------------------------
# SparseDistribution
# --------------------------------------------------------------------------------------------


def test_sparse_distribution_round_trips_top_k():
    """Exact support; values equal up to float32 rounding of the renormalisation (~2 ulp)."""
    gen = torch.Generator().manual_seed(10)
    for _ in range(300):
        vocab = int(torch.randint(2, 300, (), generator=gen))
        top_k = int(torch.randint(1, vocab + 1, (), generator=gen))
        temperature = float(torch.rand((), generator=gen)) + 0.5
        logits = torch.randn(vocab, generator=gen) * 2
        probs = logits_to_probs(logits, SamplingParams(temperature=temperature, top_k=top_k))
        for max_support in (top_k, None):
            sparse = SparseDistribution.from_dense(probs, max_support=max_support)
            assert len(sparse.token_ids) == len(sparse.probs) == (probs > 0).sum()
            assert set(sparse.token_ids.tolist()) == set(torch.topk(logits, top_k).indices.tolist())
            dense = sparse.to_dense(vocab)
            assert dense.dtype == torch.float32 and dense.shape == (vocab,)
            assert torch.equal(dense > 0, probs > 0)
            torch.testing.assert_close(dense, probs, rtol=1e-6, atol=0.0)


def test_sparse_distribution_round_trips_one_hot():
    probs = logits_to_probs(torch.tensor([0.3, 2.0, -1.0, 0.5]), SamplingParams())
    sparse = SparseDistribution.from_dense(probs, max_support=1)
    assert sparse.token_ids.tolist() == [1] and sparse.probs.tolist() == [1.0]
    assert torch.equal(sparse.to_dense(4), probs)


def test_sparse_distribution_truncates_beyond_max_support():
    """A support larger than max_support keeps the top max_support tokens, renormalised."""
    gen = torch.Generator().manual_seed(11)
    probs = torch.softmax(torch.randn(64, generator=gen), dim=-1)
    sparse = SparseDistribution.from_dense(probs, max_support=8)
    top = torch.topk(probs, 8).indices
    assert set(sparse.token_ids.tolist()) == set(top.tolist())
    expected = torch.zeros(64)
    expected[top] = probs[top] / probs[top].sum()
    torch.testing.assert_close(sparse.to_dense(64), expected)
    torch.testing.assert_close(sparse.probs.sum(), torch.tensor(1.0))


# --------------------------------------------------------------------------------------------
# sample
# --------------------------------------------------------------------------------------------


def test_sample_is_reproducible_with_a_fixed_generator():
    probs = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(12)), dim=-1)

    def draws(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return [sample(probs, gen) for _ in range(200)]

    first = draws(123)
    assert first == draws(123)
    assert first != draws(124)
    assert all(isinstance(x, int) and 0 <= x < 50 for x in first)


def _expected_counts(probs: torch.Tensor, support: np.ndarray, total: int) -> np.ndarray:
    p = probs.double().numpy()[support]
    return p / p.sum() * total


def test_sample_follows_the_distribution_and_its_support():
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -3.0, 1.5])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=5))
    gen = torch.Generator().manual_seed(13)
    counts = np.bincount([sample(probs, gen) for _ in range(20_000)], minlength=7)
    support = (probs > 0).numpy()
    assert support.sum() == 5
    assert counts[~support].sum() == 0  # top-k-truncated tokens are never drawn
    total = int(counts.sum())
    assert chisquare(counts[support], _expected_counts(probs, support, total)).pvalue > 1e-3
    # the check has power: the same support at temperature 1.25 is told apart
    hotter = torch.softmax(logits.double() / 1.25, -1)
    assert chisquare(counts[support], _expected_counts(hotter, support, total)).pvalue < 1e-6


def test_sample_accepts_float64_and_one_hot():
    gen = torch.Generator().manual_seed(14)
    one_hot = torch.zeros(10, dtype=torch.float64)
    one_hot[7] = 1.0
    assert {sample(one_hot, gen) for _ in range(100)} == {7}
