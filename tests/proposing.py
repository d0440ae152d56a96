"""The draft model's proposals, driven inline through the proposer seam: for tests that read the drafted tokens."""

from __future__ import annotations

from common.spec.propose.drafting import LocalDraft, ModelProposer
from common.spec.speculative_round import run_inline


def draft_tokens(draft_lm, context, limit, sampling, generator, eos_token_ids, verifier=None, policy=None,
                 cost_model=None, companion=None) -> list:
    """The draft model's proposals after `context`, through the proposer seam, driven inline."""
    proposer = ModelProposer(LocalDraft(draft_lm), sampling, generator, eos_token_ids, verifier, companion)

    async def collect() -> list:
        return [t async for t in proposer.propose(context, limit, policy, cost_model)]
    return run_inline(collect())
