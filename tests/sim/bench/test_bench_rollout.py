"""`sprinter bench rollout` (sim/bench/rollout.py) at its smallest: simulated edges alone on a real Mosquitto broker,
two config rounds, every edge answering each; and the telemetry pairs' arithmetic, without edge daemons."""

from __future__ import annotations

import json

import pytest
from mosquitto_broker import broker

from common.cli import parse_args
from sim.bench.rollout import RolloutResult, format_table

PNG = b"\x89PNG\r\n\x1a\n"


def test_simulated_edges_ack_every_round(tmp_path, capsys):
    broker(tmp_path / "probe")  # skips (fails, in CI) where Mosquitto is missing; the bench starts its own
    args = parse_args(["bench", "rollout", "--real-edges", "0", "--simulated-edges", "3", "--rounds", "2",
                       "--out", str(tmp_path / "out")])
    assert args.run(args) == 0
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["settings"]["simulated_edges"] == 3 and results["commit"] and results["date"]
    assert [sorted(a["edge_id"] for a in r) for r in results["rounds"]] == [["sim-000", "sim-001", "sim-002"]] * 2
    assert all(a["ok"] and a["latency_ms"] >= 0 for r in results["rounds"] for a in r)
    summary = results["summary"]
    assert summary["acks"] == 6 and summary["refused_or_timed_out"] == 0 and summary["simulated_ack_ms"]["n"] == 6
    assert "real_ack_ms" not in summary and "telemetry" not in summary  # no real edge: no pairs
    assert "| simulated |" in out and "| real |" not in out and "refused or timed out: 0 of 6" in out
    assert (tmp_path / "out" / "table.md").read_text().strip() in out
    assert (tmp_path / "out" / "rollout.png").read_bytes().startswith(PNG)
    assert not list((tmp_path / "out").glob("edge-*.log"))  # no daemon started, not even the control edge


def test_the_telemetry_cost_is_paired_and_the_table_shows_each_kind_of_edge():
    ack = [{"edge_id": "real-0", "ok": True, "latency_ms": 40.0, "reason": None},
           {"edge_id": "sim-000", "ok": True, "latency_ms": 10.0, "reason": None},
           {"edge_id": "sim-001", "ok": False, "latency_ms": None, "reason": "timed out"}]
    result = RolloutResult([ack, ack], {"telemetry": [90.0, 99.0], "none": [100.0, 100.0]})
    summary = result.summary()
    assert summary["edges"] == 3 and summary["acks"] == 6 and summary["refused_or_timed_out"] == 2
    assert summary["real_ack_ms"] == {"p50": 40.0, "p99": 40.0, "max": 40.0, "n": 2}
    assert summary["all_ack_ms"]["n"] == 4 and summary["all_ack_ms"]["p50"] == 40.0  # round(0.5 x 3) = 2, half to even
    telemetry = summary["telemetry"]
    assert telemetry["pairs"] == 2 and telemetry["cost_pct"] == pytest.approx(5.5)  # pairs of 10% and 1%
    table = format_table(summary)
    assert "| real | 40.0 | 40.0 | 40.0 | 2 |" in table and "cost +5.50%" in table and "2 of 6" in table
