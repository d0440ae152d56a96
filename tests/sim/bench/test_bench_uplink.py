"""`sprinter bench uplink` end to end on the tiny random pair: a cloud process, the edge here behind the link at
two RTTs, sampled sd with each draft_dists."""

from __future__ import annotations

import json

from sim.bench.settings.sweeps import UplinkBenchSettings
from sim.bench.uplink import bench_uplink


def test_the_bench_measures_each_draft_dists_at_each_rtt(tmp_path):
    settings = UplinkBenchSettings(target="tiny-random", draft="tiny-random-draft", rtt_ms=(0.0, 20.0), prompts=1,
                                   max_tokens=6, k=3, out=tmp_path)
    text = bench_uplink(settings)

    report = json.loads((tmp_path / "results.json").read_text())
    assert list(report) == ["date", "machine", "commit", "settings", "draft", "rows"]
    assert report["draft"] == "onnx-int8"  # the edge's own runtime and weights
    assert report["settings"]["rtt_ms"] == [0.0, 20.0] and report["settings"]["out"] == str(tmp_path)
    rows = report["rows"]
    assert [(r["rtt_ms"], r["draft_dists"]) for r in rows] == [
        (rtt, dists) for rtt in (0.0, 20.0) for dists in ("full", "on-rejection")]
    for row in rows:
        assert 1 <= row["tokens"] <= 6 and row["target_calls"] >= 1 and row["uplink_bytes_per_token"] > 0
    full, on_rejection = rows[0], rows[1]
    assert on_rejection["uplink_bytes_per_token"] < full["uplink_bytes_per_token"]  # the point of on-rejection
    assert full["residual_queries"] == 0
    # the same prompt and seed at either RTT: the same frames, only the time differs
    assert [r["uplink_bytes"] for r in rows[:2]] == [r["uplink_bytes"] for r in rows[2:]]
    lines = text.splitlines()
    assert lines[0].startswith("mode sd, T=1, k=3, tiny-random <- tiny-random-draft (float32), 1 prompts x 6 tokens")
    assert [line.split(" | ")[:3] for line in lines[4:]] == [
        [f"| {r['rtt_ms']:g}", r["draft_dists"], str(r["tokens"])] for r in rows]
    assert (tmp_path / "table.md").read_text().strip() == text.strip()
