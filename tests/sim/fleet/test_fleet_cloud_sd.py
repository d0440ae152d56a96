"""The fleet simulator's cloud-sd: the cloud drafts at the replica (draft forwards share its compute with the
target's), pays the RTT once per generation, and loses capacity to sd-block as 1 + gamma * t_d / t_v predicts."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from common.cli import main
from sim.fleet.capacity import formula_ratio, max_edges_at_itl, project_capacity
from sim.fleet.costs import (
    FleetCosts,
    ForwardModel,
    ModeProfile,
    RttModel,
    cloud_profile,
    demo_costs,
    demo_profiles,
)
from sim.fleet.simulation import run_fleet

# target forward 50 + 2n + 3b ms, draft step 5 + 1n ms; a lone edge must never wait out the window
FIXED = FleetCosts(draft_step_ms=10.0, verifier_ms=1.0, forward=ForwardModel(50.0, 2.0, 3.0), window_ms=1000.0,
                   draft_forward=ForwardModel(5.0, 1.0, 0.0))
# Forwards that cost per request only, edge drafting and network near free: the formula's own setting.
LINEAR = FleetCosts(draft_step_ms=0.5, verifier_ms=0.0, forward=ForwardModel(0.0, 2.0, 0.0),
                    draft_forward=ForwardModel(0.0, 0.0, 1.5), max_batch=4096)


def profile(mode: str, calls: list[tuple[int, int]]) -> ModeProfile:
    return ModeProfile.from_dict({"mode": mode, "calls": [{"block_length": g, "emitted": e} for g, e in calls]})


def demo(name: str) -> ModeProfile:
    return next(p for p in demo_profiles() if p.name == name)


def test_one_edge_cloud_sd_matches_hand_computation() -> None:
    # A round at the replica: 4 draft steps of b=1, n=1 (6 ms each), then a verify of b=1, n=5 (63 ms): 87 ms
    # for 5 tokens; no RTT. 10 tokens: two rounds, 174 ms, the replica busy throughout.
    result = run_fleet(FIXED, profile("cloud-sd", [(4, 5)]), 1, 1, tokens_per_request=10)
    assert result.tokens_per_s_mean == pytest.approx(10 / 0.174)
    assert result.ttft_ms_p50 == pytest.approx(87.0)
    assert result.itl_ms_p50 == 0.0 and result.itl_ms_p99 == pytest.approx(87.0)  # a round's chunk at once
    # per token (bench capacity's): the second chunk's 87 ms over its 5 tokens; the first chunk is no gap
    assert result.itl_per_token_ms_p50 == pytest.approx(17.4) and result.itl_per_token_ms_p99 == pytest.approx(17.4)
    assert result.cloud_draft_forwards == 8 and result.cloud_forwards == 2
    assert result.cloud_utilisation == pytest.approx(1.0)
    assert result.target_calls_per_token == pytest.approx(0.2)  # one verify per round


def test_per_token_itl_counts_a_streamed_sprinter_token_once_and_a_verdicts_tokens_each() -> None:
    # sprinter, calls (3, 3): 2 passed tokens stream a step (11 ms) apart (11, 22 ms), the verdict's one token comes
    # after the verify (sent at 33, 50 + 2 x 4 + 3 = 61 ms: 94); the second call streams at 105, 116 and its verdict
    # comes at 188. Per-token samples after the first token: 11, 72, 11, 11, 72.
    result = run_fleet(FIXED, profile("sprinter", [(3, 3)]), 1, 1, tokens_per_request=6)
    assert result.itl_per_token_ms_p50 == pytest.approx(11.0)
    assert result.itl_per_token_ms_p99 == pytest.approx(72.0)
    assert result.itl_ms_p99 == pytest.approx(72.0)  # one token a release: the two definitions agree


def test_draft_and_target_forwards_share_the_replica() -> None:
    # Two edges on one replica, continuous batching. A's first step runs alone (0-6 ms), then A's steps 2-4 and
    # B's 1-3 in batches of 2 (7 ms each: 27 ms); A's verify (63 ms: 90) goes before B's last step (6 ms: 96),
    # then B's verify (63 ms: 159). The replica runs one forward at a time and is never idle.
    result = run_fleet(replace(FIXED, window_ms=0.0), profile("cloud-sd", [(4, 5)]), 2, 1, tokens_per_request=5)
    assert result.cloud_draft_forwards == 5 and result.cloud_draft_batch_size_mean == pytest.approx(8 / 5)
    assert result.cloud_forwards == 2
    assert result.sim_s == pytest.approx(0.159)
    assert result.cloud_utilisation == pytest.approx(1.0)
    # a replica each: 4 x 6 + 63 = 87 ms, in parallel
    assert run_fleet(FIXED, profile("cloud-sd", [(4, 5)]), 2, 2, tokens_per_request=5).sim_s == pytest.approx(0.087)


def test_cloud_sd_pays_the_round_trip_once_and_sd_block_every_round() -> None:
    calls = [(4, 5), (4, 2), (4, 3)]
    for edges in (1, 8):
        fast, slow = (run_fleet(replace(FIXED, rtt=RttModel(mean_ms=rtt)), profile("cloud-sd", calls), edges, 1,
                                tokens_per_request=64) for rtt in (0.0, 100.0))
        assert slow.request_ms_p50 - fast.request_ms_p50 == pytest.approx(100.0)  # up at the start, down at the end
        assert slow.itl_ms_p99 == pytest.approx(fast.itl_ms_p99)  # the tokens stream: no RTT between them
        assert slow.ttft_ms_p50 - fast.ttft_ms_p50 == pytest.approx(100.0)
        edge_fast, edge_slow = (run_fleet(replace(FIXED, rtt=RttModel(mean_ms=rtt)), profile("sd-block", calls), edges, 1,
                                          tokens_per_request=64) for rtt in (0.0, 100.0))
        assert edge_slow.itl_ms_p99 == pytest.approx(edge_fast.itl_ms_p99 + 100.0, abs=1.0)
        assert edge_slow.request_ms_p50 - edge_fast.request_ms_p50 > 10 * 100.0  # one RTT per round (~20 rounds)


@pytest.mark.parametrize("itl_p99_ms", [300.0, 900.0])
def test_capacity_ratio_follows_the_drafting_cost(itl_p99_ms: float) -> None:
    # gamma = 5 draft steps of 1.5 ms per request against a verify of 6 tokens at 2 ms: 1 + 5 x 1.5 / 12 = 1.625
    sd_block = demo("sd-block")
    cloud = cloud_profile(sd_block)
    edge_drafting, _ = max_edges_at_itl(LINEAR, sd_block, itl_p99_ms)
    cloud_drafting, at_target = max_edges_at_itl(LINEAR, cloud, itl_p99_ms)
    assert at_target is not None and at_target.itl_ms_p99 <= itl_p99_ms
    predicted = formula_ratio(LINEAR, cloud, cloud_drafting)["predicted"]
    assert predicted == pytest.approx(1.625)
    assert edge_drafting / cloud_drafting == pytest.approx(predicted, rel=0.10)
    # without the drafting cost the two would serve as many edges
    free_draft = replace(LINEAR, draft_forward=ForwardModel(0.0, 0.0, 0.0))
    assert max_edges_at_itl(free_draft, cloud, itl_p99_ms)[0] == pytest.approx(edge_drafting, rel=0.10)


def test_project_capacity_reports_each_mode_and_rtt_and_the_formula() -> None:
    profiles = {name: demo(name) for name in ("target", "cloud-sd", "sd-block", "sprinter-exact")}
    projection = project_capacity(demo_costs(), profiles, [1, 4], [0.0, 200.0], itl_p99_ms=1500.0,
                                  tokens_per_request=32, e_max=64)
    json.dumps(projection)  # JSON-ready
    rows = {(r["label"], r["rtt_ms"]): r for r in projection["rows"]}
    assert set(rows) == {(label, rtt) for label in profiles for rtt in (0.0, 200.0)}
    for row in rows.values():
        assert row["edges"] == [1, 4] and len(row["tokens_per_s_per_user"]) == 2 and len(row["itl_ms_p99"]) == 2
        assert row["tokens_per_s_per_user"][0] >= row["tokens_per_s_per_user"][1] > 0
        assert 1 <= row["edges_at_itl"] <= 64
    # the RTT costs sd-block per-user speed, not the cloud's streaming modes (beyond the first token)
    for label in ("target", "cloud-sd"):
        assert rows[(label, 200.0)]["tokens_per_s_per_user"][0] > 0.9 * rows[(label, 0.0)]["tokens_per_s_per_user"][0]
    assert rows[("sd-block", 200.0)]["tokens_per_s_per_user"][0] < 0.7 * rows[("sd-block", 0.0)]["tokens_per_s_per_user"][0]
    formula = projection["formula"]
    # only sd-block has cloud-sd's rounds (its record); sprinter-exact's blocks differ
    assert {(f["edge_label"], f["rtt_ms"]) for f in formula} == {("sd-block", 0.0), ("sd-block", 200.0)}
    assert all(f["predicted"] > 1 and f["cloud_label"] == "cloud-sd" for f in formula)


def test_cloud_sd_needs_the_drafts_costs() -> None:
    costs = replace(demo_costs(), draft_forward=None)
    with pytest.raises(ValueError, match="draft_forward"):
        run_fleet(costs, demo("cloud-sd"), 1, 1)
    data = json.loads(demo_costs().to_json()) | {"draft_forward": {"samples": [[1, 1, 11.0], [4, 4, 14.0], [1, 5, 15.0]]}}
    fitted = FleetCosts.from_json(json.dumps(data)).draft_forward
    assert tuple(vars(fitted).values()) == pytest.approx((10.0, 1.0, 0.0), abs=1e-9)
    assert FleetCosts.from_json(demo_costs().to_json()) == demo_costs()
    with pytest.raises(ValueError, match="cloud-drafting"):
        cloud_profile(demo("sprinter"))


def test_cli_simulates_cloud_sd(tmp_path: Path) -> None:
    assert main(["fleet", "simulate", "--demo", "--modes", "cloud-sd,sd-block", "--edges", "1,4", "--replicas", "1",
                 "--tokens-per-request", "16", "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert {r["mode"] for r in rows} == {"cloud-sd", "sd-block"}
    assert all(r["cloud_draft_forwards"] > 0 for r in rows if r["mode"] == "cloud-sd")
    costs = json.loads((tmp_path / "costs.json").read_text())
    costs.pop("draft_forward")
    (tmp_path / "old.json").write_text(json.dumps(costs))
    with pytest.raises(SystemExit) as refused:
        main(["fleet", "simulate", "--costs", str(tmp_path / "old.json"), "--demo", "--modes", "cloud-sd",
              "--edges", "1", "--out", str(tmp_path / "again")])
    assert refused.value.code == 2
