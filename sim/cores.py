"""Which cores the cloud and the edge of a measurement run on: one rule, read from this process's affinity.

    plan = CorePlan.split()                 # the cloud on the first half of my cores, the edge on the rest
    with plan.edge_here():                  # this process (the edge's draft, in process) on the edge's cores
        CloudUnderTest(..., cpus=plan.cloud).running(log)   # sim/cloud_under_test.py: its torch pool sized to them

A deployment's edge and cloud have cores of their own, so a measurement gives each its own: with two cores or
more that this process may use, the cloud gets the first half and the edge the rest. Given one core (`taskset -c
N`, the way to measure on a shared machine), both share it: a round's drafting and its verify mostly take turns,
so sharing changes less than it seems. The cores are this process's affinity, never `os.cpu_count()`: a bench
run under taskset must stay inside what it was given.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


def my_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def thread_env(threads: int | None) -> dict[str, str]:
    """The environment that holds a process's torch pool to `threads`: torch sizes it from the machine, not the
    affinity mask, so a pinned process must be told."""
    return {"OMP_NUM_THREADS": str(threads)} if threads else {}


@dataclass(frozen=True)
class CorePlan:
    cloud: frozenset[int]
    edge: frozenset[int]

    @classmethod
    def split(cls, cores: list[int] | None = None) -> CorePlan:
        """The cloud on the first half of `cores` (default: this process's), the edge on the rest; one core: both."""
        ordered = sorted(cores if cores is not None else my_cores())
        if len(ordered) == 1:
            return cls(frozenset(ordered), frozenset(ordered))
        half = len(ordered) // 2
        return cls(frozenset(ordered[:half]), frozenset(ordered[half:]))

    @property
    def apart(self) -> bool:
        """Whether the cloud and the edge have cores of their own."""
        return not self.cloud & self.edge

    @contextmanager
    def edge_here(self) -> Iterator[None]:
        """This process on the edge's cores for the while (and torch's pool sized to them), then back."""
        import torch  # the benches that draft in process have it loaded already

        mine, threads = os.sched_getaffinity(0), torch.get_num_threads()
        os.sched_setaffinity(0, self.edge)
        torch.set_num_threads(len(self.edge))
        try:
            yield
        finally:
            os.sched_setaffinity(0, mine)
            torch.set_num_threads(threads)
