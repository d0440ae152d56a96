"""The resident engine's prefix cache (cloud/prefix_cache.py), on the real backend, store, batcher and engine.

In float32 a session started from a cached prefix gives the logits of a cold prefill (to the rounding of a GEMM
over other rows); in the paged layout sessions share the cached pages, two of them in one forward included
(each reads a shared page through its own page table); the ledger charges a shared page once and evicts idle
cached blocks before any session; reuse stays within one edge identity unless the operator shares it; and opens
of one prompt that arrive together prefill it once.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import AsyncIterator

import pytest
import torch

import cloud.packed_forward
from cloud.target_host import TargetHost
from cloud.packed_forward import packed_forward_of
from cloud.batcher import Batcher
from cloud.engine import ForwardStats
from cloud.frames import ServiceLimits
from cloud.kv_pool import KVPool
from cloud.metrics import CloudMetrics
from cloud.packed_forward import forward_packed, install
from cloud.prefix_cache import PrefixCache
from cloud.resident_engine import ResidentEngine
from cloud.resident_kv import KVLayout
from cloud.sessions import KVInvariant, SessionLimits, SessionStore
from cloud.cloud_sd import DraftEngine
from sprinter.v1 import decoding_pb2 as pb

PAGE = 8
ATOL = 1e-4
LAYOUTS = pytest.mark.parametrize("paged", [False, True], ids=["per-session", "paged"])


@contextlib.asynccontextmanager
async def _backend(target, paged: bool, budget_pages: int = 64, share: bool = False,
                   forwards: list[ForwardStats] | None = None, draft=None) -> AsyncIterator[TargetHost]:
    """A backend with a prefix cache, its budget checked in strict mode at every grant, forward and eviction;
    with `draft`, the cloud's own (cloud-sd)."""
    layout = KVLayout.of(target.model, page_tokens=PAGE, max_tokens=budget_pages * PAGE)
    budget = budget_pages * layout.bytes_per_page
    pool = KVPool(layout, budget, slack_tokens=4 * PAGE) if paged else None
    metrics = CloudMetrics()
    cache = PrefixCache(layout, pool, share, on_evict=metrics.prefix_cache_evictions.inc)
    async with contextlib.AsyncExitStack() as stack:
        batcher = await stack.enter_async_context(
            Batcher(packed_forward_of(target.model), max_batch=8, on_batch=forwards.append if forwards is not None else None))
        drafting = None
        if draft is not None:
            draft_batcher = await stack.enter_async_context(Batcher(packed_forward_of(draft.model),
                                                                    worker=batcher.worker))
            drafting = DraftEngine(draft, draft_batcher, KVLayout.of(draft.model))
        engine = ResidentEngine(target, batcher, layout, pool, drafting, prefix_cache=cache)
        store = SessionStore(SessionLimits(max_sessions=16, kv_budget_bytes=budget, idle_timeout_s=1000),
                             layout.bytes_per_token, invariant=KVInvariant(engine.kv_bytes_in_use, strict=True),
                             prefix_cache=cache)
        yield TargetHost(engine, ServiceLimits(max_block=6, max_context=budget_pages * PAGE - 8), store, metrics)


def _prompt(seed: int, n: int, vocab: int = 250) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


async def _next_logits(backend: TargetHost, owner: str, prompt: list[int]) -> tuple[torch.Tensor, int]:
    """Open `prompt`, run its last token (and two more) as a verify's forward: the rows' logits, and the prompt
    tokens the open took from the cache."""
    session, _ = await backend.open(owner, pb.OpenSession(prompt_ids=prompt))
    backend.store.grant_kv(session, session.length + 2)
    result = await backend.engine.batcher.forward(session.cache, session.tokens[session.cached_tokens:] + [7, 9],
                                                  n_logits=3, full_logits=True)
    backend.engine.rollback(session, session.cached_tokens)
    assert result.rows.logits is not None and result.rows.logits.shape[0] == 3
    reused = session.reused_tokens
    backend.close(session)
    return result.rows.logits, reused


@LAYOUTS
def test_a_cached_prefix_gives_the_logits_of_a_cold_prefill(tiny_target, paged):
    async def program() -> None:
        history = _prompt(1, 5 * PAGE + 3)
        turn_two = history + _prompt(2, 11)
        async with _backend(tiny_target, paged) as cold:
            cold_logits, cold_reused = await _next_logits(cold, "edge", turn_two)
        async with _backend(tiny_target, paged) as warm:
            await _next_logits(warm, "edge", history)
            warm_logits, reused = await _next_logits(warm, "edge", turn_two)
            assert warm.metrics.prefix_cache_hits._value.get() == 1
        assert cold_reused == 0 and reused == 5 * PAGE  # every whole page of the history, nothing of the new turn
        torch.testing.assert_close(warm_logits, cold_logits, atol=ATOL, rtol=0)

    asyncio.run(program())


@pytest.mark.parametrize("whole_pool", [False, True], ids=["cpu-plan", "cuda-plan"])
def test_two_sessions_reading_one_shared_page_in_one_forward_each_see_their_own_prefix(tiny_target, monkeypatch,
                                                                                       whole_pool):
    """The page tables' fix: with one owner per page, the second session's queries were masked out of it. The
    CUDA plan (a mask over the whole pool, for the compiled kernel) runs unfused here too."""
    if whole_pool:
        monkeypatch.setattr(cloud.packed_forward, "fused", lambda device_type: True)
    model = tiny_target.model
    install(model)
    layout = KVLayout.of(model, page_tokens=PAGE)
    pool = KVPool(layout, 32 * layout.bytes_per_page)
    cache = PrefixCache(layout, pool)
    prefix = _prompt(3, 2 * PAGE)
    first = pool.session()
    forward_packed(model, [first], [prefix], [1])
    assert cache.remember(first, "edge", prefix) == 2
    sharing = [pool.session() for _ in range(2)]
    for session in sharing:
        assert cache.start(session, "edge", prefix).tokens == 2 * PAGE
    assert sharing[0].pages[:2] == sharing[1].pages[:2] == first.pages[:2]
    assert [pool.refs(page) for page in first.pages[:2]] == [4, 4]  # the cache and three sessions
    tails = [_prompt(4, 5), _prompt(5, PAGE + 3), _prompt(6, 2)]
    rows = forward_packed(model, [first] + sharing, tails, [len(t) for t in tails])
    for tail, row in zip(tails, rows):
        with torch.inference_mode():
            alone = model(input_ids=torch.tensor([prefix + tail]), logits_to_keep=len(tail)).logits[0].float()
        torch.testing.assert_close(row.logits, alone, atol=ATOL, rtol=0)
    for session in [first] + sharing:
        session.release()
    assert pool.free_pages == pool.pages - 2  # the cached pages stay, held by the cache alone
    cache.clear()
    assert pool.free_pages == pool.pages


def test_the_ledger_charges_a_shared_page_once_and_evicts_idle_cached_blocks_before_sessions(tiny_target):
    async def program() -> None:
        async with _backend(tiny_target, paged=True, budget_pages=12) as backend:
            store, engine = backend.store, backend.engine
            prompt = _prompt(7, 4 * PAGE + 1)
            a, _ = await backend.open("edge", pb.OpenSession(prompt_ids=prompt))
            b, _ = await backend.open("edge", pb.OpenSession(prompt_ids=prompt))
            assert b.reused_tokens == 4 * PAGE and b.cache.pages[:4] == a.cache.pages[:4]
            assert store.cached_tokens == 4 * PAGE
            # the four shared pages once (the cache's), each session its own pages beside them
            assert store.kv_bytes == (4 * PAGE + a.kv_tokens + b.kv_tokens) * store.kv_bytes_per_token
            assert engine.kv_bytes_in_use() <= store.kv_bytes
            backend.close(b)
            backend.close(a)
            assert store.prefix_cache.idle_tokens() == store.cached_tokens >= 4 * PAGE
            idle, _ = await backend.open("edge", pb.OpenSession(prompt_ids=_prompt(8, 3 * PAGE)))
            idle.last_used -= 1000
            big, _ = await backend.open("edge", pb.OpenSession(prompt_ids=_prompt(9, 5 * PAGE)))
            assert store.contains(idle.session_id)  # room came from the cache's idle blocks
            assert len(store.prefix_cache.match("edge", prompt)) < 4  # the least recently used: the first prompt's
            assert backend.metrics.prefix_cache_evictions._value.get() >= 1
            backend.close(big)
            backend.close(idle)

    asyncio.run(program())


@pytest.mark.parametrize("share", [False, True], ids=["own-identity", "shared"])
def test_reuse_stays_within_an_edge_identity_unless_shared(tiny_target, share):
    async def program() -> None:
        async with _backend(tiny_target, paged=False, share=share) as backend:
            prompt = _prompt(10, 3 * PAGE + 2)
            await _next_logits(backend, "alice", prompt)
            _, bob = await _next_logits(backend, "bob", prompt)
            _, alice = await _next_logits(backend, "alice", prompt)
            assert alice == 3 * PAGE
            assert bob == (3 * PAGE if share else 0)

    asyncio.run(program())


@LAYOUTS
def test_opens_of_one_prompt_arriving_together_prefill_it_once(tiny_target, paged):
    """The n choices of a request: the first computes the prompt's pages, the others wait for them."""
    async def program() -> None:
        forwards: list[ForwardStats] = []
        async with _backend(tiny_target, paged, forwards=forwards) as backend:
            prompt = _prompt(11, 6 * PAGE + 5)
            opened = await asyncio.gather(*(backend.open("edge", pb.OpenSession(prompt_ids=prompt)) for _ in range(4)))
            prefilled = sum(f.tokens for f in forwards)
            assert sorted(s.reused_tokens for s, _ in opened) == [0] + [6 * PAGE] * 3
            assert prefilled == (len(prompt) - 1) + 3 * 4  # once, then each choice's part page (4 tokens)
            for session, _ in opened:
                backend.close(session)

    asyncio.run(program())


@LAYOUTS
@pytest.mark.parametrize("speculation", [None, 3], ids=["target", "cloud-sd"])
def test_a_generate_starts_from_a_session_s_cached_prefix_and_decodes_as_cold(tiny_target, tiny_draft, paged,
                                                                              speculation):
    async def program() -> None:
        history = _prompt(12, 4 * PAGE)
        request = pb.GenerateRequest(prompt_ids=history + _prompt(13, 6), max_new_tokens=8,
                                     speculation=pb.Speculation(block=speculation) if speculation else None)
        draft = tiny_draft if speculation else None
        async with _backend(tiny_target, paged, draft=draft) as cold:
            cold_tokens = [t for chunk in [c async for c in cold.generate("edge", request)] for t in chunk.token_ids]
        async with _backend(tiny_target, paged, draft=draft) as warm:
            await _next_logits(warm, "edge", history)
            chunks = [c async for c in warm.generate("edge", request)]
            assert chunks[0].cached_tokens == 3 * PAGE  # history[:-1] holds three whole pages
            assert [t for c in chunks for t in c.token_ids] == cold_tokens
            again = [c async for c in warm.generate("edge", request)]  # the first Generate's own pages now
            assert again[0].cached_tokens == 4 * PAGE

    asyncio.run(program())
