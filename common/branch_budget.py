"""How many branch tokens a round sends (`--branch-tokens`): a fixed number, or (auto) what measured costs justify.

    a_1..a_g    the primary chain's acceptance estimates (the call policy's)
    S_i         prod_{j<=i} a_j: the estimated chance the target keeps x_1..x_i
    branch      an alternative at position i and its continuation, L tokens (common/decoding/branching.py)
    copy        a copied run c_1..c_L offered at position i (common/decoding/copy_branches.py), with its own
                estimates ca_1..ca_L (the suffix proposer's calibrated rates); tried before the draft's alternative
    gain_i      S_{i-1} * (1 - a_i) * sum_{k=1..L} abar^k: expected extra tokens kept thanks to a branch: the chain
                reaches i, x_i is rejected, and the branch's tokens are kept as the chain's are on average (abar, the
                mean a); times (1 - ca_1) where a copy at i is tried first and must fail before the branch is read.
                A copy's k-th token adds S_{i-1} * (1 - a_i) * prod_{j<=k} ca_j
    value       what one kept token is worth, in ms: a round's cost over the tokens it yields,
                (g * t_draft + rtt + t_verify(g)) / (E(g) + 1) (call_policy.goodput's terms)
    cost        a branch: L * (t_draft + b), drafting it and the target's cost per extra verified token (b, the slope
                of the cost model's t_verify(g) = a + b*g); a copy: L * b, the target's alone (it takes no draft step)

Auto first takes each copy's tokens while the next one's gain * value exceeds b (copies in the order offered), then
branches at the lowest a_i first and stops at the first branch whose gain * value is below its cost: a long round
trip makes every kept token dear (more branching); a cheap local target makes branching rarely worth it; and a slow
draft (a CPU edge), where the draft's branches never pay, may still send copies. Under a fixed N the copies come
first, each whole in turn, and the draft's branches get what is left of N.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.call_policy import CostModel
from common.keep_model import expected_accepted_length

AUTO_MAX_TOKENS = 12  # auto's own cap on branch tokens per round, where the verifier names none
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


def auto_budget(accept_probs: Sequence[float], cost_model: CostModel, room: int, branch_length: int,
                copied_first: Sequence[float] | None = None) -> int:
    """Draft branch tokens worth drafting after the chain a_1..a_g (module docstring), at most `room`.
    `copied_first[i]`: ca_1 of the copy sent at position i (0 where none)."""
    g = len(accept_probs)
    if g == 0 or room <= 0:
        return 0
    value = _token_value(accept_probs, cost_model)
    per_token = cost_model.verify_line()[1]
    mean = sum(accept_probs) / g
    survival = _survival(accept_probs)
    tokens = 0
    for i in sorted(range(g), key=lambda i: (accept_probs[i], i)):
        length = min(branch_length, room - tokens)
        if length < 1:
            break
        missed = 1.0 - (copied_first[i] if copied_first is not None else 0.0)
        gain = survival[i] * (1.0 - accept_probs[i]) * missed * sum(mean ** k for k in range(1, length + 1))
        if gain * value <= length * (cost_model.t_draft_ms + max(per_token, 0.0)):
            break
        tokens += length
    return tokens


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


def tree_budget(setting: int | str, accept_probs: Sequence[float], offers: Sequence[CopyOfferEstimates],
                cost_model: CostModel | None, room: int | None, branch_length: int) -> tuple[list[int], int]:
    """This round's branch tokens: (how many of each copy offer's tokens, the draft's branch tokens). `setting` N
    (0: off) within `room` (the verifier's max_tree_tokens less the chain; None: no limit), or "auto" (within
    AUTO_MAX_TOKENS). `accept_probs`: one estimate per chain token."""
    room = AUTO_MAX_TOKENS if room is None and setting == "auto" else room
    if setting == 0 or (room is not None and room <= 0):
        return [0] * len(offers), 0
    if setting == "auto":
        cost_model = cost_model or CostModel()
        copies = auto_copy_lengths(accept_probs, offers, cost_model, room)
        copied_first = [0.0] * len(accept_probs)
        for (position, estimates), length in zip(offers, copies):
            copied_first[position] = estimates[0] if length else 0.0
        return copies, auto_budget(accept_probs, cost_model, room - sum(copies), branch_length, copied_first)
    left = int(setting) if room is None else min(int(setting), room)
    copies = []
    for _, estimates in offers:
        copies.append(min(len(estimates), left))
        left -= copies[-1]
    return copies, left

