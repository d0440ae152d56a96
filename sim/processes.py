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
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(address: str, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    """Poll standard gRPC health checking until the server says SERVING."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"cloud process exited with code {process.returncode} before serving")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} was not SERVING after {timeout_s:.0f} s")


def stop_process(process: subprocess.Popen, sig: int, grace_s: float) -> None:
    """Ask politely (`sig` lets it drain), then kill after `grace_s`."""
    process.send_signal(sig)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _popen(command: list[str], log_file: IO[str] | int, cpus: set[int] | None, env: dict[str, str] | None) -> subprocess.Popen:
    """Start `command`, confined to `cpus` if given, so two programs behave like two machines."""
    process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    if cpus:
        # Pinned from here rather than in a preexec_fn (unsafe with threads): the child is still
        # starting its interpreter, and every thread it creates later inherits the mask.
        os.sched_setaffinity(process.pid, cpus)
    return process


@contextmanager
def cloud_process(*serve_args: str, port: int | None = None, log_path: Path | None = None,
                  startup_timeout_s: float = 300.0, cpus: set[int] | None = None,
                  env: dict[str, str] | None = None) -> Iterator[str]:
    """`sprinter cloud serve ARGS` in its own process; yields its address; SIGTERM (drain) on exit.

    `env`: extra environment variables (e.g. OMP_NUM_THREADS to match `cpus`).
    """
    port = port or free_port()
    command = [sys.executable, "-m", "common.cli", "--log-level", "WARNING", "cloud", "serve",
               "--port", str(port), *serve_args]
    log_file = open(log_path, "w") if log_path else subprocess.DEVNULL
    process = _popen(command, log_file, cpus, env)
    address = f"127.0.0.1:{port}"
    try:
        wait_until_serving(address, startup_timeout_s, process)
        yield address
    finally:
        stop_process(process, signal.SIGTERM, 60)
        if log_path:
            log_file.close()


def _start_edge(args: list[str], port: int, log_file: IO[str] | int, cpus: set[int] | None,
                env: dict[str, str] | None) -> subprocess.Popen:
    command = [sys.executable, "-m", "common.cli", "--log-level", "WARNING", "edge", "serve",
               "--listen", f"127.0.0.1:{port}", *args]
    return _popen(command, log_file, cpus, env)


def _answers_healthz(base: str, process: subprocess.Popen, log_path: Path) -> bool:
    if process.poll() is not None:
        raise RuntimeError(f"edge daemon exited with {process.returncode}; see {log_path}")
    try:
        urllib.request.urlopen(f"{base}/healthz", timeout=2).read()
        return True
    except OSError:
        return False


@contextmanager
def edge_daemon(args: list[str], port: int, log_path: Path, timeout_s: float = 900,
                cpus: set[int] | None = None, env: dict[str, str] | None = None) -> Iterator[str]:
    """`sprinter edge serve ARGS` in its own process; yields its base URL; SIGINT on exit.

    The wait blocks: use `edge_daemon_async` when this thread's event loop must keep running
    (e.g. a link emulator between the edge and the cloud, which the edge calls while starting).
    """
    with open(log_path, "w") as log_file:
        process = _start_edge(args, port, log_file, cpus, env)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout_s
            while not _answers_healthz(base, process, log_path):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"edge daemon did not come up; see {log_path}")
                time.sleep(0.5)
            yield base
        finally:
            stop_process(process, signal.SIGINT, 30)  # uvicorn stops on SIGINT


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
