"""Per-edge quotas and fair-share eviction: no edge can push the others out.

An edge (an authenticated identity) may hold at most `max_sessions` sessions and run `max_generate`
Generate calls at once; beyond that it is refused with RESOURCE_EXHAUSTED and a retry hint, or, for
sessions, its own youngest idle session makes room. When the cloud as a whole is full,
the victim is the youngest idle session (cloud/sessions.py: seniority) of the edge using the largest share of its quota
(KV bytes for the KV budget, sessions for the session limit). An edge over its quota therefore loses
its own sessions first, and an edge inside its quota loses none while another is above its share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, TypeVar

# Retry hints (milliseconds): roughly one verify forward of a busy session, and one short Generate.
BUSY_RETRY_MS = 500
GENERATE_RETRY_MS = 1000
STREAMS_RETRY_MS = 1000


class Evictable(Protocol):
    owner: str
    busy: bool  # in use right now: never evicted


S = TypeVar("S", bound=Evictable)


@dataclass(frozen=True)
class EdgeQuotas:
    max_sessions: int
    kv_budget_bytes: int
    max_generate: int


def fair_share_victim(sessions_in_order: Iterable[S], share: Callable[[str], float],
                      protect: S | None = None) -> S | None:
    """The first idle session (in the order given: the store's, youngest request first) of the owner with the
    largest `share`, or None if all are busy. A tie between owners goes to the one whose candidate comes first.
    """
    victim, victim_share = None, float("-inf")
    shares: dict[str, float] = {}
    for session in sessions_in_order:
        if session.busy or session is protect:
            continue
        owner_share = shares.setdefault(session.owner, share(session.owner))
        if owner_share > victim_share:
            victim, victim_share = session, owner_share
    return victim
