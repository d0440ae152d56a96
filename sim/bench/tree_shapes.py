r"""`sprinter bench tree-shapes`: under greedy decoding, how much a draft tree of a given size can add to tokens per
call for a draft/target pair, and which shape gets closest, replayed offline and exactly.

    taskset -c 0 sprinter bench tree-shapes --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
        --per-category 2 --out results/bench-tree-shapes

Under greedy decoding the output is the target's greedy text whatever the edge proposes, so one pass of the models
per prompt says everything a round can keep: the target's greedy output (up to --max-tokens), the draft
teacher-forced over it (its best --top tokens at every position), and, at each position where the draft's best
token is not the target's, the draft's own chain past it. These are cached under OUT/cache (or --cache), one file
per prompt: a rerun, or an interrupted run, computes only what is missing.

Rounds are then replayed (sim/bench/tree_replay.py) as sprinter-exact runs them: a round's chain is the draft's
greedy run, its block ends where the goodput call policy sends it (the shipped verifier's acceptance estimates, or
the draft's with --estimate draft; the costs are --draft-ms, --verify-ms, --verify-per-token-ms and --rtt-ms,
fixed), and its tree adds branch tokens by a shape: the edge's (`edge:B`, planned by the edge's own
common/spec/tree/branching.py: up to 3 alternatives at the lowest estimate, each `branch_length(B)` tokens, then the
next lowest, down to the round's limit), the round-robin shape (one alternative of 3 tokens at each of the lowest
estimates in turn, no deeper than the chain; round-robin-deep: down to the round's limit), all of them at the
lowest estimate (k alternatives x L tokens), spread over the m lowest, nested (k x L at the lowest estimate, then
k2 x L2 beside each branch's own lowest estimate), and oracles: the grid and the nested shape placed at the
rejected position itself, and the target's own text from there (the most any tree of that many tokens, each within
the draft's best --oracle-rank, can keep). Each tree is checked by the greedy tree rule itself.

Prints the tokens per call (the session's open included, as `sprinter bench proposer` counts them) of one path and
of each shape at each --budgets size, with the ratio to one path; where the chain's rejections fall among its
estimates; the rank of the target's token in the draft's row at a rejection and how far the draft follows the
target after it. With --bench-results (a `sprinter bench proposer` results.json over the same prompts) it compares
the replay with that run, prompt by prompt. Writes OUT/results.json, OUT/table.md and OUT/tree_shapes.png.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from common.errors import UsageError
from common.lab.plots import saved_figure
from common.lab.prompt_sets import load_prompts
from common.spec.cost_model import CostModel
from sim.bench.proposer import chosen_prompts
from sim.bench.run_folder import RunFolder
from sim.bench.settings.trees import GRID_ALTERNATIVES, TreeShapesSettings
from sim.bench.tree_replay import (DraftTopTokens, PromptResult, PromptTrace, TraceSettings, TreeShape, decode,
                                   load_traces, scored)

GRID_LENGTH = 8  # tokens per branch in the grids
MAX_SPREAD = 6  # points in the spread grid
LENGTHS = range(1, GRID_LENGTH + 1)
RUN_BUCKETS = ("0", "1", "2", "3", "4-7", "8+")
# `bench proposer`'s variants and the shapes that replay them (its trees are the edge's)
BENCH_VARIANTS = {"model": "one path", "model+tree:6": "edge:6", "model+tree:16": "edge:16"}


def bench_tree_shapes(settings: TreeShapesSettings) -> str:
    """Trace (or read) every prompt, replay every shape, write OUT; return the table."""
    folder = RunFolder(settings.out)
    records = chosen_prompts(load_prompts(settings.prompts), (), settings.per_category or None)
    trace_settings = TraceSettings(settings.target, settings.draft, settings.dtype, settings.max_tokens,
                                   settings.round_cap - 1, settings.top)
    traces = load_traces(records, trace_settings, settings.cache or settings.out / "cache")
    estimate = estimator(settings)  # the verifier loads once
    items = [scored(t, estimate) for t in traces]
    results = {}
    for shape in shapes(settings.budgets):  # one cost model a shape, through its prompts (as one edge serves them)
        costs = CostModel(prior_draft_ms=settings.draft_ms, prior_rtt_ms=settings.rtt_ms, prior_verify_base_ms=
                          settings.verify_ms, prior_verify_per_token_ms=settings.verify_per_token_ms)
        results[shape] = [decode(item, shape, costs, settings.max_tokens, settings.round_cap,
                                 settings.max_tree_tokens or None, settings.oracle_rank) for item in items]
    bench = json.loads(settings.bench_results.read_text()) if settings.bench_results else None
    summary = summarize(traces, results, settings.budgets, settings.oracle_rank, bench)
    folder.write_results(settings, summary=summary,
                         prompts={shape.name: [asdict(r) for r in rs] for shape, rs in results.items()})
    text = folder.write_table(report_table(settings, summary))
    plot(summary, folder.path("tree_shapes.png"))
    return text


def shapes(budgets: Sequence[int]) -> list[TreeShape]:
    """One path, the edge's and the round-robin shapes at every budget up to the largest, the grids and the
    oracles."""
    most = max(budgets)
    grid = [(k, n) for k in range(1, GRID_ALTERNATIVES + 1) for n in LENGTHS if k * n <= most]
    found = [TreeShape("one path", "chain")]
    found += [TreeShape(f"edge:{b}", "edge", budget=b) for b in range(1, most + 1)]
    found += [TreeShape(f"round-robin:{b}", "round-robin", budget=b) for b in range(1, most + 1)]
    found += [TreeShape(f"round-robin-deep:{b}", "round-robin", budget=b, deep=True) for b in budgets]
    found += [TreeShape(f"lowest:{k}x{n}", "grid", alternatives=k, length=n) for k, n in grid]
    found += [TreeShape(f"spread:{m}x{n}", "grid", points=m, length=n)
              for m in range(2, MAX_SPREAD + 1) for n in LENGTHS if m * n <= most]
    found += [TreeShape(f"oracle-at-rejection:{k}x{n}", "oracle-grid", alternatives=k, length=n) for k, n in grid]
    found += [TreeShape(f"oracle-path:{b}", "oracle-path", budget=b) for b in range(1, most + 1)]
    for kind in ("nested", "oracle-nested"):
        found += [TreeShape(f"{kind}:{k}x{n}+{k2}x{n2}", kind, alternatives=k, length=n, inner_alternatives=k2,
                            inner_length=n2)
                  for k in (1, 2) for n in range(2, GRID_LENGTH + 1) for k2 in (1, 2) for n2 in range(1, 6)
                  if k * (n + k2 * n2) <= most]
    return found


def estimator(settings: TreeShapesSettings):
    """Rows -> their a_i: the shipped greedy verifier's score of the draft's features, or the draft's probability."""
    if settings.estimate == "draft":
        return lambda rows: [row.probs[0] for row in rows]
    from edge.runtime.verifier import LearnedVerifier, shipped_verifiers
    greedy = [v for v in map(LearnedVerifier.load, shipped_verifiers(settings.draft, settings.target))
              if v.trained_temperature == 0]
    if not greedy:
        raise UsageError(f"no greedy verifier is shipped for {settings.draft} -> {settings.target}: "
                         "use --estimate draft")
    names = tuple(greedy[0].metadata["features"])

    def features(row: DraftTopTokens) -> list[float]:
        known = {"token_prob": row.probs[0], "max_prob": row.probs[0], "entropy": row.entropy}  # greedy: its argmax
        if missing := [n for n in names if n not in known]:
            raise UsageError(f"the verifier reads {missing}, which a trace does not keep: use --estimate draft")
        return [known[n] for n in names]

    def estimate(rows: Sequence[DraftTopTokens]) -> list[float]:
        scores = greedy[0].score_features(np.array([features(r) for r in rows], dtype=np.float32)) if rows else []
        return [float(a) for a in scores]
    return estimate


def summarize(traces: list[PromptTrace], results: dict[TreeShape, list[PromptResult]], budgets: tuple[int, ...],
              oracle_rank: int, bench: dict | None) -> dict:
    base = totals(results[next(s for s in results if s.kind == "chain")])
    shapes = {s.name: {"kind": s.kind, "tokens_spent": s.tokens, **totals(r, base)} for s, r in results.items()}
    return {"shapes": shapes, "best": {str(b): best_rows(results, shapes, b) for b in budgets},
            "ranks": rank_stats(traces, oracle_rank), "runs": run_stats(traces),
            "hits": hit_stats(results, budgets), "validation": validation(results, bench) if bench else None}


def totals(prompts: list[PromptResult], base: dict | None = None) -> dict:
    rounds = [r for p in prompts for r in p.rounds]
    tokens, calls, n = sum(p.tokens for p in prompts), sum(p.calls for p in prompts), max(1, len(rounds))
    row = {"tokens": tokens, "calls": calls, "tokens_per_call": tokens / max(1, calls), "rounds": len(rounds),
           "side_path_won": sum(r.kept > r.chain_kept for r in rounds) / n,
           "branch_tokens_per_round": sum(r.branch_tokens for r in rounds) / n,
           "branch_kept_per_round": sum(r.kept - r.chain_kept for r in rounds) / n}
    row["x_one_path"] = row["tokens_per_call"] / base["tokens_per_call"] if base else 1.0
    return row


def best_rows(results: dict[TreeShape, list[PromptResult]], shapes: dict[str, dict], budget: int) -> list[list[str]]:
    """(label, shape name) rows of the main table at one budget: the edge's shape, the round-robin one, the best of
    each family, the oracles."""
    def best(kind: str, points: int | None = None) -> str | None:
        fits = [s for s in results if s.kind == kind and s.tokens <= budget
                and (points is None or (s.points == 1) == (points == 1))]
        return max(fits, key=lambda s: shapes[s.name]["tokens_per_call"]).name if fits else None
    rows = [("one path", "one path"), ("the edge's shape (tree:B)", f"edge:{budget}"),
            ("round-robin (1 alternative x 3 at each lowest in turn, no deeper than the chain)",
             f"round-robin:{budget}"), ("round-robin, no depth cap", f"round-robin-deep:{budget}"),
            ("best at the lowest estimate (k alternatives x L)", best("grid", 1)),
            ("best spread over the m lowest (1 alternative x L each)", best("grid", 2)),
            ("best nested (k x L at the lowest, then k2 x L2 inside each branch)", best("nested")),
            ("oracle: best k x L at the rejected position", best("oracle-grid")),
            ("oracle: best nested at the rejected position", best("oracle-nested")),
            ("oracle: the target's path from the rejection", f"oracle-path:{budget}")]
    return [[label, name] for label, name in rows if name in shapes]


def rank_stats(traces: list[PromptTrace], oracle_rank: int) -> dict:
    """At every teacher-forced rejection: the rank of the target's token in the draft's row."""
    ranks = [t.rows[j].rank_of(t.output[j]) for t in traces for j in t.rejections()]
    count = Counter("none" if r is None else str(r) if r <= 5 else "6-16" for r in ranks)
    n = max(1, len(ranks))
    within = {f"share_rank_le_{k}": sum(r is not None and r <= k for r in ranks) / n for k in (3, 4, oracle_rank)}
    return {"rejections": len(ranks), "output_tokens": sum(len(t.output) for t in traces),
            "counts": dict(count), "share": {k: v / n for k, v in count.items()},
            "share_rank_2": sum(r == 2 for r in ranks) / n, **within}


def run_stats(traces: list[PromptTrace]) -> dict:
    """Where an alternative of rank 2..5 is the target's token: how many tokens after it the draft's argmax follows
    the target (the run), and what a branch of length L keeps there beyond the chain's round: 1 + min(run, L - 1)."""
    runs, to_the_end = [], 0
    for t in traces:
        for j in (j for j in t.rejections() if (t.rows[j].rank_of(t.output[j]) or 6) <= 5):
            run = 0
            while j + 1 + run < len(t.output) and t.rows[j + 1 + run].token == t.output[j + 1 + run]:
                run += 1
            runs.append(run)
            to_the_end += j + 1 + run >= len(t.output)
    buckets = Counter(str(run) if run <= 3 else "4-7" if run < 8 else "8+" for run in runs)
    n = max(1, len(runs))
    return {"matches": len(runs), "run_share": {b: buckets.get(b, 0) / n for b in RUN_BUCKETS},
            "mean_run": sum(runs) / n, "runs_to_the_end": to_the_end,
            "extra_kept_by_length": {str(L): sum(1 + min(run, L - 1) for run in runs) / n for L in LENGTHS}}


# where a rejected round's rejected token stands: the lowest estimate (or among the 2, 3 lowest), the lowest draft
# probability (or among the 2), the chain's last token; and whether the tree branched beside it
HITS = {"lowest": lambda r: r.lowest[0] == r.rejection, "lowest_2": lambda r: r.rejection in r.lowest[:2],
        "lowest_3": lambda r: r.rejection in r.lowest[:3], "draft_lowest": lambda r: r.draft_lowest[0] == r.rejection,
        "draft_lowest_2": lambda r: r.rejection in r.draft_lowest[:2], "last_token": lambda r: r.rejection == r.chain - 1,
        "branched_beside_it": lambda r: r.at_rejection > 0}


def hit_stats(results: dict[TreeShape, list[PromptResult]], budgets: tuple[int, ...]) -> dict:
    """HITS among the rounds whose chain was rejected, for one path and the edge's and round-robin trees."""
    reported = {f"{kind}:{b}" for kind in ("edge", "round-robin") for b in budgets}
    out = {}
    for shape, prompts in results.items():
        if shape.kind == "chain" or shape.name in reported:
            rounds = [r for p in prompts for r in p.rounds]
            rejected = [r for r in rounds if r.rejection is not None]
            out[shape.name] = {"rounds": len(rounds), "rejected_rounds": len(rejected),
                               **{k: sum(map(hit, rejected)) / max(1, len(rejected)) for k, hit in HITS.items()},
                               "mean_chain": sum(r.chain for r in rounds) / max(1, len(rounds))}
    return out


def validation(results: dict[TreeShape, list[PromptResult]], bench: dict) -> dict:
    """The replay against a measured run, on the prompts both hold: tokens per call of one path and the edge's trees,
    and (one path) how many prompts had the very same blocks."""
    by_name = {s.name: r for s, r in results.items()}
    rows = [r for r in bench["rows"] if r["proposer"] in BENCH_VARIANTS]
    common = sorted({r["prompt_id"] for r in rows} & {p.prompt_id for p in by_name["one path"]})
    out = {"prompts": common, "variants": {}}
    for variant, name in BENCH_VARIANTS.items():
        measured = [r for r in rows if r["proposer"] == variant and r["prompt_id"] in common]
        replayed = {p.prompt_id: p for p in by_name.get(name, []) if p.prompt_id in common}
        ours = list(replayed.values())
        if not measured or not replayed:
            continue
        out["variants"][variant] = {
            "bench_tokens_per_call": sum(r["tokens"] for r in measured) / sum(r["target_calls"] for r in measured),
            "replay_tokens_per_call": sum(p.tokens for p in ours) / sum(p.calls for p in ours),
            "bench_calls": sum(r["target_calls"] for r in measured), "replay_calls": sum(p.calls for p in ours),
            "same_tokens": sum(r["tokens"] == replayed[r["prompt_id"]].tokens for r in measured
                               if r["prompt_id"] in replayed),
            "same_blocks": sum(r["block_lengths"] == [x.chain for x in replayed[r["prompt_id"]].rounds]
                               for r in measured if r["prompt_id"] in replayed)}
    base = out["variants"].get("model")
    for row in out["variants"].values():
        if base:
            row["bench_x"] = row["bench_tokens_per_call"] / base["bench_tokens_per_call"]
            row["replay_x"] = row["replay_tokens_per_call"] / base["replay_tokens_per_call"]
    return out


def _md(header: Sequence[object], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table."""
    return "\n".join(["| " + " | ".join(map(str, header)) + " |", "| --- " * len(header) + "|"]
                     + ["| " + " | ".join(map(str, row)) + " |" for row in rows])


def report_table(settings: TreeShapesSettings, summary: dict) -> str:
    head = (f"greedy, {settings.target} <- {settings.draft} ({settings.dtype}), up to {settings.max_tokens} tokens, "
            f"{summary['ranks']['output_tokens']} output tokens; blocks end by goodput over the "
            f"{settings.estimate}'s estimates (draft {settings.draft_ms:g} ms/token, verify {settings.verify_ms:g} + "
            f"{settings.verify_per_token_ms:g} ms/token, RTT {settings.rtt_ms:g} ms); trees of at most "
            f"{settings.max_tree_tokens or 'any number of'} nodes")
    rows = []
    for budget, best in summary["best"].items():
        for label, name in best:
            s = summary["shapes"][name]
            fixed = name == "one path" or name.startswith(("edge:", "round-robin", "oracle-path"))
            rows.append([budget, label if fixed else f"{label}: {name}",  # a family's best: which member
                         f"{s['tokens_per_call']:.2f}", f"{s['x_one_path']:.3f}", f"{s['side_path_won']:.0%}",
                         f"{s['branch_tokens_per_round']:.2f}", f"{s['branch_kept_per_round']:.2f}"])
    parts = [head, _md(("branch tokens", "shape", "tokens/call", "x one path", "side path won",
                        "branch tokens sent/round", "kept/round"), rows),
             _grid(summary, "lowest", "All branch tokens at the lowest estimate: x one path, k alternatives (rows) x "
                                      "L tokens each (columns)"),
             _grid(summary, "oracle-at-rejection", "The same grid placed at the rejected position (oracle)"),
             _ranks(summary["ranks"]), _runs(summary["runs"]), _hits(summary["hits"])]
    if summary["validation"]:
        parts.append(_validation(summary["validation"]))
    return "\n\n".join(parts)


def _grid(summary: dict, family: str, title: str) -> str:
    cells = [[k] + [f"{c['x_one_path']:.3f}" if (c := summary["shapes"].get(f"{family}:{k}x{n}")) else ""
                    for n in LENGTHS] for k in range(1, GRID_ALTERNATIVES + 1)]
    return f"{title}:\n\n" + _md(["k \\ L", *LENGTHS], cells)


def _ranks(r: dict) -> str:
    cells = [f"{r['share'].get(k, 0):.0%}" for k in ("2", "3", "4", "5", "6-16", "none")]
    return (f"Rank of the target's token in the draft's row at the {r['rejections']} rejections (of "
            f"{r['output_tokens']} output positions):\n\n"
            + _md(("2", "3", "4", "5", "6-16", "not in the top 16"), [cells]))


def _runs(r: dict) -> str:
    return (f"After an alternative of rank 2-5 that is the target's token ({r['matches']} of them), the draft's "
            f"argmax follows the target for a run of (mean {r['mean_run']:.2f}; {r['runs_to_the_end']} to the "
            f"output's end):\n\n" + _md(RUN_BUCKETS, [[f"{r['run_share'][b]:.0%}" for b in RUN_BUCKETS]])
            + "\n\nso a branch of L tokens there keeps, beyond the chain's round, on average:\n\n"
            + _md(["L", *LENGTHS], [["kept"] + [f"{r['extra_kept_by_length'][str(L)]:.2f}" for L in LENGTHS]]))


def _hits(hits: dict) -> str:
    rows = [[name, h["rounds"], h["rejected_rounds"], f"{h['mean_chain']:.2f}", *(f"{h[k]:.0%}" for k in HITS)]
            for name, h in hits.items()]
    return ("Rounds whose chain was rejected: where the rejected token falls among the chain's estimates:\n\n"
            + _md(("replay", "rounds", "rejected", "mean chain", "lowest estimate", "lowest 2", "lowest 3",
                   "lowest draft prob.", "lowest 2 (draft)", "last token", "a branch beside it"), rows))


def _validation(v: dict) -> str:
    rows = [[variant, f"{r['bench_tokens_per_call']:.2f}", f"{r['replay_tokens_per_call']:.2f}",
             f"{r.get('bench_x', 1):.3f}", f"{r.get('replay_x', 1):.3f}", r["bench_calls"], r["replay_calls"],
             r["same_blocks"]] for variant, r in v["variants"].items()]
    return (f"The replay against the measured run on its {len(v['prompts'])} prompts:\n\n"
            + _md(("variant", "measured tokens/call", "replayed", "measured x one path", "replayed", "calls measured",
                   "replayed", "prompts with the same blocks"), rows))


def plot(summary: dict, path: Path) -> None:
    """x one path against branch tokens per round: the edge's and the round-robin shapes, the best grids within each
    budget, the oracles."""
    shapes = summary["shapes"]
    budgets = range(1, max(int(b) for b in summary["best"]) + 1)

    def envelope(prefix: str) -> list[float]:
        return [max((s["x_one_path"] for name, s in shapes.items() if name.startswith(prefix)
                     and s["tokens_spent"] <= b), default=float("nan")) for b in budgets]

    def each(prefix: str) -> list[float]:
        return [shapes[f"{prefix}:{b}"]["x_one_path"] for b in budgets]
    with saved_figure(path, figsize=(7, 4.5)) as (_, ax):
        for values, style, label in ((each("edge"), "o-", "the edge's shape"),
                                     (each("round-robin"), "x:", "round-robin"),
                                     (envelope("lowest:"), "s-", "best k x L at the lowest estimate"),
                                     (envelope("spread:"), "^-", "best spread over m points"),
                                     (envelope("nested:"), "v-", "best nested"),
                                     (envelope("oracle-at-rejection:"), "d--", "oracle: best k x L at the rejection"),
                                     (each("oracle-path"), "k--", "oracle: the target's path")):
            ax.plot(list(budgets), values, style, label=label)
        ax.axhline(1.25, color="grey", linestyle=":", label="goal 1.25x")
        ax.set(xlabel="branch tokens per round (at most)", ylabel="tokens per call, x one path")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
