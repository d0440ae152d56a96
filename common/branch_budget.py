"""How many branch tokens a round drafts (`--branch-tokens`): a fixed number, or (auto) what measured costs justify.

    a_1..a_g    the primary chain's acceptance estimates (the call policy's)
    S_i         prod_{j<=i} a_j: the estimated chance the target keeps x_1..x_i
    branch      an alternative at position i and its continuation, L tokens (common/decoding/branching.py)
    gain_i      S_{i-1} * (1 - a_i) * sum_{k=1..L} abar^k: expected extra tokens kept thanks to the branch: the chain
                reaches i, x_i is rejected, and the branch's tokens are kept as the chain's are on average (abar, the
                mean a)
    value       what one kept token is worth, in ms: a round's cost over the tokens it yields,
                (g * t_draft + rtt + t_verify(g)) / (E(g) + 1) (call_policy.goodput's terms)
    cost        L * (t_draft + b): drafting the branch, and the target's cost per extra verified token (b, the
                slope of the cost model's t_verify(g) = a + b*g)

Auto branches at the lowest a_i first and stops at the first branch whose gain * value is below its cost: a long
round trip makes every kept token dear (more branching); a cheap local target makes branching rarely worth it.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.call_policy import CostModel
from common.keep_model import expected_accepted_length

AUTO_MAX_TOKENS = 12  # auto's own cap on branch tokens per round, where the verifier names none


def auto_budget(accept_probs: Sequence[float], cost_model: CostModel, room: int, branch_length: int) -> int:
    """Branch tokens worth drafting after the chain a_1..a_g (module docstring), at most `room`."""
    g = len(accept_probs)
    if g == 0 or room <= 0:
        return 0
    base, per_token = cost_model.verify_line()
    round_ms = g * cost_model.effective_draft_ms + cost_model.rtt_ms + base + per_token * g
    value = round_ms / (expected_accepted_length(accept_probs) + 1.0)
    mean = sum(accept_probs) / g
    survival = [1.0]
    for a in accept_probs:
        survival.append(survival[-1] * a)
    tokens = 0
    for i in sorted(range(g), key=lambda i: (accept_probs[i], i)):
        length = min(branch_length, room - tokens)
        if length < 1:
            break
        gain = survival[i] * (1.0 - accept_probs[i]) * sum(mean ** k for k in range(1, length + 1))
        if gain * value <= length * (cost_model.t_draft_ms + max(per_token, 0.0)):
            break
        tokens += length
    return tokens


def branch_budget(setting: int | str, accept_probs: Sequence[float], cost_model: CostModel | None,
                  room: int | None, branch_length: int) -> int:
    """This round's branch tokens: `setting` N (0: off) within `room` (the verifier's max_tree_tokens less the chain;
    None: no limit), or "auto" (`auto_budget`, within AUTO_MAX_TOKENS)."""
    room = AUTO_MAX_TOKENS if room is None and setting == "auto" else room
    if setting == 0 or (room is not None and room <= 0):
        return 0
    if setting == "auto":
        return auto_budget(accept_probs, cost_model or CostModel(), room, branch_length)
    return setting if room is None else min(int(setting), room)
