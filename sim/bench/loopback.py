"""Cloud replicas and edge daemons as real processes on loopback, on one core plan: the system the operational
benches (soak, chaos, dashboards) load and break.

    with loopback_system(settings, {"drain_s": 2}) as system:
        system.bases[0], system.replicas[0].process.kill(), system.edges_alive()

The replicas are those of sim/cloud_under_test.py (`cloud serve --target T --dtype D` plus the bench's own
flags, a metrics port each, OUT/cloud-I.log), started side by side; then every edge daemon, serving the draft
against all of them with the settings' pipeline, logged to OUT/edge.log or its spec's name. The replicas run on the
plan's cloud cores and the edges on its edge cores (sim/cores.py): given one core, they all share it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

from sim.bench.settings.operations import ServedSettings
from sim.cloud_under_test import CloudUnderTest, RunningCloud, replicas_started
from sim.cores import CorePlan, thread_env
from sim.processes import EdgeHandle, edge_daemon_process, free_port


@dataclass(frozen=True)
class EdgeSpec:
    log_name: str = "edge.log"
    args: tuple[str, ...] = ()  # beyond the draft, the clouds and the pipeline
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LoopbackSystem:
    replicas: list[RunningCloud]  # each restartable on its port (chaos kills them)
    edges: list[EdgeHandle]

    @property
    def bases(self) -> list[str]:
        return [edge.base for edge in self.edges]

    def edges_alive(self) -> bool:
        return all(edge.process.poll() is None for edge in self.edges)


def edge_arguments(settings: ServedSettings, clouds: Sequence[RunningCloud]) -> list[str]:
    return ["--draft", settings.draft, "--cloud", ",".join(r.address for r in clouds), "--dtype", settings.dtype,
            "--pipeline", settings.pipeline, "--model-name", f"{settings.draft}+{settings.target}",
            "--mode", "sprinter-exact"]  # the mode these benches load and break, whatever the daemon's default


@contextmanager
def loopback_system(settings: ServedSettings, serve: dict[str, object], edges: Sequence[EdgeSpec] = (EdgeSpec(),),
                    cloud_env: dict[str, str] | None = None) -> Iterator[LoopbackSystem]:
    """The replicas (`serve`: their flags beyond target and dtype, as CloudUnderTest takes them), each once SERVING,
    then the edges, each once answering."""
    settings.out.mkdir(parents=True, exist_ok=True)
    plan = CorePlan.split()
    cloud = CloudUnderTest(settings.target, settings.dtype, serve, env=cloud_env or {}, metrics=True)
    with replicas_started(cloud, settings.out, "cloud", [plan.cloud] * settings.replicas) as clouds, \
            ExitStack() as running:
        handles = [running.enter_context(edge_daemon_process(
            edge_arguments(settings, clouds) + list(spec.args), free_port(), settings.out / spec.log_name,
            settings.startup_timeout_s, cpus=set(plan.edge), env={**thread_env(len(plan.edge)), **spec.env}))
            for spec in edges]
        yield LoopbackSystem(clouds, handles)
