"""Drafting a pending block, one token at a time: the first half of every speculative round.

`draft_tokens` is a generator, so that `Drafter` (what the round calls) decides what happens
between steps: the edge runs each step off its event loop and streams verifier-passed tokens to its
client as they come; the local engine runs them inline. Where the block ends is the call policy's
decision (common/call_policy.py): after each token it sees a_1..a_g, each token's estimated
probability that the target accepts it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from common.cached_lm import DraftLM
from common.call_policy import CallPolicy, CostModel
from common.companion import Companion
from common.logits_processing import LogitsProcessor
from common.logprobs import TokenLogprob, logprobs_of
from common.sampling import SamplingParams, logits_to_probs, sample
from common.verifier import DraftStep, Verifier, draft_confidence_features, reads_history


def next_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> tuple[int, torch.Tensor]:
    """Pick a token from logits [V]; also return the distribution it was picked from."""
    probs = logits_to_probs(logits, sampling)
    # Greedy: the argmax directly; multinomial over a one-hot of 150k entries costs milliseconds.
    return (int(probs.argmax()) if sampling.greedy else sample(probs, generator)), probs


@dataclass(frozen=True)
class DraftedToken:
    step: DraftStep  # token, raw logits, hidden state: what the verifier judged
    p_draft: torch.Tensor  # [V] the distribution the token was sampled from
    flagged: bool  # the verifier does not trust it (score < threshold)
    ends_block: bool  # the policy says send, the cap or EOS: the block goes to the target now
    accept_prob: float | None = None  # a_i, what the policy read (None in a block that stands as drafted)

    @property
    def token(self) -> int:
        return self.step.token


@dataclass
class PendingBlock:
    """x_1..x_g, drafted after the context, not yet checked by any target."""

    drafted: list[DraftedToken] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return [d.token for d in self.drafted]

    @property
    def p_draft(self) -> torch.Tensor:
        """[g, V]: row i is the distribution x_i was drawn from."""
        return torch.stack([d.p_draft for d in self.drafted])

    @property
    def accept_probs(self) -> list[float]:
        """a_1..a_g as the policy read them (blocks headed for a target only)."""
        return [d.accept_prob for d in self.drafted if d.accept_prob is not None]

    @property
    def complete(self) -> bool:
        """Its last token ended it (policy, cap or EOS): nothing more is drafted onto it."""
        return bool(self.drafted) and self.drafted[-1].ends_block

    def __len__(self) -> int:
        return len(self.drafted)

    def draft_logprobs(self, top_n: int | None, first: int = 0) -> list[TokenLogprob] | None:
        """The draft's raw logprobs of tokens[first:] and their top N (for tokens no target judged); None when
        the request asks for none."""
        if top_n is None:
            return None
        rows = self.drafted[first:]
        if not rows:
            return []
        return logprobs_of(torch.stack([d.step.logits for d in rows]), [d.token for d in rows], top_n, "draft")


def draft_tokens(draft_lm: DraftLM, context: list[int], limit: int, sampling: SamplingParams,
                 generator: torch.Generator, eos_token_ids: frozenset[int], verifier: Verifier | None = None,
                 policy: CallPolicy | None = None, cost_model: CostModel | None = None,
                 companion: Companion | None = None, prefix: PendingBlock | None = None,
                 processor: LogitsProcessor | None = None) -> Iterator[DraftedToken]:
    """Draft after `context` (and `prefix`, a block drafted ahead that this one continues) until `policy.should_send(a_1..a_g, cap=limit)`, EOS, or `limit` tokens.

    a_i is the verifier's score (the learned verifier's is a calibrated acceptance probability), else
    the draft's probability of its token at T=1 (not the sampling distribution's: under greedy that
    is one-hot). Without a policy the block runs to `limit` or EOS. `cost_model`, when given, learns
    the time of a draft step: forward, sampling and scoring, all that one more token costs the edge.
    `companion`, when given, adds its (S, A) features to every step (so its forward counts as drafting cost).
    """
    block: list[int] = prefix.tokens if prefix is not None else []
    accept_probs: list[float] = prefix.accept_probs if prefix is not None else []
    previous = _last_confidence(prefix) if reads_history(verifier) else None
    while len(block) < limit:
        started = time.perf_counter()
        out = draft_lm.advance_to(context + block)
        # the request's bias and penalties shape the proposals as they shape the target in the rule
        logits = processor.next_row(out.logits[-1], context + block) if processor is not None else out.logits[-1]
        token, p_draft = next_token(logits, sampling, generator)
        signals = companion.features(context + block, out.logits[-1], token) if companion is not None else None
        block.append(token)
        step = DraftStep(token, out.logits[-1], out.hidden[-1] if out.hidden is not None else None, signals, previous)
        if reads_history(verifier):
            token_prob, _, entropy = draft_confidence_features(step)
            previous = (token_prob, entropy)
        score = verifier.score(step) if verifier is not None else None
        flagged = score is not None and score < verifier.threshold
        accept_prob = None
        if policy is not None:
            accept_prob = score if score is not None else draft_confidence_features(step)[0]
            accept_probs.append(accept_prob)
        if cost_model is not None:
            cost_model.observe_draft_step((time.perf_counter() - started) * 1e3)
        # The limit is checked here too: every policy sends at the cap, but the budget must hold regardless.
        ends_block = (len(block) >= limit or token in eos_token_ids
                      or (policy is not None and policy.should_send(accept_probs, cap=limit)))
        yield DraftedToken(step, p_draft, flagged, ends_block, accept_prob)
        if ends_block:
            return


def _last_confidence(prefix: PendingBlock | None) -> tuple[float, float] | None:
    if prefix is None or not prefix.drafted:
        return None
    token_prob, _, entropy = draft_confidence_features(prefix.drafted[-1].step)
    return token_prob, entropy


@dataclass
class Drafter:
    """One generation's drafting: the draft runtime (its own KV cache), the sampler, and the verifier.

    `offload` runs each draft step in a worker thread, so an event loop serving other requests
    (the edge daemon) stays responsive; the local engine runs steps inline. The verifier and the
    companion judge tokens only in blocks headed for a target (`judged`): a block that stands as
    drafted needs no scores.
    """

    draft_lm: DraftLM
    sampling: SamplingParams
    generator: torch.Generator  # shared with the local target: one seeded stream per generation
    eos_token_ids: frozenset[int]
    verifier: Verifier | None = None
    companion: Companion | None = None
    offload: bool = False
    processor: LogitsProcessor | None = None  # the request's logit_bias and penalties (common/logits_processing.py)

    async def draft(self, context: list[int], limit: int, policy: CallPolicy | None, cost_model: CostModel | None,
                    judged: bool = True, on_passed: Callable[[DraftedToken], None] | None = None,
                    prefix: PendingBlock | None = None) -> PendingBlock:
        """A pending block after `context` (see `draft_tokens`), continuing `prefix` if given; `on_passed` sees
        each token that does not end it."""
        block = PendingBlock(list(prefix.drafted)) if prefix is not None else PendingBlock()
        if block.complete:
            return block
        steps = self.steps(context, limit, policy if judged else None, cost_model, judged, prefix)
        while (drafted := await self.next_step(steps)) is not None:
            block.drafted.append(drafted)
            if on_passed is not None and not drafted.ends_block:
                on_passed(drafted)
        return block

    def steps(self, context: list[int], limit: int, policy: CallPolicy | None, cost_model: CostModel | None,
              judged: bool = True, prefix: PendingBlock | None = None) -> Iterator[DraftedToken]:
        """The drafting steps themselves, for a caller that decides between them (edge/decoding/pipeline.py)."""
        return draft_tokens(self.draft_lm, context, limit, self.sampling, self.generator, self.eos_token_ids,
                            self.verifier if judged else None, policy, cost_model,
                            self.companion if judged else None, prefix, self.processor)

    async def next_step(self, steps: Iterator[DraftedToken]) -> DraftedToken | None:
        return await asyncio.to_thread(next, steps, None) if self.offload else next(steps, None)
