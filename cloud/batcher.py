"""Cross-session batching: verify requests that arrive within a short window share one target forward.

The target model is used by one worker thread only (it is not thread-safe, and two forwards at once
would just split the same cores). The event loop gathers requests for up to `window_s` or until
`max_batch` are waiting, hands the batch to that thread, and resolves each request's future.

One padded target forward for the token blocks of many sessions (`forward_batch`):

Every session owns a batch-1 `DynamicCache` of its own length L_i and brings n_i >= 1 new tokens.
`forward_batch` lays them out as one batch:

    cache part (left-padded to L = max L_i)     new part (right-padded to T = max n_i)
    [pad pad k0 k1 k2 ... k_{L_i-1}]            [t0 t1 ... t_{n_i-1} pad pad]

The 2D attention mask hides the padding on both sides and explicit position ids put session i's new
tokens at L_i .. L_i + n_i - 1, so every real query sees exactly what it would see alone. No query row
is ever fully masked (each sees at least its block's first real token), so SDPA produces no NaNs.
Right-padded query rows compute garbage that nobody reads, and their KV entries are never copied back:
after the forward, each session's cache gets exactly its n_i new entries appended, as if it had run
alone, so later single-session forwards and `crop()` work on it unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache, PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicLayer

log = logging.getLogger(__name__)


def _check_arguments(caches: list[DynamicCache], new_tokens: list[list[int]], n_logits: list[int]) -> None:
    if not caches or not len(caches) == len(new_tokens) == len(n_logits):
        raise ValueError("caches, new_tokens and n_logits must be non-empty lists of the same length")
    for i, (cache, tokens, n) in enumerate(zip(caches, new_tokens, n_logits)):
        if not 1 <= n <= len(tokens):
            raise ValueError(f"session {i}: n_logits={n} is outside 1..{len(tokens)} (its number of new tokens)")
        # Sliding-window or linear-attention layers keep truncated states: left-padding them is another problem.
        if any(type(layer) is not DynamicLayer for layer in cache.layers):
            raise NotImplementedError(f"session {i}: only full-attention DynamicLayer caches are supported")
        if any(layer.get_seq_length() > 0 and layer.keys.shape[0] != 1 for layer in cache.layers):
            raise ValueError(f"session {i}: each cache must hold a single sequence (batch size 1)")


def _left_padded_cache(
    caches: list[DynamicCache], lengths: list[int], past: int, config: PreTrainedConfig
) -> DynamicCache:
    """A batch cache whose row i is session i's cache, left-padded with zeros to `past` entries."""
    if past == 0:
        return DynamicCache(config=config)
    donor = caches[lengths.index(past)]  # a non-empty cache gives every layer's head count, head dim and dtype
    layers = []
    for layer_idx, ref in enumerate(donor.layers):
        keys = ref.keys.new_zeros((len(caches), ref.keys.shape[1], past, ref.keys.shape[3]))
        values = ref.values.new_zeros((len(caches), ref.values.shape[1], past, ref.values.shape[3]))
        for row, (cache, length) in enumerate(zip(caches, lengths)):
            if length:
                keys[row, :, past - length :] = cache.layers[layer_idx].keys[0]
                values[row, :, past - length :] = cache.layers[layer_idx].values[0]
        layers.append((keys, values))
    return DynamicCache(layers, config=config)


@torch.inference_mode()
def forward_batch(
    model: PreTrainedModel, caches: list[DynamicCache], new_tokens: list[list[int]], n_logits: list[int]
) -> list[torch.Tensor]:
    """Run session i's `new_tokens[i]` on top of `caches[i]`, all sessions in one forward.

    Appends each session's new KV entries to its own cache and returns, per session, the float32
    logits of its last `n_logits[i]` new positions ([n_logits[i], V]; row r predicts the token after
    the r-th of those positions).
    """
    _check_arguments(caches, new_tokens, n_logits)
    device = model.device
    if len(caches) == 1:  # fast path: a plain forward on the session's own cache, nothing copied
        out = model(
            input_ids=torch.tensor(new_tokens, device=device),
            past_key_values=caches[0],
            use_cache=True,
            logits_to_keep=n_logits[0],
        )
        return [out.logits[0].float()]

    lengths = [cache.get_seq_length() for cache in caches]
    counts = [len(tokens) for tokens in new_tokens]
    past, width = max(lengths), max(counts)
    batch_cache = _left_padded_cache(caches, lengths, past, model.config)

    pad_id = new_tokens[0][0]  # any valid id: padded positions are masked as keys and their outputs are dropped
    input_ids = torch.tensor([tokens + [pad_id] * (width - len(tokens)) for tokens in new_tokens], device=device)
    attention_mask = torch.zeros((len(caches), past + width), dtype=torch.long, device=device)
    for row, (length, count) in enumerate(zip(lengths, counts)):
        attention_mask[row, past - length : past + count] = 1
    # Real positions, not padded ones: RoPE must rotate session i's new keys/queries as if it ran alone.
    position_ids = torch.tensor(lengths, device=device)[:, None] + torch.arange(width, device=device)

    # The LM head runs on the last `keep` columns only: enough to cover every session's wanted rows.
    keep = max(width - count + n for count, n in zip(counts, n_logits))
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=batch_cache,
        use_cache=True,
        logits_to_keep=keep,
    )

    # Hand each session its own new KV entries (the padded ones are dropped). `update` concatenates,
    # so the session caches hold fresh tensors and keep nothing of the batch cache alive.
    for layer_idx, layer in enumerate(batch_cache.layers):
        for row, (cache, count) in enumerate(zip(caches, counts)):
            cache.update(
                layer.keys[row : row + 1, :, past : past + count],
                layer.values[row : row + 1, :, past : past + count],
                layer_idx,
            )

    first_kept = width - keep  # out.logits[:, c] belongs to new position first_kept + c
    return [
        out.logits[row, count - n - first_kept : count - first_kept].float()
        for row, (count, n) in enumerate(zip(counts, n_logits))
    ]


@dataclass
class ForwardRequest:
    cache: DynamicCache
    new_tokens: list[int]
    n_logits: int
    abandoned: Callable[[], bool] | None = None  # true once nobody waits for the answer: the forward is skipped
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    enqueued_at: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class ForwardResult:
    logits: torch.Tensor  # [n_logits, V] float32
    batch_size: int
    queue_ms: float
    forward_ms: float


class Batcher:
    """Verify requests are batched; prompts are prefilled apart, in chunks, taking turns with verify batches.

    A prefill never joins a verify batch: padded to the prompt's width, it would multiply every
    verify's attention and LM-head work by the batch size. Chunks of at most `max_prefill_chunk`
    tokens run alone, and whenever verifies are waiting a verify batch runs between two chunks, so a
    long prompt delays a verify by one chunk's forward, not by the whole prefill.
    """

    def __init__(self, model: PreTrainedModel, window_s: float = 0.005, max_batch: int = 8,
                 on_batch: Callable[[int, float], None] | None = None,
                 demand: Callable[[], int] | None = None, max_prefill_chunk: int = 256) -> None:
        self.model = model
        self.window_s = window_s
        self.max_batch = max(1, max_batch)
        self.max_prefill_chunk = max(1, max_prefill_chunk)
        self.on_batch = on_batch  # (batch size, forward seconds): for metrics
        # How many requests could be coming (open streams): a lone edge never waits out the window.
        self.demand = demand
        self.dropped = 0  # requests skipped because their caller had left
        self._verifies: deque[ForwardRequest] = deque()
        self._prefills: deque[ForwardRequest] = deque()
        self._arrived = asyncio.Event()
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

    async def forward(self, cache: DynamicCache, new_tokens: list[int], n_logits: int,
                      abandoned: Callable[[], bool] | None = None) -> ForwardResult:
        """Append `new_tokens` to `cache` (in place) and return the logits of the last `n_logits` positions.

        A few tokens (a verify block, a decode step): batched with other sessions' requests.
        """
        request = ForwardRequest(cache, new_tokens, n_logits, abandoned)
        self._verifies.append(request)
        self._arrived.set()
        return await request.future

    async def prefill(self, cache: DynamicCache, tokens: list[int], abandoned: Callable[[], bool] | None = None) -> None:
        """Append `tokens` to `cache` in chunks that run alone; raises CancelledError if the caller left."""
        for start in range(0, len(tokens), self.max_prefill_chunk):
            request = ForwardRequest(cache, tokens[start:start + self.max_prefill_chunk], 1, abandoned)
            self._prefills.append(request)
            self._arrived.set()
            await request.future

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

    async def _gather(self) -> list[ForwardRequest]:
        batch = [self._verifies.popleft()]
        deadline = time.perf_counter() + self.window_s
        while len(batch) < self._batch_limit():
            if self._verifies:
                batch.append(self._verifies.popleft())
                continue
            remaining = deadline - time.perf_counter()
            if remaining <= 0 or self._prefills:  # a waiting prefill chunk is not kept waiting for the window
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                break
        while len(batch) < self.max_batch and self._verifies:  # whatever is already queued joins for free
            batch.append(self._verifies.popleft())
        return batch

    def _without_abandoned(self, batch: list[ForwardRequest]) -> list[ForwardRequest]:
        """Skip requests nobody waits for: their caller was cancelled, or `abandoned()` says it left."""
        kept = []
        for request in batch:
            if not request.future.done() and request.abandoned is not None and request.abandoned():
                request.future.cancel()
            if request.future.done():
                self.dropped += 1
                log.info("skipped a forward of %d tokens: its caller left", len(request.new_tokens))
            else:
                kept.append(request)
        return kept

    async def _run(self) -> None:
        prefill_next = False
        while True:
            await self._wait_for_work()
            if self._prefills and (prefill_next or not self._verifies):
                batch, prefill_next = [self._prefills.popleft()], False
            else:
                batch, prefill_next = await self._gather(), True
            batch = self._without_abandoned(batch)
            if batch:
                await self._forward(batch)

    async def _forward(self, batch: list[ForwardRequest]) -> None:
        started = time.perf_counter()
        try:
            logits = await asyncio.get_running_loop().run_in_executor(
                self._worker, forward_batch, self.model, [r.cache for r in batch], [r.new_tokens for r in batch],
                [r.n_logits for r in batch])
        except Exception as err:  # a failed forward fails its requests, never the batcher
            log.exception("target forward failed for a batch of %d", len(batch))
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(err)
            return
        forward_s = time.perf_counter() - started
        if self.on_batch:
            self.on_batch(len(batch), forward_s)
        for request, request_logits in zip(batch, logits):
            if not request.future.done():
                request.future.set_result(ForwardResult(
                    request_logits, len(batch), (started - request.enqueued_at) * 1e3, forward_s * 1e3))
