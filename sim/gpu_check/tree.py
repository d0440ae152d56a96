"""What a draft tree costs the verify forward on the device: a tree of 16 draft tokens against chains of 6 and 16.

The tree has a branching round's shape: a chain of 6 draft tokens (the primary path) with, beside each of its
first 5 tokens, an alternative and one continuation (a sibling of chain token b, then its child): 6 + 5 x 2 = 16
nodes, 6 deep at most, 6 root-to-leaf paths. Each forward is the one the resident engine's batcher runs for a
verify (cloud/packed_forward.py `forward_packed`, `trees` as cloud/tree_verify.py builds them): a session's pending
token, then its draft nodes, on top of the owed mid context (1k on a GPU), on the default layout (paged on CUDA),
for 1 session and for `owed_edges` sessions batched, each with its own block. Every forward is rolled back, so the
context stays fixed; the shapes are interleaved within each rep, and each time is the median of the timed reps.

Then, on the batched sessions, the tree's rows are checked against a chain forward of each of its paths (the same
past, the path's tokens as a chain): the tree mask (ancestors only, positions by depth) on the device. The check
runs in float32 whatever the run's dtype: in bfloat16 a tree's rows and a chain's round apart by more than a
wrong mask would show on random weights (0.17 on logits up to 4.3 on an H100, where float32 agreed within 3e-5).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from cloud.packed_forward import forward_packed
from cloud.tree_verify import forward_parents
from common.spec.tree.draft_tree import path_to
from sim.bench.engine import BenchSession, release
from sim.gpu_check.run_state import CheckRun, Deadline

CHAIN, BRANCHES, BRANCH_TOKENS = 6, 5, 2
# |tree - chain| <= ATOL for every logit, in float32: tests/cloud/test_tree_forward.py's bound.
ATOL = 1e-4


def chain_parents(n: int) -> list[int]:
    return list(range(-1, n - 1))


def branching_parents(chain: int = CHAIN, branches: int = BRANCHES, branch_tokens: int = BRANCH_TOKENS) -> list[int]:
    """Draft-node parents: `chain` tokens, then for b < `branches` an alternative to chain token b (its sibling)
    followed by `branch_tokens` - 1 more tokens."""
    parents = chain_parents(chain)
    for b in range(branches):
        parents.append(b - 1)  # chain token b's parent: -1 (the root) for b = 0
        parents += [len(parents) - 1 + i for i in range(branch_tokens - 1)]
    return parents


SHAPES = {"chain6": chain_parents(CHAIN), "chain16": chain_parents(CHAIN + BRANCHES * BRANCH_TOKENS),
          "tree16": branching_parents()}


def tree_step(run: CheckRun, deadline: Deadline) -> dict[str, Any]:
    sizes = run.sizes
    settings = replace(run.bench_settings(), edges=(sizes.owed_edges,), contexts=(sizes.mid_context,))
    model = run.model(sizes.owed)
    _, sessions = run.sessions(model, run.default_layout, sizes.owed_edges, sizes.mid_context, settings)
    rng = random.Random(8)
    drafts = {name: [[rng.randrange(model.config.vocab_size) for _ in parents] for _ in sessions]
              for name, parents in SHAPES.items()}
    row: dict[str, Any] = {"target": sizes.owed, "attention": run.default_layout, "context": sizes.mid_context,
                           "shapes": {name: len(parents) for name, parents in SHAPES.items()},
                           "tree_parents": SHAPES["tree16"], "reps": sizes.rounds, "rows": [], "not_reached": []}
    try:
        for n in dict.fromkeys((1, sizes.owed_edges)):
            timed = _timed_shapes(run, model, sessions[:n], drafts, deadline)
            if timed is None:
                row["not_reached"].append({"sessions": n})
            else:
                row["rows"].append({"sessions": n, **timed})
    finally:
        release(sessions)
    exact = run.model(sizes.owed, "float32")
    _, sessions = run.sessions(exact, run.default_layout, sizes.owed_edges, sizes.mid_context,
                               replace(settings, dtype="float32"))
    try:
        row["check"] = tree_check(exact, sessions, drafts["tree16"])
    finally:
        release(sessions)
    return row


def _forward(model: torch.nn.Module, sessions: list[BenchSession], drafts: list[list[int]], parents: list[int],
             full_logits: bool = False) -> list:
    """One verify forward of each session's pending token and draft nodes (parents as given), rolled back after."""
    pasts = [session.cache.length for session in sessions]
    blocks = [[session.pending] + draft for session, draft in zip(sessions, drafts)]
    tree = forward_parents(1, parents)
    rows = forward_packed(model, [s.cache for s in sessions], blocks, [len(b) for b in blocks],
                          full_logits=[full_logits] * len(sessions), trees=[tree] * len(sessions))
    for session, past in zip(sessions, pasts):
        session.cache.truncate(past)
    return rows


def _timed_shapes(run: CheckRun, model: torch.nn.Module, sessions: list[BenchSession],
                  drafts: dict[str, list[list[int]]], deadline: Deadline) -> dict[str, float] | None:
    """Median ms of each shape's forward for `sessions`, the shapes interleaved; None if the deadline came first."""
    times: dict[str, list[float]] = {name: [] for name in SHAPES}
    for rep in range(run.sizes.warmup + run.sizes.rounds):
        if deadline.passed():
            return None
        for name, parents in SHAPES.items():
            run.synchronize()
            started = time.perf_counter()
            _forward(model, sessions, drafts[name][:len(sessions)], parents)  # its rows on the host: the device is done
            if rep >= run.sizes.warmup:
                times[name].append((time.perf_counter() - started) * 1e3)
    ms = {f"{name}_ms": round(statistics.median(values), 3) for name, values in times.items()}
    return ms | {"tree16_over_chain6": round(ms["tree16_ms"] / ms["chain6_ms"], 3),
                 "tree16_over_chain16": round(ms["tree16_ms"] / ms["chain16_ms"], 3)}


def tree_check(model: torch.nn.Module, sessions: list[BenchSession], drafts: list[list[int]]) -> dict[str, Any]:
    """The tree's rows for `sessions` batched against a batched chain forward of each root-to-leaf path (a float32
    model: the bound is float32's)."""
    parents = SHAPES["tree16"]
    tree_rows = _forward(model, sessions, drafts, parents, full_logits=True)
    leaves = [node for node in range(len(parents)) if node not in parents]
    max_diff = 0.0
    agree = total = 0
    for leaf in leaves:
        path = path_to(parents, leaf)
        paths = [[draft[node] for node in path] for draft in drafts]
        chain_rows = _forward(model, sessions, paths, chain_parents(len(path)), full_logits=True)
        index = torch.tensor([0] + [1 + node for node in path])
        for tree_row, chain_row in zip(tree_rows, chain_rows):
            got, want = tree_row.logits[index], chain_row.logits
            diff = (got - want).abs()
            max_diff = max(max_diff, diff.max().item())
            agree += int((tree_row.argmax[index] == chain_row.argmax).sum())
            total += len(index)
    return {"dtype": "float32", "sessions": len(sessions), "paths": len(leaves), "max_abs_diff": max_diff,
            "max_abs_logit": round(max(r.logits.abs().max().item() for r in tree_rows), 3), "atol": ATOL,
            "within_tolerance": max_diff <= ATOL, "argmax_agree": round(agree / total, 4)}
