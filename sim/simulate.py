"""`sprinter simulate`: the network-latency sweep. Real cloud and edge processes, an emulated link.

    sprinter simulate --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --rtt-ms 0,50,100 --out results/sim

The cloud (`sprinter cloud serve`) and the edge daemon (`sprinter edge serve`) run as separate
processes (pinned to separate cores when there are two), the edge's gRPC channel going through a
`LinkProxy` in this process. For each RTT x mode x prompt one streamed request goes through the
edge's OpenAI API (sim.simulate_run); then, with both processes stopped, the target judges every
output (sim.simulate_quality), and OUT gets summary.csv/md and plots (sim.simulate_report) and a
fleet-simulator validation (sim.simulate_fleet). An interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from common.local_engine import MODES, DecodeSettings
from common.prompt_sets import (
    PromptRecord,
    interleave_categories,
    load_prompts,
    split_by_prompt,
)

log = logging.getLogger(__name__)

DEFAULT_MODES = MODES  # target, draft, sd, sd-block, sprinter, sprinter-exact
# What a finished result depends on: resuming into OUT with any of these changed would mix two runs.
def base_mode(method: str) -> str:
    """'sprinter-exact@goodput' -> 'sprinter-exact': a sweep's method is a mode, optionally with its call policy."""
    return method.partition("@")[0]


# rtt_ms, modes and limit may change between runs: new combinations are added, done ones kept.
RESULT_IDENTITY = ("target", "draft", "verifier", "temperature", "max_new_tokens", "policy", "dtype", "threads",
                   "pin_cpus", "jitter_ms", "jitter_distribution", "bandwidth_mbps", "loss", "prompts", "seed")


@dataclass(frozen=True)
class SimulateSettings:
    out: Path
    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    verifier: str = "auto"
    modes: tuple[str, ...] = DEFAULT_MODES
    rtt_ms: tuple[float, ...] = (0.0, 20.0, 50.0, 100.0, 200.0)
    jitter_ms: float = 0.0  # one-way, per direction (sim.link.LinkSettings)
    jitter_distribution: str = "normal"
    bandwidth_mbps: float | None = None
    loss: float = 0.0
    temperature: float = 0.0
    seed: int = 0  # sampling seed of every request (the same for all, so modes compare)
    prompts: Path | None = None  # None: the shipped set's held-out split
    limit: int = 8
    max_new_tokens: int = 64
    policy: str | None = None  # the edge's default call policy (None: each mode's own default)
    dtype: str = "bfloat16"
    threads: int | None = None  # intra-op threads of each process (None: the cores it may use)
    pin_cpus: bool = field(default_factory=lambda: len(os.sched_getaffinity(0)) >= 2)
    fleet_validation: bool = True

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if base_mode(m) not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"modes must be a non-empty list of {', '.join(MODES)} (a mode that takes a call "
                             f"policy may name one: sprinter-exact@goodput); unknown: {unknown}")
        for method in self.modes:
            mode, _, policy = method.partition("@")
            if policy:
                DecodeSettings(mode=mode, policy=policy)  # raises ValueError naming what is wrong
        if not self.rtt_ms or any(r < 0 for r in self.rtt_ms):
            raise ValueError(f"rtt_ms must be a non-empty list of values >= 0, got {self.rtt_ms}")
        if self.limit < 1 or self.max_new_tokens < 1:
            raise ValueError("limit and max_new_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def identity(self) -> dict[str, Any]:
        data = self.to_dict()
        return {key: data[key] for key in RESULT_IDENTITY}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        return {key: str(value) if isinstance(value, Path) else list(value) if isinstance(value, tuple) else value
                for key, value in data.items()}

    @classmethod
    def from_mapping(cls, data: dict[str, Any]) -> SimulateSettings:
        """Keys as in the CLI, with dashes or underscores; lists as JSON lists or comma-separated text."""
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in data.items():
            name = key.replace("-", "_")
            if name not in known:
                raise ValueError(f"unknown setting {key!r}; known: {', '.join(sorted(known))}")
            if value is not None and name in ("modes", "rtt_ms"):
                items = value.split(",") if isinstance(value, str) else value
                value = tuple(str(v).strip() if name == "modes" else float(v) for v in items if str(v).strip())
            elif value is not None and name in ("out", "prompts"):
                value = Path(value)
            values[name] = value
        if "out" not in values:
            raise ValueError("--out (or \"out\" in the config file) is required")
        return cls(**values)


def select_prompts(settings: SimulateSettings) -> list[PromptRecord]:
    """The first `limit` prompts, categories interleaved; by default from the shipped set's held-out
    split (the prompts the shipped verifier never trained on)."""
    if settings.prompts is None:
        records = split_by_prompt(load_prompts(), seed=0)[2]
    else:
        records = load_prompts(settings.prompts)
    return interleave_categories(records)[: settings.limit]


def check_out_dir(settings: SimulateSettings) -> None:
    """Write OUT/config.json, refusing to resume a sweep that ran with other result-defining settings."""
    settings.out.mkdir(parents=True, exist_ok=True)
    path = settings.out / "config.json"
    if path.exists():
        previous = json.loads(path.read_text()).get("identity", {})
        changed = {k: (previous.get(k), v) for k, v in settings.identity().items() if previous.get(k) != v}
        if changed:
            raise ValueError(f"{settings.out} holds a sweep run with other settings ({changed}: before, now); "
                             "use another --out, or delete its results.jsonl to start over")
    path.write_text(json.dumps({"settings": settings.to_dict(), "identity": settings.identity()}, indent=1) + "\n")


def simulate(settings: SimulateSettings, progress: bool = True) -> dict[str, Path]:
    """The whole sweep: measure (resuming), judge quality, report, validate the fleet simulator."""
    from sim.simulate_quality import judge
    from sim.simulate_report import write_report
    from sim.simulate_run import ResultStore, run_sweep

    check_out_dir(settings)
    prompts = select_prompts(settings)
    asyncio.run(run_sweep(settings, prompts, progress))
    records = ResultStore(settings.out / "results.jsonl").records()
    wanted = {(float(r), m, p.id) for r in settings.rtt_ms for m in settings.modes for p in prompts}
    records = [r for r in records if (r["rtt_ms"], r["mode"], r["prompt_id"]) in wanted]
    quality = judge(settings, prompts, records, progress)
    written = write_report(settings, records, quality)
    if settings.fleet_validation:
        from sim.simulate_fleet import validate_fleet

        try:
            written["fleet_validation"] = validate_fleet(settings, records)
        except Exception:  # optional: a failed calibration must not cost the measured sweep its report
            log.exception("fleet validation failed; the sweep's results and report are unaffected")
    return written


# --- CLI -----------------------------------------------------------------------------------------

def register(subcommands: argparse._SubParsersAction) -> None:
    p = subcommands.add_parser(
        "simulate", help="network-latency sweep: real cloud + edge processes over an emulated link",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        # Only flags the user gives land in the namespace, so they override --config and nothing else does.
        argument_default=argparse.SUPPRESS)
    p.add_argument("--config", type=Path, help="JSON object with the same keys as these flags; flags override it")
    p.add_argument("--out", type=Path, help="output directory (results.jsonl, summary.csv/md, plots); required")
    p.add_argument("--target", help="target model spec (default qwen2.5-coder-1.5b)")
    p.add_argument("--draft", help="draft model spec (default qwen2.5-coder-0.5b)")
    p.add_argument("--verifier", help="the edge's --verifier (default auto)")
    p.add_argument("--modes", help=f"comma-separated (default {','.join(DEFAULT_MODES)})")
    p.add_argument("--rtt-ms", dest="rtt_ms", help="comma-separated round-trip times (default 0,20,50,100,200)")
    p.add_argument("--jitter-ms", dest="jitter_ms", type=float, help="one-way jitter per direction (default 0)")
    p.add_argument("--jitter-distribution", dest="jitter_distribution", choices=["normal", "pareto"])
    p.add_argument("--bandwidth-mbps", dest="bandwidth_mbps", type=float, help="per direction (default unlimited)")
    p.add_argument("--loss", type=float, help="probability of a retransmission stall per chunk (default 0)")
    p.add_argument("--temperature", type=float, help="0 is greedy (default)")
    p.add_argument("--seed", type=int, help="sampling seed of every request (default 0)")
    p.add_argument("--prompts", type=Path, help="JSONL prompt file (default: the shipped set's held-out split)")
    p.add_argument("--limit", type=int, help="prompts, categories interleaved (default 8)")
    p.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, help="default 64")
    p.add_argument("--policy", help="the edge's default call policy (default: each mode's own)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="of both models (default bfloat16)")
    p.add_argument("--threads", type=int, help="intra-op threads per process (default: the cores it may use)")
    p.add_argument("--pin-cpus", dest="pin_cpus", action=argparse.BooleanOptionalAction,
                   help="cloud on one core, edge on another (default on with >= 2 cores)")
    p.add_argument("--fleet-validation", dest="fleet_validation", action=argparse.BooleanOptionalAction,
                   help="calibrate the fleet simulator from this run and compare (default on)")
    p.set_defaults(run=run)


def settings_from_args(args: argparse.Namespace) -> SimulateSettings:
    flags = {k: v for k, v in vars(args).items() if k not in ("config", "run", "command", "log_level")}
    config = json.loads(args.config.read_text()) if getattr(args, "config", None) else {}
    if not isinstance(config, dict):
        raise ValueError(f"{args.config}: expected a JSON object")
    return SimulateSettings.from_mapping({**config, **flags})


def run(args: argparse.Namespace) -> int:
    from sim.simulate_report import format_summary

    try:
        settings = settings_from_args(args)
    except ValueError as err:
        raise SystemExit(f"sprinter simulate: {err}") from None
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the progress bar
    log.info("simulate: %s", settings)
    written = simulate(settings)
    print(format_summary(settings.out))
    print("\nwrote " + ", ".join(str(p) for p in written.values()))
    return 0
