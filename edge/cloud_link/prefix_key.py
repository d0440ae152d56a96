"""Which replica a session's prompt goes to: a digest of its leading block, so the prefix finds its cache.

Replicas are ranked by rendezvous hashing on a session's key (edge/cloud_link/replicas.py). A random key spread
sessions evenly but sent a conversation's next turn, or a second edge's request over the same system prompt, to
any replica, where the cloud's prefix cache (cloud/prefix_cache.py) held nothing of it. Keyed on the prompt's
first `LEADING_BLOCK_TOKENS` tokens instead, every edge ranks the replicas the same way for the same leading
block, and the replica that prefilled it first is the one asked again; the bounded-load override still moves a
session off a replica holding more than its share, so one hot prefix spreads rather than piling up.

A reopen elsewhere (failover) keeps the key and skips the replicas it avoids: it lands on the next in the same
order on every edge, where it is a cache miss the first time and a hit after.
"""

from __future__ import annotations

import hashlib
from array import array

# One page of the cloud's paged KV (cloud/resident_kv.py: 128 tokens paged, 64 per session): the cloud caches and
# matches whole pages, so a shorter shared prefix holds nothing cached and a first page is the least two prompts
# must share for the replica choice to matter. Longer would split prompts that share a system prompt shorter
# than the block by what follows it; a conversation's turns share far more than this.
LEADING_BLOCK_TOKENS = 128


def prefix_key(prompt_ids: list[int]) -> str:
    """The rendezvous key of a prompt: the digest of its first `LEADING_BLOCK_TOKENS` tokens (all of them when
    shorter: such a prompt has no whole page to share, so its replica is as good as any other)."""
    leading = array("q", prompt_ids[:LEADING_BLOCK_TOKENS]).tobytes()
    return hashlib.blake2b(leading, digest_size=16, person=b"sprinter-prefix").hexdigest()
