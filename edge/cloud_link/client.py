"""The edge's connection to one cloud replica: a channel with keepalive, its limits, clear failure.

`CloudClient` is one replica (one channel, shared by all sessions there): GetInfo, Generate (mode
target) with a per-chunk deadline, and the stub a `CloudSession` (edge/cloud_link/session.py) streams
on. The errors say what a caller may do: `CloudUnavailable` (out of reach after the retries: carry
on from the draft), `CloudRefused` (no retry can fix it), both `CloudLinkError`s. Why one attempt of a
session failed, and what the session does next, is edge/cloud_link/failures.py's table. The cloud's
limits (`CloudLimits`) are read from GetInfo and from every session it opens. Several replicas are an
`edge/cloud_link/replicas.py` `ReplicaSet`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import wire
from common.admission import Admission, QueuePlace
from common.errors import SprinterError
from common.tracing import tracer
from common.sampling.distributions import SamplingParams
from common.wire import CloudLimits
from edge.cloud_link.failures import Cause, classify_status
from sprinter.v1 import decoding_pb2 as pb
from sprinter.v1 import decoding_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TargetService"].full_name  # as the cloud's health service names it


class CloudLinkError(SprinterError):
    """Whatever the edge's link to the cloud raises: it carries the gRPC status that caused it."""

    def __init__(self, code: grpc.StatusCode | int, message: str, retry_after_s: float = 0.0) -> None:
        self.code = wire.status_of(code)
        self.detail = message
        self.retry_after_s = retry_after_s  # > 0: the cloud is busy, and says when a retry may succeed
        super().__init__(f"{self.code.name}: {message}")


class CloudUnavailable(CloudLinkError):
    """The cloud could not be reached within the retries: decode from the draft alone for now."""

    reason = "cloud_unreachable"  # why the generation degrades (the API's `degraded_reason`)


class DeadlinePassed(CloudUnavailable):
    """The request's own deadline passed while it waited for the cloud: the rest comes from the draft alone."""

    reason = "deadline"

    def __init__(self, code: grpc.StatusCode | int, message: str, loading: bool = False) -> None:
        super().__init__(code, message)
        if loading:  # it waited for a cloud that answered but was still loading its model
            self.reason = "loading"


class CloudLoading(CloudUnavailable):
    """The cloud answers but is still loading its model (health NOT_SERVING): waited for, as a busy one is."""

    reason = "loading"


def time_left(deadline_at: float | None) -> float | None:
    """Seconds until `deadline_at` (time.monotonic()), never below 0; None without a deadline."""
    return None if deadline_at is None else max(0.0, deadline_at - time.monotonic())


async def sleep_within(delay_s: float, deadline_at: float | None) -> bool:
    """Sleep `delay_s`, or until `deadline_at` if that comes first; False when the deadline cut it short."""
    left = time_left(deadline_at)
    await asyncio.sleep(delay_s if left is None else min(delay_s, left))
    return left is None or left > delay_s


def wait_limit(frame_deadline_s: float, deadline_at: float | None) -> tuple[float, bool]:
    """How long one read may wait, and whether the request's deadline (not the frame's) is what limits it."""
    left = time_left(deadline_at)
    return (left, True) if left is not None and left < frame_deadline_s else (frame_deadline_s, False)


class CloudRefused(CloudLinkError):
    """The cloud refused a frame for a reason a retry cannot fix (a bug, a limit, or a misconfiguration)."""


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

    def _error(self, err: grpc.aio.AioRpcError) -> CloudLinkError:
        if classify_status(err.code()) is Cause.REPLICA_FAILED:
            return CloudUnavailable(err.code(), f"cloud {self.endpoint.address}: {err.details()}")
        return CloudRefused(err.code(), err.details() or "", wire.retry_hint_s(err.trailing_metadata()))

    async def info(self, timeout_s: float | None = None) -> pb.ServiceInfo:
        """GetInfo; CloudLoading from a cloud whose health says NOT_SERVING (its model still loading)."""
        timeout_s = timeout_s or self.endpoint.deadline_s
        try:
            info = await self.stub.GetInfo(wire.info_request(), timeout=timeout_s, metadata=self.metadata)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE and await self._loading(timeout_s):
                raise CloudLoading(err.code(), f"cloud {self.endpoint.address} is still loading its model") from err
            raise self._error(err) from err
        self.limits = CloudLimits.from_proto(info.limits)
        return info

    async def _loading(self, timeout_s: float) -> bool:
        """The cloud answers its health check with NOT_SERVING: it is up, its model not yet loaded."""
        try:
            answer = await health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout_s, metadata=self.metadata)
        except grpc.aio.AioRpcError:
            return False
        return answer.status == health_pb2.HealthCheckResponse.NOT_SERVING

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, max_new_tokens: int,
                       vocab_fingerprint: str = "", deadline_at: float | None = None,
                       output_start: int | None = None, speculate_block: int | None = None,
                       proposer: str | None = None, admission: Admission | None = None,
                       on_ticket: Callable[[QueuePlace], None] = lambda place: None) -> AsyncIterator[pb.GenerateChunk]:
        """Mode `target`: the cloud generates alone; chunks arrive as tokens are made (`output_start`: where
        tokens generated before this call begin in `prompt_ids`, which the penalties count). With
        `speculate_block`, mode cloud-sd: the cloud drafts and verifies by itself, a chunk per round, its tokens
        proposed by `proposer` (None: the cloud's default). While the request waits in the cloud's line,
        `on_ticket` hears its place (those chunks are not passed on).

        No whole-call deadline unless the request set one (`deadline_at`, time.monotonic(): DeadlinePassed),
        but each chunk must come within `deadline_s`: a Generate that hangs ends as CloudUnavailable
        instead of holding the request forever.
        """
        request = wire.generate_request(prompt_ids, sampling, max_new_tokens, vocab_fingerprint, output_start,
                                        speculate_block, proposer, admission)
        call = self.stub.Generate(request, metadata=tracer.metadata(self.metadata))
        limit, request_bound = self.endpoint.deadline_s, False
        try:
            while True:
                limit, request_bound = wait_limit(self.endpoint.deadline_s, deadline_at)
                if (chunk := await asyncio.wait_for(call.read(), limit)) is grpc.aio.EOF:
                    break
                if (place := wire.place_of(chunk)) is not None:  # still in line: the next ticket or token resets the wait
                    on_ticket(place)
                    continue
                yield chunk
        except asyncio.TimeoutError as err:
            if request_bound:
                raise DeadlinePassed(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed while "
                                     "the cloud generated") from err
            raise CloudUnavailable(grpc.StatusCode.DEADLINE_EXCEEDED, f"cloud {self.endpoint.address}: no token within "
                                   f"{self.endpoint.deadline_s:g} s; Generate abandoned") from err
        except grpc.aio.AioRpcError as err:
            raise self._error(err) from err
        finally:
            call.cancel()
