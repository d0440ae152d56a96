"""The adaptive call policy (`--policy adaptive`): verify the budget B that maximises the expected rate of the round.

A request's survival after j drafted tokens is the running product s_j = p_1 * ... * p_j of its acceptance estimates.
The budget is the B that maximises
    rate(B) = (s_1 + ... + s_B + 1) / (B * t_draft + rtt + t_verify(B))     +1: the target's own token
with t_draft, rtt and t_verify(B) from the edge's `CostModel` (common/spec/cost_model.py). The policy answers after
each drafted token, before the next one's estimate exists: past the g drafted tokens the survival goes on falling at
the last estimate p_g (the running product continued). The block goes when g reaches the budget computed so.

Beside goodput (same interface, same costs) it differs on purpose: it reads the estimates raw, with no keep model,
no call price, no planned rate and the last estimate as the next one's; it is the budget rule of vLLM's adaptive
verification, written from its description (issue 58), so that the two can be compared on one edge. (With the last
estimate as its prediction, goodput's old one-step look-ahead made the same decisions as this whole-horizon budget on
every replayed token: docs/benchmarks/verifier.md.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Costs(Protocol):
    """What the budget reads of common/spec/cost_model.py CostModel (kept a protocol: call_policy.py imports this module)."""

    @property
    def effective_draft_ms(self) -> float: ...

    @property
    def rtt_ms(self) -> float: ...

    def t_verify_ms(self, g: int) -> float: ...


def survival(accept_probs: Sequence[float], horizon: int) -> list[float]:
    """s_1..s_horizon: the running product of the estimates, continued at the last estimate past the drafted ones."""
    if not accept_probs:
        raise ValueError("survival needs at least one acceptance estimate")
    survived, product = [], 1.0
    for j in range(horizon):
        product *= accept_probs[j] if j < len(accept_probs) else accept_probs[-1]
        survived.append(product)
    return survived


def round_rate(survived: Sequence[float], budget: int, t_draft_ms: float, rtt_ms: float, t_verify_ms: float) -> float:
    """(s_1 + ... + s_B + 1) / (B * t_draft + rtt + t_verify(B)): expected tokens per ms of a round verifying B tokens."""
    cost = budget * t_draft_ms + rtt_ms + t_verify_ms
    if cost <= 0:
        raise ValueError(f"a round must cost time: B * t_draft + rtt + t_verify(B) = {cost:g} ms at B = {budget}")
    return (sum(survived[:budget]) + 1.0) / cost


def adaptive_budget(accept_probs: Sequence[float], horizon: int, costs: Costs) -> int:
    """The B in 1..horizon with the highest `round_rate` (the smallest such B on a tie)."""
    if horizon < 1:
        raise ValueError(f"the budget's horizon must be >= 1, got {horizon}")
    survived = survival(accept_probs, horizon)
    rates = [round_rate(survived, b, costs.effective_draft_ms, costs.rtt_ms, costs.t_verify_ms(b))
             for b in range(1, horizon + 1)]
    return 1 + max(range(horizon), key=lambda i: (rates[i], -i))


@dataclass
class AdaptivePolicy:
    """Send once the g drafted tokens reach the budget (see the module docstring); at most `max_block` tokens."""

    cost_model: Costs
    max_block: int = 20

    def __post_init__(self) -> None:
        if self.max_block < 1:
            raise ValueError(f"adaptive max block must be >= 1, got {self.max_block}")

    @property
    def name(self) -> str:
        return "adaptive"

    def describe(self) -> str:
        return f"adaptive:max={self.max_block}"

    def should_send(self, accept_probs: Sequence[float], cap: int) -> bool:
        g, horizon = len(accept_probs), min(cap, self.max_block)
        if g >= horizon:
            return True
        if g == 0:
            return False
        return g >= adaptive_budget(accept_probs, horizon, self.cost_model)

    def observe_verdict(self, block_length: int, n_accepted: int) -> None:
        # The costs and the estimates learn elsewhere (the cost model; a margin-logistic verifier): nothing here.
        if not 0 <= n_accepted <= block_length:
            raise ValueError(f"n_accepted must be in [0, block_length={block_length}], got {n_accepted}")


def parse_adaptive(value: str, cost_model: Costs) -> AdaptivePolicy | None:
    """'' or 'max=N' (after 'adaptive:') -> the policy; None when `value` is neither."""
    if not value:
        return AdaptivePolicy(cost_model)
    key, eq, n = value.partition("=")
    return AdaptivePolicy(cost_model, max_block=int(n)) if key == "max" and eq else None
