"""The acceptance rules of the four papers, as pure functions over probability tensors, and the one entry that
applies them (`decide`).

Every rule has the same signature:

    rule(draft_tokens [g], p_draft [g, V], p_target [g + 1, V], generator) -> (n_accepted, next_token)

`p_draft[i]` is the distribution the draft sampled `draft_tokens[i]` from; `p_target[i]` is the
target's distribution at the same position, and `p_target[g]` the one after the whole block. The
first `n_accepted` draft tokens are kept and `next_token` follows them, so one call always yields
`n_accepted + 1` tokens. Under greedy decoding the distributions are one-hot and every lossless rule
reduces to `greedy_verify`.

The verdict, decided in one place: a proposal and the target's rows in, (n_accepted, next_token) out.

    x_1..x_g   the proposal's tokens, drafted after the context
    q          p_draft [g, V]: row i is the distribution x_i was drawn from (a point mass for a copied token)
    q_i(x_i)   the draft's probability of its own token alone (a frame that sends its distributions only when
               the rule rejects: the token rule's residual is then sampled by queries, cloud/residual.py)
    p          p_target [g + 1, V]: the target's rows along the block, after the request's shaping (bias,
               penalties, grammar); row g is the target's distribution after the whole block
    method     the verify method (common/spec/modes.py: token, block, sprinter), or greedy
    verdict    (n_accepted, next_token): keep x_1..x_n, then the target's own token
    T          a draft tree (Proposal.parents; common/spec/tree/draft_tree.py): N nodes, q [N, V], p [1 + N, V]; its
               verdict also names the kept path (Decision.path). Greedy: the longest path the target's argmax follows;
               sampling: greedy multi-path block verification, GBV (common/spec/tree/multipath_rules.py, with its exactness
               condition: where the edge branches depends on the draft alone, each node a draw from its own row)

`decide` is the one entry: no rule is called outside this module (tests/house/test_verdict_home.py). Every place that
turns a block into a verdict calls it and keeps only what is its own, where the rows come from and what it does
with the verdict:

    LocalTarget.verify      common/spec/speculative_round.py   the target in this process
    TargetHost.verify       cloud/target_host.py                   a cloud session's forward, decided by
                                                                   cloud/frames.py `frame_decision`; q from
                                                                   the frame (cloud/frames.py `frame_proposal`)
    CloudSpeculation        cloud/cloud_sd.py                   cloud-sd's forward; q from the cloud's draft
    the engine bench        sim/bench/engine.py                    greedy rows of a packed forward

Under greedy decoding only the rows' argmax is read (`greedy_verdict`), so the engine need not bring back its
logits; sprinter compares the flagged x_g alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from common.spec.tree.draft_tree import DraftTree
from common.spec.modes import VERIFY_METHODS, reads_last_draft_only
from common.spec.tree.multipath_rules import block_stop, greedy_tree_verdict, multipath_block_verify
from common.sampling.distributions import SamplingParams, logits_to_probs, sample

AcceptanceRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator], tuple[int, int]]


def residual(p_target: torch.Tensor, p_draft: torch.Tensor) -> torch.Tensor:
    """norm(max(p_target - p_draft, 0)); p_target itself where the two are equal (never sampled then)."""
    mass = torch.clamp(p_target - p_draft, min=0.0)
    total = mass.sum()
    return mass / total if total > 0 else p_target


def _uniform(generator: torch.Generator) -> float:
    return torch.rand((), generator=generator, dtype=torch.float64).item()


def greedy_verify(draft_tokens: torch.Tensor, p_draft: torch.Tensor, p_target: torch.Tensor,
                  generator: torch.Generator) -> tuple[int, int]:
    """Keep draft tokens while they equal the target's argmax; then emit the target's argmax."""
    target_argmax = p_target.argmax(dim=-1)
    matches = (target_argmax[: len(draft_tokens)] == draft_tokens).long()
    n_accepted = int(matches.cumprod(dim=0).sum().item())
    return n_accepted, int(target_argmax[n_accepted].item())


def greedy_verdict(draft_tokens: list[int], target_argmax: list[int], only_last: bool = False) -> tuple[int, int]:
    """`greedy_verify` (or, with `only_last`, `sprinter_verify` under greedy) from the target's argmaxes [g + 1]
    alone: what the rules compute on one-hot distributions, without building them."""
    if only_last and not draft_tokens:
        raise ValueError("sprinter_verify needs the flagged token: the block is empty")
    n_accepted = len(draft_tokens) - 1 if only_last else 0
    while n_accepted < len(draft_tokens) and draft_tokens[n_accepted] == target_argmax[n_accepted]:
        n_accepted += 1
    return n_accepted, target_argmax[n_accepted]


def token_verify(draft_tokens: torch.Tensor, p_draft: torch.Tensor, p_target: torch.Tensor,
                 generator: torch.Generator) -> tuple[int, int]:
    """Standard speculative sampling: accept x_i with prob min(1, p_t(x_i) / p_d(x_i)), stop at the first rejection."""
    for i, x in enumerate(draft_tokens.tolist()):
        if _uniform(generator) * p_draft[i, x].item() > p_target[i, x].item():
            return i, sample(residual(p_target[i], p_draft[i]), generator)
    return len(draft_tokens), sample(p_target[-1], generator)


def token_acceptances(draft_tokens: list[int], p_draft_of_tokens: list[float], p_target: torch.Tensor,
                      generator: torch.Generator) -> int:
    """`token_verify`'s coins from the draft's probabilities of its own tokens alone: the index of the first
    rejected token, or len(draft_tokens) when all pass. Draws the same uniforms as `token_verify` does."""
    for i, x in enumerate(draft_tokens):
        if _uniform(generator) * p_draft_of_tokens[i] > p_target[i, x].item():
            return i
    return len(draft_tokens)


def residual_candidates(p_target: torch.Tensor, n: int, generator: torch.Generator) -> list[int]:
    """`n` proposals for sampling the residual by rejection: independent draws from the target's row p_target [V]."""
    return torch.multinomial(p_target.float(), n, replacement=True, generator=generator).tolist()


def residual_by_rejection(candidates: list[int], p_target: torch.Tensor, p_draft_of_candidates: list[float],
                          generator: torch.Generator) -> int | None:
    """The first candidate y (drawn from p_target) kept with probability max(0, 1 - p_draft(y) / p_target(y)), or
    None when none is. A kept y is distributed as norm(max(p_target - p_draft, 0)), the token rule's residual,
    exactly: P(propose y and keep it) = p_t(y) * (p_t(y) - p_d(y))^+ / p_t(y). So any number of rounds of this,
    ended by sampling `residual` from the full distribution, samples the residual exactly."""
    for y, q in zip(candidates, p_draft_of_candidates):
        p = p_target[y].item()
        if _uniform(generator) * p < p - q:
            return y
    return None


def block_verify(draft_tokens: torch.Tensor, p_draft: torch.Tensor, p_target: torch.Tensor,
                 generator: torch.Generator) -> tuple[int, int]:
    """Block verification (Sun et al., ICLR 2025): lossless and optimal in tokens per target call.

    p_i is the running (capped) likelihood ratio of the prefix, h_i the probability of stopping
    "at least this far", and tau the LAST position whose coin passes, not the first failure
    (common/spec/tree/multipath_rules.py `block_stop`, which also verifies a draft tree path by path).
    """
    tau, next_distribution = block_stop(draft_tokens, p_draft, p_target, generator)
    return tau, sample(next_distribution, generator)


def sprinter_verify(draft_tokens: torch.Tensor, p_draft: torch.Tensor, p_target: torch.Tensor,
                    generator: torch.Generator) -> tuple[int, int]:
    """SPRINTER (Zhong et al.): the verifier passed x_1..x_{g-1} already; only the flagged x_g is checked.

    The earlier tokens are never checked by the target: that is the approximation, bounded by
    TV(p_target, p_SPRINTER) = eta_FP * TV(p_target, p_draft).
    """
    if len(draft_tokens) == 0:
        raise ValueError("sprinter_verify needs the flagged token: the block is empty")
    last = len(draft_tokens) - 1
    n_accepted, next_token = token_verify(draft_tokens[last:], p_draft[last:], p_target[last:], generator)
    return last + n_accepted, next_token


ACCEPTANCE_RULES: dict[str, AcceptanceRule] = {
    "greedy": greedy_verify,
    "token": token_verify,
    "block": block_verify,
    "sprinter": sprinter_verify,
}

GREEDY = "greedy"  # a method that forces the greedy rule whatever the sampling (verifier data collection)
TREE_METHODS = (GREEDY, "block")  # the methods a draft tree may name: block verification's multi-path form (GBV)


@dataclass(frozen=True)
class Proposal:
    """What the rule reads of a block: its tokens and the distributions they were drawn from."""

    tokens: list[int]  # x_1..x_g
    q_rows: Callable[[int], torch.Tensor] | None = None  # V -> q [g, V] float32; None: greedy, or the scalars below
    q_of_tokens: list[float] | None = None  # q_i(x_i) [g] alone: the token rule's coins, its residual by queries
    parents: list[int] | None = None  # a draft tree's parents (common/spec/tree/draft_tree.py): tokens are its nodes,
    #                                   q [N, V] and the target's rows [1 + N, V]; None: a chain

    def tree(self) -> DraftTree | None:
        return None if self.parents is None else DraftTree(self.tokens, self.parents)


@dataclass(frozen=True)
class Decision:
    n_accepted: int  # x_1..x_n kept
    next_token: int | None  # the target's token after them; None: the token rule rejected x_{n+1} and its
    #                         residual needs the edge's distribution (asked for by queries: cloud/residual.py)
    p_target: torch.Tensor | None = None  # [g + 1, V] the rows the rule read, when the caller asked for them
    path: list[int] | None = None  # a tree proposal's kept nodes, root to last kept (n_accepted of them); None: a chain


def rule_for(method: str, sampling: SamplingParams) -> AcceptanceRule:
    """The rule a verify `method` applies under these sampling settings (common/spec/modes.py's table)."""
    if method == GREEDY:
        return ACCEPTANCE_RULES["greedy"]
    if method not in VERIFY_METHODS:
        raise ValueError(f"unknown verify method {method!r}; expected one of {', '.join(VERIFY_METHODS)}")
    if sampling.greedy and not reads_last_draft_only(method):
        return ACCEPTANCE_RULES["greedy"]  # every lossless rule reduces to it on one-hot distributions
    return ACCEPTANCE_RULES[method]


def decide(proposal: Proposal, method: str, sampling: SamplingParams, generator: torch.Generator | None = None,
           argmax: list[int] | None = None, logits: torch.Tensor | None = None,
           keep_rows: bool = False) -> Decision:
    """The verdict on `proposal` from the target's rows along it: their `argmax` [g + 1] (enough under greedy) or
    their `logits` [g + 1, V] (shaped). `keep_rows`: also return p, the distributions the rule read. The
    `generator` (the session's seeded stream) draws the rule's coins: sampling needs one, greedy reads none.
    A draft tree (`proposal.parents`) has N nodes and rows [1 + N] (common/spec/tree/draft_tree.py): its verdict
    names the kept `path`, by `greedy_tree_verdict` under greedy and GBV (`multipath_block_verify`) under sampling."""
    p_target = logits_to_probs(logits, sampling) if logits is not None and (keep_rows or not sampling.greedy) \
        else None  # [g + 1, V]; a tree's [1 + N, V]
    if (tree := proposal.tree()) is not None:
        if method not in TREE_METHODS:
            raise ValueError(f"verify method {method!r} reads one path: a draft tree is verified by "
                             f"{' or '.join(TREE_METHODS)}")
        if sampling.greedy or method == GREEDY:
            path, next_token = greedy_tree_verdict(tree, logits.argmax(dim=-1).tolist() if argmax is None else argmax)
        elif proposal.q_rows is None:
            raise ValueError("a draft tree under sampling needs the draft's distributions (q_rows)")
        else:
            q = proposal.q_rows(p_target.shape[-1]).to(p_target.dtype)  # [N, V]
            path, next_token = multipath_block_verify(tree, q, p_target, generator)
        return Decision(len(path), next_token, p_target, path)
    if sampling.greedy:
        if argmax is None:
            argmax = logits.argmax(dim=-1).tolist()
        only_last = method != GREEDY and reads_last_draft_only(method)
        return Decision(*greedy_verdict(proposal.tokens, argmax, only_last=only_last), p_target)
    if proposal.q_rows is None:  # the draft's scalars alone: the token rule's coins
        j = token_acceptances(proposal.tokens, proposal.q_of_tokens, p_target, generator)
        next_token = sample(p_target[j], generator) if j == len(proposal.tokens) else None
        return Decision(j, next_token, p_target)
    q = proposal.q_rows(p_target.shape[-1]).to(p_target.dtype)  # [g, V]
    rule = rule_for(method, sampling)
    return Decision(*rule(torch.tensor(proposal.tokens, dtype=torch.long), q, p_target, generator), p_target)
