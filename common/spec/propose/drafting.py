"""The draft model as a proposer (`--proposer model`): one token per forward, the first half of a speculative round.

`ModelProposer` is what every drafting site runs: the local decoder and the edge over a `DraftLM`
(`LocalDraft`; the edge runs each forward off its event loop so that it keeps serving other requests),
and the cloud's cloud-sd rounds over its batched draft engine (cloud/cloud_sd.py). Where the block
ends is the call policy's decision (common/spec/call_policy.py): after each token it sees a_1..a_g, each
token's estimated probability that the target accepts it.

`Drafter` is one generation's proposer as the round uses it (common/spec/speculative_round.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol

import torch

from common.model.cached_lm import DraftLM, ForwardOutput, common_prefix_length, shared_prefix
from common.spec.call_policy import CallPolicy
from common.spec.cost_model import CostModel
from common.spec.companion import Companion
from common.spec.propose.proposals import MODEL, PendingBlock, ProposedToken, Proposer, ends_block
from common.sampling.logits_processing import LogitsProcessor
from common.sampling.distributions import SamplingParams, logits_to_probs, sample
from common.spec.verifier import DraftStep, Verifier, draft_confidence_features, reads_history, teach_verdict


def next_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> tuple[int, torch.Tensor]:
    """Pick a token from logits [V]; also return the distribution it was picked from."""
    probs = logits_to_probs(logits, sampling)
    # Greedy: the argmax directly; multinomial over a one-hot of 150k entries costs milliseconds.
    return (int(probs.argmax()) if sampling.greedy else sample(probs, generator)), probs


@dataclass(frozen=True)
class DraftRow:
    """The draft's output after a context: raw logits [V] and hidden state [H], or (a greedy cloud draft that reads
    nothing more) its argmax alone."""

    logits: torch.Tensor | None
    hidden: torch.Tensor | None = None
    argmax: int | None = None


class DraftForward(Protocol):
    batches: bool  # it can also draft a tree's branches at one point side by side (`BatchedDraftForward.batch`)

    async def __call__(self, context: list[int]) -> DraftRow:
        """The draft's row after `context`; its KV follows `context`, feeding what it lacks in one forward."""
        ...


class BatchedDraftForward(DraftForward, Protocol):
    """A forward that can also draft a tree's branches at one point side by side (`batches` true)."""

    async def batch(self, contexts: list[list[int]]) -> list[DraftRow]:
        """The draft's rows after each of `contexts` (one shared prefix, one length) in one batched forward."""
        ...


@dataclass
class LocalDraft:
    """A `DraftLM` in this process; `offload` runs its forwards in a worker thread (the edge's event loop)."""

    draft_lm: DraftLM
    offload: bool = False

    async def __call__(self, context: list[int]) -> DraftRow:
        out: ForwardOutput = (await asyncio.to_thread(self.draft_lm.advance_to, context) if self.offload
                              else self.draft_lm.advance_to(context))
        return DraftRow(out.logits[-1], out.hidden[-1] if out.hidden is not None else None)

    @property
    def batches(self) -> bool:
        return getattr(self.draft_lm, "batches", False)

    async def batch(self, contexts: list[list[int]]) -> list[DraftRow]:
        logits = (await asyncio.to_thread(self.draft_lm.advance_batch, contexts) if self.offload
                  else self.draft_lm.advance_batch(contexts))
        return [DraftRow(row) for row in logits]


@dataclass
class ModelProposer:
    """Proposals from the draft model (see the module docstring). The verifier and the companion judge tokens only
    in blocks headed for a target (`to_verify`): a block that stands as drafted needs no scores."""

    forward: DraftForward
    sampling: SamplingParams
    generator: torch.Generator  # shared with the local target: one seeded stream per generation
    eos_token_ids: frozenset[int]
    verifier: Verifier | None = None
    companion: Companion | None = None
    processor: LogitsProcessor | None = None  # the request's logit_bias and penalties (common/sampling/logits_processing.py)
    offload: bool = False  # judge (sample, score) in a worker thread, as the forward
    held: list[int] | None = None  # the context of the last forward: what the draft's KV holds

    async def propose(self, context: list[int], limit: int, policy: CallPolicy | None, cost_model: CostModel | None,
                      to_verify: bool = True, prefix: PendingBlock | None = None) -> AsyncIterator[ProposedToken]:
        """Draft after `context` + `prefix` until the policy sends, EOS, or `limit` tokens. Without a policy the
        block runs to `limit` or EOS. `cost_model`, when given, learns the time of a draft step: forward, sampling
        and scoring, all that one more token costs the edge (a companion's forward counts as drafting cost)."""
        block = PendingBlock(list(prefix.drafted)) if prefix is not None else PendingBlock()
        while len(block) < limit and not block.complete:
            proposed = await self.step(context, block, limit, policy if to_verify else None, cost_model, to_verify)
            block.drafted.append(proposed)
            yield proposed

    async def step(self, context: list[int], block: PendingBlock, limit: int, policy: CallPolicy | None,
                   cost_model: CostModel | None, to_verify: bool = True) -> ProposedToken:
        """The draft's token after `context` + `block`, judged and placed by the policy (a_i: the verifier's score,
        else the draft's probability of its token at T=1, not the sampling distribution's: one-hot when greedy)."""
        started = time.perf_counter()
        full = context + block.tokens
        fed = len(full) - min(self._kept(full), len(full) - 1)
        self.held = full
        row = await self.forward(full)
        if self.offload:
            step, p_draft, score = await asyncio.to_thread(self._judge, full, row, block, to_verify)
        else:
            step, p_draft, score = self._judge(full, row, block, to_verify)
        token = step.token if step is not None else int(row.argmax)
        verifier = self.verifier if to_verify else None
        flagged = score is not None and score < verifier.threshold
        accept_prob = None
        accept_probs = block.accept_probs
        if policy is not None:
            accept_prob = score if score is not None else draft_confidence_features(step)[0]
            accept_probs.append(accept_prob)
        if cost_model is not None:
            cost_model.observe_draft_step((time.perf_counter() - started) * 1e3)
        ends = ends_block(len(block) + 1, token, accept_probs, limit, self.eos_token_ids, policy)
        return ProposedToken(token, MODEL, p_draft, flagged, ends, accept_prob, step, fed)

    async def branch_steps(self, context: list[int], branches: list[PendingBlock]) -> list[ProposedToken]:
        """The draft's next token on each branch after `context` (one shared prefix, one length), from one batched
        forward (`BatchedDraftForward`); unjudged, as a branch's tokens are. Drawn in the branches' order."""
        fulls = [context + branch.tokens for branch in branches]
        rows = await self.forward.batch(fulls)
        self.held = fulls[0][:shared_prefix(fulls)]  # what the draft's own KV keeps: the branch point's prefix
        proposed = []
        for full, row, branch in zip(fulls, rows, branches):
            step, p_draft, _ = self._judge(full, row, branch, to_verify=False)
            proposed.append(ProposedToken(step.token, MODEL, p_draft, False, False, None, step, fed=1))
        return proposed

    def _kept(self, context: list[int]) -> int:
        """How much of `context` the draft's KV already holds (the list comparison runs in C: the usual case)."""
        if self.held is None:
            return 0
        if context[:len(self.held)] == self.held:
            return len(self.held)
        return common_prefix_length(self.held, context)

    def _judge(self, full: list[int], row: DraftRow, block: PendingBlock,
               to_verify: bool) -> tuple[DraftStep | None, torch.Tensor | None, float | None]:
        """(the step the verifier reads, the distribution the token was drawn from, the verifier's score)."""
        if row.logits is None:  # a greedy draft's argmax: a point mass, nothing to judge
            return None, None, None
        # the request's bias and penalties shape the proposals as they shape the target in the rule
        logits = self.processor.next_row(row.logits, full) if self.processor is not None else row.logits
        token, p_draft = next_token(logits, self.sampling, self.generator)
        verifier = self.verifier if to_verify else None
        companion = self.companion if to_verify else None
        signals = companion.features(full, row.logits, token) if companion is not None else None
        previous = _last_confidence(block) if reads_history(verifier) else None
        step = DraftStep(token, row.logits, row.hidden, signals, previous, position=len(block))
        return step, p_draft, verifier.score(step) if verifier is not None else None

    @property
    def draft_model(self) -> ModelProposer:
        return self

    def copy_run(self, context: list[int], drafted: list[int], room: int) -> list[ProposedToken]:
        """The draft keeps no text to copy from."""
        return []

    @property
    def drafts_side_by_side(self) -> bool:
        return self.forward.batches

    async def next_logits(self, context: list[int]) -> torch.Tensor:
        self.held = list(context)
        row = await self.forward(context)
        if row.logits is None:
            raise ValueError("this draft returns its argmax alone: it has no logits to guess from")
        return row.logits

    def observe_verdict(self, block: PendingBlock, n_accepted: int) -> None:
        """The draft learns nothing from verdicts; a verifier that learns online (margin-logistic) hears them."""
        teach_verdict(self.verifier, [proposed.step for proposed in block.drafted], n_accepted)

    def observe_output(self, output: list[int]) -> None:
        """The draft learns nothing from outputs."""


def _last_confidence(block: PendingBlock) -> tuple[float, float] | None:
    """(token_prob, entropy) of the block's last token, when the draft produced it."""
    if not block.drafted or block.drafted[-1].step is None:
        return None
    token_prob, _, entropy = draft_confidence_features(block.drafted[-1].step)
    return token_prob, entropy


@dataclass
class Drafter:
    """One generation's proposer as the round uses it: the block, and who hears of each token that passes."""

    proposer: Proposer
    eos_token_ids: frozenset[int]
    processor: LogitsProcessor | None = None  # the request's logit_bias and penalties: the pipeline's guesses obey them

    async def draft(self, context: list[int], limit: int, policy: CallPolicy | None, cost_model: CostModel | None,
                    to_verify: bool = True, on_passed: Callable[[ProposedToken], None] | None = None,
                    prefix: PendingBlock | None = None) -> PendingBlock:
        """A pending block after `context` (see `Proposer.propose`), continuing `prefix` if given; `on_passed`
        sees each token that does not end it."""
        block = PendingBlock(list(prefix.drafted)) if prefix is not None else PendingBlock()
        if block.complete:
            return block
        async for proposed in self.proposer.propose(context, limit, policy if to_verify else None, cost_model,
                                                    to_verify, prefix):
            block.drafted.append(proposed)
            if on_passed is not None and not proposed.ends_block:
                on_passed(proposed)
        return block

    async def next_logits(self, context: list[int]) -> torch.Tensor:
        """The draft model's raw logits [V] after `context`: a guess at the target's next token."""
        model = self.proposer.draft_model
        if model is None:
            raise ValueError("this proposer has no draft model to guess the target's next token with")
        return await model.next_logits(context)


def model_drafter(draft_lm: DraftLM, sampling: SamplingParams, generator: torch.Generator,
                  eos_token_ids: frozenset[int], verifier: Verifier | None = None, companion: Companion | None = None,
                  offload: bool = False, processor: LogitsProcessor | None = None,
                  wrap: Callable[[ModelProposer], Proposer] | None = None) -> Drafter:
    """A drafter over a draft runtime in this process; `wrap` puts a strategy around the model (the suffix proposer)."""
    model = ModelProposer(LocalDraft(draft_lm, offload), sampling, generator, eos_token_ids, verifier, companion,
                          processor, offload)
    return Drafter(wrap(model) if wrap is not None else model, eos_token_ids, processor)

