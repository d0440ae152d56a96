"""Cloud replicas under a bench's synthetic edges: the harness `bench capacity` and `bench fleet` share.

    flags = serve_flags(target="smollm2-135m", dtype="float32", max_batch=8)   # `cloud serve`'s arguments
    with replicas_started(out, "cloud", [{0}, {1}], thread_env(1), flags) as replicas:
        phase = Phase.start(replicas)
        ...                                   # the edges' load
        used = phase.end()                    # elapsed, CPU (edges, machine, each replica), metrics increases

Each replica is a `sprinter cloud serve` process with a metrics port of its own, logging to OUT/NAME-i.log; they
load their models side by side. A phase reads each replica's Prometheus metrics (sim/bench/load.py's scrape) and
CPU time, this process's CPU time (the edges run in it) and the whole machine's (/proc/stat) at its start and
its end: what a row says the replicas did and what the CPU went to.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.bench.load import cpu_seconds, scrape_metrics
from sim.processes import CloudProcess, free_port

log = logging.getLogger(__name__)


def serve_flags(**flags: object) -> list[str]:
    """`sprinter cloud serve`'s arguments from keywords: `max_batch=8` is `--max-batch 8`, True the bare flag,
    False its `--no-` form, None the cloud's own default (left out)."""
    args: list[str] = []
    for name, value in flags.items():
        flag = name.replace("_", "-")
        if value is True or value is False:
            args.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None:
            args += [f"--{flag}", str(value)]
    return args


def bench_prompt_ids(model: str) -> tuple[list[list[int]], Any]:
    """The bench prompts in `model`'s tokens, and its tokenizer (loaded alone: no weights)."""
    from transformers import AutoTokenizer

    from common.model.loading import model_dir
    from common.model.prompting import encode_prompt
    from sim.bench.prompts import load_bench_prompts
    tokenizer = AutoTokenizer.from_pretrained(model_dir(model))
    return [encode_prompt(tokenizer, p["prompt"], p["chat"]) for p in load_bench_prompts()], tokenizer


def machine_cpu_s() -> float:
    """CPU seconds every process on this machine has used: all of /proc/stat's time but idle and iowait."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Replica:
    cloud: CloudProcess
    metrics_port: int

    @property
    def address(self) -> str:
        return self.cloud.address

    def metrics(self) -> dict[str, float]:
        """Its metrics; none (a warning) when they are unreadable: its side of a row is then left out."""
        try:
            return scrape_metrics(self.metrics_port, timeout_s=5)
        except OSError as err:
            log.warning("metrics on port %d unreadable: %s", self.metrics_port, err)
            return {}


@contextmanager
def replicas_started(out: Path, name: str, cores: list[set[int] | None], env: dict[str, str],
                     flags: list[str]) -> Iterator[list[Replica]]:
    """A replica per entry of `cores` (its cores; None: unpinned), started and stopped side by side."""
    replicas = []
    for i, cpus in enumerate(cores):
        port, log_path = free_port(), out / f"{name}-{i}.log"
        log_path.write_text("")
        replicas.append(Replica(CloudProcess(*flags, "--metrics-port", str(port), log_path=log_path, cpus=cpus,
                                             env=env), port))
    clouds = [replica.cloud for replica in replicas]
    try:
        with ThreadPoolExecutor(len(clouds)) as pool:  # each loads its model: side by side is sooner
            list(pool.map(CloudProcess.start, clouds))
        yield replicas
    finally:
        with ThreadPoolExecutor(len(clouds)) as pool:
            list(pool.map(CloudProcess.stop, clouds))


@dataclass(frozen=True)
class ReplicaUse:
    address: str
    metrics: dict[str, float]  # each metric's increase over the phase
    cpu_s: float | None  # None: its CPU time was unreadable


@dataclass(frozen=True)
class PhaseUse:
    elapsed_s: float
    edges_cpu_s: float  # this process's: the edges run in it
    machine_cpu_s: float  # every process's
    replicas: list[ReplicaUse]


@dataclass(frozen=True)
class Phase:
    """A measured phase's start: what each replica, this process and the machine had used by then."""

    replicas: list[Replica]
    metrics: list[dict[str, float]]
    cpu_s: list[float | None]
    edges_cpu_s: float
    machine_cpu_s: float
    started: float

    @classmethod
    def start(cls, replicas: list[Replica]) -> Phase:
        return cls(replicas, [r.metrics() for r in replicas], [cpu_seconds(r.cloud.pid) for r in replicas],
                   time.process_time(), machine_cpu_s(), time.perf_counter())

    def end(self) -> PhaseUse:
        elapsed, edges = time.perf_counter() - self.started, time.process_time() - self.edges_cpu_s
        machine, used = machine_cpu_s() - self.machine_cpu_s, []
        for replica, before, cpu0 in zip(self.replicas, self.metrics, self.cpu_s):
            after, cpu1 = replica.metrics(), cpu_seconds(replica.cloud.pid)
            increases = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after.keys() | before.keys()}
            used.append(ReplicaUse(replica.address, increases, None if cpu0 is None or cpu1 is None else cpu1 - cpu0))
        return PhaseUse(elapsed, edges, machine, used)
