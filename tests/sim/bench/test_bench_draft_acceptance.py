"""`sprinter bench draft-acceptance`: the calls greedy speculation makes along a text, and the bench's table and
results on the tiny-random pair (never a claim about a format's quality: random weights)."""

from __future__ import annotations

import json

import pytest

from common.cli import main
from sim.bench.draft_acceptance import calls_along, paired_interval


@pytest.mark.parametrize("matches, k, calls", [
    ([], 5, 0),
    ([True] * 10, 5, 2),  # 5 kept + the target's 6th, then 4 kept to the end
    ([False] * 3, 5, 3),  # the target's token, each call
    ([True, True, False, True], 5, 2),  # 2 kept + the correction, then 1 kept
    ([True] * 5 + [False], 5, 1),  # the block is full: the 6th is the target's own token of that call
])
def test_a_call_keeps_the_matched_run_up_to_the_block_then_the_targets_token(matches, k, calls) -> None:
    assert calls_along(matches, k) == calls


def test_the_interval_resamples_prompts_for_both_formats_together() -> None:
    assert paired_interval([10, 20, 30], [10, 20, 30]) == (0.0, 0.0)
    assert paired_interval([10, 20, 30], [20, 40, 60]) == (-0.5, -0.5)  # twice the calls on every prompt
    reference, calls = [12, 9, 15, 11, 10, 14], [13, 9, 17, 11, 12, 14]
    low, high = paired_interval(reference, calls)
    assert low < sum(reference) / sum(calls) - 1 < high <= 0  # never more calls than the reference
    assert paired_interval(reference, calls) == (low, high)  # seeded


def test_every_format_is_scored_along_one_target_text(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("SPRINTER_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    argv = ["bench", "draft-acceptance", "--target", "tiny-random", "--draft", "tiny-random-draft", "--dtype",
            "float32", "--weights", "float32,int8", "--per-category", "1", "--max-tokens", "6", "--out", str(out)]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    rows = {row["weights"]: row for row in results["summary"]}
    assert list(rows) == ["float32", "int8"]
    assert rows["float32"]["positions"] == rows["int8"]["positions"] == 6 * len(
        json.loads((out / "targets.json").read_text())["continuations"])
    for row in rows.values():
        assert 0 <= row["agreement"] <= 1 and 1 <= row["tokens_per_call"] <= 6
        assert sum(row["calls_per_prompt"]) == row["calls"] and row["interval"][0] <= row["interval"][1]
    assert "| float32 |" in capsys.readouterr().out
    assert main(argv) == 0  # the target's continuations are read back, not generated again


def test_an_unknown_format_is_refused_by_name(capsys) -> None:
    assert main(["bench", "draft-acceptance", "--weights", "int8,int3"]) == 2
    assert "--weights must name formats of" in capsys.readouterr().err
