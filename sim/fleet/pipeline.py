"""The edge's pipeline (edge/decoding/pipeline.py) in the fleet simulator: its settings and default hit rates.

    off          draft a block, send it, wait for its verdict
    ahead        while a block is in flight the edge drafts the next one for the outcome "all kept + the
                 draft's top guess of the target's bonus token"; on a hit that block is already (partly)
                 drafted: the edge sends it as soon as the verdict is in and the block is done
    send-ahead   the edge drafts candidates for the likeliest verdicts and sends each when done; on a hit
                 whose candidate went out before the verdict came back, the cloud verifies it as soon as
                 its previous forward is done and the candidate has arrived (no round trip in between; it
                 still costs a forward), and the edge gets that verdict about one verify later

A miss behaves like off. Whether a verdict is a hit is drawn with probability `hit_rate`, independently
of the call's (block_length, emitted) pair. Only sd, sd-block and sprinter-exact have a pipeline.

Default hit rate (`default_hit_rate`), from the profile's record when it has one. ASSUMPTIONS, not
measurements: the draft's top guess of the target's bonus token is right as often as a drafted token
is kept (the record's per-token acceptance a = accepted / (accepted + rejections)), and its second
guess, independently, as often again; a rejection candidate hits when the rejection falls where it
was drafted for (the record's likeliest rejection positions, by frequency) and the target's
replacement is the draft's runner-up (again a). So, with f the fraction of fully kept blocks:

    ahead       f x a
    send-ahead  f x (1 - (1 - a)^2)  +  a x (frequency of the (candidates - 2) likeliest rejections)

Without a record: 0.3 for ahead, 0.5 for send-ahead.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from common.spec.modes import PIPELINES
from sim.fleet.costs import ModeProfile

FALLBACK_HIT_RATE = {"off": 0.0, "ahead": 0.3, "send-ahead": 0.5}
BONUS_GUESSES = 2  # send-ahead's candidates after full acceptance (edge/decoding/pipeline.py)


@dataclass(frozen=True)
class PipelineModel:
    """How the simulated edges pipeline their rounds; hit_rate None: `default_hit_rate` of the profile."""

    pipeline: str = "off"
    hit_rate: float | None = None
    candidates: int = 3  # send-ahead's candidates per block in flight (edge/decoding/pipeline.py max_candidates)

    def __post_init__(self) -> None:
        if self.pipeline not in PIPELINES:
            raise ValueError(f"pipeline must be one of {', '.join(PIPELINES)}, not {self.pipeline!r}")
        if self.hit_rate is not None and not 0.0 <= self.hit_rate <= 1.0:
            raise ValueError(f"hit_rate must be within [0, 1], got {self.hit_rate}")
        if self.candidates < 1:
            raise ValueError("candidates must be >= 1")

    def applies_to(self, profile: ModeProfile) -> bool:
        return self.pipeline != "off" and profile.traits.pipelines

    def hit_rate_for(self, profile: ModeProfile) -> float:
        if not self.applies_to(profile):
            return 0.0
        return self.hit_rate if self.hit_rate is not None else default_hit_rate(profile, self.pipeline, self.candidates)


def default_hit_rate(profile: ModeProfile, pipeline: str, candidates: int = 3) -> float:
    """The module docstring's estimate from the profile's (block_length, emitted) record."""
    calls = list(zip(profile.block_lengths, profile.emitted))
    accepted = sum(e - 1 for _, e in calls)
    rejected = [e - 1 for g, e in calls if e <= g]  # the position of each rejection (tokens kept before it)
    if pipeline == "off":
        return 0.0
    if not calls or accepted + len(rejected) == 0:
        return FALLBACK_HIT_RATE[pipeline]
    a = accepted / (accepted + len(rejected))
    full = sum(e == g + 1 for g, e in calls) / len(calls)
    if pipeline == "ahead":
        return full * a
    guesses = min(BONUS_GUESSES, candidates)
    likeliest = Counter(rejected).most_common(max(0, candidates - guesses))
    return min(1.0, full * (1 - (1 - a) ** guesses) + a * sum(n for _, n in likeliest) / len(calls))
