"""What the steps of one `sprinter gpu check` share: the device, the sizes, the output folder and the model on it."""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from cloud.kv_pool import KVPool
from cloud.packed_forward import install
from cloud.resident_kv import KVLayout
from cloud.settings import CloudSettings
from common.model.loading import DTYPES
from sim.bench.engine import BenchSession, EngineRow, kv_store, open_sessions
from sim.bench.random_weights import random_model
from sim.bench.settings.engines import EngineBenchSettings
from sim.gpu_check.sizes import Sizes


@dataclass
class CheckRun:
    device: torch.device
    sizes: Sizes
    out: Path
    dtype: str = "bfloat16"
    _model: tuple[tuple[str, str], torch.nn.Module] | None = field(default=None, repr=False)  # one on the device

    @property
    def default_layout(self) -> str:
        """The resident engine's layout for `--attention auto` on this device (what the goals are read on)."""
        return "paged" if CloudSettings().paged(self.device.type) else "per-session"

    @property
    def layouts(self) -> tuple[str, ...]:
        other = "per-session" if self.default_layout == "paged" else "paged"
        return self.default_layout, other

    def model(self, name: str, dtype: str | None = None) -> torch.nn.Module:
        """Architecture `name` with random weights on the device, in `dtype` (default: the run's), installed for
        packed forwards (kept until another)."""
        key = (name, dtype or self.dtype)
        if self._model is not None and self._model[0] == key:
            return self._model[1]
        self._model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        model = random_model(name, DTYPES[key[1]], self.device)
        install(model)
        self._model = (key, model)
        return model

    def bench_settings(self, rounds: int | None = None) -> EngineBenchSettings:
        return EngineBenchSettings(device=str(self.device), dtype=self.dtype, k=self.sizes.k,
                                   rounds=rounds or self.sizes.rounds, warmup=self.sizes.warmup,
                                   edges=self.sizes.edges, contexts=self.sizes.contexts, out=self.out)

    def sessions(self, model: torch.nn.Module, layout: str, n: int, context: int,
                 settings: EngineBenchSettings) -> tuple[KVLayout | KVPool, list[BenchSession]]:
        kv = kv_store(model, layout, settings)
        return kv, open_sessions(model, kv, n, context, random.Random(context * 1000 + n))

    def write(self, name: str, payload: Any) -> Path:
        """OUT/name: a step's results, rewritten as they grow (a run cut off keeps what it measured)."""
        path = self.out / name
        if isinstance(payload, str):
            path.write_text(payload)
        else:
            path.write_text(json.dumps(payload, indent=1, default=_plain))
        return path

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def p50_ms(self, step: Callable[[], object], repeats: int, untimed: int = 3) -> float:
        """p50 ms of `step` (inputs to the device, the forward, rows to the host) over `repeats`, after `untimed`."""
        times = []
        for i in range(repeats + untimed):
            self.synchronize()
            started = time.perf_counter()
            step()
            if i >= untimed:
                times.append((time.perf_counter() - started) * 1e3)
        return round(statistics.median(times), 3)


def _plain(value: Any) -> Any:
    if isinstance(value, EngineRow):
        return asdict(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


class Deadline:
    """A step's share of the run: rows are measured while it lasts; the ones left are named as not reached."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.perf_counter() + seconds

    def passed(self) -> bool:
        return time.perf_counter() >= self.end
