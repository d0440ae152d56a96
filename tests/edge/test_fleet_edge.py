"""Edges on the fleet plane (real Mosquitto, real edge daemons, a real cloud): presence and its Last Will,
config rollout with acknowledgements, verifier push, and serving on while the broker comes and goes."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import aiomqtt
import pytest
import torch
from openai import OpenAI

import edge.fleet_agent as fleet_agent
from cloud.server import CloudSettings
from cloud_harness import ServerThread
from common.cli import main as sprinter
from common.fleet_plane import topics
from common.fleet_plane.connection import BrokerSettings, FleetConnection
from common.fleet_plane.messages import (CloudLoad, ConfigApplied, EdgeState, FleetConfig, VerifierArtifact, decode,
                                         encode, verifier_digest)
from common.fleet_plane.operator import apply_config, push_verifier, read_fleet
from common.model.loading import LoadedModel, vocab_fingerprint
from edge.api.app import ApiSettings, create_app
from edge.fleet_agent import EdgeIdentity, FleetAgent
from edge.fleet_controls import DaemonControls
from edge.runtime.verifier import LearnedVerifier
from edge_harness import EdgeDaemonThread
from mosquitto_broker import MosquittoBroker, broker
from sim.processes import free_port


def _fast(url: str) -> BrokerSettings:
    return BrokerSettings.parse(url, keepalive_s=2, reconnect_min_s=0.1, reconnect_max_s=0.5)


@contextmanager
def fleet_edge(draft: LoadedModel, cloud: str | None, url: str, edge_id: str, group: str = "g1",
               telemetry_interval_s: float = 0.3, discover_clouds: bool = False
               ) -> Iterator[tuple[EdgeDaemonThread, FleetAgent]]:
    """An edge daemon (the real app) with its fleet agent on the daemon's own event loop."""
    apps = []

    def make_app(node):
        apps.append(create_app(node, ApiSettings(default_mode="sd", model_name="tiny")))
        return apps[0]

    with EdgeDaemonThread(draft, cloud, make_app, {"discover_clouds": discover_clouds}) as daemon:
        async def start() -> FleetAgent:
            identity = EdgeIdentity(edge_id, group, "test", daemon.base + "/v1")
            controls = DaemonControls(daemon.node, apps[0].state.completions, identity)
            return await FleetAgent(_fast(url), identity, controls, telemetry_interval_s).__aenter__()

        agent = daemon.call(start())
        try:
            yield daemon, agent
        finally:
            daemon.call(agent.__aexit__(None, None, None))


def _complete(daemon: EdgeDaemonThread, **extra: object) -> dict:
    client = OpenAI(base_url=daemon.base + "/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model="tiny", prompt="the fleet", max_tokens=6, extra_body=extra or None)
    return completion.model_extra["sprinter"]


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)


def _edges(url: str) -> dict[str, EdgeState]:
    return asyncio.run(read_fleet(_fast(url), wait_s=0.2)).edges


async def _publish_and_collect(url: str, config: FleetConfig, answers_expected: int) -> list[ConfigApplied]:
    """Publish a config as is (no client-side check: what a buggy operator tool might send) and collect answers."""
    answers: list[ConfigApplied] = []

    async def collect(message: aiomqtt.Message) -> None:
        applied = decode(message.payload, ConfigApplied)
        if applied.version == config.version:
            answers.append(applied)

    async with FleetConnection(_fast(url), "raw-operator") as connection:
        connection.subscribe(topics.ALL_EDGE_APPLIED, collect)
        await asyncio.wait_for(connection.connected.wait(), 5)
        assert await connection.publish(topics.fleet_config(config.group), encode(config), qos=1, retain=True)
        for _ in range(200):
            if len(answers) >= answers_expected:
                break
            await asyncio.sleep(0.05)
    return answers


def test_a_config_rolls_out_to_three_edges_and_their_next_responses_follow_it(tmp_path: Path, tiny_target,
                                                                             tiny_draft, capsys) -> None:
    with broker(tmp_path) as running, \
            ServerThread(CloudSettings(port=0, mqtt=running.url, replica_id="c1"), tiny_target) as cloud, \
            fleet_edge(tiny_draft, cloud.address, running.url, "e1") as (e1, _), \
            fleet_edge(tiny_draft, cloud.address, running.url, "e2") as (e2, _), \
            fleet_edge(tiny_draft, cloud.address, running.url, "e3") as (e3, _):
        _wait(lambda: {e for e, s in _edges(running.url).items() if s.status == "online"} == {"e1", "e2", "e3"},
              10, "three edges online")
        assert _complete(e1)["policy"] == "fixed:5"  # the daemon's own default before any config

        results = asyncio.run(apply_config(_fast(running.url), "g1", {"mode": "sd", "policy": "fixed:3"}))
        assert [(r.edge_id, r.ok) for r in results] == [("e1", True), ("e2", True), ("e3", True)]
        for daemon in (e1, e2, e3):
            assert (_complete(daemon)["mode"], _complete(daemon)["policy"]) == ("sd", "fixed:3")
        states = _edges(running.url)
        assert {s.config_version for s in states.values()} == {1} and states["e2"].policy == "fixed:3"

        # A config no edge can take (it slipped past the operator's own check): refused with the reason, old one kept.
        answers = asyncio.run(_publish_and_collect(running.url, FleetConfig("g1", 2, policy="sometimes"), 3))
        assert sorted(a.edge_id for a in answers) == ["e1", "e2", "e3"] and not any(a.ok for a in answers)
        assert all("sometimes" in a.reason for a in answers)
        assert _complete(e3)["policy"] == "fixed:3" and _edges(running.url)["e3"].config_version == 1

        # The group's document now holds the refused policy: an apply on top of it is refused by the operator's
        # check, naming it, until it is cleared (null); mode target needs no policy, and the responses say so.
        with pytest.raises(ValueError, match="sometimes"):
            asyncio.run(apply_config(_fast(running.url), "g1", {"mode": "target"}))
        results = asyncio.run(apply_config(_fast(running.url), "g1", {"mode": "target", "policy": None}))
        assert all(r.ok for r in results) and _complete(e1)["mode"] == "target"

        assert sprinter(["fleet", "status", "--mqtt", running.url]) == 0
        status = capsys.readouterr().out
        for name in ("e1", "e2", "e3", "c1", cloud.address):
            assert f"| {name} |" in status
        telemetry = asyncio.run(read_fleet(_fast(running.url), wait_s=0.8)).telemetry
        assert {t.cloud for t in telemetry.values()} == {cloud.address}


def test_a_late_joiner_converges_on_everything_its_group_was_given(tmp_path: Path, tiny_target, tiny_draft,
                                                                   capsys) -> None:
    """Applies merge into one document per group: an edge that joins after two applies runs both, and a field
    the group clears returns every edge to its own setting. `fleet apply` takes inline JSON or a file."""
    with broker(tmp_path) as running, ServerThread(CloudSettings(port=0), tiny_target) as cloud, \
            fleet_edge(tiny_draft, cloud.address, running.url, "early") as (early, early_agent):
        _wait(lambda: "early" in _edges(running.url), 10, "the early edge online")
        (tmp_path / "first.json").write_text(json.dumps({"mode": "sd", "policy": "fixed:3"}))
        base = ["fleet", "apply", "--mqtt", running.url, "--group", "g1", "--timeout", "10"]
        assert sprinter([*base, str(tmp_path / "first.json")]) == 0
        assert sprinter([*base, '{"k": 4}']) == 0  # inline JSON
        with fleet_edge(tiny_draft, cloud.address, running.url, "late") as (late, late_agent):
            _wait(lambda: {e: s.config_version for e, s in _edges(running.url).items()} == {"early": 2, "late": 2},
                  10, "both edges at config version 2")
            for daemon, agent in ((early, early_agent), (late, late_agent)):
                answer = _complete(daemon)
                assert (answer["mode"], answer["policy"], agent.controls.service.api.default_k) == ("sd", "fixed:3", 4)
            assert sprinter([*base, '{"policy": null}']) == 0  # cleared: each edge's own default again
            assert [_complete(daemon)["policy"] for daemon in (early, late)] == ["fixed:4", "fixed:4"]  # sd, k 4
        capsys.readouterr()
        for argument, said in (("no-such-file.json", "neither a JSON object nor a file"),
                               ("{not json", "not valid JSON"), ('{"speed": "warp"}', "unknown config field(s) speed")):
            assert sprinter([*base, argument]) == 2
            assert said in capsys.readouterr().err


def _write_verifier(directory: Path, tokenizer, fingerprint: str | None = None) -> dict:
    """A learned verifier on the confidence features for the tiny pair (or a foreign vocabulary)."""
    directory.mkdir(parents=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 1), torch.nn.Flatten(0), torch.nn.Sigmoid())
    torch.onnx.export(model, (torch.zeros(1, 3),), str(directory / "verifier.onnx"), input_names=["features"],
                      output_names=["score"], dynamic_axes={"features": {0: "n"}, "score": {0: "n"}}, dynamo=False)
    metadata = {"format": "sprinter-verifier/1", "onnx": "verifier.onnx", "features": ["token_prob", "max_prob",
                "entropy"], "threshold": 0.4, "metrics": {}, "pair": {"draft": "tiny-random-draft", "target":
                "tiny-random", "vocab_fingerprint": fingerprint or vocab_fingerprint(tokenizer)}}
    (directory / "verifier.json").write_text(json.dumps(metadata))
    return metadata


def _push(url: str, directory: Path, metadata: dict, onnx: bytes | None = None, sha256: str | None = None):
    """Publish an artifact (optionally with bytes that do not match its digest) and point group g1 at it."""
    artifact = VerifierArtifact.from_onnx((directory / "verifier.onnx").read_bytes(), metadata)
    if onnx is not None:
        artifact = VerifierArtifact(sha256, metadata, VerifierArtifact.from_onnx(onnx, metadata).onnx_base64)
    asyncio.run(push_verifier(_fast(url), artifact))
    return asyncio.run(apply_config(_fast(url), "g1", {"verifier": {"id": directory.name, "sha256": artifact.sha256}},
                                    timeout_s=15))


def test_a_pushed_verifier_is_swapped_in_and_a_corrupt_or_foreign_one_is_refused(tmp_path: Path, tiny_target,
                                                                                tiny_draft, monkeypatch) -> None:
    monkeypatch.setattr(fleet_agent, "ARTIFACT_WAIT_S", 1.0)
    monkeypatch.setenv("SPRINTER_CACHE", str(tmp_path / "cache"))
    with broker(tmp_path / "broker") as running, ServerThread(CloudSettings(port=0), tiny_target) as cloud, \
            fleet_edge(tiny_draft, cloud.address, running.url, "e1") as (daemon, _):
        _wait(lambda: "e1" in _edges(running.url), 10, "the edge online")
        own = daemon.node.verifier_identity
        good = tmp_path / "calibrated-v2"
        metadata = _write_verifier(good, tiny_draft.tokenizer)
        [result] = _push(running.url, good, metadata)
        assert result.ok, result.reason
        verifier = daemon.node.decoder.verifier
        sha256 = verifier_digest((good / "verifier.onnx").read_bytes(), metadata)
        assert isinstance(verifier, LearnedVerifier) and verifier.sha256 == sha256
        assert verifier.trained_temperature == 0  # metadata from before the sampling regime: greedy
        assert _edges(running.url)["e1"].verifier == {"id": "calibrated-v2", "sha256": sha256}
        assert _complete(daemon, mode="sprinter")["verifier"] == {"id": "calibrated-v2", "sha256": sha256}

        [corrupt] = _push(running.url, good, metadata, onnx=b"not the model", sha256="ab" * 32)
        assert not corrupt.ok and "hash to" in corrupt.reason
        unloadable = tmp_path / "unloadable"
        unloadable.mkdir()
        (unloadable / "verifier.onnx").write_bytes(b"not an ONNX model, under its own digest")
        [broken] = _push(running.url, unloadable, metadata)
        assert not broken.ok and "does not load" in broken.reason
        foreign = tmp_path / "foreign"
        [refused] = _push(running.url, foreign, _write_verifier(foreign, tiny_draft.tokenizer, fingerprint="other"))
        assert not refused.ok and "vocabulary" in refused.reason
        missing = asyncio.run(apply_config(_fast(running.url), "g1", {"verifier": {"id": "x", "sha256": "cd" * 32}}))
        assert not missing[0].ok and "was not published" in missing[0].reason
        assert daemon.node.decoder.verifier is verifier  # every refusal kept what was in force
        assert _edges(running.url)["e1"].verifier["sha256"] == sha256
        [cleared] = asyncio.run(apply_config(_fast(running.url), "g1", {"verifier": None}))
        assert cleared.ok and daemon.node.verifier_identity == own  # the group cleared it: the daemon's own again


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGINT])
def test_a_stopped_edge_goes_offline_a_killed_one_by_its_last_will(tmp_path: Path, stop: signal.Signals) -> None:
    keepalive = 2
    with broker(tmp_path) as running:
        port = free_port()
        process = subprocess.Popen([sys.executable, "-m", "common.cli", "--log-level", "WARNING", "edge", "serve",
                                    "--draft", "tiny-random-draft", "--draft-runtime", "torch", "--verifier",
                                    "confidence:0.5", "--listen", f"127.0.0.1:{port}", "--mqtt", running.url,
                                    "--mqtt-keepalive", str(keepalive), "--edge-id", "doomed"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            _wait(lambda: _edges(running.url).get("doomed", None) is not None, 90, "the edge online")
            assert _edges(running.url)["doomed"].api == f"http://127.0.0.1:{port}/v1"
            process.send_signal(stop)
            stopped = time.monotonic()
            _wait(lambda: _edges(running.url)["doomed"].status == "offline", 3 * keepalive, "offline")
            # SIGKILL: the broker's keepalive check, plus a read's latency; Ctrl-C: the edge says goodbye itself
            assert time.monotonic() - stopped <= (1.5 * keepalive + 1.5 if stop == signal.SIGKILL else 1.5)
            if stop == signal.SIGINT:
                assert process.wait(30) == 0 and "Traceback" not in process.stderr.read()
        finally:
            process.kill()
            process.wait()


def test_an_edge_serves_without_its_broker_and_rejoins_when_it_comes_back(tmp_path: Path, tiny_draft) -> None:
    absent = MosquittoBroker(tmp_path, port=free_port())  # not started: the edge comes up without its broker
    with fleet_edge(tiny_draft, None, absent.url, "e1", telemetry_interval_s=0.2) as (daemon, agent):
        assert _complete(daemon, mode="draft")["mode"] == "draft"
        _wait(lambda: agent.connection.counters.dropped >= 2, 5, "telemetry dropped and counted")
        absent.start()
        try:
            _wait(lambda: "e1" in _edges(absent.url), 10, "the edge's state after the broker appears")
            absent.stop(kill=True)
            assert _complete(daemon, mode="draft")["mode"] == "draft"  # the broker's death costs requests nothing
            dropped = agent.connection.counters.dropped
            _wait(lambda: agent.connection.counters.dropped > dropped, 5, "telemetry dropped again")
            absent.start()
            _wait(lambda: agent.connection.counters.connects == 2, 10, "reconnected")
            telemetry = asyncio.run(read_fleet(_fast(absent.url), wait_s=0.6)).telemetry
            assert telemetry["e1"].dropped_telemetry > 0 and _edges(absent.url)["e1"].status == "online"
        finally:
            absent.stop()


def test_a_cloud_announcement_seeds_the_edge_cost_model(tmp_path: Path, tiny_draft) -> None:
    load = CloudLoad("c9", "online", "tiny-random", "x", "127.0.0.1:1", 0, 0, 0.0, 42.0, 0, 1, time.time())
    with broker(tmp_path) as running, fleet_edge(tiny_draft, None, running.url, "e1") as (daemon, agent):
        async def announce() -> None:
            async with FleetConnection(_fast(running.url), "fake-cloud") as connection:
                await asyncio.wait_for(connection.connected.wait(), 5)
                await connection.publish(topics.cloud_load("c9"), encode(load), qos=1, retain=True)

        asyncio.run(announce())
        cost_model = daemon.node.decoder.cost_model
        _wait(lambda: cost_model.prior_verify_base_ms == 42.0, 5, "the seeded verify time")


@pytest.mark.parametrize("flags, problem", [(["--edge-id", "a/b"], "--edge-id"), (["--group", "#"], "--group"),
                                            (["--telemetry-interval", "0"], "--telemetry-interval")])
def test_bad_fleet_flags_are_refused_before_anything_loads(flags: list[str], problem: str, capsys) -> None:
    assert sprinter(["edge", "serve", "--mqtt", "mqtt://127.0.0.1:1", *flags]) == 2
    assert problem in capsys.readouterr().err


def test_an_edge_without_cloud_flags_verifies_on_the_replicas_the_fleet_plane_announces(tmp_path: Path, tiny_target,
                                                                                       tiny_draft) -> None:
    with broker(tmp_path) as running, \
            ServerThread(CloudSettings(port=0, mqtt=running.url, replica_id="c1"), tiny_target) as cloud, \
            fleet_edge(tiny_draft, None, running.url, "e1", discover_clouds=True) as (daemon, _):
        _wait(lambda: daemon.node.cloud.available(), 10, "the announced replica in use")
        answer = _complete(daemon, mode="sd")
        assert not answer["degraded"] and answer["target_calls"] > 0
        assert daemon.node.cloud.address == cloud.address


def test_an_edge_given_its_clouds_adopts_no_announced_replica(tmp_path: Path, tiny_target, tiny_draft) -> None:
    """Its --cloud may be a proxy or a tunnel: an announced address would bypass it (as it did the sweep's link)."""
    with broker(tmp_path) as running, \
            ServerThread(CloudSettings(port=0, mqtt=running.url, replica_id="c1"), tiny_target) as given, \
            ServerThread(CloudSettings(port=0, mqtt=running.url, replica_id="c2"), tiny_target), \
            fleet_edge(tiny_draft, given.address, running.url, "e1") as (daemon, _):
        _wait(lambda: len(asyncio.run(read_fleet(_fast(running.url), wait_s=0.2)).clouds) == 2, 10, "both announced")
        time.sleep(0.5)  # the edge has heard them too
        assert [r["address"] for r in daemon.node.cloud.describe()] == [given.address]
