"""Speculative Verification's companion signals: the features, drafting with a companion, and a learned
verifier on them end to end on the tiny pair (collect -> train companion-mlp -> decode; refused without one)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from cloud.server import CloudSettings
from cloud_harness import ServerThread
from common.model.cached_lm import CachedLM
from common.cli import main
from prompt_files import short_prompt_file
from common.spec.companion import Companion, companion_factory, companion_features, load_companion
from common.spec.local_decoder import LocalDecoder
from common.spec.modes import DecodeSettings
from common.model.loading import LoadedModel
from common.model.presets import build_tiny_tokenizer
from common.sampling.distributions import SamplingParams
from edge.decoding.decoder import EdgeSettings
from edge.node import EdgeNode, EdgeNodeSettings
from proposing import draft_tokens
from edge.verifier_training.collect import load_dataset
from edge.runtime.verifier import LearnedVerifier, load_verifier


# The only other tiny model with the draft's tokenizer is the target itself: as a companion it makes the
# signals unrealistically good, which does not matter for plumbing tests.
PAIR = ["--target", "tiny-random", "--draft", "tiny-random-draft", "--dtype", "float32"]
COMPANION = "tiny-random"


def test_identical_distributions_overlap_fully():
    p = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(0)), dim=-1)
    overlap, ratio = companion_features(p, p.clone(), 7)
    assert overlap == pytest.approx(1.0, abs=1e-6) and ratio == pytest.approx(1.0)


def test_disjoint_distributions_do_not_overlap():
    p_draft = torch.tensor([0.5, 0.5, 0.0, 0.0])
    p_companion = torch.tensor([0.0, 0.0, 0.25, 0.75])
    assert companion_features(p_draft, p_companion, 1) == (0.0, 0.0)


def test_features_by_hand_and_the_ratio_caps_at_one():
    p_draft = torch.tensor([0.6, 0.3, 0.1])
    p_companion = torch.tensor([0.2, 0.3, 0.5])
    overlap, ratio = companion_features(p_draft, p_companion, 0)
    assert overlap == pytest.approx(0.2 + 0.3 + 0.1) and ratio == pytest.approx(0.2 / 0.6)
    assert companion_features(p_draft, p_companion, 2)[1] == 1.0  # 0.5 / 0.1 = 5, capped
    assert companion_features(p_draft, p_companion, 1)[1] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="differ in shape"):
        companion_features(p_draft, p_companion[:2], 0)


def test_drafting_records_the_companion_at_each_tokens_position(tiny_draft, tiny_target):
    ids = tiny_draft.tokenizer("def add(a, b):")["input_ids"]
    drafted = (draft_tokens(CachedLM(tiny_draft.model), ids, 6, SamplingParams(temperature=0.0), torch.Generator(),
                                frozenset(), companion=Companion(CachedLM(tiny_target.model))))
    plain = (draft_tokens(CachedLM(tiny_draft.model), ids, 6, SamplingParams(temperature=0.0), torch.Generator(),
                              frozenset()))
    assert [d.token for d in drafted] == [d.token for d in plain]  # the companion only observes
    assert all(d.step.companion is None for d in plain)
    context = list(ids)
    for d in drafted:  # the companion's distribution before the token, recomputed from scratch
        p_companion = torch.softmax(tiny_target.model(torch.tensor([context])).logits[0, -1].float(), -1)
        expected = companion_features(torch.softmax(d.step.logits.float(), -1), p_companion, d.token)
        assert d.step.companion == pytest.approx(expected, abs=1e-5)
        context.append(d.token)


def test_a_companion_with_another_vocabulary_is_refused(tiny_draft):
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens(["<not-in-the-draft>"])
    other = LoadedModel("other", tiny_draft.model, tokenizer)
    with pytest.raises(ValueError, match="share the draft's tokenizer"):
        load_companion("other", tiny_draft, loaded=(other,))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("companion-verifier")
    prompts = short_prompt_file(out, 12)
    assert main(["verifier", "train", *PAIR, "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "8",
                 "--draft-runtime", "torch", "--epochs", "8", "--companion", COMPANION, "--model", "companion-mlp"]) == 0
    return out


def test_collection_records_the_signals_and_training_exports_them(trained):
    dataset = load_dataset(trained / "data")
    assert dataset.manifest["settings"]["companion"] == COMPANION
    signals = dataset.arrays["companion"]
    assert signals.shape == (len(dataset), 2) and ((signals >= 0) & (signals <= 1)).all()
    metadata = json.loads((trained / "verifier.json").read_text())
    assert metadata["model"] == "companion-mlp" and metadata["companion"] == COMPANION
    assert metadata["features"] == ["token_prob", "max_prob", "entropy", "companion_overlap", "companion_ratio"]
    assert set(metadata["metrics"]) == {"linear", "mlp", "confidence-mlp", "context-mlp", "companion-mlp",
                                        "confidence"}


def test_data_without_a_companion_has_no_signals_and_cannot_train_companion_mlp(tmp_path):
    out = tmp_path / "plain"
    prompts = short_prompt_file(tmp_path, 12)
    with pytest.raises(ValueError, match="collect it with --companion"):
        main(["verifier", "train", *PAIR, "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "4",
              "--draft-runtime", "torch", "--epochs", "2", "--model", "companion-mlp"])
    dataset = load_dataset(out / "data")
    assert "companion" not in dataset.arrays and "companion" not in dataset.manifest["settings"]


def test_companion_verifier_decodes_with_a_companion(trained, tiny_target, tiny_draft):
    verifier = load_verifier(str(trained / "verifier.json"), tiny_draft.tokenizer, "tiny-random-draft", "tiny-random",
                             COMPANION)
    assert isinstance(verifier, LearnedVerifier) and verifier.needs_companion and not verifier.needs_hidden
    engine = LocalDecoder(tiny_target, tiny_draft, verifier, make_companion=companion_factory(tiny_target))
    prompt = tiny_draft.tokenizer("def add(a, b):")["input_ids"]
    reference = LocalDecoder(tiny_target, None).generate(prompt, DecodeSettings(mode="target", max_new_tokens=24))
    exact = engine.generate(prompt, DecodeSettings(mode="sprinter-exact", max_new_tokens=24))
    assert exact.token_ids == reference.token_ids  # float32 + greedy: lossless whatever the verifier says
    assert engine.generate(prompt, DecodeSettings(mode="sprinter", max_new_tokens=24)).stats.new_tokens == 24


def test_companion_verifier_is_refused_without_a_companion(trained, tiny_target, tiny_draft):
    path = str(trained / "verifier.json")
    with pytest.raises(ValueError, match="--companion tiny-random"):
        load_verifier(path, tiny_draft.tokenizer, "tiny-random-draft", "tiny-random")
    with pytest.raises(ValueError, match="trained with companion 'tiny-random'"):
        load_verifier(path, tiny_draft.tokenizer, "tiny-random-draft", "tiny-random", "tiny-random-draft")
    # Loaded past the check, it still names the missing option instead of failing obscurely.
    engine = LocalDecoder(tiny_target, tiny_draft, LearnedVerifier.load(Path(path)))
    with pytest.raises(ValueError, match="--companion SPEC"):
        engine.generate(tiny_draft.tokenizer("abc")["input_ids"], DecodeSettings(mode="sprinter", max_new_tokens=4))
    node = EdgeNode(EdgeNodeSettings(draft=tiny_draft.spec, draft_runtime="torch", dtype="float32", verifier=path),
                    tiny_draft)
    with pytest.raises(ValueError, match="--companion"):
        asyncio.run(node.__aenter__())


def test_edge_runs_the_companion_and_stays_lossless(trained, tiny_target, tiny_draft):
    prompt = tiny_draft.tokenizer("The quick brown fox")["input_ids"]
    reference = LocalDecoder(tiny_target, None).generate(prompt, DecodeSettings(mode="target", max_new_tokens=20))

    async def run():
        settings = EdgeNodeSettings(draft=tiny_draft.spec, cloud=server.address, draft_runtime="torch", dtype="float32",
                                    verifier=str(trained / "verifier.json"), companion=COMPANION)
        async with EdgeNode(settings, tiny_draft) as node:
            assert node.decoder.make_companion is not None
            return [await node.decoder.generate(prompt, EdgeSettings(DecodeSettings(mode=mode, max_new_tokens=20)))
                    for mode in ("sprinter-exact", "sprinter")]

    with ServerThread(CloudSettings(target="tiny-random", batch_window_ms=1), tiny_target) as server:
        exact, approximate = asyncio.run(run())
    assert exact.token_ids == reference.token_ids and not exact.degraded
    assert len(approximate.token_ids) == 20 and not approximate.degraded


def test_a_verifier_without_companion_features_ignores_the_companion(tiny_draft):
    node = EdgeNode(EdgeNodeSettings(draft=tiny_draft.spec, draft_runtime="torch", dtype="float32",
                                     verifier="confidence:0.3", companion=COMPANION), tiny_draft)
    asyncio.run(node.__aenter__())
    assert node.decoder.make_companion is None  # no forward per token for signals nobody reads
