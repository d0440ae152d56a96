"""The fleet simulator's cloud side: M replicas, each mirroring `cloud.batcher.Batcher`.

Sessions are sticky (the KV cache lives on one replica; a generation is placed on the replica with
the fewest open sessions, or round-robin); when idle a replica takes the first queued request and
gathers more for up to window_ms or until min(max_batch, open sessions on the replica) are in, so a
lone edge never waits out the window. With continuous batching (no window) and `straggler_share` set, a batch
short of that right after a forward waits for stragglers as the batcher does (a share of the last forward,
capped); a replica that was idle starts at once. The edges' side and the event loop: sim.fleet.simulation.

Two kinds of forward (mode cloud-sd): the target's (verifies, target mode's steps) and the cloud's draft's
(`cloud serve --draft`: its own batcher, no batching window, as cloud/server.py builds it). Both batchers'
worker threads run on the replica's cores, so a replica is one compute resource that runs one forward at
a time, of either kind, batching within each kind. The target's batch gathers during its window whatever
runs meanwhile (a draft step may); when the compute is free and both kinds are ready, the other kind than
the one that just ran goes next (neither starves the other, as two threads sharing a core).
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


class SimulatedReplica:
    __slots__ = ("batch", "busy", "busy_ms", "calls", "draft_calls", "draft_forwards", "draft_queue", "forwards",
                 "gather_id", "gathering", "kind", "last_end", "last_forward_ms", "queue", "queues", "ready", "sessions")

    def __init__(self) -> None:
        self.queue: deque[Request] = deque()  # the target's
        self.draft_queue: deque[Request] = deque()  # the cloud's draft's (cloud-sd)
        self.queues = (self.queue, self.draft_queue)  # by forward kind
        self.kind = TARGET  # of the forward running (or that ran last)
        self.batch: list[Request] = []  # the target's, gathering
        self.gathering = False  # the target's batch is gathering (or gathered, waiting for the compute)
        self.ready = False  # ... and is complete: it runs when the compute is free
        self.gather_id = 0
        self.busy = False
        self.sessions = 0  # open generations placed here: the batcher's "demand"
        self.busy_ms = 0.0  # forwards of both kinds
        self.forwards = 0  # the target's
        self.calls = 0  # requests in the target's forwards
        self.draft_forwards = 0
        self.draft_calls = 0
        self.last_forward_ms = 0.0  # the target's last forward, and when it ended: the straggler hold reads them
        self.last_end = float("-inf")


class ReplicaPool:
    """The replicas and their batching, pushing DEADLINE and DONE events on the simulation's heap."""

    def __init__(self, costs: FleetCosts, n_replicas: int, routing: str, heap: list[tuple],
                 seq: Iterator[int], horizon: float) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, not {routing!r}")
        self.costs, self.routing, self.heap, self.seq, self.horizon = costs, routing, heap, seq, horizon
        self.replicas = [SimulatedReplica() for _ in range(n_replicas)]
        self.rr = itertools.count()

    def place(self) -> int:
        if self.routing == "round-robin":
            return next(self.rr) % len(self.replicas)
        return min(range(len(self.replicas)), key=lambda r: self.replicas[r].sessions)

    def _limit(self, replica: SimulatedReplica) -> int:
        return max(1, min(self.costs.max_batch, replica.sessions))

    def arrive(self, r: int, request: Request, t: float, kind: int = TARGET) -> None:
        replica = self.replicas[r]
        replica.queues[kind].append(request)
        if kind == TARGET and replica.gathering and not replica.ready:
            batch, queue, limit = replica.batch, replica.queue, self._limit(replica)
            while len(batch) < limit and queue:
                batch.append(queue.popleft())
            if len(batch) >= limit:
                replica.ready = True
        self.next_batch(r, t)

    def enqueue(self, r: int, request: Request, kind: int) -> None:
        """Queue a request made at the replica itself while its forward ends (the caller then calls `next_batch`)."""
        self.replicas[r].queues[kind].append(request)

    def gather(self, r: int, t: float) -> None:
        """The target's batch starts gathering: complete at once, or when full or at the window's deadline."""
        replica = self.replicas[r]
        queue, limit = replica.queue, self._limit(replica)
        batch = replica.batch = [queue.popleft()]
        while len(batch) < limit and queue:
            batch.append(queue.popleft())
        replica.gathering = True
        hold = self._hold_ms(replica, t)
        replica.ready = len(batch) >= limit or hold <= 0
        if not replica.ready:
            replica.gather_id += 1
            heapq.heappush(self.heap, (t + hold, next(self.seq), DEADLINE, r, replica.gather_id))

    def _hold_ms(self, replica: SimulatedReplica, t: float) -> float:
        """How long a short batch gathers: the window, or (continuous batching) the straggler hold right after a
        forward, none after an idle spell (cloud/batcher.py)."""
        if self.costs.window_ms > 0:
            return self.costs.window_ms
        if t - replica.last_end > replica.last_forward_ms:
            return 0.0
        return min(self.costs.max_hold_ms, self.costs.straggler_share * replica.last_forward_ms)

    def deadline(self, r: int, gather_id: int, t: float) -> None:
        replica = self.replicas[r]
        if not replica.gathering or replica.ready or replica.gather_id != gather_id:
            return  # the batch filled up before the window closed
        replica.ready = True
        self.next_batch(r, t)

    def launch(self, r: int, t: float, kind: int) -> None:
        replica = self.replicas[r]
        if kind == TARGET:
            batch, replica.batch, replica.gathering, replica.ready = replica.batch, [], False, False
            while len(batch) < self.costs.max_batch and replica.queue:  # whatever is queued joins for free
                batch.append(replica.queue.popleft())
        else:
            queue, limit = replica.draft_queue, self._limit(replica)
            batch = [queue.popleft() for _ in range(min(limit, len(queue)))]
        b = len(batch)
        n = b * max(req[1] for req in batch) if self.costs.padded_batches else sum(req[1] for req in batch)
        if kind == DRAFT:
            duration = self.costs.draft_model().t_forward_ms(b, n)
            replica.draft_forwards += 1
            replica.draft_calls += b
        else:
            duration = self.costs.forward.t_forward_ms(b, n)
            replica.last_forward_ms, replica.last_end = duration, t + duration
            replica.forwards += 1
            replica.calls += b
        replica.busy, replica.kind = True, kind
        replica.busy_ms += max(0.0, min(duration, self.horizon - t))
        heapq.heappush(self.heap, (t + duration, next(self.seq), DONE, r, batch))

    def done(self, r: int) -> SimulatedReplica:
        """The forward on replica r finished: it is free (the caller then calls `next_batch`); its `kind` says
        which kind of forward it was."""
        replica = self.replicas[r]
        replica.busy = False
        return replica

    def next_batch(self, r: int, t: float) -> None:
        """The target's next batch starts gathering unless its forward runs; the compute, when free, runs a ready
        target batch or the draft's queued steps, the other kind than the last first."""
        replica = self.replicas[r]
        if not replica.gathering and replica.queue and not (replica.busy and replica.kind == TARGET):
            self.gather(r, t)
        if replica.busy:
            return
        target, draft = replica.gathering and replica.ready, bool(replica.draft_queue)
        if target and (not draft or replica.kind == DRAFT):
            self.launch(r, t, TARGET)
        elif draft:
            self.launch(r, t, DRAFT)
