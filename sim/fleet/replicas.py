"""The fleet simulator's cloud side: M replicas, each mirroring `cloud.batcher.Batcher`.

Sessions are sticky (the KV cache lives on one replica; a generation is placed on the replica with
the fewest open sessions, or round-robin); when idle a replica takes the first queued request and
gathers more for up to window_ms or until min(max_batch, open sessions on the replica) are in, so a
lone edge never waits out the window. The edges' side and the event loop: sim.fleet.engine.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `sprinter fleet simulate --help` reads ROUTINGS from here without loading numpy
    from sim.fleet.costs import FleetCosts

ARRIVE, DEADLINE, DONE, GENERATION = range(4)  # heap event kinds: (time, seq, kind, a, b)
ROUTINGS = ("least-loaded", "round-robin")

Request = tuple[int, int, float]  # (edge, tokens in the forward, sent at)


class Replica:
    __slots__ = ("batch", "busy", "busy_ms", "calls", "forwards", "gather_id", "gathering", "queue", "sessions")

    def __init__(self) -> None:
        self.queue: deque[Request] = deque()
        self.batch: list[Request] = []
        self.gathering = False
        self.gather_id = 0
        self.busy = False
        self.sessions = 0  # open generations placed here: the batcher's "demand"
        self.busy_ms = 0.0
        self.forwards = 0
        self.calls = 0


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

    def arrive(self, r: int, request: Request, t: float) -> None:
        replica = self.replicas[r]
        replica.queue.append(request)
        if replica.gathering:
            batch, queue, limit = replica.batch, replica.queue, self._limit(replica)
            while len(batch) < limit and queue:
                batch.append(queue.popleft())
            if len(batch) >= limit:
                self.launch(r, t)
        elif not replica.busy:
            self.gather(r, t)

    def gather(self, r: int, t: float) -> None:
        replica = self.replicas[r]
        queue, limit = replica.queue, self._limit(replica)
        batch = replica.batch = [queue.popleft()]
        while len(batch) < limit and queue:
            batch.append(queue.popleft())
        if len(batch) >= limit or self.costs.window_ms <= 0:
            self.launch(r, t)
            return
        replica.gathering = True
        replica.gather_id += 1
        heapq.heappush(self.heap, (t + self.costs.window_ms, next(self.seq), DEADLINE, r, replica.gather_id))

    def deadline(self, r: int, gather_id: int, t: float) -> None:
        replica = self.replicas[r]
        if not replica.gathering or replica.gather_id != gather_id:
            return  # the batch filled up before the window closed
        while len(replica.batch) < self.costs.max_batch and replica.queue:  # whatever is queued joins for free
            replica.batch.append(replica.queue.popleft())
        self.launch(r, t)

    def launch(self, r: int, t: float) -> None:
        replica = self.replicas[r]
        batch, replica.batch, replica.gathering = replica.batch, [], False
        b = len(batch)
        n = b * max(req[1] for req in batch) if self.costs.padded_batches else sum(req[1] for req in batch)
        duration = self.costs.forward.t_forward_ms(b, n)
        replica.busy = True
        replica.busy_ms += max(0.0, min(duration, self.horizon - t))
        replica.forwards += 1
        replica.calls += b
        heapq.heappush(self.heap, (t + duration, next(self.seq), DONE, r, batch))

    def done(self, r: int) -> Replica:
        """The forward on replica r finished: it is free (the caller then calls `next_batch`)."""
        replica = self.replicas[r]
        replica.busy = False
        return replica

    def next_batch(self, r: int, t: float) -> None:
        if self.replicas[r].queue:
            self.gather(r, t)
