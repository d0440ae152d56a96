"""The cloud's one line for work it cannot take at once: fair across edges, first come first served within one.

Work the cloud cannot admit now (a session's open, a verify that needs KV the budget cannot grant, a
Generate past the edge's slots) gets a place instead of a refusal. Whose turn it is: work already
running (a verify of an open session) first, since it holds KV that only its finishing gives back;
then edge identities take turns (round-robin, in the order they first queued), and within one
identity the lowest `priority` first (as vLLM's priority), then the most senior: the earliest request, a reopen
of an evicted session keeping its request's stamp (cloud/sessions.py, seniority). Only the head of the
line tries to get in: each time capacity may have been given back (`kick`) and every `retry_s`
(idle sessions become evictable with time), so a request that arrives later never overtakes one in line.

A place whose edge went away (a broken stream) is kept for `grace_s`: an edge that comes back with
that ticket id takes its old place again. The line is bounded: past `max_length` places a request is
refused with RESOURCE_EXHAUSTED naming the line's length (and a retry hint). An older edge that does not
read queue tickets (`Admission.waits_in_line` unset) gets no place: it is refused with a retry hint
as before the line existed, and while others are in line it does not jump ahead of them.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import grpc

from cloud.errors import CloudError, exhausted
from common.admission import Admission, QueuePlace

log = logging.getLogger(__name__)
T = TypeVar("T")
Tell = Callable[[QueuePlace], None]  # hears a request's queue tickets while it waits in line


@dataclass(frozen=True)
class QueueSettings:
    max_length: int = 1024  # places in line, every edge's; past it: RESOURCE_EXHAUSTED
    grace_s: float = 10.0  # how long a place outlives its edge's stream (a reconnect takes it back)
    retry_s: float = 0.25  # how often the head tries again without a kick (idle sessions age into evictable)
    ticket_every_s: float = 2.0  # a ticket at least this often: the edge's frame deadline sees the line move


@dataclass(frozen=True)
class QueueObserver:
    """What the line tells the metrics (cloud/metrics.py): its length per identity, and each admitted wait."""

    length: Callable[[str, int], None] = lambda identity, n: None
    waited: Callable[[str, float], None] = lambda identity, seconds: None


@dataclass(eq=False)
class Place:
    identity: str
    priority: int
    seq: int  # the request's seniority (arrival stamp): first come, first served within one identity and priority
    ticket_id: str
    running: bool  # work of an admitted session (a verify): served before new work
    enqueued_at: float = field(default_factory=time.monotonic)
    wake: asyncio.Event = field(default_factory=asyncio.Event)


def busy(err: CloudError) -> bool:
    """A refusal that waiting can lift: RESOURCE_EXHAUSTED with a retry hint (a limit without one never will)."""
    return err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.retry_after_ms > 0


class AdmissionQueue:
    def __init__(self, settings: QueueSettings | None = None, observer: QueueObserver | None = None) -> None:
        self.settings = settings or QueueSettings()
        self.observer = observer or QueueObserver()
        self._places: list[Place] = []
        # Plain counts (no call needed) for the uncontended path, which tries at once: everyone in line, and
        # the running work (verifies) among them.
        self.waiting = 0
        self.running_waiting = 0
        self._turns: list[str] = []  # identities in the order they first queued: round-robin goes round them
        self._last_served: str | None = None
        self._orphans: dict[str, tuple[Place, float]] = {}  # ticket id -> (the place, kept until)
        self._order: list[Place] | None = None  # the service order, until the line changes
        self._gap_s = 0.5  # the mean time between two admissions from the line (EMA): the wait estimate's unit
        self._last_admit: float | None = None

    def __len__(self) -> int:
        return len(self._places)

    def length_of(self, identity: str) -> int:
        return sum(1 for p in self._places if p.identity == identity)

    def kick(self) -> None:
        """Capacity may have been given back: the head tries again now."""
        if self._places:
            self._head().wake.set()

    async def admit(self, identity: str, admission: Admission, attempt: Callable[[], T], tell: Tell | None,
                    seniority: int, abandoned: Callable[[], bool] | None = None, running: bool = False,
                    tried: bool = False) -> tuple[T, float]:
        """`attempt()` (synchronous: it admits or raises, nothing in between) once it is this request's turn:
        its result and the seconds spent in line. `tell` hears each queue ticket; None: an edge that reads none,
        refused with a retry hint where it would wait. `seniority`: the request's stamp, its order within its
        identity and priority. `abandoned`: the edge left (its place is kept a while).
        `tried`: the caller's own attempt, with nobody ahead, was just refused as busy: straight into line."""
        if not tried and not self._ahead_of(running):
            try:
                return attempt(), 0.0
            except CloudError as err:
                if not busy(err) or tell is None:
                    raise
        if tell is None:  # an older edge: no place, and no jumping ahead of those in line
            raise exhausted(f"{len(self)} requests wait in this cloud's line; retry shortly", self._hint_ms(len(self)))
        place = self._join(identity, admission, running, seniority)
        try:
            return await self._wait_turn(place, attempt, tell, abandoned or (lambda: False))
        except BaseException:
            if place in self._places:  # refused, or the server stops: the line goes on without it
                self._leave(place, admitted=False, keep=False)
            raise

    def _ahead_of(self, running: bool) -> bool:
        """Someone in line would be served before a newcomer of this kind."""
        return bool(self.running_waiting if running else self.waiting)

    def _join(self, identity: str, admission: Admission, running: bool, seniority: int) -> Place:
        if len(self._places) >= self.settings.max_length:
            raise exhausted(f"this cloud's admission queue is full: {len(self._places)} requests in line, its "
                            f"bound (--queue-max); retry later", self._hint_ms(len(self._places)))
        self._drop_expired_orphans()
        kept = self._orphans.pop(admission.ticket_id, None) if admission.ticket_id else None
        if kept is not None and kept[0].identity == identity:  # the same edge, back within the grace period
            old = kept[0]
            place = Place(identity, old.priority, old.seq, old.ticket_id, running, old.enqueued_at)
            log.info("edge %s took back its place in line (ticket %s)", identity, old.ticket_id)
        else:
            place = Place(identity, admission.priority, seniority, secrets.token_hex(8), running)
        if identity not in self._turns:
            self._turns.append(identity)
        self._places.append(place)
        self.waiting, self.running_waiting = self.waiting + 1, self.running_waiting + running
        self._changed(identity)
        return place

    def _leave(self, place: Place, admitted: bool, keep: bool = False) -> None:
        self._places.remove(place)
        self.waiting, self.running_waiting = self.waiting - 1, self.running_waiting - place.running
        self._changed(place.identity)
        if admitted:
            now = time.monotonic()
            if self._last_admit is not None:
                self._gap_s = 0.8 * self._gap_s + 0.2 * min(now - self._last_admit, 60.0)
            self._last_admit = now
            self._last_served = place.identity
            self.observer.waited(place.identity, now - place.enqueued_at)
        elif keep:
            self._orphans[place.ticket_id] = (place, time.monotonic() + self.settings.grace_s)
        if not self._places:
            self._last_admit = None  # an empty line: the next gap measures nothing
        self.kick()  # the next head may fit too

    def _changed(self, identity: str) -> None:
        self._order = None
        self.observer.length(identity, self.length_of(identity))
        for place in self._places:  # positions moved: each tells its edge (and the head tries)
            place.wake.set()

    def _drop_expired_orphans(self) -> None:
        now = time.monotonic()
        for ticket_id in [t for t, (_, until) in self._orphans.items() if until < now]:
            del self._orphans[ticket_id]

    def order(self) -> list[Place]:
        """Everyone in line, in the order they will be served (running work, then identities in turn)."""
        if self._order is None:
            running = sorted((p for p in self._places if p.running), key=lambda p: p.seq)
            own: dict[str, list[Place]] = {}
            for place in sorted((p for p in self._places if not p.running), key=lambda p: (p.priority, p.seq)):
                own.setdefault(place.identity, []).append(place)
            last = self._turns.index(self._last_served) + 1 if self._last_served in self._turns else 0
            turns = [i for i in self._turns[last:] + self._turns[:last] if i in own]  # the next after the last served
            order = running
            while any(own.values()):
                order += [own[i].pop(0) for i in turns if own[i]]
            self._order = order
        return self._order

    def _head(self) -> Place:
        return self.order()[0]

    def place_of(self, place: Place) -> QueuePlace:
        position = self.order().index(place)
        return QueuePlace(place.ticket_id, position, self._hint_ms(position), len(self._places))

    def _hint_ms(self, position: int) -> int:
        return max(1, int((position + 1) * self._gap_s * 1e3))

    async def _wait_turn(self, place: Place, attempt: Callable[[], T], tell: Callable[[QueuePlace], None],
                         abandoned: Callable[[], bool]) -> tuple[T, float]:
        """Wait at `place` until it is its turn and `attempt()` gets in; a refusal waiting cannot lift ends the wait."""
        told, told_at = None, 0.0
        settings = self.settings
        while True:
            if abandoned():
                self._leave(place, admitted=False, keep=True)
                raise CloudError(grpc.StatusCode.CANCELLED, "the edge left while its request waited in line")
            if self._head() is place:
                try:
                    result = attempt()
                except CloudError as err:
                    if not busy(err):
                        raise
                else:
                    waited = time.monotonic() - place.enqueued_at
                    self._leave(place, admitted=True)
                    return result, waited
            ticket = self.place_of(place)
            if ticket.position != told or time.monotonic() - told_at >= settings.ticket_every_s:
                tell(ticket)
                told, told_at = ticket.position, time.monotonic()
            place.wake.clear()
            try:
                await asyncio.wait_for(place.wake.wait(), settings.retry_s)
            except asyncio.TimeoutError:
                pass
