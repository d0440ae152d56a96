"""Greedy decoding rounds replayed over a prompt's trace (tree_traces.py), with a tree of a given shape each round.

Glossary (tree_traces.py has the trace's)
    s            output tokens committed when a round starts (1 after the session's open, which brings the first)
    chain        x_1..x_g: the draft's greedy tokens after output[:s] (the rows while they are the target's, the
                 fork after the first rejection), ended as the edge ends a block: the round's limit, EOS, or the
                 call policy (sprinter-exact's goodput over the a_i, `GoodputPolicy` itself with fixed costs; its
                 keep model learns from the verdicts as the edge's does)
    a_i          the acceptance estimate of x_i: the shipped verifier's score of the draft's features, or the draft's
                 probability of its token (`Scored`)
    rejection j  the chain index (0-based) of the first x_i that is not the target's token; None: all kept
    branch       (position i, rank r, length L): the draft's r-th best token in x_i's row (a sibling of x_i),
                 continued by the draft's argmax for L - 1 tokens; the oracle path's rank is 0: the target's own
                 tokens from j on while the draft ranks each within `oracle_rank`
    shape        how a round places its branch tokens (`TreeShape`)

A round's tree is checked by the rule itself (common.spec.acceptance_rules.decide, the one entry, on the tree's tokens and parents): nodes whose
tokens the trace does not hold (off the target's text, where they can never be followed) carry placeholder tokens.
Whether the branch at j is followed, and how far, is read from the teacher-forced rows: exact under greedy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.spec.acceptance_rules import GREEDY, Proposal, decide
from common.spec.call_policy import CostModel, GoodputPolicy
from common.spec.tree.branching import MAX_ALTERNATIVES as EDGE_ALTERNATIVES
from common.spec.tree.branching import branch_length
from common.spec.tree.draft_tree import ROOT, DraftTree
from common.spec.propose.proposals import ends_block
from common.sampling.distributions import SamplingParams
from sim.bench.tree_traces import DraftTopTokens, PromptTrace

GREEDY_SAMPLING = SamplingParams(temperature=0.0)  # the replay is greedy: the tree rule reads the argmax alone
ROUND_ROBIN_LENGTH = 3  # tokens per branch of the round-robin shape


@dataclass(frozen=True)
class CostPriors:
    """The goodput policy's costs (CostModel priors, never updated here): what decides where a block ends."""

    draft_ms: float = 165.0
    rtt_ms: float = 0.0
    verify_ms: float = 430.0
    verify_per_token_ms: float = 15.0

    def cost_model(self) -> CostModel:
        return CostModel(prior_draft_ms=self.draft_ms, prior_rtt_ms=self.rtt_ms, prior_verify_base_ms=self.verify_ms,
                         prior_verify_per_token_ms=self.verify_per_token_ms)


@dataclass(frozen=True)
class TreeShape:
    """Where and how a round branches.

    kind    chain: no branches; edge: the edge's shape (common/spec/tree/branching.py's `draft_branches`, whose
            `branch_length` and MAX_ALTERNATIVES it reads): at each point in turn, lowest estimate first, up to
            MAX_ALTERNATIVES alternatives of `branch_length(budget)` tokens, within `budget` and the round's limit;
            round-robin: one alternative of ROUND_ROBIN_LENGTH tokens at each point in turn, lowest estimate
            first, then a second alternative at each, ... within `budget`, no node deeper than the chain unless
            `deep`; grid: `alternatives` x `length` at each of the `points` lowest points; oracle-grid: the grid
            at the rejection (it knows where the chain is rejected, not the token); oracle-path: `budget` tokens
            along the target's own text from the rejection (the most any tree of that many draft-ranked tokens can
            keep); nested (oracle-nested): the grid at the lowest estimate (at the rejection), then inside each
            branch `inner_alternatives` x `inner_length` beside the branch's own lowest estimate (its drafted
            tokens', from the rows and forks)
    """

    name: str
    kind: str
    budget: int = 0
    points: int = 1
    alternatives: int = 1
    length: int = 1
    deep: bool = False
    inner_alternatives: int = 0  # nested: alternatives beside the lowest estimate inside each branch
    inner_length: int = 0

    @property
    def tokens(self) -> int:
        """Branch tokens a round spends at most (before the tree's room)."""
        if self.kind in ("grid", "oracle-grid", "nested", "oracle-nested"):
            return self.points * self.alternatives * (self.length + self.inner_alternatives * self.inner_length)
        return self.budget


@dataclass(frozen=True)
class Branch:
    position: int
    rank: int
    length: int


@dataclass(frozen=True)
class RoundRecord:
    start: int
    chain: int  # g
    rejection: int | None  # chain index of the first rejected token
    kept: int  # draft tokens kept (the path's length)
    chain_kept: int
    branch_tokens: int
    lowest: list[int] = field(default_factory=list)  # chain indices by estimate, lowest first (ties: earlier)
    draft_lowest: list[int] = field(default_factory=list)  # ... by the draft's probability of its token
    at_rejection: int = 0  # branch tokens placed beside the rejected token


@dataclass
class Scored:
    """A trace with the acceptance estimate of every row and fork row."""

    trace: PromptTrace
    rows: list[float]
    forks: dict[int, list[float]]


def scored(trace: PromptTrace, estimate: Callable[[Sequence[DraftTopTokens]], list[float]]) -> Scored:
    return Scored(trace, estimate(trace.rows), {j: estimate(rows) for j, rows in trace.forks.items()})


@dataclass
class PromptResult:
    prompt_id: str
    category: str
    tokens: int
    calls: int
    rounds: list[RoundRecord]


def decode(item: Scored, shape: TreeShape, cost_model: CostModel, max_tokens: int, round_cap: int,
           max_tree_tokens: int | None, oracle_rank: int) -> PromptResult:
    """Replay one prompt's generation: the open's token, then rounds until the output is committed."""
    trace = item.trace
    policy = GoodputPolicy(cost_model, max_block=round_cap)
    s, rounds = 1, []
    while s < len(trace.output):
        limit = min(round_cap, max_tokens - s)
        rows, accept_probs, rejection = draft_chain(item, s, limit, policy)
        chain = [row.token for row in rows]
        room = len(chain) + shape.tokens if max_tree_tokens is None else max_tree_tokens
        branches = place(shape, accept_probs, rejection, max(0, room - len(chain)), limit, trace, s, oracle_rank)
        inner = (shape.inner_alternatives, shape.inner_length) if shape.inner_alternatives else None
        left = min(shape.tokens, max(0, room - len(chain))) - sum(b.length for b in branches)
        tree, argmax = build_tree(item, s, chain, branches, inner, left, limit)
        path = decide(Proposal(tree.tokens, parents=tree.parents), GREEDY, GREEDY_SAMPLING, argmax=argmax).path
        chain_kept = next((k for k, node in enumerate(path) if node != k), len(path))
        policy.observe_verdict(len(chain), chain_kept)
        cost_model.keep.observe(accept_probs, chain_kept)
        rounds.append(RoundRecord(s, len(chain), rejection, len(path), chain_kept, len(tree) - len(chain),
                                  sorted(range(len(chain)), key=lambda i: (accept_probs[i], i)),
                                  sorted(range(len(chain)), key=lambda i: (rows[i].probs[0], i)),
                                  sum(b.length for b in branches if b.position == rejection)))
        s += len(path) + 1
    return PromptResult(trace.prompt_id, trace.category, trace.tokens, 1 + len(rounds), rounds)


def draft_chain(item: Scored, s: int, limit: int,
                policy: GoodputPolicy) -> tuple[list[DraftTopTokens], list[float], int | None]:
    """The rows of the chain a round drafts after output[:s] (its tokens their best), its a_i, and its rejection."""
    trace = item.trace
    eos = frozenset(trace.eos_ids)
    chain: list[DraftTopTokens] = []
    accept_probs: list[float] = []
    rejection = None
    while True:
        i = len(chain)
        if rejection is None:
            row, a = trace.rows[s + i], item.rows[s + i]
            if row.token != trace.output[s + i]:
                rejection = i
        else:
            fork = trace.forks[s + rejection]
            if i - rejection - 1 >= len(fork):
                raise ValueError(f"{trace.prompt_id}: the fork at {s + rejection} holds {len(fork)} rows, a chain "
                                 f"needs more: build the traces with more fork tokens")
            row, a = fork[i - rejection - 1], item.forks[s + rejection][i - rejection - 1]
        chain.append(row)
        accept_probs.append(a)
        if ends_block(len(chain), row.token, accept_probs, limit, eos, policy):
            return chain, accept_probs, rejection


def place(shape: TreeShape, accept_probs: list[float], rejection: int | None, room: int, limit: int,
          trace: PromptTrace, s: int, oracle_rank: int) -> list[Branch]:
    """The round's branches under `shape`, within `room` branch tokens and no deeper than the round's limit."""
    g = len(accept_probs)
    lowest = sorted(range(g), key=lambda i: (accept_probs[i], i))
    if shape.kind == "chain" or room <= 0:
        return []
    if shape.kind == "edge":
        return _edge(lowest, min(shape.budget, room), limit)
    if shape.kind == "round-robin":
        return _round_robin(lowest, min(shape.budget, room), g if not shape.deep else limit)
    if shape.kind == "oracle-path":
        if rejection is None:
            return []
        length = 0
        while (length < min(shape.budget, room, limit - rejection) and s + rejection + length < len(trace.output)
               and (trace.rows[s + rejection + length].rank_of(trace.output[s + rejection + length]) or oracle_rank + 1)
               <= oracle_rank):
            length += 1
        return [Branch(rejection, 0, length)] if length else []
    points = lowest[:shape.points] if shape.kind in ("grid", "nested") else \
        ([rejection] if rejection is not None else [])
    first_level = shape.points * shape.alternatives * shape.length
    branches, left = [], min(first_level, room)
    for position in points:
        for nth in range(1, shape.alternatives + 1):
            length = min(shape.length, left, limit - position)
            if length >= 1:
                branches.append(Branch(position, nth + 1, length))
                left -= length
    return branches


def _edge(lowest: list[int], budget: int, depth_limit: int) -> list[Branch]:
    """draft_branches' loop (common/spec/tree/branching.py), positions and lengths only: the budget (already within
    the tree's room, as the edge's is) goes to the lowest estimate first, up to EDGE_ALTERNATIVES branches there."""
    branches, left, longest = [], budget, branch_length(budget)
    for position in lowest:
        for nth in range(1, EDGE_ALTERNATIVES + 1):
            length = min(longest, left, depth_limit - position)
            if length < 1:
                break
            branches.append(Branch(position, nth + 1, length))
            left -= length
        if left <= 0:
            break
    return branches


def _round_robin(lowest: list[int], budget: int, depth_limit: int) -> list[Branch]:
    """One alternative at each point in turn, lowest estimate first, then a second at each, ...: positions and
    lengths only."""
    branches, left, nth = [], budget, 1
    while left > 0 and lowest and nth <= max(1, budget):
        for position in lowest:
            if left <= 0:
                break
            length = min(ROUND_ROBIN_LENGTH, left, depth_limit - position)
            if length < 1:
                continue
            branches.append(Branch(position, nth + 1, length))
            left -= length
        nth += 1
    return branches


def build_tree(item: Scored, s: int, chain: list[int], branches: list[Branch], inner: tuple[int, int] | None = None,
               left: int = 0, limit: int = 0) -> tuple[DraftTree, list[int]]:
    """The round's DraftTree and the target's argmax after each node's prefix (placeholders where off its text);
    with `inner` (k, L), nested branches beside each branch's lowest estimate, within `left` tokens."""
    trace = item.trace
    tokens, parents = list(chain), list(range(-1, len(chain) - 1))
    unknown = iter(range(-1, -10**9, -1))  # placeholder tokens: never a target's token, never followed
    teacher_end = _rejection_or_end(trace, s, chain)
    added = []
    for branch in branches:
        known = branch.position <= teacher_end  # the chain before the branch is the target's text
        parent = branch.position - 1 if branch.position > 0 else ROOT
        added.append((branch, known, _add_branch(trace, s, tokens, parents, parent, branch, known, unknown)))
    for branch, known, nodes in added if inner is not None else ():
        on_text = known and tokens[nodes[0]] == trace.output[s + branch.position]
        point = _inner_point(item, s + branch.position, len(nodes)) if on_text else 1 if len(nodes) > 1 else None
        if point is None or left <= 0:
            continue
        depth = branch.position + point  # the chain index the inner alternatives stand at, as if on the chain
        for nth in range(1, inner[0] + 1):
            length = min(inner[1], left, limit - depth)
            if length >= 1:
                prefix = on_text and tokens_on_text(tokens, nodes[:point], trace.output, s + branch.position)
                inner_branch = Branch(depth, nth + 1, length)
                _add_branch(trace, s, tokens, parents, nodes[point - 1], inner_branch, prefix, unknown)
                left -= length
    tree = DraftTree(tokens, parents)
    argmax = [trace.output[s]] + [_argmax_after(tree, n, trace, s, unknown) for n in range(len(tree))]
    return tree, argmax


def _add_branch(trace: PromptTrace, s: int, tokens: list[int], parents: list[int], parent: int, branch: Branch,
                known: bool, unknown) -> list[int]:
    """Append a branch's nodes under `parent` (its prefix the target's text when `known`); return their indices."""
    on_text, nodes = True, []
    for k in range(branch.length):
        p = s + branch.position + k
        if not branch.rank:  # the oracle path: the target's own tokens
            token = trace.output[p]
        elif k == 0:  # an alternative: the row's next-best, known where its prefix is the target's text
            top = trace.rows[p].top if known else []
            token = top[branch.rank - 1] if branch.rank <= len(top) else next(unknown)
        elif on_text and p < len(trace.output):  # the draft's argmax after the target's text
            token = trace.rows[p].token
        else:
            token = next(unknown)
        on_text = on_text and p < len(trace.output) and token == trace.output[p]
        parents.append(parent if k == 0 else len(tokens) - 1)
        tokens.append(token)
        nodes.append(len(tokens) - 1)
    return nodes


def tokens_on_text(tokens: list[int], nodes: list[int], output: list[int], start: int) -> bool:
    return all(start + k < len(output) and tokens[n] == output[start + k] for k, n in enumerate(nodes))


def _inner_point(item: Scored, start: int, length: int) -> int | None:
    """The node (1..length-1) of a branch whose first token is output[start] with the lowest estimate (earliest on a
    tie): the rows while the draft follows the target, the fork after its first token that does not."""
    trace = item.trace
    estimates, deviation = [], None
    for k in range(1, length):
        p = start + k
        if deviation is None and p < len(trace.output):
            estimates.append(item.rows[p])
            deviation = p if trace.rows[p].token != trace.output[p] else None
        elif deviation is not None and p - deviation - 1 < len(item.forks.get(deviation, [])):
            estimates.append(item.forks[deviation][p - deviation - 1])
        else:
            break  # past the output's end or the fork's EOS: the branch's drafting would have stopped
    return 1 + min(range(len(estimates)), key=lambda k: (estimates[k], k)) if estimates else None


def _rejection_or_end(trace: PromptTrace, s: int, chain: list[int]) -> int:
    """The last chain index whose row is teacher-forced (the chain's prefix before it is the target's text)."""
    for i, token in enumerate(chain):
        if token != trace.output[s + i]:
            return i
    return len(chain) - 1


def _argmax_after(tree: DraftTree, node: int, trace: PromptTrace, s: int, unknown) -> int:
    path = tree.path_to(node)
    depth = len(path)
    if s + depth < len(trace.output) and tree.tokens_along(path) == trace.output[s:s + depth]:
        return trace.output[s + depth]
    return next(unknown)
