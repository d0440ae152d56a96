"""edge/decoding/ahead_gauge.py: a pipeline drafts ahead only while its measured hits pay for the lag, and probes otherwise."""

from __future__ import annotations

from edge.decoding.ahead_gauge import MIN_HIT_RATE, PROBE_EVERY, AheadGauge, AheadRecord


def _decisions(gauge: AheadGauge, rounds: int, hit: bool, saving_ms: float, lag_ms: float) -> list[bool]:
    decisions = []
    for _ in range(rounds):
        ahead = gauge.draft_ahead()
        decisions.append(ahead)
        if ahead:
            gauge.observe(hit, saving_ms, lag_ms)
    return decisions


def test_it_drafts_ahead_until_it_has_measured_a_round():
    gauge = AheadGauge(AheadRecord())
    assert gauge.pays() and gauge.draft_ahead()


def test_guesses_that_miss_fall_back_to_off_with_a_probe_every_few_rounds():
    gauge = AheadGauge(AheadRecord())
    decisions = _decisions(gauge, 64, hit=False, saving_ms=50.0, lag_ms=5.0)
    assert all(decisions[:4])  # the prior (0.5, weighted 4 rounds) holds it on for a few misses
    tail = decisions[16:]
    assert sum(tail) == len(tail) // PROBE_EVERY, tail  # then one probe in every PROBE_EVERY rounds
    assert gauge.skipped == decisions.count(False) and gauge.hit_rate < MIN_HIT_RATE


def test_hits_that_save_more_than_the_lag_keep_it_on():
    gauge = AheadGauge(AheadRecord())
    assert all(_decisions(gauge, 40, hit=True, saving_ms=40.0, lag_ms=5.0))


def test_hits_worth_less_than_the_lag_turn_it_off():
    gauge = AheadGauge(AheadRecord())
    decisions = _decisions(gauge, 40, hit=True, saving_ms=2.0, lag_ms=10.0)
    assert decisions[0] and decisions.count(False) > 30


def test_a_new_generation_starts_from_what_the_edge_learned():
    record = AheadRecord()
    for _ in range(4):  # four generations of 40 rounds whose guesses missed
        _decisions(AheadGauge(record), 40, hit=False, saving_ms=50.0, lag_ms=5.0)
    fresh = AheadGauge(record)
    assert not fresh.pays() and not fresh.draft_ahead()


def test_without_adapting_it_drafts_ahead_every_round_and_still_measures():
    record = AheadRecord()
    gauge = AheadGauge(record, adapts=False)
    assert all(_decisions(gauge, 32, hit=False, saving_ms=50.0, lag_ms=5.0))
    assert record.snapshot()["rounds"] == 32 and record.hit_rate.value < MIN_HIT_RATE
