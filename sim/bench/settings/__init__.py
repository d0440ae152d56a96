"""The settings of `sprinter bench`'s benches and what their flags default to.

Apart from the modules that measure (sim/bench/local.py, cloud.py, ...), which load torch, gRPC or ONNX Runtime,
so that building `sprinter`'s parser (sim/bench/command.py) imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


LAYOUTS = ("one-core", "two-cores", "two-replicas")  # bench fleet's cloud layouts (sim/bench/fleet.py layout_plan)


@dataclass(frozen=True)
class CapacityBenchSettings:
    """bench capacity (sim/bench/capacity.py): one pinned replica, E synthetic edges, each mode."""

    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    dtype: str = "bfloat16"
    modes: tuple[str, ...] = ("target", "cloud-sd", "sd-block", "sprinter-exact")
    edges: tuple[int, ...] = (1, 2, 4, 8, 12, 16)
    rtts: tuple[float, ...] = (0.0, 20.0, 50.0, 100.0, 200.0)  # ms
    k: int = 5  # draft tokens per round
    max_new_tokens: int = 32  # per recorded generation (each replayed generation has the recorded length)
    generations: int = 1  # per edge per point, back to back
    itl_p99_ms: float | None = None  # None: 2.5x target's single-edge ITL p99 at RTT 0
    edge_draft_ms: float = 0.0  # a replaying edge waits this long per block token before sending (its drafting)
    batch_window_ms: float | None = None  # None: the cloud's own default
    cloud_cpu: int | None = None  # the replica's core (default: this process's last); the edges get the others
    # the fleet simulator fitted to the run, projected to these edge counts and RTTs (sim/bench/capacity_projection.py)
    project_edges: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
    project_rtts: tuple[float, ...] = (0.0, 20.0, 50.0, 100.0, 200.0)
    measured: Path | None = None  # an earlier OUT/results.json: project it again, measure nothing
    out: Path = Path("results/bench-capacity")

    def to_dict(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class FleetBenchSettings:
    target: str = "smollm2-135m"
    draft: str | None = None  # default: bench cloud's draft for the target
    dtype: str = "bfloat16"
    edges: int = 8
    k: int = 5
    rounds_per_session: int = 24  # verifies per generation; then the edge opens a new session (placed afresh)
    duration_s: float = 30.0  # measured phase per layout
    rounds: int | None = None  # instead of duration_s: verifies per edge
    layouts: tuple[str, ...] = LAYOUTS
    batch_window_ms: float = 5.0
    max_batch: int = 8
    draft_step_ms: float = 10.0  # projection: one draft token on an edge (assumed)
    rtt_ms: float = 30.0  # projection: WAN round trip (assumed), plus the measured per-call overhead
    rtt_jitter_ms: float = 10.0
    profile: str = "demo-sd"  # or "measured"
    replicas: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    fleet_edges: tuple[int, ...] = (10, 100, 1000, 10000)
    tokens_per_request: int = 128
    sim_requests: int = 1  # projection: generations per edge, each opening a session; until the last is done
    out: Path = Path("results/bench-fleet")
    measured: Path | None = None  # an earlier fleet.json: project again from its measured rows, measure nothing


PREFIX_FLEET_PARTS = ("conversation", "fleet")


@dataclass(frozen=True)
class PrefixFleetSettings:
    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    dtype: str = "bfloat16"
    draft_runtime: str = "torch"  # in --dtype (ONNX runs float32); 8 edges of it fit beside 2 replicas
    parts: tuple[str, ...] = PREFIX_FLEET_PARTS
    history_tokens: int = 1000  # turn 1's message and its answer
    answer_tokens: int = 32  # turn 1's answer, at most
    new_tokens: int = 40  # turn 2's message
    max_tokens: int = 16  # turn 2's answer and each fleet request's
    conversations: int = 1  # per configuration (cold, cached), each of its own text
    replicas: int = 2
    edges: int = 8
    rounds: int = 2  # requests per edge
    system_tokens: int = 500  # each of the 2 system prompts
    question_tokens: int = 30  # each fleet request's own question
    cpus: tuple[int, ...] = (1,)  # every process is pinned to these cores
    out: Path = Path("results/bench-prefix-fleet")

    def __post_init__(self) -> None:
        for name in ("history_tokens", "answer_tokens", "new_tokens", "max_tokens", "conversations", "replicas",
                     "rounds", "system_tokens", "question_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.edges < 2:
            raise ValueError(f"--edges must be >= 2 (one per system prompt at least), got {self.edges}")
        if self.history_tokens <= self.answer_tokens:
            raise ValueError("--history-tokens must be more than --answer-tokens (the history holds the answer)")
        if not self.parts or set(self.parts) - set(PREFIX_FLEET_PARTS):
            raise ValueError(f"--parts takes {', '.join(PREFIX_FLEET_PARTS)}, got {', '.join(self.parts) or 'none'}")
        if not self.cpus:
            raise ValueError("--cpus must name at least one core")


@dataclass(frozen=True)
class RolloutSettings:
    real_edges: int = 3
    simulated_edges: int = 200
    rounds: int = 10
    draft: str = "smollm2-135m"
    telemetry_pairs: int = 12  # requests to the edge with telemetry, and as many to the one without
    max_tokens: int = 64
    out: Path = Path("results/bench-rollout")


@dataclass(frozen=True)
class PlacementBenchSettings:
    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    dtype: str = "bfloat16"
    rtts_ms: tuple[float, ...] = (0.0, 20.0, 50.0, 100.0, 200.0)
    load_rtts_ms: tuple[float, ...] = (50.0,)  # RTTs measured again under load; empty: no load phase
    load_streams: int = 3  # other users' concurrent cloud-sd streams while under load
    prompts: int = 3
    max_tokens: int = 48
    k: int = 4
    mode: str = "sd-block"
    warmup: int = 2  # untimed requests per placement at each RTT (auto's: its learning)
    mqtt: str = "auto"  # the fleet plane: auto (Mosquitto here), off, or a broker URL
    out: Path = Path("results/bench-placement")

    def __post_init__(self) -> None:
        for name, flag in (("prompts", "--prompts"), ("max_tokens", "--max-new-tokens"), ("k", "-k"),
                           ("load_streams", "--load-streams")):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if any(rtt < 0 for rtt in self.rtts_ms + self.load_rtts_ms):
            raise ValueError("--rtt-ms and --load-rtt-ms must be >= 0")
