"""`sprinter bench policy`: a network sweep per temperature whose methods are the mode with each call policy. The
sweep itself (a `mode@policy` method through the cloud and edge processes) is tests/test_simulate.py's; here the
bench's own part: the sweeps it asks for, its run folder and its table."""

from __future__ import annotations

import json

import pytest

import sim.bench.policy
from common.errors import UsageError
from sim.bench.policy import bench_policy
from sim.bench.settings.sweeps import PolicyBenchSettings
from sim.sweep.report import write_csv


def test_the_bench_runs_a_sweep_per_temperature_and_tables_their_summaries(tmp_path, monkeypatch):
    ran = []

    def sweep(settings):
        ran.append(settings)
        write_csv([], settings.out / "summary.csv")
        (settings.out / "summary.md").write_text(f"| {settings.modes[0]} at T={settings.temperature:g} |\n")

    monkeypatch.setattr(sim.bench.policy, "simulate", lambda settings: (settings.out.mkdir(parents=True), sweep(settings)))
    settings = PolicyBenchSettings(target="tiny-random", draft="tiny-random-draft", policies=("fixed:3", "goodput"),
                                   rtt_ms=(0.0, 20.0), limit=1, max_new_tokens=8, out=tmp_path)
    text = bench_policy(settings)

    assert [(s.out, s.temperature, s.modes, s.rtt_ms, s.fleet_validation) for s in ran] == [
        (tmp_path / f"T{t:g}", t, ("sprinter-exact@fixed:3", "sprinter-exact@goodput"), (0.0, 20.0), False)
        for t in (0.0, 1.0)]
    assert text == (f"T=0 (`{tmp_path}/T0`):\n\n| sprinter-exact@fixed:3 at T=0 |\n\n"
                    f"T=1 (`{tmp_path}/T1`):\n\n| sprinter-exact@fixed:3 at T=1 |")
    report = json.loads((tmp_path / "results.json").read_text())
    assert list(report) == ["date", "machine", "commit", "settings", "sweeps"]
    assert report["sweeps"] == [{"temperature": t, "out": str(tmp_path / f"T{t:g}"), "rows": []} for t in (0.0, 1.0)]
    assert (tmp_path / "table.md").read_text().strip() == text


def test_a_bad_policy_is_refused_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(sim.bench.policy, "simulate", lambda settings: pytest.fail("nothing may run"))
    with pytest.raises(UsageError, match="policy"):
        bench_policy(PolicyBenchSettings(policies=("fixed:3", "sideways"), out=tmp_path))
