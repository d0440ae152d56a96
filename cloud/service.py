"""The gRPC TargetService: sessions that verify edge blocks, and cloud-only generation.

A bad frame is answered with an Error frame carrying the gRPC status code and a message (and, for
RESOURCE_EXHAUSTED, a retry hint); the stream and the session stay usable, and no other session
notices. Calls that cannot start (no or wrong bearer token, model still loading, draining, too many
streams) end with that status instead, a retry hint in trailing metadata `retry-after-ms`.

A stream holds one session at a time: a second open closes the first. When a caller goes away, the
work it queued is skipped before its forward (`abandoned`), and its session stays for a resume.

Frames are served in order, one at a time per stream. A candidate (a verify frame with `after`) is
read after the verdict it was drafted for: if it follows that verdict it is verified at once, with
no round trip to the edge in between; otherwise it is dropped before any check or forward, without
a reply (the edge knows the verdict, so it knows which candidate, if any, it will hear about). A
candidate for a session that is gone (evicted, expired) is answered NOT_FOUND like any verify: the
edge then reopens on a fresh stream, leaving any further such answers behind with the old one.

Work the cloud cannot admit now (an open, a verify's KV, a Generate) waits in the admission queue
(cloud/admission_queue.py); to an edge whose open (or Generate) says it reads them, the stream meanwhile
carries queue tickets (`in_line`, `relayed`), then the answer. Other edges are refused with a retry hint.

A verify sent with dists_on_rejection may be answered with a residual query (cloud/residual.py) instead
of its verdict; the edge's next frame must be the residual answer. Any other frame, or the stream's
end, abandons that verify first (its forward rolled back), then is served as usual.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Generic, TypeVar

import grpc

from cloud.admission_queue import Tell
from cloud.auth import EdgeAuthenticator
from cloud.target_host import TargetHost
from cloud.errors import CloudError, exhausted
from cloud.metrics import CloudMetrics
from cloud.quotas import STREAMS_RETRY_MS
from cloud.sessions import Session
from common import wire
from common.admission import QueuePlace
from common.tracing import tracer
from sprinter.v1 import decoding_pb2 as pb
from sprinter.v1 import decoding_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")


class TargetServicer(pb_grpc.TargetServiceServicer):
    def __init__(self, authenticator: EdgeAuthenticator, metrics: CloudMetrics, max_streams: int = 256) -> None:
        self.authenticator = authenticator
        self.metrics = metrics
        self.max_streams = max_streams  # Session + Generate calls at once, all edges together
        self.host: TargetHost | None = None  # set once the model is loaded
        self.draining = False
        self.open_streams = 0

    async def _refuse(self, context: grpc.aio.ServicerContext, err: CloudError) -> None:
        self.metrics.errors.labels(err.code.name).inc()
        await context.abort(err.code, str(err), trailing_metadata=err.trailing_metadata())

    async def _admit(self, context: grpc.aio.ServicerContext, stream: bool = False) -> tuple[str, TargetHost]:
        identity = self.authenticator.identify(context.invocation_metadata())
        if identity is None:
            await self._refuse(context, CloudError(grpc.StatusCode.UNAUTHENTICATED,
                                                   "missing or unknown bearer token: send metadata 'authorization: Bearer <token>'"))
        if self.host is None:
            await self._refuse(context, CloudError(grpc.StatusCode.UNAVAILABLE,
                                                   "the target model is still loading; retry shortly", 1000))
        if self.draining:
            await self._refuse(context, CloudError(grpc.StatusCode.UNAVAILABLE,
                                                   "this cloud is shutting down; connect to another replica"))
        if stream and self.open_streams >= self.max_streams:
            await self._refuse(context, exhausted(f"this cloud serves {self.max_streams} streams at once (--max-streams), "
                                                  "all in use; retry shortly", STREAMS_RETRY_MS))
        return identity, self.host

    def _error_frame(self, err: CloudError, session: Session | None) -> pb.CloudFrame:
        self.metrics.errors.labels(err.code.name).inc()
        log.info("refused frame: %s %s", err.code.name, err)
        return wire.error_frame(err.code, str(err), err.retry_after_ms, session.length if session else 0)

    async def GetInfo(self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext) -> pb.ServiceInfo:
        _, host = await self._admit(context)
        return host.info()

    async def Session(self, request_iterator: AsyncIterator[pb.EdgeFrame],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.CloudFrame]:
        owner, host = await self._admit(context, stream=True)
        # the edge's trace context rides in the call's metadata: this stream's spans join its request's trace
        with tracer.span("cloud.session", remote=context.invocation_metadata(), edge=owner):
            async for answer in self._frames(owner, host, request_iterator, context):
                yield answer

    async def _frames(self, owner: str, host: TargetHost, request_iterator: AsyncIterator[pb.EdgeFrame],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.CloudFrame]:
        stream = _Stream(owner, host, context)
        self.open_streams += 1
        try:
            async for frame in request_iterator:
                kind = frame.WhichOneof("frame")
                session = stream.session
                if kind != "residual_answer" and session is not None:
                    host.abandon_residual(session)  # anything but the answer gives up a verify waiting on one
                try:
                    if kind == "open":
                        if self.draining:
                            raise CloudError(grpc.StatusCode.UNAVAILABLE, "this cloud is shutting down; open the session elsewhere")
                        async for answer in stream.open(frame.open):
                            yield answer
                    elif kind == "verify":
                        async for answer in stream.verify(frame.verify):
                            yield answer
                    elif kind == "residual_answer":
                        if session is None:
                            raise CloudError(grpc.StatusCode.FAILED_PRECONDITION, "residual_answer before open")
                        yield wire.cloud_frame(host.answer_residual(session, frame.residual_answer))
                    elif kind == "close":
                        if session is not None:
                            host.close(session)
                        return
                    else:
                        raise CloudError(grpc.StatusCode.INVALID_ARGUMENT, "empty frame: set one of open, verify, residual_answer or close")
                except CloudError as err:
                    session = stream.session
                    yield self._error_frame(err, session if session and host.store.contains(session.session_id) else None)
                except Exception as err:  # a bug of ours: say so on this frame, keep the stream and the server up
                    log.exception("internal error on a %s frame", kind)
                    yield self._error_frame(CloudError(grpc.StatusCode.INTERNAL, f"internal error: {err}"), None)
        finally:
            stream.left = True
            self.open_streams -= 1
            if stream.session is not None:
                host.abandon_residual(stream.session)  # the edge went away mid-query: roll that verify back

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        owner, host = await self._admit(context, stream=True)
        self.open_streams += 1
        try:
            with tracer.span("cloud.generate", remote=context.invocation_metadata(), edge=owner):
                async for chunk in relayed(lambda tell: host.generate(owner, request, context.cancelled, tell),
                                           wire.admission_of(request).waits_in_line):
                    yield chunk
        except CloudError as err:
            await self._refuse(context, err)
        finally:
            self.open_streams -= 1


class _Stream:
    """One Session stream's session (a stream holds one at a time) and its open and verify frames' answers: queue
    tickets while the work waits in the cloud's line (to an edge that reads them), then the answer."""

    def __init__(self, owner: str, host: TargetHost, context: grpc.aio.ServicerContext) -> None:
        self.owner, self.host, self.context = owner, host, context
        self.session: Session | None = None
        self.left = False

    def abandoned(self) -> bool:
        return self.left or self.context.cancelled()

    async def open(self, request: pb.OpenSession) -> AsyncIterator[pb.CloudFrame]:
        with tracer.span("cloud.open", tokens=len(request.prompt_ids)):
            async for answer in self._open(request):
                yield answer

    async def _open(self, request: pb.OpenSession) -> AsyncIterator[pb.CloudFrame]:
        host, previous = self.host, self.session
        # to its end even if the edge leaves: a client that cancels mid-prefill must not leave a half-built session
        async for step in in_line(lambda tell: host.open(self.owner, request, previous, self.abandoned, tell),
                                  wire.admission_of(request).waits_in_line, undo=lambda taken: host.close(taken[0])):
            if isinstance(step, Admitted):
                self.session, resumed = step.value
            else:
                yield wire.queued(step)
        session = self.session
        first, first_logprob = None, None
        if request.first_token and not resumed:
            first, first_logprob = await asyncio.shield(host.first_token(session, self.abandoned))
        prompt_logprobs, session.prompt_logprobs = ([] if resumed else session.prompt_logprobs), []
        yield wire.opened_frame(session.session_id, session.length, host.limits.to_proto(), resumed,
                                first, first_logprob, prompt_logprobs, 0 if resumed else session.reused_tokens,
                                0.0 if resumed else session.queued_s * 1e3)

    async def verify(self, block: pb.VerifyBlock) -> AsyncIterator[pb.CloudFrame]:
        host = self.host
        if self.session is None:
            raise CloudError(grpc.StatusCode.FAILED_PRECONDITION, "verify before open: send an open frame first")
        session = self.session = host.store.get(self.session.session_id, self.owner)  # gone: NOT_FOUND, candidates too
        if wire.candidate_after(block) is not None:
            if not host.candidate_matches(session, block):
                return
            host.metrics.candidates.labels("verified").inc()
        # to its end even if the edge leaves: the cache and the token list must move together
        with tracer.span("cloud.verify", tokens=len(block.draft_tokens), position=block.start_position):
            async for step in in_line(lambda tell: host.verify(session, block, self.abandoned, tell),
                                      session.admission.waits_in_line):
                if isinstance(step, Admitted):
                    yield wire.cloud_frame(step.value)  # the verdict, or a residual query to be answered first
                else:
                    yield wire.queued(step)


@dataclass(frozen=True)
class Admitted(Generic[T]):
    value: T


async def in_line(work: Callable[[Tell | None], Awaitable[T]], reads_tickets: bool,
                  undo: Callable[[T], None] = lambda value: None) -> AsyncIterator[QueuePlace | Admitted[T]]:
    """Run `work` (handed a `tell` when the edge reads queue tickets) to its end even if the caller leaves (a session
    must not be left half-built), yielding each ticket it tells while it waits in line, then `Admitted(result)`.
    A result nobody took (the caller left first) is given back with `undo`."""
    if not reads_tickets:
        yield Admitted(await asyncio.shield(work(None)))
        return
    tickets: asyncio.Queue[QueuePlace] = asyncio.Queue()
    task = asyncio.ensure_future(work(tickets.put_nowait))
    handed, getter = False, None

    def settle(done: asyncio.Future) -> None:
        if not done.cancelled() and done.exception() is None and not handed:
            undo(done.result())

    try:
        while not task.done():
            getter = asyncio.ensure_future(tickets.get())
            await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield getter.result()
            else:
                getter.cancel()
        handed = task.exception() is None
        yield Admitted(task.result())
    finally:
        if getter is not None:
            getter.cancel()
        task.add_done_callback(settle)  # also reads the exception of a task whose caller left


async def relayed(generate: Callable[[Tell | None], AsyncIterator[pb.GenerateChunk]],
                  reads_tickets: bool) -> AsyncIterator[pb.GenerateChunk]:
    """A Generate's chunks, with a queue-ticket chunk for each ticket told while it waits in line (to an edge that
    reads them); the generation runs in a task of its own so that tickets can pass while it waits."""
    if not reads_tickets:
        async for chunk in generate(None):
            yield chunk
        return
    out: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump() -> None:
        async for chunk in generate(lambda place: out.put_nowait(wire.queued(place, generate=True))):
            out.put_nowait(chunk)

    task = asyncio.ensure_future(pump())
    task.add_done_callback(lambda _: out.put_nowait(end))
    try:
        while (item := await out.get()) is not end:
            yield item
        task.result()  # its refusal, if it ended with one
    finally:
        task.cancel()  # the edge left: the generation stops, its KV and slot given back
