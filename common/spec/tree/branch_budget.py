"""How many branch tokens a round sends (`--branch-tokens`): a fixed number, or (auto) what measured costs justify.

    a_1..a_g    the primary chain's acceptance estimates (the call policy's)
    S_i         prod_{j<=i} a_j: the estimated chance the target keeps x_1..x_i
    shape       the tree the edge drafts for a budget (common/spec/tree/branching.py): the lowest a_i first, up to
                MAX_ALTERNATIVES alternatives there of L tokens each (an alternative and L - 1 draft steps), then the
                next lowest; L within MIN/MAX_BRANCH_LENGTH, a branch never deeper than the round's limit
    copy        a copied run c_1..c_L offered at position i (common/spec/tree/copy_branches.py), with its own
                estimates ca_1..ca_L (the suffix proposer's calibrated rates); tried before the draft's alternatives
    share_r     the chance that, where x_i is rejected, the target's token is the r-th alternative (RANK_SHARES)
    gain        of the r-th alternative at i: S_{i-1} * (1 - a_i) * share_r * sum_{k<L} abar^k: the chain reaches i,
                x_i is rejected, the target's token is that alternative, and the draft's continuation is kept as the
                chain's tokens are on average (abar, the mean a); times (1 - ca_1) where a copy at i is tried first
                and must fail. A copy's k-th token adds S_{i-1} * (1 - a_i) * prod_{j<=k} ca_j
    value       what one kept token is worth, in ms: a round's cost over the tokens it yields,
                (g * t_draft + rtt + t_verify(g)) / (E(g) + 1) (call_policy.goodput's terms)
    cost        a branch: L * b (the target's cost per extra verified token: the slope of the cost model's
                t_verify(g) = a + b*g) and its L - 1 draft steps, t_draft each for a point's first alternative and
                t_draft * e for each further one (e: what one more row of a batched draft step costs, over a step;
                the edge drafts a point's alternatives side by side, `CostModel.extra_row_share`); a copy: L * b

Auto first takes each copy's tokens while the next one's gain * value exceeds b (copies in the order offered), then,
for each L, the shape's branches in order until the first whose gain * value is below its cost, and keeps the L
whose branches add the most value net of cost: a long round trip makes every kept token dear (more branching); a
cheap local target makes branching rarely worth it; and a slow draft (a CPU edge), where the draft's branches never
pay, may still send copies. Under a fixed N the copies come first, each whole in turn, and the draft's branches get
what is left of N (L from the budget: `common.spec.tree.branching.branch_length`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.spec.cost_model import CostModel
from common.spec.tree.branching import MAX_ALTERNATIVES, MAX_BRANCH_LENGTH, MIN_BRANCH_LENGTH
from common.spec.cost_model import expected_accepted_length

AUTO_MAX_TOKENS = 24  # auto's own cap on branch tokens per round, where the verifier names none
# Where the chain's token was rejected, how often the target's token was the draft's 2nd, 3rd and 4th best: the Qwen
# pair's greedy rounds (`sprinter bench tree-shapes`: 55%, 17%, 11% of 103 rejections). A prior for both
# temperatures: under sampling the alternatives are draws, and the likeliest tokens come first there too.
RANK_SHARES = (0.55, 0.17, 0.11)
CopyOfferEstimates = tuple[int, Sequence[float]]  # a copy offer: its chain position and its tokens' estimates


def _token_value(accept_probs: Sequence[float], cost_model: CostModel) -> float:
    """What one kept token is worth, in ms (module docstring)."""
    g = len(accept_probs)
    base, per_token = cost_model.verify_line()
    round_ms = g * cost_model.effective_draft_ms + cost_model.rtt_ms + base + per_token * g
    return round_ms / (expected_accepted_length(accept_probs) + 1.0)


def _survival(accept_probs: Sequence[float]) -> list[float]:
    survival = [1.0]
    for a in accept_probs:
        survival.append(survival[-1] * a)
    return survival


def auto_budget(accept_probs: Sequence[float], cost_model: CostModel, room: int, depth_limit: int,
                copied_first: Sequence[float] | None = None) -> tuple[int, int]:
    """(draft branch tokens worth drafting after the chain a_1..a_g, their branch length L) as the module docstring
    says, at most `room` tokens, no node deeper than `depth_limit`. `copied_first[i]`: ca_1 of the copy sent at
    position i (0 where none)."""
    g = len(accept_probs)
    if g == 0 or room <= 0:
        return 0, MIN_BRANCH_LENGTH
    value = _token_value(accept_probs, cost_model)
    best = (0.0, 0, MIN_BRANCH_LENGTH)  # (net value, tokens, L)
    for length in range(MIN_BRANCH_LENGTH, MAX_BRANCH_LENGTH + 1):
        net, tokens = _shape_value(accept_probs, cost_model, room, depth_limit, copied_first, value, length)
        best = max(best, (net, tokens, length), key=lambda plan: (plan[0], -plan[1]))
    return best[1], best[2]


def _shape_value(accept_probs: Sequence[float], cost_model: CostModel, room: int, depth_limit: int,
                 copied_first: Sequence[float] | None, value: float, length: int) -> tuple[float, int]:
    """(value net of cost, tokens) of the shape's branches of `length` tokens, in the order the edge drafts them,
    up to the first that does not pay."""
    per_token = max(cost_model.verify_line()[1], 0.0)
    mean = sum(accept_probs) / len(accept_probs)
    survival = _survival(accept_probs)
    net, tokens = 0.0, 0
    for i in sorted(range(len(accept_probs)), key=lambda i: (accept_probs[i], i)):
        missed = 1.0 - (copied_first[i] if copied_first is not None else 0.0)
        for rank, share in enumerate(RANK_SHARES[:MAX_ALTERNATIVES]):
            branch = min(length, room - tokens, depth_limit - i)
            if branch < 1:
                return net, tokens
            gain = survival[i] * (1.0 - accept_probs[i]) * missed * share * sum(mean ** k for k in range(branch))
            steps = (branch - 1) * cost_model.t_draft_ms * (1.0 if rank == 0 else cost_model.extra_row_share)
            cost = branch * per_token + steps
            if gain * value <= cost:
                return net, tokens
            net += gain * value - cost
            tokens += branch
    return net, tokens


def auto_copy_lengths(accept_probs: Sequence[float], offers: Sequence[CopyOfferEstimates], cost_model: CostModel,
                      room: int) -> list[int]:
    """Tokens of each copy offer worth sending (module docstring), at most `room` in all."""
    if not offers:
        return []
    value = _token_value(accept_probs, cost_model)
    per_token = max(cost_model.verify_line()[1], 0.0)
    survival = _survival(accept_probs)
    lengths, left = [], room
    for position, estimates in offers:
        kept = survival[position] * (1.0 - accept_probs[position])  # the copy is read: the chain stopped before x_i
        length = 0
        for estimate in estimates[:max(left, 0)]:
            kept *= estimate
            if kept * value <= per_token:
                break
            length += 1
        lengths.append(length)
        left -= length
    return lengths


@dataclass(frozen=True)
class TreePlan:
    """What a round's tree holds: the tokens of each copy offer, the draft's branch tokens, and their length."""

    copies: list[int]
    budget: int
    branch_length: int | None  # auto's; None: the shape's for the budget (`branch_length`)


def tree_budget(setting: int | str, accept_probs: Sequence[float], offers: Sequence[CopyOfferEstimates],
                cost_model: CostModel | None, room: int | None, depth_limit: int) -> TreePlan:
    """This round's tree: `setting` N (0: off) within `room` (the verifier's max_tree_tokens less the chain; None:
    no limit), or "auto" (within AUTO_MAX_TOKENS). `accept_probs`: one estimate per chain token; `depth_limit`: the
    round's limit, which no branch goes past."""
    room = AUTO_MAX_TOKENS if room is None and setting == "auto" else room
    if setting == 0 or (room is not None and room <= 0):
        return TreePlan([0] * len(offers), 0, None)
    if setting == "auto":
        cost_model = cost_model or CostModel()
        copies = auto_copy_lengths(accept_probs, offers, cost_model, room)
        copied_first = [0.0] * len(accept_probs)
        for (position, estimates), length in zip(offers, copies):
            copied_first[position] = estimates[0] if length else 0.0
        return TreePlan(copies, *auto_budget(accept_probs, cost_model, room - sum(copies), depth_limit, copied_first))
    left = int(setting) if room is None else min(int(setting), room)
    copies = []
    for _, estimates in offers:
        copies.append(min(len(estimates), left))
        left -= copies[-1]
    return TreePlan(copies, left, None)
