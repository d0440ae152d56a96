"""`sprinter bench capacity`: its arithmetic (per-token ITL, edges per replica, the prediction, replayed blocks) on
made-up traces, and the whole bench for a few seconds on the tiny random pair (a real pinned `cloud serve --draft`)."""

from __future__ import annotations

import json

import pytest

from sim.bench.capacity import CapacityBenchError, RecordedRound, bench_capacity, check_modes, replay_block
from sim.bench.capacity_report import GenerationTrace, edges_per_replica, itl_samples, prediction, summarise
from sim.bench.settings import CapacityBenchSettings


def test_per_token_itl_spreads_a_release_gap_over_its_tokens_and_skips_the_first_release() -> None:
    trace = GenerationTrace(started=0.0, releases=[(0.5, 1), (0.6, 4), (0.62, 1)])
    per_token, gaps = itl_samples(trace)
    assert per_token == pytest.approx([25.0] * 4 + [20.0])  # 100 ms over 4 tokens, then 20 ms over 1
    assert gaps == pytest.approx([100.0, 20.0])
    assert sum(per_token) == pytest.approx((0.62 - 0.5) * 1e3)  # the samples add up to the decode time


def _row(mode: str, edges: int, p99: float, rtt: float = 0.0, gamma: float = 4.0, t_d: float = 10.0,
         t_v: float = 40.0) -> dict:
    return {"mode": mode, "edges": edges, "rtt_ms": rtt, "itl_ms_p99": p99, "drafted_per_round": gamma,
            "cloud": {"draft_forward_ms": t_d, "target_forward_ms": t_v}}


def test_edges_per_replica_is_the_largest_edge_count_within_the_target_at_rtt_0() -> None:
    rows = [_row("sd-block", 1, 10), _row("sd-block", 2, 12), _row("sd-block", 4, 30), _row("sd-block", 8, 19),
            _row("sd-block", 16, 5, rtt=50.0), _row("cloud-sd", 1, 25)]
    assert edges_per_replica(rows, "sd-block", 20.0) == 8  # the largest that fits, not the first gap
    assert edges_per_replica(rows, "cloud-sd", 20.0) is None
    pred = prediction(rows + [_row("cloud-sd", 2, 18)], "cloud-sd", "sd-block", 20.0)
    assert pred["edges_per_replica"] == {"cloud-sd": 2, "sd-block": 8}
    assert pred["measured_ratio"] == 4.0
    assert pred["at_one_edge"]["predicted_ratio"] == pytest.approx(1 + 4.0 * 10.0 / 40.0)
    assert pred["at_capacity"]["edges"] == 2


def test_summarise_counts_tokens_rounds_acceptance_and_the_cloud_side() -> None:
    edge = [GenerationTrace(0.0, [(1.0, 3), (2.0, 1)], drafted=[4, 4], verify_ms={2: [5.0, 7.0]}),
            GenerationTrace(2.0, [(3.0, 5)], drafted=[4])]
    before = {"sprinter_cloud_target_forward_seconds_sum": 1.0, "sprinter_cloud_target_forward_seconds_count": 10}
    after = {"sprinter_cloud_target_forward_seconds_sum": 1.5, "sprinter_cloud_target_forward_seconds_count": 15,
             "sprinter_cloud_batch_size_sum": 10}
    row = summarise("sd-block", 1, 0.0, 4, [edge], before, after)
    assert row["tokens"] == 9 and row["rounds"] == 3 and row["tokens_per_s_per_user"] == pytest.approx(3.0)
    assert row["acceptance"] == pytest.approx(6 / 12)  # each round releases its accepted tokens and one more
    assert row["verify_ms_by_batch"] == {"2": 6.0}
    assert row["cloud"]["target_forward_ms"] == pytest.approx(100.0) and row["cloud"]["target_batch_mean"] == 2.0
    assert row["cloud"]["draft_forward_ms"] is None


def test_a_replayed_block_gets_the_recorded_verdict_and_sprinter_exact_stops_at_the_rejection() -> None:
    rejected = RecordedRound(kept=[7, 8, 3], drafted=5)  # two accepted, then the target's 3
    assert replay_block(rejected, 100, cut_at_rejection=False) == [7, 8, 4, 4, 4]
    assert replay_block(rejected, 100, cut_at_rejection=True) == [7, 8, 4]
    bonus = RecordedRound(kept=[7, 8, 9, 99], drafted=3)  # all accepted: 99 is the target's bonus token
    assert replay_block(bonus, 100, cut_at_rejection=True) == [7, 8, 9]
    assert replay_block(RecordedRound(kept=[99], drafted=0), 100, cut_at_rejection=False) == [98]


def test_settings_that_cannot_work_are_refused_by_flag(tmp_path) -> None:
    for bad, flag in (({"edges": (0, 2)}, "--edges"), ({"rtts": (-1.0,)}, "--rtts"), ({"k": 0}, "--k"),
                      ({"edge_draft_ms": -1.0}, "--edge-draft-ms"), ({"itl_p99_ms": 0.0}, "--itl-p99-ms")):
        with pytest.raises(CapacityBenchError, match=flag):
            bench_capacity(CapacityBenchSettings(out=tmp_path, **bad))


def test_modes_it_cannot_run_are_refused_by_name() -> None:
    with pytest.raises(CapacityBenchError, match="sprinter is neither"):
        check_modes(("target", "sprinter"))
    with pytest.raises(CapacityBenchError, match="draft is neither"):
        check_modes(("draft",))


def test_the_bench_end_to_end_on_the_tiny_pair(tmp_path) -> None:
    settings = CapacityBenchSettings(target="tiny-random", draft="tiny-random-draft", dtype="float32",
                                     edges=(1, 2), rtts=(0.0, 10.0), max_new_tokens=8, edge_draft_ms=1.0,
                                     out=tmp_path)
    table = bench_capacity(settings)

    report = json.loads((tmp_path / "results.json").read_text())
    rows = report["rows"]
    assert {(r["mode"], r["edges"], r["rtt_ms"]) for r in rows} == {
        (m, e, t) for m in settings.modes for e in (1, 2) for t in (0.0, 10.0)}
    assert all(r["tokens"] > 0 and r["tokens_per_s_per_user"] > 0 and r["itl_ms_p99"] is not None for r in rows)
    assert all(0 < r["cloud_cpu_share"] and r["edges_cpu_share"] >= 0 for r in rows)
    for row in rows:  # every generation of a point emits the recorded tokens, however it gets them
        assert row["tokens"] == sum(r["tokens"] for r in rows if (r["edges"], r["rtt_ms"]) == (row["edges"], row["rtt_ms"])
                                    and r["mode"] == "target")
    cloud_sd = [r for r in rows if r["mode"] == "cloud-sd"]
    assert all(r["cloud"]["draft_forwards"] > 0 and r["drafted_per_round"] > 0 for r in cloud_sd)
    assert all(r["cloud"]["draft_forwards"] == 0 for r in rows if r["mode"] != "cloud-sd")
    assert all(r["verify_ms_by_batch"] for r in rows if r["mode"] in ("sd-block", "sprinter-exact"))
    assert report["itl_p99_target_basis"].startswith("2.5x target")
    assert set(report["capacity"]) == set(settings.modes)
    assert report["prediction"]["at_one_edge"]["predicted_ratio"] > 1
    assert report["recorded"]["prompts"] > 0 and report["edge_draft_ms"] == 1.0
    assert "Edges per replica" in table and (tmp_path / "table.md").read_text().strip() == table.strip()
    assert (tmp_path / "tokens_per_s_per_user.png").stat().st_size > 0
