"""The keep model (common/spec/cost_model.py KeepModel): what the verdicts say about how much of a block the cloud keeps.

Verdicts come from the real verification rules (common/spec/acceptance_rules.py) on synthetic distributions,
with the exact a_i = min(1, p_target(x_i) / p_draft(x_i)): token verification keeps E(g) in
expectation, so the fit must stay at 0; block verification keeps more, so the fit must rescue.
"""

from __future__ import annotations

import random

import pytest
import torch

from common.spec.call_policy import GoodputPolicy
from common.spec.cost_model import CostModel
from common.spec.cost_model import KeepModel, expected_accepted_length, rescued
from common.spec.acceptance_rules import AcceptanceRule, block_verify, token_verify

VOCAB = 8


def verdicts(rule: AcceptanceRule, block: int, n: int, seed: int = 0) -> list[tuple[list[float], int]]:
    """n blocks of `block` tokens: (the exact a_i of each drafted token, the rule's n_accepted)."""
    generator = torch.Generator().manual_seed(seed)
    dirichlet = torch.distributions.Dirichlet(torch.ones(VOCAB, dtype=torch.float64))
    torch.manual_seed(seed)
    out = []
    for _ in range(n):
        p_target = dirichlet.sample((block + 1,))
        p_draft = 0.5 * dirichlet.sample((block,)) + 0.5 * p_target[:block]  # a draft that resembles its target
        drafted = torch.multinomial(p_draft, 1, generator=generator).squeeze(1)
        ratios = p_target[torch.arange(block), drafted] / p_draft[torch.arange(block), drafted]
        n_accepted, _ = rule(drafted, p_draft, p_target, generator)
        out.append((ratios.clamp(max=1.0).tolist(), n_accepted))
    return out


def fitted(observed: list[tuple[list[float], int]], alpha: float = 0.01) -> KeepModel:
    model = KeepModel(alpha=alpha)
    for accept_probs, n_accepted in observed:
        model.observe(accept_probs, n_accepted)
    return model


def test_token_verification_with_exact_scores_needs_no_rescue():
    assert fitted(verdicts(token_verify, block=8, n=400)).rescue_share == pytest.approx(0.0, abs=0.05)


def test_block_verification_keeps_more_than_e_of_g_and_the_fit_says_so():
    observed = verdicts(block_verify, block=8, n=400)
    kept = sum(n for _, n in observed) / len(observed)
    predicted = sum(expected_accepted_length(a) for a, _ in observed) / len(observed)
    assert kept > 1.15 * predicted  # Sun et al.: a long block keeps more than token by token
    model = fitted(observed)
    assert model.rescue_share >= 0.15
    refit = sum(expected_accepted_length(model.keep_probs(a)) for a, _ in observed) / len(observed)
    assert abs(refit - kept) < abs(predicted - kept) / 2


def test_an_overconfident_verifier_is_scaled_down():
    rng = random.Random(3)
    model = KeepModel(alpha=0.01)
    for _ in range(600):
        scores = [rng.uniform(0.5, 1.0) for _ in range(6)]
        survive = [rng.random() < 0.8 * a for a in scores]  # the cloud keeps 80% of what each score promises
        model.observe(scores, survive.index(False) if False in survive else len(survive))
    assert model.rescue_share == pytest.approx(-0.2, abs=0.1)


def test_goodput_plans_longer_blocks_once_the_cloud_is_seen_to_keep_more():
    def block_length(policy: GoodputPolicy) -> int:
        g = 1
        while not policy.should_send([0.7] * g, cap=64):
            g += 1
        return g

    costs = CostModel(prior_draft_ms=20.0, prior_rtt_ms=100.0, prior_verify_base_ms=150.0,
                      prior_verify_per_token_ms=10.0)
    policy = GoodputPolicy(costs, max_block=64)
    before = block_length(policy)
    for _ in range(costs.keep.min_verdicts - 1):
        costs.keep.observe([0.7] * 6, 6)
    assert costs.keep.rescue_share == 0.0 and block_length(policy) == before  # too few verdicts to move the plan
    for _ in range(200):
        costs.keep.observe([0.7] * 6, 6)  # the cloud keeps every block whole
    assert costs.keep.rescue_share > 0 and block_length(policy) > before
    assert costs.snapshot()["rescue_share"] == costs.keep.rescue_share


def test_rescue_moves_scores_toward_one_or_scales_them_down():
    assert rescued([0.5, 1.0], 0.5) == [0.75, 1.0]
    assert rescued([0.5, 1.0], -0.2) == pytest.approx([0.4, 0.8])
    assert rescued([0.5], 0.0) == [0.5]


def test_a_verdict_that_does_not_fit_its_block_is_refused_and_an_unscored_block_is_ignored():
    model = KeepModel()
    with pytest.raises(ValueError, match="3 tokens accepted of a 2-token block"):
        model.observe([0.5, 0.5], 3)
    model.observe([], 0)
    assert model.verdicts == 0
    with pytest.raises(ValueError, match="alpha"):
        KeepModel(alpha=0.0)
