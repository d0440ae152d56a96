"""`sprinter fleet up`: a whole fleet on this machine as processes on loopback, no containers.

    sprinter fleet up --clouds 2 --edges 3 --mqtt      # Ctrl-C stops them all

Starts (with --mqtt) a Mosquitto broker, CLOUDS `sprinter cloud serve` replicas and EDGES `sprinter
edge serve` daemons, each edge given every replica (`--cloud a,b`) and, with the broker, the fleet
plane (presence, telemetry, config). Prints every address and where the logs are, then waits. The
tiny random pair is the default: it starts in seconds; `--target smollm2-135m --draft
smollm2-135m:layers=4` is a real pair.
"""

from __future__ import annotations

import argparse
import logging
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from edge.runtime.draft_choice import RUNTIMES
from sim.broker import MosquittoBroker
from sim.processes import CloudProcess, EdgeHandle, edge_daemon_process, free_port

log = logging.getLogger(__name__)

GROUP = "local"


@dataclass(frozen=True)
class LocalFleetSettings:
    clouds: int = 2
    edges: int = 3
    mqtt: bool = False
    target: str = "tiny-random"
    draft: str = "tiny-random-draft"
    dtype: str = "float32"
    draft_runtime: str = "torch"  # the tiny pair starts at once; "onnx" exports the draft first (cached)
    mode: str = "sprinter-exact"
    drain_s: float = 5.0
    out: Path = Path("results/fleet-up")  # logs, and the broker's files
    edge_args: tuple[str, ...] = field(default=())  # more `edge serve` flags


class LocalFleet:
    """`with LocalFleet(settings) as fleet:` broker, replicas and edges up; all stopped on exit."""

    def __init__(self, settings: LocalFleetSettings) -> None:
        self.settings = settings
        self.broker: MosquittoBroker | None = None
        self.clouds: list[CloudProcess] = []
        self.edges: list[EdgeHandle] = []
        self._stack = ExitStack()

    def __enter__(self) -> LocalFleet:
        s = self.settings
        s.out.mkdir(parents=True, exist_ok=True)
        try:
            if s.mqtt:
                self.broker = self._stack.enter_context(MosquittoBroker(s.out / "broker"))
            for i in range(s.clouds):
                cloud = CloudProcess(*self._cloud_args(i), log_path=s.out / f"cloud-{i}.log", startup_timeout_s=600)
                self._stack.callback(cloud.kill)  # a replica a demo killed already is simply gone
                self._stack.callback(cloud.stop, s.drain_s + 10)
                cloud.start()
                self.clouds.append(cloud)
                log.info("cloud-%d serving on %s", i, cloud.address)
            for i in range(s.edges):
                port = free_port()
                self.edges.append(self._stack.enter_context(edge_daemon_process(
                    self._edge_args(i), port, s.out / f"edge-{i}.log", timeout_s=600)))
                log.info("edge-%d serving on %s/v1", i, self.edges[-1].base)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _cloud_args(self, i: int) -> list[str]:
        s = self.settings
        args = ["--target", s.target, "--dtype", s.dtype, "--drain-s", str(s.drain_s), "--batch-window-ms", "2"]
        if self.broker is not None:
            args += ["--mqtt", self.broker.url, "--replica-id", f"cloud-{i}", "--mqtt-keepalive", "3"]
        return args

    def _edge_args(self, i: int) -> list[str]:
        s = self.settings
        args = ["--draft", s.draft, "--dtype", s.dtype, "--draft-runtime", s.draft_runtime, "--mode", s.mode,
                "--cloud", ",".join(c.address for c in self.clouds), *s.edge_args]
        if self.broker is not None:
            args += ["--mqtt", self.broker.url, "--edge-id", f"edge-{i}", "--group", GROUP, "--telemetry-interval",
                     "2", "--mqtt-keepalive", "3"]
        return args

    def describe(self) -> str:
        lines = [f"broker   {self.broker.url}" if self.broker else "broker   (none: --mqtt starts one)"]
        lines += [f"cloud-{i}  grpc://{c.address}  (pid {c.pid})" for i, c in enumerate(self.clouds)]
        lines += [f"edge-{i}   {e.base}/v1  (pid {e.process.pid})" for i, e in enumerate(self.edges)]
        lines.append(f"logs     {self.settings.out}/")
        if self.broker:
            lines.append(f"status   sprinter fleet status --mqtt {self.broker.url}")
        return "\n".join(lines)


def add_fleet_arguments(p: argparse.ArgumentParser, clouds: int, edges: int) -> None:
    p.add_argument("--clouds", type=int, default=clouds, help="cloud replicas")
    p.add_argument("--edges", type=int, default=edges, help="edge daemons")
    p.add_argument("--target", default=LocalFleetSettings.target)
    p.add_argument("--draft", default=LocalFleetSettings.draft)
    p.add_argument("--dtype", default=LocalFleetSettings.dtype, choices=["bfloat16", "float32"])
    p.add_argument("--draft-runtime", default=LocalFleetSettings.draft_runtime, choices=RUNTIMES)


def settings_from_args(args: argparse.Namespace, mqtt: bool, out: Path) -> LocalFleetSettings:
    if args.clouds < 1 or args.edges < 1:
        raise SystemExit("sprinter fleet: --clouds and --edges must be >= 1")
    return LocalFleetSettings(args.clouds, args.edges, mqtt, args.target, args.draft, args.dtype, args.draft_runtime,
                              out=out)


def register(programs: argparse._SubParsersAction) -> None:
    """Adds `up` to `sprinter fleet` (entry-point group sprinter.fleet_commands)."""
    p = programs.add_parser("up", help="a local fleet: broker, cloud replicas and edges as processes on loopback",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fleet_arguments(p, clouds=2, edges=3)
    p.add_argument("--mqtt", action="store_true", help="start a Mosquitto broker and put everything on the fleet plane")
    p.add_argument("--out", type=Path, default=LocalFleetSettings.out, help="logs and the broker's files")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    with LocalFleet(settings_from_args(args, args.mqtt, args.out)) as fleet:
        print(fleet.describe(), flush=True)
        print("\nCtrl-C stops them all.", flush=True)
        try:
            while all(c.process.poll() is None for c in fleet.clouds):
                time.sleep(1)
            print("a cloud replica exited; stopping the fleet (see its log)")
            return 1
        except KeyboardInterrupt:
            print("\nstopping...")
    return 0
