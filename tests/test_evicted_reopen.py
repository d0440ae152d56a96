"""An evicted request keeps its turn: its reopen waits in the cloud's line as running work, ahead of new requests.

Under load admission evicts a session idle for the grace period (its edge still drafting); the edge reopens it
with its full context. Were the reopen new work it would join the back of the line each time it is evicted.
Real host, session store and resident engine (tiny model); the line is the real one.
"""

from __future__ import annotations

import asyncio
import dataclasses

from cloud.batcher import Batcher
from cloud.evicted_sessions import EvictedSessions
from cloud.frames import ServiceLimits
from cloud.metrics import CloudMetrics
from cloud.resident_engine import ResidentEngine
from cloud.resident_kv import KVLayout
from cloud.sessions import SessionLimits, SessionStore
from cloud.target_host import TargetHost
from sprinter.v1 import decoding_pb2 as pb

PAGE = 16


def _open_request(prompt: list[int]) -> pb.OpenSession:
    return pb.OpenSession(prompt_ids=prompt, admission=pb.Admission(waits_in_line=True))


def test_evictions_are_remembered_per_owner_and_taken_once() -> None:
    evicted = EvictedSessions(per_owner=2)
    evicted.remember("edge", [1, 2, 3])
    assert not evicted.take("other", [1, 2, 3, 4])  # another edge's context is not this one's work
    assert not evicted.take("edge", [1, 2, 4, 5])  # diverges: new work
    assert evicted.take("edge", [1, 2, 3, 9, 9])  # goes on from it ...
    assert not evicted.take("edge", [1, 2, 3, 9, 9])  # ... once
    for tokens in ([1], [2], [3]):
        evicted.remember("edge", tokens)
    assert not evicted.take("edge", [1]) and evicted.take("edge", [3])  # the oldest is forgotten past the bound


def test_an_evicted_sessions_reopen_goes_ahead_of_new_work_in_line(tiny_target) -> None:
    async def run() -> None:
        layout = KVLayout.of(tiny_target.model, page_tokens=PAGE, max_tokens=8 * PAGE)
        async with Batcher(tiny_target.model, max_batch=4) as batcher:
            engine = ResidentEngine(tiny_target, batcher, layout)
            store = SessionStore(SessionLimits(max_sessions=2, idle_timeout_s=1000), layout.bytes_per_token)
            host = TargetHost(engine, ServiceLimits(max_context=8 * PAGE), store, CloudMetrics())
            first, _ = await host.open("edge", _open_request([5] * 20))
            second, _ = await host.open("edge", _open_request([6] * 20))
            third, _ = await host.open("edge", _open_request([7] * 20))  # the store is full: `first` is evicted
            assert not store.contains(first.session_id)
            second.busy = third.busy = True  # in flight: neither may be evicted now, so newcomers wait in line
            places = []
            newcomer = asyncio.create_task(host.open("edge", _open_request([8] * 20), tell=places.append))
            await asyncio.sleep(0.05)
            reopen = asyncio.create_task(host.open("edge", _open_request(first.tokens + [9]), tell=places.append))
            await asyncio.sleep(0.05)
            assert [p.running for p in host.queue.order()] == [True, False]  # the reopen first, though it came later
            third.busy = False
            host.close(third)  # room for one: the reopen gets it
            reopened, _ = await asyncio.wait_for(reopen, 5)
            assert reopened.tokens == first.tokens + [9] and not newcomer.done()
            second.busy = False
            host.close(second)
            await asyncio.wait_for(newcomer, 5)

    asyncio.run(run())


def test_a_new_request_that_merely_shares_a_prompt_is_not_taken_for_a_reopen() -> None:
    evicted = EvictedSessions()
    evicted.remember("edge", [1, 2, 3, 4, 5])
    assert not evicted.take("edge", [1, 2, 3])  # shorter than the evicted context: not its continuation
    assert dataclasses.is_dataclass(evicted)
