"""Modes target and cloud-sd on the edge: the cloud generates (or speculates) alone and streams the tokens.

While the cloud cannot, the draft goes on, and the cloud takes over again (from the context so far)
once it answers, unless the request's deadline has passed. What is waited for and what degrades:

- a busy cloud (RESOURCE_EXHAUSTED with a retry hint) and a cloud still loading its model (health
  NOT_SERVING) are waited for; a request in the cloud's line waits on its place (queue tickets, its
  ticket kept across a broken stream). Every wait ends at the request's deadline: past it the rest
  comes from the draft, reason `deadline` (`loading` when the cloud was still loading);
- a replica that fails a Generate rests; the next try goes to another usable one, or probes them all
  first (a resting replica may be back), as sessions do. The tries are bounded (`ReplicaSet.attempts`
  in a row; a replica that went away after streaming tokens starts the count again) so that a replica
  that answers GetInfo but hangs every Generate cannot hold a request:
  past them the draft goes on for `cloud_retry_s`, reason `cloud_unreachable`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, replace
from typing import Callable

import grpc

from common import wire
from common.admission import Admission, QueuePlace
from common.spec.cost_model import CostModel
from common.spec.propose.drafting import Drafter
from common.spec.generation import Generation
from common.spec.speculative_round import speculative_round
from common.tracing import tracer
from edge.cloud_link.cloud_target import CloudUse
from edge.cloud_link.client import CloudLoading, CloudRefused, CloudUnavailable, DeadlinePassed, backoff_delay, sleep_within
from edge.cloud_link.replicas import ReplicaSet
from edge.decoding.placer import Placer

log = logging.getLogger(__name__)


@dataclass
class CloudGenerate:
    """One target or cloud-sd generation against the replicas; `drafter()` makes the draft that stands in."""

    cloud: ReplicaSet
    vocab_fingerprint: str
    cost_model: CostModel
    placer: Placer
    drafter: Callable[[], Drafter]
    priority: int = 0  # orders the request within its edge's share of the cloud's line
    cloud_retry_s: float = 2.0
    ticket: QueuePlace | None = None  # the place in the cloud's line, kept for the next try
    # asked after each chunk committed: True ends the stream there (`--mode auto` switches: mode_switch.py); the
    # tokens the cloud made past it are dropped unread, never committed
    boundary: Callable[[], bool] = lambda: False

    async def run(self, generation: Generation, use: CloudUse, deadline_at: float | None) -> None:
        drafter, retry_at, busy, failures = None, None, 0, 0
        while not generation.done:
            made = len(generation.new_tokens)
            try:
                with tracer.span("edge.cloud_generate", busy=busy, failures=failures):
                    use.finish_reason = await self._stream(generation, deadline_at, use)
                return
            except CloudRefused as err:
                if err.code.name != "RESOURCE_EXHAUSTED" or not err.retry_after_s:
                    raise  # a limit no retry can lift
                busy += 1  # busy (the KV budget is held): wait for a turn, as the speculative modes do
                if await sleep_within(max(err.retry_after_s, backoff_delay(busy - 1, 0.2, 5.0)), deadline_at):
                    continue
                log.warning("the request's deadline passed while the cloud was busy: %s", err)
                use.mark_degraded("deadline")
                retry_at = None
            except DeadlinePassed as err:
                use.mark_degraded(err.reason)
                retry_at = None
            except CloudLoading as err:  # it answers: wait for it, as for a busy one, within the deadline
                busy += 1
                if await sleep_within(backoff_delay(busy - 1, 0.2, 2.0), deadline_at):
                    continue
                log.warning("the request's deadline passed while the cloud loaded: %s", err)
                use.mark_degraded("loading")
                retry_at = None
            except CloudUnavailable as err:
                # A replica that went away (UNAVAILABLE: a kill, a restart) after streaming tokens starts the count
                # again: a long request may outlive several kills. One that stops sending (DEADLINE_EXCEEDED) counts
                # every time, so a replica that streams a little and hangs cannot hold a request.
                went_away = err.code != grpc.StatusCode.DEADLINE_EXCEEDED
                failures = 1 if went_away and len(generation.new_tokens) > made else failures + 1
                if failures < self.cloud.attempts and await self._back(failures, deadline_at):
                    log.info("target mode: %s; going on with another replica", err)
                    use.reopens += 1
                    continue
                log.warning("cloud unavailable in target mode, continuing from the draft: %s", err)
                use.mark_degraded(err.reason)
                retry_at = time.monotonic() + self.cloud_retry_s
            drafter = drafter or self.drafter()
            # past the request's deadline (retry_at None) the draft goes on to the end
            with tracer.span("edge.degraded", reason=use.degraded_reason):
                while not generation.done and (retry_at is None or time.monotonic() < retry_at):
                    await speculative_round(generation, drafter, None, None, None)

    async def _back(self, failures: int, deadline_at: float | None) -> bool:
        """After a failed Generate: a replica usable now, or (none) one probed back after a short wait."""
        if self.cloud.available():
            return True
        if not await sleep_within(backoff_delay(failures - 1, 0.2, 2.0), deadline_at):
            return False
        await self.cloud.recover()  # probes resting replicas too: one restarted meanwhile is used at once
        return self.cloud.available() or self.cloud.loading()

    def _told(self, place: QueuePlace) -> None:
        self.ticket = place

    async def _stream(self, generation: Generation, deadline_at: float | None, use: CloudUse) -> str | None:
        """Stream the rest of the generation from the cloud; the cloud's finish_reason, if it sent one."""
        finish = None
        sampling = generation.settings.sampling
        if generation.new_tokens:  # a later call continues the output: the prompt's logprobs came with the first
            sampling = replace(sampling, prompt_logprobs=None)
        speculates = generation.settings.traits.cloud_drafts
        admission = Admission(self.priority, waits_in_line=True, ticket_id=self.ticket.ticket_id if self.ticket else "")
        chunks = self.cloud.generate(generation.context, sampling, generation.budget, self.vocab_fingerprint,
                                     deadline_at, output_start=len(generation.prompt_ids),
                                     speculate_block=min(generation.settings.k, self.cloud.limits.max_block or generation.settings.k)
                                     if speculates else None,
                                     proposer=generation.settings.proposer if speculates else None,
                                     admission=admission, on_ticket=self._told)
        started, first = time.perf_counter(), True
        starting = 0 if generation.new_tokens else len(generation.prompt_ids)  # a request's start: its prompt to price
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if first:
                    self.ticket = None
                    use.queued_ms += wire.queued_ms_of(chunk)
                if chunk.drafted:  # a cloud-sd round: one target forward over the cloud's block
                    generation.recorder.verified(chunk.drafted, len(chunk.token_ids) - 1, chunk.copied,
                                                 chunk.copied_kept)
                    if first:  # the round trip, paid once: what the first round took here less what it took there
                        self.cost_model.observe_rtt((time.perf_counter() - started) * 1e3 - chunk.step_ms)
                    self.placer.observe_cloud_round(len(chunk.token_ids), chunk.drafted, chunk.step_ms, first,
                                                    starting)
                else:  # a token of the target alone (a round with no room left to draft in is one too)
                    generation.recorder.target_calls += len(chunk.token_ids)
                    if not speculates:
                        self.placer.observe_target_step(chunk.step_ms / max(len(chunk.token_ids), 1), first,
                                                        starting)
                first = False
                generation.commit(len(generation.new_tokens), list(chunk.token_ids),
                                  wire.logprobs_from_proto(chunk.logprobs, chunk.token_ids))
                generation.recorder.cached_tokens += wire.chunk_cached_tokens(chunk)
                if chunk.prompt_logprobs:
                    use.prompt_logprobs = wire.logprobs_from_proto(chunk.prompt_logprobs, generation.prompt_ids[1:])
                finish = chunk.finish_reason or None  # empty from a cloud that predates the field
                if generation.done or self.boundary():
                    return None  # our own limit or stop (our own reason), or a switch to another mode
        return finish
