"""How the emulated link treats each chunk: the link's settings, per-chunk delays, the bandwidth cap.

The proxy (sim.link.proxy) works on the byte stream, not on packets, so it models what TCP shows an
application: bytes are late, slow or stalled, never lost or reordered. Each chunk the proxy reads in
one direction is delivered at

    max(previous chunk's delivery, arrival + delay + jitter + stall) + serialisation time

so jitter can bunch chunks up but never reorder them, and a stall holds back everything behind it
(head-of-line blocking). Random draws are seeded per connection and direction, so the same seed
gives the same per-chunk delay sequence (chunk boundaries follow TCP reads and may differ).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

JitterDistribution = Literal["normal", "pareto"]
Direction = Literal["up", "down"]  # up: client -> upstream (edge -> cloud); down: the answers

# A fixed burst rather than one RTT's worth: it does not depend on the delay (one RTT is nothing at
# delay 0), it is about a TCP initial window (10 segments), and it keeps every transfer but the
# smallest messages paced by the rate, as netem's `rate` (no burst at all) paces kernel mode.
BURST_BYTES = 16 * 1024
MIN_RTO_MS = 200.0  # Linux's TCP_RTO_MIN
# Shape 3: a heavy tail that still has a finite variance, so `jitter_ms` can be its standard deviation.
PARETO_SHAPE = 3.0


@dataclass(frozen=True)
class LinkSettings:
    """One link, the same in both directions.

    `jitter_ms` is extra queueing delay on top of `delay_ms` (never below it):
    - "normal": |N(0, jitter_ms)|, a normal truncated at 0 extra (mean 0.8 * jitter_ms);
    - "pareto": a Lomax (Pareto II) with shape 3 and standard deviation jitter_ms (mean 0.58 *
      jitter_ms): mostly small, now and then several times jitter_ms, like a congested path.
    `bandwidth_mbps` caps each direction with a token bucket (burst BURST_BYTES); None: unlimited.
    `loss` is the probability that a chunk suffers a retransmission stall of `rto_ms`: TCP does not
    lose bytes, it waits for the retransmission timeout.
    `disconnects`: (at_s, duration_s) pairs, seconds since the proxy started: at at_s every open
    connection is reset, and new ones are refused until at_s + duration_s.
    `delay_changes`: (at_s, delay_ms) pairs: from at_s on, the one-way delay is delay_ms (a link whose RTT
    changes mid-run: placement and policies must follow it). Chunks already on the way keep their delivery.
    """

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    jitter_distribution: JitterDistribution = "normal"
    bandwidth_mbps: float | None = None
    loss: float = 0.0
    disconnects: tuple[tuple[float, float], ...] = ()
    seed: int = 0
    delay_changes: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("delay_ms", "jitter_ms"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.jitter_distribution not in ("normal", "pareto"):
            raise ValueError(f"jitter_distribution must be 'normal' or 'pareto', got {self.jitter_distribution!r}")
        if self.bandwidth_mbps is not None and not (math.isfinite(self.bandwidth_mbps) and self.bandwidth_mbps > 0):
            raise ValueError(f"bandwidth_mbps must be a finite number > 0 or None (unlimited), got {self.bandwidth_mbps!r}")
        if not 0.0 <= self.loss <= 1.0:
            raise ValueError(f"loss is a probability per chunk, in [0, 1], got {self.loss!r}")
        windows = tuple((float(at), float(duration)) for at, duration in self.disconnects)
        for at, duration in windows:
            if not (math.isfinite(at) and at >= 0 and math.isfinite(duration) and duration > 0):
                raise ValueError(f"a disconnect is (at_s >= 0, duration_s > 0), got {(at, duration)!r}")
        object.__setattr__(self, "disconnects", windows)  # lists and ints in, one canonical form out
        changes = tuple(sorted((float(at), float(delay)) for at, delay in self.delay_changes))
        for at, delay in changes:
            if not (math.isfinite(at) and at >= 0 and math.isfinite(delay) and delay >= 0):
                raise ValueError(f"a delay change is (at_s >= 0, delay_ms >= 0), got {(at, delay)!r}")
        object.__setattr__(self, "delay_changes", changes)
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    @property
    def rto_ms(self) -> float:
        """The stall of one lost chunk: TCP's retransmission timeout, max(200 ms, 2 RTT)."""
        return rto_ms(self.delay_ms)

    def delay_at(self, elapsed_s: float) -> float:
        """The one-way delay in force `elapsed_s` after the proxy started (the latest change at or before it)."""
        delay = self.delay_ms
        for at, changed in self.delay_changes:
            if at <= elapsed_s:
                delay = changed
        return delay

    def disconnected(self, elapsed_s: float) -> bool:
        return any(at <= elapsed_s < at + duration for at, duration in self.disconnects)


def rto_ms(delay_ms: float) -> float:
    """TCP's retransmission timeout on a link of one-way delay `delay_ms`: max(200 ms, 2 RTT)."""
    return max(MIN_RTO_MS, 2 * (2 * delay_ms))


@dataclass(frozen=True)
class ChunkDelay:
    """The one-way latency drawn for one chunk."""

    delay_ms: float
    jitter_ms: float
    stall_ms: float

    @property
    def total_ms(self) -> float:
        return self.delay_ms + self.jitter_ms + self.stall_ms


class DelaySampler:
    """Draws per-chunk latencies for one direction of one connection."""

    def __init__(self, settings: LinkSettings, rng: random.Random) -> None:
        self.settings = settings
        self.rng = rng

    @classmethod
    def for_direction(cls, settings: LinkSettings, connection: int, direction: Direction) -> DelaySampler:
        # A string seed is hashed with SHA-512: stable across runs and Python processes.
        return cls(settings, random.Random(f"{settings.seed}:{connection}:{direction}"))

    def sample(self, delay_ms: float | None = None) -> ChunkDelay:
        """One chunk's latency; `delay_ms`: the delay in force now (a changed one), else the settings'."""
        s = self.settings
        delay = s.delay_ms if delay_ms is None else delay_ms
        # Both draws happen whatever the settings, so changing `loss` does not shift the jitter sequence.
        if s.jitter_distribution == "normal":
            jitter = abs(self.rng.gauss(0.0, s.jitter_ms))
        else:
            lomax_std = math.sqrt(PARETO_SHAPE / ((PARETO_SHAPE - 1) ** 2 * (PARETO_SHAPE - 2)))
            jitter = s.jitter_ms / lomax_std * (self.rng.paretovariate(PARETO_SHAPE) - 1.0)
        stalled = self.rng.random() < s.loss
        return ChunkDelay(delay, jitter, rto_ms(delay) if stalled else 0.0)


class TokenBucket:
    """Serialisation time of each chunk at `rate` bytes/s, after a burst that passes at once."""

    def __init__(self, rate_bytes_per_s: float, burst_bytes: int = BURST_BYTES) -> None:
        self.rate = rate_bytes_per_s
        self.burst = burst_bytes
        self._tokens = float(burst_bytes)
        self._last = -math.inf

    def take(self, now: float, size: int) -> float:
        """Seconds the chunk of `size` bytes starting at `now` takes to get through."""
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate) - size
        self._last = now
        if self._tokens >= 0:
            return 0.0
        wait = -self._tokens / self.rate
        self._tokens, self._last = 0.0, now + wait
        return wait
