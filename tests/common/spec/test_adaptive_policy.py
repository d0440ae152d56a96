"""The adaptive call policy: the budget arithmetic, and its place beside goodput behind `--policy`."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from common.spec.adaptive_policy import AdaptivePolicy, adaptive_budget, round_rate, survival
from common.spec.call_policy import parse_policy
from common.spec.cost_model import CostModel


@dataclass
class FlatCosts:
    effective_draft_ms: float = 10.0
    rtt_ms: float = 50.0
    verify_base_ms: float = 20.0
    verify_per_token_ms: float = 0.0

    def t_verify_ms(self, g: int) -> float:
        return self.verify_base_ms + self.verify_per_token_ms * g


def test_survival_is_the_running_product_continued_at_the_last_estimate():
    assert survival([0.9, 0.5], 4) == pytest.approx([0.9, 0.45, 0.225, 0.1125])


def test_round_rate_counts_the_targets_token_and_every_cost():
    # (0.9 + 0.45 + 1) / (2 * 10 + 50 + 20)
    assert round_rate([0.9, 0.45], 2, 10.0, 50.0, 20.0) == pytest.approx(2.35 / 90.0)
    with pytest.raises(ValueError, match="cost time"):
        round_rate([0.9], 1, 0.0, 0.0, 0.0)


def test_the_budget_is_the_argmax_of_the_rate():
    costs = FlatCosts()
    probs = [0.95, 0.9, 0.3]
    rates = [round_rate(survival(probs, 8), b, 10.0, 50.0, 20.0) for b in range(1, 9)]
    assert adaptive_budget(probs, 8, costs) == 1 + rates.index(max(rates))


def test_sure_tokens_draft_to_the_horizon_and_hopeless_ones_stop_at_once():
    costs = FlatCosts()
    assert adaptive_budget([1.0], 12, costs) == 12
    assert adaptive_budget([0.01], 12, costs) == 1


def test_a_slower_link_buys_a_longer_budget():
    probs = [0.8]
    assert adaptive_budget(probs, 20, FlatCosts(rtt_ms=500.0)) > adaptive_budget(probs, 20, FlatCosts(rtt_ms=0.0))


def test_should_send_at_the_budget_the_cap_or_the_max_block():
    policy = AdaptivePolicy(FlatCosts(), max_block=6)
    assert not policy.should_send([], 10)
    assert not policy.should_send([1.0, 1.0], 10)  # sure so far: the budget is the horizon
    assert policy.should_send([1.0] * 6, 10)  # max_block
    assert policy.should_send([1.0, 1.0, 1.0], 3)  # cap
    assert policy.should_send([0.9, 0.05], 10)  # the survival has collapsed: the budget lies behind
    with pytest.raises(ValueError, match="n_accepted"):
        policy.observe_verdict(3, 4)


def test_parse_policy_reads_adaptive_with_the_shared_cost_model():
    model = CostModel()
    policy = parse_policy("adaptive", model)
    assert isinstance(policy, AdaptivePolicy) and policy.cost_model is model and policy.describe() == "adaptive:max=20"
    assert parse_policy("adaptive:max=8").describe() == "adaptive:max=8"
    assert parse_policy(parse_policy("adaptive:max=8").describe()).describe() == "adaptive:max=8"
    for bad in ("adaptive:max=0", "adaptive:max=x", "adaptive:price=3"):
        with pytest.raises(ValueError, match="call policy"):
            parse_policy(bad)
