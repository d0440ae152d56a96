"""The one cost model (common/spec/round_cost.py): the rates every speculation choice reads, and the cloud's costs."""

from __future__ import annotations

import pytest

from common.spec.call_policy import goodput
from common.spec.round_cost import CloudCosts, request_rate, edge_speculation_rate


def test_edge_speculation_is_a_rounds_tokens_over_its_time():
    # 3 tokens a round; 4 draft steps of 10 ms, a 50 ms round trip, a 30 ms verify, 20 ms of uplink: 140 ms
    assert edge_speculation_rate(3.0, 4, 10.0, 50.0, 30.0, 20.0) == pytest.approx(3 / 0.140)


def test_goodput_is_the_edge_speculation_rate_per_ms():
    probs = [0.9, 0.5]  # E = 0.9 + 0.45 = 1.35 accepted, + the target's own token
    assert goodput(probs, 10.0, 50.0, 30.0) == pytest.approx(edge_speculation_rate(2.35, 2, 10.0, 50.0, 30.0) / 1e3)


def test_a_cloud_stream_pays_the_round_trip_once():
    # target alone: a token per 40 ms step; 100 tokens after one 200 ms round trip
    assert request_rate(100, 1.0, 40.0, 200.0) == pytest.approx(100 / 4.2)
    # a queue stretching every step by half
    assert request_rate(100, 1.0, 40.0, 200.0, load=1.5) == pytest.approx(100 / 6.2)


COSTS = CloudCosts(128, {(1, 1): 10.0, (1, 4): 16.0, (1, 8): 24.0, (4, 1): 14.0, (4, 8): 60.0})


def test_cloud_costs_read_measured_forwards_and_interpolate_between_them():
    assert COSTS.decode_ms() == 10.0
    assert COSTS.verify_ms(8) == 24.0
    assert COSTS.verify_ms(6) == pytest.approx(20.0)  # halfway from 4 to 8 tokens
    assert COSTS.verify_ms(12) == pytest.approx(32.0)  # past the largest: the last slope
    assert COSTS.verify_ms(8, sessions=4) == 60.0
    assert COSTS.verify_ms(8, sessions=3) == 60.0  # the nearest measured batch


def test_no_cost_table_is_falsy_and_answers_none():
    assert not CloudCosts() and CloudCosts().verify_ms(4) is None and CloudCosts().decode_ms() is None
