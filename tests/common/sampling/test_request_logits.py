"""logit_bias and the penalties (common/sampling/logits_processing.py): vLLM's arithmetic, and lossless under speculation.

The processor is checked against a plain reference of vLLM's formulas; then every lossless mode, over a real
cloud on loopback, must reproduce the penalized target: token for token under greedy (tiny pair and SmolLM2 in
float32), and in distribution under sampling (chi-square on the first tokens of many seeded generations,
against the exact law of the transformed target). A bad value gets a 400 naming the field.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace

import pytest
import torch

from cloud.server import CloudSettings
from cloud_harness import ServerThread
from common.spec.local_decoder import LocalDecoder
from common.spec.modes import DecodeSettings
from common.sampling.logits_processing import LogitsProcessor
from common.model.loading import LoadedModel
from common.model.prompting import encode_prompt
from common.sampling.distributions import SamplingParams
from edge.decoding.decoder import EdgeSettings
from edge.node import EdgeNode
from edge_harness import on_edge
from exact_distributions import chi_square_pvalue, first_tokens_distribution, near_draft, seeded_generations

LOSSLESS = ("sd", "sd-block", "sprinter-exact")
PENALIZED = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.6,
                 logit_bias=((5, 3.0), (17, -100.0), (101, 2.5)))


def reference_rows(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """vLLM's order and counting, written out: bias, then repetition (prompt and output), frequency, presence."""
    shaped = logits.clone().double()
    for token, bias in params.logit_bias:
        shaped[token] += bias
    for token in set(prompt) | set(output):
        value = shaped[token]
        shaped[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token in set(output):
        shaped[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return shaped.float()


def test_the_processor_computes_vllms_penalties_row_by_row_along_a_block() -> None:
    params = SamplingParams(**PENALIZED)
    generator = torch.Generator().manual_seed(3)
    prompt, output, block = [1, 2, 3, 2, 9], [4, 4, 5, 17], [5, 8, 4]
    processor = LogitsProcessor(params, prompt)
    logits = torch.randn(len(block) + 1, 120, generator=generator)
    rows = processor.rows(logits, prompt + output, block)
    for i in range(len(block) + 1):
        expected = reference_rows(logits[i], params, prompt, output + block[:i])
        assert torch.allclose(rows[i], expected, atol=1e-5), i
        assert torch.equal(processor.next_row(logits[i], prompt + output + block[:i]), rows[i])
    assert not LogitsProcessor(SamplingParams(), prompt).active


def test_out_of_range_values_are_refused_by_name() -> None:
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0)):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((3, 101.0),))


@pytest.fixture(scope="module")
def tiny_cloud(tiny_target):
    with ServerThread(CloudSettings(target="tiny-random", batch_window_ms=1), tiny_target) as server:
        yield server



def _greedy_identity(cloud: ServerThread, target: LoadedModel, draft: LoadedModel, prompt: list[int],
                     sampling: SamplingParams, new_tokens: int, runtime: str = "torch") -> None:
    reference = LocalDecoder(target, None).generate(prompt, DecodeSettings(mode="target", max_new_tokens=new_tokens,
                                                                          sampling=sampling))
    plain = LocalDecoder(target, None).generate(prompt, DecodeSettings(mode="target", max_new_tokens=new_tokens))
    assert reference.token_ids != plain.token_ids, "the penalties must change this greedy output to test anything"

    async def work(node: EdgeNode):
        return {mode: await node.decoder.generate(prompt, EdgeSettings(DecodeSettings(
            mode=mode, max_new_tokens=new_tokens, k=3, sampling=sampling))) for mode in ("target", *LOSSLESS)}

    for mode, result in asyncio.run(on_edge(cloud.address, draft, work, runtime)).items():
        assert not result.degraded, mode
        assert result.token_ids == reference.token_ids, mode


def test_every_lossless_mode_equals_the_penalized_target_under_greedy(tiny_cloud, tiny_target, tiny_draft) -> None:
    prompt = tiny_target.tokenizer("The quick brown fox")["input_ids"]
    _greedy_identity(tiny_cloud, tiny_target, tiny_draft, prompt, SamplingParams(**PENALIZED), 40)


def test_local_speculative_decoding_equals_the_penalized_target(tiny_target, tiny_draft) -> None:
    prompt = tiny_target.tokenizer("The quick brown fox")["input_ids"]
    sampling = SamplingParams(**PENALIZED)
    engine = LocalDecoder(tiny_target, tiny_draft)
    reference = engine.generate(prompt, DecodeSettings(mode="target", max_new_tokens=40, sampling=sampling))
    for mode in LOSSLESS:
        result = engine.generate(prompt, DecodeSettings(mode=mode, max_new_tokens=40, k=3, sampling=sampling))
        assert result.token_ids == reference.token_ids, mode


@pytest.mark.smollm2
def test_smollm2_lossless_modes_equal_the_penalized_target(smollm2, smollm2_4_layers) -> None:
    prompt = encode_prompt(smollm2.tokenizer, "List three colours, then three more.", chat=True)
    sampling = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3,
                              logit_bias=((28, -5.0),))
    with ServerThread(CloudSettings(target="smollm2-135m", batch_window_ms=1), smollm2) as cloud:
        _greedy_identity(cloud, smollm2, smollm2_4_layers, prompt, sampling, 24, runtime="onnx")


SAMPLED = SamplingParams(temperature=1.0, top_k=3, presence_penalty=1.5, repetition_penalty=2.0,
                         logit_bias=((65, 2.0),))
NEW_TOKENS = 3


@pytest.mark.parametrize("mode", ["sd", "sd-block"])
def test_sampled_output_follows_the_penalized_target(tiny_cloud, tiny_target, mode) -> None:
    prompt = tiny_target.tokenizer("Once upon a time")["input_ids"]
    exact = first_tokens_distribution(tiny_target, prompt, SAMPLED, NEW_TOKENS)
    unpenalized = first_tokens_distribution(tiny_target, prompt, SamplingParams(temperature=1.0, top_k=3), NEW_TOKENS)
    n = 300

    def settings_for(seed: int) -> EdgeSettings:
        return EdgeSettings(DecodeSettings(mode=mode, max_new_tokens=NEW_TOKENS, k=2,
                                           sampling=replace(SAMPLED, seed=seed)))

    async def work(node: EdgeNode):
        return await seeded_generations(node, prompt, n, settings_for, at_once=16)

    results = asyncio.run(on_edge(tiny_cloud.address, near_draft(tiny_target), work))
    assert not any(r.degraded for r in results)
    seen = Counter(tuple(r.token_ids) for r in results)
    cells = sorted(set(exact) | set(unpenalized))
    assert set(seen) <= set(exact)
    assert chi_square_pvalue(seen, exact) > 1e-3
    # the check has power: the unpenalized target's law is told apart
    assert any(seen[c] and not unpenalized.get(c) for c in cells) or chi_square_pvalue(seen, unpenalized) < 1e-6


def test_the_vllm_engine_runs_each_feature_exactly_or_refuses_it() -> None:
    """Penalties, bias, a grammar and logprobs need every row's whole vocabulary from vLLM (K = V, within
    --max-logprobs); repetition_penalty scales raw logits, which vLLM's logprobs cannot give: refused."""
    import grpc

    from cloud.engine import TargetInfo
    from cloud.errors import CloudError
    from cloud.vllm_engine import VllmEngine, VllmOptions
    from common.sampling.params import GrammarSpec

    def engine(max_logprobs: int) -> VllmEngine:
        return VllmEngine(None, TargetInfo("x", 300, frozenset({0}), "f"), VllmOptions("x", max_logprobs=max_logprobs),
                          metrics=None)

    wants_rows = [SamplingParams(presence_penalty=0.5), SamplingParams(logit_bias=((3, 1.0),)),
                  SamplingParams(grammar=GrammarSpec.json_object()), SamplingParams(logprobs=2),
                  SamplingParams(prompt_logprobs=0)]
    for sampling in wants_rows:
        assert engine(64).support(sampling) == 300
        with pytest.raises(CloudError) as refused:
            engine(64).check_sampling(sampling)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "whole vocabulary" in str(refused.value)
        engine(300).check_sampling(sampling)  # the whole vocabulary within --max-logprobs: exact
    with pytest.raises(CloudError, match="repetition_penalty"):
        engine(300).check_sampling(SamplingParams(repetition_penalty=1.2))
    assert engine(64).support(SamplingParams()) == 1  # plain greedy still reads the argmax alone


def test_the_api_takes_penalties_and_bias_streamed_or_not(tiny_cloud, tiny_draft) -> None:
    from openai import OpenAI

    from edge.api.app import ApiSettings, create_app
    from edge_harness import EdgeDaemonThread

    fields = {"presence_penalty": 0.7, "frequency_penalty": 0.4, "logit_bias": {"5": 3.0, "17": -100},
              "extra_body": {"repetition_penalty": 1.6, "k": 3}}
    with EdgeDaemonThread(tiny_draft, tiny_cloud.address,
                          lambda node: create_app(node, ApiSettings(default_mode="sd-block"))) as daemon:
        client = OpenAI(base_url=daemon.base + "/v1", api_key="unused", max_retries=0)
        kw = dict(model="x", prompt="The quick brown fox", max_tokens=24, temperature=0, **fields)
        whole = client.completions.create(**kw)
        streamed = [c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices]
        target = client.completions.create(**{**kw, "extra_body": {**fields["extra_body"], "mode": "target"}})
        plain = client.completions.create(model="x", prompt="The quick brown fox", max_tokens=24, temperature=0)
    assert whole.choices[0].text == "".join(streamed) == target.choices[0].text != plain.choices[0].text
    assert 17 not in whole.model_extra["sprinter"]["token_ids"]  # a bias of -100 bars it
