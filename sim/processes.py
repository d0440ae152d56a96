"""Start the system's programs as real, separate processes and wait until they are ready."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

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


@contextmanager
def cloud_process(*serve_args: str, port: int | None = None, log_path: Path | None = None,
                  startup_timeout_s: float = 300.0, cpus: set[int] | None = None) -> Iterator[str]:
    """`sprinter cloud serve ARGS` in its own process; yields its address; SIGTERM (drain) on exit."""
    port = port or free_port()
    command = [sys.executable, "-m", "common.cli", "--log-level", "WARNING", "cloud", "serve",
               "--port", str(port), *serve_args]
    log_file = open(log_path, "w") if log_path else subprocess.DEVNULL
    process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ},
                               preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    address = f"127.0.0.1:{port}"
    try:
        wait_until_serving(address, startup_timeout_s, process)
        yield address
    finally:
        stop_process(process, signal.SIGTERM, 60)
        if log_path:
            log_file.close()
