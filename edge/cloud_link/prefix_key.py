"""Which replica a session's prompt goes to: a digest of its leading block, so the prefix finds its cache.

Replicas are ranked by rendezvous hashing on a session's key (`rendezvous_order`). A random key spread
sessions evenly but sent a conversation's next turn, or a second edge's request over the same system prompt, to
any replica, where the cloud's prefix cache (cloud/prefix_cache.py) held nothing of it. Keyed on the prompt's
first `LEADING_BLOCK_TOKENS` tokens instead (common/prefix_digests.py), every edge ranks the replicas the same
way for the same leading block, and the replica that prefilled it first is the one asked again.

With the fleet plane, replicas also announce digests of the prefixes they hold (`CloudLoad.prefixes`); a replica
that holds a longer prefix of the prompt than the others goes first (`holders_first`), ahead of the rendezvous
order, which still breaks ties and decides alone without a broker. Either way the bounded-load override then
moves a session off a replica holding more than its share, so one hot prefix spreads rather than piling up.

A reopen elsewhere (failover) keeps the key and skips the replicas it avoids: it lands on the next in the same
order on every edge, where it is a cache miss the first time and a hit after.
"""

from __future__ import annotations

import hashlib
from typing import Protocol, Sequence, TypeVar

from common.prefix_digests import LEADING_BLOCK_TOKENS, prefix_digests, whole_digest

__all__ = ["LEADING_BLOCK_TOKENS", "PrefixKey", "holders_first", "prefix_key"]


class PrefixKey(str):
    """A session's rendezvous key (the leading block's digest) carrying the digests of its prompt's longer
    prefixes, shortest first, to match against what replicas announce."""

    digests: tuple[str, ...]


def prefix_key(prompt_ids: list[int]) -> PrefixKey:
    """The rendezvous key of a prompt: the digest of its first `LEADING_BLOCK_TOKENS` tokens (of all of them when
    shorter: such a prompt has no whole page to share, so its replica is as good as any other)."""
    digests = tuple(digest for _, digest in prefix_digests(prompt_ids))
    key = PrefixKey(digests[0] if digests else whole_digest(prompt_ids))
    key.digests = digests
    return key


class Announcing(Protocol):
    announced_prefixes: frozenset[str]  # the digests a replica last announced (empty: none, or no broker)

    @property
    def address(self) -> str: ...


R = TypeVar("R", bound=Announcing)


def rendezvous_order(key: str, replicas: Sequence[R]) -> list[R]:
    """Highest random weight first: the same key ranks the same replicas the same way on every edge."""
    return sorted(replicas, key=lambda r: hashlib.sha256(f"{key}|{r.address}".encode()).digest()[:8], reverse=True)


def holders_first(key: str, ranked: Sequence[R]) -> list[R]:
    """`ranked` (rendezvous order) with the replicas holding the longest announced prefix of the key's prompt
    first; the order among equals, and all of it where nothing was announced, stays as it was."""
    digests = getattr(key, "digests", ())

    def held(replica: R) -> int:
        return max((i + 1 for i, digest in enumerate(digests) if digest in replica.announced_prefixes), default=0)

    return sorted(ranked, key=held, reverse=True)  # stable: equals keep the rendezvous order
