"""Evictions remembered, so that an evicted request's reopen keeps its turn in the cloud's line.

An evicted session disappears; its edge reopens it with the full context: the evicted session's tokens, then
what it had not sent yet (cloud/sessions.py). Were that reopen new work, it would join the back of the line
(cloud/admission_queue.py), and under load, where admission evicts whichever session sat idle for the grace
period (its edge still drafting), the same request could be evicted and sent to the back again and again: the
soak's slowest requests waited minutes for their first token so. The store remembers each eviction (its
owner, its length and a digest of its tokens), and an open by that owner whose context extends one is the
evicted work going on: it waits as running work does, ahead of new requests.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

REMEMBERED_PER_OWNER = 64  # an owner's latest evictions; an open checks each (a digest of that many prefixes)


@dataclass
class EvictedSessions:
    """(length, digest) of each owner's latest evicted contexts; an open that extends one takes it."""

    per_owner: int = REMEMBERED_PER_OWNER
    _evicted: dict[str, OrderedDict[tuple[int, int], None]] = field(default_factory=dict)

    def remember(self, owner: str, tokens: list[int]) -> None:
        if not tokens:
            return
        kept = self._evicted.setdefault(owner, OrderedDict())
        kept[(len(tokens), hash(tuple(tokens)))] = None
        while len(kept) > self.per_owner:
            kept.popitem(last=False)

    def take(self, owner: str, context: list[int]) -> bool:
        """Whether `context` goes on from an evicted session of `owner` (forgotten once taken)."""
        kept = self._evicted.get(owner)
        if not kept:
            return False
        for length, digest in reversed(kept):  # the latest first
            if length <= len(context) and hash(tuple(context[:length])) == digest:
                del kept[(length, digest)]
                if not kept:
                    del self._evicted[owner]
                return True
        return False
