r"""`sprinter bench uplink`: what a sampled sd frame carries up, full draft distributions against on-rejection.

    sprinter bench uplink --target smollm2-135m --draft smollm2-135m:layers=4 --dtype float32 \
        --rtt-ms 20,100 --bandwidth-mbps 20 --out results/bench-uplink

The cloud runs as a process, the edge here, its draft in torch, each on half of this process's cores (the system
under test, sim/sweep/system.py), through the link proxy (sim/link/proxy.py: half the RTT each way, the bandwidth
capped both ways). Mode sd at temperature 1 drafts blocks of k; each prompt is generated with `--draft-dists full`
(every draft distribution in every verify frame, up to 4096 entries each) and `on-rejection` (each token's draft
probability alone; at a rejection the cloud asks for the draft's probabilities of its residual candidates,
cloud/residual.py: one more round trip there). Prints, per RTT and setting: uplink and downlink bytes per
token, tokens/s, verify round trips and extra (residual) round trips per token. Writes OUT/results.json
and OUT/table.md.
"""

from __future__ import annotations

import logging

from common.sampling.distributions import SamplingParams
from common.spec.modes import DRAFT_DISTS, DecodeSettings
from edge.decoding.decoder import EdgeSettings
from edge.node import EdgeNode
from sim.bench.run_folder import RunFolder
from sim.bench.settings.sweeps import UplinkBenchSettings
from sim.link.shaping import LinkSettings
from sim.sweep.system import SystemSettings, SystemUnderTest, draft_label, generate, measure_edge_here

log = logging.getLogger(__name__)

COUNTS = ("uplink_bytes", "downlink_bytes", "target_calls", "residual_queries")


def bench_uplink(settings: UplinkBenchSettings) -> str:
    """Measure every (RTT, draft_dists) on the same prompts and seeds; write OUT, return the table."""
    folder = RunFolder(settings.out)
    link = LinkSettings(bandwidth_mbps=settings.bandwidth_mbps or None)
    system = SystemSettings(settings.target, settings.draft, settings.out, dtype=settings.dtype, link=link,
                            rtt_ms=settings.rtt_ms[0])
    rows = measure_edge_here(system, settings.prompts, lambda *run: _measure(settings, *run))
    folder.write_results(settings, draft=draft_label(), rows=rows)
    return folder.write_table(table(settings, rows))


async def _measure(settings: UplinkBenchSettings, system: SystemUnderTest, draft, prompts: list[list[int]]) -> list[dict]:
    node = await system.edge_node(draft, verifier="confidence:0.3")
    rows = []
    for rtt in system.at_rtts(settings.rtt_ms):
        warm = SamplingParams(temperature=settings.temperature, seed=settings.seed)  # and the cost model learns the RTT
        await node.decoder.generate(prompts[0], EdgeSettings(DecodeSettings(mode="sd", max_new_tokens=8, k=settings.k,
                                                                            sampling=warm)))
        rows += [await _at(node, settings, prompts, rtt, dists) for dists in DRAFT_DISTS]
    return rows


async def _at(node: EdgeNode, settings: UplinkBenchSettings, prompts: list[list[int]], rtt_ms: float,
              dists: str) -> dict:
    totals = dict.fromkeys(("tokens", "wall_s", *COUNTS), 0)
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(temperature=settings.temperature, seed=settings.seed + i)
        request = EdgeSettings(DecodeSettings(mode="sd", max_new_tokens=settings.max_tokens, k=settings.k,
                                              sampling=sampling), draft_dists=dists)
        result, _ = await generate(node, prompt, request, f"a {dists} run at RTT {rtt_ms:g} ms")
        totals["tokens"] += result.stats.new_tokens
        for name in ("wall_s", *COUNTS):
            totals[name] += getattr(result.stats, name)
    n = totals["tokens"]
    log.info("rtt %g %s: %d tokens, %.0f B/token up", rtt_ms, dists, n, totals["uplink_bytes"] / n)
    return {"rtt_ms": rtt_ms, "draft_dists": dists, **totals, "tokens_per_s": n / totals["wall_s"],
            "uplink_bytes_per_token": totals["uplink_bytes"] / n, "downlink_bytes_per_token": totals["downlink_bytes"] / n,
            "verify_round_trips_per_token": totals["target_calls"] / n,
            "extra_round_trips_per_token": totals["residual_queries"] / n}


def table(settings: UplinkBenchSettings, rows: list[dict]) -> str:
    bandwidth = f"{settings.bandwidth_mbps:g} Mbit/s each way" if settings.bandwidth_mbps else "unlimited bandwidth"
    lines = [f"mode sd, T={settings.temperature:g}, k={settings.k}, {settings.target} <- {settings.draft} "
             f"({settings.dtype}), {settings.prompts} prompts x {settings.max_tokens} tokens, {bandwidth}; "
             f"draft {draft_label()}",
             "",
             "| RTT ms | draft dists | tokens | uplink B/token | downlink B/token | tokens/s | verify RTs/token "
             "| extra RTs/token |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['rtt_ms']:g} | {r['draft_dists']} | {r['tokens']} | {r['uplink_bytes_per_token']:.0f} | "
                     f"{r['downlink_bytes_per_token']:.0f} | {r['tokens_per_s']:.2f} | "
                     f"{r['verify_round_trips_per_token']:.3f} | {r['extra_round_trips_per_token']:.3f} |")
    return "\n".join(lines)
