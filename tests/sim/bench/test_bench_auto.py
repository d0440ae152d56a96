"""`sprinter bench auto` (sim/bench/auto.py) on its smallest scenario: the tiny pair in float32 behind a real cloud
and link, every method at one RTT; each method's greedy output is the target's, whatever auto chose."""

from __future__ import annotations

import json

from sim.bench.auto import METHODS, bench_auto
from sim.bench.settings.sweeps import AutoBenchSettings


def test_bench_auto_times_every_method_and_auto_matches_the_targets_output(tmp_path):
    settings = AutoBenchSettings(target="tiny-random", draft="tiny-random-draft", dtype="float32",
                                 draft_runtime="torch", verifier="confidence:0.3", baseline="off", rtt_ms=(50.0,), passes=1,
                                 prompts=1, max_new_tokens=8, out=tmp_path)
    text = bench_auto(settings)
    assert "| 50 |" in text and "auto / best" in text
    report = json.loads((tmp_path / "results.json").read_text())
    assert {"date", "machine", "commit", "settings", "rows", "requests"} <= set(report)
    assert report["draft"] == "torch-float32" and "draft torch-float32" in text  # what this test's edge ran
    (row,) = report["rows"]
    assert set(row["tokens_per_s"]) == set(METHODS) and sum(row["auto_chose"].values()) == 1
    assert 0 <= row["auto_switched"] <= 1
    timed = [r for r in report["requests"] if r["pass"] == 0]
    assert {r["method"] for r in timed} == set(METHODS)
    assert len({tuple(r["token_ids"]) for r in timed}) == 1  # lossless: the same greedy tokens in every method
