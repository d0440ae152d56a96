"""`sprinter cloud serve` as a real process: health, a session, and a clean stop on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cloud_harness import SessionStream
from sim.processes import free_port, wait_until_serving


def test_cloud_serve_process_serves_then_drains_on_sigterm(tmp_path):
    port = free_port()
    log_path = tmp_path / "cloud.log"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "common.cli", "cloud", "serve", "--target", "tiny-random",
                                    "--dtype", "float32", "--port", str(port), "--drain-s", "10"],
                                   stdout=log_file, stderr=subprocess.STDOUT)
        try:
            address = f"127.0.0.1:{port}"
            wait_until_serving(address, 120, process)
            with grpc.insecure_channel(address) as channel:
                stream = SessionStream(channel)
                assert stream.open([1, 2, 3]).WhichOneof("frame") == "opened"
                process.send_signal(signal.SIGTERM)
                time.sleep(0.5)
                health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
                # the open session may finish its work while the service drains
                assert stream.verify(3, [4, 5]).WhichOneof("frame") == "verdict"
                stream.close()
            assert process.wait(30) == 0
        finally:
            if process.poll() is None:
                process.kill()
    assert "Traceback" not in log_path.read_text()


def test_the_vllm_engine_without_its_environment_says_what_to_run(tmp_path):
    result = subprocess.run([sys.executable, "-m", "common.cli", "cloud", "serve", "--engine", "vllm"],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "SPRINTER_VLLM_ENV": str(tmp_path / "no-such-env")})
    assert result.returncode != 0
    assert "make vllm" in result.stderr and "SPRINTER_VLLM_ENV" in result.stderr
