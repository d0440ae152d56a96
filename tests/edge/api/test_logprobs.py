"""Logprobs through the edge's OpenAI API (common/sampling/logprobs.py): the target's raw values in the lossless modes.

In every lossless mode each emitted token's logprob and its top N are the target's, of its raw distribution
(before temperature, penalties and grammar): checked against one forward of the target over the prompt and the
output, to 1e-4 in float32 on SmolLM2 over a real cloud. The draft's values come only where no target judged
the token, and `sprinter.logprob_sources` says so. Streamed and whole responses carry the same values, in
OpenAI's chat and completions shapes.
"""

from __future__ import annotations

import math

import pytest
import torch

from cloud.server import CloudSettings
from cloud_harness import ServerThread
from common.model.prompting import encode_prompt
from edge.api.app import ApiSettings, create_app
from edge_harness import EdgeDaemonThread

TOP = 3


def _client(daemon: EdgeDaemonThread):
    from openai import OpenAI
    return OpenAI(base_url=daemon.base + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tiny_edge(tiny_target, tiny_draft):
    with ServerThread(CloudSettings(target="tiny-random", batch_window_ms=1), tiny_target) as cloud:
        api = ApiSettings(default_mode="sd-block", model_name="tiny")
        with EdgeDaemonThread(tiny_draft, cloud.address, lambda node: create_app(node, api)) as daemon:
            yield daemon


def _target_logprobs(target, prompt_ids: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of the target's raw logits at each output position [len(output), V]."""
    with torch.inference_mode():
        logits = target.model(torch.tensor([prompt_ids + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(output)], dim=-1)


def _check_against_target(target, prompt_ids, token_ids, entries, tokenizer) -> None:
    expected = _target_logprobs(target, prompt_ids, token_ids)
    assert len(entries) == len(token_ids)
    for i, (token, entry) in enumerate(zip(token_ids, entries)):
        assert math.isclose(entry.logprob, float(expected[i, token]), abs_tol=1e-4), i
        top = expected[i].topk(TOP)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([t]) for t in top.indices.tolist()]
        assert all(math.isclose(t.logprob, v, abs_tol=1e-4) for t, v in zip(entry.top_logprobs, top.values.tolist()))


@pytest.mark.smollm2
@pytest.mark.parametrize("mode", ["target", "sd", "sd-block", "sprinter-exact"])
def test_chat_logprobs_are_the_targets_raw_values(smollm2, smollm2_4_layers, mode) -> None:
    question = "Name a planet."
    with ServerThread(CloudSettings(target="smollm2-135m", batch_window_ms=1), smollm2) as cloud:
        api = ApiSettings(default_mode=mode, model_name="smollm2")
        with EdgeDaemonThread(smollm2_4_layers, cloud.address, lambda node: create_app(node, api)) as daemon:
            reply = _client(daemon).chat.completions.create(
                model="x", messages=[{"role": "user", "content": question}], max_tokens=12, temperature=0,
                logprobs=True, top_logprobs=TOP, extra_body={"k": 3})
    choice = reply.choices[0]
    token_ids = reply.model_extra["sprinter"]["token_ids"]
    assert set(reply.model_extra["sprinter"]["logprob_sources"]) == {"target"}
    prompt_ids = encode_prompt(smollm2.tokenizer, question, chat=True)
    _check_against_target(smollm2, prompt_ids, token_ids, choice.logprobs.content, smollm2.tokenizer)


def test_streamed_completion_logprobs_equal_the_whole_responses(tiny_edge) -> None:
    client = _client(tiny_edge)
    kw = dict(model="tiny", prompt="The quick brown fox", max_tokens=16, temperature=0, logprobs=TOP)
    response = client.completions.create(**kw)
    whole = response.choices[0]
    assert len(whole.logprobs.tokens) == len(whole.logprobs.token_logprobs) == response.usage.completion_tokens
    assert len(whole.logprobs.top_logprobs) == response.usage.completion_tokens
    # a dict keyed by token text: byte tokens that decode alike (a split character) share a key
    assert whole.logprobs.text_offset[0] == 0 and all(1 <= len(top) <= TOP for top in whole.logprobs.top_logprobs)
    tokens, values = [], []
    for chunk in client.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
    assert tokens == whole.logprobs.tokens and values == whole.logprobs.token_logprobs


def test_tokens_no_target_judged_carry_the_drafts_values_and_say_so(tiny_edge) -> None:
    client = _client(tiny_edge)
    draft = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                           temperature=0, logprobs=True, extra_body={"mode": "draft"})
    assert set(draft.model_extra["sprinter"]["logprob_sources"]) == {"draft"}
    assert all(entry.top_logprobs == [] for entry in draft.choices[0].logprobs.content)  # top_logprobs 0: none
    lossy = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=24,
                                           temperature=0, logprobs=True, extra_body={"mode": "sprinter"})
    assert "target" in lossy.model_extra["sprinter"]["logprob_sources"]


def test_top_logprobs_without_logprobs_is_a_400(tiny_edge) -> None:
    from openai import BadRequestError
    with pytest.raises(BadRequestError) as refused:
        _client(tiny_edge).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                   top_logprobs=2)
    assert "logprobs" in refused.value.body["message"]


# --- echo: the prompt back, with the target's logprobs from its prefill --------------------------------------

@pytest.mark.smollm2
@pytest.mark.parametrize("mode", ["target", "sd-block"])
def test_echo_returns_the_prompts_logprobs_from_the_targets_prefill(smollm2, smollm2_4_layers, mode) -> None:
    prompt = "The capital of France is"
    with ServerThread(CloudSettings(target="smollm2-135m", batch_window_ms=1), smollm2) as cloud:
        api = ApiSettings(default_mode=mode, model_name="smollm2")
        with EdgeDaemonThread(smollm2_4_layers, cloud.address, lambda node: create_app(node, api)) as daemon:
            reply = _client(daemon).completions.create(model="x", prompt=prompt, max_tokens=6, temperature=0,
                                                       logprobs=TOP, echo=True)
    choice = reply.choices[0]
    prompt_ids = smollm2.tokenizer(prompt)["input_ids"]
    assert choice.text.startswith(prompt)
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    scored = choice.logprobs.token_logprobs[1:len(prompt_ids)]
    with torch.inference_mode():
        logits = smollm2.model(torch.tensor([prompt_ids])).logits[0, :-1].float()
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(len(prompt_ids) - 1), torch.tensor(prompt_ids[1:])]
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(scored, expected.tolist()))
    assert len(choice.logprobs.tokens) == len(prompt_ids) + reply.usage.completion_tokens


def test_echo_streams_the_prompt_first_and_refuses_streamed_logprobs(tiny_edge) -> None:
    from openai import BadRequestError
    client = _client(tiny_edge)
    chunks = [c.choices[0].text for c in client.completions.create(model="tiny", prompt="Hello there", max_tokens=4,
                                                                    temperature=0, echo=True, stream=True) if c.choices]
    assert chunks[0] == "Hello there"
    whole = client.completions.create(model="tiny", prompt="Hello there", max_tokens=4, temperature=0, echo=True)
    assert "".join(chunks) == whole.choices[0].text
    with pytest.raises(BadRequestError) as refused:
        client.completions.create(model="tiny", prompt="Hello", echo=True, logprobs=1, stream=True)
    assert refused.value.body["param"] == "echo"
    drafted = client.completions.create(model="tiny", prompt="Hello there", max_tokens=4, temperature=0, echo=True,
                                        logprobs=1, extra_body={"mode": "draft"})
    assert drafted.choices[0].logprobs.token_logprobs[0] is None  # the draft's prefill scored the rest
    assert all(v is not None for v in drafted.choices[0].logprobs.token_logprobs[1:])
