"""Digests of a prompt's leading blocks: what replicas announce of the prefixes they cache, and what an edge
matches its prompt against (never the tokens themselves).

Both sides compute them the same way, from tokens alone: the digest of the first L tokens for L = 128, 256,
512, ... (doubling) up to the prompt's length. The first is the rendezvous key an edge places a session by
(edge/cloud_link/prefix_key.py); the longest one a replica announced tells the edge how much of its prompt that
replica holds (cloud/prefix_cache.py keeps which it may announce). Doubling keeps a prompt's digests few (a
64k-token prompt has 10) while telling a shared system prompt from a whole shared conversation.
"""

from __future__ import annotations

import hashlib
from array import array

# One page of the cloud's paged KV (cloud/resident_kv.py: 128 tokens paged, 64 per session): the cloud caches and
# matches whole pages, so a shorter shared prefix holds nothing cached and a first page is the least two prompts
# must share for the replica choice to matter. Longer would split prompts that share a system prompt shorter
# than the block by what follows it; a conversation's turns share far more than this.
LEADING_BLOCK_TOKENS = 128
# What a replica announces at most: 32 digests of 32 hex characters, about 1.2 KB of JSON on its load message
# every 2 s. Most recently used first, so the prefixes it is serving now are the ones edges hear of.
MAX_ANNOUNCED_PREFIXES = 32
DIGEST_HEX = 32  # 16 bytes of blake2b


def prefix_digests(tokens: list[int]) -> list[tuple[int, str]]:
    """(L, the digest of tokens[:L]) for L = LEADING_BLOCK_TOKENS, twice that, ... <= len(tokens), shortest first."""
    digest = hashlib.blake2b(digest_size=DIGEST_HEX // 2, person=b"sprinter-prefix")
    found, done, length = [], 0, LEADING_BLOCK_TOKENS
    while length <= len(tokens):
        digest.update(array("q", tokens[done:length]).tobytes())
        found.append((length, digest.copy().hexdigest()))
        done, length = length, length * 2
    return found


def whole_digest(tokens: list[int]) -> str:
    """The digest of all of `tokens`, for a prompt shorter than one leading block."""
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=DIGEST_HEX // 2,
                           person=b"sprinter-prefix").hexdigest()
