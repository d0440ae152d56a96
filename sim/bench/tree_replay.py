"""Greedy decoding rounds replayed over a prompt's trace, with a draft tree of a given shape each round (what
`sprinter bench tree-shapes`, sim/bench/tree_shapes.py, measures).

The trace, read of the two models once per prompt and cached:
    output       the target's greedy continuation: up to max_tokens tokens, its EOS last when it stopped
    row j        the draft teacher-forced on prompt + output[:j]: its `top` tokens (best first), their probabilities
                 and its entropy (T=1): what it proposes at j while the chain so far is the target's text
    fork j       where row j's best token is not output[j] (a rejection), the draft's own greedy chain after
                 prompt + output[:j] + [its token], up to `fork_tokens` rows (enough for the longest round) or EOS:
                 what a chain drafts past its rejection
Under greedy the output is the target's whatever the edge proposes, so these rows are all a round reads: a chain
follows the rows to its first rejection, then the fork; an alternative at j is a row's next-best token, continued
(while it is the target's text) by the rows after j. Exact, and no model runs in the replay.

A round after output[:s] (s = 1 after the session's open, which brings the first token):
    chain        x_1..x_g, the draft's greedy tokens, ended as the edge ends a block: the round's limit, EOS, or the
                 goodput call policy (`GoodputPolicy` itself, fixed costs, its keep model learning as the edge's)
    a_i          x_i's acceptance estimate: the shipped verifier's score, or the draft's probability (`Scored`)
    branch       (position i, rank r, length L): the draft's r-th best token in x_i's row, continued by its argmax
                 for L - 1 tokens; rank 0 is the oracle path: the target's own tokens from the rejection
    shape        where a round places its branch tokens (`TreeShape`); the edge's by its own budget and plan
                 (common/spec/tree: `tree_budget`, `BranchPlan`), each alternative drafted to its planned length
A round's tree is checked by the greedy tree rule itself (common.spec.acceptance_rules.decide); nodes off the
target's text (never followed, so the trace need not hold them) carry a placeholder token.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from common.lab.prompt_sets import PromptRecord
from common.model.cached_lm import CachedLM
from common.model.loading import DTYPES, LoadedModel, load_model
from common.model.prompting import encode_prompt
from common.sampling.distributions import SamplingParams
from common.spec.acceptance_rules import GREEDY, Proposal, decide
from common.spec.call_policy import GoodputPolicy
from common.spec.cost_model import CostModel
from common.spec.propose.proposals import ends_block
from common.spec.tree.branch_budget import tree_budget
from common.spec.tree.branching import MAX_ALTERNATIVES, BranchPlan, alternative_lengths, branch_length, lowest_first
from common.spec.tree.draft_tree import ROOT, DraftTree, depths

log = logging.getLogger(__name__)

GREEDY_SAMPLING = SamplingParams(temperature=0.0)  # the replay is greedy: the tree rule reads the argmax alone
ROUND_ROBIN_LENGTH = 3  # tokens per branch of the round-robin shape
# placeholders for a node's token off the target's text and for the argmax after one: no real token, and unequal,
# so that the rule never follows such a node
OFF_TEXT, NO_ARGMAX = -1, -2


@dataclass(frozen=True)
class DraftTopTokens:
    """The draft's distribution at one position: its `top` tokens best first, their probabilities, its entropy."""

    top: list[int]
    probs: list[float]
    entropy: float

    @property
    def token(self) -> int:
        return self.top[0]

    def rank_of(self, token: int) -> int | None:
        """1-based rank of `token` among the top tokens; None when it is not among them."""
        return self.top.index(token) + 1 if token in self.top else None


@dataclass(frozen=True)
class TraceSettings:
    target: str
    draft: str
    dtype: str
    max_tokens: int
    fork_tokens: int  # rows drafted past a rejection: the longest chain a round sends, less one
    top: int  # tokens kept per teacher-forced row: the alternatives a shape may use, plus the draft's own


@dataclass
class PromptTrace:
    """One prompt's output, rows and forks (module docstring)."""

    prompt_id: str
    category: str
    prompt_tokens: int
    output: list[int]
    eos_ids: list[int]
    rows: list[DraftTopTokens]
    forks: dict[int, list[DraftTopTokens]]
    timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        """Output tokens as the bench counts them: EOS not included."""
        return len(self.output) - int(bool(self.output) and self.output[-1] in self.eos_ids)

    def rejections(self) -> list[int]:
        return [j for j, row in enumerate(self.rows) if row.token != self.output[j]]

    @classmethod
    def from_json(cls, data: dict) -> PromptTrace:
        return cls(**{**data, "rows": [DraftTopTokens(**r) for r in data["rows"]],
                      "forks": {int(j): [DraftTopTokens(**r) for r in rows] for j, rows in data["forks"].items()}})


def load_traces(records: list[PromptRecord], settings: TraceSettings, cache: Path) -> list[PromptTrace]:
    """Every record's trace: from `cache` when it holds one made with these settings, else computed and cached."""
    cache.mkdir(parents=True, exist_ok=True)
    traces: dict[str, PromptTrace] = {}
    for record in records:
        path = cache / f"{record.id}.json"
        data = json.loads(path.read_text()) if path.exists() else None
        if data is not None and data.get("settings") == asdict(settings):
            traces[record.id] = PromptTrace.from_json(data["trace"])
    missing = [r for r in records if r.id not in traces]
    if missing:
        target, draft = (load_model(name, DTYPES[settings.dtype]) for name in (settings.target, settings.draft))
        for record in missing:
            traces[record.id] = build_trace(record, target, draft, settings)
            partial = cache / f"{record.id}.part"
            partial.write_text(json.dumps({"settings": asdict(settings), "trace": asdict(traces[record.id])}))
            partial.replace(cache / f"{record.id}.json")  # whole or absent: an interrupted run resumes here
    return [traces[r.id] for r in records]


def build_trace(record: PromptRecord, target: LoadedModel, draft: LoadedModel, settings: TraceSettings) -> PromptTrace:
    """One prompt's trace: the target's greedy output, then the draft's rows over it and its forks."""
    prompt = encode_prompt(draft.tokenizer, record.prompt, record.chat)
    eos = sorted(target.eos_token_ids | draft.eos_token_ids)
    started = time.perf_counter()
    target_lm, output = CachedLM(target.model), []
    while len(output) < settings.max_tokens and (not output or output[-1] not in eos):
        output.append(int(target_lm.advance_to(prompt + output).logits[-1].argmax()))  # one token a forward
    target_ms = (time.perf_counter() - started) * 1e3 / max(1, len(output))
    draft_lm = CachedLM(draft.model)
    logits = draft_lm.advance_to(prompt + output, n_logits=len(output) + 1).logits[:len(output)]
    rows = [row_of(row, settings.top) for row in logits]  # row j: one forward over prompt + output
    started = time.perf_counter()
    forks = {j: fork_rows(draft_lm, prompt + output[:j] + [row.token], settings.fork_tokens, frozenset(eos))
             for j, row in enumerate(rows) if row.token != output[j]}
    draft_ms = (time.perf_counter() - started) * 1e3 / max(1, sum(map(len, forks.values())))
    log.info("%s: %d output tokens, %d rejections, target %.0f ms/token, draft %.0f ms/step", record.id, len(output),
             len(forks), target_ms, draft_ms)
    return PromptTrace(record.id, record.category, len(prompt), output, eos, rows, forks,
                       {"target_step": target_ms, "draft_step": draft_ms})


def fork_rows(draft: CachedLM, context: list[int], count: int, eos: frozenset[int]) -> list[DraftTopTokens]:
    """The draft's greedy chain after `context`: `count` rows at most, the last one EOS when it stops there."""
    rows: list[DraftTopTokens] = []
    while len(rows) < count and (not rows or rows[-1].token not in eos):
        rows.append(row_of(draft.advance_to(context + [r.token for r in rows]).logits[-1], 1))
    return rows


def row_of(logits: torch.Tensor, top: int) -> DraftTopTokens:
    p = torch.softmax(logits.float(), dim=-1)
    values, indices = torch.topk(p, top)
    return DraftTopTokens([int(i) for i in indices], [float(v) for v in values],
                          float(-(p * torch.log(p.clamp_min(1e-12))).sum()))


@dataclass(frozen=True)
class TreeShape:
    """Where and how a round branches.

    kind    chain: no branches; edge: the edge's plan, up to MAX_ALTERNATIVES alternatives of
            `branch_length(budget)` tokens at each point in turn, lowest estimate first; round-robin: one alternative
            of ROUND_ROBIN_LENGTH tokens at each point in turn, then a second at each, ..., no node deeper than the
            chain unless `deep`; grid: `alternatives` x `length` at each of the `points` lowest points; oracle-grid:
            the grid at the rejection; oracle-path: `budget` tokens of the target's own text from the rejection;
            nested (oracle-nested): the grid at the lowest estimate (at the rejection), then inside each branch
            `inner_alternatives` x `inner_length` beside its own lowest estimate. All within `budget` (the grids:
            `tokens`) and the round's limit.
    """

    name: str
    kind: str
    budget: int = 0
    points: int = 1
    alternatives: int = 1
    length: int = 1
    deep: bool = False
    inner_alternatives: int = 0
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
        room = shape.tokens if max_tree_tokens is None else max(0, max_tree_tokens - len(chain))
        branches = place(shape, accept_probs, rejection, room, limit, trace, s, oracle_rank)
        inner = (shape.inner_alternatives, shape.inner_length) if shape.inner_alternatives else None
        left = min(shape.tokens, room) - sum(b.length for b in branches)  # what nested branches may still spend
        tree, argmax = build_tree(item, s, chain, branches, inner, left, limit)
        path = decide(Proposal(tree.tokens, parents=tree.parents), GREEDY, GREEDY_SAMPLING, argmax=argmax).path
        chain_kept = next((k for k, node in enumerate(path) if node != k), len(path))
        policy.observe_verdict(len(chain), chain_kept)
        cost_model.observe_verdict(accept_probs, chain_kept)
        rounds.append(RoundRecord(s, len(chain), rejection, len(path), chain_kept, len(tree) - len(chain),
                                  lowest_first(accept_probs), lowest_first([row.probs[0] for row in rows]),
                                  sum(b.length for b in branches if b.position == rejection)))
        s += len(path) + 1
    return PromptResult(trace.prompt_id, trace.category, trace.tokens, 1 + len(rounds), rounds)


def draft_chain(item: Scored, s: int, limit: int,
                policy: GoodputPolicy) -> tuple[list[DraftTopTokens], list[float], int | None]:
    """The rows of the chain a round drafts after output[:s] (its tokens their best), its a_i, and its rejection."""
    trace, eos = item.trace, frozenset(item.trace.eos_ids)
    chain, accept_probs, rejection = [], [], None
    while not chain or not ends_block(len(chain), chain[-1].token, accept_probs, limit, eos, policy):
        i = len(chain)
        if rejection is None:
            row, a = trace.rows[s + i], item.rows[s + i]
            rejection = i if row.token != trace.output[s + i] else None
        else:
            # the fork holds round_cap - 1 rows or ends at EOS (where the block ends): enough for any round
            row, a = trace.forks[s + rejection][i - rejection - 1], item.forks[s + rejection][i - rejection - 1]
        chain.append(row)
        accept_probs.append(a)
    return chain, accept_probs, rejection


def place(shape: TreeShape, accept_probs: list[float], rejection: int | None, room: int, limit: int,
          trace: PromptTrace, s: int, oracle_rank: int) -> list[Branch]:
    """The round's branches under `shape`, within `room` branch tokens and no deeper than the round's limit."""
    lowest = lowest_first(accept_probs)
    budget = min(shape.budget, room)
    if shape.kind == "chain" or room <= 0:
        return []
    if shape.kind == "edge":  # the edge's own budget (within the tree's room) and plan: the lowest estimate first
        budget = tree_budget(shape.budget, accept_probs, (), None, room, limit).budget
        return _at_points(lowest, budget, limit, branch_length(budget), MAX_ALTERNATIVES)
    if shape.kind == "round-robin":
        return _round_robin(lowest, budget, limit if shape.deep else len(accept_probs))
    if shape.kind == "oracle-path":
        length = 0
        while rejection is not None and length < min(budget, limit - rejection) and \
                s + rejection + length < len(trace.output) and \
                (trace.rows[s + rejection + length].rank_of(trace.output[s + rejection + length]) or oracle_rank + 1) \
                <= oracle_rank:
            length += 1
        return [Branch(rejection, 0, length)] if length else []
    points = lowest[:shape.points] if shape.kind in ("grid", "nested") else [] if rejection is None else [rejection]
    return _at_points(points, min(shape.points * shape.alternatives * shape.length, room), limit, shape.length,
                      shape.alternatives)


def _at_points(points: list[int], budget: int, depth_limit: int, length: int, count: int) -> list[Branch]:
    """`count` alternatives of `length` tokens at each point in turn, within `budget` tokens in all: the edge's own
    `BranchPlan` (common/spec/tree/branching.py), every alternative drafted to its planned length."""
    plan, branches = BranchPlan(points, budget, depth_limit, length, count), []
    for position, lengths in plan:
        branches += [Branch(position, nth, planned) for nth, planned in enumerate(lengths, start=2)]
        plan.spend(sum(lengths))
    return branches


def _round_robin(lowest: list[int], budget: int, depth_limit: int) -> list[Branch]:
    """One alternative at each point in turn, lowest estimate first, then a second at each, ..."""
    branches, left, nth = [], budget, 1
    while left > 0 and lowest and nth <= max(1, budget):
        for position in lowest:
            length = min(ROUND_ROBIN_LENGTH, left, depth_limit - position)
            if length >= 1:
                branches.append(Branch(position, nth + 1, length))
                left -= length
        nth += 1
    return branches


def build_tree(item: Scored, s: int, chain: list[int], branches: list[Branch], inner: tuple[int, int] | None = None,
               left: int = 0, limit: int = 0) -> tuple[DraftTree, list[int]]:
    """The round's DraftTree and the target's argmax after each node's prefix (a placeholder where off its text);
    with `inner` (k, L), nested branches beside each branch's lowest estimate, within `left` tokens."""
    output = item.trace.output
    tokens, parents = list(chain), list(range(-1, len(chain) - 1))
    teacher_end = next((i for i, token in enumerate(chain) if token != output[s + i]), len(chain) - 1)
    added = [(b, b.position <= teacher_end) for b in branches]  # known: the chain before it is the target's text
    added = [(b, known, _add_branch(item.trace, s, tokens, parents, b.position - 1, b, known))  # ROOT is -1
             for b, known in added]
    for branch, known, nodes in added if inner is not None else ():
        start = s + branch.position
        on_text = known and tokens[nodes[0]] == output[start]
        point = _inner_point(item, start, len(nodes)) if on_text else 1 if len(nodes) > 1 else None
        if point is None or left <= 0:
            continue
        prefix = on_text and all(start + k < len(output) and tokens[n] == output[start + k]
                                 for k, n in enumerate(nodes[:point]))
        depth = branch.position + point  # the chain index the inner alternatives stand at, as if on the chain
        for nth, length in enumerate(alternative_lengths(depth, left, limit, inner[1], inner[0]), start=2):
            _add_branch(item.trace, s, tokens, parents, nodes[point - 1], Branch(depth, nth, length), prefix)
            left -= length
    on_path: list[bool] = []  # node n's path is the target's text
    for token, up, depth in zip(tokens, parents, node_depths := depths(parents)):
        on_path.append((up == ROOT or on_path[up]) and s + depth - 1 < len(output) and token == output[s + depth - 1])
    argmax = [output[s]] + [output[s + d] if ok and s + d < len(output) else NO_ARGMAX
                            for ok, d in zip(on_path, node_depths)]
    return DraftTree(tokens, parents), argmax


def _add_branch(trace: PromptTrace, s: int, tokens: list[int], parents: list[int], parent: int, branch: Branch,
                known: bool) -> list[int]:
    """Append a branch's nodes under `parent` (its prefix the target's text when `known`); return their indices."""
    on_text, nodes = True, []
    for k in range(branch.length):
        p = s + branch.position + k
        if not branch.rank:  # the oracle path: the target's own tokens
            token = trace.output[p]
        elif k == 0:  # an alternative: the row's next-best, known where its prefix is the target's text
            top = trace.rows[p].top if known else []
            token = top[branch.rank - 1] if branch.rank <= len(top) else OFF_TEXT
        else:  # the draft's argmax after the target's text
            token = trace.rows[p].token if on_text and p < len(trace.output) else OFF_TEXT
        on_text = on_text and p < len(trace.output) and token == trace.output[p]
        parents.append(parent if k == 0 else len(tokens) - 1)
        tokens.append(token)
        nodes.append(len(tokens) - 1)
    return nodes


def _inner_point(item: Scored, start: int, length: int) -> int | None:
    """The node (1..length-1) of a branch whose first token is output[start] with the lowest estimate (earliest on a
    tie): the rows while the draft follows the target, the fork after its first token that does not."""
    trace = item.trace
    estimates, deviation = [], None
    for p in range(start + 1, start + length):
        if deviation is None and p < len(trace.output):
            estimates.append(item.rows[p])
            deviation = p if trace.rows[p].token != trace.output[p] else None
        elif deviation is not None and p - deviation - 1 < len(item.forks.get(deviation, [])):
            estimates.append(item.forks[deviation][p - deviation - 1])
        else:
            break  # past the output's end or the fork's EOS: the branch's drafting would have stopped
    return 1 + min(range(len(estimates)), key=lambda k: (estimates[k], k)) if estimates else None
