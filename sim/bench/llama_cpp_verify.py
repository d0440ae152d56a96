"""The verify step of `sprinter bench llama-cpp`: the llama.cpp engine and its batcher in this process, timed.

EDGES sessions each hold CONTEXT tokens of their own (distinct, as different edges' conversations would);
each round, every session's BLOCK-token block goes into one forward (as the cloud batches verifies that
arrive together), then each session's alone; every block is rolled back after its forward, so each
round sees the same contexts. Greedy verification reads the argmax of every row, as here.
"""

from __future__ import annotations

import asyncio
import logging
import random
from types import SimpleNamespace

from cloud.batcher import Batcher
from cloud.engine import ForwardStats
from cloud.llama_cpp_engine import LlamaCppEngine

log = logging.getLogger(__name__)
KV_BUDGET_BYTES = 1 << 30


async def timed_verifies(target: str, edges: int, block: int, context: int,
                         repeats: int) -> tuple[list[float], list[list[float]]]:
    """Seconds of each round's batched forward, and of each session's forward alone, per round."""
    engine = LlamaCppEngine.load(target, threads=1, kv_budget_bytes=KV_BUDGET_BYTES, max_tokens=context + block + 1,
                                 max_sequences=edges, max_forward_tokens=max(512, edges * block))
    forwards: list[ForwardStats] = []
    try:
        async with Batcher(engine.packed_forward, max_batch=edges, max_forward_tokens=max(512, edges * block),
                           on_batch=forwards.append) as batcher:
            engine.batcher = batcher
            draw = random.Random(0)
            sessions = [SimpleNamespace(cache=engine.new_session_kv()) for _ in range(edges)]
            for i, session in enumerate(sessions):
                print(f"prefilling session {i + 1}/{edges}: {context} tokens", flush=True)
                await batcher.prefill(session.cache, [draw.randrange(100, 30000) for _ in range(context)])
            blocks = [[draw.randrange(100, 30000) for _ in range(block)] for _ in sessions]
            batched: list[float] = []
            alone: list[list[float]] = [[] for _ in sessions]
            for round_ in range(repeats):
                forwards.clear()
                await asyncio.gather(*(batcher.forward(s.cache, b, block, full_logits=False)
                                       for s, b in zip(sessions, blocks)))
                assert [f.requests for f in forwards] == [edges], "the blocks did not share one forward"
                batched.append(forwards[0].seconds)
                _roll_back(engine, sessions, context)
                for i, (session, tokens) in enumerate(zip(sessions, blocks)):
                    forwards.clear()
                    await batcher.forward(session.cache, tokens, block, full_logits=False)
                    alone[i].append(forwards[0].seconds)
                    _roll_back(engine, [session], context)
                print(f"round {round_ + 1}/{repeats}: batched {batched[-1]:.3f} s, one by one "
                      f"{sum(a[-1] for a in alone):.3f} s", flush=True)
            return batched, alone
    finally:
        engine.close()


def _roll_back(engine: LlamaCppEngine, sessions: list[SimpleNamespace], context: int) -> None:
    for session in sessions:
        engine.rollback(session, context)
