"""The draft's prompt KV, reused across requests (`sprinter edge serve --draft-cache-mb`).

The cloud's prefix cache (cloud/prefix_cache.py) keeps whole pages under chained digests; the edge's draft needs
less: one process, one model, a few conversations. So an entry here is a whole context (the tokens a finished
prefill or a finished generation left in the draft's KV) with an owned copy of that KV, and a lookup takes the
entry sharing the longest token prefix with a new generation's context: any prefix, not whole pages, since the
draft's KV is one contiguous tensor per layer (or llama.cpp's cells of one sequence) that a copy may cut anywhere.

Glossary
    entry       tokens and a copy of the draft's KV for exactly them (`CachedLM`/`OnnxCachedLM`/`LlamaCppDraftLM`
                `.kv_snapshot`)
    reuse       a new generation's runtime starts from a copy of an entry's first rows (`start_from`) and feeds
                only the rest of its context; the last token is always fed, so its logits are computed
    claim       a prefill in flight: a generation whose context shares a longer prefix with it than with any
                entry waits for it (the `n` choices of one request start together; all but one would miss)
    saved       the draft's prefill time a reuse saved: reused tokens times the prefill's measured seconds per
                token (an estimate: the rate of this edge's own recent prefills)

Entries are evicted least recently used first to keep their bytes within the budget; an entry whose tokens a new
one extends is dropped for it (the new one holds all it held). Copies are never shared: an entry is copied out of
a runtime when stored and copied into one when reused, so a generation's rollback or growth never touches it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

if TYPE_CHECKING:  # annotations only: `edge serve --help` reads the default below without loading torch
    import torch

    from common.model.cached_lm import DraftLM, ForwardOutput
    from common.stats import StatsRecorder

log = logging.getLogger(__name__)

# Below this many shared tokens a reuse is not worth its copy: a prefill's cost is mostly the fixed cost of one
# forward (weights read once), so a handful of tokens (a BOS and a role marker) saves next to nothing.
MIN_REUSE_TOKENS = 8
# Prefills shorter than this are not timed into the rate: one forward's fixed cost dominates a few tokens.
MIN_TIMED_PREFILL = 16
CLAIM_WAIT_S = 60.0  # a claimer that never settles (it would be a bug) delays the others this long, not forever


class ReusableLM(Protocol):
    """What reuse needs of a draft runtime beyond `DraftLM`: `CachedLM`, `OnnxCachedLM` and `LlamaCppDraftLM` fit."""

    tokens: list[int]
    reusable: bool

    def advance_to(self, context: list[int], n_logits: int = 1) -> ForwardOutput: ...

    def kv_snapshot(self) -> tuple[object, int]: ...

    def start_from(self, tokens: list[int], kv: object) -> None: ...


@dataclass
class CacheEntry:
    key: int  # its place in the cache's order
    tokens: np.ndarray  # int64: the context whose KV `kv` holds
    kv: object  # the runtime's own copy (torch tensors per layer, numpy arrays or OrtValues, llama.cpp's state bytes)
    nbytes: int


@dataclass
class Claim:
    tokens: np.ndarray
    done: threading.Event = field(default_factory=threading.Event)


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


@dataclass
class DraftKVCache:
    """Entries within `max_bytes`, least recently used first; thread-safe (drafts run in worker threads)."""

    max_bytes: int
    entries: OrderedDict[int, CacheEntry] = field(default_factory=OrderedDict)
    claims: dict[int, Claim] = field(default_factory=dict)
    nbytes: int = 0
    prefill_s_per_token: float | None = None  # the latest timed prefill's rate: what a reused token saves
    # Totals since start (the edge's metrics read them too, per generation, from the stats)
    hits: int = 0
    evictions: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _next_id: int = 0

    def _best(self, context: np.ndarray) -> tuple[CacheEntry | None, int]:
        best, length = None, 0
        for entry in self.entries.values():
            shared = shared_prefix(entry.tokens, context)
            if shared > length:
                best, length = entry, shared
        return best, length

    def lookup(self, context: list[int]) -> tuple[CacheEntry | None, int, int]:
        """(the entry sharing the longest prefix with `context`, how many of its rows to reuse, a claim id to settle).

        Waits first for a claim in flight that shares a longer prefix than any entry. The rows reused leave the
        last token of `context` to be fed (its logits are what the caller wants)."""
        tokens = np.asarray(context, dtype=np.int64)
        while True:
            with self._lock:
                entry, length = self._best(tokens)
                waiting = next((c for c in self.claims.values()
                                if shared_prefix(c.tokens, tokens) >= max(length, MIN_REUSE_TOKENS) + MIN_REUSE_TOKENS),
                               None)
                if waiting is None:
                    usable = min(length, len(context) - 1)
                    if entry is not None and usable >= MIN_REUSE_TOKENS:
                        self.entries.move_to_end(entry.key)
                        self.hits += 1
                    else:
                        entry, usable = None, 0
                    self._next_id += 1
                    self.claims[self._next_id] = Claim(tokens)
                    return entry, usable, self._next_id
            if not waiting.done.wait(CLAIM_WAIT_S):
                log.warning("a draft prefill held its claim over %.0f s; prefilling without it", CLAIM_WAIT_S)
                with self._lock:
                    self.claims = {k: c for k, c in self.claims.items() if c is not waiting}

    def settle(self, claim: int) -> None:
        with self._lock:
            settled = self.claims.pop(claim, None)
        if settled is not None:
            settled.done.set()

    def timed(self, fed: int, seconds: float) -> None:
        if fed >= MIN_TIMED_PREFILL:
            self.prefill_s_per_token = seconds / fed

    def holds(self, tokens: list[int]) -> bool:
        """Whether an entry holds `tokens` already (the same context, or one that extends it): then no copy is
        worth making. Too short a context counts as held: it would never be reused."""
        if len(tokens) < MIN_REUSE_TOKENS:
            return True
        array = np.asarray(tokens, dtype=np.int64)
        with self._lock:
            return any(shared_prefix(entry.tokens, array) == len(array) for entry in self.entries.values())

    def store(self, tokens: list[int], kv: object, nbytes: int) -> bool:
        """Keep `kv` (an owned copy) for `tokens` unless an entry holds them already; evicts to stay in budget."""
        if nbytes > self.max_bytes or len(tokens) < MIN_REUSE_TOKENS:
            return False
        array = np.asarray(tokens, dtype=np.int64)
        with self._lock:
            for key, entry in list(self.entries.items()):
                shared = shared_prefix(entry.tokens, array)
                if shared == len(array):  # held already (the same context, or one it extends): nothing new
                    self.entries.move_to_end(key)
                    return False
                if shared == len(entry.tokens):  # the new entry holds all this one did
                    self._drop(key)
            while self.entries and self.nbytes + nbytes > self.max_bytes:
                self._drop(next(iter(self.entries)))
                self.evictions += 1
            self._next_id += 1
            self.entries[self._next_id] = CacheEntry(self._next_id, array, kv, nbytes)
            self.nbytes += nbytes
        return True

    def _drop(self, key: int) -> None:
        self.nbytes -= self.entries.pop(key).nbytes


class ReusingDraftLM:
    """A draft runtime whose first forward (the prompt's prefill) starts from the cache, and which leaves its
    context in the cache twice: after that prefill (for the choices and requests that start meanwhile) and when
    the generation releases it (for a conversation's next turn, which extends prompt and answer)."""

    def __init__(self, inner: ReusableLM, cache: DraftKVCache) -> None:
        self.inner = inner
        self.cache = cache
        self.reused_tokens = 0  # prompt tokens whose KV came from the cache
        self.saved_s = 0.0  # the draft's prefill time that saved (estimated: module docstring)
        self._prefilled = False
        self._released = False
        self._lock = threading.Lock()  # a drafting thread a cancelled task left running finishes before release

    @property
    def tokens(self) -> list[int]:
        return self.inner.tokens

    @property
    def forward_calls(self) -> int:
        return getattr(self.inner, "forward_calls", 0)

    @property
    def batches(self) -> bool:
        return getattr(self.inner, "batches", False)

    def advance_batch(self, contexts: list[list[int]]) -> torch.Tensor:
        """The inner runtime's batched branch rows (after the prefill: branches follow a drafted chain)."""
        with self._lock:
            return self.inner.advance_batch(contexts)

    def advance_to(self, context: list[int], n_logits: int = 1) -> ForwardOutput:
        with self._lock:
            if self._prefilled or not self.inner.reusable:
                return self.inner.advance_to(context, n_logits)
            self._prefilled = True
            return self._prefill(context, n_logits)

    def _prefill(self, context: list[int], n_logits: int) -> ForwardOutput:
        entry, reused, claim = self.cache.lookup(context)
        try:
            if entry is not None:
                self.inner.start_from(context[:reused], entry.kv)
                self.reused_tokens = reused
                self.saved_s = reused * (self.cache.prefill_s_per_token or 0.0)
            started = time.perf_counter()
            out = self.inner.advance_to(context, n_logits)
            self.cache.timed(len(context) - reused, time.perf_counter() - started)
            self._keep()
        finally:
            self.cache.settle(claim)
        return out

    def release(self) -> None:
        """The generation is over: keep its whole context (prompt and answer) for the next turn. Idempotent."""
        with self._lock:
            if self._released or not self._prefilled or not self.inner.tokens:
                return
            self._released = True
            self._keep()

    def _keep(self) -> None:
        tokens = list(self.inner.tokens)
        if not self.cache.holds(tokens):
            self.cache.store(tokens, *self.inner.kv_snapshot())


class GenerationDrafts:
    """The draft runtimes one generation made (`make_draft_lm`: one per drafter), released together at its end."""

    def __init__(self, make_draft_lm: Callable[[bool], DraftLM]) -> None:
        self.make_draft_lm = make_draft_lm
        self.made: list[DraftLM] = []

    def new(self, with_hidden: bool) -> DraftLM:
        draft_lm = self.make_draft_lm(with_hidden)
        self.made.append(draft_lm)
        return draft_lm

    def release(self, recorder: StatsRecorder) -> None:
        """Keep each reusing runtime's context for later requests, and count what reuse saved this generation."""
        for draft_lm in self.made:
            if isinstance(draft_lm, ReusingDraftLM):
                draft_lm.release()
                recorder.draft_reused_tokens += draft_lm.reused_tokens
                recorder.draft_prefill_saved_ms += draft_lm.saved_s * 1e3
