"""Issue 41: seniority. Admitting work evicts only sessions of later requests (or older ones idle for
`evict_older_idle_s`), and a reopen of an evicted session keeps its request's turn, on a real cloud on loopback.

Without it, a newcomer evicted any session idle for the grace period, and the evicted request reopened at the
back of the line, again and again: the soak's slowest requests waited minutes for their first token.
"""

from __future__ import annotations

import time

import grpc
import pytest

from cloud.server import CloudSettings
from cloud.sessions import SessionLimits, SessionStore
from cloud_harness import ServerThread, SessionStream
from common import wire
from common.admission import Admission
from common.sampling.distributions import SamplingParams

OLDER_IDLE_S = 1.0
SETTINGS = CloudSettings(target="tiny-random", dtype="float32", batch_window_ms=1, max_sessions=2,
                         evict_grace_s=0, evict_older_idle_s=OLDER_IDLE_S)


def open_as(stream: SessionStream, prompt: list[int], evicted_session_id: str = ""):
    """Open on `stream` as an edge that waits in line; the first frame back (opened, or a queue ticket)."""
    return stream.send(wire.open_frame(prompt, admission=Admission(waits_in_line=True,
                                                                   evicted_session_id=evicted_session_id)))


def test_a_reopen_keeps_its_turn_and_later_work_cannot_push_out_earlier_work(tiny_target):
    with ServerThread(SETTINGS, tiny_target) as server, grpc.insecure_channel(server.address) as channel:
        a, b, c = (SessionStream(channel) for _ in range(3))
        assert open_as(a, [1, 2, 3]).WhichOneof("frame") == "opened"
        b_id = open_as(b, [4, 5, 6]).opened.session_id
        time.sleep(OLDER_IDLE_S + 0.1)  # both idle past evict_older_idle_s: a newcomer may now evict one
        assert a.verify(3, [7]).WhichOneof("frame") == "verdict"  # a is in use again: not evictable
        assert open_as(c, [8, 9]).WhichOneof("frame") == "opened"  # b, idle long, made room
        assert b.verify(3, [7]).error.code == grpc.StatusCode.NOT_FOUND.value[0]
        # b's reopen names its evicted session: it takes back b's stamp, older than c's, and pushes c out at once
        assert open_as(b, [4, 5, 6], evicted_session_id=b_id).WhichOneof("frame") == "opened"
        assert c.verify(2, [7]).error.code == grpc.StatusCode.NOT_FOUND.value[0]
        # c's reopen (a fresh stamp, the youngest) cannot push out a or b, both used just now: it waits in line
        ticket = open_as(c, [8, 9])
        assert ticket.WhichOneof("frame") == "queued" and ticket.queued.position == 0
        a.close()
        assert next(c._responses).WhichOneof("frame") == "opened"  # a's slot went to c
        b.close()
        c.close()
        assert server.server.metrics.exposition().decode().count("sprinter_cloud_sessions_evicted_total 2.0") == 1


def test_a_store_evicts_the_youngest_request_first_and_only_younger_ones_for_admission():
    store = SessionStore(SessionLimits(max_sessions=3, evict_older_idle_s=3600), kv_bytes_per_token=0)
    greedy = SamplingParams()
    sessions = [store.create("edge", [1, 2], greedy, cache=_NoKV()) for _ in range(3)]
    stamps = [s.seniority for s in sessions]
    assert stamps == sorted(stamps)  # arrival order
    with pytest.raises(Exception, match="busy"):
        store.create("edge", [3], greedy, cache=_NoKV())  # the newest request: every session is older
    reopened = store.create("edge", [3], greedy, cache=_NoKV(), seniority=stamps[0] - 1)  # one older than all
    assert not store.contains(sessions[2].session_id) and store.contains(sessions[0].session_id)  # the youngest went
    assert store.seniority_of_evicted(sessions[2].session_id, "another edge") is None  # only its owner claims it
    assert store.seniority_of_evicted(sessions[2].session_id, "edge") == stamps[2]
    assert store.seniority_of_evicted(sessions[2].session_id, "edge") is None  # once
    assert reopened.seniority == stamps[0] - 1


class _NoKV:
    """A session cache that holds nothing (an engine that keeps its own KV): the session limit alone binds."""

    capacity = granted = shared_tokens = 0

    def release(self) -> None:
        pass
