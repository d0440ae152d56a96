"""The raw decoding record in the stats and the oracle call rate computed from it."""

from __future__ import annotations

import pytest

from common.spec.local_decoder import LocalDecoder
from common.spec.modes import DecodeSettings
from common.stats import oracle_calls_per_token


def test_oracle_call_rate_from_an_acceptance_record():
    assert oracle_calls_per_token([5, 5], [5, 5], cap=20) == pytest.approx(1 / 21)  # never rejected: the cap decides
    # p = 4 accepted / (4 + 2 rejections) = 2/3; a call yields sum_{j<=3} p^j tokens with cap 3
    p = 2 / 3
    assert oracle_calls_per_token([3, 3, 2], [2, 0, 2], cap=3) == pytest.approx(1 / sum(p ** j for j in range(4)))
    assert oracle_calls_per_token([], []) is None


def test_stats_carry_the_record(tiny_target, tiny_draft):
    prompt = tiny_target.tokenizer("hello")["input_ids"]
    stats = LocalDecoder(tiny_target, tiny_draft).generate(prompt, DecodeSettings(mode="sd", max_new_tokens=12)).stats
    assert len(stats.block_lengths) == len(stats.accepted_lengths) == stats.target_calls
    assert all(0 <= n <= g for g, n in zip(stats.block_lengths, stats.accepted_lengths))
    assert len(stats.token_times_ms) == stats.new_tokens
    assert stats.token_times_ms == sorted(stats.token_times_ms)
    assert sum(stats.block_lengths) == stats.drafted_tokens


def test_the_sweeps_hindsight_oracle_counts_the_sessions_open_as_a_call_of_its_own():
    from sim.sweep.summary import hindsight_calls_per_token

    never_rejected = {"target_calls": 3, "stats": {"block_lengths": [5, 5], "accepted_lengths": [5, 5]}}
    # 2 verified blocks + the open (target_calls 3): 1 call for the open's token, 1/21 per token after it
    assert hindsight_calls_per_token([{"sprinter": never_rejected}], 13) == pytest.approx((1 + 12 / 21) / 13)
    no_open = {"target_calls": 2, "stats": never_rejected["stats"]}
    assert hindsight_calls_per_token([{"sprinter": no_open}], 12) == pytest.approx(1 / 21)
    assert hindsight_calls_per_token([{"sprinter": {"target_calls": 1, "stats": {}}}], 4) is None
