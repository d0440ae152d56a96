r"""`sprinter bench proposer`: tokens per round trip with the draft model alone against suffix drafting, per category.

    sprinter bench proposer --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --dtype bfloat16 \
        --rtt-ms 50 --repeats 3 --out results/bench-proposer

The cloud runs as a process, the edge here, each on half of this process's cores (a core each on a
two-core machine; both on the one core when run under `taskset -c N` on a shared machine); the
edge reaches the cloud through the link proxy (sim/link/proxy.py: half the RTT each way). Every prompt
of the suite (sim/data/proposer_prompts.jsonl, written for this bench: code editing, summarization and
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

import asyncio
import json
import logging
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from common.spec.modes import CLOUD_DRAFTING, PROPOSERS, DecodeSettings, parse_branch_tokens
from common.spec.propose.suffix_match import OutputCache
from common.spec.propose.suffix_proposer import DEFAULT_CACHE_TOKENS
from common.model.loading import DTYPES, load_model
from common.lab.plots import pyplot
from common.lab.prompt_sets import PromptRecord, load_prompts
from common.model.prompting import encode_prompt
from common.sampling.params import SamplingParams
from common.stats import oracle_calls_per_token
from edge.decoding.decoder import EdgeSettings
from edge.node import EdgeNode, EdgeNodeSettings
from sim.bench.proposer_calibration import calibration_table, fit_calibration
from sim.link.proxy import LinkProxy
from sim.link.shaping import LinkSettings
from sim.processes import cloud_process

log = logging.getLogger(__name__)

TREE_SUFFIX = "+tree:"  # a variant's label: the proposer, then its branch budget (common/spec/tree/branching.py)
TREE_COUNTS = ("tree_paths", "tree_rounds", "branch_tokens_sent", "branch_tokens_kept", "side_path_wins",
               "copy_branch_tokens", "copy_path_wins")

SUITE = Path(__file__).resolve().parent.parent / "data" / "proposer_prompts.jsonl"
GROUNDED = ("code-edit", "summarize", "passage-qa")  # where the answer copies from the prompt: the goal


@dataclass(frozen=True)
class ProposerBenchSettings:
    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    dtype: str = "bfloat16"
    draft_runtime: str = "torch"
    rtt_ms: float = 50.0
    modes: tuple[str, ...] = ("sd-block",)
    proposers: tuple[str, ...] = PROPOSERS
    repeats: int = 3
    per_category: int | None = None  # the first N prompts of each category; None: all
    categories: tuple[str, ...] = ()  # empty: every category of the suite
    max_tokens: int = 128
    k: int = 5
    suffix_cache: bool = True
    prompts: Path = SUITE
    out: Path = Path("results/bench-proposer")
    temperature: float = 0.0  # 0: greedy; else sampled, each pass with its own seed
    skip_per_category: int = 0  # leave out the first N prompts of each category (prompt 1 is held out of fitting)
    fit_calibration: Path | None = None  # write the copies' rates measured here, to ship beside the verifier
    branch_tokens: tuple[str, ...] = ("0",)  # --branch-tokens of each variant: "0" (one path), a count, or "auto"

    @property
    def variants(self) -> tuple[str, ...]:
        """Each proposer with each branch budget: `model`, or `model+tree:auto` with branching on."""
        return tuple(p if b == "0" else f"{p}{TREE_SUFFIX}{b}" for p in self.proposers for b in self.branch_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def bench_proposer(settings: ProposerBenchSettings) -> str:
    """Measure every (pass, proposer, mode, prompt) and write OUT; return the table."""
    settings.out.mkdir(parents=True, exist_ok=True)
    records = chosen_prompts(load_prompts(settings.prompts), settings.categories, settings.per_category,
                             settings.skip_per_category)
    mine = os.sched_getaffinity(0)
    cloud_cpus, edge_cpus = pinning(mine)
    os.sched_setaffinity(0, edge_cpus)
    torch.set_num_threads(len(edge_cpus))
    try:
        draft = load_model(settings.draft, DTYPES[settings.dtype])
        prompts = [(r, encode_prompt(draft.tokenizer, r.prompt, r.chat)) for r in records]
        # cloud-sd: the cloud drafts; its copies come from each request's own text alone, since one identity's
        # cache there would let a proposer copy the same prompt's answer from another proposer's pass
        cloud_draft = (("--draft", settings.draft, "--suffix-cache", "off") if CLOUD_DRAFTING in settings.modes
                       else ())
        with cloud_process("--target", settings.target, "--dtype", settings.dtype, *cloud_draft,
                           log_path=settings.out / "cloud.log", cpus=cloud_cpus,
                           env={"OMP_NUM_THREADS": str(len(cloud_cpus))}) as address:
            host, _, port = address.rpartition(":")
            rows, lookups_us, calibration = asyncio.run(_measure(settings, draft, prompts, (host, int(port))))
    finally:
        os.sched_setaffinity(0, mine)
    summary = summarize(rows, DecodeSettings(proposer="hybrid", k=settings.k).round_cap)
    report = {"settings": {**asdict(settings), "out": str(settings.out), "prompts": str(settings.prompts)},
              "lookup_us_median": statistics.median(lookups_us) if lookups_us else None,
              "lookups": len(lookups_us), "calibration": calibration, "rows": rows, "summary": summary}
    (settings.out / "results.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    report["cores"] = {"cloud": sorted(cloud_cpus), "edge": sorted(edge_cpus)}
    text = (table(settings, summary, report["lookup_us_median"], report["cores"]) + tree_table(summary)
            + calibration_table(calibration))
    (settings.out / "table.md").write_text(text + "\n")
    plot(summary, settings.out / "proposers.png")
    if settings.fit_calibration is not None:
        fitted = fit_calibration(calibration, "greedy" if settings.greedy else "sampled",
                                 f"{settings.draft} -> {settings.target}, {settings.dtype}, T={settings.temperature:g}, "
                                 f"{len(records)} prompts x {settings.repeats} passes (sprinter bench proposer)")
        settings.fit_calibration.write_text(json.dumps(fitted, indent=1) + "\n")
        text += f"\n\nwrote the fitted calibration to {settings.fit_calibration}"
    return text


def pinning(cores: set[int]) -> tuple[set[int], set[int]]:
    """(the cloud's cores, the edge's): one each on a small machine, as the edge and cloud of a deployment have their
    own; both on the one core this process may use when it was given one (`taskset -c N`: a shared machine). A
    round's drafting and its verify mostly take turns, so sharing a core changes less than it seems."""
    ordered = sorted(cores)
    if len(ordered) == 1:
        return set(ordered), set(ordered)
    half = len(ordered) // 2
    return set(ordered[:half]), set(ordered[half:])


def chosen_prompts(records: list[PromptRecord], categories: tuple[str, ...], per_category: int | None,
                   skip: int = 0) -> list[PromptRecord]:
    """The suite's prompts in `categories` (all when empty): of each, `per_category` after the first `skip`."""
    taken: dict[str, int] = {}
    seen: dict[str, int] = {}
    chosen = []
    for record in records:
        if categories and record.category not in categories:
            continue
        seen[record.category] = seen.get(record.category, 0) + 1
        if seen[record.category] <= skip:
            continue
        if per_category is not None and taken.get(record.category, 0) >= per_category:
            continue
        taken[record.category] = taken.get(record.category, 0) + 1
        chosen.append(record)
    return chosen


async def _measure(settings: ProposerBenchSettings, draft, prompts: list[tuple[PromptRecord, list[int]]],
                   upstream: tuple[str, int]) -> tuple[list[dict], list[float], list[dict]]:
    link = LinkSettings(delay_ms=settings.rtt_ms / 2)
    rows: list[dict] = []
    lookups_us: list[float] = []
    async with LinkProxy(link, upstream) as proxy:
        node_settings = EdgeNodeSettings(draft=settings.draft, cloud=proxy.address, draft_runtime=settings.draft_runtime,
                                         dtype=settings.dtype, verifier="auto", suffix_cache=settings.suffix_cache)
        async with EdgeNode(node_settings, draft) as node:
            for proposer in settings.variants:  # warm every path (and the cloud) before timing
                await node.decoder.generate(prompts[0][1], _edge_settings(settings, settings.modes[0], proposer, 8))
            for run in range(settings.repeats):
                order = settings.variants if run % 2 == 0 else tuple(reversed(settings.variants))
                for proposer in order:
                    # no copies of a past pass's outputs; the scores' calibration is the edge's and goes on learning
                    node.decoder.suffix_memory.cache = OutputCache(DEFAULT_CACHE_TOKENS) if settings.suffix_cache else None
                    node.decoder.suffix_memory.match_us.clear()
                    for mode in settings.modes:
                        for record, ids in prompts:
                            rows.append(await _request(node, settings, run, proposer, mode, record, ids))
                    lookups_us += node.decoder.suffix_memory.match_us
            return rows, lookups_us, node.decoder.suffix_memory.calibration_for(settings.greedy).report()


def _edge_settings(settings: ProposerBenchSettings, mode: str, variant: str, max_tokens: int,
                   seed: int = 0) -> EdgeSettings:
    sampling = SamplingParams(temperature=settings.temperature, seed=seed)
    proposer, _, branch = variant.partition(TREE_SUFFIX)
    return EdgeSettings(DecodeSettings(mode=mode, max_new_tokens=max_tokens, k=settings.k, proposer=proposer,
                                       sampling=sampling, branch_tokens=parse_branch_tokens(branch or "0")))


async def _request(node: EdgeNode, settings: ProposerBenchSettings, run: int, proposer: str, mode: str,
                   record: PromptRecord, ids: list[int]) -> dict:
    # a pass's seed is shared by its proposers: under sampling each pass draws its own answers, alike for all
    result = await node.decoder.generate(ids, _edge_settings(settings, mode, proposer, settings.max_tokens, run))
    if result.degraded or result.error:
        raise RuntimeError(f"{proposer} {mode} on {record.id} lost the cloud: {result.degraded_reason or result.error}")
    s = result.stats
    log.info("pass %d %s %s %s: %d tokens, %.2f tokens/call, %.2f tokens/s, suffix share %.2f", run, proposer, mode,
             record.id, s.new_tokens, s.tokens_per_call or 0, s.tokens_per_s, s.suffix_share or 0)
    return {"run": run, "proposer": proposer, "mode": mode, "category": record.category, "prompt_id": record.id,
            "tokens": s.new_tokens, "wall_s": s.wall_s, "target_calls": s.target_calls,
            "draft_forwards": s.draft_forwards, "draft_fed_tokens": s.draft_fed_tokens,
            "suffix_tokens": s.suffix_tokens, "suffix_kept": s.suffix_kept,
            "block_lengths": list(s.block_lengths), "accepted_lengths": list(s.accepted_lengths),
            "tree_rounds": s.tree_rounds, "tree_paths": s.tree_paths, "branch_tokens_sent": s.branch_tokens_sent,
            "branch_tokens_kept": s.branch_tokens_kept, "side_path_wins": s.side_path_wins,
            "copy_branch_tokens": s.copy_branch_tokens, "copy_path_wins": s.copy_path_wins}


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
             f"{'on' if settings.suffix_cache else 'off'}"
             + (f"; a suffix lookup costs {lookup_us:.0f} us (median)" if lookup_us is not None else "") + pinned,
             "",
             "| mode | category | proposer | tokens/call | calls/token | calls/token x oracle | tokens/s | suffix share "
             "| copies kept | tokens/call x | tokens/s x |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in summary:
        ratio = (f"{r['tokens_per_call_x']:.2f} | {r['tokens_per_s_x']:.2f}" if r["proposer"] != "model"
                 and r["tokens_per_call_x"] is not None else "- | -")
        lines.append(f"| {r['mode']} | {r['category']} | {r['proposer']} | {r['tokens_per_call']:.2f} | "
                     f"{r['calls_per_token']:.3f} | {_x(r['calls_per_token'], r.get('oracle_calls_per_token'))} | "
                     f"{r['tokens_per_s']:.2f} | {r['suffix_share']:.2f} | "
                     f"{r['suffix_kept_share']:.2f} | {ratio} |")
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
    plt = pyplot()
    mode = summary[0]["mode"] if summary else ""
    rows = [r for r in summary if r["mode"] == mode]
    categories = sorted({r["category"] for r in rows}, key=lambda c: (c == "all", c))
    proposers = sorted({r["proposer"] for r in rows}, key=lambda p: (p != "model", p))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(1, len(proposers))
    for ax, metric, label in zip(axes, ("tokens_per_call", "tokens_per_s"), ("tokens per call", "tokens/s")):
        for i, proposer in enumerate(proposers):
            values = [next((r[metric] for r in rows if r["category"] == c and r["proposer"] == proposer), 0.0)
                      for c in categories]
            ax.bar([x + i * width for x in range(len(categories))], values, width, label=proposer)
        ax.set_xticks([x + width * (len(proposers) - 1) / 2 for x in range(len(categories))])
        ax.set_xticklabels(categories, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(f"{label} ({mode})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
