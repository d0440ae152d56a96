"""Why a call to a cloud replica failed, and what a session does about it: one cause -> action table.

`classify` reads a failure (an Error frame, or the status a broken stream ended with) and names its
`Cause`; `ACTIONS` says what each cause means for the retry. Pure: no I/O, no state; the session
(edge/cloud_link/session.py) and the replicas (edge/cloud_link/replicas.py) do what the table says.

| cause              | what happened                                  | counts | then                                 |
| ------------------ | ---------------------------------------------- | ------ | ------------------------------------ |
| `desync`           | FAILED_PRECONDITION frame (context drifted)    | no     | reopen with the context, here, now   |
| `evicted`          | NOT_FOUND frame (evicted, or a restart)        | no     | reopen with the context, elsewhere   |
| `replica_failed`   | the stream broke, a frame's deadline passed    | yes    | new stream elsewhere; this one rests |
| `draining`         | UNAVAILABLE frame (the replica shuts down)     | yes    | new stream elsewhere, at once        |
| `busy`             | RESOURCE_EXHAUSTED frame with a retry hint     | no     | elsewhere, or here after the hint    |
| `out_of_step`      | a candidate's verdict names another block      | yes    | new stream, here                     |
| `no_replica`       | no replica is usable now                       | yes    | wait for one to come back            |
| `loading`          | none usable, one answers but is still loading  | no     | wait for it (health NOT_SERVING)     |
| `refused`          | any other status; RESOURCE_EXHAUSTED, no hint  | -      | give up: `CloudRefused`              |
| `request_deadline` | the request's own deadline passed              | -      | give up: `DeadlinePassed`            |

"counts": against the session's attempts (a replica out of reach); "elsewhere": another replica if there
is one. A cloud that answered (busy, evicted, desync, loading) is waited for as long as the request's deadline
allows. `request_deadline` is the session's own finding (the time left ran out), never `classify`'s: the
table names it so that every way out is here.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import Enum

import grpc

from common.errors import SprinterError
from common.wire import status_of
from sprinter.v1 import decoding_pb2 as pb

# Statuses a call or stream ends with when the replica is out of reach (rather than refusing): worth another try.
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                       grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


class Cause(Enum):
    """Why one attempt failed; the value is the label metrics and /health count reopens by."""

    DESYNC = "desync"
    EVICTED = "evicted"
    REPLICA_FAILED = "replica_failed"
    DRAINING = "draining"
    BUSY = "busy"
    OUT_OF_STEP = "out_of_step"
    NO_REPLICA = "no_replica"
    LOADING = "loading"
    REFUSED = "refused"
    REQUEST_DEADLINE = "request_deadline"


class Rest(Enum):
    """What a failure does to the replica's health (edge/cloud_link/replicas.py)."""

    NONE = "none"
    BACKOFF = "backoff"  # rests for an exponential backoff with jitter
    DRAIN = "drain"  # no new sessions for DRAIN_REST_S


@dataclass(frozen=True)
class Action:
    """What a session does after a failure of one cause."""

    counts: bool = False  # counts against the attempts: the replica is out of reach
    resync: bool = False  # the cloud lost the session: reopen with the full context (the first retry at once)
    new_stream: bool = False  # the stream is gone or out of step: open a new one
    move: bool = False  # another replica, if there is one, is the better place to retry
    honours_hint: bool = False  # wait at least the cloud's retry_after_ms before retrying here
    rest: Rest = Rest.NONE
    reported: bool = False  # told to the replicas: counted as a reopen of this cause
    gives_up: bool = False  # no retry can help: the failure ends the verify


ACTIONS: dict[Cause, Action] = {
    Cause.DESYNC: Action(resync=True, reported=True),
    Cause.EVICTED: Action(resync=True, move=True, reported=True),
    Cause.REPLICA_FAILED: Action(counts=True, new_stream=True, move=True, rest=Rest.BACKOFF, reported=True),
    Cause.DRAINING: Action(counts=True, new_stream=True, move=True, honours_hint=True, rest=Rest.DRAIN, reported=True),
    Cause.BUSY: Action(move=True, honours_hint=True, reported=True),
    Cause.OUT_OF_STEP: Action(counts=True, new_stream=True),
    Cause.NO_REPLICA: Action(counts=True),
    Cause.LOADING: Action(),
    Cause.REFUSED: Action(gives_up=True),
    Cause.REQUEST_DEADLINE: Action(new_stream=True, gives_up=True),
}


class RetryableFailure(SprinterError):
    """One attempt failed in a way another attempt may not; `cause` says how (see `ACTIONS`)."""

    def __init__(self, cause: Cause, reason: str, retry_after_s: float = 0.0, stale_stream: bool = False) -> None:
        super().__init__(reason)
        self.cause = cause
        self.action = ACTIONS[cause]
        self.retry_after_s = retry_after_s  # the cloud's own hint (Error.retry_after_ms), where the cause honours it
        # The stream may still carry answers meant for something else (candidates): the retry takes a fresh one.
        self.new_stream = self.action.new_stream or stale_stream


def classify_frame(code: int, retry_after_ms: int = 0) -> Cause:
    """The cause of an Error frame on a Session stream (the cloud answered, and said no)."""
    status = status_of(code)
    if status == grpc.StatusCode.NOT_FOUND:
        return Cause.EVICTED
    if status == grpc.StatusCode.FAILED_PRECONDITION:
        return Cause.DESYNC
    if status == grpc.StatusCode.UNAVAILABLE:
        return Cause.DRAINING
    if status == grpc.StatusCode.RESOURCE_EXHAUSTED and retry_after_ms > 0:  # without a hint: a limit
        return Cause.BUSY
    return Cause.REFUSED


def classify_status(code: grpc.StatusCode) -> Cause:
    """The cause of a call or stream that ended with `code`: out of reach, or refused."""
    return Cause.REPLICA_FAILED if code in TRANSIENT else Cause.REFUSED


def classify(error: pb.Error | BaseException) -> Cause:
    """An Error frame, or how a stream broke mid-frame: a status, a timeout, or a write to a finished call."""
    if isinstance(error, pb.Error):
        return classify_frame(error.code, error.retry_after_ms)
    if isinstance(error, grpc.aio.AioRpcError):
        return classify_status(error.code())
    if isinstance(error, (asyncio.TimeoutError, asyncio.InvalidStateError)):
        return Cause.REPLICA_FAILED
    raise TypeError(f"not a cloud-link failure: {type(error).__name__}")
