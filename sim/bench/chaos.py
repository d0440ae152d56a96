"""`sprinter bench chaos`: kill -9 the cloud and restart it, again and again, during a run of requests.

    sprinter bench chaos --target smollm2-135m --draft smollm2-135m:layers=4 --requests 32 --kills 5

Starts the cloud and an edge daemon on loopback. The REQUESTS are split into KILLS+1 phases; each
phase's requests start a little apart (`--stagger-s`), and some time into the phase
(`--kill-after-s`, drawn at random) the cloud gets SIGKILL and is restarted on the same port (the
edge knows one `--cloud` address). The next phase starts once the cloud serves again; the last one
runs after the last restart, once the edge reports the cloud reachable, and shows the recovery.
Modes, streaming and chat alternate between requests. With `--replicas N` the edge spreads its
sessions over N cloud processes and the kills go round them (two: one, then the other), so a
session on a killed replica moves to a live one.

It passes when every request is answered 200 and complete (degraded answers are allowed: they are
counted and must be marked), none gets a 5xx, the edge process is the same one from start to end,
and no answer after the final recovery is degraded. Writes OUT/chaos.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import time
from collections import Counter
import urllib.request
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from common.arguments import DTYPE_NAMES, floats, names
from common.lab.results_page import publish_if_asked
from common.spec.modes import PIPELINES
from sim.bench.load import RequestOutcome, RequestSpec, failure_lines, http_client, latency_summary, seconds, send_request
from sim.bench.target_identity import TargetIdentity, check_target_identity
from sim.bench.prompts import load_bench_prompts
from sim.processes import CloudProcess, edge_daemon_process, free_port

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChaosSettings:
    target: str = "smollm2-135m"
    draft: str = "smollm2-135m:layers=4"
    dtype: str = "bfloat16"
    requests: int = 32
    kills: int = 5
    max_tokens: int = 96
    modes: tuple[str, ...] = ("sprinter-exact", "sd-block", "target", "sd", "sprinter")
    stagger_s: float = 0.3  # between the starts of one phase's requests
    kill_after_s: tuple[float, float] = (0.3, 1.5)  # from a phase's first request to the kill
    recovery_timeout_s: float = 60.0  # for the edge to see the cloud again before the last phase
    seed: int = 0
    pipeline: str = "off"  # the edge daemon's default --pipeline (off, ahead, send-ahead)
    replicas: int = 1  # cloud processes the edge spreads over; kill k hits replica k mod replicas
    startup_timeout_s: float = 900.0
    out: Path = Path("results/bench-chaos")


@dataclass
class KillRecord:
    at_s: float  # monotonic
    pid: int | None
    restart_s: float  # from SIGKILL until the new process served
    in_flight: list[int] = field(default_factory=list)  # requests running at the kill
    replica: int = 0  # which cloud process


@dataclass
class ChaosResult:
    settings: dict[str, Any]
    summary: dict[str, Any]
    problems: list[str]
    kills: list[dict[str, Any]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


def register_chaos(benches: argparse._SubParsersAction) -> None:
    d = ChaosSettings()
    p = benches.add_parser("chaos", help="kill -9 and restart the cloud during a run: every request must complete",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=d.target)
    p.add_argument("--draft", default=d.draft)
    p.add_argument("--dtype", default=d.dtype, choices=DTYPE_NAMES)
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--kills", type=int, default=d.kills)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--modes", type=names, default=d.modes, help="comma list, used in turn")
    p.add_argument("--stagger-s", type=float, default=d.stagger_s)
    p.add_argument("--kill-after-s", type=floats, default=d.kill_after_s,
                   metavar="MIN,MAX", help="seconds from a phase's first request to the kill (default 0.3,1.5)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--pipeline", default=d.pipeline, choices=PIPELINES,
                   help="the edge daemon's default pipeline (off, ahead, send-ahead), for every request")
    p.add_argument("--replicas", type=int, default=d.replicas,
                   help="cloud replicas behind the edge; the kills go round them (2: one, then the other)")
    p.add_argument("--out", type=Path, default=d.out)
    p.set_defaults(run=run_chaos)


def settings_from_args(args: argparse.Namespace) -> ChaosSettings:
    if args.replicas < 1:
        raise SystemExit(f"sprinter bench chaos: --replicas must be >= 1, got {args.replicas}")
    if args.requests < args.kills + 1:
        raise SystemExit(f"sprinter bench chaos: --requests ({args.requests}) must be at least --kills + 1 "
                         f"({args.kills + 1}): every phase needs a request")
    return ChaosSettings(target=args.target, draft=args.draft, dtype=args.dtype, requests=args.requests,
                         kills=args.kills, max_tokens=args.max_tokens, modes=args.modes, stagger_s=args.stagger_s,
                         kill_after_s=args.kill_after_s, seed=args.seed,
                        pipeline=args.pipeline, replicas=args.replicas, out=args.out)


def run_chaos(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    result = chaos(settings_from_args(args))
    table = format_chaos(result)
    print(table)
    publish_if_asked(args, table)
    print(f"\nwrote {args.out}/chaos.json")
    return 0 if result.passed else 1


def chaos(settings: ChaosSettings) -> ChaosResult:
    settings.out.mkdir(parents=True, exist_ok=True)
    clouds = []
    for i in range(settings.replicas):
        log_path = settings.out / ("cloud.log" if settings.replicas == 1 else f"cloud-{i}.log")
        log_path.write_text("")
        clouds.append(CloudProcess("--target", settings.target, "--dtype", settings.dtype, "--drain-s", "2",
                                   log_path=log_path, startup_timeout_s=settings.startup_timeout_s))
    edge_args = ["--draft", settings.draft, "--cloud", ",".join(c.address for c in clouds), "--dtype", settings.dtype,
                 "--pipeline", settings.pipeline,
                 "--model-name", f"{settings.draft}+{settings.target}"]
    with ExitStack() as running:
        for cloud in clouds:
            running.enter_context(cloud)
        edge = running.enter_context(edge_daemon_process(edge_args, free_port(), settings.out / "edge.log",
                                                         settings.startup_timeout_s))
        edge_pid = edge.process.pid
        started = time.monotonic()
        run = ChaosRun(settings, clouds, edge.base)
        asyncio.run(run.drive())
        wall_s = time.monotonic() - started
        edge_alive = edge.process.poll() is None and edge.process.pid == edge_pid
        (settings.out / "edge-healthz.json").write_text(_healthz(edge.base))
    result = judge(settings, run, wall_s, edge_alive)
    (settings.out / "chaos.json").write_text(json.dumps(asdict(result), indent=1))
    return result


def _healthz(base: str) -> str:
    try:
        with urllib.request.urlopen(f"{base}/healthz", timeout=10) as response:
            return response.read().decode()
    except OSError as err:
        return json.dumps({"error": str(err)})


class ChaosRun:
    """The requests in phases, and the killer between them."""

    def __init__(self, settings: ChaosSettings, clouds: list[CloudProcess], base: str) -> None:
        self.settings = settings
        self.clouds = clouds
        self.base = base
        self.phases = settings.kills + 1
        self.rng = random.Random(settings.seed)
        self.prompts = load_bench_prompts()
        self.outcomes: list[RequestOutcome] = []
        self.kills: list[KillRecord] = []
        self.running: set[int] = set()
        self.recovery_s: float | None = None
        self.identity = TargetIdentity()

    def phase_of(self, index: int) -> int:
        return index * self.phases // self.settings.requests

    def spec(self, index: int) -> RequestSpec:
        prompt = self.prompts[index % len(self.prompts)]
        return RequestSpec(index=index, prompt=prompt["prompt"], chat=prompt["chat"],
                           mode=self.settings.modes[index % len(self.settings.modes)],
                           max_tokens=self.settings.max_tokens, stream=index % 2 == 0, seed=index)

    async def drive(self) -> None:
        gates = [asyncio.Event() for _ in range(self.phases)]
        gates[0].set()
        async with http_client(self.settings.requests) as client:
            requests = [asyncio.create_task(self.request(client, i, gates)) for i in range(self.settings.requests)]
            await self.kill_between_phases(client, gates)
            await asyncio.gather(*requests)
            self.identity = await check_target_identity(client, self.base, [self.spec(o.index) for o in self.outcomes],
                                                        self.outcomes)
        self.outcomes.sort(key=lambda o: o.index)

    async def request(self, client: httpx.AsyncClient, index: int, gates: list[asyncio.Event]) -> None:
        phase = self.phase_of(index)
        first = min(i for i in range(self.settings.requests) if self.phase_of(i) == phase)
        await gates[phase].wait()
        await asyncio.sleep((index - first) * self.settings.stagger_s)
        self.running.add(index)
        try:
            self.outcomes.append(await send_request(client, self.base, self.spec(index)))
        finally:
            self.running.discard(index)

    async def kill_between_phases(self, client: httpx.AsyncClient, gates: list[asyncio.Event]) -> None:
        for phase in range(self.settings.kills):
            await asyncio.sleep(self.rng.uniform(*self.settings.kill_after_s))
            cloud = self.clouds[phase % len(self.clouds)]
            record = KillRecord(time.monotonic(), cloud.pid, 0.0, sorted(self.running), phase % len(self.clouds))
            await asyncio.to_thread(cloud.kill)
            log.info("kill %d: cloud %d (pid %s) killed with %d requests in flight", phase + 1, record.replica,
                     record.pid, len(record.in_flight))
            await asyncio.to_thread(cloud.start)  # same port; returns once SERVING
            record.restart_s = time.monotonic() - record.at_s
            self.kills.append(record)
            if phase + 1 == self.settings.kills:
                await self.wait_recovered(client)
            gates[phase + 1].set()

    async def wait_recovered(self, client: httpx.AsyncClient) -> None:
        """Until the edge reports the cloud reachable again (its channel reconnects on its own)."""
        started = time.monotonic()
        while time.monotonic() - started < self.settings.recovery_timeout_s:
            try:
                if (await client.get(f"{self.base}/healthz", timeout=10)).json().get("cloud") == "reachable":
                    self.recovery_s = time.monotonic() - started
                    return
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(0.2)
        log.warning("the edge did not report the cloud reachable within %.0f s", self.settings.recovery_timeout_s)


def judge(settings: ChaosSettings, run: ChaosRun, wall_s: float, edge_alive: bool) -> ChaosResult:
    outcomes = run.outcomes
    failed = [o for o in outcomes if not o.ok]
    degraded = [o for o in outcomes if o.ok and o.degraded]
    last_phase = [o for o in outcomes if run.phase_of(o.index) == run.phases - 1]
    hit = {i for k in run.kills for i in k.in_flight}
    summary: dict[str, Any] = {
        "requests": len(outcomes), "completed": len(outcomes) - len(failed), "errors": len(failed),
        "http_5xx": sum(1 for o in failed if o.status is not None and o.status >= 500),
        "degraded": len(degraded), "kills": len(run.kills), "in_flight_at_kills": len(hit),
        "in_flight_at_kills_degraded": sum(1 for o in outcomes if o.index in hit and o.degraded),
        "restart_s_max": max((k.restart_s for k in run.kills), default=None), "recovery_s": run.recovery_s,
        "after_recovery": len(last_phase), "after_recovery_degraded": sum(1 for o in last_phase if o.degraded),
        "tokens": sum(o.tokens for o in outcomes if o.ok), "wall_s": wall_s, "edge_alive_same_pid": edge_alive,
        "cloud_starts": sum(c.starts for c in run.clouds), "replicas": len(run.clouds),
        "degraded_by_reason": dict(Counter(o.degraded_reason for o in degraded)),
        "greedy_checked": run.identity.checked, "greedy_mismatches": len(run.identity.mismatches),
        **latency_summary(outcomes)}
    problems = [f"{len(failed)} of {len(outcomes)} requests did not complete"] + failure_lines(outcomes) if failed else []
    if len(outcomes) != settings.requests:
        problems.append(f"{settings.requests - len(outcomes)} requests never ran")
    if len(run.kills) != settings.kills:
        problems.append(f"only {len(run.kills)} of {settings.kills} kills happened")
    if not edge_alive:
        problems.append("the edge daemon exited or was replaced during the run")
    if run.recovery_s is None and settings.kills:
        problems.append(f"the edge did not see the cloud again within {settings.recovery_timeout_s:g} s of the last restart")
    if run.identity.mismatches:
        problems.append(f"{len(run.identity.mismatches)} of {run.identity.checked} greedy lossless answers differ "
                        f"from the target's: requests {run.identity.mismatches[:10]}")
    if summary["after_recovery_degraded"]:
        problems.append(f"{summary['after_recovery_degraded']} answers after the final recovery were degraded: "
                        f"requests {[o.index for o in last_phase if o.degraded]}")
    return ChaosResult(asdict(settings) | {"out": str(settings.out)}, summary, problems,
                       [asdict(k) for k in run.kills], [asdict(o) for o in outcomes])


def format_chaos(result: ChaosResult) -> str:
    s, cfg = result.summary, result.settings
    rows = [
        ("run", f"{cfg['requests']} requests, {cfg['kills']} x kill -9 + restart, {cfg['target']} / {cfg['draft']}"),
        ("completed / requests", f"{s['completed']} / {s['requests']}"),
        ("HTTP 5xx", s["http_5xx"]),
        ("degraded answers (marked), by reason", f"{s['degraded']} ("
         + (", ".join(f"{k} {v}" for k, v in s["degraded_by_reason"].items()) or "-") + ")"),
        ("greedy lossless answers = target's", f"{s['greedy_checked'] - s['greedy_mismatches']} of {s['greedy_checked']}"),
        ("in flight at a kill (of them degraded)", f"{s['in_flight_at_kills']} ({s['in_flight_at_kills_degraded']})"),
        ("cloud restart s max; edge saw it back after s", f"{seconds(s['restart_s_max'])}; {seconds(s['recovery_s'])}"),
        ("after recovery: requests (degraded)", f"{s['after_recovery']} ({s['after_recovery_degraded']})"),
        ("edge process the same throughout", "yes" if s["edge_alive_same_pid"] else "NO"),
        ("latency s p50 / p99 / max", " / ".join(seconds(s[k]) for k in ("latency_s_p50", "latency_s_p99", "latency_s_max"))),
    ]
    lines = ["| chaos | |", "|---|---|"] + [f"| {name} | {value} |" for name, value in rows]
    lines.append(f"\n{'PASS' if result.passed else 'FAIL'}" + "".join(f"\n- {p}" for p in result.problems))
    return "\n".join(lines)
