"""Placement per request (issue 29): where the draft runs, edge or cloud (cloud-sd), or chosen per request (auto).

The decision is a pure function (edge/decoding/placement.py), tested on its own; then over a real cloud on
loopback that drafts with `--draft` (ServerThread(draft=)), behind the real link proxy (sim/link/) for the RTT:
placement cloud runs cloud-sd with the same greedy output as the edge placement and the target; auto moves to the
cloud when the scripted RTT rises and back when the cloud announces a queue (and stays there when the next
announcement happens to catch the cloud between forwards, with no queue). The announcement is fed to the edge's
replica set the way the fleet agent does (edge/fleet_controls.py `cloud_announced` -> `ReplicaSet.observe`), not
over MQTT: the broker's path to `observe` is the fleet tests' business. Bad values are refused, the field named.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import httpx
import pytest

from cloud.server import CloudSettings
from cloud_harness import ServerThread
from common.spec.local_decoder import LocalDecoder
from common.spec.modes import DecodeSettings
from edge.decoding.placement import PlacementInputs, cloud_tokens_per_s, decide, edge_tokens_per_s
from common.fleet_plane.messages import CloudLoad
from edge.api.app import ApiSettings, create_app
from edge.cloud_link import replicas
from edge.decoding.decoder import EdgeSettings
from edge.decoding.placer import Placer, PlacementRefused
from edge.node import EdgeNode, EdgeNodeSettings
from edge_harness import EdgeDaemonThread
from sim.link.proxy import LinkProxy
from sim.link.shaping import LinkSettings

BASE = PlacementInputs(gamma=4, max_tokens=64, edge_tokens_per_round=3.0, t_draft_edge_ms=10.0, rtt_ms=0.0,
                       t_verify_ms=20.0, uplink_bytes_per_round=0.0, uplink_mbps=0.0, cloud_tokens_per_round=3.0,
                       cloud_round_ms=4 * 2.0 + 20.0)


def test_edge_drafting_wins_on_a_fast_link_cloud_drafting_on_a_slow_one() -> None:
    assert decide(BASE).placement == "cloud"  # the cloud's draft is faster and nothing else differs
    slow_cloud = replace(BASE, cloud_round_ms=4 * 15.0 + 20.0)
    assert decide(slow_cloud).placement == "edge"
    far = replace(slow_cloud, rtt_ms=100.0)  # edge drafting pays the RTT every round, the cloud's stream once
    decision = decide(far)
    assert decision.placement == "cloud" and decision.reason == "faster"
    assert decision.cloud_tokens_per_s == pytest.approx(1e3 * 64 / (100.0 + 64 / 3.0 * 80.0))
    assert decision.edge_tokens_per_s == pytest.approx(1e3 * 3.0 / (40.0 + 100.0 + 20.0))


def test_a_slow_uplink_pushes_towards_the_cloud() -> None:
    near = replace(BASE, cloud_round_ms=4 * 15.0 + 20.0)
    sampled = replace(near, uplink_bytes_per_round=4 * 40_000.0)  # draft distributions at sampling: tens of KB a token
    assert decide(sampled).placement == "edge"  # unlimited: bytes cost nothing
    assert decide(replace(sampled, uplink_mbps=10.0)).placement == "cloud"  # 128 ms a round on 10 Mbit/s
    assert edge_tokens_per_s(replace(sampled, uplink_mbps=10.0)) < edge_tokens_per_s(sampled)


def test_a_busy_cloud_or_one_without_a_draft_keeps_the_draft_on_the_edge() -> None:
    far = replace(BASE, rtt_ms=200.0)
    assert decide(far).placement == "cloud"
    busy = decide(replace(far, cloud_busy=True))
    assert busy.placement == "edge" and busy.reason == "cloud_busy" and busy.cloud_tokens_per_s is not None
    assert decide(replace(far, cloud_drafts=False)).reason == "no_cloud_draft"
    assert cloud_tokens_per_s(replace(far, cloud_load=3.0)) < cloud_tokens_per_s(far) / 2  # its rounds, not the RTT, stretch


def test_hysteresis_keeps_the_previous_placement_near_a_tie() -> None:
    tie = replace(BASE, cloud_round_ms=4 * 9.0 + 20.0)  # the cloud 7% faster: within the margin
    assert decide(tie, previous="edge").placement == "edge" and decide(tie, previous="edge").reason == "kept"
    assert decide(tie, previous="cloud").placement == "cloud"
    clearly = replace(BASE, rtt_ms=100.0)
    assert decide(clearly, previous="edge").placement == "cloud"
    with pytest.raises(ValueError, match="uplink_mbps"):
        replace(BASE, uplink_mbps=-1.0)


def _cloud(tiny_target, tiny_draft) -> ServerThread:
    return ServerThread(CloudSettings(target="tiny-random", draft="tiny-random-draft", batch_window_ms=1),
                        tiny_target, draft=tiny_draft)


async def _node(draft, address: str, work, placer: Placer | None = None):
    settings = EdgeNodeSettings(draft=draft.spec, cloud=address, draft_runtime="torch", dtype="float32",
                                verifier="confidence:0.3")
    async with EdgeNode(settings, draft) as node:
        if placer is not None:
            node.decoder.placer = placer
        return await work(node)


def test_placement_cloud_runs_cloud_sd_with_the_edge_placements_greedy_output(tiny_target, tiny_draft) -> None:
    prompt = tiny_target.tokenizer("Once upon a time")["input_ids"]
    target = LocalDecoder(tiny_target, None).generate(prompt, DecodeSettings(mode="target", max_new_tokens=24))

    async def work(node: EdgeNode):
        runs = []
        for mode in ("sd", "sd-block", "sprinter-exact", "sprinter"):
            for placement in ("edge", "cloud"):
                runs.append(await node.decoder.generate(prompt, EdgeSettings(
                    DecodeSettings(mode=mode, max_new_tokens=24, k=3), placement=placement)))
        return runs

    with _cloud(tiny_target, tiny_draft) as cloud:
        runs = asyncio.run(_node(tiny_draft, cloud.address, work))
    for run in runs[:6]:  # the lossless modes, on either side: the target's own output
        assert not run.degraded and run.error is None and run.token_ids == target.token_ids
    assert [(r.placed.used, r.stats.mode) for r in runs[:6]] == [
        ("edge", "sd"), ("cloud", "cloud-sd"), ("edge", "sd-block"), ("cloud", "cloud-sd"),
        ("edge", "sprinter-exact"), ("cloud", "cloud-sd")]
    assert runs[1].stats.block_length_mean > 0.9  # the cloud drafted
    sprinter = runs[7]  # lossy sprinter has no cloud form: it stays on the edge, and says so
    assert sprinter.placed.used == "edge" and sprinter.stats.mode == "sprinter" and "no cloud form" in sprinter.placed.note


def test_auto_moves_to_the_cloud_when_the_rtt_rises_and_back_when_the_cloud_is_busy(tiny_target, tiny_draft,
                                                                                    monkeypatch) -> None:
    monkeypatch.setattr(replicas, "BUSY_HOLD_S", 60.0)  # longer than the requests after the announcement take here
    prompt = tiny_target.tokenizer("Once upon a time")["input_ids"]
    # A cloud draft step priced well above the tiny draft's on the edge: at RTT 0 the edge is faster.
    placer = Placer(prior_cloud_draft_ms=30.0)
    # 12 tokens: about 12 rounds a request on the tiny pair, each 300 ms once the RTT rises
    settings = EdgeSettings(DecodeSettings(mode="sd", max_new_tokens=12, k=4), placement="auto")

    async def work(cloud: ServerThread):
        host, _, port = cloud.address.rpartition(":")
        async with LinkProxy(LinkSettings(delay_ms=0.0), (host, int(port))) as link:
            async def requests(node: EdgeNode):
                used = []
                for step in range(9):
                    if step == 3:
                        link.change_delay(150.0)  # an RTT of 300 ms from here on
                    if step == 6:  # the cloud announces a queue, as the fleet agent hands it on
                        node.cloud.observe(_busy_load(node, cloud))
                    if step == 7:  # the next announcement caught the cloud between forwards: the queue holds
                        node.cloud.observe(replace(_busy_load(node, cloud), queue_depth=0))
                    result = await node.decoder.generate(prompt, settings)
                    assert not result.degraded and result.error is None
                    used.append((result.placed.used, result.placed.decision.reason))
                return used, node.decoder.placer.decisions
            return await _node(tiny_draft, link.address, requests, placer)

    with _cloud(tiny_target, tiny_draft) as cloud:
        used, decisions = asyncio.run(work(cloud))
    where = [u for u, _ in used]
    assert where[:3] == ["edge"] * 3
    assert where[3] == "edge"  # the first request at the new RTT still sees the old one: it measures it
    assert "cloud" in where[4:6] and where[5] == "cloud"
    assert used[6:] == [("edge", "cloud_busy")] * 3
    assert decisions[("auto", "cloud")] >= 1 and decisions[("auto", "edge")] >= 6


def _busy_load(node: EdgeNode, cloud: ServerThread) -> CloudLoad:
    replica = next(iter(node.cloud.replicas.values()))
    return CloudLoad("cloud-0", "online", "tiny-random", node.decoder.vocab_fingerprint, replica.address, 4,
                     queue_depth=12, batch_size_mean=4.0, verify_ms_p50=5.0, kv_bytes_used=0, kv_bytes_budget=1,
                     time=time.time())


def test_bad_placements_are_refused_naming_the_field(tiny_target, tiny_draft) -> None:
    def app(node: EdgeNode):
        return create_app(node, ApiSettings(model_name="tiny"))

    def post(edge: EdgeDaemonThread, **fields) -> httpx.Response:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "mode": "sd", **fields}
        return httpx.post(edge.base + "/v1/completions", json=body, timeout=60)

    with ServerThread(CloudSettings(batch_window_ms=1), tiny_target) as plain:  # a cloud without a draft
        with EdgeDaemonThread(tiny_draft, plain.address, app) as edge:
            for value, words in (("moon", "unknown placement"), ("cloud", "draft of its own")):
                refused = post(edge, placement=value)
                assert refused.status_code == 400 and refused.json()["error"]["param"] == "placement"
                assert words in refused.json()["error"]["message"]
            auto = post(edge, placement="auto").json()["sprinter"]  # auto: the edge, saying why
            assert auto["placement"]["used"] == "edge" and auto["placement"]["reason"] == "no_cloud_draft"
            assert 'sprinter_edge_placements_total{asked="auto",used="edge"} 1.0' in httpx.get(edge.base + "/metrics").text
    with EdgeDaemonThread(tiny_draft, None, app) as alone:
        for value in ("cloud", "auto"):
            refused = post(alone, placement=value, mode="draft")
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "placement"
            assert "needs a cloud" in refused.json()["error"]["message"]
    with _cloud(tiny_target, tiny_draft) as cloud, EdgeDaemonThread(tiny_draft, cloud.address, app) as edge:
        body = post(edge, placement="cloud").json()["sprinter"]
        assert body["placement"] == {"asked": "cloud", "used": "cloud", "mode": "cloud-sd"} and body["mode"] == "cloud-sd"
    with pytest.raises(PlacementRefused, match="needs a cloud"):
        Placer().place("sd", "cloud", 4, 8, None, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="placement"):
        EdgeSettings(DecodeSettings(), placement="moon")
