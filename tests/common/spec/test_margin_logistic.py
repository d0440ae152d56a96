"""The margin-logistic verifier: IRLS recovers known curves, warm-up, the negative-slope rule, and the edge loads it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.spec.local_decoder import LocalDecoder
from common.spec.margin_logistic import (MarginLogistic, MarginLogisticSettings, MarginLogisticVerifier, fit_logistic,
                                         logit_margin)
from common.spec.modes import DecodeSettings, call_policy
from common.spec.verifier import DraftStep, verifier_for
from edge.runtime.verifier import load_verifier, verifier_identity


def _synthetic(w: float, b: float, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    margins = rng.exponential(2.0, n)
    labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-(w * margins + b)))).astype(float)
    return margins, labels


def _step(margin: float, position: int) -> DraftStep:
    logits = torch.zeros(16)
    logits[3], logits[7] = 5.0 + margin, 5.0  # top-1 minus top-2 = margin
    return DraftStep(3, logits, None, position=position)


def test_irls_recovers_known_parameters():
    margins, labels = _synthetic(1.5, -2.0, 20_000, seed=0)
    w, b = fit_logistic(margins, labels)
    assert w == pytest.approx(1.5, abs=0.1) and b == pytest.approx(-2.0, abs=0.1)


def test_the_ridge_keeps_a_separable_position_finite():
    w, b = fit_logistic(np.array([1.0, 2.0, 3.0]), np.ones(3))
    assert np.isfinite(w) and np.isfinite(b) and w >= 0


def test_logit_margin_is_top1_minus_top2():
    assert logit_margin(_step(2.5, 0).logits) == pytest.approx(2.5)


def test_warm_up_scores_one_until_the_first_fit_then_the_fitted_curves_per_position():
    estimator = MarginLogistic(MarginLogisticSettings(refit_every=100, min_examples=20))
    curves = {0: (1.0, -1.0), 1: (2.0, -3.0)}
    data = {k: _synthetic(*curve, 100, seed=k) for k, curve in curves.items()}
    for i in range(99):  # one verdict: position 0 reached and kept, position 1 reached (label as drawn)
        outcome = estimator.observe_examples([(k, data[k][0][i], bool(data[k][1][i])) for k in curves])
        assert outcome is None and estimator.warming_up
        assert estimator.score(_step(0.0, 0)) == 1.0 and estimator.score(_step(0.0, 1)) == 1.0  # full verification
    outcome = estimator.observe_examples([(k, data[k][0][99], bool(data[k][1][99])) for k in curves])
    assert outcome is not None and sorted(outcome.fitted) == [0, 1] and estimator.fits == 1
    for k, (w, b) in estimator.params.items():
        assert estimator.score(_step(0.7, k)) == pytest.approx(1 / (1 + np.exp(-(w * 0.7 + b))))
    # a deeper position with no fit of its own reads the nearest shallower fit
    assert estimator.score(_step(0.7, 5)) == estimator.score(_step(0.7, 1))


def test_a_fit_with_negative_slope_is_rejected_and_the_previous_parameters_stay():
    estimator = MarginLogistic(MarginLogisticSettings(refit_every=50, min_examples=20, window=50))
    margins, labels = _synthetic(1.0, -1.0, 50, seed=1)
    for m, y in zip(margins, labels):
        estimator.observe_examples([(0, m, bool(y))])
    before = estimator.params[0]
    assert before[0] > 0
    backwards, _ = _synthetic(1.0, 0.0, 50, seed=2)  # now the surer tokens are rejected: the slope comes out < 0
    outcomes = [estimator.observe_examples([(0, m, m < 1.0)]) for m in backwards]
    assert outcomes[-1] is not None and outcomes[-1].rejected_negative == [0] and estimator.params[0] == before
    assert estimator.fits == 2


def test_a_first_fit_with_negative_slope_leaves_the_position_in_warm_up():
    estimator = MarginLogistic(MarginLogisticSettings(refit_every=40, min_examples=20))
    for i in range(40):
        margin = float(i % 8)
        estimator.observe_examples([(0, margin, margin < 4)])
    assert estimator.warming_up and estimator.score(_step(6.0, 0)) == 1.0


def test_verdicts_teach_only_the_reached_positions():
    estimator = MarginLogistic(MarginLogisticSettings(refit_every=1000))
    steps = [_step(m, k) for k, m in enumerate((3.0, 2.0, 0.5, 4.0, 4.0))]
    estimator.observe_verdict(steps, n_accepted=2)  # x1, x2 kept; x3 rejected; x4, x5 never reached
    assert {k: list(v) for k, v in estimator._examples.items()} == {0: [(3.0, 1.0)], 1: [(2.0, 1.0)], 2: [(0.5, 0.0)]}
    estimator.observe_verdict(steps[:2], n_accepted=2)  # all kept: no rejected position
    assert len(estimator._examples[1]) == 2 and len(estimator._examples[2]) == 1
    with pytest.raises(ValueError, match="n_accepted"):
        estimator.observe_verdict(steps[:2], n_accepted=3)


def test_scoring_needs_the_position():
    with pytest.raises(ValueError, match="position"):
        MarginLogistic().score(DraftStep(3, torch.zeros(16), None))


def test_the_edge_loads_it_through_the_verifier_syntax():
    verifier = load_verifier("margin-logistic", None)
    assert isinstance(verifier, MarginLogisticVerifier) and verifier.threshold == 0.5 and not verifier.needs_hidden
    assert verifier_identity(verifier) == {"id": "margin-logistic:0.5", "sha256": None}
    assert load_verifier("margin-logistic:0.3", None).threshold == 0.3
    assert verifier_for(verifier, 0.0) is verifier.greedy and verifier_for(verifier, 1.0) is verifier.sampling
    with pytest.raises(ValueError, match="threshold"):
        load_verifier("margin-logistic:high", None)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        load_verifier("margin-logistic:2", None)


def test_lossy_sprinter_refuses_a_verifier_that_learns_from_verdicts():
    estimator = MarginLogisticVerifier().greedy
    with pytest.raises(ValueError, match="lossless mode"):
        call_policy(DecodeSettings(mode="sprinter"), estimator)
    assert call_policy(DecodeSettings(mode="sprinter-exact", policy="adaptive"), estimator).name == "adaptive"


def test_decoding_feeds_the_verdicts_and_stays_lossless(tiny_target, tiny_draft):
    verifier = MarginLogisticVerifier(MarginLogisticSettings(refit_every=5, min_examples=5))
    engine = LocalDecoder(tiny_target, tiny_draft, verifier)
    ids = tiny_target.tokenizer("def add(a, b):")["input_ids"]
    reference = engine.generate(ids, DecodeSettings(mode="target", max_new_tokens=40)).token_ids
    for policy in ("adaptive", "goodput"):
        settings = DecodeSettings(mode="sprinter-exact", max_new_tokens=40, policy=policy, max_run_length=6)
        assert engine.generate(ids, settings).token_ids == reference
    assert verifier.greedy.verdicts > 5 and verifier.greedy.fits >= 1 and verifier.sampling.verdicts == 0
