"""One page pool for every session's KV: what paged attention reads (cloud/paged_attention.py).

Glossary
    pool      `keys`, `values` [layers, kv_heads, pages * page_tokens, head_dim], allocated once
    page      `page_tokens` consecutive pool entries; a session's KV is its pages, in order
    slot      an entry's index in the pool: page * page_tokens + offset
    PagedKV   a session's handle on the pool, with ResidentKV's interface (length, capacity, granted,
              reserve, truncate), so the session store charges and grants it the same way

Why a pool: attention over many sessions then reads one tensor per layer through the sessions' page
tables, in one kernel, instead of one call per session per layer; a session grows by taking pages,
never by copying its past. The pool holds the KV budget plus one forward of slack: the session store
grants every page before the forward that writes it (cloud/sessions.py), so it does not run out; a
session that asks for more than is free fails its forward with `KVPoolExhausted`, nothing written.
"""

from __future__ import annotations

import logging
import math
import threading

import torch

from cloud.resident_kv import KVLayout
from common.errors import SprinterError

log = logging.getLogger(__name__)


class KVPoolExhausted(SprinterError, RuntimeError):
    """No free page for a forward: the pool is smaller than what the sessions were granted."""


class KVPool:
    """The pages of all sessions; `session()` makes a handle. Pages are taken in the forward's thread and given
    back from the event loop's, so the free list has a lock; the tensors are written only by forwards."""

    def __init__(self, layout: KVLayout, budget_bytes: int, slack_tokens: int = 0) -> None:
        self.layout = layout
        pages = math.ceil(budget_bytes / layout.bytes_per_page) + layout.pages(slack_tokens)
        shape = (layout.layers, layout.kv_heads, pages * layout.page_tokens, layout.head_dim)
        self.keys = torch.zeros(shape, dtype=layout.dtype, device=layout.device)
        self.values = torch.zeros(shape, dtype=layout.dtype, device=layout.device)
        self._free = list(range(pages - 1, -1, -1))  # a stack: the lowest page first
        self._lock = threading.Lock()
        log.info("KV pool: %d pages of %d tokens (%.0f MiB) on %s", pages, layout.page_tokens,
                 2 * self.keys.numel() * self.keys.element_size() / (1 << 20), layout.device)

    @property
    def pages(self) -> int:
        return self.keys.shape[2] // self.layout.page_tokens

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def session(self) -> PagedKV:
        return PagedKV(self)

    def take(self, n: int) -> list[int]:
        with self._lock:
            if n > len(self._free):
                raise KVPoolExhausted(f"the KV pool has {len(self._free)} free pages of {self.pages}; "
                                      f"a session needs {n} more")
            return [self._free.pop() for _ in range(n)]

    def give_back(self, pages: list[int]) -> None:
        with self._lock:
            self._free.extend(reversed(pages))


class PagedKV:
    """One session's KV as pages of the pool: written by the packed forward, rolled back by moving `length`."""

    copied_bytes = 0  # growth takes pages: nothing is ever copied

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.layout = pool.layout
        self.pages: list[int] = []  # the page table: entry i lives at slot pages[i // T] * T + i % T
        self.length = 0
        self.granted = 0  # as ResidentKV.granted: charged to the budget before the forward that takes it
        self.released = False
        self.in_forward = False  # as ResidentKV.in_forward
        self._pages_returned = False

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.layout.page_tokens

    def capacity_for(self, tokens: int, headroom: int = 0) -> int:
        """The capacity a growth to `tokens` entries takes: whole pages, plus up to `headroom` more."""
        if tokens <= self.capacity:
            return self.capacity
        layout = self.layout
        if tokens > layout.max_tokens:
            raise ValueError(f"{tokens} KV entries exceed this cloud's limit of {layout.max_tokens} per session")
        return min(layout.pages(tokens + headroom), layout.pages(layout.max_tokens)) * layout.page_tokens

    def reserve(self, tokens: int) -> int:
        """Take pages for `tokens` entries in all (the granted capacity if it holds them); copies nothing."""
        if tokens <= self.capacity:
            return 0
        if self.released:
            raise ValueError("this session's KV was released")
        capacity = self.granted if tokens <= self.granted else self.capacity_for(tokens)
        self.pages += self.pool.take(self.layout.pages(capacity) - len(self.pages))
        return 0

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate {self.length} KV entries to {length}")
        self.length = length

    def slots(self, start: int, stop: int) -> list[int]:
        """Pool slots of entries start .. stop - 1."""
        page_tokens = self.layout.page_tokens
        return [self.pages[i // page_tokens] * page_tokens + i % page_tokens for i in range(start, stop)]

    def release(self) -> None:
        """Give every page back to the pool, once (the session is gone), or when the forward using them ends."""
        self.released = True
        if not self.in_forward and not self._pages_returned:
            self._pages_returned = True
            self.pool.give_back(self.pages)

    def end_forward(self) -> None:
        self.in_forward = False
        if self.released:
            self.release()
