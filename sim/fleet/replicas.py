"""The fleet simulator's cloud side: M replicas, each mirroring `cloud.batcher.Batcher`.

Sessions are sticky (the KV cache lives on one replica; a generation is placed on the replica with
the fewest open sessions, or round-robin); when idle a replica takes the first queued request and
gathers more for up to window_ms or until min(max_batch, open sessions on the replica) are in, so a
lone edge never waits out the window. The edges' side and the event loop: sim.fleet.engine.

Two kinds of forward (mode cloud-sd): the target's (verifies, target mode's steps) and the cloud's draft's
(`cloud serve --draft`: its own batcher, no batching window, as cloud/server.py builds it). Both batchers'
worker threads run on the replica's cores, so a replica is one compute resource that runs one forward at
a time, of either kind, batching within each kind; when a forward ends and both kinds wait, the other
kind than the one that just ran goes next (neither starves the other, as two threads sharing a core).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `sprinter fleet simulate --help` reads ROUTINGS from here without loading numpy
    from sim.fleet.costs import FleetCosts

ARRIVE, DEADLINE, DONE, GENERATION, ROUND = range(5)  # heap event kinds: (time, seq, kind, a, b)
TARGET, DRAFT = 0, 1  # forward kinds: the target's, the cloud's draft's (cloud-sd)
ROUTINGS = ("least-loaded", "round-robin")

Request = tuple[int, int, float]  # (edge, tokens in the forward, sent at)


class Replica:
    __slots__ = ("batch", "busy", "busy_ms", "calls", "draft_calls", "draft_forwards", "draft_queue", "forwards",
                 "gather_id", "gathering", "kind", "queue", "queues", "sessions")

    def __init__(self) -> None:
        self.queue: deque[Request] = deque()  # the target's
        self.draft_queue: deque[Request] = deque()  # the cloud's draft's (cloud-sd)
        self.queues = (self.queue, self.draft_queue)  # by forward kind
        self.kind = TARGET  # of the batch gathering or running (or that ran last)
        self.batch: list[Request] = []
        self.gathering = False
        self.gather_id = 0
        self.busy = False
        self.sessions = 0  # open generations placed here: the batcher's "demand"
        self.busy_ms = 0.0  # forwards of both kinds
        self.forwards = 0  # the target's
        self.calls = 0  # requests in the target's forwards
        self.draft_forwards = 0
        self.draft_calls = 0


class ReplicaPool:
    """The replicas and their batching, pushing DEADLINE and DONE events on the simulation's heap."""

    def __init__(self, costs: FleetCosts, n_replicas: int, routing: str, heap: list[tuple],
                 seq: Iterator[int], horizon: float) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, not {routing!r}")
        self.costs, self.routing, self.heap, self.seq, self.horizon = costs, routing, heap, seq, horizon
        self.replicas = [Replica() for _ in range(n_replicas)]
        self.rr = itertools.count()

    def place(self) -> int:
        if self.routing == "round-robin":
            return next(self.rr) % len(self.replicas)
        return min(range(len(self.replicas)), key=lambda r: self.replicas[r].sessions)

    def _limit(self, replica: Replica) -> int:
        return max(1, min(self.costs.max_batch, replica.sessions))

    def arrive(self, r: int, request: Request, t: float, kind: int = TARGET) -> None:
        replica = self.replicas[r]
        replica.queues[kind].append(request)
        if replica.gathering:
            if replica.kind != kind:
                return  # it waits for the batch gathering now to run
            batch, queue, limit = replica.batch, replica.queues[kind], self._limit(replica)
            while len(batch) < limit and queue:
                batch.append(queue.popleft())
            if len(batch) >= limit:
                self.launch(r, t)
        elif not replica.busy:
            self.gather(r, t, kind)

    def enqueue(self, r: int, request: Request, kind: int) -> None:
        """Queue a request made at the replica itself while its forward ends (the caller then calls `next_batch`)."""
        self.replicas[r].queues[kind].append(request)

    def gather(self, r: int, t: float, kind: int = TARGET) -> None:
        replica = self.replicas[r]
        replica.kind = kind
        queue, limit = replica.queues[kind], self._limit(replica)
        batch = replica.batch = [queue.popleft()]
        while len(batch) < limit and queue:
            batch.append(queue.popleft())
        if len(batch) >= limit or self.costs.window_ms <= 0 or kind == DRAFT:  # the draft's batcher has no window
            self.launch(r, t)
            return
        replica.gathering = True
        replica.gather_id += 1
        heapq.heappush(self.heap, (t + self.costs.window_ms, next(self.seq), DEADLINE, r, replica.gather_id))

    def deadline(self, r: int, gather_id: int, t: float) -> None:
        replica = self.replicas[r]
        if not replica.gathering or replica.gather_id != gather_id:
            return  # the batch filled up before the window closed
        queue = replica.queues[replica.kind]
        while len(replica.batch) < self.costs.max_batch and queue:  # whatever is queued joins for free
            replica.batch.append(queue.popleft())
        self.launch(r, t)

    def launch(self, r: int, t: float) -> None:
        replica = self.replicas[r]
        batch, replica.batch, replica.gathering = replica.batch, [], False
        b = len(batch)
        n = b * max(req[1] for req in batch) if self.costs.padded_batches else sum(req[1] for req in batch)
        if replica.kind == DRAFT:
            duration = self.costs.draft_model().t_forward_ms(b, n)
            replica.draft_forwards += 1
            replica.draft_calls += b
        else:
            duration = self.costs.forward.t_forward_ms(b, n)
            replica.forwards += 1
            replica.calls += b
        replica.busy = True
        replica.busy_ms += max(0.0, min(duration, self.horizon - t))
        heapq.heappush(self.heap, (t + duration, next(self.seq), DONE, r, batch))

    def done(self, r: int) -> Replica:
        """The forward on replica r finished: it is free (the caller then calls `next_batch`); its `kind` says
        which kind of forward it was."""
        replica = self.replicas[r]
        replica.busy = False
        return replica

    def next_batch(self, r: int, t: float) -> None:
        replica = self.replicas[r]
        other = DRAFT if replica.kind == TARGET else TARGET
        if replica.queues[other]:
            self.gather(r, t, other)
        elif replica.queues[replica.kind]:
            self.gather(r, t, replica.kind)
