"""Branching: a round's primary chain grows alternatives where the target is likeliest to disagree (`--branch-tokens`).

Glossary (speculative_round.py and common/spec/tree/draft_tree.py have the rest)
    primary chain   x_1..x_g, the block the round drafted as it always does (nodes 0..g-1 of the tree)
    branch point    a chain position i whose acceptance estimate a_i is among the lowest: an alternative to x_i is
                    drafted there, a sibling of x_i (same parent: the context and x_1..x_{i-1}); up to
                    MAX_ALTERNATIVES of them before the next point gets any
    alternative     under greedy, the draft's next-best tokens in the row x_i was picked from; under sampling,
                    draws without replacement: each from q_i (the row x_i was drawn from) with the tokens its parent
                    already has (x_i, copies, earlier alternatives) removed and the rest renormalised, a row the
                    node carries (`without`); siblings never repeat a token, and each is a draw from its own row
    branch          an alternative and its continuation by the draft, `branch_length(budget)` tokens at most (a
                    third of the budget, 3 to 8; auto picks its own) and never deeper than the round's limit (a branch beside the chain's
                    last token goes on past the chain's length); its nodes follow the chain's (and earlier
                    branches'), so the first child of any node is on its primary chain and siblings keep the order
                    they were drawn in
    copy branch     a run the suffix index proposes after x_1..x_{i-1} where it differs from x_i: point masses, no
                    draft step (copy_branches.py; proposers suffix and hybrid only). Copies come right after the
                    chain (a copy is its parent's second child, before the draft's alternatives)
    tree block      the chain, the branches, one parent per node and one q row per node (`TreeBlock`)
    budget          branch tokens per round: the user's `--branch-tokens N`, or (auto) what the cost model finds
                    worth sending (common/spec/tree/branch_budget.py), never past the verifier's max_tree_tokens

Exactness (common/spec/tree/multipath_rules.py states the rule's condition and why it holds; this module is built to meet it).
The nodes are drawn in index order, each from the row it carries given everything drawn before it: an alternative
is a draw from q_i without its earlier siblings' tokens, and it carries that row (a function of nodes before it), a
continuation is the draft's chain from there, and a copy is a point mass on a token that the context, the parent's
prefix and what the edge learned before the round determine. Where the edge branches, how many alternatives and
copies and how far each goes depend on the context and the draft's state only (the a_i are the verifier's or the
draft's scores of the draft's own tokens), never on the target or the rule's coins. A point's alternatives are
drawn first, then continued side by side (one batched draft step per token, where the runtime batches): each draw is
fresh and reads its own branch's prefix only, so the nodes' law factors in index order as the rule needs. Then greedy multi-path block verification keeps the output distributed as the target's; under
greedy the tree verdict reads the target's argmax alone, exact for any tree.

Drafting a branch moves the draft's KV off the chain (side by side: the KV keeps the branch point's prefix, and the
rows are copies of it); the next round's `advance_to` keeps the common prefix of what the KV holds and what it is
asked for, and feeds the rest (the draft runtime's rollback), so the output does not depend on it: it costs
refeeding the kept tokens after the branch point.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from common.spec.cost_model import CostModel
from common.spec.tree.draft_tree import ROOT
from common.spec.propose.proposals import MODEL, DraftModel, PendingBlock, ProposedToken

MIN_BRANCH_LENGTH, MAX_BRANCH_LENGTH = 3, 8  # a branch's tokens (alternative and continuation), by the budget
MAX_ALTERNATIVES = 3  # per branch point: the target's token was the draft's 2nd-4th best in 83% of rejections
AUTO = "auto"  # --branch-tokens auto: the cost model's budget (branch_budget.py)


@dataclass(frozen=True)
class TreeBlock:
    """A primary chain with branches: `nodes` (the chain's first, then each branch's) and their `parents`."""

    nodes: PendingBlock
    parents: list[int]
    chain_length: int

    @property
    def chain(self) -> PendingBlock:
        return PendingBlock(self.nodes.drafted[:self.chain_length])

    @property
    def branch_count(self) -> int:
        """Branches: nodes off the chain whose parent is on it (or the root)."""
        return sum(1 for i, parent in enumerate(self.parents[self.chain_length:], self.chain_length)
                   if parent < self.chain_length)

    def tokens_of(self, path: list[int]) -> list[int]:
        return [self.nodes.drafted[n].token for n in path]

    def chain_kept(self, path: list[int]) -> int:
        """How many of the primary chain's tokens a kept path holds (its prefix of nodes 0, 1, 2, ...)."""
        kept = 0
        while kept < len(path) and path[kept] == kept:
            kept += 1
        return kept

    def side_path_won(self, path: list[int]) -> bool:
        """The kept path leaves the chain (a branch's token was kept)."""
        return self.chain_kept(path) < len(path)

    @property
    def copy_tokens(self) -> int:
        """Branch tokens copied from text (copy branches) rather than drafted."""
        return sum(not d.from_model for d in self.nodes.drafted[self.chain_length:])

    def copy_path_won(self, path: list[int]) -> bool:
        """The kept path leaves the chain through a copy branch."""
        kept = self.chain_kept(path)
        return kept < len(path) and not self.nodes.drafted[path[kept]].from_model


def estimate(proposed: ProposedToken) -> float:
    """A chain token's a_i (its q(x) where no verifier scored it): what branch points are ranked by."""
    return proposed.accept_prob if proposed.accept_prob is not None else proposed.probability


def branch_points(chain: PendingBlock, greedy: bool) -> list[int]:
    """Chain positions (0-based) that may get an alternative, lowest a_i first (earlier first on a tie): the draft's own
    tokens with the row they came from (a copied token is a point mass: its draws would all be itself)."""
    usable = [i for i, d in enumerate(chain.drafted)
              if d.from_model and (d.step is not None if greedy else d.p_draft is not None)]
    return lowest_first([estimate(d) for d in chain.drafted], usable)


def lowest_first(estimates: Sequence[float], among: Iterable[int] | None = None) -> list[int]:
    """Positions (`among`, default all) by their estimate, lowest first, earlier first on a tie: the order the edge
    spends a round's branch budget in."""
    return sorted(range(len(estimates)) if among is None else among, key=lambda i: (estimates[i], i))


def alternative(row: torch.Tensor, taken: list[int], greedy: bool,
                generator: torch.Generator) -> tuple[int, torch.Tensor | None] | None:
    """The next sibling of the chain's token at a branch point, where `taken` are the tokens its parent already has
    (the chain's, copies, earlier alternatives), and the row the node carries; None when no token is left.
    Under greedy `row` is the request-shaped logits [V] the chain's token was picked from (`shaped_row`): the best of
    the tokens not taken that the request allows (the node keeps the chain token's row: greedy reads p's argmax only).
    Under sampling `row` is q [V], the chain token's distribution: a draw from q without the taken tokens,
    renormalised, and that row goes with it (`without`), so that siblings never repeat a token and each node is a draw
    from the row it carries (common/spec/tree/multipath_rules.py)."""
    if greedy:
        logits = row.clone()
        logits[taken] = float("-inf")
        best = int(torch.argmax(logits))
        return (best, None) if logits[best] > float("-inf") else None
    rest = without(row, taken)
    if rest is None:
        return None
    return int(torch.multinomial(rest, 1, generator=generator)), rest


def without(q: torch.Tensor, taken: list[int]) -> torch.Tensor | None:
    """q [V] with the `taken` tokens' mass removed and the rest renormalised (None: nothing left)."""
    rest = q.float().clone()
    rest[taken] = 0.0
    mass = float(rest.sum())
    return rest / mass if mass > 0 else None


def shaped_row(model: DraftModel, context: list[int], chain: PendingBlock, position: int) -> torch.Tensor:
    """The logits x_i was picked from under greedy, as the request shapes them (bias, penalties, grammar): what its
    next-best tokens are ranked by, so that an alternative is never a token the request rules out or demotes."""
    logits = chain.drafted[position].step.logits
    if model.processor is None:
        return logits.float()
    return model.processor.next_row(logits, context + chain.tokens[:position]).float()


def alternative_node(chain: PendingBlock, position: int, token: int, q: torch.Tensor | None) -> ProposedToken:
    """A sibling of the chain's token at `position`: drawn from `q` (sampling: the chain token's row without the
    tokens taken before it; greedy: None, it keeps the chain token's row)."""
    p_draft = chain.drafted[position].p_draft if q is None else q
    return replace(chain.drafted[position], token=token, p_draft=p_draft, flagged=False, ends_block=False,
                   accept_prob=None, step=None, fed=0, match_length=0)


def branch_length(budget: int) -> int:
    """Tokens per branch for a round's `budget`: a third of it, within MIN/MAX_BRANCH_LENGTH (6: 2 x 3; 16: 3 x 5)."""
    return max(MIN_BRANCH_LENGTH, min(MAX_BRANCH_LENGTH, budget // MAX_ALTERNATIVES))


def alternative_lengths(position: int, left: int, depth_limit: int, longest: int,
                        count: int | None = None) -> list[int]:
    """The shape of one branch point: the length of each of its alternatives, up to `count` (default
    MAX_ALTERNATIVES), each `longest` tokens at most, within the `left` branch tokens and no node deeper than
    `depth_limit` (chain index `position`: its nodes stand at positions `position`, `position` + 1, ...). Pure, so
    that `sprinter bench tree-shapes` replays the very shape the edge drafts."""
    count = MAX_ALTERNATIVES if count is None else count  # read when called: tests try other widths
    lengths: list[int] = []
    while len(lengths) < count:
        length = min(longest, left - sum(lengths), depth_limit - position)
        if length < 1:
            break
        lengths.append(length)
    return lengths


@dataclass
class BranchPlan:
    """The edge's plan of a round's branches: the branch `points` in turn, each shaped by `alternative_lengths`
    within what is `left` of the budget, until it is spent. The caller `spend`s what each point's branches really
    took (a point may get fewer alternatives, a branch may end at EOS), so that the next point gets the rest. Pure,
    so that `sprinter bench tree-shapes` replays the very plan the edge drafts."""

    points: Sequence[int]
    left: int
    depth_limit: int
    longest: int
    count: int | None = None  # alternatives per point; None: MAX_ALTERNATIVES

    def __iter__(self) -> Iterator[tuple[int, list[int]]]:
        """(chain position, the length of each of its alternatives) for each point until the budget is spent."""
        for position in self.points:
            yield position, alternative_lengths(position, self.left, self.depth_limit, self.longest, self.count)
            if self.left <= 0:
                break

    def spend(self, tokens: int) -> None:
        self.left -= tokens


async def draft_branches(model: DraftModel, context: list[int], chain: PendingBlock, budget: int, depth_limit: int,
                         points: list[int] | None = None, grown: TreeBlock | None = None, length: int | None = None,
                         cost_model: CostModel | None = None) -> TreeBlock:
    """The tree of `chain` (drafted after `context`) with up to `budget` branch tokens: at each branch point in turn
    (`points`, default `branch_points`, lowest a_i first) up to MAX_ALTERNATIVES alternatives, each continued by the
    draft to `length` tokens in all (default `branch_length(budget)`; auto picks its own), no node deeper than
    `depth_limit` (the round's limit). `cost_model` learns what one more row of a batched draft step costs. The budget
    goes to the least trusted position first: the chain is most often rejected there (sprinter's block ends at it),
    and a long branch there keeps more than short ones spread over positions that were kept anyway (measured by
    `sprinter bench tree-shapes`). `grown`: the chain's tree so far (its copy branches), which the draft's branches
    follow."""
    nodes, parents = (list(grown.nodes.drafted), list(grown.parents)) if grown is not None else \
        (list(chain.drafted), list(range(-1, len(chain) - 1)))
    points = branch_points(chain, model.sampling.greedy) if points is None else points
    plan = BranchPlan(points, budget, depth_limit, length or branch_length(budget))
    for position, planned in plan:
        parent = position - 1 if position > 0 else ROOT
        taken = [node.token for node, up in zip(nodes, parents) if up == parent]
        starts, lengths = _alternatives(model, context, chain, position, taken, planned)
        for branch in await _continue(model, context, chain, position, starts, lengths, cost_model):
            for k, node in enumerate(branch):
                parents.append(parent if k == 0 else len(nodes) - 1)
                nodes.append(node)
            plan.spend(len(branch))
    return TreeBlock(PendingBlock(nodes), parents, len(chain))


def _alternatives(model: DraftModel, context: list[int], chain: PendingBlock, position: int, taken: list[int],
                  lengths: list[int]) -> tuple[list[ProposedToken], list[int]]:
    """The alternatives at chain `position` (each drawn without the tokens `taken` there before it), up to one per
    planned branch length in `lengths`, and each one's length."""
    greedy = model.sampling.greedy
    row = shaped_row(model, context, chain, position) if greedy else chain.drafted[position].p_draft
    starts: list[ProposedToken] = []
    for _ in lengths:
        drawn = alternative(row, taken + [s.token for s in starts], greedy, model.generator)
        if drawn is None:  # no token left to draw: the point gets fewer alternatives
            break
        starts.append(alternative_node(chain, position, *drawn))
    return starts, lengths[:len(starts)]


async def _continue(model: DraftModel, context: list[int], chain: PendingBlock, position: int,
                    starts: list[ProposedToken], lengths: list[int],
                    cost_model: CostModel | None) -> list[list[ProposedToken]]:
    """Each alternative in `starts` continued by the draft to its length (fewer at EOS): side by side in one batched
    forward per token where the runtime batches (`BatchedDraftForward`), else one branch after another. Unjudged
    (no verifier scores: branch points are chosen on the chain's). Either way each node is drawn from its own row
    given its prefix, with fresh draws, so the tree's law is the same (common/spec/tree/multipath_rules.py)."""
    branches = [[start] for start in starts]
    prefix = chain.drafted[:position]
    if model.drafts_side_by_side and len(branches) > 1:
        rows = [list(branch) for branch in branches]  # every row grows in step; a finished branch stops taking
        while not all(_done(model, branch, length) for branch, length in zip(branches, lengths)):
            started = time.perf_counter()
            proposed = await model.branch_steps(context, [PendingBlock(prefix + row) for row in rows])
            if cost_model is not None and len(rows[0]) > 1:  # the first call also refed the prefix's last token
                cost_model.observe_batched_step((time.perf_counter() - started) * 1e3, len(rows))
            for branch, length, row, token in zip(branches, lengths, rows, proposed):
                if not _done(model, branch, length):
                    branch.append(token)
                row.append(token)
        return branches
    if cost_model is not None and len(branches) > 1:  # one after another: each further row costs a whole step
        cost_model.observe_sequential_rows()
    for branch, length in zip(branches, lengths):
        while not _done(model, branch, length):
            drafted = PendingBlock(prefix + branch)
            proposed = await model.step(context, drafted, len(drafted) + 1, None, None, to_verify=False)
            branch.append(replace(proposed, source=MODEL, ends_block=False))
    return branches


def _done(model: DraftModel, branch: list[ProposedToken], length: int) -> bool:
    return len(branch) >= length or branch[-1].token in model.eos_token_ids
