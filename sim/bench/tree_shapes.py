r"""`sprinter bench tree-shapes`: under greedy decoding, how much a draft tree of a given size can add to tokens per
call for a draft/target pair, and which shape gets closest, replayed offline and exactly.

    taskset -c 0 sprinter bench tree-shapes --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
        --per-category 2 --out results/bench-tree-shapes

Under greedy decoding the output is the target's greedy text whatever the edge proposes, so one pass of the models
per prompt says everything a round can keep (sim/bench/tree_traces.py): the target's greedy output (up to
--max-tokens), the draft teacher-forced over it (its best tokens at every position), and, at each position where the
draft's best token is not the target's, the draft's own chain past it. These are cached under OUT/cache (or
--cache), one file per prompt: a rerun, or an interrupted run, computes only what is missing.

Rounds are then replayed (sim/bench/tree_rounds.py) as sprinter-exact runs them: a round's chain is the draft's
greedy run, its block ends where the goodput call policy sends it (the shipped verifier's acceptance estimates;
the costs are --draft-ms, --verify-ms, --verify-per-token-ms and --rtt-ms, fixed), and its tree adds branch tokens
by a shape: the edge's (`edge:B`, common/spec/tree/branching.py's `draft_branches`, whose `branch_length` and
MAX_ALTERNATIVES the replay reads: up to MAX_ALTERNATIVES alternatives at the lowest estimate, each
`branch_length(B)` tokens, then the next lowest, down to the round's limit), the round-robin shape (one alternative
of 3 tokens at each of the lowest estimates in turn, no deeper than the chain; round-robin-deep: down to the round's
limit), all of them at the lowest estimate (k alternatives x L tokens), spread over the m lowest, nested (k x L at
the lowest estimate, then k2 x L2 beside each branch's own lowest estimate), and oracles: the grid and the nested
shape placed at the rejected position itself, and the target's own text from there (the most any tree of that many
tokens, each within the draft's best --oracle-rank, can keep). Each tree is checked by the greedy tree rule itself
(common/spec/tree/multipath_rules.py).

Prints the tokens per call (the session's open included, as `sprinter bench proposer` counts them) of one path and
of each shape at each --budgets size, with the ratio to one path; where the chain's rejections fall among its
estimates; the rank of the target's token in the draft's row at a rejection and how far the draft follows the
target after it. With --bench-results (a `sprinter bench proposer` results.json over the same prompts) it compares
the replay with that run, prompt by prompt. Writes OUT/results.json, OUT/table.md and OUT/tree_shapes.png.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from common.lab.prompt_sets import load_prompts
from sim.bench.proposer import SUITE, chosen_prompts
from sim.bench.tree_rounds import PromptResult, CostPriors, Scored, TreeShape, decode, scored
from sim.bench.tree_shape_report import plot, report_table, summarize
from sim.bench.tree_traces import DraftTopTokens, TraceSettings, load_traces

log = logging.getLogger(__name__)

ESTIMATES = ("verifier", "draft")
MAX_ALTERNATIVES = 4  # alternatives per point in the grids (the draft's ranks 2..5)
MAX_LENGTH = 8  # tokens per branch in the grids
MAX_SPREAD = 6  # points in the spread grid


@dataclass(frozen=True)
class TreeShapesSettings:
    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    dtype: str = "bfloat16"
    prompts: Path = SUITE
    per_category: int | None = 2  # the first N prompts of each category; None: all
    max_tokens: int = 64
    round_cap: int = 20  # DecodeSettings.max_run_length: the longest block a round sends
    top: int = 16  # tokens kept per teacher-forced row: round-robin:16 may try up to 15 alternatives at one point
    estimate: str = "verifier"  # the a_i: the shipped verifier's score, or the draft's probability of its token
    costs: CostPriors = CostPriors()
    max_tree_tokens: int = 32  # nodes a tree may hold in all (the cloud's --max-tree-tokens); 0: no cap
    budgets: tuple[int, ...] = (6, 16)
    oracle_rank: int = 1 + MAX_ALTERNATIVES  # the oracle path's tokens are within the draft's best this many
    bench_results: Path | None = None  # a `sprinter bench proposer` results.json to compare with
    out: Path = Path("results/bench-tree-shapes")
    cache: Path | None = None  # default OUT/cache

    def __post_init__(self) -> None:
        if self.estimate not in ESTIMATES:
            raise ValueError(f"--estimate must be one of {', '.join(ESTIMATES)}, got {self.estimate!r}")
        if self.top < 1 + MAX_ALTERNATIVES or self.oracle_rank > self.top:
            raise ValueError(f"--top {self.top} must hold the grids' {1 + MAX_ALTERNATIVES} ranks and --oracle-rank "
                             f"{self.oracle_rank}")
        if not self.budgets or min(self.budgets) < 1:
            raise ValueError(f"--budgets must be branch token counts >= 1, got {list(self.budgets)}")

    @property
    def trace_settings(self) -> TraceSettings:
        return TraceSettings(self.target, self.draft, self.dtype, self.max_tokens, self.round_cap - 1, self.top)


def bench_tree_shapes(settings: TreeShapesSettings) -> str:
    """Trace (or read) every prompt, replay every shape, write OUT; return the table."""
    settings.out.mkdir(parents=True, exist_ok=True)
    records = chosen_prompts(load_prompts(settings.prompts), (), settings.per_category)
    traces = load_traces(records, settings.trace_settings, settings.cache or settings.out / "cache")
    estimate = estimator(settings)
    items = [scored(t, estimate) for t in traces]
    results = {shape: replay(items, shape, settings) for shape in shapes(settings.budgets)}
    bench = json.loads(settings.bench_results.read_text()) if settings.bench_results else None
    summary = summarize(traces, results, settings.budgets, settings.oracle_rank, bench)
    report = {"settings": json.loads(json.dumps(asdict(settings), default=str)), "summary": summary,
              "prompts": {shape.name: [asdict(r) for r in rs] for shape, rs in results.items()}}
    (settings.out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    text = report_table(settings, summary)
    (settings.out / "table.md").write_text(text + "\n")
    plot(summary, settings.out / "tree_shapes.png")
    return text


def shapes(budgets: Sequence[int]) -> list[TreeShape]:
    """One path, the edge's and the round-robin shapes at every budget up to the largest, the grids and the
    oracles."""
    most = max(budgets)
    found = [TreeShape("one path", "chain")]
    found += [TreeShape(f"edge:{b}", "edge", budget=b) for b in range(1, most + 1)]
    found += [TreeShape(f"round-robin:{b}", "round-robin", budget=b) for b in range(1, most + 1)]
    found += [TreeShape(f"round-robin-deep:{b}", "round-robin", budget=b, deep=True) for b in budgets]
    found += [TreeShape(f"lowest:{k}x{n}", "grid", alternatives=k, length=n)
              for k in range(1, MAX_ALTERNATIVES + 1) for n in range(1, MAX_LENGTH + 1) if k * n <= most]
    found += [TreeShape(f"spread:{m}x{n}", "grid", points=m, length=n)
              for m in range(2, MAX_SPREAD + 1) for n in range(1, MAX_LENGTH + 1) if m * n <= most]
    found += [TreeShape(f"oracle-at-rejection:{k}x{n}", "oracle-grid", alternatives=k, length=n)
              for k in range(1, MAX_ALTERNATIVES + 1) for n in range(1, MAX_LENGTH + 1) if k * n <= most]
    found += [TreeShape(f"oracle-path:{b}", "oracle-path", budget=b) for b in range(1, most + 1)]
    for kind, prefix in (("nested", "nested"), ("oracle-nested", "oracle-nested")):
        found += [TreeShape(f"{prefix}:{k}x{n}+{k2}x{n2}", kind, alternatives=k, length=n, inner_alternatives=k2,
                            inner_length=n2)
                  for k in (1, 2) for n in range(2, MAX_LENGTH + 1) for k2 in (1, 2) for n2 in range(1, 6)
                  if k * (n + k2 * n2) <= most]
    return found


def replay(items: list[Scored], shape: TreeShape, settings: TreeShapesSettings) -> list[PromptResult]:
    """Every prompt under one shape, in suite order, with one cost model throughout (as one edge serves them)."""
    cost_model = settings.costs.cost_model()
    cap = settings.max_tree_tokens or None
    return [decode(item, shape, cost_model, settings.max_tokens, settings.round_cap, cap, settings.oracle_rank)
            for item in items]


def estimator(settings: TreeShapesSettings):
    """Rows -> their a_i: the shipped greedy verifier's score of the draft's features, or the draft's probability."""
    if settings.estimate == "draft":
        return lambda rows: [row.probs[0] for row in rows]
    from edge.runtime.verifier import LearnedVerifier, shipped_verifiers
    paths = shipped_verifiers(settings.draft, settings.target)
    greedy = [v for v in (LearnedVerifier.load(p) for p in paths) if v.trained_temperature == 0]
    if not greedy:
        raise ValueError(f"no greedy verifier is shipped for {settings.draft} -> {settings.target}: "
                         "use --estimate draft")
    verifier = greedy[0]
    names = tuple(verifier.metadata["features"])

    def features(row: DraftTopTokens) -> list[float]:
        known = {"token_prob": row.probs[0], "max_prob": row.probs[0], "entropy": row.entropy}  # greedy: its argmax
        missing = [n for n in names if n not in known]
        if missing:
            raise ValueError(f"the verifier reads {missing}, which a trace does not keep: use --estimate draft")
        return [known[n] for n in names]

    def estimate(rows: Sequence[DraftTopTokens]) -> list[float]:
        if not rows:
            return []
        return [float(a) for a in verifier.score_features(np.array([features(r) for r in rows], dtype=np.float32))]
    return estimate
