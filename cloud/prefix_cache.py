"""The prefix cache: the KV of finished and live sessions, reusable by token prefix (resident engine).

Glossary
    block     one page of the KV layout (`KVLayout.page_tokens` tokens: 64 per-session, 128 paged): the unit
              cached, looked up, charged and evicted; only whole pages are cached
    digest    a block's key: a hash of its tokens chained on its parent's digest, from a root that is the
              scope; equal digests mean the same tokens at the same positions after the same prefix, so the
              same KV (vLLM hashes its blocks the same way)
    scope     whose sessions may reuse a block: the edge identity that computed it (cloud/auth.py), or one
              scope for all with `share_across_identities` (`--share-prefix-cache`)
    idle      a block no live session holds: evictable, least recently used first

Storage depends on the layout:
    paged          a page of the pool, shared: the cache and every session whose page table starts from it
                   hold a reference (cloud/kv_pool.py); registering a session's page copies nothing
    per-session    a copy of the page's keys and values; reuse copies it into the new session's buffers
                   (saves the prefill's compute, not its memory), registering copies it out

The ledger (cloud/sessions.py) charges each cached block once, as `tokens`, whatever number of sessions read
it; a session is charged only for the pages it holds beside the cache's (`shared_tokens`). A chain is touched
deepest block first, so a parent is always used more recently than its children and eviction takes leaves
before the prefixes they extend.

Opens of one prefix that arrive together (the `n` choices of a request, edges sharing a system prompt) would
each miss and prefill it again: the first claims the blocks it is about to compute (`claim`), and the others
wait for them (`wait_for_pending`) before they look up.

What it may announce on the fleet plane (`announced`): the digests of the cached prompts' leading blocks
(common/prefix_digests.py: 128, 256, 512, ... tokens, computed from the tokens alone, without the scope, so an
edge computes the same from its prompt), each while the page that ends it is still cached, most recently
remembered first, at most MAX_ANNOUNCED_PREFIXES. Edges prefer the replica that holds the longest.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from array import array
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import torch

from cloud.kv_pool import KVPool, PagedKV
from common.prefix_digests import MAX_ANNOUNCED_PREFIXES, prefix_digests
from cloud.resident_kv import KVLayout, ResidentKV

log = logging.getLogger(__name__)
SHARED_SCOPE = ""  # the one scope of every identity, with share_across_identities


@dataclass
class CachedBlock:
    digest: bytes
    storage: int | tuple[torch.Tensor, torch.Tensor]  # paged: its pool page; per-session: (keys, values) copies


@dataclass(frozen=True)
class Reuse:
    """What a lookup gave a new session: tokens whose KV came from the cache, and bytes copied to place them."""

    tokens: int = 0
    copied_bytes: int = 0


@dataclass
class PrefixCache:
    layout: KVLayout
    pool: KVPool | None = None  # paged: the pool whose pages are shared; None: per-session copies
    share_across_identities: bool = False
    # Whether the budget has room for `tokens` more cached tokens (the session store evicts idle blocks to make
    # it); None: no budget. Asked only where caching takes memory: the per-session layout's copies.
    room: Callable[[int], bool] | None = None
    on_evict: Callable[[int], None] = lambda blocks: None  # counts evicted blocks (the metric)
    blocks: OrderedDict[bytes, CachedBlock] = field(default_factory=OrderedDict)  # least recently used first
    pending: dict[bytes, asyncio.Future] = field(default_factory=dict)  # blocks an open is computing now
    copies_nbytes: int = 0  # bytes of the per-session layout's copies, kept as blocks come and go (read per grant)
    # A leading block's digest (what `announced` says) -> the digest of the cached page that ends it; most recent last
    leading: OrderedDict[str, bytes] = field(default_factory=OrderedDict)

    def scope(self, owner: str) -> str:
        return SHARED_SCOPE if self.share_across_identities else owner

    @property
    def tokens(self) -> int:
        """KV entries the cache holds: what the ledger charges it."""
        return len(self.blocks) * self.layout.page_tokens

    def nbytes(self) -> int:
        """Bytes of the per-session layout's copies (paged blocks are pool pages, measured there)."""
        return self.copies_nbytes

    @staticmethod
    def _copy_nbytes(block: CachedBlock) -> int:
        return 0 if isinstance(block.storage, int) else block.storage[0].nbytes + block.storage[1].nbytes

    def digests(self, scope: str, tokens: list[int]) -> list[bytes]:
        """The digest of each whole page of `tokens`."""
        page = self.layout.page_tokens
        digest, chain = hashlib.blake2b(scope.encode(), digest_size=16).digest(), []
        for start in range(0, len(tokens) - page + 1, page):
            digest = hashlib.blake2b(digest + array("q", tokens[start:start + page]).tobytes(), digest_size=16).digest()
            chain.append(digest)
        return chain

    def match(self, scope: str, tokens: list[int]) -> list[CachedBlock]:
        """The cached blocks of the longest cached prefix of `tokens` (whole pages), touched."""
        found = []
        for digest in self.digests(scope, tokens):
            block = self.blocks.get(digest)
            if block is None:
                break
            found.append(block)
        self._touch(found)
        return found

    def _touch(self, chain: list[CachedBlock]) -> None:
        for block in reversed(chain):  # deepest first: parents end up more recent than their children
            self.blocks.move_to_end(block.digest)

    def start(self, cache: ResidentKV | PagedKV, scope: str, tokens: list[int]) -> Reuse:
        """Start the empty `cache` from the longest cached prefix of `tokens`; paged, its pages are shared, per
        session they are copied (into capacity the session store granted)."""
        chain = self.match(scope, tokens)
        if not chain:
            return Reuse()
        if isinstance(cache, PagedKV):
            cache.start_from([block.storage for block in chain])
            return Reuse(cache.length)
        return Reuse(len(chain) * self.layout.page_tokens, cache.start_from([block.storage for block in chain]))

    def remember(self, cache: ResidentKV | PagedKV, scope: str, tokens: list[int]) -> int:
        """Cache the whole pages of `cache` that hold tokens[:cache.length] and are not cached yet; returns how
        many. Paged, the cache takes a reference on the session's page; per session it copies the page, while
        the budget has room (a full budget caches nothing more: caching never evicts a session)."""
        tokens = tokens[:cache.length]
        added = 0
        for i, digest in enumerate(self.digests(scope, tokens)):
            if digest in self.blocks:
                continue
            if isinstance(cache, PagedKV):
                self.pool.ref([cache.pages[i]])
                cache.shared_pages += 1
                self.blocks[digest] = CachedBlock(digest, cache.pages[i])
            elif self.room is None or self.room(self.layout.page_tokens):
                self.blocks[digest] = CachedBlock(digest, cache.page(i))
                self.copies_nbytes += self._copy_nbytes(self.blocks[digest])
            else:
                break
            added += 1
        self.match(scope, tokens)  # the chain is the most recently used now, parents before children
        self._note_leading(scope, tokens)
        return added

    def _note_leading(self, scope: str, tokens: list[int]) -> None:
        chain = self.digests(scope, tokens)
        for length, leading in prefix_digests(tokens):
            last_page = length // self.layout.page_tokens - 1
            if last_page < len(chain) and chain[last_page] in self.blocks:
                self.leading[leading] = chain[last_page]
                self.leading.move_to_end(leading)
        while len(self.leading) > 4 * MAX_ANNOUNCED_PREFIXES:  # evicted ones are skipped when read: keep a margin
            self.leading.popitem(last=False)

    def announced(self) -> list[str]:
        """The leading blocks' digests whose pages are still cached, most recently remembered first (bounded)."""
        held = [leading for leading, page in reversed(self.leading.items()) if page in self.blocks]
        return held[:MAX_ANNOUNCED_PREFIXES]

    def idle(self, block: CachedBlock) -> bool:
        """No live session holds it: a per-session copy always, a pool page when only the cache holds it."""
        return not isinstance(block.storage, int) or self.pool.refs(block.storage) == 1

    def evict_one(self) -> bool:
        """Drop the least recently used idle block; False when none is idle."""
        victim = next((block for block in self.blocks.values() if self.idle(block)), None)
        if victim is None:
            return False
        del self.blocks[victim.digest]
        self.copies_nbytes -= self._copy_nbytes(victim)
        if isinstance(victim.storage, int):
            self.pool.unref([victim.storage])
        self.on_evict(1)
        return True

    def idle_tokens(self) -> int:
        return sum(self.layout.page_tokens for block in self.blocks.values() if self.idle(block))

    async def wait_for_pending(self, scope: str, tokens: list[int]) -> None:
        """Until no open is computing the block after the longest cached prefix of `tokens`."""
        chain = self.digests(scope, tokens)
        while True:
            cached = len(self.match(scope, tokens))
            waiting = self.pending.get(chain[cached]) if cached < len(chain) else None
            if waiting is None:
                return
            await asyncio.shield(waiting)

    def claim(self, scope: str, tokens: list[int]) -> list[bytes]:
        """Mark the blocks of `tokens` neither cached nor claimed as being computed by the caller, who must
        `settle` them (computed or not) when its prefill ends."""
        claimed = [d for d in self.digests(scope, tokens) if d not in self.blocks and d not in self.pending]
        loop = asyncio.get_running_loop()
        for digest in claimed:
            self.pending[digest] = loop.create_future()
        return claimed

    def settle(self, claimed: list[bytes]) -> None:
        for digest in claimed:
            waiting = self.pending.pop(digest, None)
            if waiting is not None and not waiting.done():
                waiting.set_result(None)

    def clear(self) -> None:
        """Drop every idle block (the engine is going away, or a test wants the pool back)."""
        while self.evict_one():
            pass


@asynccontextmanager
async def reusing(prefix_cache: PrefixCache | None, cache: ResidentKV | PagedKV, scope: str | None,
                  tokens: list[int]) -> AsyncIterator[Reuse]:
    """Around the prefill of `tokens` into the empty `cache`: start it from their longest cached prefix (once no
    other open is computing the next block), and when the prefill is done, cache its whole pages. None (no
    cache, or no scope: the caller reads every prompt row, echo) reuses nothing."""
    if prefix_cache is None or scope is None:
        yield Reuse()
        return
    await prefix_cache.wait_for_pending(scope, tokens)
    reuse = prefix_cache.start(cache, scope, tokens)
    claimed = prefix_cache.claim(scope, tokens)
    try:
        yield reuse
        prefix_cache.remember(cache, scope, tokens)
    finally:
        prefix_cache.settle(claimed)
