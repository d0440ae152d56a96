"""Fleet simulator: hand-computed single-edge timings, batching, replicas, scale, fitting, I/O."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from common.cli import main
from sim.fleet.costs import (
    FleetCosts,
    ForwardModel,
    ModeProfile,
    RttModel,
    demo_costs,
    demo_profiles,
    fit_forward_model,
    profiles_from_json,
    profiles_to_json,
)
from sim.fleet.simulation import run_fleet
from sim.fleet.pipeline import PipelineModel, default_hit_rate
from sim.fleet.result import compare_with_measured

# Fixed costs, zero RTT: every number below is computed by hand from these.
# A lone edge must never wait out the window, hence the absurd 1000 ms.
FIXED = FleetCosts(draft_step_ms=10.0, verifier_ms=1.0, forward=ForwardModel(50.0, 2.0, 3.0), window_ms=1000.0)


def profile(mode: str, calls: list[tuple[int, int]]) -> ModeProfile:
    return ModeProfile.from_dict({"mode": mode, "calls": [{"block_length": g, "emitted": e} for g, e in calls]})


def test_one_edge_sd_matches_hand_computation() -> None:
    # A round: 4 draft steps (40 ms, no verifier in sd) + one forward of b=1, n=4+1 (50 + 10 + 3 = 63 ms)
    # gives 5 tokens; 10 tokens = 2 rounds = 206 ms.
    result = run_fleet(FIXED, profile("sd", [(4, 5)]), n_edges=1, n_replicas=1, tokens_per_request=10)
    assert result.tokens == 10
    assert result.tokens_per_s_mean == pytest.approx(10 / 0.206)
    assert result.target_calls_per_token == pytest.approx(0.2)
    assert result.cloud_batch_size_mean == 1.0
    assert result.cloud_utilisation == pytest.approx(126 / 206)
    assert result.itl_ms_p50 == 0.0  # a block is released at once
    assert result.ttft_ms_p50 == pytest.approx(103.0)


def test_one_edge_sprinter_streams_drafted_tokens() -> None:
    # Steps of 11 ms (draft + verifier). Round: 3 tokens streamed at 11, 22, 33 ms, the flagged 4th sent at
    # 44 ms, forward 63 ms, verdict at 107 ms releases 2 tokens. 10 tokens: 214 ms.
    result = run_fleet(FIXED, profile("sprinter", [(4, 5)]), n_edges=1, n_replicas=1, tokens_per_request=10)
    assert result.tokens_per_s_mean == pytest.approx(10 / 0.214)
    assert result.ttft_ms_p50 == pytest.approx(11.0)
    # gaps: 11 11 74 0 | 11 11 11 74 0 -> sorted median 11, p99 74
    assert result.itl_ms_p50 == pytest.approx(11.0)
    assert result.itl_ms_p99 == pytest.approx(74.0)


def test_target_and_draft_modes() -> None:
    target = run_fleet(FIXED, ModeProfile("target", "target"), 1, 1, tokens_per_request=20)
    assert target.tokens_per_s_mean == pytest.approx(1000 / 55.0)  # one 1-token forward per token
    assert target.target_calls_per_token == 1.0
    draft = run_fleet(FIXED, ModeProfile("draft", "draft"), 3, 1, tokens_per_request=20)
    assert draft.tokens_per_s_mean == pytest.approx(100.0)  # 10 ms per step, no verifier, no cloud
    assert draft.target_calls == 0 and draft.cloud_utilisation == 0.0


def test_rtt_and_uplink_add_to_the_round() -> None:
    costs = replace(FIXED, rtt=RttModel(mean_ms=40.0), uplink_mbps=1.0, frame_bytes=100.0, uplink_bytes_per_token=25.0)
    # uplink: (100 + 25 * 4) bytes * 8 / 1000 bits per ms = 1.6 ms; round 40 + 40 + 1.6 + 63 ms
    result = run_fleet(costs, profile("sd", [(4, 5)]), 1, 1, tokens_per_request=10)
    assert result.tokens_per_s_mean == pytest.approx(10 / (2 * 0.1446))


def test_prefill_opens_the_session_first() -> None:
    costs = replace(FIXED, prompt_tokens=11, draft_prefill_ms=25.0)
    # the first token costs the 25 ms prefill instead of a 10 ms step: round 1 drafts for 55 ms, then the
    # open (forward of 10 prompt tokens: 73 ms), then the block (63 ms): 191 ms; round 2: 103 ms
    sd = run_fleet(costs, profile("sd", [(4, 5)]), 1, 1, tokens_per_request=10)
    assert sd.tokens_per_s_mean == pytest.approx(10 / 0.294)
    assert sd.target_calls_per_token == pytest.approx(0.2)  # the open is not a verification
    target = run_fleet(costs, ModeProfile("target", "target"), 1, 1, tokens_per_request=20)
    assert target.tokens_per_s_mean == pytest.approx(20 / (0.075 + 19 * 0.055))  # the first forward carries the prompt


def test_deterministic_with_a_seed() -> None:
    costs = replace(demo_costs(), rtt=RttModel(30.0, 10.0))
    sd = demo_profiles()[2]
    a, b = (run_fleet(costs, sd, 20, 2, seed=7, tokens_per_request=32) for _ in range(2))
    assert a == b
    assert run_fleet(costs, sd, 20, 2, seed=8, tokens_per_request=32) != a


def test_batching_raises_batch_size_and_utilisation() -> None:
    costs, sd = demo_costs(), demo_profiles()[2]
    alone = run_fleet(costs, sd, 1, 1, tokens_per_request=32)
    crowd = run_fleet(costs, sd, 64, 1, tokens_per_request=32)
    assert alone.cloud_batch_size_mean == 1.0
    assert crowd.cloud_batch_size_mean > 8
    assert crowd.cloud_utilisation > alone.cloud_utilisation
    assert crowd.cloud_forwards_per_token < alone.cloud_forwards_per_token / 4
    assert crowd.target_calls_per_token == pytest.approx(alone.target_calls_per_token, rel=0.1)


def test_more_replicas_lower_latency_under_load() -> None:
    costs, sd = demo_costs(), demo_profiles()[2]
    one, four = (run_fleet(costs, sd, 64, m, tokens_per_request=32) for m in (1, 4))
    assert four.call_ms_p50 < one.call_ms_p50
    assert four.request_ms_p50 < one.request_ms_p50
    assert four.tokens_per_s_mean > one.tokens_per_s_mean


def test_duration_mode_counts_tokens_by_the_horizon() -> None:
    # generations of 206 ms back to back: 5 done by 1.03 s; the 6th's first verdict (1.133 s) is too late
    result = run_fleet(FIXED, profile("sd", [(4, 5)]), 1, 1, tokens_per_request=10, duration_s=1.1)
    assert result.tokens == 50
    assert result.tokens_per_s_mean == pytest.approx(50 / 1.1)
    assert result.cloud_utilisation == pytest.approx((5 * 126 + 30) / 1100)  # the 6th forward is cut at 1.1 s


def test_ten_thousand_edges_run_quickly() -> None:
    started = time.perf_counter()
    result = run_fleet(demo_costs(), demo_profiles()[4], 10_000, 4, tokens_per_request=8)
    assert time.perf_counter() - started < 3.0
    assert result.tokens == 80_000
    assert result.cloud_batch_size_mean > 15


def test_fit_forward_model_recovers_known_coefficients() -> None:
    rng = np.random.default_rng(0)
    truth = ForwardModel(120.0, 4.5, 7.0)
    samples = [(int(b), int(n), truth.t_forward_ms(b, n)) for b, n in zip(rng.integers(1, 17, 30), rng.integers(1, 200, 30))]
    fitted = fit_forward_model(samples)
    assert (fitted.c0_ms, fitted.c_tok_ms, fitted.c_seq_ms) == pytest.approx((120.0, 4.5, 7.0))
    # collinear, concave samples (the bench's n = 6b) still give non-negative coefficients
    assert min(vars(fit_forward_model([(1, 6, 171.0), (8, 48, 405.0), (16, 96, 609.0)])).values()) >= 0


def test_json_round_trips_and_sample_fitting() -> None:
    costs = demo_costs()
    assert FleetCosts.from_json(costs.to_json()) == costs
    data = json.loads(costs.to_json()) | {"forward": {"samples": [[1, 1, 13.0], [1, 11, 33.0], [4, 4, 22.0]]}}
    assert tuple(vars(FleetCosts.from_json(json.dumps(data)).forward).values()) == pytest.approx((10.0, 2.0, 1.0))
    profiles = demo_profiles()
    assert profiles_from_json(profiles_to_json(profiles)) == profiles
    assert profiles[2].tokens_per_call == pytest.approx(3.7, abs=0.05)
    assert profiles[4].tokens_per_call == pytest.approx(4.8, abs=0.05)
    with pytest.raises(ValueError):
        profile("sd", [(4, 6)])  # more than block_length + 1 tokens from one call


def test_compare_with_measured() -> None:
    predicted = run_fleet(FIXED, profile("sd", [(4, 5)]), 1, 1, tokens_per_request=10)
    report = compare_with_measured(predicted, {"tokens_per_s": 50.0, "target_calls_per_token": 0.2})
    assert report["tokens_per_s"]["rel_error"] == pytest.approx((10 / 0.206 - 50) / 50)
    assert report["target_calls_per_token"]["rel_error"] == pytest.approx(0.0)
    assert report["within_tolerance"] is True
    assert compare_with_measured(predicted, {"tokens_per_s": 30.0})["within_tolerance"] is False


def test_cli_writes_results_table_and_plots(tmp_path: Path) -> None:
    assert main(["fleet", "simulate", "--demo", "--modes", "sd,sprinter", "--edges", "1,4", "--replicas", "1,2",
                 "--tokens-per-request", "16", "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and {r["profile"] for r in rows} == {"sd", "sprinter"}
    assert "ILLUSTRATIVE" in (tmp_path / "table.md").read_text()
    for name in ("tokens_per_s.png", "itl_p99.png", "cloud_utilisation.png", "costs.json", "profiles.json"):
        assert (tmp_path / name).stat().st_size > 0


def test_a_pipeline_hides_the_round_trip_as_often_as_it_hits() -> None:
    # RTT 200 ms (jittered), sd with the demo's acceptance: a round is ~4 draft steps, a round trip, a forward.
    costs = replace(demo_costs(), rtt=RttModel(mean_ms=200.0, jitter_ms=20.0))
    sd = demo_profiles()[2]

    def tokens_per_s(pipeline: str = "off", hit_rate: float | None = None) -> float:
        result = run_fleet(costs, sd, 1, 1, seed=3, tokens_per_request=128, requests=4,
                           pipeline=PipelineModel(pipeline, hit_rate))
        assert result.pipeline == pipeline
        return result.tokens_per_s_mean

    off = tokens_per_s()
    send_ahead, ahead = tokens_per_s("send-ahead", 1.0), tokens_per_s("ahead", 1.0)
    assert send_ahead > 1.5 * off  # the next block's verify follows the verdict, with no round trip between
    assert off * 1.1 < ahead < send_ahead * 0.9  # ahead hides only the drafting
    for pipeline in ("ahead", "send-ahead"):  # never a hit: the rounds are off's
        assert tokens_per_s(pipeline, 0.0) == pytest.approx(off, rel=0.02)


def test_send_ahead_counts_its_candidates_and_modes_without_a_pipeline_ignore_it() -> None:
    sd = profile("sd", [(4, 5)])
    off = run_fleet(FIXED, sd, 1, 1, tokens_per_request=20)
    sent = run_fleet(FIXED, sd, 1, 1, tokens_per_request=20, pipeline=PipelineModel("send-ahead", 0.0))
    assert off.uplink_bytes_per_token == pytest.approx(4 * (64 + 8 * 4) / 20)  # 4 blocks of 4 tokens
    # one 40 ms candidate is done within each 63 ms verify (RTT 0); the fourth verdict ends the generation
    assert sent.uplink_bytes_per_token == pytest.approx((4 + 3) * (64 + 8 * 4) / 20) and sent.candidate_hits == 0
    assert sent.tokens_per_s_mean == pytest.approx(off.tokens_per_s_mean)
    hits = run_fleet(FIXED, sd, 1, 1, tokens_per_request=20, pipeline=PipelineModel("send-ahead", 1.0))
    assert hits.candidate_hits == 3 and hits.ahead_hit_rate == 1.0
    # each next block was drafted (40 ms) within the 63 ms verify: verifies back to back after the first round
    assert hits.tokens_per_s_mean == pytest.approx(20 / (0.103 + 3 * 0.063))
    sprinter = run_fleet(FIXED, profile("sprinter", [(4, 5)]), 1, 1, tokens_per_request=20,
                         pipeline=PipelineModel("send-ahead", 1.0))
    assert sprinter.pipeline == "off" and sprinter.candidate_hits == 0
    with pytest.raises(ValueError, match="pipeline"):
        PipelineModel("sideways")


def test_the_default_hit_rate_follows_the_profiles_acceptance() -> None:
    # half the calls keep all 4 tokens (a: 10 kept of 12 tokens examined, 2 rejections at position 3)
    record = profile("sd", [(4, 5), (4, 4)])
    a = 7 / 8
    assert default_hit_rate(record, "ahead") == pytest.approx(0.5 * a)
    assert default_hit_rate(record, "send-ahead") == pytest.approx(0.5 * (1 - (1 - a) ** 2) + a * 0.5)
    assert default_hit_rate(record, "send-ahead") > default_hit_rate(record, "ahead")
    assert PipelineModel("ahead").hit_rate_for(ModeProfile("target", "target")) == 0.0


def test_cli_runs_each_pipeline(tmp_path: Path) -> None:
    assert main(["fleet", "simulate", "--demo", "--modes", "target,sd", "--edges", "1", "--replicas", "1",
                 "--pipeline", "off,ahead,send-ahead", "--hit-rate", "1", "--tokens-per-request", "16",
                 "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted((r["profile"], r["pipeline"]) for r in rows) == [
        ("sd", "ahead"), ("sd", "off"), ("sd", "send-ahead"), ("target", "off")]  # target runs once
    assert all(r["hit_rate"] == 1.0 for r in rows if r["pipeline"] != "off")
    assert "| sd | send-ahead | 1.00 |" in (tmp_path / "table.md").read_text()
