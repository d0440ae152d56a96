"""The verify step of `sprinter bench llama-cpp`: the llama.cpp engine and its batcher in this process, timed.

EDGES sessions each hold CONTEXT tokens of their own (distinct, as different edges' conversations would);
each round, every session's BLOCK-token block goes into one forward (as the cloud batches verifies that
arrive together), then each session's alone; every block is rolled back after its forward, so each
round sees the same contexts. Greedy verification reads the argmax of every row, as here.

Beside it, what llama.cpp does with the same work through its C API alone (no batcher, no engine): the same
sessions' blocks in one `llama_decode`, with unified KV (as the engine and llama-server's parallel slots hold it)
and with a KV stream per sequence.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from types import SimpleNamespace

from cloud.batcher import Batcher
from cloud.engine import ForwardStats
from cloud.llama_cpp_engine import LlamaCppEngine
from common.model.llama_cpp_runtime import ContextShape, LlamaCppModel, Segment
from common.model.loading import gguf_file

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
            contexts, blocks = _work(edges, block, context)
            sessions = [SimpleNamespace(cache=engine.new_session_kv()) for _ in range(edges)]
            for i, (session, tokens) in enumerate(zip(sessions, contexts)):
                print(f"prefilling session {i + 1}/{edges}: {context} tokens", flush=True)
                await batcher.prefill(session.cache, tokens)
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


def _work(edges: int, block: int, context: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each session's context and block: distinct random tokens, the same for every measurement."""
    draw = random.Random(0)
    contexts = [[draw.randrange(100, 30000) for _ in range(context)] for _ in range(edges)]
    return contexts, [[draw.randrange(100, 30000) for _ in range(block)] for _ in range(edges)]


def c_api_verifies(target: str, edges: int, block: int, context: int, repeats: int, unified: bool) -> list[float]:
    """Seconds of each round's one `llama_decode` of every session's block, through llama.cpp's C API alone.

    A load of its own: KV unified or not is fixed when a context is made, and LlamaCppModel is one model and one
    context; the GGUF is mapped (mmap), so this load reads the weights from the page cache, not the disk."""
    batch_tokens = max(512, edges * block)
    model = LlamaCppModel(gguf_file(target), ContextShape(kv_bytes=0, slack_cells=edges * (context + batch_tokens),
                                                          sequences=edges, batch_tokens=batch_tokens, threads=1,
                                                          unified=unified))
    try:
        contexts, blocks = _work(edges, block, context)
        for seq, tokens in enumerate(contexts):
            print(f"C API ({'unified KV' if unified else 'a stream per sequence'}): prefilling sequence "
                  f"{seq + 1}/{edges}", flush=True)
            for start in range(0, context, batch_tokens):
                model.decode([Segment(seq, start, tokens[start:start + batch_tokens], 1)], [False])
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            model.decode([Segment(seq, context, tokens, block) for seq, tokens in enumerate(blocks)], [False] * edges)
            seconds.append(time.perf_counter() - started)
            for seq in range(edges):
                model.remove(seq, context)
        return seconds
    finally:
        model.close()
