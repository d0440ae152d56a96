"""Continuous batching: the target runs one packed forward after another over whatever is waiting.

The target model is used by one worker thread only (it is not thread-safe, and two forwards at once
would just split the same cores). Whenever that thread is free and work is waiting, the next forward
takes every verify request that has arrived (up to `max_batch` requests and `max_forward_tokens`
tokens): under load, requests pile up during a forward and all join the next one. Each forward is
one packed, unpadded pass over resident KV caches (cloud/packed_forward.py; the llama.cpp engine's
is one `llama_decode` over sequences), so joining a batch costs a request neither padding nor a copy
of anyone's past.

Stragglers: right after a forward, if fewer verifies wait than sessions are open (`demand`), the
next forward is held for at most `straggler_share` of the previous forward's time, capped at
`max_hold_s` (or a fixed `window_s`, `--batch-window-ms`). Without it, edges that answer verdicts at
once fall into two groups that take turns, each forward carrying half of them and each request
waiting out the other half's forward; with it, the groups merge for a fraction of a forward. A lone
session (demand 1) never waits, nor does a request that finds the engine idle (no forward ended
within the last forward's duration): at low load a verify joins the next forward at once.

Prompts are prefilled in chunks of at most `max_prefill_chunk` tokens that ride along with the
verifies: a forward carries at most one chunk, so a long prompt delays a verify by one chunk's
compute, never by the whole prefill, and a chunk left out of a full forward goes first in the next.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from cloud.engine import ForwardResult, ForwardStats, TargetRows
from cloud.resident_kv import ResidentKV

log = logging.getLogger(__name__)
STRAGGLER_SHARE = 0.25  # the hold right after a forward: this share of it (module docstring) ...
MAX_HOLD_S = 0.02  # ... at most this long


class PackedForward(Protocol):
    """One forward over every request of a batch: session i's `new_tokens[i]` appended to `caches[i]` (in place), the
    rows of its last `n_logits[i]` positions back (cloud/packed_forward.py: the resident engine's; the llama.cpp
    engine's: one `llama_decode`)."""

    def __call__(self, caches: list[Any], new_tokens: list[list[int]], n_logits: list[int], full_logits: list[bool],
                 trees: list[list[int] | None]) -> list[TargetRows]: ...


@dataclass
class ForwardRequest:
    cache: ResidentKV
    new_tokens: list[int]
    n_logits: int
    abandoned: Callable[[], bool] | None = None  # true once nobody waits for the answer: the forward is skipped
    full_logits: bool = True  # False: the argmax is all the caller reads (greedy), the logits stay on the device
    tree: list[int] | None = None  # the block's parents (common/spec/tree/draft_tree.py); None: a chain
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    enqueued_at: float = field(default_factory=time.perf_counter)


class Batcher:
    """The engine's scheduler: `forward` (a verify, a decode step) and `prefill` queue work; one thread runs it."""

    def __init__(self, forward: PackedForward, window_s: float = 0.0, max_batch: int = 8,
                 on_batch: Callable[[ForwardStats], None] | None = None,
                 demand: Callable[[], int] | None = None, max_prefill_chunk: int = 256,
                 max_forward_tokens: int = 1024, straggler_share: float = STRAGGLER_SHARE, max_hold_s: float = MAX_HOLD_S,
                 worker: ThreadPoolExecutor | None = None) -> None:
        self.packed_forward = forward
        self.window_s = window_s
        self.straggler_share = straggler_share
        self.max_hold_s = max_hold_s
        self._last_forward_s = 0.0
        self._last_forward_end = 0.0
        self.max_batch = max(1, max_batch)
        self.max_prefill_chunk = max(1, max_prefill_chunk)
        self.max_forward_tokens = max(1, max_forward_tokens)
        self.on_batch = on_batch  # every forward's ForwardStats: for metrics
        # How many requests could be coming (open streams): a window never waits for requests that cannot come.
        self.demand = demand
        self.dropped = 0  # requests skipped because their caller had left
        self._verifies: deque[ForwardRequest] = deque()
        self._prefills: deque[ForwardRequest] = deque()
        self._prefill_first = False  # a chunk left out of a full forward goes first in the next
        self._arrived = asyncio.Event()
        # One thread runs the forwards. Another batcher on the same device (the cloud's draft, cloud/cloud_sd.py)
        # shares it: two models' forwards at once would only split the same cores, and while one kind runs, the
        # other kind's requests gather into a bigger batch.
        self._own_worker = worker is None
        self._worker = worker or ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "Batcher":
        self._task = asyncio.create_task(self._run(), name="batcher")
        self._task.add_done_callback(self._fail_waiting)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._own_worker:
            self._worker.shutdown(wait=True)

    def _fail_waiting(self, task: asyncio.Task) -> None:
        """If the scheduling loop itself died (a bug, not a failed forward), fail every waiting request with its
        error instead of leaving callers to wait forever."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("the batcher's loop died", exc_info=task.exception())
        for request in (*self._verifies, *self._prefills):
            if not request.future.done():
                request.future.set_exception(task.exception())

    async def forward(self, cache: ResidentKV, new_tokens: list[int], n_logits: int,
                      abandoned: Callable[[], bool] | None = None, full_logits: bool = True,
                      tree: list[int] | None = None) -> ForwardResult:
        """Append `new_tokens` to `cache` (in place) and return the rows of the last `n_logits` positions; `tree`:
        the block's parents, when it is a tree of tokens (common/spec/tree/draft_tree.py)."""
        request = ForwardRequest(cache, new_tokens, n_logits, abandoned, full_logits, tree)
        self._raise_if_stopped()
        self._verifies.append(request)
        self._arrived.set()
        return await request.future

    async def prefill(self, cache: ResidentKV, tokens: list[int], abandoned: Callable[[], bool] | None = None,
                      full_logits: bool = True) -> ForwardResult | None:
        """Append `tokens` to `cache` in chunks, one per forward, and return the last chunk's (the row after the last
        token: a Generate's first token); raises CancelledError if the caller left."""
        # The whole prompt at once (a session's spare pages are the session store's grant): no copy mid-prefill.
        cache.reserve(cache.length + len(tokens))
        result = None
        for start in range(0, len(tokens), self.max_prefill_chunk):
            request = ForwardRequest(cache, tokens[start:start + self.max_prefill_chunk], 1, abandoned, full_logits)
            self._raise_if_stopped()
            self._prefills.append(request)
            self._arrived.set()
            result = await request.future
        return result

    def _raise_if_stopped(self) -> None:
        if self._task is not None and self._task.done() and not self._task.cancelled():
            raise RuntimeError("the batcher's loop has stopped") from self._task.exception()

    @property
    def worker(self) -> ThreadPoolExecutor:
        """The thread that runs this batcher's forwards (another batcher on the same device may share it)."""
        return self._worker

    @property
    def queue_depth(self) -> int:
        """Forwards waiting for the model: verify requests and prefill chunks."""
        return len(self._verifies) + len(self._prefills)

    def _batch_limit(self) -> int:
        return self.max_batch if self.demand is None else max(1, min(self.max_batch, self.demand()))

    async def _wait_for_work(self) -> None:
        while not self._verifies and not self._prefills:
            self._arrived.clear()
            await self._arrived.wait()

    async def _wait_for_stragglers(self) -> None:
        """Hold the forward until as many verifies wait as sessions are open, for a bounded time (module docstring)."""
        now = time.perf_counter()
        if self.window_s > 0:
            hold_s = self.window_s
        elif now - self._last_forward_end > self._last_forward_s:
            return  # the engine was idle: nobody is about to join
        else:
            hold_s = min(self.max_hold_s, self.straggler_share * self._last_forward_s)
        deadline = now + hold_s
        while len(self._verifies) < self._batch_limit() and not self._prefills:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                return

    def _next_batch(self) -> list[ForwardRequest]:
        """Verifies in arrival order within the request and token budgets, and at most one prefill chunk."""
        batch: list[ForwardRequest] = []
        tokens = 0
        chunk_first = bool(self._prefills) and (self._prefill_first or not self._verifies)
        if chunk_first:
            batch.append(self._prefills.popleft())
            tokens = len(batch[0].new_tokens)
        while self._verifies and len(batch) < self.max_batch and (
                not batch or tokens + len(self._verifies[0].new_tokens) <= self.max_forward_tokens):
            tokens += len(self._verifies[0].new_tokens)
            batch.append(self._verifies.popleft())
        self._prefill_first = False
        if not chunk_first and self._prefills:
            if len(batch) < self.max_batch and tokens + len(self._prefills[0].new_tokens) <= self.max_forward_tokens:
                batch.append(self._prefills.popleft())
            else:
                self._prefill_first = True
        return batch

    def _without_abandoned(self, batch: list[ForwardRequest]) -> list[ForwardRequest]:
        """Skip requests nobody waits for: their caller was cancelled, or `abandoned()` says it left."""
        kept = []
        for request in batch:
            if not request.future.done() and (request.cache.released or
                                              request.abandoned is not None and request.abandoned()):
                request.future.cancel()
            if request.future.done():
                self.dropped += 1
                log.info("skipped a forward of %d tokens: its caller left", len(request.new_tokens))
            else:
                kept.append(request)
        return kept

    async def _run(self) -> None:
        while True:
            await self._wait_for_work()
            if self._verifies:
                await self._wait_for_stragglers()
            batch = self._without_abandoned(self._next_batch())
            if batch:
                await self._forward(batch)

    async def _forward(self, batch: list[ForwardRequest]) -> None:
        copied_before = sum(r.cache.copied_bytes for r in batch)
        for request in batch:  # a session closed meanwhile keeps its KV until this forward is done with it
            request.cache.in_forward = True
        try:
            rows, started, forward_s = await asyncio.get_running_loop().run_in_executor(
                self._worker, _timed_forward, self.packed_forward, [r.cache for r in batch], [r.new_tokens for r in batch],
                [r.n_logits for r in batch], [r.full_logits for r in batch], [r.tree for r in batch])
        except Exception as err:  # a failed forward fails its requests, never the batcher
            log.exception("target forward failed for a batch of %d", len(batch))
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(err)
            return
        finally:
            for request in batch:
                request.cache.end_forward()
        self._last_forward_s, self._last_forward_end = forward_s, time.perf_counter()
        if self.on_batch:
            self.on_batch(ForwardStats(len(batch), sum(len(r.new_tokens) for r in batch), forward_s,
                                       sum(r.cache.copied_bytes for r in batch) - copied_before))
        for request, request_rows in zip(batch, rows):
            if not request.future.done():
                request.future.set_result(ForwardResult(
                    request_rows, len(batch), (started - request.enqueued_at) * 1e3, forward_s * 1e3))


def _timed_forward(forward: PackedForward, *args: Any) -> tuple[list, float, float]:
    """The packed forward, when it began and the seconds it ran, timed on the worker: a forward waiting for the
    thread (another batcher's, sharing it) is queueing, not forward time."""
    started = time.perf_counter()
    rows = forward(*args)
    return rows, started, time.perf_counter() - started
