"""The KV budget as an invariant: after every step of random session traffic, the KV the engine measures
(live buffers, or the pool's pages taken) is within the budget.

Random programs of open / verify (with rejections, so rollbacks) / first token / close / idle expiry /
Generate run against the real host, session store and resident engine (both layouts, tiny model) with a
budget of a few pages, so admission refusals and evictions happen all the time. With the prefix cache, prompts
share prefixes (of two edges), so cached blocks, the live sessions that share them, their eviction and
Generates starting from them mix in every program. The store checks at every
grant, forward and eviction in strict mode (it raises); the test also checks after every step.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloud.target_host import TargetHost
from cloud.packed_forward import packed_forward_of
from cloud.batcher import Batcher
from cloud.errors import CloudError
from cloud.frames import ServiceLimits
from cloud.kv_pool import KVPool
from cloud.metrics import CloudMetrics
from cloud.prefix_cache import PrefixCache
from cloud.resident_engine import ResidentEngine
from cloud.resident_kv import KVLayout
from cloud.sessions import KVBudgetExceeded, KVInvariant, SessionLimits, SessionStore
from sprinter.v1 import decoding_pb2 as pb

PAGE = 16
BUDGET_PAGES = 12
OPS = st.lists(st.tuples(st.sampled_from(["open", "verify", "verify", "verify", "close", "expire", "generate"]),
                         st.integers(0, 2 ** 16)), min_size=5, max_size=40)


async def _program(target, paged: bool, cached: bool, ops: list[tuple[str, int]]) -> int:
    model = target.model
    layout = KVLayout.of(model, page_tokens=PAGE, max_tokens=BUDGET_PAGES * PAGE)
    budget = BUDGET_PAGES * layout.bytes_per_page
    pool = KVPool(layout, budget, slack_tokens=4 * PAGE) if paged else None
    prefix_cache = PrefixCache(layout, pool) if cached else None
    async with Batcher(packed_forward_of(model), max_batch=4) as batcher:
        engine = ResidentEngine(target, batcher, layout, pool, prefix_cache=prefix_cache)
        breaches = []
        store = SessionStore(SessionLimits(max_sessions=5, kv_budget_bytes=budget, idle_timeout_s=1000),
                             layout.bytes_per_token,
                             invariant=KVInvariant(engine.kv_bytes_in_use, lambda used, where: breaches.append(where),
                                                   strict=True), prefix_cache=prefix_cache)
        host = TargetHost(engine, ServiceLimits(max_block=6, max_context=BUDGET_PAGES * PAGE - 8), store,
                                CloudMetrics())
        sessions, refusals = [], 0
        for op, seed in ops:
            rng = random.Random(seed)
            try:
                await _step(host, sessions, op, rng, model.config.vocab_size)
            except CloudError as err:  # admission said no, or the session was evicted: both fine
                assert err.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND), err
                refusals += 1
            assert engine.kv_bytes_in_use() <= budget, (op, engine.kv_bytes_in_use(), budget)
            if pool is not None:  # a page is free exactly when nobody holds it; every cached page is held
                assert pool.free_pages == sum(1 for page in range(pool.pages) if not pool.refs(page))
                assert all(pool.refs(b.storage) >= 1 for b in (prefix_cache.blocks.values() if cached else ()))
        assert not breaches
        for session in list(sessions):
            host.close(session)
        if prefix_cache is not None:
            prefix_cache.clear()
            assert not prefix_cache.blocks  # no session holds a cached block any more
        if pool is not None:  # every page came back
            assert pool.free_pages == pool.pages
        return refusals


SHARED_PREFIXES = [[(7 * i + 3 * j) % 200 for j in range(4 * PAGE)] for i in range(2)]


def _prompt(rng: random.Random, vocab: int, most: int) -> list[int]:
    """Random tokens, or (most often) a cut of one of two shared prefixes with a random tail."""
    tail = [rng.randrange(vocab) for _ in range(rng.randint(1, most))]
    if rng.random() < 0.3:
        return tail
    return (rng.choice(SHARED_PREFIXES)[:rng.randint(0, 4 * PAGE)] + tail)[:most]


async def _step(host: TargetHost, sessions: list, op: str, rng: random.Random, vocab: int) -> None:
    live = [s for s in sessions if host.store.contains(s.session_id)]
    sessions[:] = live
    owner = rng.choice(["edge", "edge", "other"])
    if op == "open" or not live and op in ("verify", "close", "expire"):
        prompt = _prompt(rng, vocab, 5 * PAGE)
        session, _ = await host.open(owner, pb.OpenSession(prompt_ids=prompt))
        sessions.append(session)
        if rng.random() < 0.5:
            await host.first_token(session)
    elif op == "verify":
        session = rng.choice(live)
        block = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        await host.verify(session, pb.VerifyBlock(start_position=session.length, draft_tokens=block,
                                                     method=pb.METHOD_BLOCK))
    elif op == "close":
        host.close(rng.choice(live))
    elif op == "expire":
        victim = rng.choice(live)
        victim.last_used -= 10_000
        host.store.expire_idle()
    else:
        request = pb.GenerateRequest(prompt_ids=_prompt(rng, vocab, 40), max_new_tokens=rng.randint(1, 30))
        async for _ in host.generate(owner, request):
            pass


@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("paged", [False, True], ids=["per-session", "paged"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_kv_in_use_never_exceeds_the_budget(tiny_target, paged, cached, ops):
    asyncio.run(_program(tiny_target, paged, cached, ops))


def test_a_breach_is_counted_and_raises_in_strict_mode():
    """The check itself: a store whose engine reports more than the budget."""
    breaches = []
    store = SessionStore(SessionLimits(kv_budget_bytes=1000), 10,
                         invariant=KVInvariant(lambda: 1001, lambda used, where: breaches.append((used, where)),
                                               strict=False))
    store.check_kv("forward")
    assert breaches == [(1001, "forward")]
    store.invariant.strict = True
    with pytest.raises(KVBudgetExceeded, match="1001 bytes > budget 1000, checked at: eviction"):
        store.enforce_budget()


def test_a_generate_that_ends_at_eos_gives_its_pages_back_at_once(tiny_target):
    """The stop path returned with the engine's generator suspended: its pages came back only when the generator
    was collected, which a property run caught as pages missing at the end."""
    async def program() -> None:
        layout = KVLayout.of(tiny_target.model, page_tokens=PAGE, max_tokens=BUDGET_PAGES * PAGE)
        budget = BUDGET_PAGES * layout.bytes_per_page
        pool = KVPool(layout, budget, slack_tokens=4 * PAGE)
        async with Batcher(packed_forward_of(tiny_target.model), max_batch=4) as batcher:
            engine = ResidentEngine(tiny_target, batcher, layout, pool)
            store = SessionStore(SessionLimits(kv_budget_bytes=budget), layout.bytes_per_token)
            host = TargetHost(engine, ServiceLimits(max_context=BUDGET_PAGES * PAGE - 8), store, CloudMetrics())
            eos = min(tiny_target.eos_token_ids)
            request = pb.GenerateRequest(prompt_ids=[5, 6, 7], max_new_tokens=20,
                                         sampling=pb.SamplingSettings(logit_bias={eos: 100.0}))
            chunks = [chunk async for chunk in host.generate("edge", request)]
            assert chunks[-1].finish_reason == "stop" and list(chunks[-1].token_ids) == [eos]
            assert pool.free_pages == pool.pages

    asyncio.run(program())
