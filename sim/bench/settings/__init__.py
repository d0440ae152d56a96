"""The settings of `sprinter bench`'s benches and what their flags default to.

Apart from the modules that measure (sim/bench/local.py, cloud.py, ...), which load torch, gRPC or ONNX Runtime,
so that building `sprinter`'s parser (sim/bench/command.py) imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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
