"""The verifier pipeline end to end on the tiny pair: collect -> train -> calibrate -> export -> edge."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from common.cli import main
from prompt_files import short_prompt_file
from common.spec.local_decoder import LocalDecoder
from common.spec.modes import DecodeSettings
from common.lab.prompt_sets import load_prompts
from edge.runtime.draft import exported_draft
from edge.verifier_training.collect import CollectSettings, collect, load_dataset
from edge.verifier_training.metrics import evaluate_scores, roc_auc, threshold_for_fpr
from edge.runtime.verifier import LearnedVerifier, load_verifier

PAIR = ["--target", "tiny-random", "--draft", "tiny-random-draft", "--dtype", "float32"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """One training run shared by the tests below (a few seconds)."""
    out = tmp_path_factory.mktemp("verifier")
    prompts = short_prompt_file(out, 40)
    assert main(["verifier", "train", *PAIR, "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "16",
                 "--draft-weights", "float32", "--epochs", "8", "--threads", "1", "--model", "mlp"]) == 0
    return out


def test_train_writes_the_edge_format_with_metrics(trained):
    metadata = json.loads((trained / "verifier.json").read_text())
    assert metadata["format"] == "sprinter-verifier/1"
    assert metadata["pair"]["draft"] == "tiny-random-draft" and metadata["pair"]["target"] == "tiny-random"
    assert metadata["features"] == ["hidden", "token_prob", "max_prob", "entropy"]
    assert metadata["draft_runtime"] == "onnx-float32" and metadata["label"] == "greedy"
    for kind in ("linear", "mlp", "confidence-mlp", "confidence"):
        test = metadata["metrics"][kind]["test"]
        assert 0.0 <= test["roc_auc"] <= 1.0 and set(test["tpr_at_fpr"]) == {"0.01", "0.02", "0.05", "0.1"}
    # The threshold holds the requested false-positive rate on the prompts it was calibrated on.
    assert metadata["metrics"]["mlp"]["calibration"]["verifier_fpr"] <= 0.05
    assert metadata["training"]["held_out_prompt_ids"]
    assert (trained / "metrics.md").read_text().startswith("| verifier |")
    assert (trained / "reliability.png").stat().st_size > 0


def test_split_is_by_prompt(trained):
    dataset = load_dataset(trained / "data")
    held_out = set(json.loads((trained / "verifier.json").read_text())["training"]["held_out_prompt_ids"])
    ids = [dataset.prompts[i].id for i in dataset.arrays["prompt_index"]]
    test_tokens = sum(i in held_out for i in ids)
    assert 0 < test_tokens < len(ids)


def test_trained_verifier_loads_in_the_edge_and_decodes(trained, tiny_target, tiny_draft):
    verifier = load_verifier(str(trained / "verifier.json"), tiny_draft.tokenizer, "tiny-random-draft", "tiny-random")
    assert isinstance(verifier, LearnedVerifier) and verifier.needs_hidden
    onnx_model = exported_draft(tiny_draft, threads=1)
    engine = LocalDecoder(tiny_target, tiny_draft, verifier, lambda with_hidden: onnx_model.new_lm(with_hidden))
    prompt = tiny_draft.tokenizer("def add(a, b):")["input_ids"]
    exact = engine.generate(prompt, DecodeSettings(mode="sprinter-exact", max_new_tokens=24))
    reference = LocalDecoder(tiny_target, None).generate(prompt, DecodeSettings(mode="target", max_new_tokens=24))
    assert exact.token_ids == reference.token_ids  # float32 + greedy: lossless whatever the verifier says
    assert engine.generate(prompt, DecodeSettings(mode="sprinter", max_new_tokens=24)).stats.new_tokens == 24


def test_scores_are_calibrated_probabilities_on_data(trained):
    metadata = json.loads((trained / "verifier.json").read_text())
    for row in metadata["reliability"]:
        assert 0.0 <= row["predicted"] <= 1.0 and 0.0 <= row["observed"] <= 1.0


def test_eval_reports_every_method(trained):
    out = trained / "eval"
    assert main(["verifier", "eval", *PAIR, "--prompts", str(trained / "prompts.jsonl"), "--verifier",
                 str(trained / "verifier.json"), "--out", str(out), "--max-new-tokens", "12", "--limit", "2",
                 "--draft-weights", "float32", "--threads", "1"]) == 0
    result = json.loads((out / "eval.json").read_text())
    methods = {r["method"] for r in result["rows"]}
    assert {"target", "sd k=5", "sprinter learned@FPR0.05", "sprinter confidence:0.5",
            "sprinter-exact learned@FPR0.05"} <= methods
    rows = {r["method"]: r for r in result["rows"]}
    assert rows["target"]["agreement_with_target"] == 1.0 and rows["target"]["target_calls_per_token"] == 1.0
    assert rows["sd k=5"]["agreement_with_target"] == 1.0  # float32 greedy: lossless
    assert rows["sprinter-exact learned@FPR0.05"]["agreement_with_target"] == 1.0
    assert (out / "tradeoff.png").stat().st_size > 0


def test_collection_resumes_and_refuses_other_settings(tmp_path, tiny_target, tiny_draft):
    prompts = load_prompts()[:6]
    settings = CollectSettings(max_new_tokens=8, shard_size=2, draft_runtime="torch")
    from common.model.cached_lm import CachedLM

    make_lm = lambda with_hidden: CachedLM(tiny_draft.model, with_hidden=with_hidden)  # noqa: E731
    collect(tiny_target, tiny_draft, make_lm, prompts, tmp_path, settings)
    first = load_dataset(tmp_path)
    (tmp_path / "shard-00001.npz").unlink()  # as if interrupted before the second shard
    collect(tiny_target, tiny_draft, make_lm, prompts, tmp_path, settings)
    again = load_dataset(tmp_path)
    for key in first.arrays:
        np.testing.assert_array_equal(first.arrays[key], again.arrays[key])
    assert sorted(set(again.arrays["prompt_index"])) == list(range(6))
    with pytest.raises(ValueError, match="other models, prompts or settings"):
        collect(tiny_target, tiny_draft, make_lm, prompts, tmp_path, CollectSettings(max_new_tokens=9, shard_size=2))


def test_labels_match_their_definitions(tmp_path, tiny_target, tiny_draft):
    from common.model.cached_lm import CachedLM

    prompts = load_prompts()[:2]
    collect(tiny_target, tiny_draft, lambda with_hidden: CachedLM(tiny_draft.model, with_hidden=with_hidden), prompts, tmp_path,
            CollectSettings(max_new_tokens=8, temperature=1.0))
    data = load_dataset(tmp_path).arrays
    assert data["hidden"].shape[1] == tiny_draft.model.config.hidden_size
    assert ((data["p_draft"] > 0) & (data["p_draft"] <= 1)).all() and ((data["p_target"] >= 0) & (data["p_target"] <= 1)).all()
    assert data["on_path"].any()


def test_metrics_against_definitions():
    rng = np.random.default_rng(0)
    labels = rng.random(2000) < 0.7
    scores = np.where(labels, rng.normal(0.6, 0.2, 2000), rng.normal(0.4, 0.2, 2000)).astype(np.float32)
    pos, neg = scores[labels], scores[~labels]
    brute = (pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean()
    assert roc_auc(scores, labels) == pytest.approx(brute, abs=1e-9)
    for max_fpr in (0.01, 0.05, 0.2):
        threshold = threshold_for_fpr(scores, labels, max_fpr)
        assert (neg >= threshold).mean() <= max_fpr
        assert (neg >= np.nextafter(threshold, np.float32(-1), dtype=np.float32)).mean() > max_fpr - 1 / len(neg) - 1e-9
    assert evaluate_scores(scores, labels.astype(np.float32), 0.5)["base_rate"] == pytest.approx(labels.mean())
    assert np.isnan(roc_auc(scores, np.ones(len(scores))))  # one class only: undefined, not a number
