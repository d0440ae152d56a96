"""What cloud-sd's proposers remember across requests (common/spec/propose/suffix_proposer.py `SuffixMemory`), one per
edge identity.

A suffix memory holds earlier outputs that later requests copy from, and the calibration of its copies. Across
edge identities that would leak one edge's text into another's proposals (and the timing of its rounds), so
each identity (cloud/auth.py: the bearer token's; without a tokens file all callers are one anonymous identity)
has its own, on this replica only. The map is bounded: past `max_identities` the least recently used identity's
memory is dropped, and it starts afresh (a cold cache costs speed, never exactness).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from common.spec.propose.suffix_proposer import SuffixMemory, suffix_memory

log = logging.getLogger(__name__)

DEFAULT_MAX_IDENTITIES = 64


@dataclass
class SuffixMemories:
    """Edge identity -> its suffix memory, least recently used first."""

    max_identities: int = DEFAULT_MAX_IDENTITIES
    cache: bool = True  # `--suffix-cache off`: no identity's earlier outputs are kept to copy from
    _memories: OrderedDict[str, SuffixMemory] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.max_identities < 1:
            raise ValueError(f"max_identities must be >= 1, got {self.max_identities}")

    def of(self, identity: str) -> SuffixMemory:
        """`identity`'s memory (made on first use), now the most recently used."""
        memory = self._memories.get(identity)
        if memory is None:
            memory = self._memories[identity] = suffix_memory(cache=self.cache)
            if len(self._memories) > self.max_identities:
                dropped, _ = self._memories.popitem(last=False)
                log.info("suffix memory of edge %r dropped: more than %d identities", dropped, self.max_identities)
        else:
            self._memories.move_to_end(identity)
        return memory

    def __len__(self) -> int:
        return len(self._memories)

    def __contains__(self, identity: str) -> bool:
        return identity in self._memories
