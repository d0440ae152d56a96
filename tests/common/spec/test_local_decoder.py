"""The local decoder: every lossless mode reproduces the target's greedy output token for token."""

from __future__ import annotations

import pytest

from common.model.prompting import encode_prompt
from common.spec.local_decoder import LocalDecoder
from common.spec.modes import MODES, DecodeSettings
from common.errors import PairMismatch
from common.model.loading import check_pair, load_model
from common.sampling.distributions import SamplingParams
from common.spec.verifier import ConfidenceVerifier

LOSSLESS = ("sd", "sd-block", "sprinter-exact")
TINY_PROMPTS = ("The quick brown fox", "def add(a, b):", "Once upon a time", "x")


def _greedy(engine: LocalDecoder, prompt_ids: list[int], mode: str, **kw) -> list[int]:
    return engine.generate(prompt_ids, DecodeSettings(mode=mode, max_new_tokens=kw.pop("n", 40), **kw)).token_ids


@pytest.mark.parametrize("prompt", TINY_PROMPTS)
@pytest.mark.parametrize("k", [1, 3, 6])
def test_tiny_pair_lossless_modes_equal_target_greedy(tiny_target, tiny_draft, prompt, k):
    engine = LocalDecoder(tiny_target, tiny_draft, ConfidenceVerifier(0.3))
    ids = tiny_target.tokenizer(prompt)["input_ids"]
    reference = _greedy(engine, ids, "target")
    assert len(reference) == 40
    for mode in LOSSLESS:
        assert _greedy(engine, ids, mode, k=k, max_run_length=k + 2) == reference, mode


def test_tiny_pair_has_rejections_and_sprinter_differs(tiny_target, tiny_draft):
    """The test above only means something if the draft is often wrong."""
    engine = LocalDecoder(tiny_target, tiny_draft, ConfidenceVerifier(0.0))  # never flags: sprinter trusts the draft
    ids = tiny_target.tokenizer(TINY_PROMPTS[0])["input_ids"]
    sd = engine.generate(ids, DecodeSettings(mode="sd", max_new_tokens=40, k=4))
    assert 0 < sd.stats.accepted_len_mean < 4
    assert sd.stats.target_calls_per_token > 0.25
    sprinter = engine.generate(ids, DecodeSettings(mode="sprinter", max_new_tokens=40, max_run_length=20))
    assert sprinter.stats.target_calls == 2  # only at the run-length cap
    assert sprinter.token_ids != _greedy(engine, ids, "target")


def test_stats_are_consistent(tiny_target, tiny_draft):
    engine = LocalDecoder(tiny_target, tiny_draft)
    ids = tiny_target.tokenizer("abc")["input_ids"]
    for mode in MODES:
        result = engine.generate(ids, DecodeSettings(mode=mode, max_new_tokens=30,
                                                     sampling=SamplingParams(temperature=1.0, seed=7)))
        s = result.stats
        assert s.new_tokens == len(result.token_ids) == 30
        assert s.tokens_per_s > 0 and s.ttft_ms is not None
        if mode == "draft":
            assert s.target_calls == 0 and s.tokens_per_call is None
        elif mode == "target":
            assert s.target_calls == 30 and s.tokens_per_call == 1.0
        else:
            assert s.target_calls_per_token == pytest.approx(s.target_calls / 30)
            assert s.tokens_per_call == pytest.approx(30 / s.target_calls)
            assert all(0.0 <= r <= 1.0 for r in s.accept_rate_by_position)
            # each call yields its accepted tokens plus one; the last call may be cut at the limit
            assert s.accepted_len_mean * s.target_calls + s.target_calls >= 30


def test_sampling_is_reproducible_with_a_seed(tiny_target, tiny_draft):
    engine = LocalDecoder(tiny_target, tiny_draft)
    ids = tiny_target.tokenizer("seed")["input_ids"]
    settings = DecodeSettings(mode="sd-block", max_new_tokens=25, sampling=SamplingParams(1.0, top_k=50, seed=11))
    assert engine.generate(ids, settings).token_ids == engine.generate(ids, settings).token_ids


def test_pair_with_different_vocabularies_is_refused(tiny_target, smollm2):
    with pytest.raises(PairMismatch, match="different vocabularies"):
        check_pair(smollm2, tiny_target)


def test_layer_spec_is_validated():
    with pytest.raises(ValueError, match="layers"):
        load_model("tiny-random:layers=zero")
    with pytest.raises(ValueError, match="cannot keep"):
        load_model("tiny-random:layers=9")


SMOLLM2_PROMPTS = ("Write a Python function that reverses a string.", "What causes the seasons on Earth?")


@pytest.fixture(scope="module")
def smollm2_greedy(smollm2) -> dict[str, list[int]]:
    """The target's own 24 greedy tokens after each prompt, generated once for both drafts."""
    return {prompt: LocalDecoder(smollm2, None).generate(encode_prompt(smollm2.tokenizer, prompt, chat=True),
                                                         DecodeSettings(mode="target", max_new_tokens=24)).token_ids
            for prompt in SMOLLM2_PROMPTS}


@pytest.mark.smollm2
@pytest.mark.parametrize("draft_name", ["self", "first-4-layers"])
def test_smollm2_lossless_modes_equal_target_greedy(smollm2, smollm2_4_layers, smollm2_greedy, draft_name):
    draft = smollm2 if draft_name == "self" else smollm2_4_layers
    engine = LocalDecoder(smollm2, draft)
    # A self-draft's one prompt shows it all (every token accepted); the 4-layer draft's rejections need both.
    for prompt in SMOLLM2_PROMPTS[:1] if draft_name == "self" else SMOLLM2_PROMPTS:
        ids = encode_prompt(smollm2.tokenizer, prompt, chat=True)
        for mode in LOSSLESS:
            result = engine.generate(ids, DecodeSettings(mode=mode, max_new_tokens=24, k=5))
            assert result.token_ids == smollm2_greedy[prompt], (mode, prompt)
            if draft_name == "self":  # a model always agrees with itself: every draft token is accepted
                assert result.stats.accept_rate_by_position and min(result.stats.accept_rate_by_position) == 1.0
