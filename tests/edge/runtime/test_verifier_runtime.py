"""Learned verifiers on ONNX Runtime: features, scores, metadata, and refusing another pair's verifier."""

from __future__ import annotations

import json

import pytest
import torch

from common.model.cached_lm import CachedLM
from common.errors import PairMismatch
from common.model.loading import vocab_fingerprint
from common.spec.verifier import DraftStep
from edge.runtime.verifier import LearnedVerifier, load_verifier, step_features

FEATURES = ["hidden", "token_prob", "max_prob", "entropy"]


def _write_verifier(directory, tokenizer, hidden_size: int, draft: str = "tiny-random-draft") -> tuple:
    torch.manual_seed(0)
    linear = torch.nn.Linear(hidden_size + 3, 1)
    model = torch.nn.Sequential(linear, torch.nn.Flatten(0), torch.nn.Sigmoid())
    torch.onnx.export(model, (torch.zeros(1, hidden_size + 3),), str(directory / "verifier.onnx"),
                      input_names=["features"], output_names=["score"], dynamic_axes={"features": {0: "n"}, "score": {0: "n"}},
                      dynamo=False)
    metadata = {"format": "sprinter-verifier/1", "onnx": "verifier.onnx", "features": FEATURES,
                "hidden_size": hidden_size, "threshold": 0.5, "metrics": {"roc_auc": 0.5},
                "pair": {"draft": draft, "target": "tiny-random", "vocab_fingerprint": vocab_fingerprint(tokenizer)}}
    (directory / "verifier.json").write_text(json.dumps(metadata))
    return model, directory / "verifier.json"


def test_learned_verifier_scores_like_its_torch_model(tmp_path, tiny_draft):
    hidden = tiny_draft.model.config.hidden_size
    model, path = _write_verifier(tmp_path, tiny_draft.tokenizer, hidden)
    verifier = load_verifier(str(path), tiny_draft.tokenizer, "tiny-random-draft", "tiny-random")
    assert isinstance(verifier, LearnedVerifier) and verifier.needs_hidden
    lm = CachedLM(tiny_draft.model, with_hidden=True)
    out = lm.advance_to(tiny_draft.tokenizer("hello there")["input_ids"])
    step = DraftStep(int(out.logits[-1].argmax()), out.logits[-1], out.hidden[-1])
    features = torch.from_numpy(step_features(step, tuple(FEATURES)))
    assert features.shape == (hidden + 3,)
    expected = float(model(features[None])[0])
    assert verifier.score(step) == pytest.approx(expected, abs=1e-5)
    assert (verifier.score(step) < verifier.threshold) == (expected < 0.5)  # what drafting flags


def test_verifier_of_another_pair_is_refused(tmp_path, tiny_draft, smollm2):
    _, path = _write_verifier(tmp_path, tiny_draft.tokenizer, tiny_draft.model.config.hidden_size)
    with pytest.raises(PairMismatch, match="vocabulary differs"):
        load_verifier(str(path), smollm2.tokenizer)
    with pytest.raises(PairMismatch, match="target 'tiny-random'"):
        load_verifier(str(path), tiny_draft.tokenizer, "tiny-random-draft", "another-target")


def test_not_a_verifier_file_is_refused(tmp_path, tiny_draft):
    (tmp_path / "x.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not a sprinter verifier"):
        load_verifier(str(tmp_path / "x.json"), tiny_draft.tokenizer)
    with pytest.raises(ValueError, match="unknown verifier"):
        load_verifier("oracle:1", tiny_draft.tokenizer)
