"""The fleet plane under fuzz: over a thousand malformed, oversized, wrong-schema and replayed messages on every
topic an edge reads and on the status topics `sprinter fleet status` reads, through a real Mosquitto broker.

Goal: no crash, the daemon serving throughout, every rejection counted by reason in
`sprinter_edge_fleet_messages_rejected_total`, and `fleet status` still reading the fleet.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import httpx

from cloud.server import CloudSettings
from cloud_harness import ServerThread
from common.cli import main as sprinter
from common.fleet_plane import topics
from common.fleet_plane.connection import FleetConnection
from common.fleet_plane.messages import MAX_PAYLOAD_BYTES, CloudLoad, EdgeState, EdgeTelemetry, FleetConfig
from common.fleet_plane.operator import apply_config
from mosquitto_broker import broker
from sim.bench.load import parse_metrics
from tests.edge.test_fleet_edge import _complete, _edges, _fast, _wait, fleet_edge

MESSAGES = 1200


def _garbage(rng: random.Random, schema: str, fields: dict) -> tuple[bytes, str]:
    """One bad payload for a message of `schema` and its reason (as the edge counts it). Never a valid message:
    `fields` gets a required field wrong (the other messages here lack required fields anyway)."""
    kind = rng.choice(["bytes", "deep", "not-object", "schema", "fields", "fields"])
    if kind == "bytes":
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 200))) + b"\xff", "not-json"
    if kind == "deep":  # nesting that blows Python's recursion limit inside json.loads
        return b"[" * 50_000 + b"]" * 50_000, "not-json"
    if kind == "not-object":
        return json.dumps(rng.choice([[1, 2], 3, "text", None, True])).encode(), "not-object"
    if kind == "schema":
        return json.dumps({**fields, "schema": rng.choice(["other/1", None, 7, schema + "x"])}).encode(), "schema"
    broken = dict(fields, schema=schema)
    name = rng.choice(["group", "version"] if schema == FleetConfig.SCHEMA else sorted(fields))  # a required one
    broken[name] = rng.choice([{"nested": [1]}, [None], 1.5e308, -1, "", True]) if rng.random() < 0.8 else None
    if rng.random() < 0.3:
        del broken[name]
    return json.dumps(broken).encode(), "fields"


def _fuzz(rng: random.Random, edge_topics: list[str]) -> list[tuple[str, bytes, bool]]:
    """(topic, payload, whether the edge reads it) for every message to send."""
    config = {"group": "g1", "version": 99, "mode": "sd"}
    load = {"replica_id": "c9", "status": "online", "model_id": "m", "endpoint": "127.0.0.1:1", "open_sessions": 0}
    state = {"status": "online", "edge_id": "x"}
    telemetry = {"edge_id": "x", "time": 1.0}
    messages = []
    for i in range(MESSAGES):
        target = rng.choice(["config", "load", "state", "telemetry"])
        schema, fields, topic = {
            "config": (FleetConfig.SCHEMA, config, topics.fleet_config("g1")),
            "load": (CloudLoad.SCHEMA, load, topics.cloud_load(f"c{i % 7}")),
            "state": (EdgeState.SCHEMA, state, topics.edge_state(f"fuzz{i % 5}")),
            "telemetry": (EdgeTelemetry.SCHEMA, telemetry, topics.edge_telemetry(f"fuzz{i % 5}")),
        }[target]
        payload, _ = _garbage(rng, schema, fields)
        messages.append((topic, payload, topic in edge_topics or target == "load"))
    replay = json.dumps({"schema": FleetConfig.SCHEMA, "group": "g1", "version": 1, "mode": "target"}).encode()
    refused = json.dumps({"schema": FleetConfig.SCHEMA, "group": "g1", "version": 50, "policy": "sometimes"}).encode()
    messages += [(topics.fleet_config("g1"), replay, True)] * 20 + [(topics.fleet_config("g1"), refused, True)] * 5
    oversized = b'{"schema": "x", "pad": "' + b"x" * MAX_PAYLOAD_BYTES + b'"}'
    messages += [(topics.fleet_config("g1"), oversized, False), (topics.cloud_load("c1"), oversized, False)]
    return messages


async def _publish(url: str, messages: list[tuple[str, bytes, bool]]) -> None:
    async with FleetConnection(_fast(url), "fuzzer") as connection:
        await asyncio.wait_for(connection.connected.wait(), 5)
        for i, (topic, payload, _) in enumerate(messages):
            retain = "/state" in topic and i % 3 == 0  # some garbage stays for `fleet status` to read
            assert await connection.publish(topic, payload, qos=1, retain=retain)


def _rejected(base: str) -> dict[str, float]:
    metrics = parse_metrics(httpx.get(base + "/metrics", timeout=10).text)
    prefix = "sprinter_edge_fleet_messages_rejected_total"
    return {key: value for key, value in metrics.items() if key.startswith(prefix)}


def test_fuzzed_fleet_messages_are_counted_and_the_daemon_keeps_serving(tmp_path: Path, tiny_target, tiny_draft,
                                                                         capsys) -> None:
    rng = random.Random(20261125)
    with broker(tmp_path) as running, ServerThread(CloudSettings(port=0), tiny_target) as cloud, \
            fleet_edge(tiny_draft, cloud.address, running.url, "e1") as (daemon, agent):
        _wait(lambda: "e1" in _edges(running.url), 10, "the edge online")
        for changes in ({"mode": "sd"}, {"k": 3}):  # v2 in force: v1 replays are stale
            assert all(r.ok for r in asyncio.run(apply_config(_fast(running.url), "g1", changes)))
        messages = _fuzz(rng, [topics.fleet_config("g1")])
        expected = sum(read for _, _, read in messages)
        started = time.monotonic()
        asyncio.run(_publish(running.url, messages))
        _wait(lambda: sum(_rejected(daemon.base).values()) >= expected, 60,
              f"{expected} rejections counted (got {_rejected(daemon.base)})")
        rejected = _rejected(daemon.base)
        reasons = {key.split('reason="')[1].rstrip('"}') for key in rejected}
        assert {"not-json", "not-object", "schema", "fields", "stale", "refused"} <= reasons, rejected
        assert _complete(daemon)["mode"] == "sd"  # still serving, on the config it had
        assert agent.config_version == 2
        with capsys.disabled():
            print(f"\n{len(messages)} messages, {expected} on the edge's topics, counted {sum(rejected.values()):.0f} "
                  f"in {time.monotonic() - started:.1f} s: {rejected}")
        assert sprinter(["fleet", "status", "--mqtt", running.url]) == 0  # retained garbage: read past, not fatal
        assert "| e1 |" in capsys.readouterr().out
