"""`sprinter bench placement` end to end on the tiny random pair: a cloud process with a draft of its own, three
edges (edge, cloud, auto) behind the link proxy, two RTTs and one point under load with the fleet plane on."""

from __future__ import annotations

import json

import pytest

from common.errors import UsageError
from sim.bench.placement import PLACEMENTS, bench_placement, goal
from sim.bench.settings.sweeps import PlacementBenchSettings


def test_the_bench_measures_every_placement_at_every_rtt_and_under_load(tmp_path):
    settings = PlacementBenchSettings(target="tiny-random", draft="tiny-random-draft", dtype="float32",
                                      rtt_ms=(0.0, 40.0), load_rtt_ms=(40.0,), load_streams=1, prompts=2,
                                      max_new_tokens=8, k=3, warmup=1, out=tmp_path)
    text = bench_placement(settings)

    report = json.loads((tmp_path / "results.json").read_text())
    assert list(report)[:4] == ["date", "machine", "commit", "settings"] and report["settings"]["rtt_ms"] == [0.0, 40.0]
    assert report["draft"] == "onnx-int8"  # the edge's own runtime and weights
    rows = report["rows"]
    assert [(r["rtt_ms"], r["load_streams"], r["placement"]) for r in rows] == [
        (rtt, load, p) for rtt, load in ((0.0, 0), (40.0, 0), (40.0, 1)) for p in PLACEMENTS]
    for row in rows:
        assert row["tokens_per_s"] > 0 and len(row["requests"]) == 2
        assert all(r["tokens"] > 0 for r in row["requests"])
    assert all(set(r["chose"]) == {r["placement"]} for r in rows if r["placement"] != "auto")
    auto = [r for r in rows if r["placement"] == "auto"]
    assert all(sum(r["chose"].values()) == 2 and len(r["learning"]) == 1 for r in auto)
    assert all(req["reason"] in ("faster", "kept", "cloud_busy") for r in auto for req in r["requests"])
    assert [(v["rtt_ms"], v["load_streams"]) for v in report["goal"]] == [(0.0, 0), (40.0, 0), (40.0, 1)]
    assert len(text.splitlines()) == 4 + 3 and "| 40 | 1 |" in text
    assert (tmp_path / "table.md").read_text().strip() == text.strip()
    assert (tmp_path / "tokens_per_s.png").stat().st_size > 0


def test_goal_reads_the_better_fixed_placement_and_the_worse_one_under_load():
    def row(placement, tokens_per_s, load=0, chose=None):
        return {"rtt_ms": 50.0, "load_streams": load, "placement": placement, "tokens_per_s": tokens_per_s,
                "chose": chose or {placement: 2}}
    quiet = goal([row("edge", 10.0), row("cloud", 20.0), row("auto", 19.5, chose={"cloud": 2})])
    assert quiet == [{"rtt_ms": 50.0, "load_streams": 0, "better": "cloud", "auto_share": pytest.approx(0.975),
                      "met": True}]
    loaded = goal([row("edge", 10.0, 3), row("cloud", 5.0, 3), row("auto", 9.9, 3, chose={"edge": 1, "cloud": 1})])
    assert loaded[0]["better"] == "edge" and not loaded[0]["met"]  # within 5%, but a request went to the worse side
    tied = goal([row("edge", 10.0, 3), row("cloud", 9.7, 3), row("auto", 9.8, 3, chose={"cloud": 2})])
    assert tied[0]["met"]  # 3% apart: neither is the worse one beyond noise


def test_bad_settings_are_refused_naming_the_flag():
    with pytest.raises(UsageError, match="--max-new-tokens"):
        PlacementBenchSettings(max_new_tokens=0)
    with pytest.raises(UsageError, match="--rtt-ms"):
        PlacementBenchSettings(rtt_ms=(-1.0,))
    with pytest.raises(UsageError, match="--mode 'target'"):
        PlacementBenchSettings(mode="target")
