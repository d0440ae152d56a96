"""The Session call a generation's session runs on: frames written one at a time, epochs, candidates.

Glossary
    stream     one bidirectional Session call on one replica; a session may go through several (a
               reset after a broken stream, a move to another replica), this object stays
    epoch      each verify frame written starts one; a candidate names the epoch of the block it
               follows, and counts only if that very write got the verdict (a retry, a reopen or a
               new stream moves the epoch on, and the cloud drops candidates of an older block)
    candidate  a block drafted ahead for one verdict of the block in flight (edge/decoding/pipeline.py),
               written behind that block on the same stream

Epochs and bytes count across the session's streams: an epoch is never reused, so a candidate from
an abandoned stream can never be taken for one of the stream that replaced it.
"""

from __future__ import annotations

import asyncio

import grpc

from common import wire
from common.tracing import tracer
from common.admission import QueuePlace
from edge.cloud_link.client import CloudClient, DeadlinePassed, wait_limit
from sprinter.v1 import decoding_pb2 as pb

STREAM_BROKE = (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError)  # how a broken stream surfaces


class SessionStream:
    """The session's current Session call (None between streams), its epochs and the link bytes it wrote."""

    def __init__(self, deadline_at: float | None) -> None:
        self.deadline_at = deadline_at  # the request's own deadline (time.monotonic()); None: as long as it takes
        self.call: grpc.aio.StreamStreamCall | None = None
        self.deadline_s = 0.0  # the replica's per-frame deadline
        self.epoch = 0  # the epoch of the verify frame written last
        self.verdict_epoch = 0  # the epoch whose write the latest verdict answered
        self.uplink_bytes = 0  # verify frames, candidates and residual answers written: what the link carried up
        self.downlink_bytes = 0  # frames read: opens, verdicts (what logprobs cost the link), residual queries
        self.residual_answers = 0  # residual queries answered (edge/cloud_link/cloud_target.py): each one more round trip
        self.has_candidates = False  # answers to candidates may still be on this call (see CloudSession._failure)
        self.ticket: QueuePlace | None = None  # the place in the cloud's line while the open or verify waits there
        self._write_lock = asyncio.Lock()  # a call takes one write at a time: candidates queue behind their block

    def start(self, client: CloudClient) -> None:
        """A call on `client`, unless one is open already."""
        if self.call is None:
            self.call = client.stub.Session(metadata=tracer.metadata(client.metadata))
            self.deadline_s = client.endpoint.deadline_s

    async def exchange(self, frame: pb.EdgeFrame) -> pb.CloudFrame:
        """Write `frame` and read the answer; a verify frame starts an epoch."""
        if frame.HasField("verify"):
            self.epoch += 1
        if frame.HasField("verify") or frame.HasField("residual_answer"):
            self.uplink_bytes += frame.ByteSize()
            self.residual_answers += frame.HasField("residual_answer")
        epoch = self.epoch
        async with self._write_lock:
            await asyncio.wait_for(self.call.write(frame), self.deadline_s)
        answer = await self.read()
        self.verdict_epoch = epoch
        return answer

    async def read(self) -> pb.CloudFrame:
        """The next answer, within the frame's deadline (a hung replica) and the request's (DeadlinePassed). Queue
        tickets before it are kept (`ticket`), not returned: each one starts the frame's deadline again, so a request
        waits on its place in the cloud's line, for as long as its own deadline allows."""
        while True:
            limit, request_bound = wait_limit(self.deadline_s, self.deadline_at)
            try:
                answer = await asyncio.wait_for(self.call.read(), limit)
            except asyncio.TimeoutError:
                if request_bound:
                    raise DeadlinePassed(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed while it "
                                         + ("waited in the cloud's line" if self.ticket else "waited for a verdict")) from None
                raise
            if answer is grpc.aio.EOF:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "the cloud ended the stream")
            self.downlink_bytes += answer.ByteSize()
            if (place := wire.place_of(answer)) is None:
                return answer
            self.ticket = place  # kept across a broken stream: the reopen claims this place back

    async def send_candidate(self, frame: pb.VerifyBlock, epoch: int) -> bool:
        """Write a candidate behind the block of `epoch`; False if that is no longer possible (a retry or reopen
        since: the cloud would drop it anyway). Never raises: a broken stream shows on the verdict's read."""
        if self.call is None or epoch != self.epoch:
            return False
        edge_frame = wire.verify_frame(frame)
        try:
            async with self._write_lock:
                if epoch != self.epoch or self.call is None:
                    return False
                self.has_candidates = True
                await asyncio.wait_for(self.call.write(edge_frame), self.deadline_s)
        except STREAM_BROKE:
            return False
        self.uplink_bytes += edge_frame.ByteSize()
        return epoch == self.epoch

    def matched(self) -> None:
        """The verdict just read answered a candidate of the block written last."""
        self.verdict_epoch = self.epoch

    def cancel(self) -> None:
        """Drop the call as it is (a frame in flight is abandoned with it)."""
        if self.call is not None:
            self.call.cancel()
        self.call, self.has_candidates = None, False

    async def close(self) -> None:
        """Close the call politely (close frame, end of writes), or cancel it if the replica does not listen."""
        try:
            await asyncio.wait_for(self.call.write(wire.close_frame()), 1.0)
            await asyncio.wait_for(self.call.done_writing(), 1.0)
        except STREAM_BROKE:
            self.call.cancel()
        self.call, self.has_candidates = None, False
