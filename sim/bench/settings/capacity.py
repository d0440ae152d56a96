"""The capacity and fleet benches' settings and commands: edges per replica (`bench capacity`), replicas against
edges (`bench fleet`), the prefix caches through edge daemons (`bench prefix-fleet`), the edge pipeline at fleet
scale (`bench pipeline`). Import-light: building `sprinter`'s parser loads no torch from here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
import typing
from typing import Literal

from common.errors import UsageError
from sim.bench.registry import Bench

Dtype = Literal["bfloat16", "float32"]  # common.arguments.DTYPE_NAMES
Layout = Literal["one-core", "two-cores", "two-replicas"]  # bench fleet's cloud layouts (sim/bench/fleet.py layout_plan)
LAYOUTS: tuple[Layout, ...] = typing.get_args(Layout)
PREFIX_FLEET_PARTS = ("conversation", "fleet")


class BenchSettingsError(UsageError, ValueError):
    """A setting these benches cannot work with, named by its flag."""


def refuse_unless(checks: tuple[tuple[str, bool], ...], rule: str) -> None:
    """The first flag whose check fails, refused with the rule it broke."""
    for flag, ok in checks:
        if not ok:
            raise BenchSettingsError(f"{flag}: out of range ({rule})")


@dataclass(frozen=True)
class CapacityBenchSettings:
    """bench capacity (sim/bench/capacity.py): one pinned replica, E synthetic edges, each mode."""

    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    dtype: Dtype = "bfloat16"
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
    project_edges: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
    project_rtts: tuple[float, ...] = (0.0, 20.0, 50.0, 100.0, 200.0)
    measured: Path | None = None  # an earlier OUT/results.json: project it again, measure nothing
    out: Path = Path("results/bench-capacity")

    def __post_init__(self) -> None:
        refuse_unless((("--edges", bool(self.edges) and min(self.edges) >= 1),
                       ("--rtts", bool(self.rtts) and min(self.rtts) >= 0), ("--k", self.k >= 1),
                       ("--max-new-tokens", self.max_new_tokens >= 2), ("--generations", self.generations >= 1),
                       ("--edge-draft-ms", self.edge_draft_ms >= 0),
                       ("--itl-p99-ms", self.itl_p99_ms is None or self.itl_p99_ms > 0),
                       ("--project-edges", bool(self.project_edges) and min(self.project_edges) >= 1),
                       ("--project-rtts", bool(self.project_rtts) and min(self.project_rtts) >= 0)),
                      "edges >= 1, RTTs and draft ms >= 0 and not empty, k >= 1, max new tokens >= 2, "
                      "generations >= 1, the ITL target > 0")


@dataclass(frozen=True)
class FleetBenchSettings:
    """bench fleet (sim/bench/fleet.py): E synthetic edges on each cloud layout, then the fleet simulator."""

    target: str = "smollm2-135m"
    draft: str | None = None  # default: bench cloud's draft for the target
    dtype: Dtype = "bfloat16"
    edges: int = 8
    k: int = 5
    rounds_per_session: int = 24  # verifies per generation; then the edge opens a new session (placed afresh)
    duration_s: float = 30.0  # measured phase per layout
    rounds: int | None = None  # instead of duration_s: verifies per edge
    layouts: tuple[Layout, ...] = LAYOUTS
    batch_window_ms: float = 5.0
    max_batch: int = 8
    draft_step_ms: float = 10.0  # projection: one draft token on an edge (assumed)
    rtt_ms: float = 30.0  # projection: WAN round trip (assumed), plus the measured per-call overhead
    rtt_jitter_ms: float = 10.0
    profile: Literal["demo-sd", "measured"] = "demo-sd"
    replicas: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    fleet_edges: tuple[int, ...] = (10, 100, 1000, 10000)
    tokens_per_request: int = 128
    sim_requests: int = 1  # projection: generations per edge, each opening a session; until the last is done
    out: Path = Path("results/bench-fleet")
    measured: Path | None = None  # an earlier results.json: project again from its measured rows, measure nothing

    def __post_init__(self) -> None:
        unknown = sorted(set(self.layouts) - set(LAYOUTS))
        if unknown or not self.layouts:
            raise BenchSettingsError(f"--layouts: {', '.join(unknown) or 'none given'}; choose from {', '.join(LAYOUTS)}")
        refuse_unless((("--edges", self.edges >= 1), ("--k", self.k >= 1), ("--max-batch", self.max_batch >= 1),
                       ("--rounds-per-session", self.rounds_per_session >= 1)), "each >= 1")


@dataclass(frozen=True)
class PrefixFleetSettings:
    """bench prefix-fleet (sim/bench/prefix_fleet.py): a conversation's second turn; replicas sharing prompts."""

    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    dtype: Dtype = "bfloat16"
    # torch: in --dtype (ONNX runs float32); 8 edges fit beside 2 replicas
    draft_runtime: Literal["torch", "onnx", "llama.cpp"] = "torch"
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
        refuse_unless(tuple((f"--{name.replace('_', '-')}", getattr(self, name) >= 1) for name in (
            "history_tokens", "answer_tokens", "new_tokens", "max_tokens", "conversations", "replicas", "rounds",
            "system_tokens", "question_tokens")) + (("--edges", self.edges >= 2), ("--cpus", bool(self.cpus)),
                                                    ("--history-tokens", self.history_tokens > self.answer_tokens),
                                                    ("--parts", bool(self.parts) and set(self.parts) <= set(PREFIX_FLEET_PARTS))),
                      "each >= 1, --edges >= 2 (a system prompt each at least), --history-tokens above "
                      "--answer-tokens, --parts of conversation, fleet")


@dataclass(frozen=True)
class PipelineBenchSettings:
    """bench pipeline (sim/bench/pipeline.py): a sweep's pipelines projected to a fleet."""

    sweep: Path | None = None  # a `sprinter simulate --pipeline ...` OUT directory (required)
    edges: int = 1000
    replicas: int = 2
    rtt_ms: tuple[float, ...] = (20.0, 50.0, 100.0, 200.0, 300.0)
    tokens_per_request: int = 128
    out: Path = Path("results/bench-pipeline")


CAPACITY = Bench(
    "capacity", "edges per cloud replica when the edges draft vs when the cloud drafts", CapacityBenchSettings,
    "sim.bench.capacity:bench_capacity", plots=("tokens_per_s_per_user.png", "projection.png"),
    helps={"draft": "the cloud's draft, and the edges' (replayed)", "modes": "comma list",
           "edges": "concurrent edges per point, comma list", "rtts": "round trips in ms, comma list",
           "k": "draft tokens per round", "max_new_tokens": "tokens per generation",
           "generations": "per edge per point", "batch_window_ms": "default: the cloud's own",
           "edge_draft_ms": "sd-block, sprinter-exact: an edge's draft time per block token (0: instant)",
           "cloud_cpu": "the replica's core (default: the last one); the edges run on the others",
           "project_edges": "the fleet simulator fitted to the run, projected to these edge counts",
           "project_rtts": "... and these RTTs in ms",
           "measured": "an earlier OUT/results.json: project it again (its own settings), measure nothing",
           "itl_p99_ms": "the per-token ITL p99 that edges per replica are counted at (default 2.5x the target-alone "
                         "mode's at one edge and RTT 0: a user keeps 40%% of an idle replica's streaming speed)"})

FLEET = Bench(
    "fleet", "E edges on 1 vs 2 cloud replicas, and the fleet simulator's projection", FleetBenchSettings,
    "sim.bench.fleet:bench_fleet", plots=("projection.png",),
    helps={"draft": "default: bench cloud's draft for the target", "edges": "synthetic edges",
           "k": "draft tokens per block", "rounds_per_session": "verifies per generation",
           "duration_s": "measured phase per layout", "rounds": "instead of --duration-s: verifies per edge",
           "layouts": f"comma list of {', '.join(LAYOUTS)}", "draft_step_ms": "projection: one draft token (assumed)",
           "rtt_ms": "projection: round trip (assumed)", "tokens_per_request": "projection",
           "profile": "demo-sd (illustrative) or measured (the replay's acceptance)",
           "replicas": "projection: replica counts", "fleet_edges": "projection: edge counts",
           "sim_requests": "projection: generations per edge",
           "measured": "an earlier results.json: project again from its measured rows, measure nothing"})

PREFIX_FLEET = Bench(
    "prefix-fleet", "the prefix caches from end to end, through edge daemons: a conversation's second turn; "
                    "replicas and edges sharing system prompts", PrefixFleetSettings,
    "sim.bench.prefix_fleet:bench_prefix_fleet", quiet_http=True,
    helps={"draft_runtime": "the edges' draft runtime", "parts": "comma list of conversation, fleet (default both)",
           "cpus": "cores every process is pinned to (comma list)"})

PIPELINE = Bench(
    "pipeline", "the edge pipeline at fleet scale, from a measured sweep", PipelineBenchSettings,
    "sim.bench.pipeline:bench_pipeline", plots=("pipeline.png",),
    helps={"sweep": "a `sprinter simulate --pipeline ...` OUT directory (required)"})

BENCHES = (CAPACITY, FLEET, PREFIX_FLEET, PIPELINE)
