"""The edge's connection to the cloud: one channel, sessions that heal themselves, clear failure.

A `CloudSession` is one generation's Session stream. The edge always knows the full context, so
whenever the cloud loses track (desync: FAILED_PRECONDITION; eviction or restart: NOT_FOUND; a
broken stream) the session reopens with that context and retries. When the cloud stays out of
reach after the retries, `CloudUnavailable` tells the decoding loop to carry on from the draft alone.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import grpc

from common.sampling import SamplingParams, SparseDistribution
from sprinter.v1 import decoding_pb2 as pb
from sprinter.v1 import decoding_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

RESYNC_CODES = {grpc.StatusCode.FAILED_PRECONDITION.value[0], grpc.StatusCode.NOT_FOUND.value[0]}
TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
             grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


STATUS_BY_NUMBER = {status.value[0]: status for status in grpc.StatusCode}


class CloudError(Exception):
    """Whatever the cloud client raises: it carries the gRPC status that caused it."""

    def __init__(self, code: grpc.StatusCode | int, message: str) -> None:
        self.code = STATUS_BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN) if isinstance(code, int) else code
        super().__init__(f"{self.code.name}: {message}")


class CloudUnavailable(CloudError):
    """The cloud could not be reached within the retries: decode from the draft alone for now."""


class CloudRefused(CloudError):
    """The cloud refused a frame for a reason a retry cannot fix (a bug or a misconfiguration)."""


@dataclass(frozen=True)
class CloudEndpoint:
    address: str  # host:port
    tls_ca: Path | None = None  # PEM roots to trust; set it to speak TLS
    tls_server_name: str | None = None  # override the name checked against the certificate
    token: str | None = None  # bearer token of this edge
    deadline_s: float = 30.0  # per verify round trip (a cold target forward on CPU can take seconds)
    retries: int = 2
    backoff_s: float = 0.2


def sampling_to_proto(sampling: SamplingParams) -> pb.SamplingSettings:
    return pb.SamplingSettings(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                               seed=sampling.seed)


class CloudClient:
    """`async with CloudClient(endpoint) as cloud:` one channel with keepalive, shared by all sessions."""

    def __init__(self, endpoint: CloudEndpoint) -> None:
        self.endpoint = endpoint
        self.channel: grpc.aio.Channel | None = None
        self.stub: pb_grpc.TargetServiceStub | None = None
        self.metadata = (("authorization", f"Bearer {endpoint.token}"),) if endpoint.token else None

    async def __aenter__(self) -> "CloudClient":
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

    async def info(self) -> pb.ServiceInfo:
        try:
            return await self.stub.GetInfo(pb.GetInfoRequest(), timeout=self.endpoint.deadline_s, metadata=self.metadata)
        except grpc.aio.AioRpcError as err:
            if err.code() in TRANSIENT:
                raise CloudUnavailable(err.code(), f"cloud {self.endpoint.address}: {err.details()}") from err
            raise CloudRefused(err.code(), err.details() or "") from err

    def session(self, sampling: SamplingParams, vocab_fingerprint: str = "") -> "CloudSession":
        return CloudSession(self, sampling, vocab_fingerprint)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, max_new_tokens: int,
                       vocab_fingerprint: str = "") -> AsyncIterator[int]:
        """Mode `target`: the cloud generates alone; tokens arrive as they are made."""
        request = pb.GenerateRequest(prompt_ids=prompt_ids, sampling=sampling_to_proto(sampling),
                                     max_new_tokens=max_new_tokens, vocab_fingerprint=vocab_fingerprint)
        try:
            async for chunk in self.stub.Generate(request, metadata=self.metadata):
                for token in chunk.token_ids:
                    yield token
        except grpc.aio.AioRpcError as err:
            if err.code() in TRANSIENT:
                raise CloudUnavailable(err.code(), f"cloud {self.endpoint.address}: {err.details()}") from err
            raise CloudRefused(err.code(), err.details() or "") from err


class CloudSession:
    """One generation's Session stream; reopens with the full context whenever the cloud lost it."""

    def __init__(self, client: CloudClient, sampling: SamplingParams, vocab_fingerprint: str) -> None:
        self.client = client
        self.sampling = sampling
        self.vocab_fingerprint = vocab_fingerprint
        self.call: grpc.aio.StreamStreamCall | None = None
        self.session_id: str | None = None
        self.reopens = 0

    async def _exchange(self, frame: pb.EdgeFrame) -> pb.CloudFrame:
        await self.call.write(frame)
        answer = await asyncio.wait_for(self.call.read(), self.client.endpoint.deadline_s)
        if answer is grpc.aio.EOF:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "the cloud ended the stream")
        return answer

    async def _open(self, context: list[int]) -> None:
        if self.call is None:
            self.call = self.client.stub.Session(metadata=self.client.metadata)
        answer = await self._exchange(pb.EdgeFrame(open=pb.OpenSession(
            prompt_ids=context, sampling=sampling_to_proto(self.sampling), vocab_fingerprint=self.vocab_fingerprint)))
        if answer.WhichOneof("frame") == "error":
            raise CloudRefused(answer.error.code, answer.error.message)
        self.session_id = answer.opened.session_id

    async def verify(self, context: list[int], draft_tokens: list[int], method: int,
                     draft_token_probs: list[float] | None = None,
                     draft_dists: list[SparseDistribution] | None = None) -> pb.Verdict:
        """Verify `draft_tokens` following `context` (the edge's committed tokens)."""
        frame = pb.EdgeFrame(verify=pb.VerifyBlock(
            start_position=len(context), draft_tokens=draft_tokens, method=method,
            draft_token_probs=draft_token_probs or [],
            draft_dists=[pb.SparseDistribution(token_ids=d.token_ids.tolist(), probs=d.probs.tolist())
                         for d in draft_dists or []]))
        last_error: Exception | None = None
        for attempt in range(self.client.endpoint.retries + 1):
            try:
                if self.session_id is None:
                    await self._open(context)
                answer = await self._exchange(frame)
                kind = answer.WhichOneof("frame")
                if kind == "verdict":
                    return answer.verdict
                if answer.error.code in RESYNC_CODES:  # the cloud lost or misplaced our context: hand it over again
                    log.info("cloud asked for a resync (%s); reopening with %d tokens", answer.error.message, len(context))
                    self.session_id = None
                    self.reopens += 1
                    continue
                raise CloudRefused(answer.error.code, answer.error.message)
            except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError) as err:
                # a stream that broke mid-frame surfaces as a status, a timeout, or a write to a finished call
                code = err.code() if isinstance(err, grpc.aio.AioRpcError) else grpc.StatusCode.UNAVAILABLE
                if code not in TRANSIENT:
                    raise CloudRefused(code, err.details() or "") from err  # only an AioRpcError gets here
                last_error = err
                await self._reset()
                await asyncio.sleep(self.client.endpoint.backoff_s * 2 ** attempt)
        raise CloudUnavailable(grpc.StatusCode.UNAVAILABLE, f"cloud {self.client.endpoint.address} unreachable after "
                               f"{self.client.endpoint.retries + 1} attempts: {last_error!r}")

    async def _reset(self) -> None:
        if self.call is not None:
            self.call.cancel()
        self.call = None
        self.session_id = None

    async def close(self) -> None:
        if self.call is None:
            return
        try:
            await self.call.write(pb.EdgeFrame(close=pb.CloseSession()))
            await self.call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass
        self.call = None
        self.session_id = None
