"""The sweep on the fleet plane: a broker for it, the processes' fleet flags, and OUT/telemetry.jsonl.

With a broker (`--mqtt auto|off|URL`) the cloud announces its load and the edge publishes telemetry
as they would in a fleet; a `TelemetryRecorder` in the sweep's event loop appends every such message
as one JSON line, labelled with the phase it arrived in (the RTT and method being measured, or null
between phases: start-up, warm-ups). sim.sweep.telemetry_plot draws the file.

The fleet plane only watches: a missing or failing broker logs and the sweep goes on without it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiomqtt

from common.fleet_plane import topics
from common.fleet_plane.connection import BrokerSettings, FleetConnection
from common.fleet_plane.messages import BadMessage, CloudLoad, EdgeTelemetry, decode
from sim.broker import MosquittoBroker

log = logging.getLogger(__name__)

CLOUD_ID = "sim-cloud"
EDGE_ID = "sim-edge"
GROUP = "sim"  # a group no operator configures: a fleet config would change what the sweep measures
TELEMETRY_INTERVAL_S = 1  # short phases of a sweep still get a report or two
TELEMETRY_FILE = "telemetry.jsonl"

Phase = tuple[float, str]  # (rtt_ms, method)


def cloud_fleet_args(url: str | None) -> list[str]:
    """`sprinter cloud serve` flags that put it on the fleet plane (none without a broker)."""
    return ["--mqtt", url, "--replica-id", CLOUD_ID] if url else []


def edge_fleet_args(url: str | None) -> list[str]:
    """`sprinter edge serve` flags that put it on the fleet plane (none without a broker)."""
    if not url:
        return []
    return ["--mqtt", url, "--edge-id", EDGE_ID, "--group", GROUP, "--telemetry-interval", str(TELEMETRY_INTERVAL_S)]


@contextmanager
def sweep_broker(mqtt: str, directory: Path) -> Iterator[str | None]:
    """The broker URL for this sweep, or None: `auto` runs Mosquitto in `directory` while the sweep does."""
    if mqtt == "off":
        yield None
        return
    if mqtt != "auto":
        log.info("fleet plane: the sweep reports to %s", BrokerSettings.parse(mqtt))
        yield mqtt
        return
    broker = _start_mosquitto(directory)
    try:
        yield broker.url if broker else None
    finally:
        if broker is not None:
            broker.stop()


def _start_mosquitto(directory: Path) -> MosquittoBroker | None:
    try:
        broker = MosquittoBroker(directory)
    except OSError as err:  # FileNotFoundError: not installed
        log.warning("fleet plane: %s; the sweep runs without it (no telemetry; --mqtt off skips this check)", err)
        return None
    try:
        broker.start()
    except (OSError, RuntimeError) as err:  # TimeoutError is an OSError
        broker.stop(kill=True)
        log.warning("fleet plane: Mosquitto did not start (%s); the sweep runs without telemetry", err)
        return None
    log.info("fleet plane: Mosquitto for the sweep on %s (log in %s)", broker.url, directory)
    return broker


class TelemetryRecorder:
    """`async with TelemetryRecorder(url, OUT / "telemetry.jsonl") as recorder:`, then set `recorder.phase`.

    Without a URL it records nothing. Connecting, reconnecting and every message happen in the
    background of the event loop (FleetConnection): nothing here waits on the broker.
    """

    def __init__(self, url: str | None, path: Path) -> None:
        self.url = url
        self.path = path
        self.phase: Phase | None = None
        self.recorded = 0
        self.bad_messages = 0
        self._connection: FleetConnection | None = None
        self._write_failed = False
        self._stack = AsyncExitStack()

    async def __aenter__(self) -> TelemetryRecorder:
        if self.url is None:
            return self
        # The pid: two sweeps on one broker must not take each other's client id (the broker would drop one).
        connection = FleetConnection(BrokerSettings.parse(self.url), f"sim-recorder-{os.getpid()}")
        connection.subscribe(topics.edge_telemetry(EDGE_ID), self._on_edge_telemetry)
        connection.subscribe(topics.cloud_load(CLOUD_ID), self._on_cloud_load)
        self._stack.callback(self._log_recorded)  # pushed first, so it runs last: once nothing more arrives
        self._connection = await self._stack.enter_async_context(connection)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    def _log_recorded(self) -> None:
        log.info("fleet plane: recorded %d messages in %s (%d unreadable)", self.recorded, self.path, self.bad_messages)

    async def _on_edge_telemetry(self, message: aiomqtt.Message) -> None:
        self._record(message, EdgeTelemetry)

    async def _on_cloud_load(self, message: aiomqtt.Message) -> None:
        self._record(message, CloudLoad)

    def _record(self, message: aiomqtt.Message, kind: type[EdgeTelemetry] | type[CloudLoad]) -> None:
        try:
            decoded = decode(message.payload, kind)  # type: ignore[arg-type]
        except (BadMessage, TypeError) as err:
            self.bad_messages += 1
            log.debug("fleet plane: ignored a message on %s: %s", message.topic.value, err)
            return
        rtt_ms, mode = self.phase if self.phase is not None else (None, None)
        self._append({"received": time.time(), "rtt_ms": rtt_ms, "mode": mode, "topic": message.topic.value,
                      "schema": kind.SCHEMA, **asdict(decoded)})

    def _append(self, line: dict[str, Any]) -> None:
        if self._write_failed:
            return
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as err:  # a full disk must cost the telemetry, not the sweep
            self._write_failed = True
            log.warning("fleet plane: cannot write %s (%s); no more telemetry is recorded", self.path, err)
            return
        self.recorded += 1


def read_telemetry(path: Path) -> list[dict[str, Any]]:
    """The recorded lines, in arrival order; a partial last line (an interrupted sweep) is skipped."""
    if not path.exists():
        return []
    lines = []
    with open(path) as f:
        for text in f:
            try:
                line = json.loads(text)
            except json.JSONDecodeError:
                continue
            if isinstance(line, dict) and isinstance(line.get("received"), (int, float)):
                lines.append(line)
    return lines
