"""The cloud a measurement runs against: one description of a `sprinter cloud serve` process (its flags, cores,
torch threads, environment, checkout and metrics port) and the way it is started, once or as replicas side by side.

    cloud = CloudUnderTest("smollm2-135m", "float32", {"max_batch": 8}, cpus=frozenset({0}), metrics=True)
    with cloud.running(out / "cloud.log") as running:            # running.address, running.pid, running.metrics()
        ...
    with replicas_started(cloud, out, "cloud", [{0}, {1}]) as replicas:     # OUT/cloud-0.log, OUT/cloud-1.log
        ...

Every bench and the sweep's system under test (sim/sweep/system.py) describe their cloud here rather than spell
its command line. Flags are keywords (`max_batch=8` is `--max-batch 8`, True the bare flag, False its `--no-` form,
None left to the cloud's own default) so that an older checkout's cloud, which may lack a newer flag, is asked only
for what a bench sets. A pinned cloud's torch pool is sized to its cores: torch sizes it from the machine, not the
affinity mask. Each start writes a fresh log; a CloudProcess appends to it across restarts (chaos kills it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from sim.bench.load import scrape_metrics
from sim.cores import thread_env
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


@dataclass(frozen=True)
class CloudUnderTest:
    """`sprinter cloud serve` for one target, as a measurement starts it."""

    target: str
    dtype: str | None = "bfloat16"  # None: the engine's own types (llama.cpp runs the GGUF's)
    flags: Mapping[str, object] = field(default_factory=dict)  # more `cloud serve` flags, as serve_flags takes them
    extra: tuple[str, ...] = ()  # and as given (a bench's --serve-args)
    cpus: frozenset[int] | None = None  # pinned to these cores; None: unpinned
    threads: int | None = None  # its torch pool; None: as many as its cores (unpinned: torch's own)
    env: Mapping[str, str] = field(default_factory=dict)  # more environment variables
    pythonpath: str | None = None  # another checkout's cloud
    metrics: bool = False  # serve Prometheus metrics on a port of its own (RunningCloud.metrics)
    startup_timeout_s: float = 300.0

    def serve_args(self, metrics_port: int | None) -> list[str]:
        return [*serve_flags(target=self.target, dtype=self.dtype, **self.flags, metrics_port=metrics_port),
                *self.extra]

    def environment(self) -> dict[str, str]:
        env = {**thread_env(self.threads or (len(self.cpus) if self.cpus else None)), **self.env}
        if self.pythonpath:  # its packages and stubs first, and `python -m` must not put this checkout (the cwd)
            env |= {"PYTHONPATH": self.pythonpath, "PYTHONSAFEPATH": "1"}  # before them
        return env

    def process(self, log_path: Path) -> RunningCloud:
        """Its process, not yet started, logging to a fresh `log_path`."""
        metrics_port = free_port() if self.metrics else None
        log_path.write_text("")
        return RunningCloud(CloudProcess(*self.serve_args(metrics_port), log_path=log_path,
                                         startup_timeout_s=self.startup_timeout_s,
                                         cpus=set(self.cpus) if self.cpus else None, env=self.environment()),
                            metrics_port)

    @contextmanager
    def running(self, log_path: Path) -> Iterator[RunningCloud]:
        """Started and SERVING (the model loaded); SIGTERM (it drains) on exit."""
        cloud = self.process(log_path)
        with cloud.process:
            yield cloud


@dataclass(frozen=True)
class RunningCloud:
    process: CloudProcess  # restartable on its port
    metrics_port: int | None

    @property
    def address(self) -> str:
        return self.process.address

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def metrics(self) -> dict[str, float]:
        """Its metrics; none without a metrics port, or (a warning) when they are unreadable."""
        if self.metrics_port is None:
            return {}
        try:
            return scrape_metrics(self.metrics_port, timeout_s=5)
        except OSError as err:
            log.warning("metrics on port %d unreadable: %s", self.metrics_port, err)
            return {}


@contextmanager
def replicas_started(cloud: CloudUnderTest, out: Path, name: str,
                     cores: Sequence[set[int] | frozenset[int] | None]) -> Iterator[list[RunningCloud]]:
    """A replica of `cloud` per entry of `cores` (its cores; None: unpinned), logging to OUT/NAME-i.log, started
    and stopped side by side: each loads its model, and side by side is sooner."""
    replicas = [replace(cloud, cpus=frozenset(cpus) if cpus else None).process(out / f"{name}-{i}.log")
                for i, cpus in enumerate(cores)]
    processes = [replica.process for replica in replicas]
    try:
        with ThreadPoolExecutor(len(processes)) as pool:
            list(pool.map(CloudProcess.start, processes))
        yield replicas
    finally:
        with ThreadPoolExecutor(len(processes)) as pool:
            list(pool.map(CloudProcess.stop, processes))
