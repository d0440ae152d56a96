r"""`sprinter bench auto`: `--mode auto` against every mode it chooses among, at each RTT, on one cloud engine.

    sprinter bench auto --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --engine llama.cpp \
        --rtt-ms 0,50,100,200 --passes 3 --out results/bench-auto-llama-cpp

The cloud runs as a process (serving the draft too, for cloud-sd), the edge here with the edge's own draft runtime,
each on half of this process's cores, behind the link proxy (the system under test, sim/sweep/system.py). At each
RTT, after one untimed request per method, `--passes` interleaved passes each generate the bench prompts greedily in
every method: mode target, sprinter-exact, cloud-sd and auto (the methods' order rotates pass by pass), and with
`--baseline llama-server` (the default) llama.cpp's server alone on the cloud's core, serving the target's GGUF
with no link (what a user would run instead; sim/sweep/baselines.py), the same prompts as the same token ids. The fixed
modes' requests also teach the edge their costs, as a daemon's earlier requests would. A pass's tokens/s is its
tokens over its wall time; the table gives each method's median over the passes, auto's over the best fixed mode
and over target (the goals: >= 0.97 and >= 0.97), what auto chose first (and in how many requests it switched
mode within the request), and its predicted tokens/s over the measured, over the requests that kept one mode
(goal: within 15%), and auto over llama-server alone. Writes OUT/results.json and OUT/table.md.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter, defaultdict
from contextlib import nullcontext
from typing import Any

import httpx

from common.spec.modes import AUTO_MODE, AUTO_SPECULATION, CLOUD_DRAFTING, TARGET_MODE, DecodeSettings, chooses_mode
from common.table_cells import cell
from edge.decoding.decoder import EdgeSettings
from edge.node import EdgeNode
from sim.bench.run_folder import RunFolder
from sim.bench.settings.sweeps import AutoBenchSettings
from sim.sweep.baselines import LLAMA_SERVER, LocalBaselines, llama_server_alone
from sim.sweep.system import SystemSettings, SystemUnderTest, draft_label, generate, measure_edge_here

log = logging.getLogger(__name__)

FIXED = (TARGET_MODE, AUTO_SPECULATION, CLOUD_DRAFTING)
METHODS = (*FIXED, AUTO_MODE)


def bench_auto(settings: AutoBenchSettings) -> str:
    folder = RunFolder(settings.out)
    system = SystemSettings(settings.target, settings.draft, settings.out, dtype=settings.dtype,
                            engine=settings.engine, cloud_drafts=True, rtt_ms=settings.rtt_ms[0])
    requests = measure_edge_here(system, settings.prompts, lambda *run: _measure(settings, *run))
    rows = summarize(requests)
    folder.write_results(settings, draft=draft_label(settings.draft_runtime, settings.dtype), rows=rows,
                         requests=requests)
    return folder.write_table(table(settings, rows))


def methods(settings: AutoBenchSettings) -> tuple[str, ...]:
    return METHODS + ((LLAMA_SERVER,) if settings.baseline == LLAMA_SERVER else ())


async def _measure(settings: AutoBenchSettings, sut: SystemUnderTest, draft: Any,
                   prompts: list[list[int]]) -> list[dict[str, Any]]:
    node = await sut.edge_node(draft, draft_runtime=settings.draft_runtime, verifier=settings.verifier)
    every = methods(settings)
    requests = []
    cores = sut.settings.cores
    alone = llama_server_alone(settings.target, settings.draft, settings.out, cores.cloud if cores else None) \
        if settings.baseline == LLAMA_SERVER else nullcontext()
    with alone as baselines:
        async with httpx.AsyncClient(timeout=600) as client:
            async def one(ids: list[int], method: str, rtt: float, number: int) -> dict[str, Any]:
                if method == LLAMA_SERVER:
                    return await _one_baseline(settings, baselines, client, ids, rtt, number)
                return await _one(settings, node, ids, method, rtt, number)

            for rtt in sut.at_rtts(settings.rtt_ms):
                for method in every:  # untimed: the link's new RTT and each way's costs, learned as a daemon would
                    await one(prompts[0], method, rtt, -1)
                for number in range(settings.passes):
                    for method in every[number % len(every):] + every[:number % len(every)]:
                        for ids in prompts:
                            requests.append(await one(ids, method, rtt, number))
                    log.info("bench auto: RTT %g ms, pass %d of %d done", rtt, number + 1, settings.passes)
    return requests


async def _one_baseline(settings: AutoBenchSettings, baselines: LocalBaselines | None, client: httpx.AsyncClient,
                        ids: list[int], rtt: float, number: int) -> dict[str, Any]:
    """llama-server alone, greedy, for the same token ids (it has no link: its rate does not depend on the RTT)."""
    assert baselines is not None
    streamed = await baselines.stream(client, LLAMA_SERVER, ids, settings.max_new_tokens)
    return {"rtt_ms": rtt, "pass": number, "method": LLAMA_SERVER, "mode": LLAMA_SERVER,
            "tokens": len(streamed["token_ids"]), "wall_s": streamed["wall_s"], "token_ids": streamed["token_ids"]}


async def _one(settings: AutoBenchSettings, node: EdgeNode, ids: list[int], method: str, rtt: float,
               number: int) -> dict[str, Any]:
    auto = chooses_mode(method)
    decode = DecodeSettings(mode=AUTO_SPECULATION if auto else method, max_new_tokens=settings.max_new_tokens, k=settings.k)
    result, wall = await generate(node, ids, EdgeSettings(decode, chooses_mode=auto), f"{method} at RTT {rtt:g}")
    record = {"rtt_ms": rtt, "pass": number, "method": method, "mode": result.stats.mode, "tokens": len(result.token_ids),
              "wall_s": wall, "token_ids": result.token_ids}
    if auto and result.placed is not None and result.placed.decision is not None:
        first, *later = result.placed.switches()
        record["predicted_tokens_per_s"] = first["predicted_tokens_per_s"]
        record["switches"] = [{"at_token": s["at_token"], "mode": s["mode"]} for s in later]  # within the request
    return record


def summarize(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per RTT: each method's median pass rate, what auto chose, its predicted over its measured rate."""
    passes: dict[tuple[float, str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in requests:
        if r["pass"] >= 0:
            passes[(r["rtt_ms"], r["method"], r["pass"])].append(r)
    rows = []
    for rtt in sorted({r["rtt_ms"] for r in requests}):
        present = [m for m in (*METHODS, LLAMA_SERVER) if any(t == rtt and method == m for t, method, _ in passes)]
        rate = {m: statistics.median(sum(r["tokens"] for r in rs) / sum(r["wall_s"] for r in rs)
                                     for (t, method, _), rs in passes.items() if t == rtt and method == m)
                for m in present}
        autos = [r for (t, method, _), rs in passes.items() if t == rtt and method == AUTO_MODE for r in rs]
        # a prediction is of one mode over the whole request: requests that switched mode within are left out
        ratios = [r["predicted_tokens_per_s"][r["mode"]] / (r["tokens"] / r["wall_s"]) for r in autos
                  if "predicted_tokens_per_s" in r and not r.get("switches")]
        best = max(FIXED, key=rate.__getitem__)
        rows.append({"rtt_ms": rtt, "tokens_per_s": rate, "best_fixed": best,
                     "auto_over_best": rate[AUTO_MODE] / rate[best], "auto_over_target": rate[AUTO_MODE] / rate[TARGET_MODE],
                     "auto_chose": dict(Counter(r["mode"] for r in autos)),
                     "auto_switched": sum(bool(r.get("switches")) for r in autos),
                     "auto_over_llama_server": rate[AUTO_MODE] / rate[LLAMA_SERVER] if LLAMA_SERVER in rate else None,
                     "predicted_over_measured": statistics.median(ratios) if ratios else None})
    return rows


def table(settings: AutoBenchSettings, rows: list[dict[str, Any]]) -> str:
    every = methods(settings)
    baseline = " auto / llama-server |" if LLAMA_SERVER in every else ""
    lines = [f"Engine {settings.engine}; tokens/s, median of {settings.passes} passes over {settings.prompts} prompts "
             f"x {settings.max_new_tokens} tokens, greedy; draft {draft_label(settings.draft_runtime, settings.dtype)}.",
             "",
             "| RTT ms | " + " | ".join(every) + f" | auto / best | auto / target |{baseline} auto chose | "
             "predicted / measured |", "|" + " --- |" * (len(every) + 5 + bool(baseline))]
    for r in rows:
        chose = ", ".join(f"{mode} {n}" for mode, n in sorted(r["auto_chose"].items())) + \
            (f" (switched within {r['auto_switched']})" if r.get("auto_switched") else "")
        over_baseline = f" {cell(r['auto_over_llama_server'], '.2f')} |" if baseline else ""
        lines.append(f"| {r['rtt_ms']:g} | " + " | ".join(cell(r["tokens_per_s"].get(m), ".2f") for m in every)
                     + f" | {r['auto_over_best']:.2f} | {r['auto_over_target']:.2f} |{over_baseline} {chose} | "
                     f"{cell(r['predicted_over_measured'], '.2f')} |")
    return "\n".join(lines)
