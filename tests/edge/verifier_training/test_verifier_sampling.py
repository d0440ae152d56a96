"""Verifiers for sampling (T > 0): the soft label, the pick by temperature, the warning on a mismatch,
the free features, the learning-curve study, and the shipped verifiers' metadata."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from common.cli import main
from common.spec.acceptance_rules import token_verify
from common.spec.verifier import DraftStep, verifier_for
from edge.verifier_training.collect import load_dataset
from edge.verifier_training.features import feature_column, labels_for, soft_label
from edge.runtime.verifier import (FREE_FEATURES, SHIPPED_DIR, LearnedVerifier, TemperatureMatched, load_verifier,
                                   step_features)
from prompt_files import short_prompt_file

PAIR = ["--target", "tiny-random", "--draft", "tiny-random-draft", "--dtype", "float32"]
TRAIN = ["--draft-runtime", "torch", "--epochs", "4", "--threads", "1", "--max-new-tokens", "12"]


def test_the_soft_label_is_the_probability_that_speculative_sampling_accepts_the_token():
    generator = torch.Generator().manual_seed(0)
    p_draft = torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]])
    p_target = torch.tensor([[0.2, 0.3, 0.5], [0.2, 0.3, 0.5]])  # row 2 only completes the shapes
    token = torch.tensor([0])  # over-drafted: accepted with probability 0.2 / 0.5
    accepted = sum(token_verify(token, p_draft[:1], p_target, generator)[0] for _ in range(4000)) / 4000
    expected = float(soft_label(np.array([0.5]), np.array([0.2]))[0])
    assert expected == pytest.approx(0.4)
    assert accepted == pytest.approx(expected, abs=3 * np.sqrt(0.4 * 0.6 / 4000))
    assert soft_label(np.array([0.2, 0.3]), np.array([0.5, 0.3])).tolist() == [1.0, 1.0]  # never over-drafted


@pytest.fixture(scope="module")
def sampled_and_greedy(tmp_path_factory) -> dict[str, Path]:
    """A greedy and a sampled (T=1) verifier for the tiny pair, context-mlp: every free feature."""
    root = tmp_path_factory.mktemp("regimes")
    prompts = short_prompt_file(root, 24)
    made = {}
    for name, temperature in (("greedy", "0"), ("sampling", "1")):
        out = root / f"tiny-random-draft__tiny-random__{name}"
        assert main(["verifier", "train", *PAIR, *TRAIN, "--prompts", str(prompts), "--out", str(out),
                     "--temperature", temperature, "--model", "context-mlp"]) == 0
        made[name] = out
    return made


def test_a_sampled_collection_trains_on_the_soft_label_and_says_its_temperature(sampled_and_greedy):
    metadata = json.loads((sampled_and_greedy["sampling"] / "verifier.json").read_text())
    assert metadata["label"] == "soft" and metadata["temperature"] == 1.0
    assert metadata["features"] == ["token_prob", "max_prob", "entropy", *FREE_FEATURES]
    data = load_dataset(sampled_and_greedy["sampling"] / "data")
    targets = labels_for(data, "auto")
    assert np.allclose(targets, np.minimum(1, data.arrays["p_target"] / data.arrays["p_draft"]), atol=1e-6)
    assert ((targets > 0) & (targets < 1)).any()  # probabilities, not events
    greedy = json.loads((sampled_and_greedy["greedy"] / "verifier.json").read_text())
    assert greedy["label"] == "greedy" and greedy["temperature"] == 0.0


def test_auto_picks_the_verifier_trained_for_the_requested_temperature(sampled_and_greedy, tiny_draft, monkeypatch):
    shipped = sampled_and_greedy["greedy"].parent
    monkeypatch.setattr("edge.runtime.verifier.SHIPPED_DIR", shipped)
    verifier = load_verifier("auto", tiny_draft.tokenizer, "tiny-random-draft", "tiny-random")
    assert isinstance(verifier, TemperatureMatched)
    assert verifier_for(verifier, 0.0).trained_temperature == 0.0
    assert verifier_for(verifier, 0.7).trained_temperature == 1.0
    assert verifier.needs_history  # the drafter records the previous token's features for it


def test_a_verifier_of_the_other_regime_scores_with_one_warning(sampled_and_greedy, tiny_draft, caplog):
    greedy = LearnedVerifier.load(sampled_and_greedy["greedy"] / "verifier.json")
    with caplog.at_level(logging.WARNING, logger="common.spec.verifier"):
        assert verifier_for(greedy, 1.0) is greedy
        verifier_for(greedy, 0.8)
        assert verifier_for(greedy, 0.0) is greedy  # its own regime: silent
    warnings = [r for r in caplog.records if "trained on greedy data" in r.getMessage()]
    assert len(warnings) == 1 and "T=1" in warnings[0].getMessage()


def test_free_features_at_the_edge_equal_the_training_columns(sampled_and_greedy, tiny_draft):
    """The edge computes margin, prev_token_prob and entropy_delta from a DraftStep as training read them."""
    data = load_dataset(sampled_and_greedy["greedy"] / "data")
    columns = {name: feature_column(data, name) for name in FREE_FEATURES}
    second = int(np.flatnonzero(data.arrays["position"] == 1)[0])  # a token with a previous one in its prompt
    assert columns["prev_token_prob"][second] == pytest.approx(data.arrays["confidence"][second - 1, 0])
    first = int(np.flatnonzero(data.arrays["position"] == 0)[0])
    assert columns["prev_token_prob"][first] == data.arrays["confidence"][first, 0] and columns["entropy_delta"][first] == 0
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    step = DraftStep(0, logits, None, previous=(0.25, 1.5))
    features = dict(zip(FREE_FEATURES, step_features(step, FREE_FEATURES)))
    p = torch.softmax(logits, dim=-1)
    entropy = float(-(p * p.log()).sum())
    assert features["margin"] == pytest.approx(float(p[0] - p[1]), abs=1e-6)
    assert features["prev_token_prob"] == pytest.approx(0.25)
    assert features["entropy_delta"] == pytest.approx(entropy - 1.5, abs=1e-6)


def test_the_study_writes_a_learning_curve_and_an_ablation(sampled_and_greedy, tmp_path):
    assert main(["verifier", "study", "--data", str(sampled_and_greedy["greedy"] / "data"), "--out", str(tmp_path),
                 "--epochs", "2"]) == 0
    study = json.loads((tmp_path / "study.json").read_text())
    tokens = sorted({p["train_tokens"] for p in study["learning_curve"]})
    assert len(tokens) >= 3 and {p["kind"] for p in study["learning_curve"]} >= {"linear", "confidence-mlp"}
    assert [r["added"] for r in study["ablation"]] == ["-", *FREE_FEATURES, "all free"]
    assert (tmp_path / "learning_curve.png").stat().st_size > 0


def test_the_edge_ships_a_greedy_and_a_sampling_verifier():
    assert {p.parent.name.endswith("__sampling") for p in SHIPPED_DIR.glob("*/verifier.json")} == {False, True}


@pytest.mark.parametrize("path", sorted(SHIPPED_DIR.glob("*/verifier.json")), ids=lambda p: p.parent.name)
def test_shipped_verifiers_say_the_pair_and_regime_they_were_trained_for(path):
    metadata = json.loads(path.read_text())
    verifier = LearnedVerifier.load(path)
    assert metadata["pair"]["draft"] and metadata["pair"]["target"] and (path.parent / metadata["onnx"]).exists()
    assert metadata["label"] == ("greedy" if verifier.trained_temperature == 0 else "soft")


def test_a_temperature_matched_pair_decodes_with_history_features(sampled_and_greedy, tiny_target, tiny_draft,
                                                                 monkeypatch):
    from common.model.cached_lm import CachedLM
    from common.spec.local_decoder import LocalDecoder
    from common.spec.modes import DecodeSettings
    from common.sampling.distributions import SamplingParams

    monkeypatch.setattr("edge.runtime.verifier.SHIPPED_DIR", sampled_and_greedy["greedy"].parent)
    verifier = load_verifier("auto", tiny_draft.tokenizer, "tiny-random-draft", "tiny-random")
    engine = LocalDecoder(tiny_target, tiny_draft, verifier, lambda hidden: CachedLM(tiny_draft.model, with_hidden=hidden))
    prompt = tiny_draft.tokenizer("def add(a, b):")["input_ids"]
    exact = engine.generate(prompt, DecodeSettings(mode="sprinter-exact", max_new_tokens=20))
    reference = LocalDecoder(tiny_target, None).generate(prompt, DecodeSettings(mode="target", max_new_tokens=20))
    assert exact.token_ids == reference.token_ids
    sampled = engine.generate(prompt, DecodeSettings(mode="sprinter", max_new_tokens=20,
                                                     sampling=SamplingParams(temperature=1.0, seed=3)))
    assert sampled.stats.new_tokens == 20


def test_bound_picks_the_cheapest_threshold_that_meets_the_quality_on_calibration_prompts(sampled_and_greedy, tmp_path):
    from edge.verifier_training.quality_bound import QualityBound

    verifier = sampled_and_greedy["greedy"] / "verifier.json"
    prompts = sampled_and_greedy["greedy"].parent / "prompts.jsonl"
    assert main(["verifier", "bound", *PAIR, "--prompts", str(prompts), "--verifier", str(verifier), "--out",
                 str(tmp_path), "--bound", "agreement:0.5", "--limit", "2", "--max-new-tokens", "8",
                 "--draft-runtime", "torch", "--threads", "1"]) == 0
    report = json.loads((tmp_path / "bound.json").read_text())
    swept = [r for r in report["calibration"] if r["mode"] == "sprinter"]
    meeting = [r for r in swept if r["agreement_with_target"] >= 0.5]
    assert report["threshold"] == min(meeting, key=lambda r: r["target_calls_per_token"])["threshold"]
    assert [r["mode"] for r in report["held_out"]] == ["target", "sd", "sprinter"]
    assert report["held_out"][1]["agreement_with_target"] == 1.0  # sd: lossless
    with pytest.raises(ValueError, match="agreement:A or nll:R"):
        QualityBound.parse("quality:0.9")


def test_collection_keeps_a_token_budget_and_splits_shards_between_workers(tmp_path, tiny_target, tiny_draft):
    from common.model.cached_lm import CachedLM
    from common.lab.prompt_sets import load_prompts
    from edge.verifier_training.collect import CollectSettings, collect, collected_tokens

    prompts = load_prompts()[:8]
    settings = CollectSettings(max_new_tokens=6, shard_size=2, draft_runtime="torch")
    make_lm = lambda with_hidden: CachedLM(tiny_draft.model, with_hidden=with_hidden)  # noqa: E731
    collect(tiny_target, tiny_draft, make_lm, prompts, tmp_path / "odd", settings, worker=(1, 2))
    assert sorted(p.name for p in (tmp_path / "odd").glob("shard-*.npz")) == ["shard-00001.npz", "shard-00003.npz"]
    collect(tiny_target, tiny_draft, make_lm, prompts, tmp_path / "budget", settings, max_tokens=1)
    assert len(list((tmp_path / "budget").glob("shard-*.npz"))) == 1  # the budget is checked before each shard
    collect(tiny_target, tiny_draft, make_lm, prompts, tmp_path / "budget", settings, max_tokens=13)
    assert collected_tokens(tmp_path / "budget") >= 13 and len(list((tmp_path / "budget").glob("shard-*.npz"))) < 4


def test_workers_fill_one_directory_from_the_command_line(tmp_path):
    prompts = short_prompt_file(tmp_path, 32)  # two shards of 16: one per worker
    assert main(["verifier", "collect", *PAIR, "--prompts", str(prompts), "--data", str(tmp_path / "data"),
                 "--max-new-tokens", "4", "--draft-runtime", "torch", "--workers", "2"]) == 0
    assert sorted(p.name for p in (tmp_path / "data").glob("shard-*.npz")) == ["shard-00000.npz", "shard-00001.npz"]
    assert len(load_dataset(tmp_path / "data")) > 0


def test_replay_reads_the_sampled_verifiers_held_out_traces_from_the_command_line(sampled_and_greedy, tmp_path):
    verifier = sampled_and_greedy["sampling"]
    assert main(["verifier", "replay", "--data", str(verifier / "data"), "--verifier", str(verifier / "verifier.json"),
                 "--out", str(tmp_path), "--rtt-ms", "0,100", "--draft-ms", "40", "--verify-ms", "700",
                 "--verify-per-token-ms", "40", "--seeds", "2"]) == 0
    report = json.loads((tmp_path / "replay.json").read_text())
    held_out = json.loads((verifier / "verifier.json").read_text())["training"]["held_out_prompt_ids"]
    assert report["traces"] == len(held_out) and report["tokens"] > 0
    policies = {r["policy"] for r in report["rows"] if r["rtt_ms"] == 100}
    assert {"hindsight oracle", "goodput", "goodput exact-a", "fixed:5"} <= policies
    assert (tmp_path / "replay.png").stat().st_size > 0 and "hindsight" in (tmp_path / "replay.md").read_text()
