"""What `sprinter bench tree-shapes` reports: tokens per call by shape and budget, the rejections' ranks and runs,
where the chain's rejections fall among its estimates, and the replay against a measured `bench proposer` run."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from common.lab.plots import pyplot
from sim.bench.tree_rounds import PromptResult, TreeShape
from sim.bench.tree_traces import PromptTrace

LENGTHS = range(1, 9)
RUN_BUCKETS = ("0", "1", "2", "3", "4-7", "8+")
# `bench proposer`'s variants and the shapes that replay them (its trees are the edge's)
BENCH_VARIANTS = {"model": "one path", "model+tree:6": "edge:6", "model+tree:16": "edge:16"}


def summarize(traces: list[PromptTrace], results: dict[TreeShape, list[PromptResult]], budgets: tuple[int, ...],
              oracle_rank: int, bench: dict | None) -> dict:
    base = totals(results[next(s for s in results if s.kind == "chain")])
    shapes = {s.name: {"kind": s.kind, "tokens_spent": s.tokens, **totals(r, base)} for s, r in results.items()}
    return {"shapes": shapes, "best": {str(b): best_rows(results, shapes, b) for b in budgets},
            "ranks": rank_stats(traces, oracle_rank), "runs": run_stats(traces),
            "hits": hit_stats(results, budgets), "validation": validation(results, bench) if bench else None}


def totals(prompts: list[PromptResult], base: dict | None = None) -> dict:
    rounds = [r for p in prompts for r in p.rounds]
    tokens, calls = sum(p.tokens for p in prompts), sum(p.calls for p in prompts)
    row = {"tokens": tokens, "calls": calls, "tokens_per_call": tokens / max(1, calls), "rounds": len(rounds),
           "side_path_won": sum(r.kept > r.chain_kept for r in rounds) / max(1, len(rounds)),
           "branch_tokens_per_round": sum(r.branch_tokens for r in rounds) / max(1, len(rounds)),
           "branch_kept_per_round": sum(r.kept - r.chain_kept for r in rounds) / max(1, len(rounds))}
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
            (f"oracle: the target's path from the rejection", f"oracle-path:{budget}")]
    return [[label, name] for label, name in rows if name in shapes]


def rank_stats(traces: list[PromptTrace], oracle_rank: int) -> dict:
    """At every teacher-forced rejection: the rank of the target's token in the draft's row."""
    ranks = [t.rows[j].rank_of(t.output[j]) for t in traces for j in t.rejections()]
    count = Counter("none" if r is None else str(r) if r <= 5 else "6-16" for r in ranks)
    n = max(1, len(ranks))
    return {"rejections": len(ranks), "output_tokens": sum(len(t.output) for t in traces),
            "counts": dict(count), "share": {k: v / n for k, v in count.items()},
            "share_rank_2": sum(r == 2 for r in ranks) / n, "share_rank_le_3": sum(r is not None and r <= 3 for r in ranks) / n,
            "share_rank_le_4": sum(r is not None and r <= 4 for r in ranks) / n,
            f"share_rank_le_{oracle_rank}": sum(r is not None and r <= oracle_rank for r in ranks) / n}


def run_stats(traces: list[PromptTrace]) -> dict:
    """Where an alternative of rank 2..5 is the target's token: how many tokens after it the draft's argmax follows
    the target (the run), and what a branch of length L keeps there beyond the chain's round: 1 + min(run, L - 1)."""
    runs = []
    for t in traces:
        for j in t.rejections():
            rank = t.rows[j].rank_of(t.output[j])
            if rank is not None and rank <= 5:
                run = 0
                while j + 1 + run < len(t.output) and t.rows[j + 1 + run].token == t.output[j + 1 + run]:
                    run += 1
                runs.append((rank, run, j + 1 + run >= len(t.output)))
    buckets = Counter(_bucket(run) for _, run, _ in runs)
    n = max(1, len(runs))
    return {"matches": len(runs), "run_share": {b: buckets.get(b, 0) / n for b in RUN_BUCKETS},
            "mean_run": sum(run for _, run, _ in runs) / n,
            "runs_to_the_end": sum(end for *_, end in runs),
            "extra_kept_by_length": {str(L): sum(1 + min(run, L - 1) for _, run, _ in runs) / n for L in LENGTHS}}


def _bucket(run: int) -> str:
    return str(run) if run <= 3 else "4-7" if run < 8 else "8+"


def hit_stats(results: dict[TreeShape, list[PromptResult]], budgets: tuple[int, ...]) -> dict:
    """Rounds whose chain was rejected: is the rejected token the lowest estimate (or among the 2, 3 lowest), the
    lowest draft probability, the chain's last token; do the edge's and the round-robin trees branch beside it."""
    reported = {f"{kind}:{b}" for kind in ("edge", "round-robin") for b in budgets}
    out = {}
    for shape, prompts in results.items():
        if shape.kind != "chain" and shape.name not in reported:
            continue
        rejected = [r for p in prompts for r in p.rounds if r.rejection is not None]
        n = max(1, len(rejected))
        out[shape.name] = {
            "rounds": sum(len(p.rounds) for p in prompts), "rejected_rounds": len(rejected),
            "lowest": sum(r.lowest[0] == r.rejection for r in rejected) / n,
            "lowest_2": sum(r.rejection in r.lowest[:2] for r in rejected) / n,
            "lowest_3": sum(r.rejection in r.lowest[:3] for r in rejected) / n,
            "draft_lowest": sum(r.draft_lowest[0] == r.rejection for r in rejected) / n,
            "draft_lowest_2": sum(r.rejection in r.draft_lowest[:2] for r in rejected) / n,
            "last_token": sum(r.rejection == r.chain - 1 for r in rejected) / n,
            "branched_beside_it": sum(r.at_rejection > 0 for r in rejected) / n,
            "mean_chain": sum(r.chain for p in prompts for r in p.rounds) / max(1, sum(len(p.rounds) for p in prompts))}
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
        replayed = [p for p in by_name.get(name, []) if p.prompt_id in common]
        if not measured or not replayed:
            continue
        out["variants"][variant] = {
            "bench_tokens_per_call": sum(r["tokens"] for r in measured) / sum(r["target_calls"] for r in measured),
            "replay_tokens_per_call": sum(p.tokens for p in replayed) / sum(p.calls for p in replayed),
            "bench_calls": sum(r["target_calls"] for r in measured), "replay_calls": sum(p.calls for p in replayed),
            "same_tokens": sum(r["tokens"] == p.tokens for r in measured for p in replayed
                               if p.prompt_id == r["prompt_id"]),
            "same_blocks": sum(r["block_lengths"] == [x.chain for x in p.rounds] for r in measured for p in replayed
                               if p.prompt_id == r["prompt_id"])}
    base = out["variants"].get("model")
    for row in out["variants"].values():
        if base:
            row["bench_x"] = row["bench_tokens_per_call"] / base["bench_tokens_per_call"]
            row["replay_x"] = row["replay_tokens_per_call"] / base["replay_tokens_per_call"]
    return out


def report_table(settings, summary: dict) -> str:
    c = settings.costs
    lines = [f"greedy, {settings.target} <- {settings.draft} ({settings.dtype}), up to {settings.max_tokens} tokens, "
             f"{summary['ranks']['output_tokens']} output tokens; blocks end by goodput over the "
             f"{settings.estimate}'s estimates (draft {c.draft_ms:g} ms/token, verify {c.verify_ms:g} + "
             f"{c.verify_per_token_ms:g} ms/token, RTT {c.rtt_ms:g} ms); trees of at most "
             f"{settings.max_tree_tokens or 'any number of'} nodes", "",
             "| branch tokens | shape | tokens/call | x one path | side path won | branch tokens sent/round "
             "| kept/round |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for budget, rows in summary["best"].items():
        for label, name in rows:
            s = summary["shapes"][name]
            fixed = name == "one path" or name.startswith(("edge:", "round-robin", "oracle-path"))
            shown = label if fixed else f"{label}: {name}"  # a family's best: which member
            lines.append(f"| {budget} | {shown} | {s['tokens_per_call']:.2f} | {s['x_one_path']:.3f} | "
                         f"{s['side_path_won']:.0%} | {s['branch_tokens_per_round']:.2f} | "
                         f"{s['branch_kept_per_round']:.2f} |")
    lines += ["", _grid(summary, "lowest", "All branch tokens at the lowest estimate: x one path, k alternatives "
                                           "(rows) x L tokens each (columns)")]
    lines += ["", _grid(summary, "oracle-at-rejection", "The same grid placed at the rejected position (oracle)")]
    lines += ["", _ranks(summary["ranks"]), "", _runs(summary["runs"]), "", _hits(summary["hits"])]
    if summary["validation"]:
        lines += ["", _validation(summary["validation"])]
    return "\n".join(lines)


def _grid(summary: dict, family: str, title: str) -> str:
    lines = [title + ":", "", "| k \\ L | " + " | ".join(map(str, LENGTHS)) + " |", "| --- " * (len(LENGTHS) + 1) + "|"]
    for k in range(1, 5):
        cells = [summary["shapes"].get(f"{family}:{k}x{n}") for n in LENGTHS]
        lines.append(f"| {k} | " + " | ".join(f"{c['x_one_path']:.3f}" if c else "" for c in cells) + " |")
    return "\n".join(lines)


def _ranks(r: dict) -> str:
    share = r["share"]
    cells = " | ".join(f"{share.get(k, 0):.0%}" for k in ("2", "3", "4", "5", "6-16", "none"))
    return (f"Rank of the target's token in the draft's row at the {r['rejections']} rejections (of "
            f"{r['output_tokens']} output positions):\n\n| 2 | 3 | 4 | 5 | 6-16 | not in the top 16 |\n"
            f"| --- | --- | --- | --- | --- | --- |\n| {cells} |")


def _runs(r: dict) -> str:
    runs = " | ".join(f"{r['run_share'][b]:.0%}" for b in RUN_BUCKETS)
    kept = " | ".join(f"{r['extra_kept_by_length'][str(L)]:.2f}" for L in LENGTHS)
    return (f"After an alternative of rank 2-5 that is the target's token ({r['matches']} of them), the draft's "
            f"argmax follows the target for a run of (mean {r['mean_run']:.2f}; {r['runs_to_the_end']} to the "
            f"output's end):\n\n| " + " | ".join(RUN_BUCKETS) + " |\n" + "| --- " * len(RUN_BUCKETS) + f"|\n| {runs} |"
            f"\n\nso a branch of L tokens there keeps, beyond the chain's round, on average:\n\n| L | "
            + " | ".join(map(str, LENGTHS)) + " |\n" + "| --- " * (len(LENGTHS) + 1) + f"|\n| kept | {kept} |")


def _hits(hits: dict) -> str:
    lines = ["Rounds whose chain was rejected: where the rejected token falls among the chain's estimates:", "",
             "| replay | rounds | rejected | mean chain | lowest estimate | lowest 2 | lowest 3 | lowest draft prob. "
             "| lowest 2 (draft) | last token | a branch beside it |", "| --- " * 11 + "|"]
    for name, h in hits.items():
        lines.append(f"| {name} | {h['rounds']} | {h['rejected_rounds']} | {h['mean_chain']:.2f} | {h['lowest']:.0%} | "
                     f"{h['lowest_2']:.0%} | {h['lowest_3']:.0%} | {h['draft_lowest']:.0%} | {h['draft_lowest_2']:.0%} "
                     f"| {h['last_token']:.0%} | {h['branched_beside_it']:.0%} |")
    return "\n".join(lines)


def _validation(v: dict) -> str:
    lines = [f"The replay against the measured run on its {len(v['prompts'])} prompts:", "",
             "| variant | measured tokens/call | replayed | measured x one path | replayed | calls measured | replayed "
             "| prompts with the same blocks |", "| --- " * 8 + "|"]
    for variant, r in v["variants"].items():
        lines.append(f"| {variant} | {r['bench_tokens_per_call']:.2f} | {r['replay_tokens_per_call']:.2f} | "
                     f"{r.get('bench_x', 1):.3f} | {r.get('replay_x', 1):.3f} | {r['bench_calls']} | "
                     f"{r['replay_calls']} | {r['same_blocks']} |")
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    """x one path against branch tokens per round: the edge's and the round-robin shapes, the best grids within each
    budget, the oracles."""
    plt = pyplot()
    shapes = summary["shapes"]
    most = max(int(b) for b in summary["best"])
    budgets = list(range(1, most + 1))

    def envelope(prefix: str, points: bool | None = None) -> list[float]:
        out = []
        for b in budgets:
            fits = [s["x_one_path"] for name, s in shapes.items() if name.startswith(prefix) and s["tokens_spent"] <= b]
            out.append(max(fits) if fits else float("nan"))
        return out
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(budgets, [shapes[f"edge:{b}"]["x_one_path"] for b in budgets], "o-", label="the edge's shape")
    ax.plot(budgets, [shapes[f"round-robin:{b}"]["x_one_path"] for b in budgets], "x:", label="round-robin")
    ax.plot(budgets, envelope("lowest:"), "s-", label="best k x L at the lowest estimate")
    ax.plot(budgets, envelope("spread:"), "^-", label="best spread over m points")
    ax.plot(budgets, envelope("nested:"), "v-", label="best nested")
    ax.plot(budgets, envelope("oracle-at-rejection:"), "d--", label="oracle: best k x L at the rejection")
    ax.plot(budgets, [shapes[f"oracle-path:{b}"]["x_one_path"] for b in budgets], "k--", label="oracle: the target's path")
    ax.axhline(1.25, color="grey", linestyle=":", label="goal 1.25x")
    ax.set_xlabel("branch tokens per round (at most)")
    ax.set_ylabel("tokens per call, x one path")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
