"""A measured phase of load on cloud replicas (sim/cloud_under_test.py): what they, the edges and the machine used
over it. bench capacity and bench fleet read their rows' cloud side and CPU through it.

    with replicas_started(cloud, out, "cloud", [{0}, {1}]) as replicas:
        phase = Phase.start(replicas)
        ...                                   # the edges' load
        used = phase.end()                    # elapsed, CPU (edges, machine, each replica), metrics increases

A phase reads each replica's Prometheus metrics and CPU time, this process's CPU time (the edges run in it) and the
whole machine's (/proc/stat) at its start and its end: what a row says the replicas did and what the CPU went to.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from sim.bench.load import cpu_seconds
from sim.cloud_under_test import RunningCloud


def machine_cpu_s() -> float:
    """CPU seconds every process on this machine has used: all of /proc/stat's time but idle and iowait."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


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

    replicas: list[RunningCloud]
    metrics: list[dict[str, float]]
    cpu_s: list[float | None]
    edges_cpu_s: float
    machine_cpu_s: float
    started: float

    @classmethod
    def start(cls, replicas: list[RunningCloud]) -> Phase:
        return cls(replicas, [r.metrics() for r in replicas], [cpu_seconds(r.pid) for r in replicas],
                   time.process_time(), machine_cpu_s(), time.perf_counter())

    def end(self) -> PhaseUse:
        elapsed, edges = time.perf_counter() - self.started, time.process_time() - self.edges_cpu_s
        machine, used = machine_cpu_s() - self.machine_cpu_s, []
        for replica, before, cpu0 in zip(self.replicas, self.metrics, self.cpu_s):
            after, cpu1 = replica.metrics(), cpu_seconds(replica.pid)
            increases = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after.keys() | before.keys()}
            used.append(ReplicaUse(replica.address, increases, None if cpu0 is None or cpu1 is None else cpu1 - cpu0))
        return PhaseUse(elapsed, edges, machine, used)
