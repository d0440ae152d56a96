"""Start the system's programs as real, separate processes and wait until they are ready."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)


def quiet_http_clients() -> None:
    """httpx and httpcore log a line per request at INFO: in a program that polls, they bury its own output."""
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(ready: Callable[[], bool], process: subprocess.Popen | None, timeout_s: float, interval_s: float,
               exited: Callable[[int], str], timed_out: str) -> None:
    """Ask `ready` every `interval_s` until it says yes; RuntimeError(exited(exit code)) if `process` ends first,
    TimeoutError(timed_out) after `timeout_s`. `ready` says no, without raising, while the server is starting."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(exited(process.returncode))
        if ready():
            return
        time.sleep(interval_s)
    raise TimeoutError(timed_out)


def answers(url: str, timeout_s: float = 2) -> bool:
    """Whether a GET of `url` succeeds now (a server still starting refuses it, or answers an error status)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return True
    except OSError:
        return False


def wait_until_serving(address: str, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    """Poll standard gRPC health checking until the server says SERVING."""
    import grpc  # here, not at the top: command lines that import this module parse (and --help) without gRPC
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        def serving() -> bool:
            try:
                return stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                return False
        wait_ready(serving, process, timeout_s, 0.2, lambda code: f"cloud process exited with code {code} before serving",
                   f"{address} was not SERVING after {timeout_s:.0f} s")


def stop_process(process: subprocess.Popen, sig: int, grace_s: float) -> None:
    """Ask politely (`sig` lets it drain), then kill after `grace_s`."""
    process.send_signal(sig)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _popen(command: list[str], log_file: IO[str] | int, cpus: set[int] | None, env: dict[str, str] | None,
           own_group: bool = False) -> subprocess.Popen:
    """Start `command`, confined to `cpus` if given, so two programs behave like two machines; with `own_group`,
    in a process group of its own, which `_kill_group` takes down with everything the program started."""
    process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                               start_new_session=own_group)
    if cpus:
        # Pinned from here rather than in a preexec_fn (unsafe with threads): the child is still
        # starting its interpreter, and every thread it creates later inherits the mask.
        os.sched_setaffinity(process.pid, cpus)
    return process


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to the process group `process` leads (started with own_group), members left behind included."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # nobody left in it
        pass
    process.wait()


class CloudProcess:
    """`sprinter cloud serve ARGS` as a real process on a fixed port, which can be killed and restarted.

    Restarts reuse the port (the edge was given one `--cloud` address) and append to the same log.
    """

    def __init__(self, *serve_args: str, port: int | None = None, log_path: Path | None = None,
                 startup_timeout_s: float = 300.0, cpus: set[int] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "common.cli", "--log-level", "WARNING", "cloud", "serve",
                        "--port", str(self.port), *serve_args]
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.cpus = cpus
        self.env = env
        self.process: subprocess.Popen | None = None
        self.starts = 0

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self) -> None:
        """Start it and wait until it is SERVING (the model loaded)."""
        log_file = open(self.log_path, "a") if self.log_path else subprocess.DEVNULL
        try:
            self.process = _popen(self.command, log_file, self.cpus, self.env, own_group=True)
        finally:
            if self.log_path:
                log_file.close()  # the child holds its own descriptor
        self.starts += 1
        wait_until_serving(self.address, self.startup_timeout_s, self.process)

    def kill(self) -> None:
        """SIGKILL to the cloud and every process it started (vLLM's engine processes): no drain, no goodbye,
        as when a machine dies. Killing the cloud alone would leave vLLM's engine core running, orphaned."""
        if self.process is not None:
            _kill_group(self.process)

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM (it drains open sessions), then SIGKILL after `grace_s`; whatever it left running goes too."""
        if self.process is not None:
            if self.process.poll() is None:
                stop_process(self.process, signal.SIGTERM, grace_s)
            _kill_group(self.process)

    def __enter__(self) -> "CloudProcess":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_side_by_side(*clouds: CloudProcess) -> None:
    """Start every cloud at once and wait until each is SERVING: each loads its model, and side by side is sooner
    than one after the other. If one fails, all are killed and its error raised."""
    with ThreadPoolExecutor(len(clouds)) as pool:
        started = [pool.submit(cloud.start) for cloud in clouds]
    try:
        for future in started:
            future.result()
    except BaseException:
        for cloud in clouds:
            cloud.kill()
        raise


def _start_edge(args: list[str], port: int, log_file: IO[str] | int, cpus: set[int] | None,
                env: dict[str, str] | None) -> subprocess.Popen:
    command = [sys.executable, "-m", "common.cli", "--log-level", "WARNING", "edge", "serve",
               "--listen", f"127.0.0.1:{port}", *args]
    return _popen(command, log_file, cpus, env)


def _answers_healthz(base: str, process: subprocess.Popen, log_path: Path) -> bool:
    if process.poll() is not None:
        raise RuntimeError(f"edge daemon exited with {process.returncode}; see {log_path}")
    return answers(f"{base}/healthz")


@dataclass(frozen=True)
class EdgeHandle:
    base: str  # http://127.0.0.1:PORT
    process: subprocess.Popen


@contextmanager
def edge_daemon_process(args: list[str], port: int, log_path: Path, timeout_s: float = 900,
                        cpus: set[int] | None = None, env: dict[str, str] | None = None) -> Iterator[EdgeHandle]:
    """`sprinter edge serve ARGS` in its own process; yields its base URL and process; SIGINT on exit.

    The wait blocks: use `edge_daemon_async` when this thread's event loop must keep running
    (e.g. a link emulator between the edge and the cloud, which the edge calls while starting).
    """
    with open(log_path, "w") as log_file:
        process = _start_edge(args, port, log_file, cpus, env)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(lambda: answers(f"{base}/healthz"), process, timeout_s, 0.5,
                       lambda code: f"edge daemon exited with {code}; see {log_path}",
                       f"edge daemon did not come up; see {log_path}")
            yield EdgeHandle(base, process)
        finally:
            stop_process(process, signal.SIGINT, 30)  # uvicorn stops on SIGINT


@contextmanager
def edge_daemon(args: list[str], port: int, log_path: Path, timeout_s: float = 900,
                cpus: set[int] | None = None, env: dict[str, str] | None = None) -> Iterator[str]:
    """As `edge_daemon_process`, yielding only the base URL."""
    with edge_daemon_process(args, port, log_path, timeout_s, cpus, env) as edge:
        yield edge.base


@asynccontextmanager
async def edge_daemon_async(args: list[str], port: int, log_path: Path, timeout_s: float = 900,
                            cpus: set[int] | None = None, env: dict[str, str] | None = None) -> AsyncIterator[str]:
    """As `edge_daemon`, but waiting (and stopping) without blocking the running event loop."""
    with open(log_path, "w") as log_file:
        process = _start_edge(args, port, log_file, cpus, env)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout_s
            while not await asyncio.to_thread(_answers_healthz, base, process, log_path):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"edge daemon did not come up; see {log_path}")
                await asyncio.sleep(0.5)
            yield base
        finally:
            await asyncio.to_thread(stop_process, process, signal.SIGINT, 30)
