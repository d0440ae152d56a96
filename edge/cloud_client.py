"""The edge's connection to the cloud: one channel, sessions that heal themselves, clear failure.

A `CloudSession` is one generation's Session stream. The edge always knows the full context, so
whenever the cloud loses track (desync: FAILED_PRECONDITION; eviction or restart: NOT_FOUND; a
broken stream) the session reopens with that context and retries. A cloud that says "not now"
(RESOURCE_EXHAUSTED, UNAVAILABLE in an error frame) is retried after its `retry_after_ms`. Retries
back off exponentially with jitter; every wait on the cloud has a deadline (a verdict, a Generate
chunk, GetInfo). When the cloud stays out of reach after the retries, `CloudUnavailable` tells the
decoding loop to carry on from the draft alone; a refusal no retry can fix is `CloudRefused`.
The cloud's limits (`CloudLimits`) are read from GetInfo and from every session it opens.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import grpc

from common.sampling import FLOAT32_TINY, SamplingParams, SparseDistribution
from sprinter.v1 import decoding_pb2 as pb
from sprinter.v1 import decoding_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

RESYNC_CODES = {grpc.StatusCode.FAILED_PRECONDITION.value[0], grpc.StatusCode.NOT_FOUND.value[0]}
TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
             grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
# Refusals in an error frame that say "not now" rather than "never": retried, after Error.retry_after_ms if given.
RETRY_LATER = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}


STATUS_BY_NUMBER = {status.value[0]: status for status in grpc.StatusCode}


class CloudError(Exception):
    """Whatever the cloud client raises: it carries the gRPC status that caused it."""

    def __init__(self, code: grpc.StatusCode | int, message: str) -> None:
        self.code = STATUS_BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN) if isinstance(code, int) else code
        self.detail = message
        super().__init__(f"{self.code.name}: {message}")


class CloudUnavailable(CloudError):
    """The cloud could not be reached within the retries: decode from the draft alone for now."""


class CloudRefused(CloudError):
    """The cloud refused a frame for a reason a retry cannot fix (a bug, a limit, or a misconfiguration)."""


class RetryableFailure(Exception):
    """One attempt failed in a way another attempt may not: a broken stream, a busy cloud, a lost session."""

    def __init__(self, reason: str, retry_after_s: float = 0.0, resync: bool = False, reset: bool = False) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s  # the cloud's own hint (Error.retry_after_ms)
        self.resync = resync  # the cloud lost our session: reopen with the full context
        self.reset = reset  # the stream itself is gone: open a new one


@dataclass(frozen=True)
class CloudLimits:
    """The cloud's ServiceInfo.limits (None: the cloud did not say). The edge shapes its frames to fit them."""

    max_block: int | None = None  # draft tokens per verify frame
    max_context: int | None = None  # prompt + generated tokens per session (and per Generate)
    max_sparse_support: int | None = None  # entries per sparse draft distribution

    @classmethod
    def from_proto(cls, limits: pb.Limits) -> "CloudLimits":
        return cls(limits.max_block or None, limits.max_context or None, limits.max_sparse_support or None)


@dataclass(frozen=True)
class CloudEndpoint:
    address: str  # host:port
    tls_ca: Path | None = None  # PEM roots to trust; set it to speak TLS
    tls_server_name: str | None = None  # override the name checked against the certificate
    token: str | None = None  # bearer token of this edge
    deadline_s: float = 30.0  # per verify round trip and per Generate chunk (a cold target forward on CPU takes seconds)
    retries: int = 2
    backoff_s: float = 0.2  # first retry delay; doubles per attempt, with jitter
    max_backoff_s: float = 5.0


def backoff_delay(attempt: int, base_s: float, cap_s: float, rng: random.Random | None = None) -> float:
    """Exponential backoff with jitter: base * 2^attempt (capped), times a random factor in [0.5, 1.5).

    The jitter keeps edges that lost the cloud at the same moment from coming back in lockstep.
    """
    return min(cap_s, base_s * 2 ** attempt) * (rng or random).uniform(0.5, 1.5)


def sampling_to_proto(sampling: SamplingParams) -> pb.SamplingSettings:
    # The wire's floats are 32-bit: a top_p below their range would arrive as 0 (refused); it means "the argmax alone",
    # which the smallest float32 means too.
    return pb.SamplingSettings(temperature=sampling.temperature, top_k=sampling.top_k,
                               top_p=max(sampling.top_p, FLOAT32_TINY), seed=sampling.seed)


class CloudClient:
    """`async with CloudClient(endpoint) as cloud:` one channel with keepalive, shared by all sessions.

    `limits` are the cloud's, as last heard: from GetInfo, and from every session it opens (a cloud
    restarted with other limits says so when the edge reopens there).
    """

    def __init__(self, endpoint: CloudEndpoint) -> None:
        self.endpoint = endpoint
        self.channel: grpc.aio.Channel | None = None
        self.stub: pb_grpc.TargetServiceStub | None = None
        self.metadata = (("authorization", f"Bearer {endpoint.token}"),) if endpoint.token else None
        self.limits = CloudLimits()

    async def __aenter__(self) -> "CloudClient":
        # Keepalive pings every 20 s find a dead link between requests; the cloud permits them
        # (cloud/server.py: keepalive_permit_without_calls, min ping interval 10 s).
        options = [("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 5_000),
                   ("grpc.keepalive_permit_without_calls", 1), ("grpc.max_receive_message_length", 4 << 20),
                   ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2_000)]
        if self.endpoint.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.endpoint.tls_server_name))
        if self.endpoint.tls_ca:
            credentials = grpc.ssl_channel_credentials(root_certificates=Path(self.endpoint.tls_ca).read_bytes())
            self.channel = grpc.aio.secure_channel(self.endpoint.address, credentials, options=options)
        else:
            self.channel = grpc.aio.insecure_channel(self.endpoint.address, options=options)
        self.stub = pb_grpc.TargetServiceStub(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.channel is not None:
            await self.channel.close()

    def _error(self, err: grpc.aio.AioRpcError) -> CloudError:
        if err.code() in TRANSIENT:
            return CloudUnavailable(err.code(), f"cloud {self.endpoint.address}: {err.details()}")
        return CloudRefused(err.code(), err.details() or "")

    async def info(self) -> pb.ServiceInfo:
        try:
            info = await self.stub.GetInfo(pb.GetInfoRequest(), timeout=self.endpoint.deadline_s, metadata=self.metadata)
        except grpc.aio.AioRpcError as err:
            raise self._error(err) from err
        self.limits = CloudLimits.from_proto(info.limits)
        return info

    def session(self, sampling: SamplingParams, vocab_fingerprint: str = "") -> "CloudSession":
        return CloudSession(self, sampling, vocab_fingerprint)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, max_new_tokens: int,
                       vocab_fingerprint: str = "") -> AsyncIterator[pb.GenerateChunk]:
        """Mode `target`: the cloud generates alone; chunks arrive as tokens are made.

        No whole-call deadline (a long generation is legitimate), but each chunk must come within
        `deadline_s`: a Generate that hangs ends as CloudUnavailable instead of holding the request forever.
        """
        request = pb.GenerateRequest(prompt_ids=prompt_ids, sampling=sampling_to_proto(sampling),
                                     max_new_tokens=max_new_tokens, vocab_fingerprint=vocab_fingerprint)
        call = self.stub.Generate(request, metadata=self.metadata)
        try:
            while (chunk := await asyncio.wait_for(call.read(), self.endpoint.deadline_s)) is not grpc.aio.EOF:
                yield chunk
        except asyncio.TimeoutError as err:
            raise CloudUnavailable(grpc.StatusCode.DEADLINE_EXCEEDED, f"cloud {self.endpoint.address}: no token within "
                                   f"{self.endpoint.deadline_s:g} s; Generate abandoned") from err
        except grpc.aio.AioRpcError as err:
            raise self._error(err) from err
        finally:
            call.cancel()


class CloudSession:
    """One generation's Session stream; reopens with the full context whenever the cloud lost it."""

    def __init__(self, client: CloudClient, sampling: SamplingParams, vocab_fingerprint: str) -> None:
        self.client = client
        self.sampling = sampling
        self.vocab_fingerprint = vocab_fingerprint
        self.call: grpc.aio.StreamStreamCall | None = None
        self.session_id: str | None = None
        self.abandoned_id: str | None = None  # a session left behind on a broken stream, to be closed
        self.reopens = 0

    async def _exchange(self, frame: pb.EdgeFrame) -> pb.CloudFrame:
        await asyncio.wait_for(self.call.write(frame), self.client.endpoint.deadline_s)
        answer = await asyncio.wait_for(self.call.read(), self.client.endpoint.deadline_s)
        if answer is grpc.aio.EOF:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "the cloud ended the stream")
        return answer

    async def _open(self, context: list[int]) -> None:
        if self.call is None:
            self.call = self.client.stub.Session(metadata=self.client.metadata)
        if self.abandoned_id is not None:
            await self._close_abandoned()
        answer = await self._exchange(pb.EdgeFrame(open=pb.OpenSession(
            prompt_ids=context, sampling=sampling_to_proto(self.sampling), vocab_fingerprint=self.vocab_fingerprint)))
        if answer.WhichOneof("frame") == "error":
            raise self._failure(answer.error, len(context))
        if answer.opened.HasField("limits"):
            self.client.limits = CloudLimits.from_proto(answer.opened.limits)
        self.session_id = answer.opened.session_id

    async def _close_abandoned(self) -> None:
        """Take back the session a broken stream left on the cloud, so that the fresh open closes it.

        The cloud keeps a session past its stream (it may be resumed); a stream holds one session, and
        a second open on it closes the first. Without this, every deadline the edge gives up on would
        leave a session holding KV until its idle timeout. Whatever the answer (gone already: NOT_FOUND),
        the fresh open follows.
        """
        abandoned, self.abandoned_id = self.abandoned_id, None
        await self._exchange(pb.EdgeFrame(open=pb.OpenSession(resume_session_id=abandoned,
                                                              vocab_fingerprint=self.vocab_fingerprint)))

    def _failure(self, error: pb.Error, context_length: int) -> Exception:
        """What an error frame means: a resync, a retry later, or a refusal."""
        code = STATUS_BY_NUMBER.get(error.code, grpc.StatusCode.UNKNOWN)
        if error.code in RESYNC_CODES:  # the cloud lost or misplaced our context: hand it over again
            log.info("cloud asked for a resync (%s); reopening with %d tokens", error.message, context_length)
            self.session_id = None
            self.reopens += 1
            return RetryableFailure(f"{code.name}: {error.message}", resync=True)
        if code in RETRY_LATER:  # busy or shutting down; a draining cloud is better left on a fresh stream
            return RetryableFailure(f"{code.name}: {error.message}", error.retry_after_ms / 1e3,
                                    reset=code == grpc.StatusCode.UNAVAILABLE)
        return CloudRefused(code, error.message)

    async def _attempt(self, context: list[int], frame: pb.EdgeFrame) -> pb.Verdict:
        try:
            if self.session_id is None:
                await self._open(context)
            answer = await self._exchange(frame)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError) as err:
            # a stream that broke mid-frame surfaces as a status, a timeout, or a write to a finished call
            code = err.code() if isinstance(err, grpc.aio.AioRpcError) else grpc.StatusCode.UNAVAILABLE
            if code not in TRANSIENT:
                raise CloudRefused(code, err.details() or "") from err  # only an AioRpcError gets here
            raise RetryableFailure(repr(err), reset=True) from err
        if answer.WhichOneof("frame") == "verdict":
            return answer.verdict
        raise self._failure(answer.error, len(context))

    async def verify(self, context: list[int], draft_tokens: list[int], method: int,
                     draft_token_probs: list[float] | None = None,
                     draft_dists: list[SparseDistribution] | None = None) -> pb.Verdict:
        """Verify `draft_tokens` following `context` (the edge's committed tokens).

        Retries with jittered exponential backoff (at least the cloud's retry_after_ms when it gives
        one; never longer than the deadline); the first reopen after a lost session is immediate.
        """
        endpoint = self.client.endpoint
        frame = pb.EdgeFrame(verify=pb.VerifyBlock(
            start_position=len(context), draft_tokens=draft_tokens, method=method,
            draft_token_probs=draft_token_probs or [],
            draft_dists=[pb.SparseDistribution(token_ids=d.token_ids.tolist(), probs=d.probs.tolist())
                         for d in draft_dists or []]))
        for attempt in range(endpoint.retries + 1):
            try:
                return await self._attempt(context, frame)
            except RetryableFailure as failure:
                last_failure = failure
                if failure.reset:
                    await self._reset()
                if attempt == endpoint.retries:
                    break
                delay = 0.0 if failure.resync and attempt == 0 else backoff_delay(attempt, endpoint.backoff_s,
                                                                                  endpoint.max_backoff_s)
                await asyncio.sleep(min(max(delay, failure.retry_after_s), endpoint.deadline_s))
        raise CloudUnavailable(grpc.StatusCode.UNAVAILABLE, f"cloud {endpoint.address} unavailable after "
                               f"{endpoint.retries + 1} attempts: {last_failure}")

    async def _reset(self) -> None:
        if self.call is not None:
            self.call.cancel()
        self.call = None
        if self.session_id is not None:
            self.abandoned_id = self.session_id
        self.session_id = None

    async def close(self) -> None:
        if self.call is None:
            return
        try:
            await asyncio.wait_for(self.call.write(pb.EdgeFrame(close=pb.CloseSession())), 1.0)
            await asyncio.wait_for(self.call.done_writing(), 1.0)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, asyncio.TimeoutError):
            self.call.cancel()
        self.call = None
        self.session_id = None
