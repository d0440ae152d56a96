"""Load and faults against real processes on loopback (tiny pair): short versions of `sprinter bench soak`
and `sprinter bench chaos`, bounded in time and count; their settings' checks, and the identities' fair shares."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from common.cli import parse_args
from common.errors import UsageError
from common.stats import percentile
from sim.bench import registry
from sim.bench.load import RequestOutcome, parse_metrics
from sim.bench.settings.operations import ChaosSettings, SoakSettings
from sim.bench.soak_identities import (identity_problems, identity_summary, identity_table_rows, make_identities,
                                       write_tokens_file)

TINY = ("--target", "tiny-random", "--draft", "tiny-random-draft")


def _parse(*argv: str) -> argparse.Namespace:
    return parse_args(["bench", *argv])


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [2])  # two replicas run the one-replica path twice over
def test_short_soak_has_no_errors_and_keeps_kv_within_budget(tmp_path, capsys, replicas):
    # 2 MiB holds 4k tiny-random tokens (512 B each): 16 sessions of a prompt + up to 160 tokens fit. A budget the
    # busy sessions overflow is refused with RESOURCE_EXHAUSTED and a retry hint since the cloud's hardening
    # (issue 12): back-pressure, which tests/cloud/test_cloud_limits.py covers; this soak asks for no errors.
    args = _parse("soak", *TINY, "--sessions", "16", "--duration-s", "4", "--max-tokens", "64,160",
                  "--kv-budget-mb", "2", "--max-context", "1024", "--sample-s", "0.2", "--replicas", str(replicas),
                  "--out", str(tmp_path))
    code = args.run(args)
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "results.json").read_text())
    summary = result["summary"]
    assert result["problems"] == [], out
    assert code == 0 and "PASS" in out and "KV cache max MiB / budget MiB" in out
    assert summary["requests"] >= 16 and summary["errors"] == 0 and summary["http_5xx"] == 0
    assert summary["replicas"] == replicas and {s["replica"] for s in result["samples"]} == set(range(replicas))
    assert summary["metrics_samples"] >= 3 and summary["kv_cache_bytes_max"] <= summary["kv_budget_bytes"]
    assert summary["cloud_rss_max_bytes"] > 10 << 20 and summary["edge_rss_max_bytes"] > 10 << 20
    requests = result["requests"]
    assert {r["stream"] for r in requests} == {True, False} and len({r["mode"] for r in requests}) >= 4
    assert summary["greedy_checked"] >= 3 and summary["greedy_mismatches"] == 0, summary


@pytest.mark.slow
def test_short_soak_with_two_identities_reports_each_ones_share(tmp_path, capsys):
    # Two tokens, two edges, 2 and 1 workers; --max-sessions 2 below the 3 workers, so the cloud's line takes turns.
    args = _parse("soak", *TINY, "--identities", "2,1", "--duration-s", "5", "--max-tokens", "8,24",
                  "--kv-budget-mb", "2", "--max-context", "1024", "--max-sessions", "2", "--sample-s", "0.2",
                  "--out", str(tmp_path))
    code = args.run(args)
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "results.json").read_text())
    summary = result["summary"]
    assert result["problems"] == [] and code == 0, out
    rows = summary["identities"]
    assert [(r["identity"], r["workers"]) for r in rows] == [("edge-0", 2), ("edge-1", 1)]
    assert all(r["completed"] >= 1 and r["errors"] == 0 and r["tokens"] > 0 for r in rows), rows
    assert all(r["latency_s_p50"] is not None and r["latency_s_p99"] is not None for r in rows)
    assert sum(r["tokens"] for r in rows) == summary["tokens"]
    assert sum(r["tokens_share"] for r in rows) == pytest.approx(1.0)
    assert sum(r["tokens_share_window"] for r in rows) == pytest.approx(1.0)
    assert {r["identity"] for r in result["requests"]} == {"edge-0", "edge-1"}
    assert "edge-1 (1 workers)" in out and (tmp_path / "edge-1.log").exists()


@pytest.mark.slow
def test_short_chaos_over_two_replicas_kills_each_in_turn(tmp_path, capsys):
    args = _parse("chaos", *TINY, "--requests", "9", "--kills", "2", "--max-tokens", "120",
                  "--stagger-s", "0.2", "--kill-after-s", "0.2,0.5", "--replicas", "2", "--out", str(tmp_path))
    code = args.run(args)
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "results.json").read_text())
    summary = result["summary"]
    assert result["problems"] == [] and code == 0, out
    # One run, over two replicas: a kill with one replica (the edge degrades, then recovers) is
    # tests/edge/test_edge.py's test_cloud_killed_mid_generation_degrades_then_recovers.
    assert summary["completed"] == 9 and summary["http_5xx"] == 0 and summary["replicas"] == 2
    assert [k["replica"] for k in result["kills"]] == [0, 1] and summary["cloud_starts"] == 4
    assert summary["edge_alive_same_pid"] and summary["after_recovery_degraded"] == 0
    assert len({k["pid"] for k in result["kills"]}) == 2
    print(f"two replicas: {summary['degraded']} degraded of 9, {summary['in_flight_at_kills']} in flight at kills")


@dataclasses.dataclass(frozen=True)
class NoSettings:
    pass


def failing_bench(settings: NoSettings) -> registry.Verdict:
    return registry.Verdict("| a table |\n\nFAIL\n- what failed", passed=False)


def test_a_failed_run_prints_its_table_and_exits_1(capsys):
    bench = registry.Bench("failing", "", NoSettings, "tests.sim.bench.test_reliability:failing_bench")
    assert registry.run(bench, argparse.Namespace()) == 1
    assert capsys.readouterr().out.startswith("| a table |\n\nFAIL\n- what failed")


def test_chaos_needs_a_request_per_phase():
    with pytest.raises(UsageError, match="at least --kills"):
        ChaosSettings(requests=3, kills=5)


def test_soak_rejects_an_inverted_token_range():
    with pytest.raises(UsageError, match="--max-tokens"):
        SoakSettings(max_tokens=(64, 8))
    assert SoakSettings(max_tokens=(16,)).token_range == (16, 16)


@pytest.mark.parametrize("identities", [(3,), (2, 0)])
def test_soak_wants_two_or_more_positive_identity_worker_counts(identities):
    with pytest.raises(UsageError, match="--identities"):
        SoakSettings(identities=identities)
    with pytest.raises(SystemExit):
        _parse("soak", "--identities", "2,x")
    assert _parse("soak", "--identities", "24,8").identities == (24, 8)


def test_metrics_parsing_and_percentiles():
    text = ('# HELP sprinter_cloud_kv_cache_bytes KV\n# TYPE sprinter_cloud_kv_cache_bytes gauge\n'
            'sprinter_cloud_kv_cache_bytes 1.5e+06\nsprinter_cloud_errors_total{code="NOT_FOUND"} 2.0\n')
    assert parse_metrics(text) == {"sprinter_cloud_kv_cache_bytes": 1.5e6, 'sprinter_cloud_errors_total{code="NOT_FOUND"}': 2.0}
    assert percentile([3, 1, 2, 4], 0.5) == 3 and percentile([3, 1, 2, 4], 0.99) == 4  # round(q (n - 1)): rank 2 of 0..3
    assert percentile([], 0.5) is None


def _outcome(index: int, tokens: int, ended_s: float, ok: bool = True) -> RequestOutcome:
    return RequestOutcome(index, "sd", False, ok, 200 if ok else 503, None, ended_s - 1.0, 1.0, None, tokens)


def test_each_identity_gets_its_share_of_the_tokens_in_the_window_and_overall(tmp_path):
    identities = make_identities([2, 1])
    # edge-0: 30 tokens by t=10 and 30 after; edge-1: 10 tokens by t=10, and one request that failed.
    outcomes = [_outcome(0, 30, 9.0), _outcome(1, 10, 10.0), _outcome(2, 30, 12.0), _outcome(3, 0, 5.0, ok=False)]
    rows = identity_summary(identities, outcomes, {0: 0, 1: 1, 2: 0, 3: 1}, window_end_s=10.0)
    assert [(r["identity"], r["workers"], r["requests"], r["completed"], r["errors"]) for r in rows] == \
        [("edge-0", 2, 2, 2, 0), ("edge-1", 1, 2, 1, 1)]
    assert [(r["tokens"], r["tokens_window"]) for r in rows] == [(60, 30), (10, 10)]
    assert [r["tokens_share_window"] for r in rows] == [0.75, 0.25]
    assert [r["tokens_share"] for r in rows] == pytest.approx([60 / 70, 10 / 70])
    assert identity_problems(rows) == [] and identity_problems([{**rows[1], "completed": 0}]) == \
        ["identity edge-1 completed no request"]
    (name, value), _ = identity_table_rows(rows)
    assert name.startswith("edge-0 (2 workers)") and value == "2, 60, 1.00 / 1.00, 0.750 / 0.857"
    tokens = write_tokens_file(tmp_path, identities)
    assert tokens.stat().st_mode & 0o777 == 0o600
    assert tokens.read_text().splitlines() == [f"{who.name} {who.token}" for who in identities]
    assert len({who.token for who in identities}) == 2
