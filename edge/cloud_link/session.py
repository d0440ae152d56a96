"""One generation's Session stream, on one cloud replica at a time, healing itself.

The edge always knows the full context, so whenever a replica loses track of a session the session
reopens with that context and retries; where and when depends on why, which edge/cloud_link/failures.py
names (`classify`: desync, evicted, replica_failed, draining, busy, ...) and answers (`ACTIONS`: counts
against the attempts? reopen? a new stream? another replica? wait for the cloud's hint?).

Replicas are chosen by the `Replicas` the session was made by (edge/cloud_link/replicas.py: rendezvous
hashing on the session's key with a bounded-load override). A switch to another replica is
immediate; a retry on the same one backs off exponentially with jitter (at least the cloud's
retry_after_ms). A cloud that answers (busy, evicted, desync) is waited for as long as the request's
deadline allows, as mode target waits its turn: a lossless request never turns lossy because the
cloud is loaded. Only failures that say a replica is out of reach (broken stream, frame deadline,
draining, none usable) count against the attempts; when they run out, `CloudUnavailable` tells
the decoding loop to carry on from the draft alone, and when the request's deadline passes,
`DeadlinePassed` does. A refusal no retry can fix is `CloudRefused`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Protocol

import grpc

from common.sampling import SparseDistribution, SamplingParams
from edge.cloud_link.client import (CloudClient, CloudLimits, CloudRefused, CloudUnavailable, DeadlinePassed,
                                    backoff_delay, sampling_to_proto, sleep_within, wait_limit)
from edge.cloud_link.failures import ACTIONS, Cause, RetryableFailure, classify, status_of
from sprinter.v1 import decoding_pb2 as pb

log = logging.getLogger(__name__)


class Replicas(Protocol):
    """Where a session may run, and what it tells about how each replica fared."""

    attempts: int  # verify attempts before CloudUnavailable

    def choose(self, key: str, avoid: frozenset[str]) -> CloudClient | None:
        """A replica for session `key`, preferring any not in `avoid`; None when none is usable now. No side effect."""
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


def verify_frame(start_position: int, draft_tokens: list[int], method: int,
                 draft_token_probs: list[float] | None = None, draft_dists: list[SparseDistribution] | None = None,
                 after: pb.AfterVerdict | None = None) -> pb.VerifyBlock:
    """A verify frame; with `after`, a candidate for that verdict of the block in flight."""
    return pb.VerifyBlock(start_position=start_position, draft_tokens=draft_tokens, method=method,
                          draft_token_probs=draft_token_probs or [], after=after,
                          draft_dists=[pb.SparseDistribution(token_ids=d.token_ids.tolist(), probs=d.probs.tolist())
                                       for d in draft_dists or []])


class CloudSession:
    """One generation's Session stream; reopens with the full context wherever the cloud lost it."""

    def __init__(self, replicas: Replicas, sampling: SamplingParams, vocab_fingerprint: str,
                 deadline_at: float | None = None) -> None:
        self.replicas = replicas
        self.deadline_at = deadline_at  # the request's own deadline (time.monotonic()); None: as long as it takes
        self.key = uuid.uuid4().hex  # what rendezvous hashing places this session by
        self.sampling = sampling
        self.vocab_fingerprint = vocab_fingerprint
        self.client: CloudClient | None = None
        self.call: grpc.aio.StreamStreamCall | None = None
        self.session_id: str | None = None
        self.abandoned: tuple[CloudClient, str] | None = None  # a session left behind on a broken stream
        self.avoid: set[str] = set()  # replicas this session should not go back to if it has a choice
        self.opens = 0
        self._opening: asyncio.Task | None = None  # open_ahead's open, until the first verify takes it over
        self._early_failure: Exception | None = None  # how that open failed, for the first verify to handle
        self._first_token: int | None = None  # the target's token after the prompt, from an open that asked for it
        # Each verify frame written starts a new epoch; candidates belong to the epoch of the block they follow,
        # and count only if that very write got the verdict (a retry, a reopen or a new stream loses them).
        self._epoch = 0
        self.verdict_epoch = 0  # the epoch whose write the latest verdict answered
        self.uplink_bytes = 0  # verify frames and candidates written: what send-ahead costs the link
        self._call_has_candidates = False  # answers to candidates may still be on this stream (see `_failure`)
        self._write_lock = asyncio.Lock()  # a stream takes one write at a time: candidates queue behind their block

    def open_ahead(self, prompt_ids: list[int], first_token: bool = False) -> None:
        """Open the session with the prompt now, so that the cloud prefills it while the edge prefills its
        draft and drafts the first block; the first verify then carries the block alone. With
        `first_token` the cloud also answers with the target's token after the prompt (`opened_first_token`).
        If this open fails, the first verify meets the failure (and its retries) as if it had opened itself."""
        if self.session_id is None and self._opening is None:
            self._opening = asyncio.get_running_loop().create_task(self._open_ahead(list(prompt_ids), first_token))

    async def opened_first_token(self) -> int | None:
        """The target's token after the prompt, once the early open has answered; None if it failed or the
        cloud did not give one (its failure stays for the first verify to handle)."""
        if self._opening is not None:
            await asyncio.shield(self._opening)
        token, self._first_token = self._first_token, None
        return token

    @property
    def opening(self) -> bool:
        """An early open is still in flight (the next verify waits for it)."""
        return self._opening is not None and not self._opening.done()

    async def _open_ahead(self, prompt_ids: list[int], first_token: bool) -> None:
        """The open, its failure kept for the first verify: that verify's retry loop treats it as its own
        first attempt's (a busy cloud's retry hint is honoured, a broken stream reset, a refusal final)."""
        try:
            await self._open(prompt_ids, first_token)
        except (RetryableFailure, CloudRefused, DeadlinePassed) as failure:
            self._early_failure = failure
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError) as err:
            self._early_failure = self._stream_failure(err)

    async def _exchange(self, frame: pb.EdgeFrame) -> pb.CloudFrame:
        deadline = self.client.endpoint.deadline_s
        if frame.HasField("verify"):
            self._epoch += 1
            self.uplink_bytes += frame.ByteSize()
        epoch = self._epoch
        async with self._write_lock:
            await asyncio.wait_for(self.call.write(frame), deadline)
        answer = await self._read()
        self.verdict_epoch = epoch
        return answer

    async def _read(self) -> pb.CloudFrame:
        limit, request_bound = wait_limit(self.client.endpoint.deadline_s, self.deadline_at)
        try:
            answer = await asyncio.wait_for(self.call.read(), limit)
        except asyncio.TimeoutError:
            if request_bound:
                raise DeadlinePassed(grpc.StatusCode.DEADLINE_EXCEEDED,
                                     "the request's deadline passed while it waited for a verdict") from None
            raise
        if answer is grpc.aio.EOF:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "the cloud ended the stream")
        return answer

    async def _open(self, context: list[int], first_token: bool = False) -> None:
        if self.client is None:
            self.client = self.replicas.choose(self.key, frozenset(self.avoid))
            if self.client is None:
                await self.replicas.recover()
                self.client = self.replicas.choose(self.key, frozenset(self.avoid))
            if self.client is None:
                raise RetryableFailure(Cause.NO_REPLICA, "no cloud replica is usable now")
            self.replicas.acquire(self.client)
        if self.call is None:
            self.call = self.client.stub.Session(metadata=self.client.metadata)
        if self.abandoned is not None:
            await self._close_abandoned()
        answer = await self._exchange(pb.EdgeFrame(open=pb.OpenSession(
            prompt_ids=context, sampling=sampling_to_proto(self.sampling), vocab_fingerprint=self.vocab_fingerprint,
            first_token=first_token)))
        if answer.WhichOneof("frame") == "error":
            raise self._failure(answer.error, len(context))
        if answer.opened.HasField("limits"):
            self.client.limits = CloudLimits.from_proto(answer.opened.limits)
        self.session_id = answer.opened.session_id
        self._first_token = answer.opened.first_token if answer.opened.HasField("first_token") else None
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
            await self._exchange(pb.EdgeFrame(open=pb.OpenSession(resume_session_id=abandoned,
                                                                  vocab_fingerprint=self.vocab_fingerprint)))

    def _failure(self, error: pb.Error, context_length: int) -> Exception:
        """What an error frame means (edge/cloud_link/failures.py): a resync, a retry (here or elsewhere), or a
        refusal. On a stream that carried candidates the retry takes a fresh stream: the cloud may still answer
        candidates on this one (NOT_FOUND for a session that is gone), and those answers must not be read as
        the retry's."""
        cause, code = classify(error), status_of(error.code)
        action = ACTIONS[cause]
        if action.gives_up:
            return CloudRefused(code, error.message)
        if action.resync:  # the cloud lost or misplaced our context: hand it over again
            log.info("cloud %s asked for a resync (%s); reopening with %d tokens", self.client.endpoint.address,
                     error.message, context_length)
            self.session_id = None
        hint_s = error.retry_after_ms / 1e3 if action.honours_hint else 0.0
        return RetryableFailure(cause, f"{code.name}: {error.message}", hint_s,
                                stale_stream=self._call_has_candidates)

    @property
    def epoch(self) -> int:
        """The epoch of the verify frame written last (see `send_candidate`)."""
        return self._epoch

    async def send_candidate(self, frame: pb.VerifyBlock, epoch: int) -> bool:
        """Write a candidate behind the block of `epoch`, on that block's stream; False if that is no longer
        possible (a retry or reopen since: the cloud would drop it anyway). Never raises: a broken stream
        shows on the verdict's read, which the verify in flight handles."""
        if self.call is None or self.session_id is None or epoch != self._epoch:
            return False
        edge_frame = pb.EdgeFrame(verify=frame)
        try:
            async with self._write_lock:
                if epoch != self._epoch or self.call is None:
                    return False
                self._call_has_candidates = True
                await asyncio.wait_for(self.call.write(edge_frame), self.client.endpoint.deadline_s)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError):
            return False
        self.uplink_bytes += edge_frame.ByteSize()
        return epoch == self._epoch

    async def _read_candidate_verdict(self, context: list[int], frame: pb.VerifyBlock) -> pb.Verdict:
        """The verdict on a candidate the cloud matched: the next frame on the stream, named by its block."""
        try:
            answer = await self._read()
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError) as err:
            raise self._stream_failure(err) from err
        if answer.WhichOneof("frame") == "error":
            raise self._failure(answer.error, len(context))
        if not answer.verdict.candidate or answer.verdict.start_position != frame.start_position:
            # Not what this edge and the cloud agreed would come: the stream is out of step, start afresh.
            raise RetryableFailure(Cause.OUT_OF_STEP, "the cloud answered another block than the candidate")
        self.verdict_epoch = self._epoch
        return answer.verdict

    async def _attempt(self, context: list[int], frame: pb.EdgeFrame) -> pb.Verdict:
        if self._opening is not None:
            opening, self._opening = self._opening, None
            await opening
            if self._early_failure is not None:
                failure, self._early_failure = self._early_failure, None
                raise failure
        try:
            if self.session_id is None:
                await self._open(context)
            answer = await self._exchange(frame)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError) as err:
            raise self._stream_failure(err) from err
        if answer.WhichOneof("frame") == "verdict":
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
        return await self.verify_block(context, verify_frame(len(context), draft_tokens, method, draft_token_probs,
                                                             draft_dists))

    async def verify_block(self, context: list[int], block: pb.VerifyBlock,
                           matched_candidate: bool = False) -> pb.Verdict:
        """Verify `block` following `context` (the edge's committed tokens). With `matched_candidate` the block
        went out as a candidate the cloud has matched: its verdict is read, not asked for; should that fail,
        the block is sent again the ordinary way."""
        frame = pb.EdgeFrame(verify=pb.VerifyBlock(start_position=block.start_position, draft_tokens=block.draft_tokens,
                                                   draft_token_probs=block.draft_token_probs,
                                                   draft_dists=block.draft_dists, method=block.method))
        last_failure: RetryableFailure | None = None
        failures = tries = 0  # failures: replicas out of reach (they count against the attempts); tries: all
        while failures < self.replicas.attempts:
            try:
                if tries == 0 and matched_candidate:
                    verdict = await self._read_candidate_verdict(context, block)
                else:
                    verdict = await self._attempt(context, frame)
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
                await self._leave()
                return
        if client is None:  # no replica was usable: wait for one to come back
            delay = backoff_delay(attempt, 0.2, 2.0)
        else:
            endpoint = client.endpoint
            delay = 0.0 if failure.action.resync and attempt == 0 else backoff_delay(attempt, endpoint.backoff_s,
                                                                                     endpoint.max_backoff_s)
            delay = min(max(delay, failure.retry_after_s), endpoint.deadline_s)
        if not await sleep_within(delay, self.deadline_at):
            await self._reset()
            raise DeadlinePassed(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 f"the request's deadline passed while the cloud was unavailable ({failure})")

    async def _reset(self) -> None:
        if self.call is not None:
            self.call.cancel()
        self.call, self._call_has_candidates = None, False
        if self.session_id is not None and self.client is not None:
            self.abandoned = (self.client, self.session_id)
        self.session_id = None

    async def _leave(self) -> None:
        """Off this replica: the next open chooses again."""
        if self.call is not None:
            await self._close_call()
        if self.client is not None:
            self.replicas.release(self.client)
        self.client, self.session_id = None, None

    async def _close_call(self) -> None:
        try:
            await asyncio.wait_for(self.call.write(pb.EdgeFrame(close=pb.CloseSession())), 1.0)
            await asyncio.wait_for(self.call.done_writing(), 1.0)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, asyncio.TimeoutError):
            self.call.cancel()
        self.call, self._call_has_candidates = None, False

    async def close(self) -> None:
        if self._opening is not None:  # cancelled mid-open: the stream is closed below, its answer unread
            self._opening.cancel()
            await asyncio.gather(self._opening, return_exceptions=True)
            self._opening = None
        await self._leave()
