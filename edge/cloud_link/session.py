"""One generation's session with the cloud, on one replica at a time, healing itself.

Along its seams: this module opens and reopens the session and retries a verify; the Session call
with its epochs and candidates is edge/cloud_link/stream.py; the early open and the first token it
brings, edge/cloud_link/opening.py; what a failure means and what to do about it, the pure
edge/cloud_link/failures.py.

The edge always knows the full context, so whenever a replica loses track of a session the session
reopens with that context and retries; where and when depends on why, which edge/cloud_link/failures.py
names (`classify`: desync, evicted, replica_failed, draining, busy, ...) and answers (`ACTIONS`: counts
against the attempts? reopen? a new stream? another replica? wait for the cloud's hint?).

Replicas are chosen by the `Replicas` the session was made by (edge/cloud_link/replicas.py: rendezvous
hashing on the session's key with a bounded-load override; the key is a digest of the prompt's leading block,
edge/cloud_link/prefix_key.py, so the same prefix goes to the replica that cached it). A switch to another replica is
immediate; a retry on the same one backs off exponentially with jitter (at least the cloud's
retry_after_ms). A cloud that answers (busy, evicted, desync) is waited for as long as the request's
deadline allows, as mode target waits its turn: a lossless request never turns lossy because the
cloud is loaded. Only failures that say a replica is out of reach (broken stream, frame deadline,
draining, none usable) count against the attempts; when they run out, `CloudUnavailable` tells
the decoding loop to carry on from the draft alone, and when the request's deadline passes,
`DeadlinePassed` does. A refusal no retry can fix is `CloudRefused`.
"""

from __future__ import annotations

from dataclasses import replace

import logging
from typing import Callable, Protocol

import grpc

from common import wire
from common.admission import Admission
from common.sampling.logprobs import TokenLogprob
from common.sampling.distributions import SparseDistribution, SamplingParams
from common.tracing import tracer
from edge.cloud_link.prefix_key import prefix_key
from edge.cloud_link.client import CloudClient, CloudRefused, CloudUnavailable, DeadlinePassed, backoff_delay, sleep_within
from edge.cloud_link.failures import ACTIONS, Cause, RetryableFailure, classify
from edge.cloud_link.opening import EarlyOpen
from edge.cloud_link.stream import STREAM_BROKE, SessionStream
from sprinter.v1 import decoding_pb2 as pb

log = logging.getLogger(__name__)


AnswerQuery = Callable[[pb.ResidualQuery], pb.EdgeFrame]  # the edge's residual answer to a query of the cloud


class Replicas(Protocol):
    """Where a session may run, and what it tells about how each replica fared."""

    attempts: int  # verify attempts before CloudUnavailable

    def choose(self, key: str, avoid: frozenset[str]) -> CloudClient | None:
        """A replica for session `key`, preferring any not in `avoid`; None when none is usable now. No side effect."""
        ...

    def loading(self) -> bool:
        """None is usable, but one answers and is still loading its model: worth waiting for."""
        ...

    async def recover(self) -> None:
        """Nothing was usable: look again now (a replica may have come back)."""
        ...

    def acquire(self, client: CloudClient) -> None:
        """The session runs on `client` from now on."""
        ...

    def release(self, client: CloudClient) -> None:
        """The session no longer runs on `client`."""
        ...

    def report(self, client: CloudClient, cause: Cause | None) -> None:
        """How a call went: None for an answer, else the cause of its failure (one its action reports)."""
        ...


class CloudSession:
    """One generation's Session stream; reopens with the full context wherever the cloud lost it."""

    def __init__(self, replicas: Replicas, sampling: SamplingParams, vocab_fingerprint: str,
                 deadline_at: float | None = None, output_start: int | None = None, priority: int = 0) -> None:
        self.replicas = replicas
        self.priority = priority  # orders this request within its edge's share of the cloud's line (lower first)
        self.queued_ms = 0.0  # time this session's opens and verifies waited in the cloud's line
        # where the generation's tokens begin in every context this session opens with (the user's prompt length):
        # penalties count them, so a reopen with the full context says where they start
        self.output_start = output_start
        self.prompt_logprobs: list[TokenLogprob] | None = None  # the first open's answer when the sampling asked (echo)
        self.deadline_at = deadline_at  # the request's own deadline (time.monotonic()); None: as long as it takes
        # What rendezvous hashing places this session by: its prompt's leading block (edge/cloud_link/prefix_key.py),
        # set at the first open and kept by every reopen, so a failover goes where every edge would send it.
        self.key: str | None = None
        self.sampling = sampling
        self.vocab_fingerprint = vocab_fingerprint
        self.client: CloudClient | None = None
        self.stream = SessionStream(deadline_at)  # the call, its epochs and candidates (edge/cloud_link/stream.py)
        self.early = EarlyOpen()  # open_ahead's open and the first token it brings (edge/cloud_link/opening.py)
        self.session_id: str | None = None
        self.evicted_session_id = ""  # the session the cloud evicted: a reopen names it to keep its request's turn
        self.abandoned: tuple[CloudClient, str] | None = None  # a session left behind on a broken stream
        self.avoid: set[str] = set()  # replicas this session should not go back to if it has a choice
        self.opens = 0
        self.cached_tokens = 0  # prompt tokens the cloud served from its prefix cache at the first open

    def open_ahead(self, prompt_ids: list[int], first_token: bool = False) -> None:
        """Open the session with the prompt now (edge/cloud_link/opening.py); with `first_token` the cloud also
        answers with the target's token after the prompt (`opened_first_token`)."""
        if self.session_id is None and not self.early.started:
            self.early.start(self._open(list(prompt_ids), first_token), self._kept_for_first_verify)

    def _kept_for_first_verify(self, err: Exception) -> Exception | None:
        if isinstance(err, (RetryableFailure, CloudRefused, DeadlinePassed)):
            return err
        return self._stream_failure(err) if isinstance(err, STREAM_BROKE) else None

    async def opened_first_token(self) -> tuple[int, TokenLogprob | None] | None:
        """The target's token after the prompt (and its logprob, when asked), once the early open has answered;
        None if it failed or the cloud did not give one (its failure stays for the first verify to handle)."""
        return await self.early.token()

    @property
    def opening(self) -> bool:
        """An early open is still in flight (the next verify waits for it)."""
        return self.early.in_flight

    async def _open(self, context: list[int], first_token: bool = False) -> None:
        if self.client is None:
            self.key = self.key or prefix_key(context)
            self.client = self.replicas.choose(self.key, frozenset(self.avoid))
            if self.client is None:
                await self.replicas.recover()
                self.client = self.replicas.choose(self.key, frozenset(self.avoid))
            if self.client is None:
                if self.replicas.loading():
                    raise RetryableFailure(Cause.LOADING, "the cloud is still loading its model")
                raise RetryableFailure(Cause.NO_REPLICA, "no cloud replica is usable now")
            self.replicas.acquire(self.client)
        self.stream.start(self.client)
        if self.abandoned is not None:
            await self._close_abandoned()
        # only the first open asks for the prompt's logprobs: a reopen's context holds output too, already scored
        sampling = self.sampling if self.opens == 0 else replace(self.sampling, prompt_logprobs=None)
        ticket = self.stream.ticket.ticket_id if self.stream.ticket else ""  # a place kept from a broken stream
        frame = wire.open_frame(context, sampling, self.vocab_fingerprint, first_token, self.output_start,
                                Admission(self.priority, True, ticket, self.evicted_session_id))
        with tracer.span("edge.open", replica=self.client.endpoint.address, reopen=self.opens > 0,
                         tokens=len(context)):
            answer = await self.stream.exchange(frame)
        if answer.WhichOneof("frame") == "error":
            raise self._failure(answer.error, len(context))
        self.stream.ticket, self.evicted_session_id = None, ""
        self.queued_ms += wire.queued_ms_of(answer.opened)
        if (limits := wire.opened_limits(answer.opened)) is not None:
            self.client.limits = limits
        self.session_id = answer.opened.session_id
        self.early.first_token = wire.opened_first_token(answer.opened)
        self.early.first_logprob = wire.opened_first_logprob(answer.opened)
        if self.opens == 0:
            self.prompt_logprobs = wire.logprobs_from_proto(answer.opened.prompt_logprobs, context[1:])
            self.cached_tokens = wire.opened_cached_tokens(answer.opened)
        self.opens += 1

    @property
    def reopens(self) -> int:
        """Opens after the first: each handed the full context over again (a resync, another replica)."""
        return max(0, self.opens - 1)

    async def _close_abandoned(self) -> None:
        """Take back the session a broken stream left on this replica, so that the fresh open closes it.

        The cloud keeps a session past its stream (it may be resumed); a stream holds one session, and
        a second open on it closes the first. Without this, every deadline the edge gives up on would
        leave a session holding KV until its idle timeout. Whatever the answer (gone already: NOT_FOUND),
        the fresh open follows. A session left on another replica is left to its idle timeout.
        """
        (client, abandoned), self.abandoned = self.abandoned, None
        if client is self.client:
            await self.stream.exchange(wire.resume_frame(abandoned, self.vocab_fingerprint))

    def _failure(self, error: pb.Error, context_length: int) -> Exception:
        """What an error frame means (edge/cloud_link/failures.py): a resync, a retry (here or elsewhere), or a
        refusal. On a stream that carried candidates the retry takes a fresh stream: the cloud may still answer
        candidates on this one (NOT_FOUND for a session that is gone), and those answers must not be read as
        the retry's."""
        cause, code = classify(error), wire.error_status(error)
        action = ACTIONS[cause]
        if action.gives_up:
            return CloudRefused(code, error.message)
        if action.resync:  # the cloud lost or misplaced our context: hand it over again
            log.info("cloud %s asked for a resync (%s); reopening with %d tokens", self.client.endpoint.address,
                     error.message, context_length)
            self.evicted_session_id = self.session_id if cause is Cause.EVICTED and self.session_id else ""
            self.session_id = None
        hint_s = error.retry_after_ms / 1e3 if action.honours_hint else 0.0
        return RetryableFailure(cause, f"{code.name}: {error.message}", hint_s,
                                stale_stream=self.stream.has_candidates)

    async def send_candidate(self, frame: pb.VerifyBlock, epoch: int) -> bool:
        """Write a candidate behind the block of `epoch`, on that block's stream; False if that is no longer
        possible. Never raises: a broken stream shows on the verdict's read, which the verify in flight handles."""
        return self.session_id is not None and await self.stream.send_candidate(frame, epoch)

    async def _read_candidate_verdict(self, context: list[int], frame: pb.VerifyBlock) -> pb.Verdict:
        """The verdict on a candidate the cloud matched: the next frame on the stream, named by its block."""
        try:
            answer = await self.stream.read()
        except STREAM_BROKE as err:
            raise self._stream_failure(err) from err
        if answer.WhichOneof("frame") == "error":
            raise self._failure(answer.error, len(context))
        if not answer.verdict.candidate or answer.verdict.start_position != frame.start_position:
            # Not what this edge and the cloud agreed would come: the stream is out of step, start afresh.
            raise RetryableFailure(Cause.OUT_OF_STEP, "the cloud answered another block than the candidate")
        self.stream.matched()
        return answer.verdict

    async def _attempt(self, context: list[int], frame: pb.EdgeFrame, answer_query: AnswerQuery | None) -> pb.Verdict:
        if self.early.started:  # the first verify meets the early open's outcome
            await self.early.take_over()
        try:
            if self.session_id is None:
                await self._open(context)
            answer = await self.stream.exchange(frame)
            # a block sent without its distributions: the cloud asks for the draft's at a rejection first
            while answer.WhichOneof("frame") == "residual_query" and answer_query is not None:
                answer = await self.stream.exchange(answer_query(answer.residual_query))
        except STREAM_BROKE as err:
            raise self._stream_failure(err) from err
        if answer.WhichOneof("frame") == "residual_query":
            raise RetryableFailure(Cause.OUT_OF_STEP, "the cloud asked a residual query of a block sent with "
                                                      "its distributions")
        if answer.WhichOneof("frame") == "verdict":
            self.stream.ticket = None
            self.queued_ms += wire.queued_ms_of(answer.verdict)
            return answer.verdict
        raise self._failure(answer.error, len(context))

    @staticmethod
    def _stream_failure(err: Exception) -> Exception:
        """A stream that broke mid-frame surfaces as a status, a timeout, or a write to a finished call."""
        cause = classify(err)
        if ACTIONS[cause].gives_up:
            return CloudRefused(err.code(), err.details() or "")  # only an AioRpcError gets here
        return RetryableFailure(cause, repr(err))

    async def verify(self, context: list[int], draft_tokens: list[int], method: int,
                     draft_token_probs: list[float] | None = None,
                     draft_dists: list[SparseDistribution] | None = None) -> pb.Verdict:
        """Verify `draft_tokens` following `context` (the edge's committed tokens)."""
        return await self.verify_block(context, wire.verify_block(len(context), draft_tokens, wire.method_name(method),
                                                                  draft_token_probs, draft_dists))

    async def verify_block(self, context: list[int], block: pb.VerifyBlock, matched_candidate: bool = False,
                           answer_query: AnswerQuery | None = None) -> pb.Verdict:
        """Verify `block` following `context` (the edge's committed tokens). With `matched_candidate` the block
        went out as a candidate the cloud has matched: its verdict is read, not asked for; should that fail,
        the block is sent again the ordinary way. `answer_query` answers the cloud's residual queries on a block
        sent without its distributions (dists_on_rejection)."""
        frame = wire.ordinary_verify_frame(block)
        last_failure: RetryableFailure | None = None
        failures = tries = 0  # failures: replicas out of reach (they count against the attempts); tries: all
        while failures < self.replicas.attempts:
            try:
                with tracer.span("edge.attempt", attempt=tries, candidate=tries == 0 and matched_candidate) as span:
                    if tries == 0 and matched_candidate:
                        verdict = await self._read_candidate_verdict(context, block)
                    else:
                        verdict = await self._attempt(context, frame, answer_query)
                    span.set(replica=self.client.endpoint.address if self.client else None)
            except RetryableFailure as failure:
                last_failure, tries = failure, tries + 1
                failures += failure.action.counts
                await self._after(failure, tries - 1, final=failures == self.replicas.attempts)
                continue
            except DeadlinePassed:
                await self._reset()  # the frame in flight is abandoned with its stream
                raise
            if self.client is not None:
                self.replicas.report(self.client, None)
            return verdict
        raise CloudUnavailable(grpc.StatusCode.UNAVAILABLE, f"no cloud replica answered in "
                               f"{self.replicas.attempts} attempts: {last_failure}")

    async def _after(self, failure: RetryableFailure, attempt: int, final: bool) -> None:
        """Move to another replica at once if the failure says so and there is one; else wait, then try again
        (no longer than the request's deadline allows: past it, DeadlinePassed)."""
        client = self.client
        if client is not None and failure.action.reported:
            self.replicas.report(client, failure.cause)
        if failure.new_stream:
            await self._reset()
        if final:
            return
        if client is not None and failure.action.move:
            avoid = frozenset(self.avoid | {client.endpoint.address})
            # No other replica usable now still means leaving: the next open probes them all (`recover`), so
            # one that came up while resting is found at once, where staying would ask a draining one again.
            if self.replicas.choose(self.key, avoid) is not client:
                self.avoid = set(avoid)
                with tracer.span("edge.failover", replica=client.endpoint.address, cause=failure.cause.value):
                    await self._leave()
                return
        if client is None:  # no replica was usable: wait for one to come back
            delay = backoff_delay(attempt, 0.2, 2.0)
        else:
            endpoint = client.endpoint
            delay = 0.0 if failure.action.resync and attempt == 0 else backoff_delay(attempt, endpoint.backoff_s,
                                                                                     endpoint.max_backoff_s)
            delay = min(max(delay, failure.retry_after_s), endpoint.deadline_s)
        with tracer.span("edge.retry_wait", cause=failure.cause.value, delay_ms=delay * 1e3):
            waited = await sleep_within(delay, self.deadline_at)
        if not waited:
            await self._reset()
            raise DeadlinePassed(grpc.StatusCode.DEADLINE_EXCEEDED, f"the request's deadline passed while the cloud "
                                 f"was unavailable ({failure})", loading=failure.cause is Cause.LOADING)

    async def _reset(self) -> None:
        self.stream.cancel()
        if self.session_id is not None and self.client is not None:
            self.abandoned = (self.client, self.session_id)
        self.session_id = None

    async def _leave(self) -> None:
        """Off this replica: the next open chooses again."""
        if self.stream.call is not None:
            await self.stream.close()
        if self.client is not None:
            self.replicas.release(self.client)
        self.client, self.session_id = None, None

    async def close(self) -> None:
        await self.early.cancel()  # cancelled mid-open: the stream is closed below, its answer unread
        await self._leave()
