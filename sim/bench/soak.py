"""`sprinter bench soak`: many concurrent sessions for a while, against real cloud and edge processes.

    sprinter bench soak --target smollm2-135m --draft smollm2-135m:layers=4 --sessions 32 --duration-s 300

Starts the cloud (with `--metrics-port`) and an edge daemon on loopback. SESSIONS workers each send
requests back to back through the edge's OpenAI API until DURATION_S is over: chat and plain
completions, streamed and whole, greedy and sampled, the modes in turn, so each in-flight request
holds one cloud session. Every `--sample-s` it records the cloud's and the edge's RSS and the cloud's
metrics (KV cache bytes, open sessions, evictions). It passes with 0 errors (every request answered
200 and complete), 0 degraded answers, every greedy answer of a lossless mode token-identical to
mode target's for the same request (sim/bench/target_identity.py, asked after the load), and KV
cache bytes never above the budget; RSS is reported (max, and how much the second half's max
exceeds the first half's) for a person to judge. The command exits 1 when it fails.
Writes OUT/results.json (settings, summary, samples, every request) and OUT/table.md.

With `--identities N,M,...` (e.g. `--identities 24,8`; `--sessions` is then ignored) the cloud gets a
tokens file with one token per identity and each identity its own edge daemon sending its token, with
N_i workers sending the same request mix back to back to it for DURATION_S. It measures fairness: the
cloud's admission line takes turns between identities, so each backlogged identity's share of the
tokens completed during the load window (requests that ended within DURATION_S of the start; the share
over everything is given too), and the light identity's latency, to hold against the same workers running
alone (`--sessions N`). The line forms only once the cloud is full: give `--max-sessions` (times
`--replicas`) below the workers' sum. The checks above hold across every identity (the greedy answers
are checked through the first identity's edge); edge RSS and CPU are the first edge's.

The KV gauge is read between requests (the cloud sets it after enforcing the budget), so a peak
inside one target forward is not seen.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from sim.bench.load import ProcessSampler, RequestOutcome, RequestSpec, http_client, mb, seconds, send_request
from sim.bench.loopback import EdgeSpec, loopback_system
from sim.bench.prompts import load_bench_prompts
from sim.bench.registry import Verdict
from sim.bench.settings.operations import SoakSettings
from sim.bench.soak_identities import (Identity, identity_problems, identity_summary, identity_table_rows,
                                       make_identities, write_tokens_file)
from sim.bench.target_identity import TargetIdentity, check_target_identity
from sim.bench.verdict import Judged, by_reason, outcome_problems, outcome_summary, verdict_table

log = logging.getLogger(__name__)


@dataclass
class SoakLoad:
    """What the load gave: the outcomes (by request index), the greedy check, and the times."""

    outcomes: list[RequestOutcome]
    identity: TargetIdentity
    wall_s: float
    started_s: float  # monotonic: the load's start (its window ends duration_s later)
    identity_of: dict[int, int] = field(default_factory=dict)  # request index -> identity (with --identities)


def bench_soak(settings: SoakSettings) -> Verdict:
    result = soak(settings)
    return Verdict(format_soak(result, settings), result.passed)


def soak(settings: SoakSettings) -> Judged:
    """Start the processes, run the load, stop them, judge; writes OUT/results.json and OUT/table.md."""
    settings.out.mkdir(parents=True, exist_ok=True)
    identities = make_identities(settings.identities) if settings.identities else []
    tokens = write_tokens_file(settings.out, identities) if identities else None
    serve = {"kv_budget_mb": settings.kv_budget_mb, "max_context": settings.max_context,
             "max_sessions": settings.max_sessions, "drain_s": 5, "auth_tokens": tokens}
    edges = [EdgeSpec(f"edge-{i}.log", ("--insecure",), {"SPRINTER_CLOUD_TOKEN": who.token})  # loopback: plaintext
             for i, who in enumerate(identities)] or [EdgeSpec()]
    # SPRINTER_CHECK_INVARIANTS: a KV budget breach fails the run loudly.
    with loopback_system(settings, serve, edges, cloud_env={"SPRINTER_CHECK_INVARIANTS": "1"}) as system:
        write_scrape_targets(settings.out, [f"127.0.0.1:{r.metrics_port}" for r in system.replicas],
                             [base.removeprefix("http://") for base in system.bases])
        samplers = [ProcessSampler(lambda cloud=r.process: cloud.pid, system.edges[0].process.pid if i == 0 else None,
                                   r.metrics_port, settings.sample_s) for i, r in enumerate(system.replicas)]
        load = asyncio.run(_drive(settings, system.bases, identities, samplers))
        edge_alive = system.edges_alive()
    result = judge(settings, load, samplers, edge_alive, identities)
    result.write(settings, settings.out, format_soak(result, settings))
    return result


def write_scrape_targets(out: Path, clouds: list[str], edges: list[str]) -> None:
    """Where the running processes serve metrics, as Prometheus's file service discovery reads it (one file a job:
    `bench dashboards` scrapes a soak with them)."""
    for job, targets in (("cloud", clouds), ("edge", edges)):
        path = out / f"scrape-targets-{job}.json"
        path.with_suffix(".tmp").write_text(json.dumps([{"targets": targets}]))
        path.with_suffix(".tmp").replace(path)  # whole, never half-written, when Prometheus reads it


def _workers(settings: SoakSettings, bases: list[str], identities: list[Identity]) -> list[tuple[str, int | None]]:
    """(edge base URL, identity index or None) of each worker."""
    if not identities:
        return [(bases[0], None)] * settings.sessions
    return [(bases[i], i) for i, identity in enumerate(identities) for _ in range(identity.workers)]


async def _drive(settings: SoakSettings, bases: list[str], identities: list[Identity],
                 samplers: list[ProcessSampler]) -> SoakLoad:
    """The load (its outcomes and wall time), then the greedy answers held against the target's."""
    prompts = load_bench_prompts()
    rng = random.Random(settings.seed)
    load_started = time.monotonic()
    deadline = load_started + settings.duration_s
    counter = iter(range(10**9))
    outcomes: list[RequestOutcome] = []
    specs: list[RequestSpec] = []
    identity_of: dict[int, int] = {}
    workers = _workers(settings, bases, identities)

    async def worker(w: int, base: str, who: int | None, client: httpx.AsyncClient) -> None:
        turn = 0
        while time.monotonic() < deadline:
            index = next(counter)
            prompt = prompts[(w + turn * len(workers)) % len(prompts)]
            spec = RequestSpec(index=index, prompt=prompt["prompt"], chat=prompt["chat"],
                               mode=settings.modes[(w + turn) % len(settings.modes)],
                               max_tokens=rng.randint(*settings.token_range), stream=(w + turn) % 2 == 0,
                               temperature=settings.temperatures[index % len(settings.temperatures)], seed=index)
            specs.append(spec)
            if who is not None:
                identity_of[index] = who
            outcomes.append(await send_request(client, base, spec))
            turn += 1

    sampling = [asyncio.create_task(sampler.run()) for sampler in samplers]
    async with http_client(len(workers)) as client:
        await asyncio.gather(*(worker(w, base, who, client) for w, (base, who) in enumerate(workers)))
        wall_s = time.monotonic() - load_started
        for sampler in samplers:
            sampler.stop()
        await asyncio.gather(*sampling)
        log.info("load over after %.0f s; asking the target for the greedy references", wall_s)
        identity = await check_target_identity(client, bases[0], specs, outcomes)
    return SoakLoad(sorted(outcomes, key=lambda o: o.index), identity, wall_s, load_started, identity_of)


def _most(values: list[float | None]) -> float | None:
    return max((v for v in values if v is not None), default=None)


def _total(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _clouds_summary(samplers: list[ProcessSampler], half_s: float) -> dict[str, Any]:
    """The replicas together: the largest RSS, RSS growth and KV of any one (each has its own budget), sums else."""
    return {"replicas": len(samplers), "cloud_rss_max_bytes": _most([s.maximum("cloud_rss") for s in samplers]),
            "cloud_rss_growth_bytes": _most([s.growth("cloud_rss", half_s) for s in samplers]),
            "kv_cache_bytes_max": _most([s.maximum("kv_cache_bytes") for s in samplers]),
            "sessions_open_max": _total([s.maximum("sessions_open") for s in samplers]),
            "sessions_evicted": _total([s.last("sessions_evicted") for s in samplers]),
            "metrics_samples": sum(1 for sampler in samplers for s in sampler.samples if s.kv_cache_bytes is not None),
            "cloud_cpu_s": _total([s.used("cloud_cpu_s") for s in samplers])}


def judge(settings: SoakSettings, load: SoakLoad, samplers: list[ProcessSampler], edge_alive: bool,
          identities: list[Identity] | None = None) -> Judged:
    outcomes, wall_s = load.outcomes, load.wall_s
    summary = outcome_summary(outcomes, load.identity)
    summary |= {"wall_s": wall_s, "tokens_per_s": summary["tokens"] / wall_s if wall_s else 0.0,
                "edge_rss_max_bytes": samplers[0].maximum("edge_rss"), "kv_budget_bytes": settings.kv_budget_mb << 20,
                **_clouds_summary(samplers, wall_s / 2), "edge_cpu_s": samplers[0].used("edge_cpu_s"),
                "edge_alive": edge_alive}
    if identities:
        summary["identities"] = identity_summary(identities, outcomes, load.identity_of,
                                                 load.started_s + settings.duration_s)
    names = {i: who.name for i, who in enumerate(identities or [])}
    requests = [asdict(o) | ({"identity": names[load.identity_of[o.index]]} if names else {}) for o in outcomes]
    samples = [asdict(s) | {"replica": i} for i, sampler in enumerate(samplers) for s in sampler.samples]
    return Judged(summary, _problems(settings, summary, outcomes, load.identity),
                  {"samples": samples, "requests": requests})


def _problems(settings: SoakSettings, summary: dict[str, Any], outcomes: list[RequestOutcome],
              identity: TargetIdentity) -> list[str]:
    problems = outcome_problems(outcomes, identity)
    if summary["degraded"]:
        problems.append(f"{summary['degraded']} answers degraded ({summary['degraded_by_reason']}): "
                        f"requests {[o.index for o in outcomes if o.ok and o.degraded][:10]}")
    kv_max = summary["kv_cache_bytes_max"]
    if kv_max is None:
        problems.append("no KV cache reading: the cloud's metrics endpoint never answered")
    elif kv_max > summary["kv_budget_bytes"]:
        problems.append(f"KV cache reached {kv_max / 2**20:.1f} MiB, above the {settings.kv_budget_mb} MiB budget")
    if not summary["edge_alive"]:
        problems.append("an edge daemon exited during the run")
    return problems + identity_problems(summary.get("identities", []))


def format_soak(result: Judged, settings: SoakSettings) -> str:
    s = result.summary
    load = (f"{len(settings.identities)} identities, {'+'.join(map(str, settings.identities))} concurrent sessions"
            if settings.identities else f"{settings.sessions} concurrent sessions")
    rows = [
        ("load", f"{load} for {settings.duration_s:g} s, {settings.target} / {settings.draft}"),
        ("requests (errors, HTTP 5xx, degraded)", f"{s['requests']} ({s['errors']}, {s['http_5xx']}, {s['degraded']})"),
        ("degraded by reason", by_reason(s["degraded_by_reason"])),
        ("greedy lossless answers = target's (checked, references failed)",
         f"{s['greedy_checked'] - s['greedy_mismatches']} of {s['greedy_checked']} ({s['greedy_references_failed']})"),
        ("tokens, tokens/s", f"{s['tokens']}, {s['tokens_per_s']:.1f}"),
        ("latency s p50 / p90 / p99 / max", " / ".join(seconds(s[f"latency_s_{k}"]) for k in ("p50", "p90", "p99", "max"))),
        ("time to first token s p50 / p99 (streams)", f"{seconds(s['ttft_s_p50'])} / {seconds(s['ttft_s_p99'])}"),
        ("cloud RSS max MiB (2nd half max - 1st half max)", f"{mb(s['cloud_rss_max_bytes'])} ({mb(s['cloud_rss_growth_bytes'])})"),
        ("edge RSS max MiB", mb(s["edge_rss_max_bytes"])),
        ("CPU s used: cloud, edge (wall s)", f"{seconds(s['cloud_cpu_s'])}, {seconds(s['edge_cpu_s'])} ({s['wall_s']:.0f})"),
        ("KV cache max MiB / budget MiB", f"{mb(s['kv_cache_bytes_max'])} / {mb(s['kv_budget_bytes'])}"),
        ("cloud sessions open max, evicted", f"{s['sessions_open_max']}, {s['sessions_evicted']}"),
    ] + identity_table_rows(s.get("identities", []))
    return verdict_table("soak", rows, result.problems)
