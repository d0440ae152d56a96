"""An edge on the fleet plane (proto/mqtt.md): presence, telemetry, desired config, verifier rollout.

- Presence: `edges/{id}/state`, retained, republished on every (re)connect and change; its Last
  Will (the same state with status `offline`) tells the fleet when this process dies.
- Telemetry: `edges/{id}/telemetry` every `telemetry_interval_s`, QoS 0, expiring after three
  intervals; while the broker is away it is dropped and counted, never queued in a request's way.
- Desired config: `fleet/{group}/config` (retained). A version above the one in force is checked,
  its verifier (if it names one) fetched from `artifacts/verifiers/{sha256}`, checked against the
  digest and the draft/target pair and loaded off the event loop; then the whole config is applied
  at once by `EdgeControls.apply` (requests in flight keep what they started with) and the answer
  goes to `edges/{id}/applied`. Any failure is a refusal with its reason: what was in force stays.
- Cloud announcements (`clouds/+/load`) add replicas to verify on, spare draining ones, and seed the
  goodput policy's cost model before the first verify.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import aiomqtt

from common.atomic_files import written_aside
from common.fleet_plane import topics
from common.fleet_plane.connection import BrokerSettings, FleetConnection, publish_properties
from common.fleet_plane.messages import (BadMessage, CloudLoad, ConfigApplied, EdgeState, EdgeTelemetry, FleetConfig,
                                         VerifierArtifact, decode, encode)
from common.model.loading import cache_root
from edge.node import VerifierSetup

log = logging.getLogger(__name__)

ARTIFACT_WAIT_S = 10.0  # how long a config waits for the verifier artifact it names


@dataclass(frozen=True)
class EdgeIdentity:
    edge_id: str
    group: str
    version: str  # the software's
    api: str  # where this edge's HTTP API listens


class EdgeControls(Protocol):
    """What the fleet plane may read and change on an edge (the daemon implements it)."""

    def state(self, status: str, config_version: int) -> EdgeState: ...

    def telemetry(self, edge_id: str, interval_s: float, dropped: int) -> EdgeTelemetry: ...

    def load_verifier(self, metadata_path: Path) -> VerifierSetup:
        """Load and check (pair, companion) a verifier; raise ValueError to refuse it. Called off the loop."""
        ...

    async def apply(self, config: FleetConfig, verifier: VerifierSetup | None) -> None:
        """Put `config` (and its verifier) in force for the next requests; raise ValueError to refuse."""
        ...

    def cloud_announced(self, load: CloudLoad) -> None:
        """A cloud replica's announcement: a replica to verify on (or to spare, draining), and its verify
        time to start the cost model from instead of cold."""
        ...

    def message_rejected(self, reason: str) -> None:
        """A message the agent ignored or refused, by reason (for the daemon's metrics)."""
        ...


class FleetAgent:
    """`async with FleetAgent(broker, identity, controls):` around the daemon's serving."""

    def __init__(self, broker: BrokerSettings, identity: EdgeIdentity, controls: EdgeControls,
                 telemetry_interval_s: float = 5.0) -> None:
        self.identity = identity
        self.controls = controls
        self.telemetry_interval_s = telemetry_interval_s
        self.config_version = 0
        self.bad_messages = 0
        self._artifacts: dict[str, asyncio.Future[VerifierArtifact]] = {}
        self._applying = asyncio.Lock()
        self._config_tasks: set[asyncio.Task] = set()
        self._subscribed_artifacts: set[str] = set()
        will = aiomqtt.Will(topics.edge_state(identity.edge_id), encode(controls.state("offline", 0)), qos=1, retain=True)
        self.connection = FleetConnection(broker, f"edge-{identity.edge_id}", will=will, on_connect=self.publish_state)
        self._telemetry_task: asyncio.Task | None = None
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> FleetAgent:
        self.connection.subscribe(topics.fleet_config(self.identity.group), self._on_config)
        self.connection.subscribe(topics.ALL_CLOUD_LOADS, self._on_cloud_load)
        await self._stack.enter_async_context(self.connection)
        self._stack.push_async_callback(self._go_offline)  # while the connection is still up
        self._telemetry_task = asyncio.create_task(self._publish_telemetry(), name="fleet-telemetry")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _go_offline(self) -> None:
        for task in (self._telemetry_task, *self._config_tasks):
            if task is not None:
                task.cancel()
        await self.publish_state("offline")  # a clean stop says so at once, not after the keepalive

    async def publish_state(self, status: str = "online") -> None:
        state = self.controls.state(status, self.config_version)
        await self.connection.publish(topics.edge_state(self.identity.edge_id), encode(state), qos=1, retain=True)

    async def _publish_telemetry(self) -> None:
        expiry = int(3 * self.telemetry_interval_s) + 1
        while True:
            await asyncio.sleep(self.telemetry_interval_s)
            report = self.controls.telemetry(self.identity.edge_id, self.telemetry_interval_s,
                                             self.connection.counters.dropped)
            await self.connection.publish(topics.edge_telemetry(self.identity.edge_id), encode(report), qos=0,
                                          properties=publish_properties(expiry_s=expiry))

    def _decode(self, message: aiomqtt.Message, kind: type) -> object | None:
        try:
            return decode(message.payload, kind)
        except BadMessage as err:
            self._reject(err.reason, f"ignored a message on {message.topic.value}: {err}")
            return None

    def _reject(self, reason: str, said: str) -> None:
        self.bad_messages += 1
        self.controls.message_rejected(reason)
        log.warning("fleet plane: %s", said)

    async def _on_cloud_load(self, message: aiomqtt.Message) -> None:
        load = self._decode(message, CloudLoad)
        if isinstance(load, CloudLoad):
            self.controls.cloud_announced(load)

    async def _on_artifact(self, message: aiomqtt.Message) -> None:
        artifact = self._decode(message, VerifierArtifact)
        if not isinstance(artifact, VerifierArtifact):
            return
        if artifact.sha256 != topics.level(message.topic.value, -1):
            self._reject("digest", f"ignored a verifier published under another digest on {message.topic.value}")
            return
        future = self._artifact_future(artifact.sha256)
        if not future.done():
            future.set_result(artifact)

    def _artifact_future(self, sha256: str) -> asyncio.Future[VerifierArtifact]:
        return self._artifacts.setdefault(sha256, asyncio.get_running_loop().create_future())

    async def _on_config(self, message: aiomqtt.Message) -> None:
        config = self._decode(message, FleetConfig)
        if not isinstance(config, FleetConfig) or config.version <= self.config_version:
            if isinstance(config, FleetConfig) and config.version < self.config_version:
                self._reject("stale", f"ignored config v{config.version}: v{self.config_version} is in force")
            return  # unreadable, or already in force (a retained config is redelivered on every reconnect)
        correlation = getattr(message.properties, "CorrelationData", None)
        # Applied in a task: the verifier it may wait for arrives through this same message loop.
        task = asyncio.create_task(self._apply(config, correlation), name=f"fleet-config-v{config.version}")
        self._config_tasks.add(task)
        task.add_done_callback(self._config_tasks.discard)

    async def _apply(self, config: FleetConfig, correlation: bytes | None) -> None:
        async with self._applying:  # one config at a time, in the order they came (the lock is FIFO)
            if config.version <= self.config_version:
                return
            try:
                config.check()
                verifier = await self._fetch_verifier(config)
                await self.controls.apply(config, verifier)
            except (ValueError, BadMessage, asyncio.TimeoutError, OSError) as err:
                reason = str(err) or type(err).__name__
                self.controls.message_rejected("refused")
                log.warning("fleet config v%d refused: %s", config.version, reason)
                await self._answer(config, False, reason, correlation)
                return
            self.config_version = config.version
            log.info("fleet config v%d applied", config.version)
            await self._answer(config, True, None, correlation)
            await self.publish_state()

    async def _fetch_verifier(self, config: FleetConfig) -> VerifierSetup | None:
        if config.verifier is None:
            return None
        sha256 = config.verifier["sha256"]
        if sha256 not in self._subscribed_artifacts:  # this artifact only: not every one ever pushed
            self._subscribed_artifacts.add(sha256)
            self._artifact_future(sha256)
            self.connection.subscribe(topics.verifier_artifact(sha256), self._on_artifact)
        try:
            artifact = await asyncio.wait_for(asyncio.shield(self._artifact_future(sha256)), ARTIFACT_WAIT_S)
        except asyncio.TimeoutError:
            raise ValueError(f"verifier {sha256[:12]}... was not published on {topics.verifier_artifact(sha256)}")
        try:
            onnx = artifact.onnx_bytes()  # BadMessage when the bytes do not match the digest
        except BadMessage:
            del self._artifacts[sha256]  # a corrected republish under this digest gets its chance
            raise
        directory = cache_root() / "fleet-verifiers" / sha256
        setup = await asyncio.to_thread(self._store_and_load, directory, onnx, artifact.metadata)
        return replace(setup, identity={"id": config.verifier["id"], "sha256": sha256})  # the operator's name for it

    def _store_and_load(self, directory: Path, onnx: bytes, metadata: dict) -> VerifierSetup:
        directory.mkdir(parents=True, exist_ok=True)
        onnx_name = str(metadata.get("onnx", "verifier.onnx"))
        if "/" in onnx_name or onnx_name.startswith("."):
            raise ValueError(f"verifier metadata names the ONNX file {onnx_name!r}: a plain file name is required")
        # each file written aside and renamed in: another edge on this machine may store the same digest meanwhile
        for name, data in ((onnx_name, onnx), ("verifier.json", json.dumps(metadata).encode())):
            with written_aside(directory / name) as partial:
                partial.write_bytes(data)
        return self.controls.load_verifier(directory / "verifier.json")

    async def _answer(self, config: FleetConfig, ok: bool, reason: str | None, correlation: bytes | None) -> None:
        applied = ConfigApplied(self.identity.edge_id, config.group, config.version, ok, reason, time.time())
        await self.connection.publish(topics.edge_applied(self.identity.edge_id), encode(applied), qos=1,
                                      properties=publish_properties(correlation=correlation))
