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

Pages carry reference counts: a page taken has one (its session's); the prefix cache (cloud/prefix_cache.py)
holds one on each page it keeps, and every session whose page table starts from a cached prefix holds one on
each of those pages. A page goes back to the free list when its last holder lets go (`unref`). Sessions only
ever write past their cached prefix, so a shared page is read-only while shared.
"""

from __future__ import annotations

import logging
import math
import threading

import torch

from cloud.resident_kv import KVLayout, moved_entries
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
        self._refs = [0] * pages  # holders of each page (sessions, the prefix cache); 0: free
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
            taken = [self._free.pop() for _ in range(n)]
            for page in taken:
                self._refs[page] = 1
            return taken

    def ref(self, pages: list[int]) -> None:
        """One more holder of each of `pages` (all taken)."""
        with self._lock:
            for page in pages:
                if self._refs[page] < 1:
                    raise ValueError(f"page {page} is free: only a taken page can be shared")
                self._refs[page] += 1

    def unref(self, pages: list[int]) -> None:
        """One holder fewer of each of `pages`; a page nobody holds is free again."""
        with self._lock:
            for page in reversed(pages):
                if self._refs[page] < 1:
                    raise ValueError(f"page {page} is free already")
                self._refs[page] -= 1
                if not self._refs[page]:
                    self._free.append(page)

    def refs(self, page: int) -> int:
        return self._refs[page]


class PagedKV:
    """One session's KV as pages of the pool: written by the packed forward, rolled back by moving `length`."""

    copied_bytes = 0  # growth takes pages: nothing is ever copied

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.layout = pool.layout
        self.pages: list[int] = []  # the page table: entry i lives at slot pages[i // T] * T + i % T
        self.shared_pages = 0  # of these, pages the prefix cache also holds (charged to it, not to the session)
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

    @torch.inference_mode()  # the buffers are the forward's inference tensors
    def keep_path(self, start: int, path: list[int]) -> None:
        """As ResidentKV.keep_path: the path's entries move into place in the pool (every entry past `start` is this
        session's own: only a cached prefix's pages are shared), then the length drops."""
        source, target = moved_entries(self.length, start, path)
        if target and target[0] < self.shared_tokens:
            raise ValueError(f"entry {target[0]} is in a shared page: a kept path cannot move into it")
        if source:
            slots = [self.slots(entry, entry + 1)[0] for entry in source + target]
            sources = torch.tensor(slots[:len(source)], device=self.pool.keys.device)
            targets = torch.tensor(slots[len(source):], device=self.pool.keys.device)
            self.pool.keys.index_copy_(2, targets, self.pool.keys.index_select(2, sources))
            self.pool.values.index_copy_(2, targets, self.pool.values.index_select(2, sources))
        self.truncate(start + len(path))

    def slots(self, start: int, stop: int) -> list[int]:
        """Pool slots of entries start .. stop - 1."""
        page_tokens = self.layout.page_tokens
        return [self.pages[i // page_tokens] * page_tokens + i % page_tokens for i in range(start, stop)]

    def start_from(self, pages: list[int]) -> None:
        """Begin an empty session with `pages`, a cached prefix of whole pages held with the prefix cache; as many
        pages it had taken already go back."""
        if self.length or self.shared_pages:
            raise ValueError("a cached prefix can only start an empty session")
        self.pool.ref(pages)
        replaced, self.pages = self.pages[:len(pages)], list(pages) + self.pages[len(pages):]
        self.pool.unref(replaced)
        self.length, self.shared_pages = len(pages) * self.layout.page_tokens, len(pages)

    @property
    def shared_tokens(self) -> int:
        return self.shared_pages * self.layout.page_tokens

    def release(self) -> None:
        """Let go of every page, once (the session is gone), or when the forward using them ends; a page the
        prefix cache or another session holds stays taken."""
        self.released = True
        if not self.in_forward and not self._pages_returned:
            self._pages_returned = True
            self.pool.unref(self.pages)

    def end_forward(self) -> None:
        self.in_forward = False
        if self.released:
            self.release()
