"""`sprinter bench capacity`: its arithmetic (per-token ITL, edges per replica, the prediction, replayed blocks) on
made-up traces, and the whole bench for a few seconds on the tiny random pair (a real pinned `cloud serve --draft`)."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict

import pytest

from sim.bench.capacity import RecordedRound, bench_capacity, check_modes, replay_block
from sim.bench.capacity_projection import (fit_costs, format_projection, profiles, project, recorded_rounds,
                                          synthetic_rounds)
from sim.bench.capacity_report import GenerationTrace, edges_per_replica, itl_samples, prediction, summarise
from sim.bench.settings.capacity import BenchSettingsError, CapacityBenchSettings
from sim.fleet.costs import ForwardModel


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
    increases = {"sprinter_cloud_target_forward_seconds_sum": 0.5, "sprinter_cloud_target_forward_seconds_count": 5,
                 "sprinter_cloud_batch_size_sum": 10}
    row = summarise("sd-block", 1, 0.0, 4, [edge], increases)
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
        with pytest.raises(BenchSettingsError, match=flag):
            bench_capacity(CapacityBenchSettings(out=tmp_path, **bad))


def test_modes_it_cannot_run_are_refused_by_name() -> None:
    with pytest.raises(BenchSettingsError, match="sprinter is neither"):
        check_modes(("target", "sprinter"))
    with pytest.raises(BenchSettingsError, match="draft is neither"):
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
    # measured, not assumed: a loaded machine can leave the cloud a share that rounds to 0, never a negative one
    assert all(r["cloud_cpu_share"] >= 0 and r["edges_cpu_share"] >= 0 for r in rows)
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
    assert report["recorded"]["per_prompt"] and report["projection"]["rounds_basis"] == "recorded"
    assert len(report["projection"]["check"]["points"]) == len(rows)
    assert "Projection" in table and (tmp_path / "projection.png").stat().st_size > 0


# --- the projection: the fleet simulator fitted to a run, on a made-up results.json -------------------------------

TARGET = ForwardModel(100.0, 10.0, 5.0)  # the replica's forwards the made-up run was "measured" with
DRAFT = ForwardModel(20.0, 2.0, 0.0)
PROMPT = 9  # tokens a prompt


def _point(mode: str, edges: int, rtt: float = 0.0, overlap: float = 1.0) -> dict:
    """A results row whose replica metrics and verdicts are TARGET's and DRAFT's times (x overlap: a cloud whose
    two models ran at once), its user figures a guess (the fit does not read them)."""
    drafts, cut = mode in ("cloud-sd", "sd-block", "sprinter-exact"), mode == "sprinter-exact"
    b, per_request = min(edges, 3), (2.5 if cut else 4.0) + 1
    n = b * per_request if drafts and mode != "cloud-sd" else b * 1.0
    row = {"mode": mode, "edges": edges, "rtt_ms": rtt, "generations": edges, "tokens": 8 * edges,
           "tokens_per_s_per_user": 10.0 / edges, "itl_ms_p99": 100.0 * edges, "elapsed_s": 10.0,
           "tokens_per_round": 2.0 if drafts else 1.0, "drafted_per_round": (2.5 if cut else 4.0) if drafts else None,
           "verify_ms_by_batch": {}, "cloud_cpu_share": 1.0,
           "cloud": {"target_forwards": 10, "target_batch_mean": b, "target_tokens_mean": n,
                     "target_forward_ms": TARGET.t_forward_ms(b, n) * overlap,
                     "draft_forwards": 0, "draft_forward_ms": None, "draft_batch_mean": None}}
    if drafts and mode != "cloud-sd":
        row["verify_ms_by_batch"] = {str(b): TARGET.t_forward_ms(b, b * per_request)}
    if mode == "cloud-sd":  # the draft steps and each generation's prompt, in forwards batched as they came
        steps, forwards = 20 * edges + 12, 30 + 5 * edges ** 2
        b_d, n_d = (steps + edges) / forwards, (steps + edges * PROMPT) / forwards
        row["cloud"] |= {"draft_forwards": forwards, "draft_batch_mean": steps / forwards,
                         "draft_forward_ms": DRAFT.t_forward_ms(b_d, n_d) * overlap}
    return row


def _results(modes: tuple[str, ...] = ("target", "cloud-sd", "sd-block", "sprinter-exact"), overlap: float = 1.0) -> dict:
    rounds = [[[3, 4], [1, 4], [5, 4], [2, 4]], [[4, 4], [1, 3]]]  # (kept, drafted): 4 accepted + a bonus; ...
    return {"date": "made up", "args": {"target": "tiny-random", "modes": list(modes), "edges": [1, 2, 4], "k": 4,
                                        "generations": 1, "batch_window_ms": None, "edge_draft_ms": 0.0},
            "edge_draft_ms": 0.0, "itl_p99_target_ms": 250.0,
            "recorded": {"prompts": 2, "rounds": 6, "tokens_per_round": 16 / 6, "acceptance": 10 / 23,
                         "per_prompt": [{"prompt_tokens": PROMPT, "rounds": r} for r in rounds]},
            "rows": [_point(m, e, overlap=overlap if m == "cloud-sd" and e > 1 else 1.0) for m in modes for e in (1, 2, 4)]}


def test_the_fit_recovers_the_forwards_the_run_measured_and_scales_overlapped_ones() -> None:
    for overlap in (1.0, 2.0):  # overlap 2: the point's forwards took twice the core's time; scaled back by half
        results = _results(overlap=overlap)
        for row in results["rows"]:  # the busy share: forwards' time over the point's
            c = row["cloud"]
            busy = c["target_forwards"] * c["target_forward_ms"] + c["draft_forwards"] * (c["draft_forward_ms"] or 0)
            row["elapsed_s"] = busy / 1e3 / (overlap if row["mode"] == "cloud-sd" and row["edges"] > 1 else 1.0)
        costs, fit = fit_costs(results, recorded_rounds(results))
        assert asdict(costs.forward) == pytest.approx(asdict(TARGET), abs=1e-6)
        assert asdict(costs.draft_forward) == pytest.approx(asdict(DRAFT), abs=1e-6)
        assert costs.prompt_tokens == PROMPT and costs.max_batch == 8 and costs.window_ms == 0.0
        assert set(fit["overlap_scaled"]) == ({"cloud-sd E=2 RTT=0", "cloud-sd E=4 RTT=0"} if overlap > 1 else set())


def test_profiles_replay_the_recorded_rounds_as_the_bench_does() -> None:
    rounds = recorded_rounds(_results())
    assert rounds.basis == "recorded" and rounds.generation_tokens == pytest.approx((11 + 5) / 2)
    assert rounds.for_point({"mode": "sd-block", "edges": 3}, 1) == rounds.of_prompts([0, 1, 0])
    by_mode = profiles(["target", "cloud-sd", "sd-block", "sprinter-exact"], rounds.of_prompts([0, 1]))
    assert by_mode["target"].tokens_per_call == 1.0
    assert by_mode["cloud-sd"].block_lengths == by_mode["sd-block"].block_lengths == (4, 4, 4, 4, 4, 3)
    assert by_mode["sprinter-exact"].block_lengths == (3, 1, 4, 2, 4, 1)  # cut after the rejected token
    assert by_mode["sd-block"].emitted == by_mode["sprinter-exact"].emitted == (3, 1, 5, 2, 4, 1)


def test_synthesized_rounds_match_the_mean_they_are_given_and_say_so() -> None:
    rounds = synthetic_rounds(5, 3.5)
    assert statistics.fmean(k for k, _ in rounds) == pytest.approx(3.5, abs=0.02)
    assert all(d == 5 and 1 <= k <= 6 for k, d in rounds)
    old = _results()
    del old["recorded"]["per_prompt"]
    with pytest.raises(ValueError, match="prompts' lengths"):
        recorded_rounds(old)
    assert recorded_rounds(old, [PROMPT, PROMPT]).basis.startswith("SYNTHESIZED")


def test_the_projection_checks_every_measured_point_and_projects_every_mode_and_rtt() -> None:
    results = _results()
    projection = project(results, [1, 2, 4, 8], [0.0, 100.0])
    points = projection["check"]["points"]
    assert [(p["mode"], p["edges"]) for p in points] == [(r["mode"], r["edges"]) for r in results["rows"]]
    assert all(p["simulated_tokens_per_s_per_user"] > 0 and p["simulated_itl_ms_p99"] > 0 for p in points)
    assert projection["check"]["edges_per_replica"]["target"]["measured"] == 2  # 100 ms a user per edge, target 250
    assert {(r["label"], r["rtt_ms"]) for r in projection["rows"]} == {
        (m, t) for m in results["args"]["modes"] for t in (0.0, 100.0)}
    assert all(0 <= r["edges_at_itl"] <= 8 for r in projection["rows"]) and projection["itl"] == "per-token"
    assert projection["projected_max_batch"] == 12
    at_0 = {r["label"]: r for r in projection["rows"] if r["rtt_ms"] == 0.0}
    assert at_0["sd-block"]["tokens_per_s_per_user"][0] > at_0["cloud-sd"]["tokens_per_s_per_user"][0]
    (formula,) = [f for f in projection["formula"] if f["rtt_ms"] == 0.0]  # sprinter-exact's rounds are not cloud-sd's
    assert formula["edge_label"] == "sd-block" and formula["predicted"] > 1
    assert formula["measured"] == 1.0 and formula["saturated_throughput"] > 1  # the made-up rows' ITLs: 2 edges each
    assert [f["measured"] for f in projection["formula"] if f["rtt_ms"] == 100.0] == [None]  # not measured there
    assert "Check" in format_projection(projection)


def test_measured_projects_an_earlier_run_without_a_cloud(tmp_path) -> None:
    results = _results()
    results.update({"itl_p99_target_basis": "made up", "capacity": {}, "cpu": "none",
                    "prediction": {"edge_mode": "sd-block", "cloud_mode": "cloud-sd", "measured_ratio": None}})
    for row in results["rows"]:
        row |= {"itl_ms_p50": 50.0, "acceptance": 0.5}
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps(results))
    table = bench_capacity(CapacityBenchSettings(measured=earlier, project_edges=(1, 4), project_rtts=(0.0,),
                                                 out=tmp_path / "again"))
    written = json.loads((tmp_path / "again" / "results.json").read_text())
    assert written["rows"] == results["rows"] and written["measured_from"] == str(earlier)
    assert written["projection"]["rows"][0]["edges"] == [1, 4] and "Projection" in table
    assert (tmp_path / "again" / "projection.png").stat().st_size > 0
    with pytest.raises(BenchSettingsError, match="--project-edges"):
        bench_capacity(CapacityBenchSettings(measured=earlier, project_edges=(0,), out=tmp_path))
