"""Cross-session batching: verify requests that arrive within a short window share one target forward.

The target model is used by one worker thread only (it is not thread-safe, and two forwards at once
would just split the same cores). The event loop gathers requests for up to `window_s` or until
`max_batch` are waiting, hands the batch to that thread, and resolves each request's future.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache, PreTrainedModel

from cloud.batched_forward import forward_batch

log = logging.getLogger(__name__)


@dataclass
class ForwardRequest:
    cache: DynamicCache
    new_tokens: list[int]
    n_logits: int
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    enqueued_at: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class ForwardResult:
    logits: torch.Tensor  # [n_logits, V] float32
    batch_size: int
    queue_ms: float
    forward_ms: float


class Batcher:
    def __init__(self, model: PreTrainedModel, window_s: float = 0.005, max_batch: int = 8,
                 on_batch: Callable[[int, float], None] | None = None,
                 demand: Callable[[], int] | None = None) -> None:
        self.model = model
        self.window_s = window_s
        self.max_batch = max(1, max_batch)
        self.on_batch = on_batch  # (batch size, forward seconds): for metrics
        # How many requests could be coming (open streams): a lone edge never waits out the window.
        self.demand = demand
        self._queue: asyncio.Queue[ForwardRequest] = asyncio.Queue()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="target-forward")
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "Batcher":
        self._task = asyncio.create_task(self._run(), name="batcher")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._worker.shutdown(wait=True)

    async def forward(self, cache: DynamicCache, new_tokens: list[int], n_logits: int) -> ForwardResult:
        """Append `new_tokens` to `cache` (in place) and return the logits of the last `n_logits` positions."""
        request = ForwardRequest(cache, new_tokens, n_logits)
        await self._queue.put(request)
        return await request.future

    def _batch_limit(self) -> int:
        return self.max_batch if self.demand is None else max(1, min(self.max_batch, self.demand()))

    async def _gather(self) -> list[ForwardRequest]:
        batch = [await self._queue.get()]
        deadline = time.perf_counter() + self.window_s
        while len(batch) < self._batch_limit():
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                # Whatever is already queued joins for free.
                while len(batch) < self.max_batch and not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                break
            try:
                batch.append(await asyncio.wait_for(self._queue.get(), remaining))
            except asyncio.TimeoutError:
                break
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._gather()
            started = time.perf_counter()
            try:
                logits = await loop.run_in_executor(
                    self._worker, forward_batch, self.model, [r.cache for r in batch], [r.new_tokens for r in batch],
                    [r.n_logits for r in batch])
            except Exception as err:  # a failed forward fails its requests, never the batcher
                log.exception("target forward failed for a batch of %d", len(batch))
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(err)
                continue
            forward_s = time.perf_counter() - started
            if self.on_batch:
                self.on_batch(len(batch), forward_s)
            for request, request_logits in zip(batch, logits):
                if not request.future.done():
                    request.future.set_result(ForwardResult(
                        request_logits, len(batch), (started - request.enqueued_at) * 1e3, forward_s * 1e3))
