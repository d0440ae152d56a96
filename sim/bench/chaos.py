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
and no answer after the final recovery is degraded; the command exits 1 when it fails. Writes OUT/results.json
(settings, summary, kills, every request) and OUT/table.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import urllib.request
from dataclasses import asdict, dataclass, field

import httpx

from sim.bench.load import RequestOutcome, RequestSpec, http_client, seconds, send_request
from sim.bench.loopback import loopback_system
from sim.bench.prompts import load_bench_prompts
from sim.bench.registry import Verdict
from sim.bench.settings.operations import ChaosSettings
from sim.bench.target_identity import TargetIdentity, check_target_identity
from sim.bench.verdict import Judged, by_reason, outcome_problems, outcome_summary, verdict_table
from sim.processes import CloudProcess

log = logging.getLogger(__name__)


@dataclass
class KillRecord:
    at_s: float  # monotonic
    pid: int | None
    restart_s: float  # from SIGKILL until the new process served
    in_flight: list[int] = field(default_factory=list)  # requests running at the kill
    replica: int = 0  # which cloud process


def bench_chaos(settings: ChaosSettings) -> Verdict:
    with loopback_system(settings, {"drain_s": 2}) as system:
        started = time.monotonic()
        run = ChaosRun(settings, [replica.process for replica in system.replicas], system.bases[0])
        asyncio.run(run.drive())
        wall_s = time.monotonic() - started
        edge_alive = system.edges_alive()
        (settings.out / "edge-healthz.json").write_text(_healthz(system.bases[0]))
    result = judge(settings, run, wall_s, edge_alive)
    table = format_chaos(result, settings)
    result.write(settings, settings.out, table)
    return Verdict(table, result.passed)


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


def judge(settings: ChaosSettings, run: ChaosRun, wall_s: float, edge_alive: bool) -> Judged:
    outcomes = run.outcomes
    last_phase = [o for o in outcomes if run.phase_of(o.index) == run.phases - 1]
    hit = {i for k in run.kills for i in k.in_flight}
    summary = outcome_summary(outcomes, run.identity) | {
        "kills": len(run.kills), "in_flight_at_kills": len(hit),
        "in_flight_at_kills_degraded": sum(1 for o in outcomes if o.index in hit and o.degraded),
        "restart_s_max": max((k.restart_s for k in run.kills), default=None), "recovery_s": run.recovery_s,
        "after_recovery": len(last_phase), "after_recovery_degraded": sum(1 for o in last_phase if o.degraded),
        "wall_s": wall_s, "edge_alive_same_pid": edge_alive, "cloud_starts": sum(c.starts for c in run.clouds),
        "replicas": len(run.clouds)}
    problems = outcome_problems(outcomes, run.identity)
    if len(outcomes) != settings.requests:
        problems.append(f"{settings.requests - len(outcomes)} requests never ran")
    if len(run.kills) != settings.kills:
        problems.append(f"only {len(run.kills)} of {settings.kills} kills happened")
    if not edge_alive:
        problems.append("the edge daemon exited or was replaced during the run")
    if run.recovery_s is None and settings.kills:
        problems.append(f"the edge did not see the cloud again within {settings.recovery_timeout_s:g} s of the last restart")
    if summary["after_recovery_degraded"]:
        problems.append(f"{summary['after_recovery_degraded']} answers after the final recovery were degraded: "
                        f"requests {[o.index for o in last_phase if o.degraded]}")
    return Judged(summary, problems, {"kills": [asdict(k) for k in run.kills], "requests": [asdict(o) for o in outcomes]})


def format_chaos(result: Judged, settings: ChaosSettings) -> str:
    s = result.summary
    rows = [
        ("run", f"{settings.requests} requests, {settings.kills} x kill -9 + restart, {settings.target} / {settings.draft}"),
        ("completed / requests", f"{s['completed']} / {s['requests']}"),
        ("HTTP 5xx", s["http_5xx"]),
        ("degraded answers (marked), by reason", f"{s['degraded']} ({by_reason(s['degraded_by_reason'])})"),
        ("greedy lossless answers = target's", f"{s['greedy_checked'] - s['greedy_mismatches']} of {s['greedy_checked']}"),
        ("in flight at a kill (of them degraded)", f"{s['in_flight_at_kills']} ({s['in_flight_at_kills_degraded']})"),
        ("cloud restart s max; edge saw it back after s", f"{seconds(s['restart_s_max'])}; {seconds(s['recovery_s'])}"),
        ("after recovery: requests (degraded)", f"{s['after_recovery']} ({s['after_recovery_degraded']})"),
        ("edge process the same throughout", "yes" if s["edge_alive_same_pid"] else "NO"),
        ("latency s p50 / p99 / max", " / ".join(seconds(s[f"latency_s_{k}"]) for k in ("p50", "p99", "max"))),
    ]
    return verdict_table("chaos", rows, result.problems)
