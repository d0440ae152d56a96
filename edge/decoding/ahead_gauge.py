"""Whether drafting ahead pays, measured: a pipeline runs its rounds as `off` while its guesses miss.

Drafting ahead (edge/decoding/pipeline.py) is free only while the block is in flight. When the verdict
arrives mid-step the round waits for that step to end (the lag), and on a miss the candidates are
thrown away. A hit saves what the next round would have spent: drafting the candidate's tokens,
and with send-ahead, when the cloud verified the sent candidate straight after the verdict, the
link's round trip as well.

    saving per round = P(hit) x saving per hit          cost per round = lag

Each round the gauge decides: draft ahead while the saving covers the cost (`AHEAD_MARGIN` to
spare) and guesses hit at least `MIN_HIT_RATE` of the time (below that, drafting ahead is work
thrown away: the edge's power, the uplink, and a CPU the cloud may share), otherwise run the round as `off`, and still draft ahead every `PROBE_EVERY` rounds so that
a change (another prompt, another link) is noticed. P(hit) is the generation's own count, shrunk
towards the edge's rate for that pipeline and mode (`PRIOR_ROUNDS` pseudo-rounds), so a generation
starts from what the edge has learned; the saving and the lag are the edge's EWMAs. Whether a round
drafts ahead never depends on its own verdict, so the output stays exactly the same (the pipeline
is lossless either way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.spec.cost_model import Ewma

PRIOR_ROUNDS = 4.0  # weight of the edge's hit rate in a generation's estimate, in rounds
PROBE_EVERY = 8  # while drafting ahead does not pay, one round in this many still drafts ahead
AHEAD_MARGIN = 1.2  # the saving must exceed the cost by this factor: a tie is noise, and off is the safe side
MIN_HIT_RATE = 0.1
ALPHA = 0.1  # EWMA weight of the newest round


@dataclass
class AheadRecord:
    """What one edge has measured of one pipeline in one mode, across generations."""

    # Optimistic until measured, and blended from the first round on (n=1): one miss is not a verdict on the edge.
    hit_rate: Ewma = field(default_factory=lambda: Ewma(0.5, ALPHA, 1))
    saving_ms: Ewma = field(default_factory=lambda: Ewma(0.0, ALPHA))  # what a hit would save, measured every round
    lag_ms: Ewma = field(default_factory=lambda: Ewma(0.0, ALPHA))  # per round that drafted ahead

    def snapshot(self) -> dict[str, float]:
        return {"hit_rate": self.hit_rate.value, "saving_ms": self.saving_ms.value, "lag_ms": self.lag_ms.value,
                "rounds": float(self.hit_rate.n - 1)}


@dataclass
class AheadGauge:
    """One generation's decisions, over the edge's record for its pipeline and mode."""

    record: AheadRecord
    adapts: bool = True  # False: draft ahead every round (still measuring), as `--no-pipeline-adapt` asks
    rounds: int = 0  # rounds that drafted ahead in this generation
    hits: int = 0
    rounds_off: int = 0  # rounds run as `off` since the last one that drafted ahead
    skipped: int = 0  # rounds run as `off` in all

    @property
    def hit_rate(self) -> float:
        prior = self.record.hit_rate.value
        return (self.hits + PRIOR_ROUNDS * prior) / (self.rounds + PRIOR_ROUNDS)

    def pays(self) -> bool:
        """Whether drafting ahead is expected to save more than it costs (with no measurement yet, it is tried)."""
        if self.record.lag_ms.n == 0:
            return True
        hit_rate = self.hit_rate
        return hit_rate >= MIN_HIT_RATE and hit_rate * self.record.saving_ms.value >= AHEAD_MARGIN * self.record.lag_ms.value

    def draft_ahead(self) -> bool:
        """This round's decision: draft ahead, or run it as `off`."""
        if not self.adapts or self.pays() or self.rounds_off + 1 >= PROBE_EVERY:
            self.rounds_off = 0
            return True
        self.rounds_off += 1
        self.skipped += 1
        return False

    def observe(self, hit: bool, saving_ms: float, lag_ms: float) -> None:
        """A round that drafted ahead: whether its verdict hit, what a hit saves (ms), how long the verdict waited."""
        self.rounds += 1
        self.hits += hit
        self.record.hit_rate.update(float(hit))
        self.record.lag_ms.update(lag_ms)
        self.record.saving_ms.update(saving_ms)
