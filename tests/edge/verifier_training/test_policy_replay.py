"""Call policies replayed on recorded traces (edge/verifier_training/replay.py): the round's arithmetic,
the hindsight oracle's claims, and that knowing a_i exactly is worth something."""

from __future__ import annotations

import numpy as np
import pytest

from common.spec.call_policy import FixedPolicy
from common.spec.margin_logistic import MarginLogistic
from edge.verifier_training.replay import (ALL, CAP, ESTIMATOR_BUDGET, EXACT, HINDSIGHT, LEARNED, ReplaySettings,
                                           RoundCosts, Tally, Trace, adaptive_policy, block_position_chooser,
                                           by_category, estimator_block_scores, hindsight_chooser, kept_run,
                                           policy_chooser, replay, replay_trace)

COSTS = RoundCosts(draft_ms=40.0, verify_base_ms=700.0, verify_per_token_ms=40.0)


def test_a_round_keeps_the_run_before_the_first_failing_coin():
    kept = np.array([True, True, False, True])
    assert kept_run(kept, 0, 4) == 2 and kept_run(kept, 0, 1) == 1 and kept_run(kept, 3, 1) == 1
    assert kept_run(kept, 2, 2) == 0


def test_fixed_blocks_on_a_known_trace():
    kept = np.array([True, True, False, True, True, True])
    tally = Tally()
    replay_trace(policy_chooser(FixedPolicy(2), [0.5] * 6), kept, COSTS, 100.0, tally)
    # rounds: [0,1] both kept -> 3 tokens, pos 3; [3,4] kept -> 3 tokens, pos 6
    assert (tally.calls, tally.tokens, tally.drafted, tally.kept) == (2, 6, 4, 4)
    assert tally.time_ms == pytest.approx(2 * COSTS.round_ms(2, 100.0))
    tally = Tally()
    replay_trace(policy_chooser(FixedPolicy(3), [0.5] * 6), kept, COSTS, 0.0, tally)
    # [0,1,2] keeps 2 -> pos 3 (the target's token replaces 2); [3,4,5] keeps 3 -> +4
    assert (tally.calls, tally.tokens, tally.drafted, tally.kept) == (2, 7, 6, 5)


def test_the_hindsight_oracle_calls_as_drafting_to_the_cap_does_and_throws_nothing_away():
    rng = np.random.default_rng(0)
    for _ in range(20):
        kept = rng.random(int(rng.integers(1, 80))) < rng.uniform(0.3, 0.97)
        oracle, capped = Tally(), Tally()
        replay_trace(hindsight_chooser, kept, COSTS, 50.0, oracle)
        replay_trace(policy_chooser(FixedPolicy(20), [0.5] * len(kept)), kept, COSTS, 50.0, capped)
        assert (oracle.calls, oracle.tokens) == (capped.calls, capped.tokens)
        assert oracle.drafted == oracle.kept and oracle.time_ms <= capped.time_ms


def test_knowing_each_acceptance_probability_beats_a_verifier_that_knows_nothing():
    # runs of easy tokens broken by hard ones; the "learned" scores here say the same thing everywhere
    rng = np.random.default_rng(1)
    traces = []
    for _ in range(30):
        accept = np.where(rng.random(60) < 0.2, 0.05, 0.98)
        traces.append(Trace(accept.tolist(), [float(accept.mean())] * 60))
    rows = {r.policy: r for r in replay(traces, COSTS, ReplaySettings(rtts_ms=(100.0,), prices_ms=(1000.0,), seeds=4))}
    assert rows[EXACT].tokens_per_s > 1.1 * rows[LEARNED].tokens_per_s
    assert rows[HINDSIGHT].calls_vs_hindsight == 1.0 and rows[HINDSIGHT].wasted_draft_share == 0.0
    assert rows[HINDSIGHT].tokens_per_s >= max(r.tokens_per_s for r in rows.values())
    # a price on calls buys fewer calls with tokens/s
    priced = rows[f"{EXACT} +price:1000"]
    assert priced.calls_per_token <= rows[EXACT].calls_per_token


def test_estimator_scores_are_read_at_each_tokens_position_in_its_block():
    # p is high at block positions 0-2 and low from 3 on, whatever the token: the adaptive budget sends once it
    # has seen the drop (the fourth token), wherever the block starts
    block_scores = np.full((CAP, 40), 0.05)
    block_scores[:3] = 0.99
    choose = block_position_chooser(adaptive_policy(COSTS, 50.0), block_scores)
    kept = np.ones(40, dtype=bool)
    assert choose(0, CAP, kept) == choose(17, CAP, kept) == 4
    estimator = MarginLogistic()
    estimator.params = {0: (1.0, 0.0), 2: (2.0, -1.0)}
    scores = estimator_block_scores(estimator, np.array([0.0, 1.0]))
    assert scores.shape == (CAP, 2)
    assert scores[0].tolist() == pytest.approx([0.5, 1 / (1 + np.exp(-1.0))])
    assert scores[1].tolist() == scores[0].tolist()  # position 1 reads the nearest shallower fit
    assert scores[5].tolist() == pytest.approx([1 / (1 + np.exp(1.0)), 1 / (1 + np.exp(-1.0))])


def test_each_category_is_tallied_against_its_own_hindsight_oracle():
    rng = np.random.default_rng(2)
    traces = [Trace(np.where(rng.random(50) < rate, 0.1, 0.97).tolist(), [0.8] * 50, category,
                    np.full((CAP, 50), 0.8))
              for category, rate in (("easy", 0.05), ("hard", 0.4)) for _ in range(6)]
    rows = replay(traces, COSTS, ReplaySettings(rtts_ms=(50.0,), fixed_ks=(4,), prices_ms=(), seeds=2))
    at = {(r.category, r.policy): r for r in rows}
    assert {r.category for r in rows} == {ALL, "easy", "hard"}
    assert {ESTIMATOR_BUDGET, "adaptive + learned", "goodput + margin-logistic"} <= {r.policy for r in rows}
    for category in ("easy", "hard"):
        assert at[category, HINDSIGHT].calls_vs_hindsight == 1.0
    # the easy prompts keep longer runs: fewer calls per token, more tokens/s
    assert at["easy", HINDSIGHT].calls_per_token < at[ALL, HINDSIGHT].calls_per_token < at["hard", HINDSIGHT].calls_per_token
    assert "| 50 | easy |" in by_category(rows)
