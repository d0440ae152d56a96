"""The cloud's cost table: its target's forward times, timed at start, before it serves (GetInfo's `costs`).

An edge that has not verified anything on this cloud yet needs its costs to choose how to decode
(common/spec/round_cost.py): what a decode step costs (mode target), and what a verify of a block of k costs alone
and beside other sessions (speculation). As vLLM profiles its steps before serving, the cloud runs the shapes
itself: `sessions` sessions of `context` tokens each, every one appending `tokens` new tokens in one forward, for
each (sessions, tokens) of the grid, `repeats` times after one untimed warm-up, the median kept. The sessions go
through the engine's own path (its batcher packs the concurrent forwards), so a row is what a verdict would cost
with no queue; the KV they take is released before the service opens.

Grid: tokens 1 (a decode step), 4 and 8 (blocks of 3 and 7) and the largest block the limits allow up to 16 (1 + 16);
sessions 1 and 4, and 128 tokens of context, each as far as the service's limits allow (`TableLimits`: a cloud
started with a small --max-context, --max-sessions or KV budget times smaller shapes; the table says its context and
its batches): 32 forwards after 4 prefills, each shape's first untimed. Measured on one core of this project's CPU machine (AMD EPYC,
AVX-512) for Qwen2.5-Coder-1.5B, the resident engine in bf16 took 15.5 s of start-up for it (a decode step 239 ms,
a block of 3 229 ms, 4 sessions x 17 tokens 689 ms); on llama.cpp its 32 forwards add up to about 10.5 s
by its own medians (its 4 x 17 forward alone is 1 s).
`cloud serve --cost-table off` skips it (GetInfo then reports no table and edges learn the
costs from their verdicts alone).
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field
from typing import Any

from common.sampling.params import SamplingParams
from common.spec.round_cost import CloudCosts

from cloud.engine import TargetEngine

log = logging.getLogger(__name__)

CONTEXT_TOKENS = 128
SESSIONS = (1, 4)
TOKENS = (1, 4, 8)
LARGEST_BLOCK = 16  # the grid's largest block: longer ones are rare, and interpolation reaches them
REPEATS = 3


@dataclass
class TimedSession:
    """A session of the cost table's own (cloud/engine.py EngineSession): greedy, holding random tokens."""

    tokens: list[int]
    cache: Any
    cached_tokens: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)


def grid(max_block: int) -> tuple[int, ...]:
    """New tokens per session to time: a decode step, two block sizes, and the largest verify the limits allow."""
    return tuple(sorted({*TOKENS, min(max_block, LARGEST_BLOCK) + 1}))


@dataclass(frozen=True)
class TableLimits:
    """What the service allows the timed sessions: their context and verify sizes, how many, and their KV."""

    max_block: int
    max_context: int
    max_sessions: int
    kv_budget_bytes: int

    def shape(self, kv_bytes_per_token: int) -> tuple[int, tuple[int, ...]]:
        """(context, sessions): 128 tokens of context where the context limit allows, and the batches whose KV fits
        in half the budget (the rest stays free for what the engine itself holds)."""
        largest = grid(self.max_block)[-1]
        context = max(1, min(CONTEXT_TOKENS, self.max_context - largest))
        fits = self.kv_budget_bytes // 2 // max(1, (context + largest) * kv_bytes_per_token) if kv_bytes_per_token else 1 << 30
        return context, tuple(n for n in SESSIONS if n <= min(self.max_sessions, fits)) or (1,)


async def measure(engine: TargetEngine, limits: TableLimits, repeats: int = REPEATS, seed: int = 0) -> CloudCosts:
    """Time every (sessions, tokens) of the grid on `engine`; the sessions' KV is released whatever happens."""
    context, sessions = limits.shape(engine.kv_bytes_per_token)
    draw = random.Random(seed)
    vocab = engine.info.vocab_size
    held = [TimedSession([draw.randrange(vocab) for _ in range(context)], engine.new_session_kv())
            for _ in range(max(sessions))]
    samples: dict[tuple[int, int], list[float]] = {}
    try:
        for session in held:
            await engine.prefill(session, session.tokens)
            session.cached_tokens = context
        for n in sessions:
            for tokens in grid(limits.max_block):
                new = [[draw.randrange(vocab) for _ in range(tokens)] for _ in range(n)]
                samples[(n, tokens)] = [await _one_forward(engine, held[:n], new) for _ in range(repeats + 1)][1:]
    finally:
        for session in held:
            session.cache.release()
    costs = CloudCosts.from_samples(context, samples)
    log.info("cost table (ms, over %d tokens of context): %s", context,
             ", ".join(f"{n}x{t}: {ms:.1f}" for (n, t), ms in sorted(costs.forward_ms.items())))
    return costs


async def _one_forward(engine: TargetEngine, sessions: list[TimedSession], new: list[list[int]]) -> float:
    """One forward of every session's new tokens at once (the batcher packs them); its time, then rolled back."""
    results = await asyncio.gather(*(engine.forward(s, tokens, n_logits=len(tokens)) for s, tokens in zip(sessions, new)))
    for session in sessions:
        engine.rollback(session, session.cached_tokens)
    return max(result.forward_ms for result in results)
