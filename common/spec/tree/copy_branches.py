"""Copy branches: the suffix index's proposals as candidate paths of a draft tree (`--branch-tokens` with
`--proposer suffix` or `hybrid`; the draft model alone keeps no suffix index, so `--proposer model` has none).

    copy offer   at chain position i (0: right after the context), the run the suffix index proposes after the
                 context and x_1..x_{i-1} (`Proposer.copy_run`) where its first token differs from x_i: a
                 sibling path of x_i, each token a point mass (p_draft None, source CONTEXT or CACHE) carrying its
                 calibrated a
    length       while the chance that the target keeps the whole run stays above MIN_SURVIVAL, at most
                 COPY_BRANCH_LENGTH, never deeper than the round's limit, and within the round's budget
                 (common/spec/tree/branch_budget.py prices a copy's tokens at the target's cost alone: no draft step)
    order        offers are taken lowest chain estimate first (where the chain likeliest fails, as branch points
                 are); a copy is its parent's second child, after the chain's token and before the draft's
                 alternatives: it costs no draft step, and where text repeats it is the likelier of the two

Exactness (common/spec/tree/multipath_rules.py states the condition): a copy is a draw from the point mass on its token, and
that token, whether it is offered and how long it runs are functions of the context, the parent's prefix, the
chain's own token there and what the edge learned before the round (index, cache, calibration); never of the target
or the rule's coins. The copies are placed right after the chain, each whole, before any draft branch is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.spec.tree.branching import TreeBlock, estimate
from common.spec.tree.draft_tree import ROOT
from common.spec.propose.proposals import PendingBlock, ProposedToken, Proposer

# A copy costs no draft step, only the target's forward over its tokens, so it may run as long as the draft's longest
# branch (MAX_BRANCH_LENGTH); the survival rule ends most runs sooner, and eight keeps one copy within half of a
# 16-token branch budget, so that one repeated passage does not crowd out every other candidate path.
COPY_BRANCH_LENGTH = 8


@dataclass(frozen=True)
class CopyOffer:
    """A copied run on offer as a sibling of the chain's token at `position`."""

    position: int
    run: list[ProposedToken]

    @property
    def estimates(self) -> list[float]:
        return [d.accept_prob for d in self.run]


def copy_offers(proposer: Proposer, context: list[int], chain: PendingBlock, depth_limit: int) -> list[CopyOffer]:
    """The copies the proposer offers along `chain` (drafted after `context`), lowest chain estimate first; none for
    a proposer that keeps no text. No node deeper than `depth_limit`."""
    offers = []
    for position in sorted(range(len(chain)), key=lambda i: (estimate(chain.drafted[i]), i)):
        room = min(COPY_BRANCH_LENGTH, depth_limit - position)
        run = proposer.copy_run(context, chain.tokens[:position], room)
        if run and run[0].token != chain.drafted[position].token:
            offers.append(CopyOffer(position, run))
    return offers


def attach_copies(chain: PendingBlock, offers: list[CopyOffer], lengths: list[int]) -> TreeBlock:
    """The tree of `chain` with the first `lengths[k]` tokens of each offer hung off it, in the offers' order."""
    nodes, parents = list(chain.drafted), list(range(-1, len(chain) - 1))
    for offer, length in zip(offers, lengths):
        for k, node in enumerate(offer.run[:length]):
            parents.append((offer.position - 1 if offer.position > 0 else ROOT) if k == 0 else len(nodes) - 1)
            nodes.append(node)
    return TreeBlock(PendingBlock(nodes), parents, len(chain))
