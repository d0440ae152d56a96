"""Call policies wired into decoding: any policy keeps lossless modes lossless, stats report it, and the edge's
cost model learns from real round trips."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
import torch

from cloud.server import CloudSettings
from cloud_harness import ServerThread
from common.model.cached_lm import CachedLM
from common.spec.call_policy import FixedPolicy
from common.spec.cost_model import CostModel
from common.spec.local_decoder import LocalDecoder
from common.spec.modes import DecodeSettings, call_policy
from common.sampling.distributions import SamplingParams
from common.spec.verifier import DraftStep
from edge.decoding.decoder import EdgeSettings
from edge.node import EdgeNode, EdgeNodeSettings
from proposing import draft_tokens


LOSSLESS = ("sd", "sd-block", "sprinter-exact")
POLICIES = ("fixed:3", "heuristic", "flag", "goodput")
PROMPTS = ("The quick brown fox", "def add(a, b):")


@dataclass
class HashVerifier:
    """Scores spread over [0.2, 1) by token id. The tiny random draft's own confidence is near 1/vocab for every
    token, so goodput would always send at g = 1; these scores make flag and goodput blocks vary in length."""

    threshold: float = 0.3
    needs_hidden: bool = False

    def score(self, step: DraftStep) -> float:
        return 0.2 + 0.8 * (step.token * 2654435761 % 1000) / 1000


VERIFIER = HashVerifier()


@pytest.fixture(scope="module")
def engine(tiny_target, tiny_draft) -> LocalDecoder:
    return LocalDecoder(tiny_target, tiny_draft, VERIFIER)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", LOSSLESS)
def test_lossless_modes_equal_target_greedy_under_every_policy(engine, tiny_target, mode, policy):
    for prompt in PROMPTS:
        ids = tiny_target.tokenizer(prompt)["input_ids"]
        reference = engine.generate(ids, DecodeSettings(mode="target", max_new_tokens=40)).token_ids
        result = engine.generate(ids, DecodeSettings(mode=mode, max_new_tokens=40, policy=policy, max_run_length=8))
        assert result.token_ids == reference, (mode, policy, prompt)
        assert result.stats.policy == call_policy(DecodeSettings(mode=mode, policy=policy), VERIFIER).describe()
        assert 1 <= result.stats.block_length_mean <= 8


def test_stats_report_the_policy_and_block_length(engine, tiny_target):
    ids = tiny_target.tokenizer(PROMPTS[0])["input_ids"]

    def stats(**kw):
        return engine.generate(ids, DecodeSettings(max_new_tokens=40, **kw)).stats

    fixed = stats(mode="sd", policy="fixed:3")
    assert fixed.policy == "fixed:3" and fixed.block_length_mean <= 3
    assert fixed.block_length_mean == pytest.approx(fixed.drafted_tokens / fixed.target_calls)
    assert stats(mode="sd-block", k=4).policy == "fixed:4"  # the default of sd modes: every k tokens
    assert stats(mode="sd", k=4).block_length_mean <= 4
    assert stats(mode="sprinter").policy == "flag:0.3"  # the paper's loop at the verifier's threshold
    assert stats(mode="sprinter-exact").policy == "goodput:max=20"
    assert stats(mode="sprinter-exact", policy="flag").policy == "flag:0.3"  # bare flag: the verifier's threshold
    assert stats(mode="sd", policy="goodput:max=6").block_length_mean <= 6
    for mode in ("draft", "target"):
        s = stats(mode=mode)
        assert s.policy is None and s.block_length_mean is None
        assert s.to_dict()["policy"] is None


def test_bad_policies_are_refused():
    with pytest.raises(ValueError, match="unknown call policy"):
        DecodeSettings(mode="sd", policy="warp-speed")
    with pytest.raises(ValueError, match="bad call policy"):
        DecodeSettings(mode="sd-block", policy="fixed:0")
    for mode in ("sprinter", "draft", "target"):
        with pytest.raises(ValueError, match="applies to modes"):
            DecodeSettings(mode=mode, policy="goodput")


def test_cli_refuses_a_bad_policy(capsys):
    from common.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--policy", "sometimes"])
    assert "unknown call policy" in capsys.readouterr().err
    assert build_parser().parse_args(["generate", "--prompt", "x", "--policy", "goodput:max=8"]).policy == "goodput:max=8"


class SendAt:
    """A policy that records what it is asked and sends at a chosen block length."""

    name = "send-at"

    def __init__(self, g: int) -> None:
        self.g = g
        self.asked: list[list[float]] = []

    def describe(self) -> str:
        return f"send-at:{self.g}"

    def should_send(self, accept_probs, cap: int) -> bool:
        self.asked.append(list(accept_probs))
        return len(accept_probs) >= self.g

    def observe_verdict(self, block_length: int, n_accepted: int) -> None:
        pass


def test_draft_tokens_asks_the_policy_with_verifier_scores(tiny_draft):
    ids = tiny_draft.tokenizer(PROMPTS[1])["input_ids"]
    policy, cost_model = SendAt(4), CostModel()
    drafted = (draft_tokens(CachedLM(tiny_draft.model), ids, 10, SamplingParams(temperature=0.0),
                                torch.Generator(), frozenset(), VERIFIER, policy, cost_model))
    assert len(drafted) == 4 and [d.ends_block for d in drafted] == [False, False, False, True]
    scores = [VERIFIER.score(d.step) for d in drafted]
    assert policy.asked[-1] == pytest.approx(scores)  # a_i is the verifier's score
    assert [d.flagged for d in drafted] == [s < VERIFIER.threshold for s in scores]  # flags stay the verifier's
    assert cost_model.snapshot()["draft_steps_observed"] == 4
    # the cap wins over a policy that would draft on; without a verifier a_i is the draft's own T=1 probability
    capped = (draft_tokens(CachedLM(tiny_draft.model), ids, 2, SamplingParams(temperature=0.0),
                               torch.Generator(), frozenset(), None, FixedPolicy(9)))
    assert len(capped) == 2 and capped[-1].ends_block and not any(d.flagged for d in capped)


# --- over a real gRPC cloud ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_cloud(tiny_target):
    with ServerThread(CloudSettings(target="tiny-random", batch_window_ms=1), tiny_target) as server:
        yield server


def test_edge_goodput_is_lossless_and_learns_the_round_trip(tiny_cloud, tiny_target, tiny_draft):
    prompt_ids = tiny_target.tokenizer(PROMPTS[0])["input_ids"]
    reference = LocalDecoder(tiny_target, None).generate(prompt_ids, DecodeSettings(mode="target", max_new_tokens=32))

    async def run():
        settings = EdgeNodeSettings(draft=tiny_draft.spec, cloud=tiny_cloud.address, draft_runtime="torch",
                                    dtype="float32", verifier="confidence:0.3")
        async with EdgeNode(settings, tiny_draft) as node:
            node.decoder.verifier = VERIFIER
            results, snapshots = [], []
            for mode, policy in (("sprinter-exact", "goodput"), ("sd", "heuristic")):
                decode = DecodeSettings(mode=mode, max_new_tokens=32, policy=policy, max_run_length=8)
                results.append(await node.decoder.generate(prompt_ids, EdgeSettings(decode)))
                snapshots.append(node.decoder.cost_model.snapshot())
            return results, snapshots

    results, snapshots = asyncio.run(run())
    for result, policy in zip(results, ("goodput:max=20", "heuristic")):
        assert result.token_ids == reference.token_ids, policy
        assert not result.degraded and result.stats.policy == policy
        assert result.stats.block_length_mean is not None
    first, second = snapshots
    # every verify: the session's open (which prefills the prompt and brings the first token) is no round trip
    assert first["round_trips_observed"] == results[0].stats.target_calls - 1 >= 1
    # the first block is drafted beside the prompt's prefill: not a step's cost
    assert 0 < first["draft_steps_observed"] <= results[0].stats.drafted_tokens
    assert first["rtt_ms"] > 0.0  # loopback gRPC: the edge waits longer than the cloud verifies
    assert first["verdicts_observed"] == results[0].stats.target_calls - 1  # every verdict feeds the keep model
    # one cost model per decoder: the second request keeps learning where the first left off
    assert second["round_trips_observed"] == first["round_trips_observed"] + results[1].stats.target_calls - 1


def test_http_api_takes_a_policy_and_refuses_a_bad_one(tiny_draft):
    from fastapi.testclient import TestClient

    from edge.api.app import ApiSettings, create_app

    node = EdgeNode(EdgeNodeSettings(draft=tiny_draft.spec, draft_runtime="torch", dtype="float32",
                                     verifier="confidence:0.3"), tiny_draft)
    asyncio.run(node.__aenter__())  # no cloud: nothing bound to that loop
    client = TestClient(create_app(node, ApiSettings("sprinter-exact", "tiny", default_policy="fixed:2")))

    def complete(**fields):
        return client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 6, "temperature": 0, **fields})

    for fields, message in (({"policy": "warp-speed"}, "unknown call policy"),
                            ({"policy": "fixed:-1"}, "bad call policy"),
                            ({"mode": "sprinter", "policy": "goodput"}, "applies to modes")):
        response = complete(**fields)
        assert response.status_code == 400, fields
        error = response.json()["error"]
        assert error["param"] == "policy" and message in error["message"] and error["type"] == "invalid_request_error"
    ok = complete(mode="sd", policy="heuristic").json()["sprinter"]
    assert ok["policy"] == "heuristic" and ok["stats"]["policy"] == "heuristic" and "block_length_mean" in ok
    assert complete().json()["sprinter"]["policy"] == "fixed:2"  # the daemon's default policy
    assert complete(mode="sprinter").json()["sprinter"]["policy"] == "flag:0.3"  # the default skips sprinter
    assert 'sprinter_edge_cost_model{estimate="t_draft_ms"}' in client.get("/metrics").text
