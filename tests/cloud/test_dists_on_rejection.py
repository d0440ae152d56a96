"""draft_dists "on-rejection" (cloud/residual.py): sampled sd frames carry p_draft(x_i) alone, and the cloud samples
the token rule's residual at a rejection by asking the edge for the draft's probabilities of its candidates.

Over a real cloud on loopback: the output follows the target's law exactly (chi-square on the first tokens of
seeded generations, with a power check), through the candidate queries and through the forced fallback to the
whole distribution; greedy is unchanged; on SmolLM2 at T=1 the uplink falls from tens of KB per token to under
3 KB. The cloud refuses malformed answers by field name and keeps the session as it was before that verify.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import replace

import grpc
import pytest
import torch

from cloud.server import CloudSettings
from cloud_harness import ServerThread, SessionStream
from common.spec.local_decoder import LocalDecoder
from common.spec.modes import DecodeSettings
from common.model.loading import LoadedModel
from common.model.prompting import encode_prompt
from common.sampling.distributions import SamplingParams
from edge.decoding.decoder import EdgeSettings
from edge.node import EdgeNode
from edge_harness import on_edge
from exact_distributions import chi_square_pvalue, first_tokens_distribution, near_draft, seeded_generations
from sprinter.v1 import decoding_pb2 as pb

SAMPLED = SamplingParams(temperature=1.0, top_k=3)
NEW_TOKENS = 3


@pytest.fixture(scope="module")
def tiny_cloud(tiny_target):
    with ServerThread(CloudSettings(target="tiny-random", batch_window_ms=1), tiny_target) as server:
        yield server



def _queries(cloud: ServerThread, kind: str) -> float:
    return cloud.server.metrics.residual_queries.labels(kind)._value.get()


def _sampled_runs(cloud: ServerThread, target: LoadedModel, n: int) -> list:
    prompt = target.tokenizer("Once upon a time")["input_ids"]

    def settings_for(seed: int) -> EdgeSettings:
        return EdgeSettings(DecodeSettings(mode="sd", max_new_tokens=NEW_TOKENS, k=2, sampling=replace(SAMPLED, seed=seed)),
                            draft_dists="on-rejection")

    async def work(node: EdgeNode):
        return await seeded_generations(node, prompt, n, settings_for, at_once=16)

    results = asyncio.run(on_edge(cloud.address, near_draft(target), work))
    assert not any(r.degraded or r.error for r in results)
    return results


def _assert_follows_target(results: list, target: LoadedModel) -> None:
    prompt = target.tokenizer("Once upon a time")["input_ids"]
    exact = first_tokens_distribution(target, prompt, SAMPLED, NEW_TOKENS)
    seen = Counter(tuple(r.token_ids) for r in results)
    assert set(seen) <= set(exact)
    assert chi_square_pvalue(seen, exact) > 1e-3
    # the check has power: the target's law at another temperature is told apart
    hotter = first_tokens_distribution(target, prompt, replace(SAMPLED, temperature=3.0), NEW_TOKENS)
    assert chi_square_pvalue(seen, hotter) < 1e-6


def test_on_rejection_output_follows_the_target(tiny_cloud, tiny_target) -> None:
    before = _queries(tiny_cloud, "candidates")
    results = _sampled_runs(tiny_cloud, tiny_target, 400)
    assert sum(r.stats.residual_queries for r in results) > 50, "rejections must be resolved by residual queries"
    assert _queries(tiny_cloud, "candidates") - before > 50
    _assert_follows_target(results, tiny_target)


def test_the_forced_fallback_to_the_whole_distribution_stays_exact(tiny_target) -> None:
    # one candidate, one query: many residuals come from the candidate, many from the whole distribution
    settings = CloudSettings(target="tiny-random", batch_window_ms=1, residual_candidates=1, residual_queries=1)
    with ServerThread(settings, tiny_target) as cloud:
        results = _sampled_runs(cloud, tiny_target, 400)
        full, candidates = _queries(cloud, "full"), _queries(cloud, "candidates")
    assert full > 30 and candidates > full, (full, candidates)
    _assert_follows_target(results, tiny_target)


def test_greedy_is_unchanged(tiny_cloud, tiny_target, tiny_draft) -> None:
    prompt = tiny_target.tokenizer("The quick brown fox")["input_ids"]
    reference = LocalDecoder(tiny_target, None).generate(prompt, DecodeSettings(mode="target", max_new_tokens=30))

    async def work(node: EdgeNode):
        return [await node.decoder.generate(prompt, EdgeSettings(DecodeSettings(mode="sd", max_new_tokens=30, k=3),
                                                                 draft_dists=dists))
                for dists in ("full", "on-rejection")]

    full, on_rejection = asyncio.run(on_edge(tiny_cloud.address, tiny_draft, work))
    assert full.token_ids == on_rejection.token_ids == reference.token_ids
    assert full.stats.uplink_bytes == on_rejection.stats.uplink_bytes
    assert on_rejection.stats.residual_queries == 0


def test_on_rejection_is_refused_where_the_rule_reads_every_distribution() -> None:
    for mode in ("sd-block", "sprinter-exact", "sprinter"):
        with pytest.raises(ValueError, match="reads every one"):
            EdgeSettings(DecodeSettings(mode=mode), draft_dists="on-rejection")
    with pytest.raises(ValueError, match="send-ahead"):
        EdgeSettings(DecodeSettings(mode="sd"), draft_dists="on-rejection", pipeline="send-ahead")
    with pytest.raises(ValueError, match="draft_dists"):
        EdgeSettings(DecodeSettings(mode="sd"), draft_dists="some")
    EdgeSettings(DecodeSettings(mode="sd"), draft_dists="on-rejection", pipeline="ahead")


@pytest.mark.smollm2
def test_smollm2_uplink_falls_under_3_kb_per_token(smollm2, smollm2_4_layers) -> None:
    prompts = [encode_prompt(smollm2.tokenizer, text, chat=True)
               for text in ("Write a short poem about the sea.",)]
    sampling = SamplingParams(temperature=1.0, seed=3)

    async def work(node: EdgeNode):
        return {dists: [await node.decoder.generate(p, EdgeSettings(DecodeSettings(
            mode="sd", max_new_tokens=32, k=4, sampling=sampling), draft_dists=dists)) for p in prompts]
            for dists in ("full", "on-rejection")}

    with ServerThread(CloudSettings(target="smollm2-135m", batch_window_ms=1), smollm2) as cloud:
        runs = asyncio.run(on_edge(cloud.address, smollm2_4_layers, work, runtime="onnx"))
    per_token = {dists: sum(r.stats.uplink_bytes for r in results) / sum(len(r.token_ids) for r in results)
                 for dists, results in runs.items()}
    assert not any(r.degraded or r.error for results in runs.values() for r in results)
    assert sum(r.stats.residual_queries for r in runs["on-rejection"]) > 0
    assert per_token["on-rejection"] <= 3072, per_token
    assert per_token["on-rejection"] * 10 < per_token["full"], per_token


# -- the cloud's side of the exchange, frame by frame ------------------------------------------------------------


def _rejected_verify(stream: SessionStream, start: int, outside: int) -> pb.CloudFrame:
    """A dists_on_rejection verify whose first token the target (top-3) cannot give: rejected for certain."""
    return stream.verify(start, [outside, 5], pb.METHOD_TOKEN, draft_token_probs=[0.5, 0.5], dists_on_rejection=True)


def _outside_top_k(target: LoadedModel, prompt: list[int]) -> int:
    """The token the target finds least likely after `prompt`: outside its top 3, so a draft token it rejects."""
    with torch.inference_mode():
        return int(target.model(torch.tensor([prompt])).logits[0, -1].argmin())


def _answer(stream: SessionStream, **fields) -> pb.CloudFrame:
    return stream.send(pb.EdgeFrame(residual_answer=pb.ResidualAnswer(**fields)))


def test_garbage_answers_are_refused_by_field_and_the_session_kept(tiny_cloud, tiny_target) -> None:
    prompt = tiny_target.tokenizer("Hello there")["input_ids"]
    with grpc.insecure_channel(tiny_cloud.address) as channel:
        stream = SessionStream(channel)
        opened = stream.open(prompt, sampling=pb.SamplingSettings(temperature=1.0, top_k=3, seed=1))
        length = opened.opened.context_length
        outside = _outside_top_k(tiny_target, prompt)
        assert _answer(stream, start_position=length).error.message.startswith("residual_answer without")
        garbage = [
            (dict(draft_probs=[0.1]), "residual_answer.draft_probs has 1 entries"),
            (dict(draft_probs=[2.0] * 16), "residual_answer.draft_probs must lie in [0, 1]"),
            (dict(position=1, draft_probs=[0.0] * 16), "residual_answer.start_position/position"),
            (dict(draft_probs=[float("nan")] * 16), "residual_answer.draft_probs must lie in [0, 1]"),
        ]
        for fields, message in garbage:
            query = _rejected_verify(stream, length, outside)
            assert query.WhichOneof("frame") == "residual_query", query
            assert query.residual_query.position == 0 and len(query.residual_query.candidate_ids) == 16
            answer = _answer(stream, start_position=length, **{"position": 0, **fields})
            assert answer.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], answer
            assert message in answer.error.message
            assert answer.error.context_length == length  # nothing of the refused verify was kept
        # the session goes on: a query answered well ends in a verdict after the same start
        query = _rejected_verify(stream, length, outside)
        answer = _answer(stream, start_position=length, position=0,
                         draft_probs=[0.0] * len(query.residual_query.candidate_ids))
        assert answer.WhichOneof("frame") == "verdict", answer
        assert answer.verdict.n_accepted == 0 and answer.verdict.start_position == length
        assert answer.verdict.context_length == length + 1
        stream.close()


def test_an_edge_that_leaves_mid_query_leaves_the_session_usable(tiny_cloud, tiny_target) -> None:
    prompt = tiny_target.tokenizer("Hello there")["input_ids"]
    outside = _outside_top_k(tiny_target, prompt)
    with grpc.insecure_channel(tiny_cloud.address) as channel:
        stream = SessionStream(channel)
        opened = stream.open(prompt, sampling=pb.SamplingSettings(temperature=1.0, top_k=3, seed=1))
        session_id, length = opened.opened.session_id, opened.opened.context_length
        abandoned = _queries(tiny_cloud, "abandoned")
        assert _rejected_verify(stream, length, outside).WhichOneof("frame") == "residual_query"
        # another verify instead of the answer: the waiting one is dropped, this one served from the same start
        assert _rejected_verify(stream, length, outside).WhichOneof("frame") == "residual_query"
        assert _queries(tiny_cloud, "abandoned") == abandoned + 1
        stream.abandon()
        deadline = time.monotonic() + 10
        while _queries(tiny_cloud, "abandoned") < abandoned + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _queries(tiny_cloud, "abandoned") == abandoned + 2
        resumed = SessionStream(channel)
        again = resumed.send(pb.EdgeFrame(open=pb.OpenSession(resume_session_id=session_id)))
        assert again.opened.resumed and again.opened.context_length == length
        query = _rejected_verify(resumed, length, outside)
        answer = _answer(resumed, start_position=length, position=0,
                         draft_probs=[0.0] * len(query.residual_query.candidate_ids))
        assert answer.verdict.context_length == length + 1
        resumed.close()


def test_the_cloud_refuses_dists_on_rejection_for_a_block_rule(tiny_cloud, tiny_target) -> None:
    prompt = tiny_target.tokenizer("Hello there")["input_ids"]
    with grpc.insecure_channel(tiny_cloud.address) as channel:
        stream = SessionStream(channel)
        length = stream.open(prompt, sampling=pb.SamplingSettings(temperature=1.0, seed=1)).opened.context_length
        answer = stream.verify(length, [3, 4], pb.METHOD_BLOCK, draft_token_probs=[0.5, 0.5], dists_on_rejection=True)
        assert answer.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "verify.dists_on_rejection" in answer.error.message
        answer = stream.verify(length, [3, 4], pb.METHOD_TOKEN, draft_token_probs=[0.5], dists_on_rejection=True)
        assert "verify.draft_token_probs" in answer.error.message
        stream.close()
