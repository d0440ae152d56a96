r"""`sprinter bench auto`: `--mode auto` against every mode it chooses among, at each RTT, on one cloud engine.

    sprinter bench auto --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --engine llama.cpp \
        --rtt-ms 0,50,100,200 --passes 3 --out results/bench-auto-llama-cpp

The cloud runs as a process (serving the draft too, for cloud-sd), the edge here with the edge's own draft runtime,
each on half of this process's cores, behind the link proxy (the system under test, sim/sweep/system.py). At each
RTT, after one untimed request per method, `--passes` interleaved passes each generate the bench prompts greedily in
every method: mode target, sprinter-exact, cloud-sd and auto (the methods' order rotates pass by pass). The fixed
modes' requests also teach the edge their costs, as a daemon's earlier requests would. A pass's tokens/s is its
tokens over its wall time; the table gives each method's median over the passes, auto's over the best fixed mode
and over target (the goals: >= 0.97 and >= 0.97), what auto chose, and its predicted tokens/s over the measured
(goal: within 15%). Writes OUT/results.json and OUT/table.md.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter, defaultdict
from typing import Any

from common.model.loading import DTYPES, load_model
from common.model.prompting import encode_prompt
from common.spec.modes import AUTO_MODE, AUTO_SPECULATION, CLOUD_DRAFTING, TARGET_MODE, DecodeSettings, chooses_mode
from common.table_cells import cell
from edge.decoding.decoder import EdgeSettings
from edge.node import EdgeNode
from sim.bench.prompts import load_bench_prompts
from sim.bench.run_folder import RunFolder
from sim.bench.settings.sweeps import AutoBenchSettings
from sim.sweep.system import SystemSettings, SystemUnderTest, draft_label, generate, measure_here

log = logging.getLogger(__name__)

FIXED = (TARGET_MODE, AUTO_SPECULATION, CLOUD_DRAFTING)
METHODS = (*FIXED, AUTO_MODE)


def bench_auto(settings: AutoBenchSettings) -> str:
    folder = RunFolder(settings.out)
    draft = load_model(settings.draft, DTYPES[settings.dtype])
    prompts = [encode_prompt(draft.tokenizer, p["prompt"], p["chat"]) for p in load_bench_prompts()[: settings.prompts]]
    system = SystemSettings(settings.target, settings.draft, settings.out, dtype=settings.dtype,
                            engine=settings.engine, cloud_drafts=True, rtt_ms=settings.rtt_ms[0])
    requests = measure_here(system, lambda sut: _measure(settings, sut, draft, prompts))
    rows = summarize(requests)
    folder.write_results(settings, draft=draft_label(settings.draft_runtime, settings.dtype), rows=rows,
                         requests=requests)
    text = table(settings, rows)
    folder.write_table(text)
    return text


async def _measure(settings: AutoBenchSettings, sut: SystemUnderTest, draft: Any,
                   prompts: list[list[int]]) -> list[dict[str, Any]]:
    node = await sut.edge_node(draft, draft_runtime=settings.draft_runtime, verifier=settings.verifier)
    requests = []
    for rtt in settings.rtt_ms:
        sut.set_rtt(rtt)
        for method in METHODS:  # untimed: the link's new RTT and each way's costs, learned as a daemon would
            await _one(settings, node, prompts[0], method, rtt, -1)
        for number in range(settings.passes):
            order = METHODS[number % len(METHODS):] + METHODS[:number % len(METHODS)]
            for method in order:
                for ids in prompts:
                    requests.append(await _one(settings, node, ids, method, rtt, number))
        log.info("bench auto: RTT %g ms done", rtt)
    return requests


async def _one(settings: AutoBenchSettings, node: EdgeNode, ids: list[int], method: str, rtt: float,
               number: int) -> dict[str, Any]:
    auto = chooses_mode(method)
    decode = DecodeSettings(mode=AUTO_SPECULATION if auto else method, max_new_tokens=settings.max_new_tokens, k=settings.k)
    result, wall = await generate(node, ids, EdgeSettings(decode, chooses_mode=auto), f"{method} at RTT {rtt:g}")
    record = {"rtt_ms": rtt, "pass": number, "method": method, "mode": result.stats.mode, "tokens": len(result.token_ids),
              "wall_s": wall, "token_ids": result.token_ids}
    if auto and result.placed is not None and result.placed.decision is not None:
        (switch,) = result.placed.switches()
        record["predicted_tokens_per_s"] = switch["predicted_tokens_per_s"]
    return record


def summarize(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per RTT: each method's median pass rate, what auto chose, its predicted over its measured rate."""
    passes: dict[tuple[float, str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in requests:
        if r["pass"] >= 0:
            passes[(r["rtt_ms"], r["method"], r["pass"])].append(r)
    rows = []
    for rtt in sorted({r["rtt_ms"] for r in requests}):
        rate = {m: statistics.median(sum(r["tokens"] for r in rs) / sum(r["wall_s"] for r in rs)
                                     for (t, method, _), rs in passes.items() if t == rtt and method == m)
                for m in METHODS}
        autos = [r for (t, method, _), rs in passes.items() if t == rtt and method == AUTO_MODE for r in rs]
        ratios = [r["predicted_tokens_per_s"][r["mode"]] / (r["tokens"] / r["wall_s"]) for r in autos
                  if "predicted_tokens_per_s" in r]
        best = max(FIXED, key=rate.__getitem__)
        rows.append({"rtt_ms": rtt, "tokens_per_s": rate, "best_fixed": best,
                     "auto_over_best": rate[AUTO_MODE] / rate[best], "auto_over_target": rate[AUTO_MODE] / rate[TARGET_MODE],
                     "auto_chose": dict(Counter(r["mode"] for r in autos)),
                     "predicted_over_measured": statistics.median(ratios) if ratios else None})
    return rows


def table(settings: AutoBenchSettings, rows: list[dict[str, Any]]) -> str:
    lines = [f"Engine {settings.engine}; tokens/s, median of {settings.passes} passes over {settings.prompts} prompts "
             f"x {settings.max_new_tokens} tokens, greedy; draft {draft_label(settings.draft_runtime, settings.dtype)}.",
             "",
             "| RTT ms | " + " | ".join(METHODS) + " | auto / best | auto / target | auto chose | predicted / measured |",
             "|" + " --- |" * (len(METHODS) + 5)]
    for r in rows:
        chose = ", ".join(f"{mode} {n}" for mode, n in sorted(r["auto_chose"].items()))
        lines.append(f"| {r['rtt_ms']:g} | " + " | ".join(cell(r["tokens_per_s"][m], ".2f") for m in METHODS)
                     + f" | {r['auto_over_best']:.2f} | {r['auto_over_target']:.2f} | {chose} | "
                     f"{cell(r['predicted_over_measured'], '.2f')} |")
    return "\n".join(lines)
