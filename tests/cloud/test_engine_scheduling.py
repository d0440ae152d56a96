"""The engine's scheduler (cloud/batcher.py): continuous batching on the real tiny target, forwards recorded."""

from __future__ import annotations

import asyncio
import time

import pytest

import cloud.packed_forward
from cloud.packed_forward import packed_forward_of
from cloud.batcher import Batcher
from cloud.engine import ForwardStats
from cloud.resident_kv import KVLayout, ResidentKV


@pytest.fixture
def forwards(monkeypatch) -> list[list[int]]:
    """Each forward's requests, as their token counts (the real forward still runs)."""
    calls: list[list[int]] = []
    real = cloud.packed_forward.forward_packed

    def spy(model, caches, new_tokens, *rest):
        calls.append([len(tokens) for tokens in new_tokens])
        return real(model, caches, new_tokens, *rest)

    monkeypatch.setattr(cloud.packed_forward, "forward_packed", spy)
    return calls


def _caches(model, n: int) -> list[ResidentKV]:
    return [ResidentKV(KVLayout.of(model, page_tokens=16)) for _ in range(n)]


def test_a_lone_verify_on_an_idle_engine_waits_for_nothing(tiny_target, forwards):
    # A hold would last a full second here (the budgets are raised), so "no hold" reads as far under
    # it however loaded the machine is.
    async def run() -> float:
        async with Batcher(packed_forward_of(tiny_target.model), demand=lambda: 8,  # 8 open streams, 1 request
                           straggler_share=1e6, max_hold_s=1.0) as batcher:
            cache = _caches(tiny_target.model, 1)[0]
            started = time.perf_counter()
            await batcher.forward(cache, [1, 2, 3], n_logits=2)
            await asyncio.sleep(2 * (time.perf_counter() - started) + 0.01)  # idle for longer than a forward
            result = await batcher.forward(cache, [4], n_logits=1)
            return result.queue_ms

    assert asyncio.run(run()) < 500.0
    assert forwards == [[3], [1]]


def test_requests_waiting_during_a_forward_all_join_the_next_within_the_budgets(tiny_target, forwards):
    stats: list[ForwardStats] = []

    async def run() -> None:
        async with Batcher(packed_forward_of(tiny_target.model), max_batch=3, max_forward_tokens=12,
                           on_batch=stats.append) as batcher:
            caches = _caches(tiny_target.model, 6)
            blocking = asyncio.create_task(batcher.forward(caches[0], [7] * 2, 1))
            await asyncio.sleep(0)  # the first forward starts alone ...
            queued = [batcher.forward(cache, [5] * n, 1) for cache, n in zip(caches[1:], (4, 4, 4, 2, 1))]
            await asyncio.gather(blocking, *queued)  # ... the others queue behind it

    asyncio.run(run())
    assert forwards[0] == [2]
    assert forwards[1:] == [[4, 4, 4], [2, 1]]  # at most 3 requests and 12 tokens per forward, in arrival order
    assert [s.tokens for s in stats] == [2, 12, 3] and all(s.copied_bytes == 0 for s in stats)


def test_a_prefill_rides_along_in_chunks_one_per_forward(tiny_target, forwards):
    async def run() -> None:
        async with Batcher(packed_forward_of(tiny_target.model), max_prefill_chunk=8) as batcher:
            prompt, busy = _caches(tiny_target.model, 2)
            await batcher.forward(busy, [1, 2], 1)
            prefill = asyncio.create_task(batcher.prefill(prompt, list(range(20))))
            for _ in range(3):
                await batcher.forward(busy, [3], 1)
            await prefill
            # its pages, allocated up front (spare pages are the session store's grant, tests/cloud/test_cloud_limits.py)
            assert prompt.length == 20 and prompt.capacity == 32 and prompt.copied_bytes == 0

    asyncio.run(run())
    chunks = [[n for n in forward if n == 8 or n == 4] for forward in forwards]
    assert all(len(c) <= 1 for c in chunks) and sum(sum(c) for c in chunks) == 20
    assert any(len(forward) == 2 for forward in forwards), "no verify shared a forward with a prefill chunk"


def test_after_a_forward_stragglers_are_held_for_a_share_of_it(tiny_target, forwards, monkeypatch):
    """Two sessions that answer at once would otherwise take turns; the hold merges them."""
    spy = cloud.packed_forward.forward_packed

    def slow(*args):  # forwards of 50 ms, as a real target's: the hold is a share of that
        time.sleep(0.05)
        return spy(*args)

    monkeypatch.setattr(cloud.packed_forward, "forward_packed", slow)

    async def run() -> None:
        async with Batcher(packed_forward_of(tiny_target.model), demand=lambda: 2, straggler_share=0.5,
                           max_hold_s=0.5) as batcher:
            first, second = _caches(tiny_target.model, 2)
            await batcher.forward(first, [1, 2, 3, 4], 1)
            late = asyncio.create_task(_after(0.005, batcher.forward(second, [5], 1)))
            await batcher.forward(first, [6], 1)
            await late

    asyncio.run(run())
    assert forwards[-1] == [1, 1], f"the straggler ran apart: {forwards}"


async def _after(delay_s: float, coroutine):
    await asyncio.sleep(delay_s)
    return await coroutine


def test_a_dead_scheduling_loop_fails_its_callers_instead_of_leaving_them_waiting(tiny_target, monkeypatch):
    def broken(self) -> list:
        raise KeyError("a bug in the scheduler")

    monkeypatch.setattr(Batcher, "_next_batch", broken)

    async def run() -> None:
        async with Batcher(packed_forward_of(tiny_target.model)) as batcher:
            cache = _caches(tiny_target.model, 1)[0]
            with pytest.raises(KeyError):
                await asyncio.wait_for(batcher.forward(cache, [1, 2, 3], n_logits=1), 30)
            with pytest.raises(RuntimeError, match="stopped"):
                await batcher.forward(cache, [4], n_logits=1)

    asyncio.run(run())
