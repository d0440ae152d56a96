"""The one model of what a way of decoding costs, in tokens per second for one user.

Every choice the edge makes about speculation reads it: the goodput call policy (how long a block grows,
common/spec/call_policy.py), placement (where the draft runs, edge/decoding/placement.py) and `--mode auto` (whether
to speculate at all). Each way of decoding is a renewal process whose rate is the tokens a cycle yields over the
time a cycle takes:

    speculating on the edge   E / (gamma * t_draft + rtt + t_verify(gamma) + t_uplink)
                              a round: draft gamma tokens here, one round trip, one verify of 1 + gamma tokens
    streamed from the cloud   T / (rtt + (T / E) * t_round * load)
                              the cloud decodes (target alone: E = 1, t_round = t_decode) or speculates beside the
                              target (cloud-sd: E and t_round its own rounds'); the stream pays the round trip once

E is the tokens a cycle yields (the accepted draft tokens + the target's own), T the request's token budget, and
`load` >= 1 how much the cloud's queue stretches its steps. Every time is in ms and measured: the edge's draft step
and round trip by the edge, the cloud's forward times by the cloud at start (`CloudCosts`, GetInfo's cost table)
and on every verdict and Generate chunk after.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field


def round_rate(tokens_per_round: float, round_ms: float) -> float:
    """Tokens per second of a process that yields `tokens_per_round` every `round_ms`."""
    return 1e3 * tokens_per_round / max(round_ms, 1e-6)


def edge_speculation_rate(tokens_per_round: float, gamma: float, t_draft_ms: float, rtt_ms: float, t_verify_ms: float,
                          t_uplink_ms: float = 0.0) -> float:
    """Tokens/s of speculating on the edge: gamma draft steps here, a round trip and a verify per round."""
    return round_rate(tokens_per_round, gamma * t_draft_ms + rtt_ms + t_verify_ms + t_uplink_ms)


def request_rate(max_tokens: int, tokens_per_round: float, round_ms: float, once_ms: float,
                 load: float = 1.0) -> float:
    """Tokens/s of a request that pays `once_ms` at its start (a stream's round trip), then max_tokens / E rounds of
    `round_ms` each, stretched by `load`."""
    rounds = max_tokens / max(tokens_per_round, 1e-6)
    return 1e3 * max_tokens / max(once_ms + rounds * round_ms * load, 1e-6)


@dataclass(frozen=True)
class CloudCosts:
    """The target's forward times on one cloud, by (sessions in the forward, new tokens each), in ms.

    One new token is a decode step (mode target's cost per token); 1 + k new tokens verify a block of k. The
    cloud times them at start (cloud/cost_table.py) over `context_tokens` of context and reports them in GetInfo.
    """

    context_tokens: int = 0
    forward_ms: Mapping[tuple[int, int], float] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.forward_ms)

    def verify_ms(self, tokens: int, sessions: int = 1) -> float | None:
        """One forward of `tokens` new tokens for each of `sessions`: measured, or interpolated linearly in tokens
        at the nearest measured batch (extrapolated by the last slope past the largest); None: nothing measured."""
        if not self.forward_ms:
            return None
        batches = sorted({s for s, _ in self.forward_ms})
        batch = min(batches, key=lambda s: (abs(s - sessions), s))
        points = sorted((t, ms) for (s, t), ms in self.forward_ms.items() if s == batch)
        sizes = [t for t, _ in points]
        if tokens in sizes:
            return points[sizes.index(tokens)][1]
        if len(points) == 1:
            return points[0][1]
        i = min(max(bisect.bisect_left(sizes, tokens), 1), len(points) - 1)
        (t0, m0), (t1, m1) = points[i - 1], points[i]
        return max(m0 + (m1 - m0) * (tokens - t0) / (t1 - t0), 0.0)

    def decode_ms(self) -> float | None:
        """A decode step at batch 1: what mode target pays per token."""
        return self.verify_ms(1)

    @classmethod
    def from_samples(cls, context_tokens: int, samples: Mapping[tuple[int, int], list[float]]) -> CloudCosts:
        return cls(context_tokens, {key: statistics.median(values) for key, values in samples.items() if values})
