"""The llama.cpp engine's prefix cache: finished contexts kept in llama.cpp's cells, reused by token prefix.

What a conversation's next turn resends (the last prompt and its answer) is still in llama.cpp's KV
when the turn ends: instead of removing it, the session's sequence is kept as an entry (its tail past
the remembered tokens removed), and a later prompt that starts with the same tokens shares those cells
(`llama_memory_seq_cp` in unified KV makes the new sequence part of the same cells: nothing is copied
or computed) and prefills only the rest. A session's prompt is an entry from its prefill on, so
sessions opened while it lives (the n choices of a request) share it too. It plays the role of the
resident engine's page cache (cloud/prefix_cache.py) behind the same calls (start, remember,
evict_one, tokens), at another granularity:

Glossary
    entry      a remembered context: its scope, its tokens and the sequence that holds their cells (the
               session's own while it lives, then the cache's)
    match      the longest common prefix of a prompt with any entry of its scope (any length: a shared system
               prompt matches an entry of another conversation up to where they part)
    holders    live sessions whose first tokens are an entry's cells (its own session's among them): while
               one lives, the entry is not evicted, and they are not charged for them (`shared_tokens`)
    scope      as the page cache's: the edge identity, or one scope for all (`share_across_identities`)

The ledger charges an entry's tokens once (`tokens`), whatever number of sessions share them; idle
entries are evicted least recently used first, when the budget or the sequence ids run short.
Entries of one scope where one extends another keep the longer only.

Opens of one prefix that arrive together (the n choices of a request, a burst of one conversation's retries)
compute it once: an open claims its prompt while it prefills it, and a later open that would reuse at least
MIN_REUSE_TOKENS more of a claimed prompt than the entries hold waits for that prefill to end (then its entry is
there to share), as the resident cache's block claims do.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from cloud.prefix_cache import SHARED_SCOPE, Reuse
from common.prefix_digests import MAX_ANNOUNCED_PREFIXES, prefix_digests

if TYPE_CHECKING:
    from cloud.llama_cpp_engine import LlamaCppEngine, SequenceKV

MIN_REUSE_TOKENS = 16  # a shorter match saves less than the bookkeeping costs


@dataclass(eq=False)
class Entry:
    scope: str
    tokens: tuple[int, ...]
    seq: int
    parent: Entry | None = None  # the entry its session started from: its first `shared` cells are the parent's
    shared: int = 0
    holders: weakref.WeakSet = field(default_factory=weakref.WeakSet)


@dataclass(eq=False)
class Claim:
    """A prompt an open is prefilling: opens that would reuse more of it wait for `done`."""

    scope: str
    tokens: list[int]
    done: asyncio.Future


def common_prefix(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class LlamaCppPrefixCache:
    engine: LlamaCppEngine
    share_across_identities: bool = False
    room: Callable[[int], bool] | None = None  # set by the session store; unused: remembering takes no new cells
    on_evict: Callable[[int], None] = lambda entries: None
    entries: OrderedDict[int, Entry] = field(default_factory=OrderedDict)  # by sequence id, least recently used first
    claims: list[Claim] = field(default_factory=list)  # prompts being prefilled now

    def scope(self, owner: str) -> str:
        return SHARED_SCOPE if self.share_across_identities else owner

    @property
    def tokens(self) -> int:
        """Cells the entries hold, each once (a prefix shared with a parent entry counts in the parent's while it is
        cached): charged to the KV budget here, not to the sessions sharing them."""
        return sum(len(e.tokens) - (e.shared if e.parent is not None and e.parent.seq in self.entries else 0)
                   for e in self.entries.values())

    def match(self, scope: str, tokens: list[int]) -> tuple[Entry | None, int]:
        best, length = None, 0
        for entry in self.entries.values():
            if entry.scope == scope and (n := common_prefix(entry.tokens, tokens)) > length:
                best, length = entry, n
        return best, length

    def start(self, cache: SequenceKV, scope: str, tokens: list[int]) -> Reuse:
        """Begin the empty `cache` with the longest cached prefix of `tokens`: its cells shared, none copied."""
        entry, length = self.match(scope, tokens)
        if entry is None or length < MIN_REUSE_TOKENS or cache.length:
            return Reuse()
        self.engine.share(entry.seq, cache, length)
        cache.shared_tokens = length
        cache.started_from = (entry, length)
        entry.holders.add(cache)
        self._touch(entry)
        return Reuse(tokens=length)

    def remember(self, cache: SequenceKV, scope: str, tokens: list[int]) -> int:
        """Keep the first len(tokens) cells of `cache` as an entry when the session ends (its sequence is kept, not
        removed): from now on the session is not charged for them, the cache is. An idle entry of the scope that
        the tokens extend is dropped. Returns the tokens newly cached."""
        tokens = tuple(tokens[:cache.length])
        own = self.entries.get(cache.seq)
        if len(tokens) < MIN_REUSE_TOKENS or (own is not None and len(tokens) <= len(own.tokens)):
            return 0
        before = len(own.tokens) if own is not None else 0
        extended, length = self.match(scope, list(tokens))
        if extended is not None and extended is not own and length == len(extended.tokens) and self.idle(extended):
            self._drop(extended)  # superseded: the new entry holds all of it
        entry = own or Entry(scope, tokens, cache.seq, *(cache.started_from or (None, 0)))
        entry.tokens = tokens
        entry.holders.add(cache)
        self.entries[cache.seq] = entry
        self._touch(entry)
        cache.shared_tokens = len(tokens)
        return len(tokens) - before

    def kept(self, seq: int) -> int | None:
        """The tokens an entry keeps of sequence `seq` (its session ending: the cells past them go), or None."""
        entry = self.entries.get(seq)
        return len(entry.tokens) if entry is not None else None

    def _touch(self, entry: Entry) -> None:
        self.entries.move_to_end(entry.seq)  # the order is the recency

    def idle(self, entry: Entry) -> bool:
        """No live session reads its cells."""
        return all(holder.released for holder in entry.holders)

    def evict_one(self) -> bool:
        """Drop the least recently used entry no live session shares; False when there is none."""
        for entry in self.entries.values():
            if self.idle(entry):
                self._drop(entry)
                self.on_evict(1)
                return True
        return False

    def _drop(self, entry: Entry) -> None:
        del self.entries[entry.seq]
        self.engine.free_sequence(entry.seq)

    def announced(self) -> list[str]:
        """The leading-prefix digests of the entries (common/prefix_digests.py), most recently used first."""
        found: list[str] = []
        for entry in reversed(self.entries.values()):
            found += [digest for _, digest in reversed(prefix_digests(list(entry.tokens)))]
            if len(found) >= MAX_ANNOUNCED_PREFIXES:
                break
        return list(dict.fromkeys(found))[:MAX_ANNOUNCED_PREFIXES]

    async def wait_for_pending(self, scope: str, tokens: list[int]) -> None:
        """Until no open is prefilling a prompt of `scope` that shares at least MIN_REUSE_TOKENS more of `tokens`
        than the entries hold."""
        while (claim := self._worth_waiting_for(scope, tokens)) is not None:
            await asyncio.shield(claim.done)

    def _worth_waiting_for(self, scope: str, tokens: list[int]) -> Claim | None:
        _, cached = self.match(scope, tokens)
        return next((c for c in self.claims if c.scope == scope and not c.done.done()
                     and common_prefix(c.tokens, tokens) >= cached + MIN_REUSE_TOKENS), None)

    def claim(self, scope: str, tokens: list[int]) -> list[Claim]:
        """Mark `tokens` as being prefilled by the caller, who must `settle` the claim (computed or not) when its
        prefill ends."""
        claim = Claim(scope, list(tokens), asyncio.get_running_loop().create_future())
        self.claims.append(claim)
        return [claim]

    def settle(self, claimed: list[Claim]) -> None:
        for claim in claimed:
            if claim in self.claims:
                self.claims.remove(claim)
            if not claim.done.done():
                claim.done.set_result(None)
