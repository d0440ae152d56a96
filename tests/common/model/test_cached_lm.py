"""The greedy text and teacher-forced top-1 helpers over a cached LM (what the export check and the acceptance bench
read a draft by)."""

from __future__ import annotations

from common.model.cached_lm import CachedLM, greedy_continuation, top1_matches
from common.model.loading import LoadedModel


def test_a_model_matches_its_own_greedy_text_everywhere_and_not_a_changed_token(tiny_target: LoadedModel) -> None:
    context = list(range(20, 30))
    text = greedy_continuation(CachedLM(tiny_target.model), context, 8)
    assert text[:10] == context and len(text) == 18
    assert top1_matches(CachedLM(tiny_target.model), text, len(context)) == [True] * 8
    changed = text[:14] + [(text[14] + 1) % tiny_target.model.config.vocab_size] + text[15:]
    assert top1_matches(CachedLM(tiny_target.model), changed, len(context))[4] is False  # position 14, changed
