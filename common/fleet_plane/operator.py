"""The operator's side of the fleet plane: read the fleet's state, push a config or a verifier, wait for acks.

    snapshot = await read_fleet(settings, wait_s=1.5)       # retained state + the telemetry seen meanwhile
    print(format_status(snapshot))
    results = await apply_config(settings, "g1", {"mode": "sd"}, timeout_s=10)   # one ApplyResult per online edge
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import aiomqtt

from common.fleet_plane import topics
from common.fleet_plane.topics import check_identifier
from common.fleet_plane.connection import BrokerSettings, FleetConnection, publish_properties
from common.fleet_plane.messages import (BadMessage, CloudLoad, ConfigApplied, EdgeState, EdgeTelemetry, FleetConfig,
                                         VerifierArtifact, decode, encode)
from common.table_cells import cell

log = logging.getLogger(__name__)

STALE_AFTER_INTERVALS = 3  # telemetry older than this many of its own intervals marks an edge stale


@dataclass
class FleetSnapshot:
    edges: dict[str, EdgeState] = field(default_factory=dict)
    telemetry: dict[str, EdgeTelemetry] = field(default_factory=dict)
    clouds: dict[str, CloudLoad] = field(default_factory=dict)
    configs: dict[str, FleetConfig] = field(default_factory=dict)  # by group: the retained desired state
    bad_messages: int = 0

    def online_edges(self, group: str) -> list[str]:
        return sorted(e for e, s in self.edges.items() if s.group == group and s.status != "offline")


@dataclass(frozen=True)
class ApplyResult:
    edge_id: str
    ok: bool
    reason: str | None  # why a refusal, or "timed out"
    latency_ms: float | None


def _collector(snapshot: FleetSnapshot):
    """A handler that files each message of the four read topics into `snapshot` (bad ones counted)."""
    kinds = {"state": EdgeState, "telemetry": EdgeTelemetry, "load": CloudLoad, "config": FleetConfig}

    async def collect(message: aiomqtt.Message) -> None:
        kind = kinds[topics.level(message.topic.value, -1)]
        try:
            decoded = decode(message.payload, kind)
        except BadMessage as err:
            snapshot.bad_messages += 1
            log.info("ignored a message on %s: %s", message.topic.value, err)
            return
        key = topics.level(message.topic.value, 3)
        table = {EdgeState: snapshot.edges, EdgeTelemetry: snapshot.telemetry, CloudLoad: snapshot.clouds,
                 FleetConfig: snapshot.configs}[kind]
        table[key] = decoded

    return collect


def watch_fleet(connection: FleetConnection, snapshot: FleetSnapshot) -> None:
    """File every state, telemetry, load and config message `connection` receives into `snapshot`."""
    collect = _collector(snapshot)
    for topic_filter in (topics.ALL_EDGE_STATES, topics.ALL_EDGE_TELEMETRY, topics.ALL_CLOUD_LOADS,
                         f"{topics.ROOT}/fleet/+/config"):
        connection.subscribe(topic_filter, collect)


async def read_fleet(settings: BrokerSettings, wait_s: float = 1.5) -> FleetSnapshot:
    """Retained state arrives at once; `wait_s` also lets recent telemetry in."""
    snapshot = FleetSnapshot()
    async with FleetConnection(settings, f"sprinter-status-{secrets.token_hex(4)}") as connection:
        watch_fleet(connection, snapshot)
        await asyncio.wait_for(connection.connected.wait(), settings.publish_timeout_s * 3)
        await asyncio.sleep(wait_s)
    return snapshot


def _age(then: float, now: float) -> str:
    return f"{now - then:.0f}s"


def format_status(snapshot: FleetSnapshot, now: float | None = None) -> str:
    """Two plain-text tables, edges then clouds; a stale edge (no recent telemetry) says so."""
    now = time.time() if now is None else now
    lines = ["edges", "| edge | status | group | mode | policy | verifier | config | tok/s | calls/tok | active "
             "| degraded | cloud | seen |", "|" + "---|" * 13]
    for edge_id, state in sorted(snapshot.edges.items()):
        tele = snapshot.telemetry.get(edge_id)
        status = state.status
        if status == "online" and (tele is None or now - tele.time > STALE_AFTER_INTERVALS * tele.interval_s):
            status = "online (stale)"
        lines.append(f"| {edge_id} | {status} | {state.group} | {state.mode} | {state.policy or '-'} "
                     f"| {state.verifier.get('id', '-')} | {state.config_version} "
                     f"| {cell(tele and tele.tokens_per_s, '.2f')} | {cell(tele and tele.target_calls_per_token, '.3f')} "
                     f"| {tele.active_requests if tele else '-'} | {tele.degraded_requests if tele else '-'} "
                     f"| {(tele.cloud if tele else None) or '-'} | {_age(tele.time if tele else state.time, now)} |")
    lines += ["", "clouds", "| replica | status | model | endpoint | sessions | queue | batch | verify ms p50 "
              "| KV used / budget | seen |", "|" + "---|" * 10]
    for replica_id, load in sorted(snapshot.clouds.items()):
        lines.append(f"| {replica_id} | {load.status} | {load.model_id} | {load.endpoint} | {load.open_sessions} "
                     f"| {load.queue_depth} | {load.batch_size_mean:.2f} | {cell(load.verify_ms_p50, '.1f')} "
                     f"| {load.kv_bytes_used >> 20} / {load.kv_bytes_budget >> 20} MiB | {_age(load.time, now)} |")
    return "\n".join(lines)


async def apply_config(settings: BrokerSettings, group: str, changes: dict[str, Any], timeout_s: float = 10.0,
                       snapshot: FleetSnapshot | None = None) -> list[ApplyResult]:
    """Merge `changes` into the group's desired state, publish it (retained) and wait for every online edge's
    answer (or the timeout).

    The retained document holds every field applied so far (a None value clears one), so an edge that joins
    later converges on all of it. `changes` may name a `version`; by default the next one is used. Two
    operators applying at the same moment race: the later publish wins whole.
    """
    check_identifier(group, "group")
    snapshot = snapshot or await read_fleet(settings, wait_s=0.3)
    changes = dict(changes)
    version = changes.pop("version", None)
    config = (snapshot.configs.get(group) or FleetConfig(group, 0)).merged(changes, version)
    config.check()
    waiting = set(snapshot.online_edges(config.group))
    answers: dict[str, ApplyResult] = {}
    done = asyncio.Event()
    started = time.perf_counter()

    async def on_applied(message: aiomqtt.Message) -> None:
        try:
            applied = decode(message.payload, ConfigApplied)
        except BadMessage:
            return
        if applied.group == config.group and applied.version == config.version:
            answers[applied.edge_id] = ApplyResult(applied.edge_id, applied.ok, applied.reason,
                                                   (time.perf_counter() - started) * 1e3)
            if waiting <= answers.keys():
                done.set()

    correlation = secrets.token_bytes(8)
    async with FleetConnection(settings, f"sprinter-apply-{secrets.token_hex(4)}") as connection:
        connection.subscribe(topics.ALL_EDGE_APPLIED, on_applied)
        await asyncio.wait_for(connection.connected.wait(), settings.publish_timeout_s * 3)
        started = time.perf_counter()
        if not await connection.publish(topics.fleet_config(config.group), encode(config), qos=1, retain=True,
                                        properties=publish_properties(correlation=correlation)):
            raise ConnectionError(f"could not publish the config to {settings}")
        if not waiting:
            return []
        try:
            await asyncio.wait_for(done.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
    return [answers.get(e, ApplyResult(e, False, "timed out", None)) for e in sorted(waiting)]


async def push_verifier(settings: BrokerSettings, artifact: VerifierArtifact) -> None:
    """Publish a verifier artifact (retained) under its sha256; a config then points edges at it."""
    async with FleetConnection(settings, f"sprinter-push-{secrets.token_hex(4)}") as connection:
        await asyncio.wait_for(connection.connected.wait(), settings.publish_timeout_s * 3)
        if not await connection.publish(topics.verifier_artifact(artifact.sha256), encode(artifact), qos=1,
                                        retain=True):
            raise ConnectionError(f"could not publish the verifier to {settings}")
