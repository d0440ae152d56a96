"""Pipelined rounds: while a block is in flight, the edge drafts for the verdicts it expects instead of idling.

Glossary (speculative_round.py has the rest)
    block in flight  the pending block sent to the cloud, verdict not yet known
    outcome          a verdict it may get: keep x_1..x_n, then token t (n = g: all kept, t the target's bonus)
    candidate        a block drafted ahead after one outcome's context: context + x_1..x_n + [t]
    hit              the verdict is a drafted-for outcome: its candidate is the next round's block

Pipelines (`--pipeline`)
    off          draft, send, wait (speculative_round.py)
    ahead        while the block is in flight, draft one candidate: all kept, with the draft's likeliest
                 guess of the bonus. On a hit it is the next block (topped up if the policy wants more);
                 otherwise it is dropped and the draft's KV rolls back by itself (`advance_to` keeps only the
                 common prefix of what it holds and what it is asked for).
    send-ahead   draft candidates for the likeliest outcomes (a few bonus guesses, a rejection at the least
                 safe positions with the draft's runner-up as the target's replacement) and send each as it
                 is done, on the same stream. The cloud verifies the one that follows its verdict at once,
                 with no round trip in between, and drops the rest unread (cloud/service.py).

Why the output is still the target's (lossless modes; `sprinter` keeps `off`: its blocks end at a token
the verifier expects to be rejected, the outcome least worth drafting for)
    Every lossless rule is exact for any proposal x_1..x_g drawn from the draft's own distributions
    p_draft(. | prefix), with any stopping rule that decides from tokens already drawn, provided the
    rule's coin flips are independent of the proposals. A candidate for outcome (n, t) is exactly such
    a proposal for the context c' = c + x_1..x_n + t: its tokens are fresh draws from p_draft given
    their prefix, made with the drafter's generator, which the cloud's verification never reads.
    Which outcomes get candidates is decided from the block and the draft's probabilities, never
    from the verdict; the verdict only picks which candidate is used, and there is one per outcome.
    So, given the verdict (hence c'), the next proposal is distributed as if it had been drafted
    after c' the ordinary way: p_draft's chain from c', stopped by the policy. Guessing the bonus is
    not drafting it: the guess t is only a condition, and the target's own token is what is kept.
    A candidate cut short by the verdict's arrival is topped up from c' + its tokens, the same chain.
    (The drafter's generator advances differently than with `off`, so sampled outputs differ run by
    run from `off` while their distribution does not; greedy outputs are identical.)
    Tokens reach the client only as verdicts commit them, never from a candidate.

When it pays (edge/decoding/ahead_gauge.py)
    Each round asks the generation's `AheadGauge` whether to draft ahead at all: while the
    measured hit rate x what a hit saves stays below the measured lag it costs, the round runs as
    `off` (with a probe now and then). That choice is made before the verdict, so it is lossless too.

Costs
    Drafting ahead hides behind the round trip, so its steps are not taught to the cost model as
    drafting cost; a candidate's verdict teaches the round trip the edge actually waited for it (from
    the previous verdict), which is what goodput weighs when it picks the next block's length.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

import torch

from common.spec.call_policy import CallPolicy
from common.spec.cost_model import CostModel
from common.spec.propose.drafting import Drafter
from common.spec.propose.proposals import PendingBlock
from common.spec.generation import Generation
from common.spec.speculative_round import Verdict, apply_verdict, block_limit, draft_block, speculative_round
from edge.decoding.ahead_gauge import AheadGauge
from edge.cloud_link.cloud_target import CloudTarget

BONUS_GUESSES = 2  # send-ahead: candidates after full acceptance, one per guess of the target's bonus token


@dataclass(frozen=True)
class Outcome:
    """A verdict the block in flight may get, with the draft's estimate of its probability."""

    n_accepted: int
    next_token: int
    likelihood: float


@dataclass
class Candidate:
    outcome: Outcome
    context: list[int]  # the context that outcome makes
    block: PendingBlock
    sent_at_epoch: int | None = None  # the stream epoch it went out in (edge/cloud_link/session.py); None: kept here
    drafting_ms: float = 0.0  # what drafting it took: what the next round saves if it hits


Shaping = Callable[[torch.Tensor, list[int]], torch.Tensor]  # logits [V] after a context -> transformed


def likely_outcomes(block: PendingBlock, bonus_logits: torch.Tensor, eos_token_ids: frozenset[int],
                    bonus_guesses: int, rejections: bool, shape: Shaping | None = None,
                    context: list[int] = ()) -> list[Outcome]:
    """Outcomes of `block` (drafted after `context`)'s verdict worth drafting for, likeliest first (none that
    ends the generation).

    P(all kept, bonus t) = prod a_i * q(t); P(x_1..x_n kept, then r) = prod_{i<=n} a_i * (1 - a_{n+1}) * q'(r),
    with a_i the scores the policy read, q the draft's distribution at T=1 and r the draft's likeliest
    token other than x_{n+1} (q' renormalised without x_{n+1}): the target's replacement, as best guessed.
    `shape`: the request's logits processor (a grammar, penalties), so that no guess is a token the target
    could not give there.
    """
    def logits_at(raw: torch.Tensor, n: int) -> torch.Tensor:
        return shape(raw, list(context) + block.tokens[:n]) if shape is not None else raw

    outcomes, survive = [], 1.0
    for n, drafted in enumerate(block.drafted):
        a = drafted.accept_prob if drafted.accept_prob is not None else 1.0
        if rejections and drafted.step is not None:  # a copied token has no draft distribution to guess from
            q = torch.softmax(logits_at(drafted.step.logits, n).float(), dim=-1)
            rest = 1.0 - float(q[drafted.token])
            q[drafted.token] = 0.0
            replacement = int(q.argmax())
            if replacement not in eos_token_ids and rest > 0:
                outcomes.append(Outcome(n, replacement, survive * (1.0 - a) * float(q[replacement]) / rest))
        survive *= a
        if drafted.token in eos_token_ids:
            return sorted(outcomes, key=lambda o: -o.likelihood)  # accepted up to EOS, the generation ends
    q = torch.softmax(logits_at(bonus_logits, len(block)).float(), dim=-1)
    top = q.topk(bonus_guesses)
    outcomes += [Outcome(len(block), int(t), survive * float(p)) for p, t in zip(top.values, top.indices)
                 if int(t) not in eos_token_ids and float(p) > 0]
    return sorted(outcomes, key=lambda o: -o.likelihood)


def picked(candidates: list[Candidate], verdict: Verdict) -> Candidate | None:
    """The candidate drafted for the verdict's outcome, if any (a hit)."""
    return next((c for c in candidates if (c.outcome.n_accepted, c.outcome.next_token)
                 == (verdict.n_accepted, verdict.next_token)), None)


@dataclass
class PipelinedRounds:
    """One generation's rounds with a pipeline on (see the module docstring)."""

    generation: Generation
    drafter: Drafter
    cloud_target: CloudTarget
    policy: CallPolicy | None
    cost_model: CostModel | None
    pipeline: str
    fit_to_cloud: Callable[[], None]
    gauge: AheadGauge
    max_candidates: int = 3  # send-ahead's budget per block in flight
    # asked after each verdict: True stops the rounds there (`--mode auto` switches: edge/decoding/mode_switch.py);
    # what was drafted or sent ahead is dropped with the session, never committed
    boundary: Callable[[], bool] = lambda: False

    async def run(self, carried: PendingBlock | None = None) -> None:
        """Rounds until the generation is done or `boundary()` stops them; `carried`: tokens drafted ahead to start
        the first block with."""
        generation = self.generation
        matched: Candidate | None = None  # a sent candidate the cloud is verifying now
        verdict_at = time.perf_counter()
        while not generation.done:
            self.fit_to_cloud()
            if not self.cloud_target.reachable():
                await speculative_round(generation, self.drafter, self.cloud_target, self.policy, self.cost_model)
                carried = matched = None
                continue
            context = generation.context
            if matched is None:
                block = await self._next_block(context, carried)
                if block is None:
                    return
            else:
                block = matched.block
            if self.cost_model is not None:
                self.cost_model.observe_block_sent(len(block) if matched else len(carried or ()), len(block))
            # The candidates follow the block's own write; a matched candidate was written already.
            epoch = self.cloud_target.epoch + (matched is None)
            ahead = self.gauge.draft_ahead()
            generation.recorder.ahead_off_rounds += not ahead
            in_flight = asyncio.create_task(self.cloud_target.verify(
                context, block, matched_candidate=matched is not None, waited_since=verdict_at))
            arrived: list[float] = []
            in_flight.add_done_callback(lambda _: arrived.append(time.perf_counter()))
            try:
                candidates = await self._draft_ahead(context, block, in_flight, epoch) if ahead else []
                lag_ms = (time.perf_counter() - arrived[0]) * 1e3 if arrived else 0.0
                verdict = await in_flight
            finally:  # cancelled (the client left): the verify must not outlive the generation
                in_flight.cancel()
            verdict_at = time.perf_counter()
            self._learn(verdict, candidates, lag_ms)
            carried, matched = self._commit(context, block, verdict, candidates)
            if verdict is not None and self.boundary():
                return

    def _learn(self, verdict: Verdict | None, candidates: list[Candidate], lag_ms: float) -> None:
        """Teach the gauge this round: hit or not, what a hit saves (drafting a candidate, and with a sent one
        the link's round trip), and the lag the drafting cost the verdict."""
        if verdict is None or not candidates:
            return
        hit = picked(candidates, verdict) is not None
        saving_ms = sum(c.drafting_ms for c in candidates) / len(candidates)
        if any(c.sent_at_epoch is not None for c in candidates) and verdict.round_trip_ms is not None:
            saving_ms += max(0.0, verdict.round_trip_ms - (verdict.verify_ms or 0.0))
        self.gauge.observe(hit, saving_ms, lag_ms)

    async def _next_block(self, context: list[int], carried: PendingBlock | None) -> PendingBlock | None:
        """Draft the next block, continuing a kept candidate; None when the context has no room left."""
        generation = self.generation
        limit = block_limit(generation, to_verify=True)
        if limit < 1:
            generation.context_full = True
            return None
        learn = self.cost_model if generation.new_tokens else None  # the first round prefills: not a step's cost
        return await draft_block(generation, self.drafter, context, limit, self.policy, learn, prefix=carried)

    def _commit(self, context: list[int], block: PendingBlock, verdict: Verdict | None,
                candidates: list[Candidate]) -> tuple[PendingBlock | None, Candidate | None]:
        """Commit what the verdict keeps; the candidate it picks, kept here (carried) or already with the cloud."""
        generation, recorder = self.generation, self.generation.recorder
        apply_verdict(generation, context, block, verdict, self.policy, self.cost_model,
                      first_round=not generation.new_tokens)
        if verdict is None:  # out of reach: the block stood as drafted
            return None, None
        self.drafter.proposer.observe_verdict(block, verdict.n_accepted)
        hit = picked(candidates, verdict)
        recorder.pipelined(drafted_ahead=bool(candidates), hit=hit is not None,
                           sent=sum(c.sent_at_epoch is not None for c in candidates))
        if hit is None or generation.done or hit.context != generation.context:
            return None, None  # (a stop sequence may have cut the commit short: then the candidate is moot)
        if hit.sent_at_epoch is not None and hit.sent_at_epoch == self.cloud_target.verdict_epoch:
            recorder.candidate_hits += 1
            return None, hit
        return hit.block, None

    async def _draft_ahead(self, context: list[int], block: PendingBlock, in_flight: asyncio.Task,
                           epoch: int) -> list[Candidate]:
        """Candidates for the block in flight, until its verdict arrives or the budget is spent."""
        generation = self.generation
        send = self.pipeline == "send-ahead"
        if not send and any(t in self.drafter.eos_token_ids for t in block.tokens):
            return []  # all kept would end the generation: nothing to draft for
        bonus_logits = await self.drafter.next_logits(context + block.tokens)
        generation.recorder.draft_forwards += 1
        processor = self.drafter.processor
        outcomes = likely_outcomes(block, bonus_logits, self.drafter.eos_token_ids, BONUS_GUESSES if send else 1,
                                   rejections=send, shape=processor.next_row if processor is not None else None,
                                   context=context)
        candidates: list[Candidate] = []
        for outcome in outcomes[: self.max_candidates if send else 1]:
            room = min(generation.settings.round_cap, generation.block_room - outcome.n_accepted - 1)
            if in_flight.done():
                break
            if room < 1:  # that verdict leaves no room for another block
                continue
            kept = context + block.tokens[: outcome.n_accepted] + [outcome.next_token]
            candidate = Candidate(outcome, kept, PendingBlock())
            candidates.append(candidate)
            await self._draft_candidate(candidate, room, in_flight)
            if send:
                await self._send_ready(context, candidates, epoch, in_flight)
        return candidates

    async def _draft_candidate(self, candidate: Candidate, room: int, in_flight: asyncio.Task) -> None:
        """Draft `candidate`'s block as the policy would, stopping early if the verdict comes first."""
        started = time.perf_counter()
        # hidden behind the round trip: no cost taught
        proposals = self.drafter.proposer.propose(candidate.context, room, self.policy, None)
        try:
            while not in_flight.done():
                proposed = await anext(proposals, None)
                if proposed is None:
                    break
                candidate.block.drafted.append(proposed)
                self.generation.recorder.proposed([proposed])
        finally:
            await proposals.aclose()
        candidate.drafting_ms = (time.perf_counter() - started) * 1e3

    async def _send_ready(self, context: list[int], candidates: list[Candidate], epoch: int,
                          in_flight: asyncio.Task) -> None:
        """Send the complete candidates not sent yet, in order, once their block has gone out (epoch reached)."""
        for candidate in candidates:
            if candidate.sent_at_epoch is not None or not candidate.block.complete:
                continue
            if in_flight.done() or self.cloud_target.epoch != epoch:
                return  # too late, or the block is not written yet (the next candidate's turn tries again)
            outcome = candidate.outcome
            if await self.cloud_target.send_candidate(candidate.block, len(context), outcome.n_accepted,
                                                 outcome.next_token, epoch):
                candidate.sent_at_epoch = epoch
