"""`--mode auto` (issue 56): per request, the target alone, speculating on the edge, or in the cloud, whichever the
cost model (common/spec/round_cost.py) predicts fastest, and lossless whatever it chooses.

The choice is a pure function (edge/decoding/placement.py `decide` with the target's decode step given), tested on
its own; then over a real cloud on loopback behind the real link proxy (sim/link/) for the RTT, greedy in float32:
far from the cloud it streams the target's own decoding, near it with a slow target it speculates, and every output
is the target's own, token for token. Through the real API: the response says what it chose and what it predicted
of each option, the metrics count it, and a daemon without a cloud refuses `auto`, naming the field.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx
import pytest

from cloud.server import CloudSettings
from cloud_harness import ServerThread
from common.spec.cost_model import CostModel
from common.spec.local_decoder import LocalDecoder
from common.spec.modes import DecodeSettings
from common.spec.round_cost import CloudCosts
from common.stats import DecodeStats
from edge.api.app import ApiSettings, create_app
from edge.decoding.decoder import EdgeSettings
from edge.decoding.placement import PlacementInputs, decide
from edge.decoding.mode_switch import ModeSwitch
from edge.decoding.placer import EdgeYield, Placer
from edge.node import EdgeNode, EdgeNodeSettings
from edge_harness import EdgeDaemonThread
from sim.link.proxy import LinkProxy
from sim.link.shaping import LinkSettings

NEAR = PlacementInputs(gamma=4, max_tokens=64, edge_tokens_per_round=3.0, t_draft_edge_ms=10.0, rtt_ms=0.0,
                       t_verify_ms=20.0, uplink_bytes_per_round=0.0, uplink_mbps=0.0, cloud_tokens_per_round=3.0,
                       cloud_round_ms=4 * 15.0 + 20.0, cloud_drafts=False, cloud_decode_ms=20.0)


def test_speculating_wins_near_a_slow_target_and_the_target_alone_far_from_it() -> None:
    near = decide(NEAR)  # a round: 3 tokens in 60 ms; the target alone: a token per 20 ms
    assert near.placement == "edge" and near.target_tokens_per_s == pytest.approx(1e3 * 64 / (64 * 20.0))
    far = decide(replace(NEAR, rtt_ms=200.0))  # every round pays the RTT; the target's stream pays it once
    assert far.placement == "target" and far.reason == "faster"
    assert far.target_tokens_per_s == pytest.approx(1e3 * 64 / (200.0 + 64 * 20.0))
    assert set(far.predicted()) == {"edge", "target"}  # no cloud draft: cloud-sd is no option
    drafting = decide(replace(NEAR, rtt_ms=200.0, cloud_drafts=True, cloud_round_ms=4 * 2.0 + 20.0))  # 3 in 28 ms
    assert drafting.placement == "cloud" and set(drafting.predicted()) == {"edge", "cloud", "target"}


def test_mid_request_an_open_stream_pays_no_round_trip_again() -> None:
    end = replace(NEAR, rtt_ms=200.0, max_tokens=2)  # 2 tokens left, the edge's round: 3 tokens in 260 ms
    assert decide(end).placement == "edge"  # a fresh stream of the target's: 2 tokens in 200 + 40 ms
    kept = decide(replace(end, open_stream="target"), previous="target")  # the stream running: 2 in 40 ms
    assert kept.placement == "target" and kept.target_tokens_per_s == pytest.approx(1e3 * 2 / 40.0)


def test_a_busy_cloud_loses_cloud_drafting_and_stretches_the_targets_stream() -> None:
    far = replace(NEAR, rtt_ms=200.0, cloud_drafts=True, cloud_round_ms=4 * 2.0 + 20.0)
    busy = decide(replace(far, cloud_busy=True, cloud_load=3.0))
    assert busy.placement != "cloud" and busy.target_tokens_per_s < decide(far).target_tokens_per_s / 2


def test_the_edge_is_priced_at_the_blocks_its_rounds_send_not_at_k() -> None:
    # a goodput policy sends 10-token blocks where k is 4: the rounds' 3 tokens cost 10 draft steps and a verify of 10
    cost_model = CostModel(prior_draft_ms=10.0, prior_rtt_ms=0.0, prior_verify_base_ms=20.0, prior_verify_per_token_ms=1.0)
    placer = Placer()
    placer.observe_edge_rounds(EdgeYield(1, 3.0, 10.0))
    inputs = placer.inputs(4, 64, cost_model)
    assert inputs.edge_drafted_per_round == pytest.approx(10.0)
    assert inputs.t_verify_ms == pytest.approx(cost_model.t_verify_ms(10.0))
    assert decide(inputs).edge_tokens_per_s == pytest.approx(1e3 * 3.0 / (10 * 10.0 + 20.0 + 10 * 1.0))
    assert Placer().inputs(4, 64, cost_model).edge_drafted_per_round is None  # before any round: k


def test_each_option_is_priced_with_its_start_as_learned_per_prompt_token() -> None:
    # a request's first round or chunk holds its prompt's prefill: learned per prompt token, charged once per request
    cost_model = CostModel(prior_draft_ms=10.0, prior_rtt_ms=0.0, prior_verify_base_ms=20.0, prior_verify_per_token_ms=0.0)
    placer = Placer()
    placer.observe_target_step(20.0, first=False)
    placer.observe_target_step(20.0 + 100.0, first=True, prompt_tokens=50)  # 100 ms of prefill for 50 tokens: 2 a token
    # a mode whose first token comes with the first verdict: that round is the first of the request's T / E
    placer.observe_edge_start(ttft_ms=4 * 10.0 + 20.0 + 300.0, prompt_tokens=100, k=4, cost_model=cost_model,
                              first_from_open=False)
    assert placer.start_ms("target", 200) == pytest.approx(400.0) and placer.start_ms("edge", 200) == pytest.approx(600.0)
    assert placer.start_ms("cloud", 200) == 0.0  # no cloud-sd request seen: nothing charged
    inputs = replace(placer.inputs(4, 64, cost_model, prompt_tokens=200), cloud_decode_ms=20.0)
    decision = decide(inputs)
    assert decision.target_tokens_per_s == pytest.approx(1e3 * 64 / (400.0 + 64 * 20.0))
    rounds = 64 / inputs.edge_tokens_per_round
    assert decision.edge_tokens_per_s == pytest.approx(1e3 * 64 / (600.0 + rounds * (4 * 10.0 + 20.0)))
    assert placer.inputs(4, 64, cost_model).edge_start_ms == 0.0  # mid-request (no prompt): no start to pay


def test_a_first_token_from_the_open_is_charged_a_tokens_share_of_a_round_not_a_round() -> None:
    # the lossless modes take the target's first token from the session's open: the request is that token at its
    # time to first token, then (T - 1) / E rounds; priced s + (T / E) rounds, s is the TTFT less 1 / E of a round
    cost_model = CostModel(prior_draft_ms=10.0, prior_rtt_ms=0.0, prior_verify_base_ms=20.0, prior_verify_per_token_ms=0.0)
    placer = Placer()
    placer.observe_edge_rounds(EdgeYield(1, 5.0, 4.0))  # verdicts yield 5 tokens from 4 drafted: a round of 4 * 10 + 20 ms
    placer.observe_edge_start(ttft_ms=500.0, prompt_tokens=100, k=4, cost_model=cost_model)
    assert placer.start_ms("edge", 100) == pytest.approx(500.0 - 60.0 / 5.0)
    inputs = placer.inputs(4, 64, cost_model, prompt_tokens=100)
    assert 1e3 * 64 / decide(inputs).edge_tokens_per_s == pytest.approx(500.0 + (64 - 1) / 5.0 * 60.0)


def test_an_edge_round_is_a_verdict_and_the_opens_first_token_no_rounds_yield() -> None:
    # 32 tokens: the open's first (a target call, no verdict), then 4 verdicts on blocks of 2, 13, 20 and 4
    stats = DecodeStats("sprinter-exact", "goodput", 32, 3.0, 10.7, 5, 5 / 32, 6.4, 9.75, 7.0, [], 39, 39, 700.0,
                        None, None, block_lengths=[2, 13, 20, 4], accepted_lengths=[0, 4, 20, 4], uplink_bytes=4000)
    placer = Placer()
    placer.observe_edge(stats)
    inputs = placer.inputs(5, 32, CostModel())
    assert inputs.edge_tokens_per_round == pytest.approx(31 / 4)
    assert inputs.edge_drafted_per_round == pytest.approx(39 / 4)
    assert inputs.uplink_bytes_per_round == pytest.approx(1000.0)


class _Cloud:  # what the placer reads of the decoder's ReplicaSet: no cost table, no draft, no queue
    def costs(self) -> CloudCosts:
        return CloudCosts()

    def drafting_load(self) -> tuple[float, bool]:
        return 1.0, False

    def drafts(self) -> bool:
        return False


def _slow_target_placer() -> tuple[Placer, CostModel]:
    """Earlier requests' edge rounds yielded 5 tokens from 5 drafted, a round of 5 * 24 + 100 + 300 ms (9.6 tokens/s);
    the target decodes a token in 240 ms (4.2 tokens/s) and prefilled 2 ms a prompt token."""
    cost_model = CostModel(prior_draft_ms=24.0, prior_rtt_ms=100.0, prior_verify_base_ms=300.0,
                           prior_verify_per_token_ms=0.0)
    placer = Placer()
    placer.observe_edge_rounds(EdgeYield(10, 50.0, 50.0))
    placer.observe_target_step(240.0, first=False)
    placer.observe_target_step(240.0 + 100.0, first=True, prompt_tokens=50)
    return placer, cost_model


def test_a_few_poor_rounds_of_a_request_weigh_against_earlier_requests_and_many_take_over() -> None:
    placer, cost_model = _slow_target_placer()
    few = EdgeYield(rounds=3, tokens=4.5, drafted=15.0)  # a stretch of prose: 1.5 tokens a round
    kept = placer.choose_mode("sprinter-exact", 5, 64, cost_model, _Cloud(), "edge", 10, 110, few)
    assert kept.used == "edge" and kept.decision.reason != "kept"
    blended = (8 * 5.0 + 4.5) / (8 + 3)  # the request's 3 rounds against earlier requests' as 8
    assert kept.decision.edge_tokens_per_s == pytest.approx(1e3 * 64 / (64 / blended * (5 * 24.0 + 400.0)))
    many = EdgeYield(rounds=40, tokens=40.0, drafted=200.0)  # a request that keeps yielding one token a round
    left = placer.choose_mode("sprinter-exact", 5, 64, cost_model, _Cloud(), "edge", 50, 150, many)
    assert left.used == "target"
    # the switch pays the target's start over the context so far: a fresh stream prefills 150 tokens at 2 ms each
    assert left.decision.target_tokens_per_s == pytest.approx(1e3 * 64 / (100.0 + 300.0 + 64 * 240.0))


def test_the_option_running_pays_no_start_and_a_requests_own_switches_do_not_steer_the_next_one() -> None:
    placer, cost_model = _slow_target_placer()
    placer.observe_edge_start(ttft_ms=1000.0, prompt_tokens=100, k=5, cost_model=cost_model)
    first = placer.choose_mode("sprinter-exact", 5, 64, cost_model, _Cloud(), None, prompt_tokens=100)
    assert first.used == "edge" and placer.previous_choice == "edge"
    running = placer.choose_mode("sprinter-exact", 5, 64, cost_model, _Cloud(), "edge", 10, 110)
    assert running.decision.edge_tokens_per_s == pytest.approx(1e3 * 64 / (64 / 5.0 * (5 * 24.0 + 400.0)))
    slow = EdgeYield(rounds=400, tokens=400.0, drafted=2000.0)
    assert placer.choose_mode("sprinter-exact", 5, 64, cost_model, _Cloud(), "edge", 20, 120, slow).used == "target"
    assert placer.previous_choice == "edge"  # the next request starts from this one's first choice


def test_a_requests_edge_rounds_teach_the_placer_once_at_its_end_weighed_by_their_rounds() -> None:
    placer, cost_model = _slow_target_placer()  # earlier: 10 rounds, 50 tokens, 50 drafted
    asked = EdgeSettings(DecodeSettings(mode="sprinter-exact", max_new_tokens=64, k=5), chooses_mode=True)
    first = placer.choose_mode("sprinter-exact", 5, 64, cost_model, _Cloud(), None)
    switch = ModeSwitch(placer, asked, first, cost_model, _Cloud(), lambda: False,
                        own=EdgeYield(rounds=30, tokens=40.0, drafted=150.0))
    switch.teach()
    inputs = placer.inputs(5, 64, cost_model)
    # one step of the decay by request, as ratios of sums: (0.75 * 50 + 0.25 * 40) / (0.75 * 10 + 0.25 * 30)
    assert inputs.edge_tokens_per_round == pytest.approx(47.5 / 15.0)
    assert inputs.edge_drafted_per_round == pytest.approx(75.0 / 15.0) and switch.edge_rounds == 30
    # an average of each request's own E would say (0.75 * 5 + 0.25 * 1.33) = 4.08: the poor request's 30 rounds
    # take 3x the time of the other's 10, and the ratio of sums weighs them so


def test_placement_alone_never_offers_the_target() -> None:
    assert decide(replace(NEAR, rtt_ms=200.0, cloud_decode_ms=None)).placement == "edge"


def _plain_cloud(tiny_target) -> ServerThread:  # no draft of its own: auto chooses between the target and the edge
    return ServerThread(CloudSettings(target="tiny-random", batch_window_ms=1, dtype="float32"), tiny_target,
                        cost_table=True)


async def _through_link(cloud: ServerThread, draft, work):
    host, _, port = cloud.address.rpartition(":")
    async with LinkProxy(LinkSettings(delay_ms=0.0), (host, int(port))) as link:
        settings = EdgeNodeSettings(draft=draft.spec, cloud=link.address, draft_runtime="torch", dtype="float32",
                                    verifier="confidence:0.3")
        async with EdgeNode(settings, draft) as node:
            return await work(node, link)


def test_auto_streams_the_target_far_away_speculates_near_a_slow_one_and_stays_lossless(tiny_target,
                                                                                       tiny_draft) -> None:
    prompt = tiny_target.tokenizer("Once upon a time")["input_ids"]
    target = LocalDecoder(tiny_target, None).generate(prompt, DecodeSettings(mode="target", max_new_tokens=24))
    settings = EdgeSettings(DecodeSettings(mode="sprinter-exact", max_new_tokens=24, k=4), chooses_mode=True)

    async def work(node: EdgeNode, link: LinkProxy):
        runs = []
        link.change_delay(150.0)  # an RTT of 300 ms: every speculation round would pay it
        node.decoder.cost_model.observe_rtt(300.0)
        runs.append(await node.decoder.generate(prompt, settings))
        link.change_delay(0.0)
        for _ in range(8):  # the target measured as slow: 1 s a token
            node.decoder.placer.observe_target_step(1000.0, first=False)
            node.decoder.cost_model.observe_rtt(0.0)
        runs.append(await node.decoder.generate(prompt, settings))
        return runs

    with _plain_cloud(tiny_target) as cloud:
        far, near = asyncio.run(_through_link(cloud, tiny_draft, work))
    assert (far.placed.used, far.stats.mode) == ("target", "target")
    assert (near.placed.used, near.stats.mode) == ("edge", "sprinter-exact")
    for run in (far, near):
        assert not run.degraded and run.error is None and run.token_ids == target.token_ids
        (switch,) = run.placed.switches()
        assert switch["at_token"] == 0 and switch["mode"] == run.stats.mode
        assert set(switch["predicted_tokens_per_s"]) == {"target", "sprinter-exact"}


def test_the_api_reports_autos_choice_and_refuses_it_without_a_cloud(tiny_target, tiny_draft) -> None:
    def app(node: EdgeNode):
        return create_app(node, ApiSettings(model_name="tiny"))

    def post(edge: EdgeDaemonThread, **fields) -> httpx.Response:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "mode": "auto",
                **fields}
        return httpx.post(edge.base + "/v1/completions", json=body, timeout=60)

    with _plain_cloud(tiny_target) as cloud, EdgeDaemonThread(tiny_draft, cloud.address, app) as edge:
        body = post(edge).json()["sprinter"]
        (switch,) = body["decision"]["switches"]
        assert body["mode"] == switch["mode"] in ("target", "sprinter-exact") and body["placement"]["asked"] == "auto"
        assert all(rate > 0 for rate in switch["predicted_tokens_per_s"].values())
        used = body["placement"]["used"]
        assert f'sprinter_edge_placements_total{{asked="auto",used="{used}"}} 1.0' in httpx.get(edge.base + "/metrics").text
    with EdgeDaemonThread(tiny_draft, None, app) as alone:
        refused = post(alone)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "mode"
        assert "needs a cloud" in refused.json()["error"]["message"]
