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
them (`CostModel.keep`, common/spec/cost_model.py KeepModel): block verification keeps more of a long block than E(g) says.
A drafted token's ms is priced at the better of the block's own goodput and the rate the edge's recent rounds were
planned at (`GoodputPolicy`, common/spec/cost_model.py PlannedRate).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from common.spec.adaptive_policy import parse_adaptive
from common.spec.cost_model import CostModel, expected_accepted_length
from common.spec.round_cost import edge_speculation_rate


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
class GoodputPolicy:
    """Send when one more drafted token is not expected to pay for its time (research.md section 3).

    With s_g = prod_{i<=g} a'_i (the plan's a_i, `CostModel.keep`) and a_{g+1} predicted by `predict_next_accept`,
    drafting token g+1 adds s_g * a_{g+1} expected tokens and delta = t_draft + t_verify(g+1) - t_verify(g) ms. It
    is drafted while
        s_g * a_{g+1} > price * delta,     price = max(goodput(g), planned rate)      tokens per ms
    The price of a ms is what the time would yield elsewhere. goodput(g+1) > goodput(g) holds exactly when
    s_g * a_{g+1} > goodput(g) * delta, so pricing at the block's own rate alone is the one-step look-ahead on goodput;
    but early in a block that rate is low (the round's rtt and verify are shared by few tokens), and the block then
    drafts on through tokens that are unlikely to survive. The renewal-reward optimum (Dinkelbach) prices a ms at the
    long-run rate the edge achieves: the planned rate of its recent rounds (`CostModel.planned_rate`), which takes
    over from the first verdict. A block already doing better than that is the freshest evidence of the local rate,
    hence the max. A larger rtt lowers both rates, which favours longer blocks: a slow link gets longer blocks with
    no retuning.

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
        price = max(goodput(keep_probs, t_draft, rtt, cm.t_verify_ms(g)), cm.planned_rate(self.call_price_ms) or 0.0)
        gain = math.prod(keep_probs) * predict_next_accept(keep_probs)
        return gain <= price * (t_draft + cm.t_verify_ms(g + 1) - cm.t_verify_ms(g))

    def observe_verdict(self, block_length: int, n_accepted: int) -> None:
        # Nothing to adapt here: the edge feeds costs and verdicts to the cost model (its keep model, planned rate).
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
