"""`sprinter bench pipeline` on a made-up sweep: the hit rates it reads per (mode, pipeline), the off records it
replays, and the table and files it writes (its smallest scenario: 4 edges, 1 replica, two RTTs)."""

from __future__ import annotations

import json

import pytest

from common.errors import UsageError
from sim.bench.pipeline import bench_pipeline, sweep_inputs
from sim.bench.settings.capacity import PipelineBenchSettings

PIPELINES = ("off", "ahead", "send-ahead")


def _sweep(folder) -> None:
    """A sweep's results.jsonl: two pipelined modes each with every pipeline, and a mode that does not pipeline."""
    folder.mkdir()
    stats = {"block_lengths": [4, 4, 3, 4], "accepted_lengths": [2, 4, 0, 1], "ahead_hits": 3, "candidate_hits": 2,
             "ahead_rounds": 4}
    rows = [{"mode": m, "pipeline": p, "sprinter": {"stats": stats}} for m in ("sd-block", "sprinter-exact")
            for p in PIPELINES] + [{"mode": "target", "pipeline": "off", "sprinter": {"stats": {}}}]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_sweeps_records_and_hit_rates_projected_to_a_fleet(tmp_path) -> None:
    _sweep(tmp_path / "sweep")
    profiles, hit_rates = sweep_inputs(tmp_path / "sweep")
    assert [p.mode for p in profiles] == ["sd-block", "sprinter-exact"]  # target does not pipeline
    assert profiles[0].block_lengths == (4, 4, 3, 4) and profiles[0].emitted == (3, 5, 1, 2)
    assert hit_rates == {(m, p): rate for m in ("sd-block", "sprinter-exact")
                         for p, rate in (("ahead", 0.75), ("send-ahead", 0.5))}

    settings = PipelineBenchSettings(sweep=tmp_path / "sweep", edges=4, replicas=1, rtt_ms=(0.0, 50.0),
                                     tokens_per_request=16, out=tmp_path / "out")
    table = bench_pipeline(settings)
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert report["settings"]["edges"] == 4 and report["costs_note"].startswith("ASSUMED")
    rows = report["rows"]
    assert [(r["rtt_ms"], r["mode"], r["pipeline"]) for r in rows] == [
        (t, m, p) for t in (0.0, 50.0) for m in ("sd-block", "sprinter-exact") for p in PIPELINES]
    assert all(r["tokens_per_s"] > 0 and 0 < r["cloud_utilisation"] <= 1 for r in rows)
    lines = [line for line in table.splitlines() if line.startswith("| 0 |") or line.startswith("| 50 |")]
    assert len(lines) == len(rows) and all(" | 1.00x | " in line for line in lines if "| off |" in line)
    assert (tmp_path / "out" / "table.md").read_text().strip() == table.strip()
    assert (tmp_path / "out" / "pipeline.png").stat().st_size > 0


def test_a_missing_sweep_is_refused_by_its_flag(tmp_path) -> None:
    for sweep in (None, tmp_path):
        with pytest.raises(UsageError, match="--sweep"):
            bench_pipeline(PipelineBenchSettings(sweep=sweep, out=tmp_path / "out"))
