"""`sprinter bench fleet` on the tiny random pair: two replicas both used by the edges' ReplicaSet, and the
fleet simulator's projection over the whole replicas x edges grid, and again from the written measurements."""

from __future__ import annotations

import json
from dataclasses import replace

from sim.bench.fleet import bench_fleet, projection_table
from sim.bench.settings.capacity import FleetBenchSettings

REPLICAS = (1, 2, 4, 8, 16, 32, 64)
EDGES = (10, 100, 1000, 10000)


def test_two_replicas_two_edges_measured_and_projected(tmp_path):
    settings = FleetBenchSettings(target="tiny-random", draft="tiny-random-draft", dtype="float32", edges=2,
                                  rounds=6, rounds_per_session=2, layouts=("two-replicas",), tokens_per_request=16,
                                  out=tmp_path)
    table = bench_fleet(settings)

    report = json.loads((tmp_path / "results.json").read_text())
    [row] = report["measured"]
    assert row["replicas"] == 2 and row["verify_calls"] == 12
    assert row["verified_tokens_per_s"] > 0 and row["emitted_tokens_per_s"] > 0
    # three generations per edge, each a session the ReplicaSet placed: both replicas got sessions and verifies
    assert sum(row["sessions_placed"].values()) == 6
    assert len(row["calls_per_replica"]) == 2 and all(n > 0 for n in row["calls_per_replica"].values())
    assert all(c["forwards"] > 0 for c in row["cloud"])  # each replica's own metrics saw the forwards
    assert row["forward_samples"] and row["forward_fit"]["c0_ms"] >= 0

    projection = report["projection"]
    assert {(r["n_replicas"], r["n_edges"]) for r in projection["results"]} == {(m, n) for m in REPLICAS for n in EDGES}
    assert all(r["fleet_tokens_per_s"] > 0 for r in projection["results"])
    assert [v["layout"] for v in projection["validation"]] == ["two-replicas"]
    grid = projection_table(projection)
    assert grid.splitlines()[0] == "| edges \\ replicas | " + " | ".join(map(str, REPLICAS)) + " |"
    assert [line.split("|")[1].strip() for line in grid.splitlines()[2:]] == [str(n) for n in EDGES]
    assert grid in table and "two-replicas" in table
    assert (tmp_path / "table.md").read_text().strip() == table.strip()
    assert (tmp_path / "projection.png").stat().st_size > 0

    # projecting again from the written measurements (other assumptions, no processes) keeps the measured rows
    again = bench_fleet(replace(settings, rtt_ms=100.0, replicas=(1, 2), fleet_edges=(10,),
                                measured=tmp_path / "results.json", out=tmp_path / "again"))
    reprojected = json.loads((tmp_path / "again" / "results.json").read_text())
    assert reprojected["measured"] == report["measured"] and reprojected["measured_date"] == report["date"]
    assert reprojected["projection"]["costs"]["rtt"]["mean_ms"] > projection["costs"]["rtt"]["mean_ms"]
    assert projection_table(reprojected["projection"]) in again
