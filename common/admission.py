"""A request's terms of admission to the cloud's line (cloud/admission_queue.py), as both sides speak of them.

The cloud keeps one line for work it cannot take at once: edge identities take turns, and within one
identity lower `priority` goes first (as vLLM's priority), then first come, first served. An edge that
says it `waits_in_line` is sent queue tickets (`QueuePlace`) while it waits; one that does not (an older
edge) is refused with a retry hint, as before the line existed. The codec is common/wire/.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIORITY_RANGE = (-(2 ** 31), 2 ** 31 - 1)  # the wire's int32


@dataclass(frozen=True)
class Admission:
    """How one request waits: its priority (lower first, within its edge's share), whether the edge reads queue
    tickets, the ticket of an earlier try (a broken stream) whose place it claims back, and, on a reopen, the
    session the cloud evicted (whose seniority it claims back)."""

    priority: int = 0
    waits_in_line: bool = False
    ticket_id: str = ""
    evicted_session_id: str = ""  # a reopen's: the session the cloud evicted, whose seniority it takes back


@dataclass(frozen=True)
class QueuePlace:
    """A queue ticket: the request's place in the cloud's line."""

    ticket_id: str
    position: int  # requests the cloud will serve before this one (0: next)
    estimated_wait_ms: int
    queue_length: int  # requests in line, every edge's
