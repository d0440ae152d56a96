"""`--mode auto` switching within a request (edge/decoding/mode_switch.py), over a real cloud on loopback.

A placer that switches by force every few tokens, through the target alone, speculation on the edge and in the cloud,
makes the switches deterministic: greedy output in float32 is the target's own, token for token (the tiny pair and
SmolLM2-135M with its 4-layer draft), streamed or not,
with a pipeline sending candidates ahead at the switch, with logprobs, a stop string and max_tokens; sampled output
at T=1 follows the target's law over the first tokens (chi-square, fixed seeds). The real placer switches on its
own when what it measures during the request changes its prediction by more than the margin. Through the API a
streamed response after switches carries each token once and `sprinter.decision.switches` lists every choice.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass, replace

import httpx
import pytest
import torch

from cloud.server import CloudSettings
from cloud_harness import ServerThread
from common.model.prompting import encode_prompt
from common.sampling.distributions import SamplingParams
from common.sampling.params import GrammarSpec
from common.spec.generation import Released
from common.spec.local_decoder import LocalDecoder
from common.spec.modes import DecodeSettings
from edge.api.app import ApiSettings, create_app
from edge.decoding.decoder import EdgeSettings
from edge.decoding.mode_switch import segment_seed, segment_settings
from edge.decoding.placer import EdgeYield, Placed, Placer, option_mode
from edge.node import EdgeNode
from edge_harness import EdgeDaemonThread, on_edge
from exact_distributions import chi_square_pvalue, first_tokens_distribution, near_draft, seeded_generations

ROUND_ROBIN = ("target", "cloud", "edge")


@dataclass
class Alternating(Placer):
    """Forces a switch at the first boundary of every `every` tokens, through `order`; the prediction is the real one,
    the reason "forced"."""

    order: tuple[str, ...] = ROUND_ROBIN
    every: int = 3

    def choose_mode(self, mode: str, k: int, max_tokens: int, cost_model, cloud, current: str | None,
                    at_token: int = 0, prompt_tokens: int = 0, own: EdgeYield = EdgeYield()) -> Placed:
        real = super().choose_mode(mode, k, max_tokens, cost_model, cloud, current, at_token, prompt_tokens, own)
        option = self.order[(at_token // self.every) % len(self.order)]
        return replace(real, used=option, mode=option_mode(mode, option),
                       decision=replace(real.decision, placement=option, reason="forced"))


@dataclass
class SlowingTarget(Placer):
    """The real placer, told that the target's decode step turned 1 s after its first `after` steps."""

    after: int = 4
    steps: int = 0

    def observe_target_step(self, step_ms: float, first: bool, prompt_tokens: int = 0) -> None:
        self.steps += 1
        super().observe_target_step(1000.0 if self.steps > self.after else step_ms, first, prompt_tokens)


@pytest.fixture(scope="module")
def drafting_cloud(tiny_target):  # a cloud with a draft of its own: cloud-sd is an option
    settings = CloudSettings(target="tiny-random", draft="tiny-random", batch_window_ms=1, dtype="float32")
    with ServerThread(settings, tiny_target, draft=near_draft(tiny_target, seed=11), cost_table=True) as cloud:
        yield cloud


def _auto(max_new_tokens: int, sampling: SamplingParams = SamplingParams(), **fields) -> EdgeSettings:
    return EdgeSettings(DecodeSettings(mode="sprinter-exact", max_new_tokens=max_new_tokens, k=3, sampling=sampling),
                        chooses_mode=True, **fields)


def _check_switches(result, at_least: int) -> list[dict]:
    switches = result.placed.switches()
    assert len(switches) >= at_least and switches[0]["at_token"] == 0
    assert [s["at_token"] for s in switches] == sorted({s["at_token"] for s in switches})  # increasing, one each
    assert all(0 <= s["at_token"] < len(result.token_ids) for s in switches)
    assert all(a["mode"] != b["mode"] for a, b in zip(switches, switches[1:]))  # each a change
    assert all(set(s["predicted_tokens_per_s"]) == {"target", "sprinter-exact", "cloud-sd"} for s in switches)
    return switches


def test_a_segment_past_token_0_gets_a_fresh_reproducible_seed_and_its_modes_settings() -> None:
    asked = _auto(16, SamplingParams(temperature=1.0, seed=5, prompt_logprobs=2), pipeline="send-ahead")
    assert segment_seed(5, 7) == segment_seed(5, 7) and len({segment_seed(5, n) for n in (1, 2, 3)}) == 3
    assert segment_seed(5, 1) not in (5, 6) and segment_seed(6, 1) != segment_seed(5, 1)
    first = segment_settings(asked, Placed("auto", "edge", "sprinter-exact"))
    assert first == asked  # token 0: the request's own settings
    later = segment_settings(asked, Placed("auto", "target", "target", at_token=4))
    assert later.decode.mode == "target" and later.decode.policy is None and later.draft_dists == "full"
    assert later.decode.sampling.seed == segment_seed(5, 4) and later.decode.sampling.prompt_logprobs is None
    assert later.decode.sampling.temperature == 1.0 and later.decode.max_new_tokens == 16


@pytest.mark.parametrize("pipeline", ["off", "send-ahead"])
def test_forced_switches_through_every_mode_keep_the_targets_greedy_output(drafting_cloud, tiny_target, tiny_draft,
                                                                          pipeline) -> None:
    prompt = tiny_target.tokenizer("Once upon a time")["input_ids"]
    sampling = SamplingParams(logprobs=2)
    reference = LocalDecoder(tiny_target, None).generate(prompt, DecodeSettings(mode="target", max_new_tokens=30,
                                                                                 sampling=sampling))
    streamed: list[Released] = []

    async def work(node: EdgeNode):
        node.decoder.placer = Alternating()
        whole = await node.decoder.generate(prompt, _auto(30, sampling, pipeline=pipeline))
        async for item in node.decoder.stream(prompt, _auto(30, sampling, pipeline=pipeline)):
            streamed.append(item)
        return whole

    result = asyncio.run(on_edge(drafting_cloud.address, tiny_draft, work))
    last = streamed.pop()
    assert not result.degraded and result.error is None and result.finish_reason == "length"
    assert result.token_ids == reference.token_ids == last.token_ids
    assert [t for item in streamed for t in item.tokens] == reference.token_ids  # each token once, in order
    assert [e.token for e in result.logprobs] == result.token_ids
    with torch.inference_mode():
        logits = tiny_target.model(torch.tensor([prompt + result.token_ids])).logits[0, len(prompt) - 1:-1]
    expected = torch.log_softmax(logits.float(), dim=-1)
    assert all(abs(e.logprob - float(expected[i, e.token])) < 1e-4 for i, e in enumerate(result.logprobs))
    modes = {s["mode"] for s in _check_switches(result, 4)}
    assert modes == {"target", "sprinter-exact", "cloud-sd"}
    assert result.placed.describe()["switches"] == len(result.placed.switches()) - 1


@pytest.mark.parametrize("sampling", [
    SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.6, logit_bias=((5, 3.0),)),
    SamplingParams(grammar=GrammarSpec("json_object")),
], ids=["penalties", "json"])
def test_penalties_and_a_grammar_carry_across_switches(drafting_cloud, tiny_target, tiny_draft, sampling) -> None:
    """Penalties count the completion and a grammar constrains it whichever mode made its tokens."""
    prompt = tiny_target.tokenizer("The quick brown fox")["input_ids"]
    reference = LocalDecoder(tiny_target, None).generate(prompt, DecodeSettings(mode="target", max_new_tokens=24,
                                                                                 sampling=sampling))

    async def work(node: EdgeNode):
        node.decoder.placer = Alternating(every=2)
        return await node.decoder.generate(prompt, _auto(24, sampling))

    result = asyncio.run(on_edge(drafting_cloud.address, tiny_draft, work))
    assert not result.degraded and result.error is None and result.token_ids == reference.token_ids
    _check_switches(result, 2)  # (the json object closes in 3 tokens: one switch)


@pytest.mark.smollm2
def test_smollm2_with_forced_switches_equals_the_target(smollm2, smollm2_4_layers) -> None:
    prompt = encode_prompt(smollm2.tokenizer, "Write a haiku about the sea.", chat=True)
    reference = LocalDecoder(smollm2, None).generate(prompt, DecodeSettings(mode="target", max_new_tokens=40))
    settings = CloudSettings(target="smollm2-135m", draft="smollm2-135m:layers=4", batch_window_ms=1, cost_table="off")

    async def work(node: EdgeNode):
        node.decoder.placer = Alternating(every=5)
        return await node.decoder.generate(prompt, _auto(40, pipeline="send-ahead"))

    with ServerThread(settings, smollm2, draft=smollm2_4_layers) as cloud:
        result = asyncio.run(on_edge(cloud.address, smollm2_4_layers, work))
    assert not result.degraded and result.error is None and result.token_ids == reference.token_ids
    assert {s["mode"] for s in _check_switches(result, 4)} == {"target", "sprinter-exact", "cloud-sd"}


def test_a_stop_string_ends_the_generation_in_whichever_mode_it_falls(drafting_cloud, tiny_target, tiny_draft):
    prompt = tiny_target.tokenizer("Once upon a time")["input_ids"]
    reference = LocalDecoder(tiny_target, None).generate(prompt, DecodeSettings(mode="target", max_new_tokens=30))
    text = tiny_target.tokenizer.decode(reference.token_ids, skip_special_tokens=True)
    stop = text[len(text) * 2 // 3:][:3]  # late enough that switches come first
    expected = text[:text.find(stop)]

    async def work(node: EdgeNode):
        node.decoder.placer = Alternating(every=2)
        return await node.decoder.generate(prompt, _auto(30, stop=(stop,)))

    result = asyncio.run(on_edge(drafting_cloud.address, tiny_draft, work))
    assert result.text == expected and result.finish_reason == "stop"
    assert result.token_ids == reference.token_ids[:len(result.token_ids)]
    _check_switches(result, 2)


def test_a_cloud_lost_mid_request_degrades_the_segment_running_and_ends_the_switching(tiny_target, tiny_draft):
    """From the first token served by the draft alone no switch comes: the segment running goes on degraded."""
    prompt = tiny_target.tokenizer("Once upon a time")["input_ids"]
    no_eos = tuple((token, -100.0) for token in tiny_target.eos_token_ids)  # the draft goes on to max_tokens
    sampling = SamplingParams(logit_bias=no_eos)
    reference = LocalDecoder(tiny_target, None).generate(prompt, DecodeSettings(mode="target", max_new_tokens=40,
                                                                                 sampling=sampling))
    cloud = ServerThread(CloudSettings(target="tiny-random", batch_window_ms=1, dtype="float32", drain_s=0.2),
                         tiny_target, cost_table=True).__enter__()
    made: list[int] = []
    killed: list[int] = []
    degraded_at: list[int] = []

    def emit(released: Released) -> None:
        made.extend(released.tokens)
        if len(made) >= 8 and not killed:
            killed.append(len(made))
            cloud.__exit__(None, None, None)  # the cloud goes away mid-request, whichever mode runs then

    async def work(node: EdgeNode):
        node.decoder.placer = Alternating(order=("target", "edge"), every=3)
        return await node.decoder.generate(prompt, _auto(40, sampling, cloud_retry_s=30.0), emit=emit,
                                           on_degraded=lambda reason: degraded_at.append(len(made)))

    result = asyncio.run(on_edge(cloud.address, tiny_draft, work))
    assert result.degraded_reason == "cloud_unreachable" and len(result.token_ids) == 40 == len(made)
    assert result.token_ids == made  # each token once, in order
    switches = result.placed.switches()
    assert result.token_ids[:switches[-1]["at_token"]] == reference.token_ids[:switches[-1]["at_token"]]
    # (a chunk the cloud sent before it went may still bring a switch: the loss is not known yet)
    assert degraded_at and killed[0] <= degraded_at[0] and all(s["at_token"] <= degraded_at[0] for s in switches)


def test_the_placer_switches_on_its_own_when_the_target_turns_slow_mid_request(tiny_target, tiny_draft) -> None:
    prompt = tiny_target.tokenizer("Once upon a time")["input_ids"]
    reference = LocalDecoder(tiny_target, None).generate(prompt, DecodeSettings(mode="target", max_new_tokens=24))
    cloud_settings = CloudSettings(target="tiny-random", batch_window_ms=1, dtype="float32")  # no draft of its own

    async def work(node: EdgeNode):
        placer = node.decoder.placer = SlowingTarget()
        for _ in range(8):  # the target fast, the edge's rounds slow: the target alone first
            Placer.observe_target_step(placer, 0.5, first=False)
        node.decoder.cost_model.observe_rtt(50.0)
        return await node.decoder.generate(prompt, _auto(24))

    with ServerThread(cloud_settings, tiny_target, cost_table=True) as cloud:
        result = asyncio.run(on_edge(cloud.address, tiny_draft, work))
    assert not result.degraded and result.token_ids == reference.token_ids
    first, switch, *rest = result.placed.switches()
    assert (first["mode"], switch["mode"], rest) == ("target", "sprinter-exact", [])
    assert switch["reason"] != "kept" and 4 < switch["at_token"] < 24  # (no_cloud_draft: cloud-sd was no option)
    rates = switch["predicted_tokens_per_s"]
    assert rates["sprinter-exact"] > 1.15 * rates["target"]  # the margin: a switch only for a clear gain


def test_sampled_output_across_forced_switches_follows_the_target(drafting_cloud, tiny_target) -> None:
    prompt = tiny_target.tokenizer("Once upon a time")["input_ids"]
    sampled = SamplingParams(temperature=1.0, top_k=2)
    new_tokens, n = 4, 300
    exact = first_tokens_distribution(tiny_target, prompt, sampled, new_tokens)
    draft = near_draft(tiny_target)

    def settings_for(seed: int) -> EdgeSettings:
        return _auto(new_tokens, replace(sampled, seed=seed))

    async def work(node: EdgeNode):
        results = []
        # every token the next mode: the target for a token, then cloud-sd or the edge, then what the order says
        for order in (("target", "cloud", "edge"), ("target", "edge", "cloud")):
            node.decoder.placer = Alternating(order=order, every=1)
            results += await seeded_generations(node, prompt, n // 2, settings_for, at_once=8)
        return results

    results = asyncio.run(on_edge(drafting_cloud.address, draft, work))
    assert not any(r.degraded or r.error for r in results)
    runs = Counter(s["mode"] for r in results for s in r.placed.switches()[1:])
    assert runs["cloud-sd"] > n // 3 and runs["sprinter-exact"] > n // 3 and runs["target"] > n // 10
    seen = Counter(tuple(r.token_ids) for r in results)
    assert set(seen) <= set(exact)
    assert chi_square_pvalue(seen, exact) > 1e-3
    # the check has power: the draft's own law is told apart
    assert chi_square_pvalue(seen, first_tokens_distribution(draft, prompt, sampled, new_tokens)) < 1e-6


def test_a_streamed_response_after_switches_carries_each_token_once_and_lists_the_switches(drafting_cloud,
                                                                                          tiny_draft) -> None:
    def app(node: EdgeNode):
        node.decoder.placer = Alternating()
        return create_app(node, ApiSettings(model_name="tiny"))

    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0, "mode": "auto"}
    with EdgeDaemonThread(tiny_draft, drafting_cloud.address, app) as edge:
        whole = httpx.post(edge.base + "/v1/completions", json=body, timeout=60).json()
        text, usage = "", None
        with httpx.stream("POST", edge.base + "/v1/completions", timeout=60,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: "):])
                    text += "".join(choice["text"] for choice in chunk["choices"])
                    usage = chunk.get("usage") or usage
        metrics = httpx.get(edge.base + "/metrics").text
    assert text == whole["choices"][0]["text"]
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"] == 20
    switches = whole["sprinter"]["decision"]["switches"]
    assert len(switches) >= 3 and [s["mode"] for s in switches[:2]] == ["target", "cloud-sd"]
    assert 'sprinter_edge_mode_switches_total{mode="cloud-sd"}' in metrics
