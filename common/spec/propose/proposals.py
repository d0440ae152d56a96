"""Proposals: the tokens a round sends to be verified, and the one seam that proposes them.

What proposes the next tokens is a `Proposer`; the round, the rules and the wire do not care which
(design.md, "Proposals"). Strategies (`--proposer`):
    model    the draft model, one token per forward (common/spec/propose/drafting.py)
    suffix   text the request or the edge has seen before where it matches, the draft model elsewhere
             (common/spec/propose/suffix_proposer.py)

A proposed token carries what the rule and the call policy need: the distribution it was drawn
from (None: a point mass, q(x) = 1, for a token drawn from no distribution), its acceptance
estimate a_i, and its source. The draft's logits and hidden state (`step`) are there only when the
draft model produced the token.

Why the lossless rules stay exact: every rule is exact for any proposal x_i drawn from a distribution
q_i(. | prefix) that the edge tells it. A point mass is such a distribution, and one entry of a
sparse distribution carries it on the wire. Which strategy serves a position is decided from the
context alone (never from the token the draft would sample there), so q_i is a function of the
prefix, as the rules require.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

import torch

from common.spec.call_policy import CallPolicy
from common.spec.cost_model import CostModel
from common.sampling.logits_processing import LogitsProcessor
from common.sampling.logprobs import TokenLogprob, logprobs_of
from common.sampling.distributions import SparseDistribution
from common.sampling.params import SamplingParams
from common.spec.verifier import DraftStep

MODEL, CONTEXT, CACHE = "model", "context", "cache"  # sources: the draft, this request's text, another request's output


@dataclass(frozen=True)
class ProposedToken:
    token: int
    source: str  # MODEL, CONTEXT or CACHE
    p_draft: torch.Tensor | None  # [V] the distribution the token was drawn from; None: a point mass on it
    flagged: bool  # not to be passed unchecked (sprinter): the verifier does not trust it, or it is another's text
    ends_block: bool  # the policy says send, the cap, EOS or the end of a match: the block goes to the target now
    accept_prob: float | None = None  # a_i, what the policy read (None in a block that stands as drafted)
    step: DraftStep | None = None  # token, raw logits, hidden state: the draft's, when the draft produced the token
    fed: int = 0  # tokens the draft's forward fed for it: 1, more when it caught up on kept suffix tokens
    match_length: int = 0  # a copied token's: how many tokens before it agree with where it was copied from

    @property
    def probability(self) -> float:
        """q(x): the probability of the token under the distribution it was drawn from."""
        return 1.0 if self.p_draft is None else float(self.p_draft[self.token])

    @property
    def from_model(self) -> bool:
        return self.source == MODEL

    def sparse(self, max_support: int | None = None) -> SparseDistribution:
        """The distribution the token was drawn from, as the wire carries it: a point mass is one entry."""
        if self.p_draft is None:
            return SparseDistribution(torch.tensor([self.token]), torch.tensor([1.0]))
        return SparseDistribution.from_dense(self.p_draft, max_support)


@dataclass
class PendingBlock:
    """x_1..x_g, proposed after the context, not yet checked by any target."""

    drafted: list[ProposedToken] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return [d.token for d in self.drafted]

    def p_draft(self, vocab_size: int) -> torch.Tensor:
        """[g, V]: row i is the distribution x_i was drawn from (one-hot for a point mass)."""
        rows = [d.p_draft if d.p_draft is not None else torch.zeros(vocab_size) for d in self.drafted]
        if not rows:
            return torch.zeros((0, vocab_size))
        q = torch.stack([r.float() for r in rows])
        for i, d in enumerate(self.drafted):
            if d.p_draft is None:
                q[i, d.token] = 1.0
        return q

    @property
    def accept_probs(self) -> list[float]:
        """a_1..a_g as the policy read them (blocks headed for a target only)."""
        return [d.accept_prob for d in self.drafted if d.accept_prob is not None]

    @property
    def complete(self) -> bool:
        """Its last token ended it (policy, cap or EOS): nothing more is proposed onto it."""
        return bool(self.drafted) and self.drafted[-1].ends_block

    @property
    def model_tokens(self) -> int:
        """Tokens the draft model produced: a draft step each."""
        return sum(d.from_model for d in self.drafted)

    def __len__(self) -> int:
        return len(self.drafted)

    def unverified_prefix(self, released: int = 0) -> PendingBlock:
        """What may stand as drafted when no target is reached: the draft's own tokens up to the first copied one
        (text copied from elsewhere is no model's output), and at least the `released` ones the client has."""
        first = next((i for i, d in enumerate(self.drafted) if not d.from_model), len(self.drafted))
        return PendingBlock(self.drafted[:max(first, released)])

    def draft_logprobs(self, top_n: int | None, first: int = 0) -> list[TokenLogprob] | None:
        """The draft's raw logprobs of tokens[first:] and their top N (for tokens no target to_verify); None when
        the request asks for none. Only the draft's own tokens have them (`unverified_prefix`)."""
        if top_n is None:
            return None
        rows = self.drafted[first:]
        if not rows:
            return []
        if any(d.step is None for d in rows):
            raise ValueError("logprobs of a token the draft did not produce")
        return logprobs_of(torch.stack([d.step.logits for d in rows]), [d.token for d in rows], top_n, "draft")


class DraftModel(Protocol):
    """The draft model behind a proposer (common/spec/propose/drafting.py `ModelProposer`): what grows a draft tree's
    branches (common/spec/tree/branching.py) and guesses the target's next token (edge/decoding/pipeline.py)."""

    eos_token_ids: frozenset[int]
    sampling: SamplingParams
    generator: torch.Generator  # the generation's seeded stream: alternatives are drawn from it
    processor: LogitsProcessor | None  # the request's bias and penalties: alternatives obey them

    @property
    def drafts_side_by_side(self) -> bool:
        """Whether a tree's branches at one point go as rows of one batched forward (`branch_steps`)."""
        ...

    async def step(self, context: list[int], block: PendingBlock, limit: int, policy: CallPolicy | None,
                   cost_model: CostModel | None, to_verify: bool = True) -> ProposedToken:
        """The draft's next token after `context` + `block`."""
        ...

    async def branch_steps(self, context: list[int], branches: list[PendingBlock]) -> list[ProposedToken]:
        """The draft's next token on each branch (one shared prefix, one length), from one batched forward."""
        ...

    async def next_logits(self, context: list[int]) -> torch.Tensor:
        """The draft's raw logits [V] after `context`."""
        ...


class Proposer(Protocol):
    """One generation's source of proposals (see the module docstring)."""

    def propose(self, context: list[int], limit: int, policy: CallPolicy | None, cost_model: CostModel | None,
                to_verify: bool = True, prefix: PendingBlock | None = None) -> AsyncIterator[ProposedToken]:
        """Tokens after `context` (and `prefix`, a block proposed ahead that this one continues) until the block
        ends (`ProposedToken.ends_block`): at most `limit` tokens. `to_verify`: the block goes to a target (else it
        stands as drafted: no scores, and only the draft's own tokens)."""
        ...

    @property
    def draft_model(self) -> DraftModel | None:
        """The draft model behind the proposer, or None: what grows a tree's branches and guesses the next token."""
        ...

    def copy_run(self, context: list[int], drafted: list[int], room: int) -> list[ProposedToken]:
        """A run copied from text seen before, after `context` (the generation's) and `drafted` (a block's tokens
        so far), as a candidate branch of a draft tree: at most `room` tokens; none for a proposer that keeps no
        text (common/spec/tree/copy_branches.py)."""
        ...

    def observe_verdict(self, block: PendingBlock, n_accepted: int) -> None:
        """What the target kept of a block this proposer proposed (a proposer may calibrate its scores on it)."""
        ...

    def observe_output(self, output: list[int]) -> None:
        """A finished generation's output (a proposer may draw on it for later requests)."""
        ...


def ends_block(length: int, token: int, accept_probs: list[float], limit: int, eos_token_ids: frozenset[int],
               policy: CallPolicy | None) -> bool:
    """Whether a block of `length` tokens ending in `token` goes to the target now: the cap, EOS or the policy.
    The limit is checked even with a policy: every policy sends at the cap, but the budget must hold regardless."""
    return (length >= limit or token in eos_token_ids
            or (policy is not None and policy.should_send(accept_probs, cap=limit)))
