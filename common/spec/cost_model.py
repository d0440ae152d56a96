"""What a round costs the edge, what the cloud keeps of a block, and what the edge's rounds were planned to yield:
learned online from what the edge observes.

`CostModel` holds the draft, network and verify costs the call policies weigh (common/spec/call_policy.py goodput,
common/spec/adaptive_policy.py), how much of a block the cloud keeps (`KeepModel`, below) and the rate the edge's
rounds were planned at (`PlannedRate`): the price of a ms that goodput charges a drafted token.

The keep model
    How much of a block the cloud keeps, given the verifier's a_i, as this edge has seen it keep.

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

from common.spec.round_cost import CloudCosts

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


@dataclass
class Ewma:
    """Exponentially weighted mean; the prior stands until the first observation replaces it."""

    value: float
    alpha: float
    n: int = 0

    def update(self, x: float) -> None:
        self.value = x if self.n == 0 else (1.0 - self.alpha) * self.value + self.alpha * x
        self.n += 1


@dataclass
class PlannedRate:
    """The rate the edge's rounds were planned at, with forgetting: a renewal-reward estimate of tokens per ms.

    Each verdict adds the plan of the block it judged: N = E(g) + 1 tokens (the block's a'_i, `KeepModel`;
    +1: the target's own token) over a round of g drafted tokens. With decayed sums n (rounds), sum N and sum g,
        rate = sum N / (sum g * t_draft + n * (rtt + a) + b * sum g)      t_verify(g) = a + b*g
    at the costs the edge knows now. The plan's expectation, not the verdicts' kept runs: under greedy a run is all
    or nothing, and the realised rate swings with every round where the planned one moves with the scores.
    """

    alpha: float = 0.1  # weight of the newest round: about the last ten rounds decide
    rounds: float = field(default=0.0, init=False)
    tokens: float = field(default=0.0, init=False)
    drafted: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"planned rate alpha must be in (0, 1], got {self.alpha}")

    def observe(self, keep_probs: Sequence[float]) -> None:
        """A round sent the block whose tokens the plan counted as a'_1..a'_g."""
        decay = 1.0 - self.alpha
        self.rounds = decay * self.rounds + 1.0
        self.tokens = decay * self.tokens + expected_accepted_length(keep_probs) + 1.0
        self.drafted = decay * self.drafted + len(keep_probs)

    def rate(self, t_draft_ms: float, round_ms: float, verify_per_token_ms: float) -> float | None:
        """Tokens per ms; round_ms: what a round costs besides its tokens (rtt + a). None before the first round."""
        if self.rounds == 0.0:
            return None
        time_ms = self.drafted * (t_draft_ms + verify_per_token_ms) + self.rounds * round_ms
        return self.tokens / time_ms if time_ms > 0 else None


@dataclass
class CostModel:
    """Draft, network and verify costs as the edge sees them, learned online with forgetting.

    t_draft and rtt are EWMAs. t_verify(g) = a + b*g is an exponentially weighted least-squares fit
    over (g, verify_ms) with a ridge pull of the slope toward its prior: with 0 observations the
    priors answer; while all observed g are equal (fixed-K drafting) the slope stays at its prior and
    only the intercept is learned; as g varies the data take over. alpha is the weight of the newest
    observation, so a link that slows down shows within a few round trips. `keep` learns the other side
    of a round from the verdicts: how much of a block the cloud keeps (`KeepModel`); `planned`, the rate
    the edge's rounds were planned at (`PlannedRate`).
    """

    prior_draft_ms: float = 20.0
    prior_rtt_ms: float = 0.0
    prior_verify_base_ms: float = 150.0  # a
    prior_verify_per_token_ms: float = 10.0  # b
    alpha: float = 0.25
    slope_prior_weight: float = 1.0  # pseudo-observations (in token^2) behind the prior slope
    keep: KeepModel = field(default_factory=KeepModel)
    planned: PlannedRate = field(default_factory=PlannedRate)
    _draft: Ewma = field(init=False, repr=False)
    _rtt: Ewma = field(init=False, repr=False)
    _hidden: Ewma = field(init=False, repr=False)  # share of a block drafted behind the previous round trip
    # One more row of a batched draft step (a tree's branches side by side), over a step: 0.1-0.15 measured on a CPU
    # core for the 0.5B draft (torch, ONNX), less on a GPU; 1 where the runtime drafts branches one after another.
    prior_extra_row_share: float = 0.25
    _extra_row: Ewma = field(init=False, repr=False)
    # Decayed sums for the weighted fit: weight, g, v, g*g, g*v.
    _w: float = field(default=0.0, init=False, repr=False)
    _sg: float = field(default=0.0, init=False, repr=False)
    _sv: float = field(default=0.0, init=False, repr=False)
    _sgg: float = field(default=0.0, init=False, repr=False)
    _sgv: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        self._draft = Ewma(self.prior_draft_ms, self.alpha)
        self._rtt = Ewma(self.prior_rtt_ms, self.alpha)
        self._hidden = Ewma(0.0, self.alpha)
        self._extra_row = Ewma(self.prior_extra_row_share, self.alpha)

    def observe_draft_step(self, ms: float) -> None:
        self._draft.update(ms)

    def observe_batched_step(self, ms: float, rows: int) -> None:
        """A batched draft step of `rows` branches took `ms`: what each row past the first cost, over a step."""
        if rows > 1 and self.t_draft_ms > 0:
            self._extra_row.update(max(0.0, ms / self.t_draft_ms - 1.0) / (rows - 1))

    def observe_sequential_rows(self) -> None:
        """The runtime drafted a point's branches one after another: each further row cost a whole step."""
        self._extra_row.update(1.0)

    @property
    def extra_row_share(self) -> float:
        return self._extra_row.value

    def observe_block_sent(self, drafted_ahead: int, block_length: int) -> None:
        """A block went out of which `drafted_ahead` tokens were drafted while the previous one was in flight
        (edge/decoding/pipeline.py): those cost no waiting, so they do not count as drafting time."""
        if block_length > 0:
            self._hidden.update(drafted_ahead / block_length)

    def observe_plan(self, accept_probs: Sequence[float]) -> None:
        """A block whose tokens the verifier scored a_1..a_g went to the cloud: the planned rate counts it as the plan
        saw it (the a'_i of the keep model as it stands). A block drafted without scores says nothing."""
        if accept_probs:
            self.planned.observe(self.keep.keep_probs(accept_probs))

    def observe_verdict(self, accept_probs: Sequence[float], n_accepted: int) -> None:
        """The cloud kept n_accepted of the block scored a_1..a_g: its plan, then the keep model."""
        self.observe_plan(accept_probs)
        self.keep.observe(accept_probs, n_accepted)

    def planned_rate(self, call_price_ms: float = 0.0) -> float | None:
        """Tokens per ms the edge's recent rounds were planned at (`PlannedRate`), each round `call_price_ms` dearer;
        None before the first verdict."""
        a, b = self.verify_line()
        return self.planned.rate(self.effective_draft_ms, self.rtt_ms + call_price_ms + a, b)

    def observe_round_trip(self, total_ms: float, verify_ms: float, block_length: int) -> None:
        """One verify call: total_ms measured at the edge, verify_ms reported by the cloud."""
        # The network's share is what the cloud did not spend verifying; clock noise can make it < 0.
        self._rtt.update(max(0.0, total_ms - verify_ms))
        decay = 1.0 - self.alpha
        g = float(block_length)
        self._w = decay * self._w + 1.0
        self._sg = decay * self._sg + g
        self._sv = decay * self._sv + verify_ms
        self._sgg = decay * self._sgg + g * g
        self._sgv = decay * self._sgv + g * verify_ms

    def observe_rtt(self, ms: float) -> None:
        """A round trip measured outside a verify call (the first round of a cloud-sd stream, less the cloud's time)."""
        self._rtt.update(max(0.0, ms))

    def seed_verify_ms(self, verify_ms: float) -> None:
        """Start t_verify from a cloud's announced verify time instead of the cold prior.

        Only before the first own observation: what this edge measures always wins over an announcement.
        """
        if self._w == 0.0 and verify_ms >= 0.0:
            self.prior_verify_base_ms = verify_ms

    def seed_verify_prior(self, costs: CloudCosts) -> None:
        """Start t_verify(g) = a + b*g from a cloud's cost table (GetInfo): the line through its blocks of g drafted
        tokens (1 + g new tokens) at batch 1; like `seed_verify_ms`, only before the edge's own first verdict."""
        points = [(tokens - 1, ms) for (sessions, tokens), ms in costs.forward_ms.items() if sessions == 1]
        if self._w > 0.0 or len(points) < 2:
            return
        n, sg, sv = len(points), sum(g for g, _ in points), sum(v for _, v in points)
        sxx = sum(g * g for g, _ in points) - sg * sg / n
        b = max(0.0, (sum(g * v for g, v in points) - sg * sv / n) / sxx) if sxx > 0 else 0.0
        self.prior_verify_base_ms, self.prior_verify_per_token_ms = max(0.0, sv / n - b * sg / n), b

    @property
    def t_draft_ms(self) -> float:
        return self._draft.value

    @property
    def rtt_ms(self) -> float:
        return self._rtt.value

    @property
    def hidden_draft_share(self) -> float:
        return self._hidden.value

    @property
    def effective_draft_ms(self) -> float:
        """What one more drafted token costs a round: t_draft, less the share drafted behind a round trip."""
        return self.t_draft_ms * (1.0 - self.hidden_draft_share)

    def verify_line(self) -> tuple[float, float]:
        """(a, b) of t_verify(g) = a + b*g."""
        if self._w == 0.0:
            return self.prior_verify_base_ms, self.prior_verify_per_token_ms
        mean_g, mean_v = self._sg / self._w, self._sv / self._w
        sxx = self._sgg - self._w * mean_g * mean_g  # weighted scatter of g about its mean
        sxy = self._sgv - self._w * mean_g * mean_v
        lam = self.slope_prior_weight
        # A longer block never verifies faster; a negative slope is noise.
        b = max(0.0, (sxy + lam * self.prior_verify_per_token_ms) / (max(sxx, 0.0) + lam))
        return mean_v - b * mean_g, b

    def t_verify_ms(self, g: float) -> float:
        a, b = self.verify_line()
        return max(0.0, a + b * g)

    def snapshot(self) -> dict[str, float | int]:
        a, b = self.verify_line()
        return {
            "t_draft_ms": self.t_draft_ms,
            "rtt_ms": self.rtt_ms,
            "hidden_draft_share": self.hidden_draft_share,
            "t_verify_base_ms": a,
            "t_verify_per_token_ms": b,
            "draft_steps_observed": self._draft.n,
            "round_trips_observed": self._rtt.n,
            "alpha": self.alpha,
            "rescue_share": self.keep.rescue_share,
            "verdicts_observed": self.keep.verdicts,
            "planned_tokens_per_s": 1e3 * (self.planned_rate() or 0.0),
        }
