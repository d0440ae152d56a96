"""Block verification over one path or several: its stopping rule, and the verdict on a draft tree.

Applied only through `common.spec.acceptance_rules.decide` (tests/house/test_verdict_home.py). Notation of block verification
(Sun et al., ICLR 2025), as `common.spec.acceptance_rules` uses it, and of the tree (common/spec/tree/draft_tree.py):

    x_1..x_g     a chain's tokens; M_b = p (target), M_s = q (draft): p [g + 1, V], q [g, V]
    p_i          min(p_{i-1} * p(x_i) / q(x_i), 1), p_0 = 1: the capped likelihood ratio of the prefix x_1..x_i
    h_i          the probability of stopping "at least this far": r_i / (r_i + 1 - p_i) with
                 r_i = sum_v (p_i * p_i(v) - q_i(v))^+ for i < g, h_g = p_g
    tau          the LAST position i whose coin eta_i <= h_i (0 when none): x_1..x_tau are kept
    R_tau        the residual after tau: norm((p_tau * p_tau(.) - q_tau(.))^+), or p_g(.) when tau = g
    T            a draft tree: tokens [N], parents [N]; rows p [1 + N, V] and q [N, V] (see draft_tree.py)

Greedy multi-path block verification (GBV; Thomas and Pal, arXiv 2602.16961). The paper's algorithm section was not
reachable from here; this rule is derived from block verification and its successive-residual argument, and its
exactness is tested at the rule level (tests/common/spec/tree/test_multipath_rules.py), not checked line by line against the paper:

    u <- root, P <- p(. | context), C <- the root's children
    loop:
        no child left in C: emit y ~ P, stop
        c <- the first of C; chain <- c and its first-child descendants to a leaf
        block-verify chain against the rows (P, p after c, p after its child, ...) and q's rows: tau, R_tau
        keep chain[:tau]
        tau = len(chain): emit y ~ R_tau (= p after the leaf), stop
        u <- chain[tau - 1] (or stay at u when tau = 0); P <- R_tau; C <- u's children not yet tried

With one path this is block verification itself, coin for coin (the same generator gives the same verdict).

Exactness. Block verification is exact for any draft rows: given its stop (x_1..x_tau), the rest of the output is
R_tau and then the target. Trying an untried child c' of the stopping node, block-verified against the rows
(R_tau, p after c', ...) and the q rows c' and its chain were drawn from, produces exactly that, by block
verification's own exactness, PROVIDED that, given everything the rule has read so far (the nodes it verified and
its coins), c' and its chain are draws from the rows the rule is told. So the output is the target's exactly when:
  - the nodes are drawn in index order, node n from the row q_n it carries, given its parent's prefix and any of the
    nodes before it: a sibling's row need not be its first sibling's (a draw from another q', from q without the
    tokens of the siblings before it, a point mass on a token copied from text: q_n = one-hot of it); never top-k or de-duplicated draws from one row told as that row (those
    are not draws from it);
  - whether node n exists, its parent and its row depend only on the context, the nodes before it and the draft's
    state (and what the edge learned before the round), never on the target's rows or the rule's coins;
  - a branch (a node and its first-child descendants, its primary chain) takes consecutive indices, and the nodes'
    law factors in index order: each node, given every node before it in index order, is a draw from its row,
    whatever later nodes are. So everything the rule reads before trying c' tells nothing about c' beyond its row.
    Drafting each branch whole before the next meets it; so does drafting a point's siblings side by side (the
    alternatives first, then their continuations in step, each draw fresh and reading its own branch's prefix
    only: no node's draw reads a node of a later index);
  - children are tried in index order, the first child continuing its parent's primary chain.
Why the order matters: the rule's state when it tries c' (the kept path, R_tau, its coins) is a function of nodes
before c' and of coins independent of all nodes; c' is, given those nodes, a draw from q_{c'}; the conditional law of
what follows is then R_tau and the target, whatever the earlier nodes were. Under greedy decoding the alternatives
are the draft's next-best tokens (or copies) and the rule reads the target's argmax only: exact for any tree.
"""

from __future__ import annotations

import math

import torch

from common.spec.tree.draft_tree import ROOT, DraftTree
from common.sampling.distributions import sample


def block_stop(draft_tokens: torch.Tensor, p_draft: torch.Tensor, p_target: torch.Tensor,
               generator: torch.Generator) -> tuple[int, torch.Tensor]:
    """Block verification's stop: (tau, R_tau), the tokens kept and the distribution the next one is drawn from.
    Draws its g coins eta_1..eta_g from `generator` and nothing else."""
    g = len(draft_tokens)
    p_t = p_target.double()
    p_d = p_draft.double()
    positions = torch.arange(g)
    log_ratio = (p_t[positions, draft_tokens].log() - p_d[positions, draft_tokens].log()).tolist()

    p = [1.0]  # p_0 = 1; p_i = min(p_{i-1} * M_b(X_i) / M_s(X_i), 1), accumulated in log space
    log_p_i = 0.0
    for i in range(g):
        log_p_i = min(log_p_i + log_ratio[i], 0.0)
        p.append(math.exp(log_p_i))

    h = [0.0]  # h[0] unused: positions are 1-based as in the paper
    for i in range(1, g):
        r_i = torch.clamp(p[i] * p_t[i] - p_d[i], min=0.0).sum().item()
        denominator = r_i + 1.0 - p[i]
        h.append(r_i / denominator if denominator > 0 else 1.0)
    h.append(p[g])

    eta = torch.rand(g, generator=generator, dtype=torch.float64).tolist()
    tau = max((i for i in range(1, g + 1) if eta[i - 1] <= h[i]), default=0)
    if tau == g:
        return g, p_target[g]
    y_mass = torch.clamp(p[tau] * p_t[tau] - p_d[tau], min=0.0)
    return tau, (y_mass / y_mass.sum() if y_mass.sum() > 0 else p_t[tau])


def multipath_block_verify(tree: DraftTree, p_draft: torch.Tensor, p_target: torch.Tensor,
                           generator: torch.Generator) -> tuple[list[int], int]:
    """GBV on `tree` (module docstring): (the kept path as node indices, root to last kept; the token after it).
    p_draft [N, V] and p_target [1 + N, V] as in common/spec/tree/draft_tree.py."""
    _check_rows(tree, p_draft, p_target)
    kept: list[int] = []
    row = p_target[0]  # P: what the token after the kept path must follow
    untried = tree.children(ROOT)
    while untried:
        chain = tree.primary_chain(untried[0])
        rows = torch.stack([row.double()] + [p_target[1 + n].double() for n in chain])
        tau, row = block_stop(torch.tensor([tree.tokens[n] for n in chain]), p_draft[chain], rows, generator)
        if tau == len(chain):
            return kept + chain, sample(row, generator)
        if tau == 0:
            untried = untried[1:]
        else:
            kept += chain[:tau]
            untried = tree.children(chain[tau - 1])[1:]  # chain[tau] is its first child, just rejected
    return kept, sample(row, generator)


def greedy_tree_verdict(tree: DraftTree, target_argmax: list[int]) -> tuple[list[int], int]:
    """The longest path whose every token is the target's argmax after its parent's prefix, then the target's argmax
    after it (the first such path in index order on a tie). target_argmax [1 + N] as the rows of draft_tree.py."""
    if len(target_argmax) != len(tree) + 1:
        raise ValueError(f"a tree of {len(tree)} nodes needs {len(tree) + 1} target argmaxes, got {len(target_argmax)}")
    followed = [False] * len(tree)
    depth = [0] * len(tree)
    best = ROOT
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        on_path = parent == ROOT or followed[parent]
        followed[i] = on_path and token == target_argmax[1 + parent]
        if followed[i]:
            depth[i] = 1 + (depth[parent] if parent != ROOT else 0)
            if best == ROOT or depth[i] > depth[best]:
                best = i
    path = tree.path_to(best)
    return path, target_argmax[1 + best]


def _check_rows(tree: DraftTree, p_draft: torch.Tensor, p_target: torch.Tensor) -> None:
    if p_draft.shape[0] != len(tree) or p_target.shape[0] != len(tree) + 1:
        raise ValueError(f"a tree of {len(tree)} nodes needs q [{len(tree)}, V] and p [{len(tree) + 1}, V], got "
                         f"{list(p_draft.shape)} and {list(p_target.shape)}")
