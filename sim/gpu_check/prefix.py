"""The prefix cache on the device: a session of the owed context opened from a cached prefix against a cold one.

In the paged layout (CUDA's default) the new session shares the cached pages and prefills only its last,
partial page; in the per-session layout (a CPU's) the pages are copied into its buffer first. Each trial
prefills a fresh prompt cold, caches it, then opens it again from the cache; both sides include the
forward of the prompt's last token, as an open's first verify would.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from cloud.kv_pool import KVPool
from cloud.prefix_cache import PrefixCache
from sim.bench.engine import kv_store, new_cache, prefill
from sim.gpu_check.run_state import CheckRun, Deadline

TRIALS = 3


def prefix_step(run: CheckRun, deadline: Deadline) -> dict[str, Any]:
    sizes = run.sizes
    settings = replace(run.bench_settings(), contexts=(sizes.prefix_context,), edges=(2,))  # the store: two sessions
    model = run.model(sizes.owed)
    kv = kv_store(model, run.default_layout, settings)
    pool = kv if isinstance(kv, KVPool) else None
    cache = PrefixCache(pool.layout if pool else kv, pool)
    rng, cold_ms, warm_ms, cached = random.Random(6), [], [], 0
    for _ in range(TRIALS):
        if deadline.passed():
            break
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(sizes.prefix_context)]
        first, elapsed, _ = _open(run, model, kv, cache, prompt, from_cache=False)
        cold_ms.append(elapsed)
        cache.remember(first, "edge", prompt)
        second, elapsed, cached = _open(run, model, kv, cache, prompt, from_cache=True)
        warm_ms.append(elapsed)
        for session in (first, second):
            session.release()
        cache.clear()  # the store holds two sessions: a trial's cached pages go back before the next
    if not cold_ms:
        return {"not_reached": ["every trial"]}
    cold, warm = statistics.median(cold_ms), statistics.median(warm_ms)
    return {"target": sizes.owed, "attention": run.default_layout, "context": sizes.prefix_context,
            "page_tokens": cache.layout.page_tokens, "cached_tokens": cached, "cold_open_ms": round(cold, 2), "cached_open_ms": round(warm, 2),
            "cached_over_cold": round(warm / cold, 3), "trials": len(cold_ms)}


def _open(run: CheckRun, model: torch.nn.Module, kv, cache: PrefixCache, prompt: list[int],
          from_cache: bool) -> tuple[Any, float, int]:
    """A session of `prompt` (from its cached prefix, or cold) with its last token's forward; (session, ms, tokens
    taken from the cache)."""
    run.synchronize()
    started = time.perf_counter()
    session = new_cache(kv, len(prompt) + 8)
    start = cache.start(session, "edge", prompt[:-1]).tokens if from_cache else 0
    prefill(model, session, prompt[start:])
    run.synchronize()
    return session, (time.perf_counter() - started) * 1e3, start
