"""The fleet plane's foundation against a real Mosquitto: messages, the contract, one connection kept up."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import aiomqtt
import pytest

from common.fleet_plane import topics
from common.fleet_plane.connection import BrokerSettings, FleetConnection, publish_properties
from common.fleet_plane.messages import (MAX_PAYLOAD_BYTES, BadMessage, CloudLoad, ConfigApplied, EdgeState,
                                         EdgeTelemetry, FleetConfig, VerifierArtifact, decode, encode)
from mosquitto_broker import broker, free_port

CONTRACT = Path(__file__).resolve().parents[3] / "proto" / "mqtt.md"


def _fast(url: str, **options: object) -> BrokerSettings:
    return BrokerSettings.parse(url, keepalive_s=2, reconnect_min_s=0.1, reconnect_max_s=0.5, **options)


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.02)


def test_the_contract_page_names_every_schema_and_topic() -> None:
    page = CONTRACT.read_text()
    for kind in (EdgeState, EdgeTelemetry, CloudLoad, FleetConfig, ConfigApplied, VerifierArtifact):
        assert f"`{kind.SCHEMA}`" in page
    for topic in (topics.edge_state("X"), topics.edge_telemetry("X"), topics.edge_applied("X"), topics.cloud_load("X"),
                  topics.fleet_config("X"), topics.verifier_artifact("0" * 64)):
        pattern = re.sub(r"/(X|0{64})(/|$)", r"/{[a-z_0-9]+}\2", topic)
        assert re.search(pattern.replace("/", r"\/"), page), topic


def test_messages_round_trip_and_bad_payloads_are_refused_with_a_reason() -> None:
    config = FleetConfig("g1", 3, mode="sd", policy="fixed:4", k=4, clouds=["127.0.0.1:50051"], pipeline="send-ahead")
    assert decode(encode(config), FleetConfig) == config
    artifact = VerifierArtifact.from_onnx(b"\x08\x07onnx", {"threshold": 0.5})
    assert decode(encode(artifact), VerifierArtifact).onnx_bytes() == b"\x08\x07onnx"
    bad = {
        b"not json": "not JSON",
        b"[1, 2]": "JSON object",
        json.dumps({"schema": "sprinter.fleet.config/2", "group": "g", "version": 1}).encode(): "expected schema",
        json.dumps({"schema": FleetConfig.SCHEMA, "group": "g"}).encode(): "'version' is missing",
        json.dumps({"schema": FleetConfig.SCHEMA, "group": "g", "version": "7"}).encode(): "'version' has the wrong type",
        json.dumps({"schema": FleetConfig.SCHEMA, "group": "g", "version": True}).encode(): "wrong type",
        b" " * (MAX_PAYLOAD_BYTES + 1): "over the",
    }
    for payload, reason in bad.items():
        with pytest.raises(BadMessage, match=reason):
            decode(payload, FleetConfig)
    tampered = VerifierArtifact(artifact.sha256, {}, "b3RoZXI=")
    with pytest.raises(BadMessage, match="hash to"):
        tampered.onnx_bytes()


@pytest.mark.parametrize("field, value, reason", [
    ("version", 0, "positive"), ("mode", "fast", "not one of"), ("policy", "sometimes", "policy"),
    ("k", 99, "k must be"), ("verifier", {"id": "v"}, "verifier must be"), ("clouds", ["nohost"], "HOST:PORT"),
    ("pipeline", "eager", "pipeline"),
])
def test_a_config_an_edge_must_refuse_says_why(field: str, value: object, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        FleetConfig(**{"group": "g", "version": 1, field: value}).check()


def test_identifiers_cannot_smuggle_wildcards() -> None:
    for bad in ("a/b", "+", "#", "", "x" * 65):
        with pytest.raises(ValueError):
            topics.edge_state(bad)


def test_publish_subscribe_retained_state_and_expiry(tmp_path: Path) -> None:
    async def scenario(url: str) -> None:
        received: list[tuple[str, bytes, object]] = []

        async def collect(message: aiomqtt.Message) -> None:
            received.append((message.topic.value, message.payload, message.properties))

        async with FleetConnection(_fast(url), "writer") as writer:
            await asyncio.wait_for(writer.connected.wait(), 5)
            state = EdgeState("online", "e1", "g", "tiny", None, {}, "sd", None, "0", "127.0.0.1:1", 0, 1.0)
            assert await writer.publish(topics.edge_state("e1"), encode(state), qos=1, retain=True)
            async with FleetConnection(_fast(url), "reader") as reader:
                reader.subscribe(topics.ALL_EDGE_STATES, collect)
                await _until(lambda: received)  # retained: a late subscriber gets it
                assert decode(received[0][1], EdgeState) == state
                await writer.publish("sprinter/v1/edges/e1/state", b"{}", qos=1,
                                     properties=publish_properties(expiry_s=30, correlation=b"c-1"))
                await _until(lambda: len(received) == 2)
                assert received[1][2].CorrelationData == b"c-1"

    with broker(tmp_path) as running:
        asyncio.run(scenario(running.url))


def test_no_broker_drops_and_counts_then_connects_when_it_appears(tmp_path: Path) -> None:
    port = free_port()

    async def scenario() -> None:
        async with FleetConnection(_fast(f"mqtt://127.0.0.1:{port}"), "patient") as fleet:
            assert not await fleet.publish(topics.edge_telemetry("e1"), b"{}")  # returns at once
            assert fleet.counters.dropped == 1
            restartable = broker(tmp_path, port=port)
            await asyncio.to_thread(restartable.start)
            try:
                await asyncio.wait_for(fleet.connected.wait(), 10)
                assert await fleet.publish(topics.edge_telemetry("e1"), b"{}")
                await asyncio.to_thread(restartable.stop, True)  # killed mid-run
                await _until(lambda: not fleet.connected.is_set())
                await asyncio.to_thread(restartable.start)
                await asyncio.wait_for(fleet.connected.wait(), 10)
                assert fleet.counters.connects == 2
            finally:
                restartable.stop()

    asyncio.run(scenario())


def test_wrong_credentials_are_reported_and_never_raise(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(url: str) -> None:
        async with FleetConnection(_fast(url, username="edge", password="wrong"), "intruder") as fleet:
            await asyncio.sleep(1.0)
            assert not fleet.connected.is_set()
            assert not await fleet.publish(topics.edge_telemetry("e1"), b"{}")
        async with FleetConnection(_fast(url, username="edge", password="right"), "member") as fleet:
            await asyncio.wait_for(fleet.connected.wait(), 5)

    with broker(tmp_path, users={"edge": "right"}) as running:
        asyncio.run(scenario(running.url))
    assert any("refused" in r.message and "credentials" in r.message for r in caplog.records)


def test_a_failing_handler_is_counted_and_the_connection_stays(tmp_path: Path) -> None:
    async def scenario(url: str) -> None:
        seen: list[bytes] = []

        async def fragile(message: aiomqtt.Message) -> None:
            if message.payload == b"boom":
                raise RuntimeError("bad handler")
            seen.append(message.payload)

        async with FleetConnection(_fast(url), "listener") as fleet:
            fleet.subscribe("sprinter/v1/test", fragile)
            await asyncio.wait_for(fleet.connected.wait(), 5)
            await fleet.publish("sprinter/v1/test", b"boom", qos=1)
            await fleet.publish("sprinter/v1/test", b"fine", qos=1)
            await _until(lambda: seen == [b"fine"])
            assert fleet.counters.handler_errors == 1 and fleet.connected.is_set()

    with broker(tmp_path) as running:
        asyncio.run(scenario(running.url))
