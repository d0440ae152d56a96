"""The settings and the command of `sprinter bench tree-shapes` (sim/bench/tree_shapes.py): import-light, so that
building `sprinter`'s parser loads no model code."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from common.errors import UsageError
from sim.bench.prompts import PROPOSER_PROMPTS_FILE
from sim.bench.registry import Bench

GRID_ALTERNATIVES = 4  # alternatives per point in the study's grids (the draft's ranks 2..5)


@dataclass(frozen=True)
class TreeShapesSettings:
    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    prompts: Path = PROPOSER_PROMPTS_FILE
    per_category: int = 2  # the first N prompts of each category; 0: all
    max_tokens: int = 64
    round_cap: int = 20  # DecodeSettings.max_run_length: the longest block a round sends
    top: int = 16  # tokens kept per teacher-forced row: round-robin:16 may try up to 15 alternatives at one point
    estimate: Literal["verifier", "draft"] = "verifier"
    draft_ms: float = 165.0  # the goodput policy's costs (fixed priors): what decides where a block ends
    verify_ms: float = 430.0
    verify_per_token_ms: float = 15.0
    rtt_ms: float = 0.0
    max_tree_tokens: int = 32  # nodes a tree may hold in all (the cloud's --max-tree-tokens); 0: no cap
    budgets: tuple[int, ...] = (6, 16)
    oracle_rank: int = 1 + GRID_ALTERNATIVES  # the oracle path's tokens are within the draft's best this many
    bench_results: Path | None = None  # a `sprinter bench proposer` results.json to compare with
    out: Path = Path("results/bench-tree-shapes")
    cache: Path | None = None  # default OUT/cache

    def __post_init__(self) -> None:
        if self.top < 1 + GRID_ALTERNATIVES or self.oracle_rank > self.top:
            raise UsageError(f"--top {self.top} must hold the grids' {1 + GRID_ALTERNATIVES} ranks and --oracle-rank "
                             f"{self.oracle_rank}")
        if not self.budgets or min(self.budgets) < 1:
            raise UsageError(f"--budgets must be branch token counts >= 1, got {list(self.budgets)}")
        if self.max_tokens < 1 or self.round_cap < 2:  # a round's chain may run one token past its rejection
            raise UsageError(f"--max-tokens must be 1 or more and --round-cap 2 or more, got {self.max_tokens} and "
                             f"{self.round_cap}")


TREE_SHAPES = Bench(
    "tree-shapes", "greedy: what a draft tree of a given size can add to tokens per call, by shape, replayed offline "
                   "and exactly", TreeShapesSettings, "sim.bench.tree_shapes:bench_tree_shapes",
    plots=("tree_shapes.png",),
    helps={"prompts": "a prompt file (JSONL with prompt, chat, category)",
           "per_category": "the first N prompts of each category (0: all)",
           "round_cap": "the longest block a round sends (the edge's max run length)",
           "top": "tokens kept per teacher-forced row of the trace",
           "estimate": "the a_i: the shipped greedy verifier's score, or the draft's probability of its token",
           "draft_ms": "what the goodput policy weighs: a draft step",
           "verify_ms": "what the goodput policy weighs: a verify (base)",
           "verify_per_token_ms": "what the goodput policy weighs: a verified token",
           "rtt_ms": "what the goodput policy weighs: the round trip",
           "max_tree_tokens": "nodes a tree may hold in all (the cloud's --max-tree-tokens); 0: no cap",
           "budgets": "branch tokens per round to report (comma list)",
           "oracle_rank": "the oracle path's tokens are within the draft's best this many",
           "bench_results": "a `sprinter bench proposer` results.json to compare with",
           "cache": "where the traces are cached; None: OUT/cache"})

BENCHES = (TREE_SHAPES,)
