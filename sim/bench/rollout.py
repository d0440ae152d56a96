"""`sprinter bench rollout`: how fast a fleet config reaches every edge, and what telemetry costs an edge.

    sprinter bench rollout --real-edges 3 --simulated-edges 200 --rounds 10 --out results/bench-rollout

Starts Mosquitto on loopback, REAL_EDGES `sprinter edge serve --mqtt` daemons (the draft alone, no cloud;
telemetry every second, five times the default rate) and SIMULATED_EDGES fleet agents in this process (each
its own MQTT connection and Last Will, applying a config at once), all in one group. Each round publishes a
new config (the call policy alternating) with `fleet apply`'s own code and waits for every edge's answer;
the time from publish to each answer is the ack latency. A real edge's ack also covers checking the config
and swapping it in between requests.

Telemetry's cost: one more edge daemon without `--mqtt`, pinned to the same core as the first real edge;
requests (mode draft, greedy, the same prompt) alternate between the two, one at a time, and each
response's own tokens/s is compared (with `--real-edges 0`, simulated edges alone: no pairs). Writes
OUT/results.json (every round's acks, the pairs' tokens/s, the summary), OUT/table.md and OUT/rollout.png (ack
latency CDF).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from common.fleet_plane.connection import BrokerSettings
from common.fleet_plane.messages import CloudLoad, EdgeState, EdgeTelemetry, FleetConfig
from common.fleet_plane.operator import ApplyResult, apply_config, read_fleet
from common.stats import percentile
from edge.fleet_agent import EdgeIdentity, FleetAgent
from sim.bench.run_folder import RunFolder
from sim.bench.settings.operations import RolloutSettings
from sim.broker import MosquittoBroker
from sim.cores import my_cores, thread_env
from sim.processes import edge_daemon_async, free_port

log = logging.getLogger(__name__)

GROUP = "bench"
POLICIES = ("fixed:3", "fixed:4")


class SimulatedEdge:
    """An edge's fleet-facing side with no model behind it: applies any config that checks, at once."""

    def __init__(self, identity: EdgeIdentity) -> None:
        self.identity = identity
        self.policy: str | None = None

    def state(self, status: str, config_version: int) -> EdgeState:
        return EdgeState(status, self.identity.edge_id, self.identity.group, "simulated", None,
                         {"id": "confidence:0.5", "sha256": None}, "sprinter-exact", self.policy,
                         self.identity.version, self.identity.api, config_version, time.time())

    def telemetry(self, edge_id: str, interval_s: float, dropped: int) -> EdgeTelemetry:
        return EdgeTelemetry(edge_id, time.time(), interval_s, 0.0, 0.0, None, 0, 0, 0, {}, None, dropped)

    def load_verifier(self, metadata_path: Path) -> object:
        raise ValueError("a simulated edge loads no verifier")

    async def apply(self, config: FleetConfig, verifier: object) -> None:
        self.policy = config.policy or self.policy

    def cloud_announced(self, load: CloudLoad) -> None:
        pass

    def message_rejected(self, reason: str) -> None:
        pass


@dataclass
class RolloutResult:
    rounds: list[list[dict]] = field(default_factory=list)  # per round, per edge: ApplyResult fields
    telemetry_tokens_per_s: dict[str, list[float]] = field(default_factory=dict)

    def latencies(self, real: bool | None = None) -> list[float]:
        return [a["latency_ms"] for r in self.rounds for a in r if a["ok"]
                and (real is None or a["edge_id"].startswith("real") == real)]

    def summary(self) -> dict:
        acks = [a for r in self.rounds for a in r]
        out: dict = {"edges": len(self.rounds[0]) if self.rounds else 0, "rounds": len(self.rounds),
                     "acks": len(acks), "refused_or_timed_out": sum(not a["ok"] for a in acks)}
        for name, real in (("all", None), ("real", True), ("simulated", False)):
            values = sorted(self.latencies(real))
            if values:
                out[f"{name}_ack_ms"] = {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99),
                                         "max": values[-1], "n": len(values)}
        with_t, without_t = (self.telemetry_tokens_per_s.get(k) for k in ("telemetry", "none"))
        if with_t and without_t:
            # Paired: each pair ran back to back on the same core, so the ratio cancels the machine's drift.
            costs = [(1 - w / wo) * 100 for w, wo in zip(with_t, without_t)]
            half_width = 1.96 * statistics.stdev(costs) / len(costs) ** 0.5 if len(costs) > 1 else float("nan")
            out["telemetry"] = {"tokens_per_s_with": statistics.mean(with_t),
                                "tokens_per_s_without": statistics.mean(without_t),
                                "cost_pct": statistics.mean(costs), "cost_pct_ci95": half_width, "pairs": len(costs)}
        return out


async def _simulated_fleet(stack: AsyncExitStack, broker: BrokerSettings, n: int) -> None:
    for i in range(n):
        identity = EdgeIdentity(f"sim-{i:03d}", GROUP, "simulated", "-")
        await stack.enter_async_context(FleetAgent(broker, identity, SimulatedEdge(identity),
                                                   telemetry_interval_s=5.0))


async def _real_edges(stack: AsyncExitStack, settings: RolloutSettings, url: str) -> list[str]:
    """The real edges' base URLs, then the control edge's (without telemetry); none with no real edges."""
    cpus, env = set(my_cores()[-1:]), thread_env(1)  # one core, one thread: the pairs compare like with like
    common = ["--draft", settings.draft, "--draft-runtime", "onnx", "--verifier", "confidence:0.5", "--mode", "draft"]
    runs = [(common + ["--mqtt", url, "--edge-id", f"real-{i}", "--group", GROUP, "--telemetry-interval", "1"],
             f"edge-real-{i}.log") for i in range(settings.real_edges)]
    runs += [(common, "edge-control.log")] if runs else []
    return [await stack.enter_async_context(edge_daemon_async(args, free_port(), settings.out / log_name, cpus=cpus,
                                                              env=env)) for args, log_name in runs]


async def _wait_online(broker: BrokerSettings, expected: int) -> None:
    deadline = time.monotonic() + 120
    while True:
        snapshot = await read_fleet(broker, wait_s=0.5)
        online = len(snapshot.online_edges(GROUP))
        if online >= expected:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{online} of {expected} edges came online")


async def _telemetry_cost(settings: RolloutSettings, with_telemetry: str, without: str) -> dict[str, list[float]]:
    body = {"model": "x", "prompt": "def fibonacci(n):", "max_tokens": settings.max_tokens, "temperature": 0}
    speeds: dict[str, list[float]] = {"telemetry": [], "none": []}
    async with httpx.AsyncClient(timeout=300) as client:
        for pair in range(settings.telemetry_pairs + 1):
            order = (("telemetry", with_telemetry), ("none", without))
            for name, base in order if pair % 2 else order[::-1]:  # alternate who goes first
                response = await client.post(base + "/v1/completions", json=body)
                response.raise_for_status()
                if pair:  # the first pair warms both up
                    speeds[name].append(response.json()["sprinter"]["stats"]["tokens_per_s"])
    return speeds


async def measure(settings: RolloutSettings) -> RolloutResult:
    settings.out.mkdir(parents=True, exist_ok=True)
    result = RolloutResult()
    with MosquittoBroker(settings.out / "broker") as running:
        broker = BrokerSettings.parse(running.url)
        async with AsyncExitStack() as stack:
            bases = await _real_edges(stack, settings, running.url)
            await _simulated_fleet(stack, broker, settings.simulated_edges)
            await _wait_online(broker, settings.real_edges + settings.simulated_edges)
            log.info("%d edges online; %d rounds", settings.real_edges + settings.simulated_edges, settings.rounds)
            for round_index in range(settings.rounds):
                answers: list[ApplyResult] = await apply_config(broker, GROUP, {"policy": POLICIES[round_index % 2]},
                                                                timeout_s=30)
                result.rounds.append([asdict(a) for a in answers])
                log.info("round %d: %d acks, p99 %.0f ms", round_index + 1, sum(a.ok for a in answers),
                         percentile([a.latency_ms for a in answers if a.ok], 0.99) or 0.0)
            if settings.real_edges:
                result.telemetry_tokens_per_s = await _telemetry_cost(settings, bases[0], bases[-1])
    return result


def format_table(summary: dict) -> str:
    lines = ["| edges | ack p50 ms | ack p99 ms | max ms | acks |", "|---|---|---|---|---|"]
    for name in ("real", "simulated", "all"):
        if (s := summary.get(f"{name}_ack_ms")) is not None:
            lines.append(f"| {name} | {s['p50']:.1f} | {s['p99']:.1f} | {s['max']:.1f} | {s['n']} |")
    if t := summary.get("telemetry"):
        lines.append(f"\ntelemetry every 1 s: {t['tokens_per_s_with']:.1f} tok/s vs {t['tokens_per_s_without']:.1f} "
                     f"without; cost {t['cost_pct']:+.2f}% +- {t['cost_pct_ci95']:.2f}% (95% CI, {t['pairs']} pairs)")
    lines.append(f"refused or timed out: {summary['refused_or_timed_out']} of {summary['acks']}")
    return "\n".join(lines)


def plot(result: RolloutResult, path: Path) -> None:
    from common.lab.plots import saved_figure

    with saved_figure(path, figsize=(6, 4)) as (_, ax):
        for name, real in (("real edges", True), ("simulated edges", False)):
            values = sorted(result.latencies(real))
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=f"{name} (n={len(values)})")
        ax.set(xlabel="config ack latency (ms, publish to answer)", ylabel="fraction of acks", title="fleet config rollout")
        ax.legend()


def bench_rollout(settings: RolloutSettings) -> str:
    """Every round's rollout and the telemetry pairs; writes OUT/results.json, table.md, rollout.png; the table."""
    result = asyncio.run(measure(settings))
    summary, folder = result.summary(), RunFolder(settings.out)
    folder.write_results(settings, summary=summary, rounds=result.rounds,
                         telemetry_tokens_per_s=result.telemetry_tokens_per_s)
    table = folder.write_table(format_table(summary))
    plot(result, folder.path("rollout.png"))
    return table
