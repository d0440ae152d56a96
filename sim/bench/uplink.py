r"""`sprinter bench uplink`: what a sampled sd frame carries up, full draft distributions against on-rejection.

    sprinter bench uplink --target smollm2-135m --draft smollm2-135m:layers=4 --dtype float32 \
        --rtt-ms 20,100 --bandwidth-mbps 20 --out results/bench-uplink

The cloud runs as a process (pinned to core 0 on a small machine); the edge runs here, its draft in torch,
through the link proxy (sim/link/proxy.py: half the RTT each way, the bandwidth capped both ways). Mode sd
at temperature 1 drafts blocks of k; each prompt is generated with `--draft-dists full` (every draft
distribution in every verify frame, up to 4096 entries each) and `on-rejection` (each token's draft
probability alone; at a rejection the cloud asks for the draft's probabilities of its residual candidates,
cloud/residual.py: one more round trip there). Prints, per RTT and setting: uplink and downlink bytes per
token, tokens/s, verify round trips and extra (residual) round trips per token. Writes OUT/results.json
and OUT/table.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from common.spec.modes import DRAFT_DISTS, DecodeSettings
from common.model.loading import DTYPES, load_model
from common.model.prompting import encode_prompt
from common.sampling.distributions import SamplingParams
from edge.decoding.decoder import EdgeSettings
from edge.node import EdgeNode, EdgeNodeSettings
from sim.bench.prompts import load_bench_prompts
from sim.link.proxy import LinkProxy
from sim.link.shaping import LinkSettings
from sim.processes import cloud_process, small_machine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UplinkBenchSettings:
    target: str = "smollm2-135m"
    draft: str = "smollm2-135m:layers=4"
    dtype: str = "float32"
    rtts_ms: tuple[float, ...] = (20.0, 100.0)
    bandwidth_mbps: float | None = 20.0  # each way; None: unlimited
    prompts: int = 3
    max_tokens: int = 48
    k: int = 4
    temperature: float = 1.0
    seed: int = 0
    out: Path = Path("results/bench-uplink")


def bench_uplink(settings: UplinkBenchSettings) -> str:
    """Measure every (RTT, draft_dists) on the same prompts and seeds; write OUT, return the table."""
    settings.out.mkdir(parents=True, exist_ok=True)
    draft = load_model(settings.draft, DTYPES[settings.dtype])
    prompts = [encode_prompt(draft.tokenizer, p["prompt"], p["chat"]) for p in load_bench_prompts()[: settings.prompts]]
    small = small_machine()  # there the cloud keeps to core 0, leaving the other to the edge's draft here
    with cloud_process("--target", settings.target, "--dtype", settings.dtype, log_path=settings.out / "cloud.log",
                       cpus={0} if small else None) as address:
        host, _, port = address.rpartition(":")
        rows = [row for rtt in settings.rtts_ms
                for row in asyncio.run(_at_rtt(settings, draft, prompts, (host, int(port)), rtt))]
    (settings.out / "results.json").write_text(json.dumps({"settings": {**asdict(settings), "out": str(settings.out)},
                                                           "rows": rows}, indent=1) + "\n")
    text = table(settings, rows)
    (settings.out / "table.md").write_text(text + "\n")
    return text


async def _at_rtt(settings: UplinkBenchSettings, draft, prompts: list[list[int]], upstream: tuple[str, int],
                  rtt_ms: float) -> list[dict]:
    link = LinkSettings(delay_ms=rtt_ms / 2, bandwidth_mbps=settings.bandwidth_mbps)
    async with LinkProxy(link, upstream) as proxy:
        node_settings = EdgeNodeSettings(draft=settings.draft, cloud=proxy.address, draft_runtime="torch",
                                         dtype=settings.dtype, verifier="confidence:0.3")
        async with EdgeNode(node_settings, draft) as node:
            sampling = SamplingParams(temperature=settings.temperature, seed=settings.seed)
            warm = EdgeSettings(DecodeSettings(mode="sd", max_new_tokens=8, k=settings.k, sampling=sampling))
            await node.decoder.generate(prompts[0], warm)
            return [await _measure(node, settings, prompts, rtt_ms, dists) for dists in DRAFT_DISTS]


async def _measure(node: EdgeNode, settings: UplinkBenchSettings, prompts: list[list[int]], rtt_ms: float,
                   dists: str) -> dict:
    totals = dict(tokens=0, wall_s=0.0, uplink_bytes=0, downlink_bytes=0, target_calls=0, residual_queries=0)
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(temperature=settings.temperature, seed=settings.seed + i)
        result = await node.decoder.generate(prompt, EdgeSettings(DecodeSettings(
            mode="sd", max_new_tokens=settings.max_tokens, k=settings.k, sampling=sampling), draft_dists=dists))
        if result.degraded or result.error:
            raise RuntimeError(f"a {dists} run at RTT {rtt_ms:g} ms lost the cloud: "
                               f"{result.degraded_reason or result.error}")
        stats = result.stats
        totals["tokens"] += stats.new_tokens
        totals["wall_s"] += stats.wall_s
        for name in ("uplink_bytes", "downlink_bytes", "target_calls", "residual_queries"):
            totals[name] += getattr(stats, name)
    n = totals["tokens"]
    log.info("rtt %g %s: %d tokens, %.0f B/token up", rtt_ms, dists, n, totals["uplink_bytes"] / n)
    return {"rtt_ms": rtt_ms, "draft_dists": dists, **totals, "tokens_per_s": n / totals["wall_s"],
            "uplink_bytes_per_token": totals["uplink_bytes"] / n, "downlink_bytes_per_token": totals["downlink_bytes"] / n,
            "verify_round_trips_per_token": totals["target_calls"] / n,
            "extra_round_trips_per_token": totals["residual_queries"] / n}


def table(settings: UplinkBenchSettings, rows: list[dict]) -> str:
    bandwidth = f"{settings.bandwidth_mbps:g} Mbit/s each way" if settings.bandwidth_mbps else "unlimited bandwidth"
    lines = [f"mode sd, T={settings.temperature:g}, k={settings.k}, {settings.target} <- {settings.draft} "
             f"({settings.dtype}), {settings.prompts} prompts x {settings.max_tokens} tokens, {bandwidth}",
             "",
             "| RTT ms | draft dists | tokens | uplink B/token | downlink B/token | tokens/s | verify RTs/token "
             "| extra RTs/token |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['rtt_ms']:g} | {r['draft_dists']} | {r['tokens']} | {r['uplink_bytes_per_token']:.0f} | "
                     f"{r['downlink_bytes_per_token']:.0f} | {r['tokens_per_s']:.2f} | "
                     f"{r['verify_round_trips_per_token']:.3f} | {r['extra_round_trips_per_token']:.3f} |")
    return "\n".join(lines)
