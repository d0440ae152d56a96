"""The operational benches' settings and commands: soak, chaos, dashboards (real processes on loopback, loaded and
broken) and rollout (the fleet plane's config rollout). Import-light: `sprinter --help` builds their flags from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from common.errors import UsageError
from sim.bench.registry import Bench

Dtype = Literal["bfloat16", "float32"]  # common/arguments.py DTYPE_NAMES
Pipeline = Literal["off", "ahead", "send-ahead"]  # common/spec/modes.py PIPELINES
DASHBOARDS_DIR = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "dashboards"


def _refuse(flag: str, why: str) -> None:
    raise UsageError(f"argument --{flag}: {why}")  # worded as argparse words a bad flag


def _listed(values: tuple[object, ...]) -> str:
    return ",".join(map(str, values))  # as the flag was written


@dataclass(frozen=True)
class ServedSettings:
    """Cloud replicas and edge daemons on loopback (sim/bench/loopback.py)."""

    target: str = "smollm2-135m"
    draft: str = "smollm2-135m:layers=4"
    dtype: Dtype = "bfloat16"
    pipeline: Pipeline = "off"  # the edge daemons' default --pipeline, for every request
    replicas: int = 1  # cloud processes the edge spreads its sessions over
    seed: int = 0
    startup_timeout_s: float = 900.0  # an edge daemon's (loading its draft)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            _refuse("replicas", f"must be >= 1, got {self.replicas}")


@dataclass(frozen=True)
class SoakSettings(ServedSettings):
    sessions: int = 32  # concurrent requests, each one cloud session while it runs
    identities: tuple[int, ...] = ()  # workers per edge identity (own token, own edge); empty: one edge, `sessions`
    duration_s: float = 300.0  # no request starts after this; those in flight finish
    max_tokens: tuple[int, ...] = (16, 96)  # MIN,MAX: each request draws its max_tokens from this range
    modes: tuple[str, ...] = ("sprinter-exact", "sd-block", "sd", "sprinter", "target")
    temperatures: tuple[float, ...] = (0.0, 1.0)
    kv_budget_mb: int = 64
    # The cloud refuses a KV budget that cannot hold one full context: a short context keeps a small budget legal.
    max_context: int = 1024
    max_sessions: int = 64
    sample_s: float = 0.5
    out: Path = Path("results/bench-soak")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (1 <= len(self.max_tokens) <= 2 and 1 <= self.max_tokens[0] <= self.max_tokens[-1]):
            _refuse("max-tokens", f"expected MIN,MAX with 1 <= MIN <= MAX, got {_listed(self.max_tokens)}")
        if self.identities and (len(self.identities) < 2 or min(self.identities) < 1):
            _refuse("identities", f"expected two or more worker counts, each >= 1, got {_listed(self.identities)}")
        if not self.modes or not self.temperatures:
            _refuse("modes" if not self.modes else "temperatures", "needs at least one value")

    @property
    def token_range(self) -> tuple[int, int]:
        return self.max_tokens[0], self.max_tokens[-1]


@dataclass(frozen=True)
class ChaosSettings(ServedSettings):
    requests: int = 32
    kills: int = 5
    max_tokens: int = 96
    modes: tuple[str, ...] = ("sprinter-exact", "sd-block", "target", "sd", "sprinter")
    stagger_s: float = 0.3  # between the starts of one phase's requests
    kill_after_s: tuple[float, ...] = (0.3, 1.5)  # MIN,MAX: from a phase's first request to the kill
    recovery_timeout_s: float = 60.0  # for the edge to see the cloud again before the last phase
    out: Path = Path("results/bench-chaos")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.requests < self.kills + 1:
            _refuse("requests", f"must be at least --kills + 1 ({self.kills + 1}), got {self.requests}: every "
                                "phase needs a request")
        if len(self.kill_after_s) != 2 or not 0 <= self.kill_after_s[0] <= self.kill_after_s[1]:
            _refuse("kill-after-s", f"expected MIN,MAX with 0 <= MIN <= MAX, got {_listed(self.kill_after_s)}")


@dataclass(frozen=True)
class DashboardBenchSettings:
    target: str = "smollm2-135m"
    draft: str = "smollm2-135m:layers=4"
    dtype: Dtype = "float32"
    sessions: int = 8
    duration_s: float = 120.0
    scrape_s: float = 1.0
    step_s: float = 2.0
    dashboards: Path = DASHBOARDS_DIR
    prometheus: str = "prometheus"
    out: Path = Path("results/bench-dashboards")
    images: Path | None = None  # where the PNGs go; None: OUT

    def __post_init__(self) -> None:
        for name in ("duration_s", "scrape_s", "step_s"):
            if not getattr(self, name) > 0:
                _refuse(name.replace("_", "-"), f"must be a positive number of seconds, not {getattr(self, name)}")

    @property
    def soak(self) -> SoakSettings:
        """The soak it records: in OUT/soak/."""
        return SoakSettings(target=self.target, draft=self.draft, dtype=self.dtype, sessions=self.sessions,
                            duration_s=self.duration_s, out=self.out / "soak")


@dataclass(frozen=True)
class RolloutSettings:
    real_edges: int = 3
    simulated_edges: int = 200
    rounds: int = 10
    draft: str = "smollm2-135m"
    telemetry_pairs: int = 12  # requests to the edge with telemetry, and as many to the one without
    max_tokens: int = 64
    out: Path = Path("results/bench-rollout")


SERVED_HELPS = {"pipeline": "the edge daemon's default pipeline, for every request",
                "startup_timeout_s": "for each edge daemon to answer"}
SOAK = Bench("soak", "N concurrent sessions for a duration: errors, RSS, KV bytes vs budget", SoakSettings,
             "sim.bench.soak:bench_soak", quiet_http=True, helps=SERVED_HELPS | {
                 "replicas": "cloud replicas behind the edge, each with its own budgets (checked per replica)",
                 "sessions": "concurrent requests (ignored with --identities)",
                 "identities": "N,M,...: one cloud token and one edge per identity, N_i workers each, instead of "
                               "--sessions: each identity's token share and latency (fairness of the cloud's line)",
                 "max_tokens": "MIN,MAX: each request's max_tokens is drawn from this range",
                 "modes": "comma list, used in turn", "kv_budget_mb": "the cloud's --kv-budget-mb",
                 "max_context": "the cloud's --max-context (its KV budget must hold one such session)",
                 "max_sessions": "the cloud's --max-sessions", "sample_s": "RSS and metrics sampling period"})
CHAOS = Bench("chaos", "kill -9 and restart the cloud during a run: every request must complete", ChaosSettings,
              "sim.bench.chaos:bench_chaos", quiet_http=True, helps=SERVED_HELPS | {
                  "replicas": "cloud replicas behind the edge; the kills go round them (2: one, then the other)",
                  "modes": "comma list, used in turn",
                  "kill_after_s": "MIN,MAX: seconds from a phase's first request to the kill"})
DASHBOARDS = Bench("dashboards", "the Grafana dashboards' queries over a recorded soak, as PNGs", DashboardBenchSettings,
                   "sim.bench.dashboards:bench_dashboards", quiet_http=True, helps={
                       "sessions": "concurrent requests in the soak", "duration_s": "the soak's load duration",
                       "scrape_s": "Prometheus's scrape interval", "step_s": "the range queries' step",
                       "dashboards": "folder of Grafana dashboard JSON", "prometheus": "the Prometheus server binary",
                       "images": "folder for the PNGs (default OUT; docs/img for the docs)"})
ROLLOUT = Bench("rollout", "fleet config rollout latency to real and simulated edges; telemetry cost", RolloutSettings,
                "sim.bench.rollout:bench_rollout", plots=("rollout.png",), quiet_http=True, helps={
                    "real_edges": "edge daemons with --mqtt (0: simulated edges only, no telemetry pairs)",
                    "simulated_edges": "fleet agents in this process", "rounds": "configs published",
                    "telemetry_pairs": "requests with telemetry, and as many without",
                    "max_tokens": "each telemetry request's"})

BENCHES = (SOAK, CHAOS, DASHBOARDS, ROLLOUT)
