"""Call policies and the cost model (common/spec/call_policy.py): pure logic, floats in, decisions out."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from common.spec.call_policy import (
    CallPolicy,
    CostModel,
    FixedPolicy,
    FlagPolicy,
    GoodputPolicy,
    HeuristicPolicy,
    expected_accepted_length,
    goodput,
    parse_policy,
)


def block_length(policy: CallPolicy, accept_probs: Sequence[float], cap: int = 1000) -> int:
    """Draft token by token, asking the policy after each one, as the edge does; return g at the send."""
    for g in range(1, len(accept_probs) + 1):
        if policy.should_send(accept_probs[:g], cap):
            return g
    raise AssertionError(f"{policy.describe()} never sent within {len(accept_probs)} tokens")


def steady_cost_model(rtt_ms: float) -> CostModel:
    return CostModel(prior_draft_ms=20.0, prior_rtt_ms=rtt_ms, prior_verify_base_ms=150.0,
                     prior_verify_per_token_ms=10.0)


# --- the goodput math ---

@pytest.mark.parametrize(("accept_probs", "expected"), [
    ([], 0.0),
    ([1.0, 1.0, 1.0, 1.0], 4.0),  # all ones: every token survives
    ([0.5, 0.5], 0.75),  # 0.5 + 0.25
    ([0.8, 0.5, 1.0], 0.8 + 0.4 + 0.4),
    ([0.0, 1.0, 1.0], 0.0),  # a sure rejection first: nothing after it counts
])
def test_expected_accepted_length(accept_probs: list[float], expected: float) -> None:
    assert expected_accepted_length(accept_probs) == pytest.approx(expected)


def test_goodput_hand_computed() -> None:
    # (0.75 + 1) tokens over 2*20 + 100 + 170 ms.
    assert goodput([0.5, 0.5], t_draft_ms=20.0, rtt_ms=100.0, t_verify_ms=170.0) == pytest.approx(1.75 / 310.0)


# --- fixed, heuristic, flag ---

def test_fixed_sends_at_k() -> None:
    policy = FixedPolicy(5)
    assert [policy.should_send([0.9] * g, cap=20) for g in range(1, 6)] == [False] * 4 + [True]
    assert block_length(policy, [0.01] * 10) == 5  # scores are ignored
    assert policy.describe() == "fixed:5" and policy.name == "fixed"


def test_heuristic_grows_on_full_acceptance_and_shrinks_otherwise() -> None:
    policy = HeuristicPolicy()
    assert block_length(policy, [0.5] * 30) == 5
    policy.observe_verdict(5, 5)
    assert policy.k == 7 and block_length(policy, [0.5] * 30) == 7
    policy.observe_verdict(7, 7)
    assert policy.k == 9
    policy.observe_verdict(9, 3)
    assert policy.k == 8
    for _ in range(20):
        policy.observe_verdict(8, 0)
    assert policy.k == 1  # never below one token


def test_heuristic_counts_a_capped_block_fully_accepted_as_full() -> None:
    policy = HeuristicPolicy(k=9)
    assert block_length(policy, [0.5] * 30, cap=4) == 4
    policy.observe_verdict(4, 4)
    assert policy.k == 11


def test_flag_sends_at_the_first_low_score() -> None:
    policy = FlagPolicy(0.5)
    assert block_length(policy, [0.9, 0.8, 0.6, 0.4, 0.9, 0.1]) == 4
    assert block_length(policy, [0.2, 0.9]) == 1
    assert block_length(FlagPolicy(0.3), [0.9, 0.8, 0.6, 0.4, 0.9, 0.1]) == 6
    assert FlagPolicy().describe() == "flag:0.5"


@pytest.mark.parametrize("policy", [FixedPolicy(8), HeuristicPolicy(), FlagPolicy(0.5),
                                    GoodputPolicy(steady_cost_model(10_000.0), max_block=50)])
def test_every_policy_sends_at_the_cap(policy: CallPolicy) -> None:
    for cap in (1, 3):
        assert block_length(policy, [1.0] * 20, cap=cap) == cap


# --- goodput ---

def test_goodput_drafts_longer_over_a_slower_link() -> None:
    lengths = [block_length(GoodputPolicy(steady_cost_model(rtt)), [0.8] * 50) for rtt in (0, 50, 100, 200)]
    assert lengths == sorted(lengths), lengths
    assert lengths[-1] > lengths[0], lengths


def test_goodput_stops_at_the_best_block_length_under_its_prediction() -> None:
    # With constant a the prediction is exact, so the chosen g must maximise goodput over all g.
    costs = steady_cost_model(100.0)
    best = max(range(1, 40), key=lambda g: goodput([0.8] * g, 20.0, 100.0, costs.t_verify_ms(g)))
    assert block_length(GoodputPolicy(costs, max_block=40), [0.8] * 40) == best


def test_goodput_sends_early_when_acceptance_is_unlikely() -> None:
    for rtt in (0.0, 200.0):
        assert block_length(GoodputPolicy(steady_cost_model(rtt)), [0.05] * 20) <= 2


def test_goodput_respects_max_block() -> None:
    policy = parse_policy("goodput:max=6", steady_cost_model(10_000.0))
    assert block_length(policy, [1.0] * 30) == 6


def test_a_price_on_cloud_calls_plans_as_a_slower_link_does() -> None:
    priced = GoodputPolicy(steady_cost_model(0.0), call_price_ms=300.0)
    assert block_length(priced, [0.8] * 50) == block_length(GoodputPolicy(steady_cost_model(300.0)), [0.8] * 50)
    assert block_length(priced, [0.8] * 50) > block_length(GoodputPolicy(steady_cost_model(0.0)), [0.8] * 50)


def test_goodput_learns_from_its_cost_model() -> None:
    costs = steady_cost_model(0.0)
    policy = GoodputPolicy(costs)
    fast = block_length(policy, [0.8] * 50)
    for _ in range(10):
        costs.observe_round_trip(total_ms=600.0, verify_ms=200.0, block_length=5)
    assert block_length(policy, [0.8] * 50) > fast


# --- cost model ---

def test_cost_model_priors_with_no_observations() -> None:
    costs = CostModel()
    assert costs.t_draft_ms == 20.0 and costs.rtt_ms == 0.0
    assert costs.t_verify_ms(0) == 150.0 and costs.t_verify_ms(4) == 190.0


def test_cost_model_with_one_observation() -> None:
    costs = CostModel()
    costs.observe_draft_step(90.0)
    costs.observe_round_trip(total_ms=300.0, verify_ms=260.0, block_length=5)
    assert costs.t_draft_ms == 90.0 and costs.rtt_ms == 40.0
    # One g seen: the line goes through it with the prior slope.
    assert costs.t_verify_ms(5) == pytest.approx(260.0)
    assert costs.t_verify_ms(6) - costs.t_verify_ms(5) == pytest.approx(10.0)


def test_cost_model_learns_draft_time_rtt_and_verify_slope() -> None:
    rng = random.Random(0)
    costs = CostModel(alpha=0.1)
    for _ in range(200):
        costs.observe_draft_step(104.0 + rng.gauss(0, 3))
        g = rng.randint(1, 16)
        verify = 500.0 + 25.0 * g + rng.gauss(0, 5)
        costs.observe_round_trip(total_ms=verify + 60.0 + rng.gauss(0, 2), verify_ms=verify, block_length=g)
    snap = costs.snapshot()
    assert snap["t_draft_ms"] == pytest.approx(104.0, abs=3.0)
    assert snap["rtt_ms"] == pytest.approx(60.0, abs=3.0)
    assert snap["t_verify_per_token_ms"] == pytest.approx(25.0, abs=2.0)
    assert snap["t_verify_base_ms"] == pytest.approx(500.0, abs=15.0)
    assert snap["round_trips_observed"] == 200


def test_cost_model_follows_a_slower_link() -> None:
    costs = CostModel()
    for _ in range(30):
        costs.observe_round_trip(total_ms=220.0, verify_ms=200.0, block_length=5)
    assert costs.rtt_ms == pytest.approx(20.0)
    for _ in range(4):
        costs.observe_round_trip(total_ms=400.0, verify_ms=200.0, block_length=5)
    assert costs.rtt_ms > 110.0  # past halfway to the new 200 ms within four round trips


def test_cost_model_ignores_negative_network_time_and_negative_slopes() -> None:
    costs = CostModel()
    costs.observe_round_trip(total_ms=190.0, verify_ms=200.0, block_length=2)  # clocks disagree
    assert costs.rtt_ms == 0.0
    for g, v in [(2, 300.0), (8, 100.0), (2, 300.0), (8, 100.0)]:
        costs.observe_round_trip(total_ms=v, verify_ms=v, block_length=g)
    assert costs.verify_line()[1] >= 0.0


def test_cost_model_rejects_bad_alpha() -> None:
    with pytest.raises(ValueError, match="alpha"):
        CostModel(alpha=0.0)


# --- parsing ---

@pytest.mark.parametrize(("spec", "kind", "described"), [
    ("fixed:5", FixedPolicy, "fixed:5"),
    ("heuristic", HeuristicPolicy, "heuristic"),
    ("flag", FlagPolicy, "flag:0.5"),
    ("flag:0.3", FlagPolicy, "flag:0.3"),
    ("goodput", GoodputPolicy, "goodput:max=20"),
    ("goodput:max=16", GoodputPolicy, "goodput:max=16"),
    ("goodput:price=500", GoodputPolicy, "goodput:max=20,price=500"),
    ("goodput:max=16,price=250.5", GoodputPolicy, "goodput:max=16,price=250.5"),
])
def test_parse_policy_round_trips(spec: str, kind: type, described: str) -> None:
    policy = parse_policy(spec)
    assert isinstance(policy, kind)
    assert policy.describe() == described
    assert parse_policy(described).describe() == described


def test_parse_policy_shares_the_cost_model() -> None:
    costs = CostModel()
    policy = parse_policy("goodput", costs)
    assert isinstance(policy, GoodputPolicy) and policy.cost_model is costs


@pytest.mark.parametrize("spec", ["", "fixed", "fixed:", "fixed:0", "fixed:x", "heuristic:3", "flag:", "flag:1.5",
                                  "flag:abc", "goodput:16", "goodput:max=", "goodput:max=0", "goodput:min=3",
                                  "goodput:price=", "goodput:price=-5", "goodput:max=8,max=9", "goodput:max=8,",
                                  "greedy"])
def test_parse_policy_errors_list_the_valid_forms(spec: str) -> None:
    with pytest.raises(ValueError, match="valid forms: fixed:K, heuristic, flag"):
        parse_policy(spec)


def test_observe_verdict_rejects_impossible_counts() -> None:
    with pytest.raises(ValueError, match="n_accepted"):
        HeuristicPolicy().observe_verdict(3, 4)


def test_goodput_block_length_is_nondecreasing_in_rtt_for_any_scores() -> None:
    # A larger rtt only enlarges every denominator, so "draft one more" at a fast link implies it at a slow one.
    rng = random.Random(1)
    for _ in range(200):
        scores = [rng.random() ** 0.3 for _ in range(20)]
        lengths = [block_length(GoodputPolicy(steady_cost_model(rtt)), scores, cap=20) for rtt in (0, 50, 100, 200)]
        assert lengths == sorted(lengths), (scores, lengths)


def test_an_announced_verify_time_seeds_the_cost_model_until_it_measures_its_own():
    cost_model = CostModel()
    cost_model.seed_verify_ms(42.0)
    assert cost_model.t_verify_ms(0) == pytest.approx(42.0)
    cost_model.observe_round_trip(total_ms=80.0, verify_ms=60.0, block_length=4)
    measured = cost_model.verify_line()
    assert cost_model.t_verify_ms(4) == pytest.approx(60.0)
    cost_model.seed_verify_ms(5.0)  # an announcement no longer moves what the edge measured
    assert cost_model.verify_line() == measured


def test_drafting_hidden_behind_a_round_trip_is_not_a_cost() -> None:
    """A pipelined edge whose blocks were drafted ahead sends longer blocks at the same costs: the hidden share
    of drafting time is not weighed (edge/decoding/pipeline.py's observe_block_sent)."""
    def block_length(cost_model: CostModel) -> int:
        policy = GoodputPolicy(cost_model)
        probs: list[float] = []
        while not policy.should_send(probs, cap=20):
            probs.append(0.8)
        return len(probs)

    plain, pipelined = CostModel(prior_draft_ms=60.0), CostModel(prior_draft_ms=60.0)
    for _ in range(10):
        pipelined.observe_block_sent(4, 4)
    assert pipelined.hidden_draft_share > 0.9 and pipelined.effective_draft_ms < 6.0
    assert block_length(pipelined) > block_length(plain)
    plain.observe_block_sent(0, 4)
    assert plain.effective_draft_ms == plain.t_draft_ms


# --- the price of a drafted token's time: the planned rate ---

def one_step_lookahead_length(costs: CostModel, accept_probs: Sequence[float]) -> int:
    """The first g at which goodput with one more token (a_{g+1} predicted as the block's mean) is no higher."""
    t_draft, rtt = costs.effective_draft_ms, costs.rtt_ms
    for g in range(1, len(accept_probs)):
        block = list(accept_probs[:g])
        longer = goodput([*block, sum(block) / g], t_draft, rtt, costs.t_verify_ms(g + 1))
        if longer <= goodput(block, t_draft, rtt, costs.t_verify_ms(g)):
            return g
    return len(accept_probs)


def test_before_any_plan_goodput_is_the_one_step_lookahead() -> None:
    rng = random.Random(2)
    for _ in range(200):
        scores = [rng.random() ** 0.3 for _ in range(20)]
        costs = steady_cost_model(rng.choice((0.0, 50.0, 200.0)))
        assert block_length(GoodputPolicy(costs), scores, cap=20) == one_step_lookahead_length(costs, scores), scores


def test_planned_rate_is_the_plans_tokens_over_their_rounds_time() -> None:
    costs = steady_cost_model(50.0)
    assert costs.planned_rate() is None
    costs.observe_plan([0.5, 0.5])  # E = 0.75: 1.75 tokens over 2 * 20 + 50 + 150 + 2 * 10 = 260 ms
    assert costs.planned_rate() == pytest.approx(1.75 / 260.0)
    assert costs.planned_rate(call_price_ms=100.0) == pytest.approx(1.75 / 360.0)
    costs.observe_plan([])  # a block drafted without scores says nothing
    assert costs.planned.rounds == 1.0
    costs.observe_verdict([1.0, 1.0], 2)  # a verdict adds its plan and teaches the keep model
    assert costs.planned.rounds == pytest.approx(1.9) and costs.keep.verdicts == 1


def test_a_high_planned_rate_ends_a_block_at_a_dip_the_lookahead_drafts_through() -> None:
    scores = [0.95, 0.7] + [0.95] * 10
    # Early in the block its own goodput is low (150 ms of verify shared by two tokens): the dip is drafted through.
    assert block_length(GoodputPolicy(steady_cost_model(0.0)), scores) == 8
    costs = steady_cost_model(0.0)
    for _ in range(10):
        costs.observe_plan([0.99] * 10)  # recent rounds planned at about 23 tokens/s
    assert block_length(GoodputPolicy(costs), scores) == 2


def test_the_planned_rate_never_lengthens_a_block() -> None:
    # The price is the max of the block's own goodput and the planned rate: a low planned rate changes nothing.
    rng = random.Random(3)
    slow = steady_cost_model(0.0)
    slow.observe_plan([0.01])
    for _ in range(100):
        scores = [rng.random() ** 0.3 for _ in range(20)]
        assert block_length(GoodputPolicy(slow), scores, cap=20) == one_step_lookahead_length(slow, scores)
