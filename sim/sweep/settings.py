"""What one network sweep measures (`SimulateSettings`): the models, the methods, the link, the prompts.

A leaf: the sweep's other modules (run, quality, report, fleet_validation) and its callers import it.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from common.spec.modes import MODES, PIPELINES, DecodeSettings, mode_of
from common.fleet_plane.connection import BrokerSettings

DEFAULT_MODES = MODES  # target, draft, sd, sd-block, sprinter, sprinter-exact, cloud-sd
ENGINES = ("resident", "llama.cpp")  # the cloud's --engine the sweep starts it with
# What a user would run instead, beside our modes (sim/sweep/baselines.py): llama.cpp's server alone, and with its
# own speculative decoding
BASELINES = ("llama-server", "llama-server-sd")


def is_baseline(method: str) -> bool:
    """A baseline row (sim/sweep/baselines.py) rather than one of our modes."""
    return method in BASELINES


def base_mode(method: str) -> str:
    """'sprinter-exact@goodput' -> 'sprinter-exact': a sweep's method is a mode, optionally with its call policy."""
    return method.partition("@")[0]


def run_label(method: str, pipeline: str = "off") -> str:
    """How reports name a (method, pipeline): the method alone when off, else 'sd-block/send-ahead'."""
    return method if pipeline == "off" else f"{method}/{pipeline}"


# What a finished result depends on: resuming into OUT with any of these changed would mix two runs.
# rtt_ms, modes, pipeline and limit may change between runs: new combinations are added, done ones kept.
# mqtt is not here: the fleet plane only watches the sweep (telemetry.jsonl), it changes no result.
RESULT_IDENTITY = ("target", "draft", "verifier", "temperature", "max_new_tokens", "policy", "dtype", "threads",
                   "pin_cpus", "jitter_ms", "jitter_distribution", "bandwidth_mbps", "loss", "prompts", "seed", "device",
                   "proposer", "engine")
# Settings added to RESULT_IDENTITY later: an OUT from before ran with these values.
IDENTITY_BEFORE = {"device": "auto", "proposer": "model", "engine": "resident"}


@dataclass(frozen=True)
class SimulateSettings:
    out: Path
    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    verifier: str = "auto"
    modes: tuple[str, ...] = DEFAULT_MODES
    baselines: tuple[str, ...] = ()  # BASELINES measured beside the modes, same prompts and cores
    engine: str = "resident"  # the cloud's --engine
    pipeline: tuple[str, ...] = ("off",)  # edge/decoding/pipeline.py; for the modes that pipeline, the others run "off"
    rtt_ms: tuple[float, ...] = (0.0, 20.0, 50.0, 100.0, 200.0)
    jitter_ms: float = 0.0  # one-way, per direction (sim.link.shaping.LinkSettings)
    jitter_distribution: str = "normal"
    bandwidth_mbps: float | None = None
    loss: float = 0.0
    temperature: float = 0.0
    seed: int = 0  # sampling seed of every request (the same for all, so modes compare)
    prompts: Path | None = None  # None: the shipped set's held-out split
    limit: int = 8
    max_new_tokens: int = 64
    policy: str | None = None  # the edge's default call policy (None: each mode's own default)
    proposer: str = "model"  # the edge's --proposer (common/spec/propose/proposals.py)
    dtype: str = "bfloat16"
    device: str = "auto"  # the cloud's --device (common/model/devices.py)
    threads: int | None = None  # intra-op threads of each process (None: the cores it may use)
    pin_cpus: bool = field(default_factory=lambda: len(os.sched_getaffinity(0)) >= 2)
    fleet_validation: bool = True
    # The fleet plane's broker: "auto" (Mosquitto in OUT/broker if installed), "off", or mqtt[s]://HOST[:PORT].
    # Not in repr: a URL may carry a password, and the settings are logged.
    mqtt: str = field(default="auto", repr=False)

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if base_mode(m) not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"modes must be a non-empty list of {', '.join(MODES)} (a mode that takes a call "
                             f"policy may name one: sprinter-exact@goodput); unknown: {unknown}")
        for method in self.modes:
            mode, _, policy = method.partition("@")
            if policy:
                DecodeSettings(mode=mode, policy=policy)  # raises ValueError naming what is wrong
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if any(b not in BASELINES for b in self.baselines):
            raise ValueError(f"baselines must be a list of {', '.join(BASELINES)}, got {self.baselines}")
        if not self.pipeline or any(p not in PIPELINES for p in self.pipeline):
            raise ValueError(f"pipeline must be a non-empty list of {', '.join(PIPELINES)}, got {self.pipeline}")
        if not self.rtt_ms or any(r < 0 for r in self.rtt_ms):
            raise ValueError(f"rtt_ms must be a non-empty list of values >= 0, got {self.rtt_ms}")
        if self.limit < 1 or self.max_new_tokens < 1:
            raise ValueError("limit and max_new_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not isinstance(self.mqtt, str):
            raise ValueError(f"mqtt must be auto, off or a broker URL, got {self.mqtt!r}")
        if self.mqtt not in ("auto", "off"):
            BrokerSettings.parse(self.mqtt)  # raises ValueError naming the URL

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def runs(self) -> list[tuple[str, str]]:
        """Every (method, pipeline) the sweep measures: methods whose mode has no pipeline run once, "off"."""
        pairs = [(m, p if mode_of(m).pipelines else "off") for m in self.modes for p in self.pipeline]
        return list(dict.fromkeys(pairs)) + [(b, "off") for b in self.baselines]

    def identity(self) -> dict[str, Any]:
        data = self.to_dict()
        return {key: data[key] for key in RESULT_IDENTITY}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if self.mqtt not in ("auto", "off"):  # config.json records which broker, never its password
            data["mqtt"] = str(BrokerSettings.parse(self.mqtt))
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
            if value is not None and name in ("modes", "pipeline", "rtt_ms", "baselines"):
                items = value.split(",") if isinstance(value, str) else value
                value = tuple(float(v) if name == "rtt_ms" else str(v).strip() for v in items if str(v).strip())
            elif value is not None and name in ("out", "prompts"):
                value = Path(value)
            values[name] = value
        if "out" not in values:
            raise ValueError("--out (or \"out\" in the config file) is required")
        return cls(**values)
