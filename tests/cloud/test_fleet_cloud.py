"""A cloud replica on the fleet plane (real Mosquitto): its load announcement, draining, and its Last Will."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiomqtt
import pytest

from cloud.server import CloudSettings
from cloud_harness import ServerThread
from common.fleet_plane import topics
from common.fleet_plane.connection import BrokerSettings, FleetConnection
from common.fleet_plane.messages import CloudLoad, decode
from mosquitto_broker import broker
from sim.processes import free_port, wait_until_serving


async def _loads(url: str, replica_id: str, until, timeout: float) -> list[CloudLoad]:
    """Every load announcement of `replica_id` until `until(loads)` holds."""
    loads: list[CloudLoad] = []

    async def collect(message: aiomqtt.Message) -> None:
        loads.append(decode(message.payload, CloudLoad))

    async with FleetConnection(BrokerSettings.parse(url, reconnect_min_s=0.1), "watcher") as fleet:
        fleet.subscribe(topics.cloud_load(replica_id), collect)
        deadline = time.monotonic() + timeout
        while not until(loads):
            assert time.monotonic() < deadline, f"no such announcement within {timeout} s: {loads[-1:]}"
            await asyncio.sleep(0.05)
    return loads


def test_a_replica_announces_its_load_and_says_offline_when_it_stops(tmp_path: Path, tiny_target) -> None:
    with broker(tmp_path) as running:
        settings = CloudSettings(port=0, mqtt=running.url, replica_id="c1", mqtt_keepalive=2)
        with ServerThread(settings, tiny_target) as server:
            loads = asyncio.run(_loads(running.url, "c1", lambda ls: ls and ls[-1].status == "online", 10))
            load = loads[-1]
            assert (load.model_id, load.endpoint) == ("tiny-random", server.address)
            assert load.kv_bytes_budget == settings.kv_budget_bytes and load.open_sessions == 0
        loads = asyncio.run(_loads(running.url, "c1", lambda ls: ls and ls[-1].status == "offline", 10))  # retained


def test_a_killed_replica_goes_offline_by_its_last_will(tmp_path: Path) -> None:
    keepalive = 2
    with broker(tmp_path) as running:
        port = free_port()
        process = subprocess.Popen([sys.executable, "-m", "common.cli", "--log-level", "WARNING", "cloud", "serve",
                                    "--port", str(port), "--mqtt", running.url, "--mqtt-keepalive", str(keepalive),
                                    "--replica-id", "doomed"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until_serving(f"127.0.0.1:{port}", 120, process)
            asyncio.run(_loads(running.url, "doomed", lambda ls: ls and ls[-1].status == "online", 10))
            process.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            asyncio.run(_loads(running.url, "doomed", lambda ls: ls and ls[-1].status == "offline", 3 * keepalive))
            assert time.monotonic() - killed <= 1.5 * keepalive + 0.5  # the broker's keepalive check, plus slack
        finally:
            process.kill()
            process.wait()


@pytest.mark.parametrize("url", ["http://x", "mqtt://", "mqtts"])
def test_a_bad_broker_url_is_refused_with_the_forms_it_takes(url: str) -> None:
    with pytest.raises(ValueError, match="mqtt://HOST"):
        BrokerSettings.parse(url)
