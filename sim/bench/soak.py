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
exceeds the first half's) for a person to judge.
Writes OUT/soak.json (settings, summary, samples, every request) and prints a table.

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

import argparse
import asyncio
import json
import logging
import random
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from common.arguments import DTYPE_NAMES, floats, names
from common.lab.results_page import publish_if_asked
from common.spec.modes import PIPELINES
from sim.bench.load import (ProcessSampler, RequestOutcome, RequestSpec, failure_lines, http_client,
                            latency_summary, mb, seconds, send_request)
from sim.bench.prompts import load_bench_prompts
from sim.bench.soak_identities import (Identity, edge_options, identity_problems, identity_summary,
                                       identity_table_rows, make_identities, worker_counts, write_tokens_file)
from sim.bench.target_identity import TargetIdentity, check_target_identity
from sim.processes import CloudProcess, edge_daemon_process, free_port

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SoakSettings:
    target: str = "smollm2-135m"
    draft: str = "smollm2-135m:layers=4"
    dtype: str = "bfloat16"
    sessions: int = 32  # concurrent requests, each one cloud session while it runs
    duration_s: float = 300.0  # no request starts after this; those in flight finish
    max_tokens: tuple[int, int] = (16, 96)  # each request draws its max_tokens from this range
    modes: tuple[str, ...] = ("sprinter-exact", "sd-block", "sd", "sprinter", "target")
    temperatures: tuple[float, ...] = (0.0, 1.0)
    kv_budget_mb: int = 64
    # The cloud refuses a KV budget that cannot hold one full context: a short context keeps a small budget legal.
    max_context: int = 1024
    max_sessions: int = 64
    sample_s: float = 0.5
    seed: int = 0
    pipeline: str = "off"  # the edge daemon's default --pipeline (off, ahead, send-ahead)
    replicas: int = 1  # cloud processes the edge spreads its sessions over, each with the budgets above
    identities: tuple[int, ...] = ()  # workers per edge identity (own token, own edge); empty: one edge, `sessions`
    startup_timeout_s: float = 900.0
    out: Path = Path("results/bench-soak")


@dataclass
class SoakResult:
    settings: dict[str, Any]
    summary: dict[str, Any]
    problems: list[str]
    samples: list[dict[str, Any]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


def register_soak(benches: argparse._SubParsersAction) -> None:
    d = SoakSettings()
    p = benches.add_parser("soak", help="N concurrent sessions for a duration: errors, RSS, KV bytes vs budget",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=d.target)
    p.add_argument("--draft", default=d.draft)
    p.add_argument("--dtype", default=d.dtype, choices=DTYPE_NAMES)
    p.add_argument("--sessions", type=int, default=d.sessions, help="concurrent requests (ignored with --identities)")
    p.add_argument("--duration-s", type=float, default=d.duration_s)
    p.add_argument("--max-tokens", type=_int_range, default=d.max_tokens, metavar="MIN,MAX",
                   help="each request's max_tokens is drawn from this range (default 16,96)")
    p.add_argument("--modes", type=names, default=d.modes, help="comma list, used in turn")
    p.add_argument("--temperatures", type=floats, default=d.temperatures)
    p.add_argument("--kv-budget-mb", type=int, default=d.kv_budget_mb, help="the cloud's --kv-budget-mb")
    p.add_argument("--max-context", type=int, default=d.max_context,
                   help="the cloud's --max-context (its KV budget must hold one such session)")
    p.add_argument("--max-sessions", type=int, default=d.max_sessions, help="the cloud's --max-sessions")
    p.add_argument("--sample-s", type=float, default=d.sample_s, help="RSS and metrics sampling period")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--pipeline", default=d.pipeline, choices=PIPELINES,
                   help="the edge daemon's default pipeline (off, ahead, send-ahead), for every request")
    p.add_argument("--replicas", type=int, default=d.replicas,
                   help="cloud replicas behind the edge, each with its own budgets (checked per replica)")
    p.add_argument("--identities", type=worker_counts, default=d.identities, metavar="N,M,...",
                   help="one cloud token and one edge per identity, N_i workers each, instead of --sessions (which "
                        "is then ignored): each identity's token share and latency (fairness of the cloud's line)")
    p.add_argument("--out", type=Path, default=d.out)
    p.set_defaults(run=run_soak)


def _int_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    low_n, high_n = int(low), int(high or low)
    if not 1 <= low_n <= high_n:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 1 <= MIN <= MAX, got {text!r}")
    return low_n, high_n


def settings_from_args(args: argparse.Namespace) -> SoakSettings:
    return SoakSettings(target=args.target, draft=args.draft, dtype=args.dtype, sessions=args.sessions,
                        duration_s=args.duration_s, max_tokens=args.max_tokens, modes=args.modes,
                        temperatures=args.temperatures, kv_budget_mb=args.kv_budget_mb, max_context=args.max_context,
                        max_sessions=args.max_sessions, sample_s=args.sample_s, seed=args.seed,
                        pipeline=args.pipeline, replicas=args.replicas, identities=args.identities, out=args.out)


def run_soak(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the table
    result = soak(settings_from_args(args))
    table = format_soak(result)
    print(table)
    publish_if_asked(args, table)
    print(f"\nwrote {args.out}/soak.json")
    return 0 if result.passed else 1


@dataclass
class SoakLoad:
    """What the load gave: the outcomes (by request index), the greedy check, and the times."""

    outcomes: list[RequestOutcome]
    identity: TargetIdentity
    wall_s: float
    started_s: float  # monotonic: the load's start (its window ends duration_s later)
    identity_of: dict[int, int] = field(default_factory=dict)  # request index -> identity (with --identities)


def soak(settings: SoakSettings) -> SoakResult:
    """Start the processes, run the load, stop them, judge."""
    settings.out.mkdir(parents=True, exist_ok=True)
    identities = make_identities(settings.identities) if settings.identities else []
    tokens_file = write_tokens_file(settings.out, identities) if identities else None
    clouds = [_cloud(settings, i, tokens_file) for i in range(settings.replicas)]
    edge_args = ["--draft", settings.draft, "--cloud", ",".join(c.address for c, _ in clouds), "--dtype",
                 settings.dtype, "--pipeline", settings.pipeline, "--model-name", f"{settings.draft}+{settings.target}"]
    with ExitStack() as running:
        for cloud, _ in clouds:
            running.enter_context(cloud)
        edges = [running.enter_context(edge_daemon_process(edge_args + extra, free_port(), settings.out / log_name,
                                                           settings.startup_timeout_s, env=env))
                 for log_name, extra, env in _edge_specs(identities)]
        write_scrape_targets(settings.out, [f"127.0.0.1:{port}" for _, port in clouds],
                             [edge.base.removeprefix("http://") for edge in edges])
        samplers = [ProcessSampler(lambda cloud=cloud: cloud.pid, edges[0].process.pid if i == 0 else None,
                                   f"http://127.0.0.1:{port}/metrics", settings.sample_s)
                    for i, (cloud, port) in enumerate(clouds)]
        load = asyncio.run(_drive(settings, [edge.base for edge in edges], identities, samplers))
        edge_alive = all(edge.process.poll() is None for edge in edges)
    result = judge(settings, load, samplers, edge_alive, identities)
    (settings.out / "soak.json").write_text(json.dumps(asdict(result), indent=1))
    return result


def write_scrape_targets(out: Path, clouds: list[str], edges: list[str]) -> None:
    """Where the running processes serve metrics, as Prometheus's file service discovery reads it (one file a job:
    `bench dashboards` scrapes a soak with them)."""
    for job, targets in (("cloud", clouds), ("edge", edges)):
        path = out / f"scrape-targets-{job}.json"
        path.with_suffix(".tmp").write_text(json.dumps([{"targets": targets}]))
        path.with_suffix(".tmp").replace(path)  # whole, never half-written, when Prometheus reads it


def _edge_specs(identities: list[Identity]) -> list[tuple[str, list[str], dict[str, str] | None]]:
    """(log file name, extra arguments, extra environment) of each edge daemon: one, or one per identity."""
    if not identities:
        return [("edge.log", [], None)]
    return [(f"edge-{i}.log", *edge_options(identity)) for i, identity in enumerate(identities)]


def _cloud(settings: SoakSettings, index: int, tokens_file: Path | None = None) -> tuple[CloudProcess, int]:
    """Replica `index` and its metrics port."""
    log_path = settings.out / ("cloud.log" if settings.replicas == 1 else f"cloud-{index}.log")
    log_path.write_text("")
    metrics_port = free_port()
    auth = ["--auth-tokens", str(tokens_file)] if tokens_file else []
    cloud = CloudProcess("--target", settings.target, "--dtype", settings.dtype, "--metrics-port", str(metrics_port),
                         "--kv-budget-mb", str(settings.kv_budget_mb), "--max-context", str(settings.max_context),
                         "--max-sessions", str(settings.max_sessions), "--drain-s", "5", *auth, log_path=log_path,
                         startup_timeout_s=settings.startup_timeout_s,
                         env={"SPRINTER_CHECK_INVARIANTS": "1"})  # a KV budget breach fails the run loudly
    return cloud, metrics_port


def _workers(settings: SoakSettings, bases: list[str], identities: list[Identity]) -> list[tuple[str, int | None]]:
    """(edge base URL, identity index or None) of each worker."""
    if not identities:
        return [(bases[0], None)] * settings.sessions
    return [(bases[i], i) for i, identity in enumerate(identities) for _ in range(identity.workers)]


async def _drive(settings: SoakSettings, bases: list[str], identities: list[Identity],
                 samplers: list[ProcessSampler]) -> SoakLoad:
    """The load (its outcomes and wall time), then the greedy answers held against the target's."""
    started = time.monotonic()
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
                               max_tokens=rng.randint(*settings.max_tokens), stream=(w + turn) % 2 == 0,
                               temperature=settings.temperatures[index % len(settings.temperatures)], seed=index)
            specs.append(spec)
            if who is not None:
                identity_of[index] = who
            outcomes.append(await send_request(client, base, spec))
            turn += 1

    sampling = [asyncio.create_task(sampler.run()) for sampler in samplers]
    async with http_client(len(workers)) as client:
        await asyncio.gather(*(worker(w, base, who, client) for w, (base, who) in enumerate(workers)))
        wall_s = time.monotonic() - started
        for sampler in samplers:
            sampler.stop()
        await asyncio.gather(*sampling)
        log.info("load over after %.0f s; asking the target for the greedy references", wall_s)
        identity = await check_target_identity(client, bases[0], specs, outcomes)
    return SoakLoad(sorted(outcomes, key=lambda o: o.index), identity, wall_s, load_started, identity_of)


def _clouds_summary(samplers: list[ProcessSampler], half_s: float) -> dict[str, Any]:
    """The replicas together: the largest RSS, RSS growth and KV of any one (each has its own budget), sums else."""
    def growth(sampler: ProcessSampler) -> float | None:
        first = [s.cloud_rss for s in sampler.samples if s.cloud_rss is not None and s.at_s < half_s]
        second = [s.cloud_rss for s in sampler.samples if s.cloud_rss is not None and s.at_s >= half_s]
        return max(second) - max(first) if first and second else None

    def most(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return max(known) if known else None

    def total(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return sum(known) if known else None

    return {"replicas": len(samplers), "cloud_rss_max_bytes": most([s.maximum("cloud_rss") for s in samplers]),
            "cloud_rss_growth_bytes": most([growth(s) for s in samplers]),
            "kv_cache_bytes_max": most([s.maximum("kv_cache_bytes") for s in samplers]),
            "sessions_open_max": total([s.maximum("sessions_open") for s in samplers]),
            "sessions_evicted": total([s.last("sessions_evicted") for s in samplers]),
            "metrics_samples": sum(1 for sampler in samplers for s in sampler.samples if s.kv_cache_bytes is not None),
            "cloud_cpu_s": total([_used(s, "cloud_cpu_s") for s in samplers])}


def judge(settings: SoakSettings, load: SoakLoad, samplers: list[ProcessSampler], edge_alive: bool,
          identities: list[Identity] | None = None) -> SoakResult:
    outcomes, identity, wall_s = load.outcomes, load.identity, load.wall_s
    budget = settings.kv_budget_mb << 20
    failed = [o for o in outcomes if not o.ok]
    degraded = [o for o in outcomes if o.ok and o.degraded]
    clouds = _clouds_summary(samplers, wall_s / 2)
    tokens = sum(o.tokens for o in outcomes if o.ok)
    summary: dict[str, Any] = {
        "requests": len(outcomes), "errors": len(failed), "degraded": len(degraded),
        "degraded_by_reason": dict(Counter(o.degraded_reason for o in degraded)),
        "degraded_by_mode": dict(Counter(o.mode for o in degraded)),
        "greedy_checked": identity.checked, "greedy_mismatches": len(identity.mismatches),
        "greedy_references_failed": identity.references_failed,
        "http_5xx": sum(1 for o in failed if o.status is not None and o.status >= 500),
        "tokens": tokens, "wall_s": wall_s, "tokens_per_s": tokens / wall_s if wall_s else 0.0,
        "edge_rss_max_bytes": samplers[0].maximum("edge_rss"), "kv_budget_bytes": budget, **clouds,
        "edge_cpu_s": _used(samplers[0], "edge_cpu_s"), "edge_alive": edge_alive, **latency_summary(outcomes)}
    if identities:
        summary["identities"] = identity_summary(identities, outcomes, load.identity_of,
                                                 load.started_s + settings.duration_s)
    problems = _problems(settings, summary, outcomes, identity)
    names = {i: who.name for i, who in enumerate(identities or [])}
    requests = [asdict(o) | ({"identity": names[load.identity_of[o.index]]} if names else {}) for o in outcomes]
    return SoakResult(asdict(settings) | {"out": str(settings.out)}, summary, problems,
                      [asdict(s) | {"replica": i} for i, sampler in enumerate(samplers) for s in sampler.samples],
                      requests)


def _problems(settings: SoakSettings, summary: dict[str, Any], outcomes: list[RequestOutcome],
              identity: TargetIdentity) -> list[str]:
    failed = [o for o in outcomes if not o.ok]
    degraded = [o for o in outcomes if o.ok and o.degraded]
    kv_max = summary["kv_cache_bytes_max"]
    problems = [f"{len(failed)} of {len(outcomes)} requests failed"] + failure_lines(outcomes) if failed else []
    if degraded:
        problems.append(f"{len(degraded)} answers degraded ({summary['degraded_by_reason']}): "
                        f"requests {[o.index for o in degraded[:10]]}")
    if identity.mismatches:
        problems.append(f"{len(identity.mismatches)} of {identity.checked} greedy lossless answers differ from the "
                        f"target's: requests {identity.mismatches[:10]}")
    if kv_max is None:
        problems.append("no KV cache reading: the cloud's metrics endpoint never answered")
    elif kv_max > summary["kv_budget_bytes"]:
        problems.append(f"KV cache reached {kv_max / 2**20:.1f} MiB, above the {settings.kv_budget_mb} MiB budget")
    if not summary["edge_alive"]:
        problems.append("an edge daemon exited during the run")
    if not outcomes:
        problems.append("no request was sent")
    return problems + identity_problems(summary.get("identities", []))


def _used(sampler: ProcessSampler, name: str) -> float | None:
    """CPU seconds a process used during the run (from the first sample to the last)."""
    values = [getattr(s, name) for s in sampler.samples if getattr(s, name) is not None]
    return values[-1] - values[0] if values else None


def format_soak(result: SoakResult) -> str:
    s, cfg = result.summary, result.settings
    rows = [
        ("load", f"{_load_words(cfg)} for {cfg['duration_s']:g} s, {cfg['target']} / {cfg['draft']}"),
        ("requests (errors, HTTP 5xx, degraded)", f"{s['requests']} ({s['errors']}, {s['http_5xx']}, {s['degraded']})"),
        ("degraded by reason", ", ".join(f"{k} {v}" for k, v in s["degraded_by_reason"].items()) or "-"),
        ("greedy lossless answers = target's (checked, references failed)",
         f"{s['greedy_checked'] - s['greedy_mismatches']} of {s['greedy_checked']} ({s['greedy_references_failed']})"),
        ("tokens, tokens/s", f"{s['tokens']}, {s['tokens_per_s']:.1f}"),
        ("latency s p50 / p90 / p99 / max", " / ".join(seconds(s[k]) for k in
                                                      ("latency_s_p50", "latency_s_p90", "latency_s_p99", "latency_s_max"))),
        ("time to first token s p50 / p99 (streams)", f"{seconds(s['ttft_s_p50'])} / {seconds(s['ttft_s_p99'])}"),
        ("cloud RSS max MiB (2nd half max - 1st half max)", f"{mb(s['cloud_rss_max_bytes'])} ({mb(s['cloud_rss_growth_bytes'])})"),
        ("edge RSS max MiB", mb(s["edge_rss_max_bytes"])),
        ("CPU s used: cloud, edge (wall s)", f"{seconds(s['cloud_cpu_s'])}, {seconds(s['edge_cpu_s'])} ({s['wall_s']:.0f})"),
        ("KV cache max MiB / budget MiB", f"{mb(s['kv_cache_bytes_max'])} / {mb(s['kv_budget_bytes'])}"),
        ("cloud sessions open max, evicted", f"{s['sessions_open_max']}, {s['sessions_evicted']}"),
    ] + identity_table_rows(s.get("identities", []))
    lines = ["| soak | |", "|---|---|"] + [f"| {name} | {value} |" for name, value in rows]
    verdict = "PASS" if result.passed else "FAIL"
    lines.append(f"\n{verdict}" + "".join(f"\n- {p}" for p in result.problems))
    return "\n".join(lines)


def _load_words(cfg: dict[str, Any]) -> str:
    if cfg.get("identities"):
        return f"{len(cfg['identities'])} identities, {'+'.join(map(str, cfg['identities']))} concurrent sessions"
    return f"{cfg['sessions']} concurrent sessions"
