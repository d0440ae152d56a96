r"""`sprinter bench proposer`: tokens per round trip with the draft model alone against suffix drafting, per category.

    sprinter bench proposer --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --dtype bfloat16 \
        --rtt-ms 50 --repeats 3 --out results/bench-proposer

The cloud runs as a process, the edge here, on the system under test (sim/sweep/system.py): each on half of this
process's cores (a core each on a two-core machine; both on the one core when run under `taskset -c N` on a shared
machine), the edge reaching the cloud through the link proxy (half the RTT each way). Every prompt of the suite
(sim/data/proposer_prompts.jsonl, written for this bench: code editing, summarization and
question answering over a given passage, multi-turn chat with its history, math word problems,
translation, plain code completion) is generated greedily with each `--proposer`, in `--repeats`
interleaved passes (the proposers' order alternates pass by pass). Suffix drafting's cache of earlier
outputs starts empty in each pass, so a prompt never copies its own earlier answer; the calibration of
its scores is the edge's own and learns across passes, as a serving edge's does across requests.

Prints, per mode, category and proposer, the medians over passes of: tokens per call (tokens kept per
target call, its own included), calls per token, tokens/s (wall, TTFT included) and the suffix share
(proposed tokens copied rather than drafted), with suffix's ratios to model's; and what a suffix lookup
costs. Writes OUT/results.json, OUT/table.md and OUT/proposers.png.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import httpx

from common.lab.plots import grouped_bars, saved_figure
from common.lab.prompt_sets import PromptRecord, load_prompts
from common.sampling.params import SamplingParams
from common.spec.modes import CLOUD_DRAFTING, DecodeSettings, parse_branch_tokens
from common.spec.propose.suffix_match import OutputCache
from common.spec.propose.suffix_proposer import DEFAULT_CACHE_TOKENS
from common.stats import oracle_calls_per_token
from edge.decoding.decoder import EdgeSettings
from edge.node import EdgeNode
from sim.bench.proposer_calibration import calibration_table, fit_calibration
from sim.bench.run_folder import RunFolder
from sim.bench.settings.sweeps import SUITE, TREE_SUFFIX, ProposerBenchSettings
from sim.sweep.baselines import LLAMA_SERVER, LocalBaselines, llama_server_alone
from sim.sweep.system import SystemSettings, SystemUnderTest, draft_label, generate, measure_edge_here

log = logging.getLogger(__name__)

TREE_COUNTS = ("tree_paths", "tree_rounds", "branch_tokens_sent", "branch_tokens_kept", "side_path_wins",
               "copy_branch_tokens", "copy_path_wins")
ROW_STATS = ("wall_s", "target_calls", "draft_forwards", "draft_fed_tokens", "suffix_tokens", "suffix_kept",
             "block_lengths", "accepted_lengths", *TREE_COUNTS)


def bench_proposer(settings: ProposerBenchSettings) -> str:
    """Measure every (pass, proposer, mode, prompt) and write OUT; return the table."""
    folder = RunFolder(settings.out)
    records = chosen_prompts(load_prompts(settings.prompts or SUITE), settings.categories, settings.per_category,
                             settings.skip_per_category)
    # cloud-sd: the cloud drafts; its copies come from each request's own text alone, since one identity's
    # cache there would let a proposer copy the same prompt's answer from another proposer's pass
    cloud_sd = CLOUD_DRAFTING in settings.modes
    system = SystemSettings(settings.target, settings.draft, settings.out, dtype=settings.dtype, engine=settings.engine,
                            cloud_drafts=cloud_sd, cloud_flags=("--suffix-cache", "off") if cloud_sd else (),
                            rtt_ms=settings.rtt_ms)
    rows, lookups_us, calibration = measure_edge_here(
        system, records, lambda sut, draft, ids: _measure(settings, sut, draft, list(zip(records, ids))))
    summary = summarize(rows, DecodeSettings(proposer="hybrid", k=settings.k).round_cap)
    lookup_us = statistics.median(lookups_us) if lookups_us else None
    cores = {"cloud": sorted(system.cores.cloud), "edge": sorted(system.cores.edge)}
    folder.write_results(settings, draft=draft_label(settings.draft_runtime, settings.dtype, settings.runtime_weights), cores=cores,
                         lookup_us_median=lookup_us, lookups=len(lookups_us), calibration=calibration, rows=rows,
                         summary=summary)
    text = folder.write_table(table(settings, summary, lookup_us, cores) + tree_table(summary)
                              + calibration_table(calibration))
    plot(summary, folder.path("proposers.png"))
    if settings.fit_calibration is not None:
        fitted = fit_calibration(calibration, "greedy" if settings.greedy else "sampled",
                                 f"{settings.draft} -> {settings.target}, {settings.dtype}, T={settings.temperature:g}, "
                                 f"{len(records)} prompts x {settings.repeats} passes (sprinter bench proposer)")
        settings.fit_calibration.write_text(json.dumps(fitted, indent=1) + "\n")
        text += f"\n\nwrote the fitted calibration to {settings.fit_calibration}"
    return text


def chosen_prompts(records: list[PromptRecord], categories: tuple[str, ...], per_category: int | None,
                   skip: int = 0) -> list[PromptRecord]:
    """The suite's prompts in `categories` (all when empty): of each, `per_category` after the first `skip`."""
    last = skip + (per_category if per_category is not None else len(records))
    seen: Counter[str] = Counter()
    chosen = []
    for record in (r for r in records if not categories or r.category in categories):
        seen[record.category] += 1
        if skip < seen[record.category] <= last:
            chosen.append(record)
    return chosen


async def _measure(settings: ProposerBenchSettings, system: SystemUnderTest, draft,
                   prompts: list[tuple[PromptRecord, list[int]]]) -> tuple[list[dict], list[float], list[dict]]:
    node = await system.edge_node(draft, draft_runtime=settings.draft_runtime, draft_weights=settings.runtime_weights,
                                  verifier="auto", suffix_cache=settings.suffix_cache == "on")
    rows: list[dict] = []
    lookups_us: list[float] = []
    variants = settings.variants + ((LLAMA_SERVER,) if settings.baseline == LLAMA_SERVER else ())
    cores = system.settings.cores
    alone = llama_server_alone(settings.target, settings.draft, settings.out, cores.cloud if cores else None) \
        if settings.baseline == LLAMA_SERVER else nullcontext()
    with alone as baseline:  # the baseline's rows: LLAMA_SERVER their mode and their proposer
        async with httpx.AsyncClient(timeout=600) as client:
            for variant in variants:  # warm every path (the cloud, llama-server) before timing
                if variant == LLAMA_SERVER:
                    await baseline.stream(client, LLAMA_SERVER, prompts[0][1], 8)
                else:
                    await node.decoder.generate(prompts[0][1], _edge_settings(settings, settings.modes[0], variant, 8))
            for run in range(settings.repeats):
                for variant in variants if run % 2 == 0 else tuple(reversed(variants)):
                    if variant == LLAMA_SERVER:
                        rows += [await _baseline_request(baseline, client, settings, run, record, ids)
                                 for record, ids in prompts]
                        continue
                    # no copies of a past pass's outputs; the scores' calibration is the edge's and goes on learning
                    memory = node.decoder.suffix_memory
                    memory.cache = OutputCache(DEFAULT_CACHE_TOKENS) if settings.suffix_cache == "on" else None
                    memory.match_us.clear()
                    for mode in settings.modes:
                        for record, ids in prompts:
                            rows.append(await _request(node, settings, run, variant, mode, record, ids))
                    lookups_us += memory.match_us
    return rows, lookups_us, node.decoder.suffix_memory.calibration_for(settings.greedy).report()


async def _baseline_request(baseline: LocalBaselines, client: httpx.AsyncClient, settings: ProposerBenchSettings,
                            run: int, record: PromptRecord, ids: list[int]) -> dict:
    """llama-server alone for the same token ids, sampled with the pass's seed (it has no link): a target forward per
    token, so a call per token."""
    streamed = await baseline.stream(client, LLAMA_SERVER, ids, settings.max_tokens, settings.temperature, run)
    tokens = len(streamed["token_ids"])
    log.info("pass %d llama-server on %s: %d tokens, %.2f tokens/s", run, record.id, tokens,
             tokens / streamed["wall_s"])
    return {"run": run, "proposer": LLAMA_SERVER, "mode": LLAMA_SERVER, "category": record.category,
            "prompt_id": record.id, "tokens": tokens, "wall_s": streamed["wall_s"], "target_calls": tokens,
            "draft_forwards": 0, "draft_fed_tokens": 0, "suffix_tokens": 0, "suffix_kept": 0,
            "block_lengths": [], "accepted_lengths": [], **dict.fromkeys(TREE_COUNTS, 0)}


def _edge_settings(settings: ProposerBenchSettings, mode: str, variant: str, max_tokens: int,
                   seed: int = 0) -> EdgeSettings:
    sampling = SamplingParams(temperature=settings.temperature, seed=seed)
    proposer, _, branch = variant.partition(TREE_SUFFIX)
    return EdgeSettings(DecodeSettings(mode=mode, max_new_tokens=max_tokens, k=settings.k, proposer=proposer,
                                       sampling=sampling, branch_tokens=parse_branch_tokens(branch or "0")))


async def _request(node: EdgeNode, settings: ProposerBenchSettings, run: int, proposer: str, mode: str,
                   record: PromptRecord, ids: list[int]) -> dict:
    # a pass's seed is shared by its proposers: under sampling each pass draws its own answers, alike for all
    result, _ = await generate(node, ids, _edge_settings(settings, mode, proposer, settings.max_tokens, run),
                               f"{proposer} {mode} on {record.id}")
    s = result.stats
    log.info("pass %d %s %s %s: %d tokens, %.2f tokens/call, %.2f tokens/s, suffix share %.2f", run, proposer, mode,
             record.id, s.new_tokens, s.tokens_per_call or 0, s.tokens_per_s, s.suffix_share or 0)
    return {"run": run, "proposer": proposer, "mode": mode, "category": record.category, "prompt_id": record.id,
            "tokens": s.new_tokens, **{name: getattr(s, name) for name in ROW_STATS}}


def oracle_rate(totals: dict, cap: int) -> float:
    """The hindsight oracle's calls per token on a pass's acceptance record (common.stats): a verifier that sends
    each block at its first rejected token. The opens (a call each, in every proposer) count as they are."""
    rate = oracle_calls_per_token(totals["block_lengths"], totals["accepted_lengths"], cap)
    opens = max(0.0, totals["target_calls"] - len(totals["block_lengths"]))
    return (opens + (rate or 0.0) * max(0.0, totals["tokens"] - opens)) / max(1.0, totals["tokens"])


def summarize(rows: list[dict], cap: int = 20) -> list[dict]:
    """Per (mode, category, proposer): each pass's totals over its prompts, then the medians over passes; `cap`:
    the longest block the hindsight oracle may send (the run-length cap)."""
    groups: dict[tuple[str, str, str], dict[int, dict[str, float]]] = {}
    for r in rows:
        for category in (r["category"], "all"):
            per_run = groups.setdefault((r["mode"], category, r["proposer"]), {})
            totals = per_run.setdefault(r["run"], {**dict.fromkeys(
                ("tokens", "wall_s", "target_calls", "draft_forwards", "suffix_tokens", "suffix_kept", *TREE_COUNTS), 0.0),
                "block_lengths": [], "accepted_lengths": []})
            for name in totals:
                totals[name] += r.get(name, [] if name.endswith("lengths") else 0.0)
    summary = []
    for (mode, category, proposer), per_run in groups.items():
        passes = list(per_run.values())

        def median(f) -> float:
            return statistics.median(f(t) for t in passes)
        summary.append({
            "mode": mode, "category": category, "proposer": proposer, "passes": len(passes),
            "tokens_per_call": median(lambda t: t["tokens"] / max(1, t["target_calls"])),
            "calls_per_token": median(lambda t: t["target_calls"] / max(1, t["tokens"])),
            "tokens_per_s": median(lambda t: t["tokens"] / t["wall_s"]),
            "suffix_share": median(lambda t: t["suffix_tokens"] / max(1, t["suffix_tokens"] + t["draft_forwards"])),
            "suffix_kept_share": median(lambda t: t["suffix_kept"] / max(1, t["suffix_tokens"])),
            "oracle_calls_per_token": median(lambda t: oracle_rate(t, cap)),
            **{name: sum(t[name] for t in passes) for name in TREE_COUNTS}})
    for row in summary:  # suffix's ratios to model's, same mode and category
        base = next((b for b in summary if b["proposer"] == "model" and (b["mode"], b["category"])
                     == (row["mode"], row["category"])), None)
        row["tokens_per_call_x"] = row["tokens_per_call"] / base["tokens_per_call"] if base else None
        row["tokens_per_s_x"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
        alone = next((b for b in summary if b["proposer"] == LLAMA_SERVER and b["category"] == row["category"]), None)
        row["tokens_per_s_x_llama_server"] = row["tokens_per_s"] / alone["tokens_per_s"] if alone else None
    return sorted(summary, key=lambda r: (r["mode"], r["category"] == "all", r["category"], r["proposer"]))


def table(settings: ProposerBenchSettings, summary: list[dict], lookup_us: float | None,
          cores: dict[str, list[int]] | None = None) -> str:
    pinned = ""
    if cores is not None:
        pinned = ("; cloud and edge share core " + ",".join(map(str, cores["cloud"])) if cores["cloud"] == cores["edge"]
                  else f"; cloud on core(s) {','.join(map(str, cores['cloud']))}, edge on {','.join(map(str, cores['edge']))}")
    regime = "greedy" if settings.greedy else f"T={settings.temperature:g}"
    lines = [f"{regime}, {settings.target} <- {settings.draft} ({settings.dtype}), RTT {settings.rtt_ms:g} ms, k={settings.k}, "
             f"up to {settings.max_tokens} tokens, medians of {settings.repeats} interleaved passes; suffix cache "
             f"{settings.suffix_cache}; draft {draft_label(settings.draft_runtime, settings.dtype, settings.runtime_weights)}"
             + (f"; a suffix lookup costs {lookup_us:.0f} us (median)" if lookup_us is not None else "") + pinned,
             "",
             "| mode | category | proposer | tokens/call | calls/token | calls/token x oracle | tokens/s | suffix share "
             "| copies kept | tokens/call x | tokens/s x | tokens/s x llama-server |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in summary:
        over_alone = r.get("tokens_per_s_x_llama_server")
        ratio = (f"{r['tokens_per_call_x']:.2f} | {r['tokens_per_s_x']:.2f}" if r["proposer"] != "model"
                 and r["tokens_per_call_x"] is not None else "- | -")
        lines.append(f"| {r['mode']} | {r['category']} | {r['proposer']} | {r['tokens_per_call']:.2f} | "
                     f"{r['calls_per_token']:.3f} | {_x(r['calls_per_token'], r.get('oracle_calls_per_token'))} | "
                     f"{r['tokens_per_s']:.2f} | {r['suffix_share']:.2f} | "
                     f"{r['suffix_kept_share']:.2f} | {ratio} | "
                     + (f"{over_alone:.2f} |" if over_alone is not None else "- |"))
    return "\n".join(lines)


def tree_table(summary: list[dict]) -> str:
    """What the variants with branching sent and kept, summed over passes (empty when none branched)."""
    rows = [r for r in summary if r["tree_rounds"]]
    if not rows:
        return ""
    lines = ["", "", "Trees (sums over passes): rounds sent as a tree, their paths per round, branch tokens sent and kept "
             "per tree round, the share of tree rounds whose kept path left the primary chain; of the branch tokens "
             "sent, those copied from text per tree round, and the share of tree rounds whose kept path left through a "
             "copy.", "",
             "| mode | category | variant | tree rounds | paths/round | branch tokens sent/round | kept/round "
             "| side path won | copied/round | copy path won |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        n = r["tree_rounds"]
        lines.append(f"| {r['mode']} | {r['category']} | {r['proposer']} | {n:.0f} | {r['tree_paths'] / n:.2f} | "
                     f"{r['branch_tokens_sent'] / n:.2f} | {r['branch_tokens_kept'] / n:.2f} | "
                     f"{r['side_path_wins'] / n:.2f} | {r['copy_branch_tokens'] / n:.2f} | "
                     f"{r['copy_path_wins'] / n:.2f} |")
    return "\n".join(lines)


def _x(value: float, oracle: float | None) -> str:
    return f"{value / oracle:.2f}" if oracle else "-"


def plot(summary: list[dict], path: Path) -> None:
    """Tokens per call and tokens/s per category, a bar per proposer (the first mode measured)."""
    mode = summary[0]["mode"] if summary else ""
    rows = [r for r in summary if r["mode"] == mode]
    categories = sorted({r["category"] for r in rows}, key=lambda c: (c == "all", c))
    proposers = sorted({r["proposer"] for r in rows}, key=lambda p: (p != "model", p))

    def value(metric: str, category: str, proposer: str) -> float:
        return next((r[metric] for r in rows if r["category"] == category and r["proposer"] == proposer), 0.0)
    with saved_figure(path, 1, 2, figsize=(10, 4)) as (fig, axes):
        for ax, metric, label in zip(axes, ("tokens_per_call", "tokens_per_s"), ("tokens per call", "tokens/s")):
            grouped_bars(ax, categories, {p: [value(metric, c, p) for c in categories] for p in proposers},
                         rotation=30, ha="right", fontsize=8)
            ax.set_ylabel(f"{label} ({mode})")
            ax.legend(fontsize=8)
