"""`sprinter simulate`: a tiny sweep through the real cloud and edge processes over the link emulator,
watched on the fleet plane (a Mosquitto of its own when installed)."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from mosquitto_broker import broker

import sim.broker
import sim.sweep.run
from sim.sweep.command import register, settings_from_args
from sim.sweep.report import read_csv
from sim.sweep.settings import SimulateSettings
from sim.sweep.simulate import check_out_dir, simulate
from sim.sweep.telemetry import sweep_broker
from sim.sweep.telemetry_plot import phase_spans, plot_telemetry

PLOTS = ("tokens_per_s_vs_rtt.png", "target_calls_per_token.png", "quality_vs_cloud_cost.png", "itl_cdf.png")


def tiny_settings(out: Path) -> SimulateSettings:
    # float32: the lossless modes then reproduce the target token for token (docs/getting-started.md, Exactness);
    # mqtt auto (the default): with Mosquitto installed the sweep records the fleet plane. 16 tokens: the
    # 40 ms phases then take over 4 s (a round trip per call), so the cloud's 2 s load reports land in them.
    return SimulateSettings(out=out, target="tiny-random", draft="tiny-random-draft", dtype="float32",
                            modes=("target", "sd", "sprinter-exact", "sprinter-exact@fixed:3", "cloud-sd"),
                            rtt_ms=(0.0, 40.0), limit=2, max_new_tokens=16)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> SimulateSettings:
    settings = tiny_settings(tmp_path_factory.mktemp("sweep"))
    simulate(settings, progress=False)
    return settings


@pytest.mark.slow
def test_a_tiny_sweep_writes_results_summary_and_plots(sweep: SimulateSettings) -> None:
    results = lines(sweep.out / "results.jsonl")
    assert len(results) == 2 * 5 * 2  # rtt x method x prompt
    assert {(r["rtt_ms"], r["mode"]) for r in results} == {(rtt, m) for rtt in (0.0, 40.0) for m in sweep.modes}
    for r in results:
        assert r["completion_tokens"] >= 1 and r["wall_ms"] > 0 and r["ttft_ms"] > 0
        assert r["degraded"] is False
        assert r["sprinter"]["mode"] == r["mode"].partition("@")[0] and "stats" in r["sprinter"]
        if r["mode"] == "sprinter-exact@fixed:3":  # a method: the mode with the call policy it names
            assert r["sprinter"]["policy"] == "fixed:3" and max(r["sprinter"]["stats"]["block_lengths"]) <= 3
    rows = read_csv(sweep.out / "summary.csv")
    assert len(rows) == 10
    for row in rows:
        assert row.tokens_per_s > 0 and row.target_nll_per_token > 0 and row.degraded == 0
        assert row.itl_ms_p50 is not None and row.ttft_ms_p50 is not None
        if row.mode == "target":
            assert row.target_calls_per_token == 1.0
        else:  # the oracle bound comes from the run's own acceptance record
            assert 0 < row.oracle_calls_per_token <= 1
        # lossless at T=0 in float32: token for token the target's output
        assert row.exact_match_rate == 1.0 and row.agreement_with_target == 1.0, row
    summary = (sweep.out / "summary.md").read_text()
    assert "| 40 | sprinter-exact |" in summary and "sprinter-exact/sd" in summary
    for name in PLOTS:
        assert (sweep.out / name).stat().st_size > 1000
    assert "within" in (sweep.out / "fleet_validation.md").read_text()


@pytest.mark.slow
def test_the_sweep_records_the_fleet_plane_and_plots_it(sweep: SimulateSettings, tmp_path: Path) -> None:
    broker(tmp_path)  # without Mosquitto the sweep ran without a broker: skip (fail under SPRINTER_REQUIRE_PRESETS)
    assert (sweep.out / "broker" / "mosquitto.conf").exists()  # auto: the sweep's own broker
    recorded = lines(sweep.out / "telemetry.jsonl")
    edge = [m for m in recorded if m["schema"] == "sprinter.edge.telemetry/1"]
    cloud = [m for m in recorded if m["schema"] == "sprinter.cloud.load/1"]
    assert {m["edge_id"] for m in edge} == {"sim-edge"} and {m["replica_id"] for m in cloud} == {"sim-cloud"}
    phases = {(rtt, m) for rtt in sweep.rtt_ms for m in sweep.modes} | {(None, None)}
    assert {(m["rtt_ms"], m["mode"]) for m in recorded} <= phases
    # every message is labelled; some arrived while a method was measured (reports come every 1-2 s)
    assert any(m["mode"] is not None for m in edge) and any(m["mode"] is not None for m in cloud)
    assert any(m["tokens_per_s"] > 0 for m in edge) and cloud[0]["model_id"]
    assert (sweep.out / "telemetry.png").stat().st_size > 1000


@pytest.mark.slow
def test_a_longer_round_trip_makes_every_call_slower(sweep: SimulateSettings) -> None:
    results = lines(sweep.out / "results.jsonl")

    def ms_per_call(rtt: float, mode: str) -> float:
        group = [r for r in results if r["rtt_ms"] == rtt and r["mode"] == mode]
        return sum(r["wall_ms"] for r in group) / sum(r["sprinter"]["target_calls"] for r in group)

    for mode in ("sd", "sprinter-exact"):
        # each call pays the 40 ms round trip (and each request one more, to open its session)
        assert ms_per_call(40.0, mode) > ms_per_call(0.0, mode) + 30, mode


@pytest.mark.slow
def test_a_finished_sweep_reruns_without_measuring(sweep: SimulateSettings, monkeypatch) -> None:
    before = (sweep.out / "results.jsonl").read_text()

    def no_processes(*args, **kwargs):
        raise AssertionError("every combination is done: nothing should start")

    monkeypatch.setattr(sim.sweep.run, "SweepSystem", no_processes)
    simulate(sweep, progress=False)
    assert (sweep.out / "results.jsonl").read_text() == before


@pytest.mark.slow
def test_an_interrupted_sweep_measures_only_what_is_missing(sweep: SimulateSettings, tmp_path: Path) -> None:
    settings = replace(sweep, out=tmp_path, fleet_validation=False)
    kept = (sweep.out / "results.jsonl").read_text().splitlines(keepends=True)[:-1]
    (tmp_path / "results.jsonl").write_text("".join(kept) + '{"rtt_ms": 40.0, "mode": "sprin')  # killed mid-write
    (tmp_path / "config.json").write_text((sweep.out / "config.json").read_text())
    simulate(settings, progress=False)
    results = (tmp_path / "results.jsonl").read_text().splitlines(keepends=True)
    assert results[:-1] == kept  # done lines untouched, the partial one dropped
    assert len(results) == 2 * len(sweep.modes) * 2
    assert json.loads(results[-1])["mode"] == sweep.modes[-1]


@pytest.fixture(scope="module")
def pipelined_sweep(tmp_path_factory) -> SimulateSettings:
    # One RTT, one prompt: target (once, off) and a lossless mode with and without send-ahead.
    settings = replace(tiny_settings(tmp_path_factory.mktemp("pipelined")), modes=("target", "sd-block"),
                       pipeline=("off", "send-ahead"), rtt_ms=(40.0,), limit=1, mqtt="off", fleet_validation=False)
    simulate(settings, progress=False)
    return settings


@pytest.mark.slow
def test_a_pipelined_sweep_measures_each_pipeline_of_a_lossless_mode(pipelined_sweep: SimulateSettings) -> None:
    results = lines(pipelined_sweep.out / "results.jsonl")
    assert sorted((r["mode"], r["pipeline"]) for r in results) == [
        ("sd-block", "off"), ("sd-block", "send-ahead"), ("target", "off")]  # target is not run per pipeline
    for r in results:
        assert r["sprinter"]["stats"]["pipeline"] == r["pipeline"] and not r["degraded"]
    rows = {(row.mode, row.pipeline): row for row in read_csv(pipelined_sweep.out / "summary.csv")}
    assert set(rows) == {("target", "off"), ("sd-block", "off"), ("sd-block", "send-ahead")}
    ahead = rows[("sd-block", "send-ahead")]
    assert ahead.ahead_hit_rate is not None and 0 <= ahead.ahead_hit_rate <= 1
    assert ahead.uplink_bytes_per_token > 0 and ahead.candidate_hits >= 0
    assert rows[("sd-block", "off")].ahead_hit_rate is None
    assert all(row.exact_match_rate == 1.0 for row in rows.values())  # send-ahead is lossless too
    summary = (pipelined_sweep.out / "summary.md").read_text()
    assert "| 40 | sd-block | resident (float32) | send-ahead |" in summary and "ahead hit rate" in summary
    assert "(sd-block/send-ahead)/sd" not in summary  # no sd in this sweep: no ratio to it


@pytest.mark.slow
def test_a_pipelined_sweep_resumes_without_redoing_either_pipeline(pipelined_sweep: SimulateSettings,
                                                                    tmp_path: Path, monkeypatch) -> None:
    def no_processes(*args, **kwargs):
        raise AssertionError("every (mode, pipeline) is done: nothing should start")

    monkeypatch.setattr(sim.sweep.run, "SweepSystem", no_processes)
    simulate(pipelined_sweep, progress=False)
    # rows from before the pipeline axis have no "pipeline": they count as off
    old = [{k: v for k, v in r.items() if not (k == "pipeline" and v == "off")}
           for r in lines(pipelined_sweep.out / "results.jsonl")]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    (tmp_path / "config.json").write_text((pipelined_sweep.out / "config.json").read_text())
    simulate(replace(pipelined_sweep, out=tmp_path), progress=False)
    assert len(lines(tmp_path / "results.jsonl")) == 3
    assert {(r.mode, r.pipeline) for r in read_csv(tmp_path / "summary.csv")} == {
        ("target", "off"), ("sd-block", "off"), ("sd-block", "send-ahead")}


def test_the_pipeline_axis_runs_pipelined_modes_only(tmp_path: Path) -> None:
    settings = SimulateSettings.from_mapping({"out": str(tmp_path), "modes": "target,sd,sprinter,sprinter-exact@fixed:3",
                                              "pipeline": ["off", "ahead", "send-ahead"]})
    assert settings.runs() == [("target", "off"), ("sd", "off"), ("sd", "ahead"), ("sd", "send-ahead"),
                               ("sprinter", "off"), ("sprinter-exact@fixed:3", "off"),
                               ("sprinter-exact@fixed:3", "ahead"), ("sprinter-exact@fixed:3", "send-ahead")]
    assert "pipeline" not in settings.identity()  # another pipeline adds runs to OUT, like another mode
    with pytest.raises(ValueError, match="pipeline"):
        SimulateSettings(out=tmp_path, pipeline=("sideways",))
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    flags = settings_from_args(parser.parse_args(["simulate", "--out", str(tmp_path), "--pipeline", "off,send-ahead"]))
    assert flags.pipeline == ("off", "send-ahead") and SimulateSettings(out=tmp_path).pipeline == ("off",)


def test_resuming_with_other_result_settings_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"identity": tiny_settings(tmp_path).identity()}))
    with pytest.raises(ValueError, match="temperature"):
        simulate(replace(tiny_settings(tmp_path), temperature=1.0), progress=False)


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "sweep.json"
    config.write_text(json.dumps({"out": str(tmp_path / "out"), "rtt-ms": [0, 25], "modes": "sd,sprinter",
                                  "max_new_tokens": 16, "pin_cpus": False}))
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    settings = settings_from_args(parser.parse_args(["simulate", "--config", str(config), "--max-new-tokens", "32"]))
    assert settings.rtt_ms == (0.0, 25.0) and settings.modes == ("sd", "sprinter")
    assert settings.max_new_tokens == 32 and settings.pin_cpus is False and settings.limit == 8
    with pytest.raises(ValueError, match="unknown setting"):
        SimulateSettings.from_mapping({"out": "x", "rtts": "0"})


def test_the_broker_setting_is_a_flag_and_no_part_of_a_result(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    settings = settings_from_args(parser.parse_args(["simulate", "--out", str(tmp_path), "--mqtt", "off"]))
    assert settings.mqtt == "off" and tiny_settings(tmp_path).mqtt == "auto"
    with pytest.raises(ValueError, match="broker URL"):
        SimulateSettings(out=tmp_path, mqtt="tcp://host")
    remote = SimulateSettings(out=tmp_path, mqtt="mqtt://user:secret@broker.example:1884")
    assert "mqtt" not in remote.identity() and remote.to_dict()["mqtt"] == "mqtt://broker.example:1884"
    assert "secret" not in repr(remote)
    check_out_dir(tiny_settings(tmp_path))
    check_out_dir(replace(tiny_settings(tmp_path), mqtt="off"))  # resuming with another broker is allowed


def test_without_mosquitto_auto_warns_and_runs_without_a_broker(tmp_path: Path, monkeypatch, caplog) -> None:
    def missing() -> str:
        raise FileNotFoundError("mosquitto is not installed")

    monkeypatch.setattr(sim.broker, "mosquitto_binary", missing)
    with caplog.at_level(logging.WARNING), sweep_broker("auto", tmp_path / "broker") as url:
        assert url is None
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and "mosquitto" in caplog.text
    with sweep_broker("off", tmp_path) as url:
        assert url is None


def test_telemetry_plots_with_phase_spans_and_nothing_without_data(tmp_path: Path) -> None:
    assert plot_telemetry(tmp_path) is None and not (tmp_path / "telemetry.png").exists()
    recorded = []
    for i, (rtt, mode) in enumerate([(None, None), (0.0, "sd"), (0.0, "sd"), (40.0, "sprinter"), (None, None)]):
        recorded.append({"received": 100.0 + i, "rtt_ms": rtt, "mode": mode, "schema": "sprinter.edge.telemetry/1",
                         "tokens_per_s": 10.0 * i, "target_calls_per_token": 0.5})
        recorded.append({"received": 100.5 + i, "rtt_ms": rtt, "mode": mode, "schema": "sprinter.cloud.load/1",
                         "open_sessions": 1, "queue_depth": 0, "verify_ms_p50": None if i == 0 else 2.0})
    spans = phase_spans(recorded, 100.0)
    assert [(s.start, s.end, s.rtt_ms, s.mode) for s in spans] == [(1.0, 3.0, 0.0, "sd"), (3.0, 4.0, 40.0, "sprinter")]
    (tmp_path / "telemetry.jsonl").write_text("".join(json.dumps(m) + "\n" for m in recorded) + '{"rec')  # cut short
    assert plot_telemetry(tmp_path) == tmp_path / "telemetry.png"
    assert (tmp_path / "telemetry.png").stat().st_size > 1000


def test_the_real_cli_namespace_makes_settings(tmp_path):
    """What `sprinter simulate` gets from common/cli.py (argv included) is accepted (it once was refused)."""
    from common.cli import parse_args
    settings = settings_from_args(parse_args(["simulate", "--out", str(tmp_path), "--rtt-ms", "0,50", "--mqtt", "off"]))
    assert settings.rtt_ms == (0.0, 50.0) and settings.out == tmp_path
