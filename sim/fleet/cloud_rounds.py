"""Mode cloud-sd in the fleet simulator: speculation rounds that run wholly at the replica (cloud/cloud_sd.py).

A generation opens with one Generate call: half an RTT (and the prompt's uplink) to the replica. Then, per
round, with (g, emitted) drawn from the profile's record as an edge-drafting round draws it:

    g draft steps    each one request of one token in the replica's draft queue; the steps of every cloud-sd
                     generation waiting then share one batched draft forward (`FleetCosts.draft_forward`)
    one verify       g + 1 tokens in the target's queue, batched with the others like an edge's verify
    the chunk        the round's tokens reach the edge together half an RTT (and the downlink) later, while
                     the next round already starts at the replica: the RTT is paid once per generation

Draft and target forwards share the replica's compute (sim.fleet.replicas: one forward at a time, either
kind). With prompt_tokens > 0 the first round's first draft step carries the prompt and its verify the
prompt but its last token too (the cloud runs them as prefill chunks first; one forward each here, as
target mode's first forward carries the prompt). A later round's first step feeds one token (the real one
feeds one or two: the bonus token, and the last drafted one when all were kept; a token's cost is small
next to a step's). While the target's batch gathers in its window, the replica runs draft steps.

A mixin of sim.fleet.simulation._Simulation: it reads the simulation's per-edge state and its pool.
"""

from __future__ import annotations

import heapq

from sim.fleet.replicas import DRAFT, ROUND, TARGET, Request


class CloudRounds:
    """The cloud-sd half of the simulation (the attributes are _Simulation's; `steps_left` and `block` are its own)."""

    def _cloud_open(self, edge: int, t: float) -> None:
        """The Generate call goes up; its first round starts at the replica when it arrives (a ROUND event)."""
        prompt = max(1, self.costs.prompt_tokens)
        self.opening[edge] = self.costs.prompt_tokens > 0  # the first round carries the prompt
        arrival = t + 0.5 * self.rtt_draws.next() + self.costs.uplink_ms(prompt)
        heapq.heappush(self.heap, (arrival, next(self.seq), ROUND, edge, None))

    def _cloud_round(self, edge: int, t: float, at_done: bool = False) -> None:
        """A round starts at the replica at t: its first draft step queues (`at_done`: while a forward ends
        there, so the pool's next_batch gathers it with the others)."""
        g, e = self._take_call(edge)
        self.late[edge] = e
        self.block[edge] = self.steps_left[edge] = g
        self.round_start[edge] = t
        request: Request = (edge, max(1, self.costs.prompt_tokens) if self.opening[edge] else 1, t)
        if at_done:
            self.pool.enqueue(self.replica_of[edge], request, DRAFT)
        else:
            self.pool.arrive(self.replica_of[edge], request, t, DRAFT)

    def _cloud_drafted(self, batch: list[Request], t: float) -> None:
        """A draft forward ended: each generation's next step queues, or its verify when the block is drafted."""
        for edge, _, _ in batch:
            r = self.replica_of[edge]
            self.steps_left[edge] -= 1
            if self.steps_left[edge] > 0:
                self.pool.enqueue(r, (edge, 1, t), DRAFT)
                continue
            n = self.block[edge] + 1 + (max(0, self.costs.prompt_tokens - 1) if self.opening[edge] else 0)
            self.opening[edge] = False
            if self.round_start[edge] <= self.horizon:
                self.calls += 1
            self.pool.enqueue(r, (edge, n, self.round_start[edge]), TARGET)

    def _cloud_verified(self, batch: list[Request], t: float) -> None:
        """A verify forward ended: each round's tokens stream down as one chunk; the next round starts now."""
        down = self.costs.downlink_ms()
        for edge, _, round_start in batch:
            t_emit = max(t + 0.5 * self.rtt_draws.next() + down, self.last_emit[edge])  # one stream, in order
            self.call_ms.append(t_emit - round_start)
            self._release(edge, t_emit, self.late[edge])
            if self.remaining[edge] > 0:
                self._cloud_round(edge, t, at_done=True)
            else:
                self._end_generation(edge, t_emit)
