"""How much of a block the cloud keeps, given the verifier's a_i, as this edge has seen it keep.

Glossary
    a_i        the verifier's probability that the target accepts drafted token i (given its prefix)
    E(g)       sum_{j<=g} prod_{i<=j} a_i: the draft tokens token verification keeps of a block of g
    rho        rescue share: the plan counts token i as kept with a'_i = a_i + rho (1 - a_i)
               (rho < 0: a'_i = a_i (1 + rho), for a verifier that promises more than the cloud keeps)

Why learn rho: E(g) is exact for token verification with a calibrated verifier. Block verification
(Sun et al.) keeps more of a long block: a later token the target likes more than the draft did can
make up for an earlier one it liked less, so a dip does not end the run as surely. The a_i cannot
show that (a_i = min(1, p/q) clips the excess), so the goodput plan undervalued long blocks and
called the cloud more than it had to. The edge sees every verdict, so it fits rho by moment matching:
of a grid of values, the one whose predicted kept tokens, summed over recent verdicts (with
forgetting), come closest to the tokens the cloud actually kept. Under token verification with a
calibrated verifier the fit stays near 0, and the plan is the paper's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

RESCUE_GRID = (-0.3, -0.2, -0.1, 0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6)


def expected_accepted_length(accept_probs: Sequence[float]) -> float:
    """E(g) = sum_{j<=g} prod_{i<=j} a_i: token j counts only if it and every token before it survive."""
    expected, survive = 0.0, 1.0
    for a in accept_probs:
        survive *= a
        expected += survive
    return expected


def rescued(accept_probs: Sequence[float], rho: float) -> list[float]:
    """a'_i: each a_i moved a share rho of the way to 1 (rho >= 0), or scaled by 1 + rho (rho < 0)."""
    if rho >= 0.0:
        return [a + rho * (1.0 - a) for a in accept_probs]
    return [a * (1.0 + rho) for a in accept_probs]


@dataclass
class KeepModel:
    """The rescue share rho this edge's verdicts support; 0 until `min_verdicts` have been seen."""

    alpha: float = 0.02  # weight of the newest verdict: about the last 50 verdicts decide
    min_verdicts: int = 20
    verdicts: int = field(default=0, init=False)  # verdicts observed so far
    _kept: float = field(default=0.0, init=False, repr=False)  # decayed sum of tokens the cloud kept
    _predicted: list[float] = field(default_factory=lambda: [0.0] * len(RESCUE_GRID), init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"keep model alpha must be in (0, 1], got {self.alpha}")

    def observe(self, accept_probs: Sequence[float], n_accepted: int) -> None:
        """A verdict: the cloud kept n_accepted of the block whose tokens the plan saw as a_1..a_g."""
        if not accept_probs:  # a block drafted without a policy's scores says nothing about them
            return
        if not 0 <= n_accepted <= len(accept_probs):
            raise ValueError(f"{n_accepted} tokens accepted of a {len(accept_probs)}-token block")
        decay = 1.0 - self.alpha
        self._kept = decay * self._kept + n_accepted
        for k, rho in enumerate(RESCUE_GRID):
            self._predicted[k] = decay * self._predicted[k] + expected_accepted_length(rescued(accept_probs, rho))
        self.verdicts += 1

    @property
    def rescue_share(self) -> float:
        if self.verdicts < self.min_verdicts:
            return 0.0
        gaps = [abs(predicted - self._kept) for predicted in self._predicted]
        return RESCUE_GRID[gaps.index(min(gaps))]

    def keep_probs(self, accept_probs: Sequence[float]) -> list[float]:
        """The a'_i the goodput plan counts."""
        return rescued(accept_probs, self.rescue_share)
