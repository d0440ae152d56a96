"""Fleet-scale discrete-event simulator: N edges (1 to 10,000) sharing M cloud replicas.

    result = run_fleet(demo_costs(), demo_profiles()[2], n_edges=1000, n_replicas=4)

Each edge loops, one cloud call per round: draft g tokens (g x (draft_step_ms + verifier_ms in the
sprinter modes)), send the block (half an RTT + uplink), queue at its replica, wait for the batched
target forward, get the verdict (half an RTT + downlink), emit. (g, emitted) pairs are drawn from
the mode's recorded profile. `sprinter` streams verifier-passed tokens as they are drafted; the
other modes release a block's tokens when its verdict returns. `target` is the cloud streaming one
token per 1-token forward; `cloud-sd` is the cloud's own rounds (draft steps and a verify at the
replica, streamed: sim.fleet.cloud_rounds); `draft` never calls the cloud. Prefill is modelled only when the costs
give prompt_tokens (the session open: one more round trip and a prompt forward in the batch queue).
With a pipeline (sim.fleet.pipeline: ahead, send-ahead) a verdict that hits has the next block drafted
ahead (sent at once) or, for send-ahead, already on its way to the cloud (verified with no round trip).

The replicas mirror `cloud.batcher.Batcher` (sim.fleet.replicas).

One heap event per cloud call (its arrival at the replica), one per forward, one per gathering
window and one per generation: the edge's emissions are computed, not simulated, which keeps
10,000 edges x a few hundred tokens to seconds per mode. Inputs: sim.fleet.costs; the report and
`sprinter fleet simulate`: sim.fleet.report, sim.fleet.command.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from array import array
from collections.abc import Callable

import numpy as np

from sim.fleet.cloud_rounds import CloudRounds
from sim.fleet.costs import FleetCosts, ModeProfile
from sim.fleet.pipeline import PipelineModel
from sim.fleet.replicas import ARRIVE, DEADLINE, DONE, DRAFT, GENERATION, ROUND, ROUTINGS, SimulatedReplica, ReplicaPool
from sim.fleet.result import FleetResult, itl_per_token_percentiles, itl_percentiles, percentile

log = logging.getLogger(__name__)

__all__ = ["ROUTINGS", "run_fleet"]


class _Draws:
    """Random numbers drawn in chunks: one numpy call per 65,536 values instead of one per value."""

    def __init__(self, draw: Callable[[int], np.ndarray], chunk: int = 65536) -> None:
        self._draw, self._chunk = draw, chunk
        self._values: list = []
        self._i = 0

    def next(self) -> float | int:
        if self._i == len(self._values):
            self._values, self._i = self._draw(self._chunk).tolist(), 0
        self._i += 1
        return self._values[self._i - 1]


class _Simulation(CloudRounds):
    def __init__(self, costs: FleetCosts, profile: ModeProfile, n_edges: int, n_replicas: int, seed: int,
                 tokens_per_request: int, requests: int | None, duration_s: float | None, routing: str,
                 start_spread_ms: float, pipeline: PipelineModel) -> None:
        if n_edges < 1 or n_replicas < 1 or tokens_per_request < 1:
            raise ValueError("n_edges, n_replicas and tokens_per_request must be >= 1")
        if (requests is None) == (duration_s is None):
            raise ValueError("give exactly one of requests and duration_s")
        if profile.traits.cloud_drafts:
            costs.draft_model()  # missing: a clear error now, not at the first draft forward
        self.costs, self.profile, self.routing, self.seed, self.pipeline = costs, profile, routing, seed, pipeline
        self.n_edges, self.tokens_per_request = n_edges, tokens_per_request
        self.requests, self.duration_s = requests, duration_s
        self.horizon = math.inf if duration_s is None else duration_s * 1e3
        self.step_ms = costs.draft_step_ms + (costs.verifier_ms if profile.traits.uses_verifier else 0.0)
        # the prompt's forward yields the first draft token: it replaces that token's step
        self.prefill_extra_ms = max(0.0, costs.draft_prefill_ms - costs.draft_step_ms) if costs.draft_prefill_ms else 0.0
        self.opens_session = costs.prompt_tokens >= 2  # the cloud prefills prompt[:-1]; the last goes with the first block
        self.calls_record = list(zip(profile.block_lengths, profile.emitted))
        call_rng, rtt_rng, start_rng, hit_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4))
        n_record = max(1, len(self.calls_record))
        self.call_draws = _Draws(lambda size: call_rng.integers(0, n_record, size))
        self.rtt_draws = _Draws(lambda size: costs.rtt.sample(rtt_rng, size))
        self.starts = (start_rng.uniform(0, start_spread_ms, n_edges) if start_spread_ms > 0 else np.zeros(n_edges)).tolist()
        self.heap: list[tuple] = []
        self.seq = itertools.count()
        self.pool = ReplicaPool(costs, n_replicas, routing, self.heap, self.seq, self.horizon)
        self.replicas = self.pool.replicas
        # the pipeline (sim.fleet.pipeline): whether a verdict hits, and the next call drawn a round early
        self.pipelined = pipeline.applies_to(profile)
        self.hit_rate = pipeline.hit_rate_for(profile)
        self.hit_draws = _Draws(lambda size: hit_rng.random(size))
        self.next_call: list[tuple[int, int] | None] = [None] * n_edges
        self.ahead_from = [0.0] * n_edges  # when the edge began drafting ahead of the block in flight
        self.ahead_rounds = self.ahead_hits = self.candidate_hits = 0
        self.uplink_bytes = 0.0
        # per edge
        self.replica_of = [-1] * n_edges
        self.requests_left = [requests if requests is not None else -1 for _ in range(n_edges)]  # -1: until the horizon
        self.remaining = [0] * n_edges  # tokens of the current generation not yet committed to a call
        self.late = [0] * n_edges  # tokens the in-flight call releases when its verdict arrives
        self.down_ms = [0.0] * n_edges  # the in-flight call's way back
        self.opening = [False] * n_edges  # the in-flight request is the session open (prefill), the block waits
        self.pending_n = [0] * n_edges  # tokens of the block waiting for the open
        self.steps_left = [0] * n_edges  # cloud-sd: draft steps of the round still to run at the replica
        self.block = [0] * n_edges  # cloud-sd: the round's g
        self.round_start = [0.0] * n_edges  # cloud-sd: when the round began at the replica
        self.request_start = [0.0] * n_edges
        self.last_emit = [-1.0] * n_edges  # -1: nothing emitted yet in this generation
        self.tokens = [0] * n_edges  # emitted by the horizon
        self.wall_ms = [0.0] * n_edges  # summed generation wall times
        # measurements; ITL gaps of 0 (a block released at once) and of one draft step are only counted
        self.zero_gaps = self.step_gaps = 0
        self.other_gaps = array("d")
        self.other_gap_tokens = array("d")  # the tokens released after each of other_gaps (per-token ITL)
        self.ttft_ms, self.call_ms, self.request_ms = array("d"), array("d"), array("d")
        self.calls = 0

    # --- edges ---------------------------------------------------------------------------------

    def _generation(self, edge: int, t: float) -> None:
        """A generation ends (its session closes) and, if the edge has more to do, the next one opens."""
        if self.replica_of[edge] >= 0:
            self.replicas[self.replica_of[edge]].sessions -= 1
            self.replica_of[edge] = -1
        if self.requests_left[edge] == 0 or t > self.horizon:
            return
        if self.requests_left[edge] > 0:
            self.requests_left[edge] -= 1
        r = self.pool.place()
        self.replicas[r].sessions += 1
        self.replica_of[edge] = r
        self.remaining[edge] = self.tokens_per_request
        self.request_start[edge] = t
        self.last_emit[edge] = -1.0
        if self.profile.traits.cloud_drafts:  # cloud-sd: one Generate stream; the replica runs the rounds
            self._cloud_open(edge, t)
        elif not self.profile.traits.drafts:  # target: one Generate stream; the cloud then loops on its own
            self.calls += 1
            prompt = max(1, self.costs.prompt_tokens)  # the first forward carries the prompt
            arrival = t + 0.5 * self.rtt_draws.next() + self.costs.uplink_ms(prompt)
            heapq.heappush(self.heap, (arrival, next(self.seq), ARRIVE, r, (edge, prompt, t)))
        else:
            self.opening[edge] = self.opens_session
            self._round(edge, t + self.prefill_extra_ms)

    def _take_call(self, edge: int) -> tuple[int, int]:
        """This round's (g, emitted), within the generation's budget; with a pipeline the next round's is
        drawn now (its block is drafted ahead of this one's verdict)."""
        call = self.next_call[edge] or self.calls_record[self.call_draws.next()]
        if self.pipelined:
            self.next_call[edge] = self.calls_record[self.call_draws.next()]
        rem = self.remaining[edge]
        g, e = min(call[0], rem), min(call[1], rem)  # the edge drafts no further than the generation's budget
        self.remaining[edge] = rem - e
        return g, e

    def _stream(self, edge: int, t0: float, early: int) -> None:
        """sprinter: the verifier-passed tokens of a block drafted from t0 reach the user as they are drafted."""
        step = self.step_ms
        last = self.last_emit[edge]
        if last < 0:
            self.ttft_ms.append(t0 + step - self.request_start[edge])
        else:
            self.other_gaps.append(t0 + step - last)
            self.other_gap_tokens.append(1)
        self.step_gaps += early - 1
        self.last_emit[edge] = t0 + early * step
        if t0 + early * step <= self.horizon:
            self.tokens[edge] += early
        elif step > 0:  # the horizon falls inside the streamed run
            self.tokens[edge] += max(0, min(early, int((self.horizon - t0) // step)))

    def _round(self, edge: int, t0: float, ready: float | None = None) -> None:
        """Draft a block from t0 (streaming it in sprinter mode) and send it; `ready`: the block was drafted
        ahead (a pipeline's hit) and is done then, so it goes up at max(t0, ready)."""
        g, e = self._take_call(edge)
        # sprinter never re-checks verifier-passed tokens, so the user gets them as they are drafted
        early = min(g - 1, e - 1) if self.profile.traits.releases_passed else 0
        if early > 0:
            self._stream(edge, t0, early)
        self.late[edge] = e - early
        self._send(edge, g, t0 + g * self.step_ms if ready is None else max(t0, ready))

    def _send(self, edge: int, g: int, t_send: float, not_before: float = 0.0, candidate: bool = False) -> None:
        """A block of g draft tokens goes up at t_send and queues at its replica (not before `not_before`).
        A candidate's bytes were counted when it was sent ahead."""
        half_rtt = 0.5 * self.rtt_draws.next()
        self.down_ms[edge] = half_rtt + self.costs.downlink_ms()
        self.ahead_from[edge] = t_send
        if t_send <= self.horizon:
            self.calls += 1
        if self.opening[edge]:  # the session opens first: the cloud prefills the prompt but its last token
            self.pending_n[edge] = g + 1
            arrival = t_send + half_rtt + self.costs.uplink_ms(self.costs.prompt_tokens)
            request = (edge, self.costs.prompt_tokens - 1, t_send)
        else:
            self.uplink_bytes += 0.0 if candidate else self.costs.frame_bytes + self.costs.uplink_bytes_per_token * g
            arrival = t_send + half_rtt + self.costs.uplink_ms(g)
            # g + 1 tokens: the previous verdict's next token goes into the forward with the block
            request = (edge, g + 1, t_send)
        heapq.heappush(self.heap, (max(arrival, not_before), next(self.seq), ARRIVE, self.replica_of[edge], request))

    def _pipelined(self, edge: int, t: float, t_reply: float) -> bool:
        """A verdict (forward done at t, at the edge at t_reply) of a block the edge drafted ahead of; True on a
        hit, which starts the next round. The hit candidate is taken to be the first drafted (the likeliest)."""
        g = min(self.next_call[edge][0], self.remaining[edge])  # type: ignore[index]
        drafting = g * self.step_ms
        ready = self.ahead_from[edge] + drafting
        send_ahead = self.pipeline.pipeline == "send-ahead"
        if send_ahead:  # candidates go up as each is done, until the verdict is back
            k = self.pipeline.candidates
            sent = k if drafting <= 0 else min(k, max(0, int((t_reply - self.ahead_from[edge]) // drafting)))
            self.uplink_bytes += sent * (self.costs.frame_bytes + self.costs.uplink_bytes_per_token * g)
        self.ahead_rounds += 1
        if self.hit_draws.next() >= self.hit_rate:
            return False
        self.ahead_hits += 1
        if send_ahead and ready <= t_reply:  # the cloud has it (or will): verified once it arrives, no round trip
            self.candidate_hits += 1
            g, e = self._take_call(edge)
            self.late[edge] = e
            self._send(edge, g, ready, not_before=t, candidate=True)
            self.ahead_from[edge] = t_reply  # the edge learns which block is in flight from this verdict
        else:
            self._round(edge, t_reply, ready)
        return True

    def _verdicts(self, batch: list[tuple[int, int, float]], t: float) -> None:
        for edge, _, t_sent in batch:
            if self.opening[edge]:  # opened: now the block goes up, one more round trip
                self.opening[edge] = False
                half_rtt = 0.5 * self.rtt_draws.next()
                n = self.pending_n[edge]
                arrival = t + self.down_ms[edge] + half_rtt + self.costs.uplink_ms(n - 1)
                self.ahead_from[edge] = t + self.down_ms[edge]  # the block goes up now: drafting ahead starts
                self.down_ms[edge] = half_rtt + self.costs.downlink_ms()
                self.uplink_bytes += self.costs.frame_bytes + self.costs.uplink_bytes_per_token * (n - 1)
                heapq.heappush(self.heap, (arrival, next(self.seq), ARRIVE, self.replica_of[edge], (edge, n, t_sent)))
                continue
            t_reply = t + self.down_ms[edge]
            self.call_ms.append(t_reply - t_sent)
            self._release(edge, t_reply, self.late[edge])
            if self.remaining[edge] == 0:
                self._end_generation(edge, t_reply)
            elif not (self.pipelined and self._pipelined(edge, t, t_reply)):
                self._round(edge, t_reply)

    def _target_tokens(self, replica: SimulatedReplica, batch: list[tuple[int, int, float]], t: float) -> None:
        """target mode: each token streams down to its edge; the cloud queues the session's next step at once."""
        down = self.costs.downlink_ms()
        for request in batch:
            edge = request[0]
            last = self.last_emit[edge]
            t_emit = max(t + 0.5 * self.rtt_draws.next() + down, last)  # one stream arrives in order
            self.call_ms.append(t_emit - request[2])
            self._release(edge, t_emit, 1)
            self.remaining[edge] -= 1
            if self.remaining[edge] > 0:
                self.calls += 1
                replica.queue.append((edge, 1, t))
            else:
                self._end_generation(edge, t_emit)

    def _release(self, edge: int, t_emit: float, n: int) -> None:
        """n tokens reach the edge together at t_emit: the TTFT or one gap since the last, then n - 1 gaps of 0."""
        last = self.last_emit[edge]
        if last < 0:
            self.ttft_ms.append(t_emit - self.request_start[edge])
        else:
            self.other_gaps.append(t_emit - last)
            self.other_gap_tokens.append(n)
        self.zero_gaps += n - 1
        self.last_emit[edge] = t_emit
        if t_emit <= self.horizon:
            self.tokens[edge] += n

    def _end_generation(self, edge: int, t: float) -> None:
        self.request_ms.append(t - self.request_start[edge])
        self.wall_ms[edge] += t - self.request_start[edge]
        # the session closes (and the next opens) when the edge has the last token: an event at t
        heapq.heappush(self.heap, (t, next(self.seq), GENERATION, edge, None))

    def _done(self, r: int, batch: list[tuple[int, int, float]], t: float) -> None:
        replica = self.pool.done(r)
        if replica.kind == DRAFT:
            self._cloud_drafted(batch, t)
        elif self.profile.traits.cloud_drafts:
            self._cloud_verified(batch, t)
        elif not self.profile.traits.drafts:
            self._target_tokens(replica, batch, t)
        else:
            self._verdicts(batch, t)
        self.pool.next_batch(r, t)

    # --- run -----------------------------------------------------------------------------------

    def _run_draft(self) -> None:
        """No cloud: each edge emits one token per draft step, nothing to interleave."""
        step, n, extra = self.step_ms, self.tokens_per_request, self.prefill_extra_ms
        generation_ms = n * step + extra
        if generation_ms <= 0:
            raise ValueError("mode draft needs draft_step_ms > 0")
        for edge, start in enumerate(self.starts):
            if math.isinf(self.horizon):
                generations = self.requests_left[edge]
                self.tokens[edge] = generations * n
                self.wall_ms[edge] = generations * generation_ms
                self.request_ms.extend([generation_ms] * generations)
                self.last_emit[edge] = start + generations * generation_ms
            else:
                done, partial_ms = divmod(self.horizon - start, generation_ms)
                partial = n if step == 0 else int((partial_ms - extra) // step)
                self.tokens[edge] = int(done) * n + min(n, max(0, partial))
                generations = int(done) + (partial_ms > 0)
                self.last_emit[edge] = self.horizon
            self.ttft_ms.extend([step + extra] * generations)
            self.step_gaps += generations * (n - 1)

    def run(self) -> FleetResult:
        started = time.perf_counter()
        if not self.profile.traits.uses_cloud:
            self._run_draft()
        else:
            self._run_events()
        return self._result(time.perf_counter() - started)

    def _run_events(self) -> None:
        heap = self.heap
        for edge, start in enumerate(self.starts):
            heapq.heappush(heap, (start, next(self.seq), GENERATION, edge, None))
        handlers = {ARRIVE: self.pool.arrive, DEADLINE: self.pool.deadline, DONE: self._done,
                    ROUND: lambda edge, _, t: self._cloud_round(edge, t)}
        while heap:
            t, _, kind, a, b = heapq.heappop(heap)
            if t > self.horizon:
                break
            if kind == GENERATION:
                self._generation(a, t)
            else:
                handlers[kind](a, b, t)

    def _result(self, wall_s: float) -> FleetResult:
        tokens = sum(self.tokens)
        if math.isinf(self.horizon):
            sim_ms = max(self.last_emit)
            wall = np.asarray(self.wall_ms)
        else:
            sim_ms = self.horizon
            wall = self.horizon - np.asarray(self.starts)
        per_edge = np.asarray(self.tokens) / np.maximum(wall, 1e-9) * 1e3
        itl_p50, itl_p99 = itl_percentiles(self.step_ms, self.zero_gaps, self.step_gaps, self.other_gaps)
        token_p50, token_p99 = itl_per_token_percentiles(self.step_ms, self.step_gaps, self.other_gaps, self.other_gap_tokens)
        forwards = sum(r.forwards for r in self.replicas)
        batched = sum(r.calls for r in self.replicas)
        draft_forwards = sum(r.draft_forwards for r in self.replicas)
        busy_ms = sum(r.busy_ms for r in self.replicas)
        return FleetResult(
            mode=self.profile.mode, profile=self.profile.name, n_edges=self.n_edges, n_replicas=len(self.replicas),
            seed=self.seed, tokens_per_request=self.tokens_per_request, requests=self.requests,
            duration_s=self.duration_s, routing=self.routing,
            tokens=tokens, sim_s=sim_ms / 1e3,
            tokens_per_s_mean=float(per_edge.mean()), tokens_per_s_p50=float(np.median(per_edge)),
            fleet_tokens_per_s=tokens / sim_ms * 1e3 if sim_ms > 0 else 0.0,
            ttft_ms_p50=percentile(self.ttft_ms, 0.5), itl_ms_p50=itl_p50, itl_ms_p99=itl_p99,
            itl_per_token_ms_p50=token_p50, itl_per_token_ms_p99=token_p99,
            call_ms_p50=percentile(self.call_ms, 0.5), call_ms_p99=percentile(self.call_ms, 0.99),
            request_ms_p50=percentile(self.request_ms, 0.5),
            cloud_utilisation=busy_ms / (len(self.replicas) * sim_ms) if sim_ms > 0 else 0.0,
            cloud_forwards=forwards, cloud_forwards_per_token=forwards / tokens if tokens else 0.0,
            cloud_batch_size_mean=batched / forwards if forwards else None,
            cloud_draft_forwards=draft_forwards,
            cloud_draft_batch_size_mean=sum(r.draft_calls for r in self.replicas) / draft_forwards if draft_forwards else None,
            target_calls=self.calls, target_calls_per_token=self.calls / tokens if tokens else 0.0,
            tokens_per_call=tokens / self.calls if self.calls else None, wall_s=wall_s,
            pipeline=self.pipeline.pipeline if self.pipelined else "off",
            hit_rate=self.hit_rate if self.pipelined else None,
            ahead_hit_rate=self.ahead_hits / self.ahead_rounds if self.ahead_rounds else None,
            candidate_hits=self.candidate_hits,
            uplink_bytes_per_token=self.uplink_bytes / tokens if tokens and self.uplink_bytes else None)


def run_fleet(costs: FleetCosts, profile: ModeProfile, n_edges: int, n_replicas: int = 1, seed: int = 0, *,
              tokens_per_request: int = 128, requests: int | None = 1, duration_s: float | None = None,
              routing: str = "least-loaded", start_spread_ms: float = 0.0,
              pipeline: PipelineModel | None = None) -> FleetResult:
    """Simulate n_edges edges in one mode, each generating `requests` generations of `tokens_per_request`
    tokens back to back, or generating until `duration_s` of simulated time (then `requests` is ignored).

    start_spread_ms: edges start uniformly within this span (0: all at once, as bench-cloud does).
    pipeline: the edges' pipeline and its hit rate (sim.fleet.pipeline; None: off). A profile whose mode has
    no pipeline (target, draft, sprinter) runs off.
    """
    if duration_s is not None:
        requests = None
    sim = _Simulation(costs, profile, n_edges, n_replicas, seed, tokens_per_request, requests, duration_s,
                      routing, start_spread_ms, pipeline or PipelineModel())
    return sim.run()
