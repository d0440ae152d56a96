"""Fleet-scale discrete-event simulator: N edges (1 to 10,000) sharing M cloud replicas.

    python -m sim.fleet --costs costs.json --profiles profiles.json --edges 1,10,100,1000,10000 \
        --replicas 1,4 --out results/fleet
    python -m sim.fleet --demo --out results/fleet-demo     # illustrative built-in inputs

Each edge loops, one cloud call per round: draft g tokens (g x (draft_step_ms + verifier_ms in the
sprinter modes)), send the block (half an RTT + uplink), queue at its replica, wait for the batched
target forward, get the verdict (half an RTT + downlink), emit. (g, emitted) pairs are drawn from
the mode's recorded profile. `sprinter` streams verifier-passed tokens as they are drafted; the
other modes release a block's tokens when its verdict returns. `target` is the cloud streaming one
token per 1-token forward; `draft` never calls the cloud. Prefill is modelled only when the costs
give prompt_tokens (the session open: one more round trip and a prompt forward in the batch queue).

A replica mirrors `cloud.batcher.Batcher`: sessions are sticky (the KV cache lives on one replica;
a generation is placed on the replica with the fewest open sessions, or round-robin); when idle it
takes the first queued request and gathers more for up to window_ms or until
min(max_batch, open sessions on the replica) are in, so a lone edge never waits out the window.

One heap event per cloud call (its arrival at the replica), one per forward, one per gathering
window and one per generation: the edge's emissions are computed, not simulated, which keeps
10,000 edges x a few hundred tokens to seconds per mode.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import logging
import math
import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from sim.fleet_costs import FleetCosts, ModeProfile, demo_costs, demo_profiles, profiles_from_json, profiles_to_json

log = logging.getLogger(__name__)

_ARRIVE, _DEADLINE, _DONE, _GENERATION = range(4)
ROUTINGS = ("least-loaded", "round-robin")


@dataclass
class FleetResult:
    mode: str
    profile: str
    n_edges: int
    n_replicas: int
    seed: int
    tokens_per_request: int
    requests: int | None
    duration_s: float | None
    routing: str
    tokens: int
    sim_s: float  # simulated time until the last token (or the duration)
    tokens_per_s_mean: float  # per edge: its tokens / the wall time of its generations
    tokens_per_s_p50: float
    fleet_tokens_per_s: float  # all edges' tokens / sim_s
    ttft_ms_p50: float | None
    itl_ms_p50: float | None  # gaps between consecutive tokens of a generation, as the user sees them
    itl_ms_p99: float | None
    # a call from send to verdict, a generation's first including the session open (target: from
    # queueing the token's forward to its arrival at the edge)
    call_ms_p50: float | None
    call_ms_p99: float | None
    request_ms_p50: float | None  # one generation of tokens_per_request tokens
    cloud_utilisation: float  # busy fraction of the replicas over sim_s
    cloud_forwards: int
    cloud_forwards_per_token: float
    cloud_batch_size_mean: float | None  # requests per forward, as the cloud's histogram counts it
    target_calls: int
    target_calls_per_token: float
    tokens_per_call: float | None
    wall_s: float = field(default=0.0, compare=False)  # how long the simulation itself took


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


class _Replica:
    __slots__ = ("batch", "busy", "busy_ms", "calls", "forwards", "gather_id", "gathering", "queue", "sessions")

    def __init__(self) -> None:
        self.queue: deque[tuple[int, int, float]] = deque()  # (edge, tokens in the forward, sent at)
        self.batch: list[tuple[int, int, float]] = []
        self.gathering = False
        self.gather_id = 0
        self.busy = False
        self.sessions = 0  # open generations placed here: the batcher's "demand"
        self.busy_ms = 0.0
        self.forwards = 0
        self.calls = 0


class _Simulation:
    def __init__(self, costs: FleetCosts, profile: ModeProfile, n_edges: int, n_replicas: int, seed: int,
                 tokens_per_request: int, requests: int | None, duration_s: float | None, routing: str,
                 start_spread_ms: float) -> None:
        if n_edges < 1 or n_replicas < 1 or tokens_per_request < 1:
            raise ValueError("n_edges, n_replicas and tokens_per_request must be >= 1")
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, not {routing!r}")
        if (requests is None) == (duration_s is None):
            raise ValueError("give exactly one of requests and duration_s")
        self.costs, self.profile, self.routing, self.seed = costs, profile, routing, seed
        self.n_edges, self.tokens_per_request = n_edges, tokens_per_request
        self.requests, self.duration_s = requests, duration_s
        self.horizon = math.inf if duration_s is None else duration_s * 1e3
        self.step_ms = costs.draft_step_ms + (costs.verifier_ms if profile.uses_verifier else 0.0)
        # the prompt's forward yields the first draft token: it replaces that token's step
        self.prefill_extra_ms = max(0.0, costs.draft_prefill_ms - costs.draft_step_ms) if costs.draft_prefill_ms else 0.0
        self.opens_session = costs.prompt_tokens >= 2  # the cloud prefills prompt[:-1]; the last goes with the first block
        self.calls_record = list(zip(profile.block_lengths, profile.emitted))
        call_rng, rtt_rng, start_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))
        n_record = max(1, len(self.calls_record))
        self.call_draws = _Draws(lambda size: call_rng.integers(0, n_record, size))
        self.rtt_draws = _Draws(lambda size: costs.rtt.sample(rtt_rng, size))
        self.starts = (start_rng.uniform(0, start_spread_ms, n_edges) if start_spread_ms > 0 else np.zeros(n_edges)).tolist()
        self.replicas = [_Replica() for _ in range(n_replicas)]
        self.rr = itertools.count()
        self.heap: list[tuple] = []
        self.seq = itertools.count()
        # per edge
        self.replica_of = [-1] * n_edges
        self.requests_left = [requests if requests is not None else -1 for _ in range(n_edges)]  # -1: until the horizon
        self.remaining = [0] * n_edges  # tokens of the current generation not yet committed to a call
        self.late = [0] * n_edges  # tokens the in-flight call releases when its verdict arrives
        self.down_ms = [0.0] * n_edges  # the in-flight call's way back
        self.opening = [False] * n_edges  # the in-flight request is the session open (prefill), the block waits
        self.pending_n = [0] * n_edges  # tokens of the block waiting for the open
        self.request_start = [0.0] * n_edges
        self.last_emit = [-1.0] * n_edges  # -1: nothing emitted yet in this generation
        self.tokens = [0] * n_edges  # emitted by the horizon
        self.wall_ms = [0.0] * n_edges  # summed generation wall times
        # measurements; ITL gaps of 0 (a block released at once) and of one draft step are only counted
        self.zero_gaps = 0
        self.step_gaps = 0
        self.other_gaps = array("d")
        self.ttft_ms = array("d")
        self.call_ms = array("d")
        self.request_ms = array("d")
        self.calls = 0

    # --- edges ---------------------------------------------------------------------------------

    def _place(self) -> int:
        if self.routing == "round-robin":
            return next(self.rr) % len(self.replicas)
        return min(range(len(self.replicas)), key=lambda r: self.replicas[r].sessions)

    def _generation(self, edge: int, t: float) -> None:
        """A generation ends (its session closes) and, if the edge has more to do, the next one opens."""
        if self.replica_of[edge] >= 0:
            self.replicas[self.replica_of[edge]].sessions -= 1
            self.replica_of[edge] = -1
        if self.requests_left[edge] == 0 or t > self.horizon:
            return
        if self.requests_left[edge] > 0:
            self.requests_left[edge] -= 1
        r = self._place()
        self.replicas[r].sessions += 1
        self.replica_of[edge] = r
        self.remaining[edge] = self.tokens_per_request
        self.request_start[edge] = t
        self.last_emit[edge] = -1.0
        if self.profile.mode == "target":  # one Generate stream; the cloud then loops on its own
            self.calls += 1
            prompt = max(1, self.costs.prompt_tokens)  # the first forward carries the prompt
            arrival = t + 0.5 * self.rtt_draws.next() + self.costs.uplink_ms(prompt)
            heapq.heappush(self.heap, (arrival, next(self.seq), _ARRIVE, r, (edge, prompt, t)))
        else:
            self.opening[edge] = self.opens_session
            self._round(edge, t + self.prefill_extra_ms)

    def _round(self, edge: int, t0: float) -> None:
        """Draft a block from t0 (streaming it in sprinter mode) and send it."""
        rem = self.remaining[edge]
        g, e = self.calls_record[self.call_draws.next()]
        g, e = min(g, rem), min(e, rem)  # the edge drafts no further than the generation's budget
        step = self.step_ms
        early = min(g - 1, e - 1) if self.profile.streams_drafted else 0
        if early > 0:
            last = self.last_emit[edge]
            if last < 0:
                self.ttft_ms.append(t0 + step - self.request_start[edge])
            else:
                self.other_gaps.append(t0 + step - last)
            self.step_gaps += early - 1
            self.last_emit[edge] = t0 + early * step
            if t0 + early * step <= self.horizon:
                self.tokens[edge] += early
            elif step > 0:  # the horizon falls inside the streamed run
                self.tokens[edge] += max(0, min(early, int((self.horizon - t0) // step)))
        self.remaining[edge] = rem - e
        self.late[edge] = e - early
        half_rtt = 0.5 * self.rtt_draws.next()
        self.down_ms[edge] = half_rtt + self.costs.downlink_ms()
        t_send = t0 + g * step
        if t_send <= self.horizon:
            self.calls += 1
        if self.opening[edge]:  # the session opens first: the cloud prefills the prompt but its last token
            self.pending_n[edge] = g + 1
            arrival = t_send + half_rtt + self.costs.uplink_ms(self.costs.prompt_tokens)
            request = (edge, self.costs.prompt_tokens - 1, t_send)
        else:
            arrival = t_send + half_rtt + self.costs.uplink_ms(g)
            # g + 1 tokens: the previous verdict's next token goes into the forward with the block
            request = (edge, g + 1, t_send)
        heapq.heappush(self.heap, (arrival, next(self.seq), _ARRIVE, self.replica_of[edge], request))

    def _verdicts(self, batch: list[tuple[int, int, float]], t: float) -> None:
        for edge, _, t_sent in batch:
            if self.opening[edge]:  # opened: now the block goes up, one more round trip
                self.opening[edge] = False
                half_rtt = 0.5 * self.rtt_draws.next()
                n = self.pending_n[edge]
                arrival = t + self.down_ms[edge] + half_rtt + self.costs.uplink_ms(n - 1)
                self.down_ms[edge] = half_rtt + self.costs.downlink_ms()
                heapq.heappush(self.heap, (arrival, next(self.seq), _ARRIVE, self.replica_of[edge], (edge, n, t_sent)))
                continue
            t_reply = t + self.down_ms[edge]
            self.call_ms.append(t_reply - t_sent)
            late = self.late[edge]
            last = self.last_emit[edge]
            if last < 0:
                self.ttft_ms.append(t_reply - self.request_start[edge])
            else:
                self.other_gaps.append(t_reply - last)
            self.zero_gaps += late - 1
            self.last_emit[edge] = t_reply
            if t_reply <= self.horizon:
                self.tokens[edge] += late
            if self.remaining[edge] == 0:
                self._end_generation(edge, t_reply)
            else:
                self._round(edge, t_reply)

    def _target_tokens(self, replica: _Replica, batch: list[tuple[int, int, float]], t: float) -> None:
        """target mode: each token streams down to its edge; the cloud queues the session's next step at once."""
        down = self.costs.downlink_ms()
        for request in batch:
            edge = request[0]
            last = self.last_emit[edge]
            t_emit = max(t + 0.5 * self.rtt_draws.next() + down, last)  # one stream arrives in order
            self.call_ms.append(t_emit - request[2])
            if last < 0:
                self.ttft_ms.append(t_emit - self.request_start[edge])
            else:
                self.other_gaps.append(t_emit - last)
            self.last_emit[edge] = t_emit
            if t_emit <= self.horizon:
                self.tokens[edge] += 1
            self.remaining[edge] -= 1
            if self.remaining[edge] > 0:
                self.calls += 1
                replica.queue.append((edge, 1, t))
            else:
                self._end_generation(edge, t_emit)

    def _end_generation(self, edge: int, t: float) -> None:
        self.request_ms.append(t - self.request_start[edge])
        self.wall_ms[edge] += t - self.request_start[edge]
        # the session closes (and the next opens) when the edge has the last token: an event at t
        heapq.heappush(self.heap, (t, next(self.seq), _GENERATION, edge, None))

    # --- replicas (mirrors cloud.batcher.Batcher._gather) -------------------------------------

    def _limit(self, replica: _Replica) -> int:
        return max(1, min(self.costs.max_batch, replica.sessions))

    def _arrive(self, r: int, request: tuple[int, int, float], t: float) -> None:
        replica = self.replicas[r]
        replica.queue.append(request)
        if replica.gathering:
            batch, queue, limit = replica.batch, replica.queue, self._limit(replica)
            while len(batch) < limit and queue:
                batch.append(queue.popleft())
            if len(batch) >= limit:
                self._launch(r, t)
        elif not replica.busy:
            self._gather(r, t)

    def _gather(self, r: int, t: float) -> None:
        replica = self.replicas[r]
        queue, limit = replica.queue, self._limit(replica)
        batch = replica.batch = [queue.popleft()]
        while len(batch) < limit and queue:
            batch.append(queue.popleft())
        if len(batch) >= limit or self.costs.window_ms <= 0:
            self._launch(r, t)
            return
        replica.gathering = True
        replica.gather_id += 1
        heapq.heappush(self.heap, (t + self.costs.window_ms, next(self.seq), _DEADLINE, r, replica.gather_id))

    def _deadline(self, r: int, gather_id: int, t: float) -> None:
        replica = self.replicas[r]
        if not replica.gathering or replica.gather_id != gather_id:
            return  # the batch filled up before the window closed
        while len(replica.batch) < self.costs.max_batch and replica.queue:  # whatever is queued joins for free
            replica.batch.append(replica.queue.popleft())
        self._launch(r, t)

    def _launch(self, r: int, t: float) -> None:
        replica = self.replicas[r]
        batch, replica.batch, replica.gathering = replica.batch, [], False
        b = len(batch)
        n = b * max(req[1] for req in batch) if self.costs.padded_batches else sum(req[1] for req in batch)
        duration = self.costs.forward.t_forward_ms(b, n)
        replica.busy = True
        replica.busy_ms += max(0.0, min(duration, self.horizon - t))
        replica.forwards += 1
        replica.calls += b
        heapq.heappush(self.heap, (t + duration, next(self.seq), _DONE, r, batch))

    def _done(self, r: int, batch: list[tuple[int, int, float]], t: float) -> None:
        replica = self.replicas[r]
        replica.busy = False
        if self.profile.mode == "target":
            self._target_tokens(replica, batch, t)
        else:
            self._verdicts(batch, t)
        if replica.queue:
            self._gather(r, t)

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
        if self.profile.mode == "draft":
            self._run_draft()
        else:
            self._run_events()
        return self._result(time.perf_counter() - started)

    def _run_events(self) -> None:
        heap = self.heap
        for edge, start in enumerate(self.starts):
            heapq.heappush(heap, (start, next(self.seq), _GENERATION, edge, None))
        handlers = {_ARRIVE: self._arrive, _DEADLINE: self._deadline, _DONE: self._done}
        while heap:
            t, _, kind, a, b = heapq.heappop(heap)
            if t > self.horizon:
                break
            if kind == _GENERATION:
                self._generation(a, t)
            else:
                handlers[kind](a, b, t)

    def _itl_percentiles(self) -> tuple[float | None, float | None]:
        values = np.concatenate([[0.0, self.step_ms], np.frombuffer(self.other_gaps, dtype=float)])
        counts = np.concatenate([[self.zero_gaps, self.step_gaps], np.ones(len(self.other_gaps))])
        if counts.sum() == 0:
            return None, None
        order = np.argsort(values, kind="stable")
        values, cumulative = values[order], np.cumsum(counts[order])
        return tuple(float(values[np.searchsorted(cumulative, round(q * (cumulative[-1] - 1)), side="right")])
                     for q in (0.5, 0.99))

    def _result(self, wall_s: float) -> FleetResult:
        tokens = sum(self.tokens)
        if math.isinf(self.horizon):
            sim_ms = max(self.last_emit)
            wall = np.asarray(self.wall_ms)
        else:
            sim_ms = self.horizon
            wall = self.horizon - np.asarray(self.starts)
        per_edge = np.asarray(self.tokens) / np.maximum(wall, 1e-9) * 1e3
        itl_p50, itl_p99 = self._itl_percentiles()
        forwards = sum(r.forwards for r in self.replicas)
        batched = sum(r.calls for r in self.replicas)
        busy_ms = sum(r.busy_ms for r in self.replicas)
        return FleetResult(
            mode=self.profile.mode, profile=self.profile.name, n_edges=self.n_edges, n_replicas=len(self.replicas),
            seed=self.seed, tokens_per_request=self.tokens_per_request, requests=self.requests,
            duration_s=self.duration_s, routing=self.routing,
            tokens=tokens, sim_s=sim_ms / 1e3,
            tokens_per_s_mean=float(per_edge.mean()), tokens_per_s_p50=float(np.median(per_edge)),
            fleet_tokens_per_s=tokens / sim_ms * 1e3 if sim_ms > 0 else 0.0,
            ttft_ms_p50=_percentile(self.ttft_ms, 0.5), itl_ms_p50=itl_p50, itl_ms_p99=itl_p99,
            call_ms_p50=_percentile(self.call_ms, 0.5), call_ms_p99=_percentile(self.call_ms, 0.99),
            request_ms_p50=_percentile(self.request_ms, 0.5),
            cloud_utilisation=busy_ms / (len(self.replicas) * sim_ms) if sim_ms > 0 else 0.0,
            cloud_forwards=forwards, cloud_forwards_per_token=forwards / tokens if tokens else 0.0,
            cloud_batch_size_mean=batched / forwards if forwards else None,
            target_calls=self.calls, target_calls_per_token=self.calls / tokens if tokens else 0.0,
            tokens_per_call=tokens / self.calls if self.calls else None, wall_s=wall_s)


def _percentile(values: array, q: float) -> float | None:
    """Nearest rank, as common.stats does, so simulated and measured percentiles compare."""
    if not len(values):
        return None
    ordered = np.sort(np.frombuffer(values, dtype=float))
    return float(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))])


def run_fleet(costs: FleetCosts, profile: ModeProfile, n_edges: int, n_replicas: int = 1, seed: int = 0, *,
              tokens_per_request: int = 128, requests: int | None = 1, duration_s: float | None = None,
              routing: str = "least-loaded", start_spread_ms: float = 0.0) -> FleetResult:
    """Simulate n_edges edges in one mode, each generating `requests` generations of `tokens_per_request`
    tokens back to back, or generating until `duration_s` of simulated time (then `requests` is ignored).

    start_spread_ms: edges start uniformly within this span (0: all at once, as bench-cloud does).
    """
    if duration_s is not None:
        requests = None
    sim = _Simulation(costs, profile, n_edges, n_replicas, seed, tokens_per_request, requests, duration_s,
                      routing, start_spread_ms)
    return sim.run()


def compare_with_measured(predicted: FleetResult, measured: dict, tolerance: float = 0.15) -> dict:
    """Relative errors (predicted - measured) / measured of tokens_per_s and target_calls_per_token.

    `measured` uses the design's names, e.g. a DecodeStats dict or a bench row; tokens_per_s is
    compared with the simulated per-edge mean. `within_tolerance` is True when every error is within it.
    """
    pairs = {"tokens_per_s": predicted.tokens_per_s_mean, "target_calls_per_token": predicted.target_calls_per_token}
    report: dict = {}
    for name, value in pairs.items():
        if measured.get(name):
            report[name] = {"predicted": value, "measured": measured[name],
                            "rel_error": (value - measured[name]) / measured[name]}
    report["tolerance"] = tolerance
    report["within_tolerance"] = bool(report) and all(abs(v["rel_error"]) <= tolerance
                                                      for v in report.values() if isinstance(v, dict))
    return report


# --- sweep and report --------------------------------------------------------------------------

def sweep(costs: FleetCosts, profiles: list[ModeProfile], edges: list[int], replicas: list[int], seed: int = 0,
          progress: bool = True, **run_kwargs: object) -> list[FleetResult]:
    """Every profile x replica count x edge count; `run_kwargs` go to run_fleet."""
    grid = [(p, m, n) for p in profiles for m in replicas for n in edges]
    results = []
    for profile, m, n in tqdm(grid, desc="fleet", disable=not progress):
        results.append(run_fleet(costs, profile, n, m, seed, **run_kwargs))
        log.debug("%s N=%d M=%d: %.1f s", profile.name, n, m, results[-1].wall_s)
    return results


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(results: list[FleetResult]) -> str:
    lines = [("| mode | edges | replicas | tokens/s per edge (mean) | p50 | fleet tokens/s | ITL p50 ms | ITL p99 ms "
             "| cloud utilisation | forwards/token | mean cloud batch | target calls/token | simulator runtime s |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.profile} | {r.n_edges} | {r.n_replicas} | {_fmt(r.tokens_per_s_mean, 2)} | "
                     f"{_fmt(r.tokens_per_s_p50, 2)} | {_fmt(r.fleet_tokens_per_s)} | {_fmt(r.itl_ms_p50)} | "
                     f"{_fmt(r.itl_ms_p99)} | {r.cloud_utilisation:.2f} | {r.cloud_forwards_per_token:.3f} | "
                     f"{_fmt(r.cloud_batch_size_mean, 2)} | {r.target_calls_per_token:.3f} | {r.wall_s:.1f} |")
    return "\n".join(lines)


def plot(results: list[FleetResult], out: Path, title: str = "") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    charts = [("tokens_per_s_mean", "tokens/s per edge", "tokens_per_s.png", True),
              ("itl_ms_p99", "ITL p99 (ms)", "itl_p99.png", True),
              ("cloud_utilisation", "cloud utilisation (busy fraction)", "cloud_utilisation.png", False)]
    profiles = list(dict.fromkeys(r.profile for r in results))
    replica_counts = sorted({r.n_replicas for r in results})
    styles = ["-", "--", ":", "-."]
    paths = []
    for metric, label, name, log_y in charts:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, profile in enumerate(profiles):
            for j, m in enumerate(replica_counts):
                series = sorted((r for r in results if r.profile == profile and r.n_replicas == m), key=lambda r: r.n_edges)
                if metric == "cloud_utilisation" and series and series[0].mode == "draft":
                    continue  # no cloud
                ys = [getattr(r, metric) for r in series]
                if not series or all(y is None for y in ys):
                    continue
                ax.plot([r.n_edges for r in series], [math.nan if y is None else y for y in ys],
                        color=f"C{i}", linestyle=styles[j % len(styles)], marker="o", markersize=3,
                        label=f"{profile}, {m} replica{'s' if m > 1 else ''}")
        ax.set_xscale("log")
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel("edges (N)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        if title:
            ax.set_title(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        paths.append(out / name)
    return paths


def write_report(results: list[FleetResult], out: Path, header: str = "", title: str = "") -> None:
    """results.jsonl (one FleetResult per line), table.md (header first) and three PNG plots (titled)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "w") as f:
        f.writelines(json.dumps(asdict(r)) + "\n" for r in results)
    (out / "table.md").write_text((header + "\n\n" if header else "") + format_table(results) + "\n")
    plot(results, out, title)


def compare_all(results: list[FleetResult], measured_rows: list[dict], tolerance: float = 0.15) -> list[dict]:
    """Each measured row {"mode" or "profile", "edges", "replicas" (1), tokens_per_s, target_calls_per_token}
    against the matching simulated run."""
    rows = []
    for m in measured_rows:
        name = m.get("profile", m.get("mode"))
        match = next((r for r in results if r.profile == name and r.n_edges == m.get("edges", 1)
                      and r.n_replicas == m.get("replicas", 1)), None)
        if match is None:
            log.warning("no simulated run for measured row %s", m)
            continue
        rows.append({"profile": name, "edges": match.n_edges, "replicas": match.n_replicas}
                    | compare_with_measured(match, m, tolerance))
    return rows


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--costs", type=Path, help="FleetCosts JSON (default with --demo: illustrative built-in)")
    parser.add_argument("--profiles", type=Path, help="mode profiles JSON (default with --demo: illustrative built-in)")
    parser.add_argument("--demo", action="store_true", help="use the built-in ILLUSTRATIVE costs/profiles for what is not given")
    parser.add_argument("--modes", help="comma-separated profile names to run (default: all)")
    parser.add_argument("--edges", default="1,10,100,1000,10000")
    parser.add_argument("--replicas", default="1,4")
    parser.add_argument("--tokens-per-request", type=int, default=128)
    parser.add_argument("--requests", type=int, default=1, help="generations per edge, back to back")
    parser.add_argument("--duration-s", type=float, help="instead of --requests: simulated seconds")
    parser.add_argument("--routing", choices=ROUTINGS, default="least-loaded")
    parser.add_argument("--start-spread-ms", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--measured", type=Path, help="JSON list of measured rows to compare (writes comparison.json)")
    parser.add_argument("--out", type=Path, default=Path("results/fleet"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.demo and (args.costs is None or args.profiles is None):
        parser.error("give --costs and --profiles, or --demo for the illustrative built-in inputs")
    costs = FleetCosts.from_json(args.costs.read_text()) if args.costs else demo_costs()
    profiles = profiles_from_json(args.profiles.read_text()) if args.profiles else demo_profiles()
    if args.modes:
        wanted = args.modes.split(",")
        profiles = [p for p in profiles if p.name in wanted]
    illustrative = args.costs is None or args.profiles is None
    if illustrative:
        log.warning("using ILLUSTRATIVE built-in inputs (derived from measured figures, not a measurement)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "costs.json").write_text(costs.to_json() + "\n")  # the inputs travel with the results
    (args.out / "profiles.json").write_text(profiles_to_json(profiles) + "\n")
    for p in profiles:
        log.info("%s: tokens/call %s", p.name, _fmt(p.tokens_per_call, 2))

    results = sweep(costs, profiles, _int_list(args.edges), _int_list(args.replicas), args.seed,
                    tokens_per_request=args.tokens_per_request, requests=args.requests,
                    duration_s=args.duration_s, routing=args.routing, start_spread_ms=args.start_spread_ms)
    header = ("**ILLUSTRATIVE inputs** (built-in; see costs.json / profiles.json notes), not measured.\n"
              if illustrative else "")
    header += (f"Fleet simulation, seed {args.seed}, {args.tokens_per_request} tokens per generation, "
               + (f"{args.duration_s} s simulated" if args.duration_s else f"{args.requests} generation(s) per edge")
               + f", routing {args.routing}, batching window {costs.window_ms} ms, max batch {costs.max_batch}.")
    write_report(results, args.out, header, "ILLUSTRATIVE inputs (not measured)" if illustrative else "")
    print(format_table(results))
    if args.measured:
        comparison = compare_all(results, json.loads(args.measured.read_text()))
        (args.out / "comparison.json").write_text(json.dumps(comparison, indent=1) + "\n")
        for row in comparison:
            print(f"{row['profile']} N={row['edges']}: within 15%: {row['within_tolerance']}  "
                  + "  ".join(f"{k} {v['rel_error']:+.1%}" for k, v in row.items() if isinstance(v, dict)))
    print(f"\nwrote {args.out}/results.jsonl, table.md, tokens_per_s.png, itl_p99.png, cloud_utilisation.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
