"""Mode cloud-sd: speculative decoding wholly in the cloud (cloud/cloud_sd.py), over a real cloud on loopback.

The cloud drafts with its own draft next to the target and block-verifies; the edge only streams. It is lossless:
greedy output equals the target's own (SmolLM2 in float32), and sampled output follows the target's law (chi-square
on the tiny pair, the cloud's draft a noisy copy of the target so that rejections and hits both happen).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace

import grpc
import pytest
import torch

from cloud.server import CloudSettings
from cloud_harness import ServerThread
from common import wire
from common.spec.local_decoder import LocalDecoder
from common.spec.modes import DecodeSettings, placed_mode
from common.model.prompting import encode_prompt
from common.sampling.distributions import SamplingParams
from common.sampling.params import GrammarSpec
from edge.decoding.decoder import EdgeSettings
from edge.node import EdgeNode
from edge_harness import on_edge
from exact_distributions import chi_square_pvalue, first_tokens_distribution, near_draft, seeded_generations
from sprinter.v1 import decoding_pb2_grpc as pb_grpc


def test_placement_moves_the_lossless_edge_modes_to_the_cloud() -> None:
    assert [placed_mode(m, "cloud") for m in ("sd", "sd-block", "sprinter-exact")] == ["cloud-sd"] * 3
    assert [placed_mode(m, "cloud") for m in ("sprinter", "target", "draft", "cloud-sd")] == \
        ["sprinter", "target", "draft", "cloud-sd"]
    assert placed_mode("sd-block", "edge") == "sd-block"
    with pytest.raises(ValueError, match="auto"):
        placed_mode("sd", "auto")


@pytest.mark.smollm2
def test_cloud_sd_greedy_equals_the_target(smollm2, smollm2_4_layers) -> None:
    prompt = encode_prompt(smollm2.tokenizer, "Write a haiku about the sea.", chat=True)
    reference = LocalDecoder(smollm2, None).generate(prompt, DecodeSettings(mode="target", max_new_tokens=24))
    settings = CloudSettings(target="smollm2-135m", draft="smollm2-135m:layers=4", batch_window_ms=1)
    with ServerThread(settings, smollm2, draft=smollm2_4_layers) as cloud:
        async def work(node: EdgeNode):
            return await asyncio.gather(*(node.decoder.generate(prompt, EdgeSettings(
                DecodeSettings(mode="cloud-sd", max_new_tokens=24, k=k))) for k in (1, 5)))

        results = asyncio.run(on_edge(cloud.address, smollm2_4_layers, work))
    for result in results:
        assert not result.degraded and result.error is None
        assert result.token_ids == reference.token_ids
        assert result.stats.block_length_mean > 0.9  # the cloud drafted (a 4-layer draft it mostly rejects)


def test_cloud_sd_sampled_output_follows_the_target(tiny_target) -> None:
    prompt = tiny_target.tokenizer("Once upon a time")["input_ids"]
    sampling = SamplingParams(temperature=1.0, top_k=4)
    exact = first_tokens_distribution(tiny_target, prompt, sampling, 3)
    draft = near_draft(tiny_target)
    exact_draft = first_tokens_distribution(draft, prompt, sampling, 3)
    n = 400
    settings = CloudSettings(target="tiny-random", draft="tiny-random", batch_window_ms=1, edge_max_generate=16)
    with ServerThread(settings, tiny_target, draft=draft) as cloud:
        def settings_for(seed: int) -> EdgeSettings:
            return EdgeSettings(DecodeSettings(mode="cloud-sd", max_new_tokens=3, k=2, sampling=replace(sampling, seed=seed)))

        results = asyncio.run(on_edge(cloud.address, tiny_target, lambda node: seeded_generations(
            node, prompt, n, settings_for, at_once=16)))
    assert not any(r.degraded or r.error for r in results)
    seen = Counter(tuple(r.token_ids) for r in results)
    assert set(seen) <= set(exact)
    assert chi_square_pvalue(seen, exact) > 1e-3
    assert chi_square_pvalue(seen, exact_draft) < 1e-6  # the check has power: the draft's own law is told apart
    rounds = sum(r.stats.target_calls for r in results)
    assert rounds < 3 * n  # drafts were accepted: fewer target forwards than tokens


def test_a_cloud_without_a_draft_refuses_to_speculate(tiny_target) -> None:
    with ServerThread(CloudSettings(target="tiny-random", max_block=8), tiny_target) as cloud:
        stub = pb_grpc.TargetServiceStub(grpc.insecure_channel(cloud.address))
        assert stub.GetInfo(wire.info_request()).draft_model_id == ""
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(wire.generate_request([1, 2, 3], SamplingParams(), 4, speculate_block=3)))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--draft" in refused.value.details()


def test_a_speculation_block_beyond_max_block_is_refused(tiny_target) -> None:
    settings = CloudSettings(target="tiny-random", draft="tiny-random", max_block=8)
    with ServerThread(settings, tiny_target, draft=tiny_target) as cloud:
        stub = pb_grpc.TargetServiceStub(grpc.insecure_channel(cloud.address))
        assert stub.GetInfo(wire.info_request()).draft_model_id == "tiny-random"
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(wire.generate_request([1, 2, 3], SamplingParams(), 4, speculate_block=9)))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "speculation.block" in refused.value.details()
        chunks = list(stub.Generate(wire.generate_request([1, 2, 3], SamplingParams(), 10, speculate_block=3)))
    # the cloud's draft is the target itself: greedy accepts every draft token, a round gives block + 1 tokens
    assert [(len(c.token_ids), c.drafted) for c in chunks] == [(4, 3), (4, 3), (2, 1), (0, 0)]
    assert chunks[-1].finish_reason == "length"


def test_cloud_sd_keeps_the_requests_logits_processing_and_logprobs(tiny_target) -> None:
    """Penalties, logit_bias, a grammar and logprobs reach both of the cloud's models: the output equals the target's
    own under the same request, and each token's logprob is the target's raw one."""
    prompt = tiny_target.tokenizer("The quick brown fox")["input_ids"]
    requests = {
        "penalties": SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.6,
                                    logit_bias=((5, 3.0), (17, -100.0)), logprobs=2),
        "json": SamplingParams(grammar=GrammarSpec("json_object"), logprobs=1),
    }
    references = {name: LocalDecoder(tiny_target, None).generate(prompt, DecodeSettings(
        mode="target", max_new_tokens=24, sampling=sampling)) for name, sampling in requests.items()}
    settings = CloudSettings(target="tiny-random", draft="tiny-random", batch_window_ms=1)
    with ServerThread(settings, tiny_target, draft=near_draft(tiny_target)) as cloud:
        async def work(node: EdgeNode):
            return {name: await node.decoder.generate(prompt, EdgeSettings(DecodeSettings(
                mode="cloud-sd", max_new_tokens=24, k=3, sampling=sampling))) for name, sampling in requests.items()}

        results = asyncio.run(on_edge(cloud.address, tiny_target, work))
    for name, result in results.items():
        assert result.token_ids == references[name].token_ids, name
        with torch.inference_mode():
            logits = tiny_target.model(torch.tensor([prompt + result.token_ids])).logits[0, len(prompt) - 1:-1]
        expected = torch.log_softmax(logits.float(), dim=-1)
        assert [e.token for e in result.logprobs] == result.token_ids
        assert all(abs(e.logprob - float(expected[i, e.token])) < 1e-4 for i, e in enumerate(result.logprobs)), name
