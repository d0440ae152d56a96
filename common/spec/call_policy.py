"""Call policies: after each drafted token, draft another or send the pending block to the cloud now.

The edge asks `should_send(accept_probs, cap)` after every drafted token, where accept_probs holds a_1..a_g, the
verifier's calibrated probability that the target accepts each pending token given its prefix. Policies are pure
decisions over floats; `CostModel` learns, from what the edge observes, the costs the goodput policy (and adaptive:
common/spec/adaptive_policy.py) weighs (research.md sections 3 and 6).

Goodput, as a renewal-reward rate (one round = draft g tokens, one round trip, one verification):
    E(g)       = sum_{j<=g} prod_{i<=j} a_i                      expected accepted draft tokens
    goodput(g) = (E(g) + 1) / (g * t_draft + rtt + t_verify(g))  tokens per ms; +1: the target's own token
With a pipeline (edge/decoding/pipeline.py) t_draft is the effective cost: the share of blocks drafted while the
previous block was in flight costs no time of its own. The plan counts the a_i as the cloud has been seen to keep
them (`CostModel.keep`, common/spec/keep_model.py): block verification keeps more of a long block than E(g) says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from common.spec.adaptive_policy import parse_adaptive
from common.spec.keep_model import KeepModel, expected_accepted_length
from common.spec.round_cost import CloudCosts, edge_speculation_rate


def goodput(accept_probs: Sequence[float], t_draft_ms: float, rtt_ms: float, t_verify_ms: float) -> float:
    """Expected tokens emitted per ms of a round that sends the block a_1..a_g; t_verify_ms is t_verify(g): the
    cost model's edge speculation rate (common/spec/round_cost.py), per ms."""
    tokens = expected_accepted_length(accept_probs) + 1.0
    return edge_speculation_rate(tokens, len(accept_probs), t_draft_ms, rtt_ms, t_verify_ms) / 1e3


def predict_next_accept(accept_probs: Sequence[float]) -> float:
    """Estimate a_{g+1} before drafting it: the mean of a_1..a_g in this block.

    Not the last a_g: a low a_g already shrinks the survival product prod_{i<=g} a_i; predicting the
    next token as low too counts the same dip twice and turns goodput back into the stop-at-first-flag
    loop, which measured worse than fixed-K drafting on the real pair (research.md section 6). The
    mean still tracks the block's local difficulty and is less noisy than one verifier score.
    """
    return sum(accept_probs) / len(accept_probs)


class CallPolicy(Protocol):
    @property
    def name(self) -> str: ...

    def describe(self) -> str:
        """The spec `parse_policy` reads back, e.g. 'fixed:5'."""
        ...

    def should_send(self, accept_probs: Sequence[float], cap: int) -> bool:
        """True: send the g = len(accept_probs) pending tokens now. Always True at g >= cap."""
        ...

    def observe_verdict(self, block_length: int, n_accepted: int) -> None:
        """The cloud kept n_accepted of the block_length tokens sent (for policies that adapt)."""
        ...


def _check_verdict(block_length: int, n_accepted: int) -> None:
    if not 0 <= n_accepted <= block_length:
        raise ValueError(f"n_accepted must be in [0, block_length={block_length}], got {n_accepted}")


@dataclass
class FixedPolicy:
    """Plain speculative decoding: send every k tokens."""

    k: int = 5

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"fixed block length must be >= 1, got {self.k}")

    @property
    def name(self) -> str:
        return "fixed"

    def describe(self) -> str:
        return f"fixed:{self.k}"

    def should_send(self, accept_probs: Sequence[float], cap: int) -> bool:
        return len(accept_probs) >= min(self.k, cap)

    def observe_verdict(self, block_length: int, n_accepted: int) -> None:
        _check_verdict(block_length, n_accepted)


@dataclass
class HeuristicPolicy:
    """transformers' "heuristic" schedule for assisted generation (candidate_generator.py).

    Rule: block length k starts at 5; after each verdict, k += 2 if every token sent was accepted (n_accepted ==
    block_length, also when the cap cut the block short, as transformers compares with the candidates actually
    drafted), else k = max(1, k - 1); only `cap` bounds k. The state persists across verdicts (a fresh policy per
    generation gives transformers' "heuristic_transient").
    """

    k: int = 5

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"initial block length must be >= 1, got {self.k}")

    @property
    def name(self) -> str:
        return "heuristic"

    def describe(self) -> str:
        return "heuristic"

    def should_send(self, accept_probs: Sequence[float], cap: int) -> bool:
        return len(accept_probs) >= min(self.k, cap)

    def observe_verdict(self, block_length: int, n_accepted: int) -> None:
        _check_verdict(block_length, n_accepted)
        if block_length == 0:
            return  # nothing was verified: no evidence either way
        self.k = self.k + 2 if n_accepted == block_length else max(1, self.k - 1)


@dataclass
class FlagPolicy:
    """The SPRINTER paper's loop: send at the first token the verifier flags (a_i < threshold)."""

    threshold: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"flag threshold must be in [0, 1], got {self.threshold}")

    @property
    def name(self) -> str:
        return "flag"

    def describe(self) -> str:
        return f"flag:{self.threshold:g}"

    def should_send(self, accept_probs: Sequence[float], cap: int) -> bool:
        # any(), not just the last: the decision stays right even if a caller skips a step.
        return len(accept_probs) >= cap or any(a < self.threshold for a in accept_probs)

    def observe_verdict(self, block_length: int, n_accepted: int) -> None:
        _check_verdict(block_length, n_accepted)


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
class CostModel:
    """Draft, network and verify costs as the edge sees them, learned online with forgetting.

    t_draft and rtt are EWMAs. t_verify(g) = a + b*g is an exponentially weighted least-squares fit
    over (g, verify_ms) with a ridge pull of the slope toward its prior: with 0 observations the
    priors answer; while all observed g are equal (fixed-K drafting) the slope stays at its prior and
    only the intercept is learned; as g varies the data take over. alpha is the weight of the newest
    observation, so a link that slows down shows within a few round trips. `keep` learns the other side
    of a round from the verdicts: how much of a block the cloud keeps (common/spec/keep_model.py).
    """

    prior_draft_ms: float = 20.0
    prior_rtt_ms: float = 0.0
    prior_verify_base_ms: float = 150.0  # a
    prior_verify_per_token_ms: float = 10.0  # b
    alpha: float = 0.25
    slope_prior_weight: float = 1.0  # pseudo-observations (in token^2) behind the prior slope
    keep: KeepModel = field(default_factory=KeepModel)
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
        }


@dataclass
class GoodputPolicy:
    """Send when drafting one more token is not expected to raise goodput (research.md section 3).

    a_{g+1} is predicted by `predict_next_accept`. Under that constant prediction goodput over the
    block length is a concave numerator over an affine denominator, hence unimodal, so the first
    non-increase is the maximum and a one-step look-ahead suffices. A larger rtt inflates every
    denominator alike, which favours longer blocks: a slow link gets longer blocks with no retuning.

    call_price_ms puts a price on a cloud call: the policy plans as if each round took that much longer,
    so it drafts longer blocks and calls less, at some tokens/s (`sprinter verifier replay` traces the
    trade-off). 0: tokens/s alone decides.
    """

    cost_model: CostModel = field(default_factory=CostModel)
    max_block: int = 20  # the reference code's run-length cap
    call_price_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.max_block < 1:
            raise ValueError(f"goodput max block must be >= 1, got {self.max_block}")
        if self.call_price_ms < 0:
            raise ValueError(f"goodput call price must be >= 0 ms, got {self.call_price_ms:g}")

    @property
    def name(self) -> str:
        return "goodput"

    def describe(self) -> str:
        price = f",price={self.call_price_ms:g}" if self.call_price_ms else ""
        return f"goodput:max={self.max_block}{price}"

    def should_send(self, accept_probs: Sequence[float], cap: int) -> bool:
        g = len(accept_probs)
        if g >= min(cap, self.max_block):
            return True
        if g == 0:
            return False
        cm = self.cost_model
        t_draft, rtt = cm.effective_draft_ms, cm.rtt_ms + self.call_price_ms
        keep_probs = cm.keep.keep_probs(accept_probs)
        now = goodput(keep_probs, t_draft, rtt, cm.t_verify_ms(g))
        longer = goodput([*keep_probs, predict_next_accept(keep_probs)], t_draft, rtt, cm.t_verify_ms(g + 1))
        return longer <= now

    def observe_verdict(self, block_length: int, n_accepted: int) -> None:
        # Nothing to adapt here: the edge feeds costs and verdicts to the cost model (and its keep model).
        _check_verdict(block_length, n_accepted)


POLICY_FORMS = ("fixed:K", "heuristic", "flag", "flag:THRESHOLD", "goodput", "goodput:max=N", "goodput:price=MS",
                "goodput:max=N,price=MS", "adaptive", "adaptive:max=N")


def _goodput_options(value: str) -> dict[str, float | int] | None:
    """'max=16,price=500' -> GoodputPolicy's keyword arguments; None when a part is not one of them."""
    names = {"max": ("max_block", int), "price": ("call_price_ms", float)}
    options: dict[str, float | int] = {}
    for part in value.split(","):
        key, eq, n = part.partition("=")
        if key not in names or not eq or names[key][0] in options:
            return None
        name, kind = names[key]
        options[name] = kind(n)
    return options


def parse_policy(spec: str, cost_model: CostModel | None = None) -> CallPolicy:
    """'fixed:5' | 'heuristic' | 'flag' | 'flag:0.5' | 'goodput' | 'goodput:max=16,price=500' | 'adaptive' |
    'adaptive:max=16' -> a policy. cost_model is shared with the caller, which feeds it observations; goodput and
    adaptive (common/spec/adaptive_policy.py) get a fresh one with default priors when none is given.
    """
    kind, sep, value = spec.strip().partition(":")
    try:
        if kind == "fixed" and value:
            return FixedPolicy(int(value))
        if kind == "heuristic" and not sep:
            return HeuristicPolicy()
        if kind == "flag":
            return FlagPolicy(float(value)) if sep else FlagPolicy()
        model = cost_model if cost_model is not None else CostModel()
        if kind == "adaptive" and (adaptive := parse_adaptive(value, model)) is not None:
            return adaptive
        if kind == "goodput":
            if not sep:
                return GoodputPolicy(model)
            options = _goodput_options(value)
            if options is not None:
                return GoodputPolicy(model, **options)
    except ValueError as err:
        raise ValueError(f"bad call policy {spec!r}: {err}; valid forms: {', '.join(POLICY_FORMS)}") from err
    raise ValueError(f"unknown call policy {spec!r}; valid forms: {', '.join(POLICY_FORMS)}")
