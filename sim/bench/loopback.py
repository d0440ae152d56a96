"""Cloud replicas and edge daemons as real processes on loopback, on one core plan: the system the operational benches
(soak, chaos, dashboards) load and break.

    with loopback_system(settings, ["--drain-s", "2"]) as system:
        system.bases[0], system.replicas[0].process.kill(), system.edges_alive()

Every replica is `cloud serve --target T --dtype D` plus the bench's own arguments (a `--metrics-port` of its own
with `metrics=True`), logged to OUT/cloud.log (OUT/cloud-I.log for several); every edge daemon serves the draft
against all the replicas with the settings' pipeline, logged to OUT/edge.log or its spec's name. The replicas run
on the plan's cloud cores and the edges on its edge cores (sim/cores.py): given one core, they all share it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

from sim.bench.settings.operations import ServedSettings
from sim.cores import CorePlan, thread_env
from sim.processes import CloudProcess, EdgeHandle, edge_daemon_process, free_port


@dataclass(frozen=True)
class EdgeSpec:
    log_name: str = "edge.log"
    args: tuple[str, ...] = ()  # beyond the draft, the clouds and the pipeline
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Replica:
    process: CloudProcess  # restartable on its port (chaos kills it)
    metrics_port: int | None


@dataclass(frozen=True)
class LoopbackSystem:
    replicas: list[Replica]
    edges: list[EdgeHandle]

    @property
    def bases(self) -> list[str]:
        return [edge.base for edge in self.edges]

    def edges_alive(self) -> bool:
        return all(edge.process.poll() is None for edge in self.edges)


def replicas(settings: ServedSettings, serve_args: Sequence[str], plan: CorePlan, metrics: bool,
             env: dict[str, str]) -> list[Replica]:
    """The replicas, not started yet (each starts when entered)."""
    made = []
    for i in range(settings.replicas):
        log_path = settings.out / ("cloud.log" if settings.replicas == 1 else f"cloud-{i}.log")
        log_path.write_text("")  # a fresh log; a restart appends to it
        port = free_port() if metrics else None
        own = ["--metrics-port", str(port)] if port else []
        made.append(Replica(CloudProcess("--target", settings.target, "--dtype", settings.dtype, *own, *serve_args,
                                         log_path=log_path, startup_timeout_s=settings.startup_timeout_s,
                                         cpus=set(plan.cloud), env={**plan.cloud_env(), **env}), port))
    return made


def edge_arguments(settings: ServedSettings, clouds: Sequence[Replica]) -> list[str]:
    return ["--draft", settings.draft, "--cloud", ",".join(r.process.address for r in clouds), "--dtype",
            settings.dtype, "--pipeline", settings.pipeline, "--model-name", f"{settings.draft}+{settings.target}"]


@contextmanager
def loopback_system(settings: ServedSettings, serve_args: Sequence[str], edges: Sequence[EdgeSpec] = (EdgeSpec(),),
                    metrics: bool = False, cloud_env: dict[str, str] | None = None) -> Iterator[LoopbackSystem]:
    """The replicas started one after the other (each once SERVING), then the edges (each once answering)."""
    settings.out.mkdir(parents=True, exist_ok=True)
    plan = CorePlan.split()
    clouds = replicas(settings, serve_args, plan, metrics, cloud_env or {})
    args = edge_arguments(settings, clouds)
    with ExitStack() as running:
        for replica in clouds:
            running.enter_context(replica.process)
        handles = [running.enter_context(edge_daemon_process(
            args + list(spec.args), free_port(), settings.out / spec.log_name, settings.startup_timeout_s,
            cpus=set(plan.edge), env={**thread_env(len(plan.edge)), **spec.env})) for spec in edges]
        yield LoopbackSystem(clouds, handles)
