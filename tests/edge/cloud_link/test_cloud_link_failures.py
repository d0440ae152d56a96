"""The cloud link's cause -> action table (edge/cloud_link/failures.py): what each failure is, what follows it."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.errors import SprinterError
from common.wire import retry_hint_s, status_of
from edge.cloud_link.client import CloudLinkError, CloudRefused, CloudUnavailable, DeadlinePassed
from edge.cloud_link.failures import ACTIONS, Cause, Rest, RetryableFailure, classify, classify_frame
from sprinter.v1 import decoding_pb2 as pb

CODES = list(grpc.StatusCode)


def frame(code: grpc.StatusCode, retry_after_ms: int = 0) -> pb.Error:
    return pb.Error(code=code.value[0], message="m", retry_after_ms=retry_after_ms)


@pytest.mark.parametrize("code,retry_after_ms,cause", [
    (grpc.StatusCode.FAILED_PRECONDITION, 0, Cause.DESYNC),
    (grpc.StatusCode.FAILED_PRECONDITION, 50, Cause.DESYNC),
    (grpc.StatusCode.NOT_FOUND, 0, Cause.EVICTED),
    (grpc.StatusCode.UNAVAILABLE, 0, Cause.DRAINING),
    (grpc.StatusCode.UNAVAILABLE, 50, Cause.DRAINING),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 50, Cause.BUSY),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 0, Cause.REFUSED),  # no hint: a limit no retry lifts
    (grpc.StatusCode.INVALID_ARGUMENT, 0, Cause.REFUSED),
    (grpc.StatusCode.PERMISSION_DENIED, 0, Cause.REFUSED),
    (grpc.StatusCode.INTERNAL, 0, Cause.REFUSED),  # in a frame: the cloud answered, and refused
])
def test_an_error_frame_names_its_cause(code: grpc.StatusCode, retry_after_ms: int, cause: Cause) -> None:
    assert classify(frame(code, retry_after_ms)) is cause
    assert classify_frame(code.value[0], retry_after_ms) is cause


def test_a_frame_with_a_code_grpc_does_not_define_is_a_refusal() -> None:
    assert classify(pb.Error(code=999)) is Cause.REFUSED and status_of(999) is grpc.StatusCode.UNKNOWN


@pytest.mark.parametrize("code", CODES)
def test_a_broken_stream_is_a_failed_replica_unless_its_status_refuses(code: grpc.StatusCode) -> None:
    transient = code in {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                         grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
    error = grpc.aio.AioRpcError(code, None, None, "d")
    assert classify(error) is (Cause.REPLICA_FAILED if transient else Cause.REFUSED)


def test_a_timeout_or_a_write_to_a_finished_call_is_a_failed_replica() -> None:
    assert classify(asyncio.TimeoutError()) is Cause.REPLICA_FAILED
    assert classify(asyncio.InvalidStateError()) is Cause.REPLICA_FAILED
    with pytest.raises(TypeError):
        classify(KeyError("not ours"))


def test_the_table_says_what_follows_each_cause() -> None:
    assert set(ACTIONS) == set(Cause)
    waited_for = {c for c, a in ACTIONS.items() if not a.counts and not a.gives_up}
    assert waited_for == {Cause.BUSY, Cause.EVICTED, Cause.DESYNC, Cause.LOADING}  # the cloud answered: wait
    assert {c for c, a in ACTIONS.items() if a.resync} == {Cause.EVICTED, Cause.DESYNC}
    assert {c for c, a in ACTIONS.items() if a.move} == {Cause.EVICTED, Cause.REPLICA_FAILED, Cause.DRAINING,
                                                         Cause.BUSY}
    assert {c for c, a in ACTIONS.items() if a.honours_hint} == {Cause.BUSY, Cause.DRAINING}
    assert ACTIONS[Cause.REPLICA_FAILED].rest is Rest.BACKOFF and ACTIONS[Cause.DRAINING].rest is Rest.DRAIN
    # the causes /metrics and /health count reopens by
    assert {c.value for c, a in ACTIONS.items() if a.reported} == {"desync", "evicted", "replica_failed", "draining",
                                                                   "busy"}


def test_a_stale_stream_takes_a_new_one_whatever_the_cause() -> None:
    assert not RetryableFailure(Cause.BUSY, "b").new_stream
    assert RetryableFailure(Cause.BUSY, "b", stale_stream=True).new_stream
    assert RetryableFailure(Cause.REPLICA_FAILED, "r").new_stream
    assert str(RetryableFailure(Cause.NO_REPLICA, "no cloud replica is usable now")) == "no cloud replica is usable now"


def test_the_retry_hint_comes_from_the_trailing_metadata() -> None:
    assert retry_hint_s((("retry-after-ms", "250"),)) == 0.25
    assert retry_hint_s((("other", "9"),)) == 0.0 and retry_hint_s(None) == 0.0
    assert retry_hint_s((("retry-after-ms", "soon"),)) == 0.0


def test_the_edge_link_errors_are_one_branch_of_the_family() -> None:
    for error in (CloudRefused, CloudUnavailable, DeadlinePassed):
        assert issubclass(error, CloudLinkError) and issubclass(error, SprinterError)
    assert issubclass(RetryableFailure, SprinterError) and not issubclass(RetryableFailure, CloudLinkError)
    assert CloudRefused(9, "x").code is grpc.StatusCode.FAILED_PRECONDITION and str(CloudRefused(9, "x")) == \
        "FAILED_PRECONDITION: x"
