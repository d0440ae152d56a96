"""`sprinter bench features` end to end on the tiny random pair: a cloud process and an edge daemon, each feature
against the plain request, greedy."""

from __future__ import annotations

import json

import pytest

from common.errors import UsageError
from sim.bench.features import FEATURES, bench_features
from sim.bench.settings.sweeps import FeaturesBenchSettings


def test_the_bench_measures_every_feature_against_the_plain_request(tmp_path):
    settings = FeaturesBenchSettings(target="tiny-random", draft="tiny-random-draft", dtype="float32",
                                     modes=("sd-block",), prompts=1, repeats=1, max_tokens=6, out=tmp_path)
    text = bench_features(settings)

    report = json.loads((tmp_path / "results.json").read_text())
    assert list(report) == ["date", "machine", "commit", "settings", "grammar_step_us", "runs"]
    assert set(report["grammar_step_us"]) <= {"json_schema", "tool_call"}
    runs = report["runs"]
    assert [(r["mode"], r["feature"], r["prompt"]) for r in runs] == [("sd-block", f, 0) for f in FEATURES]
    assert all(1 <= r["tokens"] <= 6 and r["target_calls"] >= 1 and r["token_ids"] for r in runs)
    plain = runs[0]
    assert runs[2]["token_ids"] == plain["token_ids"]  # logprobs change what comes back, never the greedy tokens
    lines = text.splitlines()
    assert lines[0].startswith("Features against the plain request: target tiny-random, draft tiny-random-draft, "
                               "float32, greedy, 1 prompts x 1 repeats, up to 6 tokens")
    assert [line.split(" | ")[1] for line in lines[4:]] == list(FEATURES)
    assert " | 1.00x | " in lines[4]  # the plain request against itself
    assert (tmp_path / "table.md").read_text().strip() == text.strip()


def test_more_prompts_than_the_bench_has_are_refused_naming_the_flag(tmp_path):
    with pytest.raises(UsageError, match="--prompts"):
        bench_features(FeaturesBenchSettings(prompts=5, out=tmp_path))
