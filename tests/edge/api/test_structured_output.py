"""Structured output and tools through the edge's OpenAI API, lossless under speculation.

A grammar's mask constrains the draft's proposals and the target's rows in the rule, so every lossless mode
reproduces the constrained target: token for token under greedy (tiny pair over a real cloud; SmolLM2 in
float32), and in law under sampling (chi-square on the first tokens against the exact constrained target).
Every output that ends validates against its schema (random schemas from a small generator, decoded by the
real decoder). Tools render through the model's own template; required and named calls are constrained by
the tools' schemas and come back as `tool_calls`, streamed as OpenAI streams them.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import replace

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings

from cloud.server import CloudSettings
from cloud_harness import ServerThread
from common.spec.local_decoder import LocalDecoder
from common.spec.modes import DecodeSettings
from common.sampling.distributions import SamplingParams
from common.sampling.params import GrammarSpec
from edge.api.app import ApiSettings, create_app
from edge.decoding.decoder import EdgeSettings
from edge.node import EdgeNode, EdgeNodeSettings
from edge_harness import EdgeDaemonThread
from exact_distributions import chi_square_pvalue, first_tokens_distribution, near_draft, seeded_generations
from tests.common.sampling.test_grammar import SCHEMAS

LOSSLESS = ("sd", "sd-block", "sprinter-exact")
TINY_EOS = 256
FLAGS = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]},
                                          "count": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["ok", "size", "count"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Oslo", "Lima"]}, "unit": {"enum": ["C", "F"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tiny_cloud(tiny_target):
    with ServerThread(CloudSettings(target="tiny-random", batch_window_ms=1), tiny_target) as server:
        yield server


@pytest.fixture(scope="module")
def edge(tiny_cloud, tiny_draft):
    api = ApiSettings(default_mode="sd-block", model_name="tiny")
    with EdgeDaemonThread(tiny_draft, tiny_cloud.address, lambda node: create_app(node, api)) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def client(edge):
    from openai import OpenAI
    return OpenAI(base_url=edge.base + "/v1", api_key="unused", max_retries=0)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_json_schema_output_equals_the_constrained_target_in_every_mode(client) -> None:
    def ask(mode: str, stream: bool = False, pipeline: str = "off") -> str:
        kw = dict(model="tiny", messages=[{"role": "user", "content": "Describe a shirt"}], temperature=0,
                  max_tokens=60, response_format=_schema_format(FLAGS),
                  extra_body={"mode": mode, "k": 3, "pipeline": pipeline})
        if not stream:
            return client.chat.completions.create(**kw).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)

    reference = ask("target")
    jsonschema.validate(json.loads(reference), FLAGS)
    for mode in (*LOSSLESS, "draft"):
        text = ask(mode)
        jsonschema.validate(json.loads(text), FLAGS)  # the draft alone too: its proposals are masked
        assert mode == "draft" or text == reference, mode
    assert ask("sd-block", stream=True) == reference
    for pipeline in ("ahead", "send-ahead"):  # drafting ahead on a guessed verdict rolls the grammar back and forth
        assert ask("sprinter-exact", pipeline=pipeline) == reference, pipeline


def test_json_object_on_completions_parses(client) -> None:
    choice = client.completions.create(model="tiny", prompt="Data:", temperature=0, max_tokens=200,
                                       extra_body={"response_format": {"type": "json_object"}}).choices[0]
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.text), dict)


@pytest.mark.parametrize("response_format, words", [
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}, "strnig"),
    ({"type": "yaml"}, "yaml")])
def test_a_bad_response_format_is_a_400_naming_it(client, response_format, words) -> None:
    from openai import BadRequestError
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       response_format=response_format)
    assert refused.value.body["param"] == "response_format" and words in refused.value.body["message"]


# --- sampling: the constrained target's law ---------------------------------------------------------------

LETTERS = GrammarSpec.lark('start: ("a" | "b" | "c" | "d")+')
NEW_TOKENS = 3


@pytest.mark.parametrize("mode", ["sd", "sd-block"])
def test_sampled_output_follows_the_constrained_target(tiny_cloud, tiny_target, mode) -> None:
    sampling = SamplingParams(temperature=1.0, grammar=LETTERS)
    prompt = tiny_target.tokenizer("Once upon a time")["input_ids"]
    exact = first_tokens_distribution(tiny_target, prompt, sampling, NEW_TOKENS)
    n = 400

    def settings_for(seed: int) -> EdgeSettings:
        return EdgeSettings(DecodeSettings(mode=mode, max_new_tokens=NEW_TOKENS, k=2,
                                           sampling=replace(sampling, seed=seed)))

    node_settings = EdgeNodeSettings(draft="tiny-random", cloud=tiny_cloud.address, draft_runtime="torch",
                                     dtype="float32", verifier="confidence:0.3")

    async def on_edge():
        async with EdgeNode(node_settings, near_draft(tiny_target)) as node:
            return await seeded_generations(node, prompt, n, settings_for, at_once=16)

    results = asyncio.run(on_edge())
    assert not any(r.degraded for r in results)
    seen = Counter(tuple(r.token_ids) for r in results)
    assert set(seen) <= set(exact)
    assert chi_square_pvalue(seen, exact) > 1e-3
    # the check has power: a uniform law over the same cells is told apart
    assert chi_square_pvalue(seen, {c: 1.0 for c in exact if exact[c] > 0}) < 1e-6


# --- property: every finished output validates -------------------------------------------------------------

@pytest.fixture(scope="module")
def local_pair(tiny_target, tiny_draft) -> LocalDecoder:
    return LocalDecoder(tiny_target, tiny_draft)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                    HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS)
def test_every_finished_output_validates_against_its_random_schema(local_pair, tiny_target, schema) -> None:
    prompt = tiny_target.tokenizer("JSON:")["input_ids"]
    sampling = SamplingParams(temperature=1.0, seed=7, grammar=GrammarSpec.json_schema(schema))
    result = local_pair.generate(prompt, DecodeSettings(mode="sd-block", max_new_tokens=400, k=4, sampling=sampling))
    if result.token_ids[-1] in tiny_target.eos_token_ids:
        jsonschema.validate(json.loads(result.text), schema)
    else:  # a random model may wander inside long strings and numbers: then it ran out of tokens, cut mid-JSON
        assert len(result.token_ids) == 400


# --- tools --------------------------------------------------------------------------------------------------

def _ask_tools(client, tool_choice, stream: bool = False, mode: str = "sd-block", end_when_allowed: bool = False):
    """A greedy random model may call again and again ("required" allows one or more calls): `end_when_allowed`
    lifts EOS by logit_bias, so the reply ends as soon as the grammar lets it (after the first call)."""
    extra = {"mode": mode, **({"logit_bias": {str(TINY_EOS): 100}} if end_when_allowed else {})}
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Oslo?"}], temperature=0,
              max_tokens=200, tools=[WEATHER, CLOCK], tool_choice=tool_choice, extra_body=extra)
    return client.chat.completions.create(stream=stream, **kw) if stream else client.chat.completions.create(**kw)


def test_a_named_tool_choice_returns_that_call_with_valid_arguments(client) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = _ask_tools(client, named)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert _ask_tools(client, named, mode="target").choices[0].message.tool_calls[0].function.arguments == \
        call.function.arguments  # lossless: the constrained target's own call


def test_required_tool_calls_stream_as_openai_streams_them(client) -> None:
    whole = _ask_tools(client, "required", end_when_allowed=True).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
    names, arguments, finish = {}, {}, None
    for chunk in _ask_tools(client, "required", stream=True, end_when_allowed=True):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for call in chunk.choices[0].delta.tool_calls or []:
            if call.function.name:
                names[call.index] = call.function.name
            arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
    assert finish == "tool_calls"
    assert [names[i] for i in sorted(names)] == [c.function.name for c in whole.message.tool_calls]
    assert [arguments[i] for i in sorted(arguments)] == [c.function.arguments for c in whole.message.tool_calls]


def test_a_conversation_with_calls_and_tool_results_is_accepted(client) -> None:
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=8,
                                           temperature=0, tool_choice="none")
    assert reply.choices[0].message.tool_calls is None


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "auto", "parallel_tool_calls": False}, "parallel_tool_calls")])
def test_tool_mistakes_are_a_400_naming_the_field(client, body, param) -> None:
    from openai import BadRequestError
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], **body}
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(**request)
    assert refused.value.body["param"] == param


@pytest.mark.smollm2
def test_a_model_without_a_tools_template_refuses_tools(smollm2) -> None:
    from openai import BadRequestError, OpenAI
    with EdgeDaemonThread(smollm2, None, lambda node: create_app(node, ApiSettings(default_mode="draft"))) as daemon:
        client = OpenAI(base_url=daemon.base + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(BadRequestError) as refused:
            client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER])
        assert refused.value.body["param"] == "tools" and "tools section" in refused.value.body["message"]


@pytest.mark.smollm2
def test_smollm2_json_schema_output_is_the_constrained_targets_and_validates(smollm2, smollm2_4_layers) -> None:
    from openai import OpenAI
    person = {"type": "object", "additionalProperties": False, "required": ["name", "age", "student"],
              "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 99},
                             "student": {"type": "boolean"}}}
    with ServerThread(CloudSettings(target="smollm2-135m", batch_window_ms=1), smollm2) as cloud:
        api = ApiSettings(default_mode="sd-block", model_name="smollm2")
        with EdgeDaemonThread(smollm2_4_layers, cloud.address, lambda node: create_app(node, api)) as daemon:
            client = OpenAI(base_url=daemon.base + "/v1", api_key="unused", max_retries=0)
            texts = {mode: client.chat.completions.create(
                model="x", messages=[{"role": "user", "content": "Describe a student as JSON."}], temperature=0,
                max_tokens=48, response_format=_schema_format(person), extra_body={"mode": mode, "k": 4},
            ).choices[0].message.content for mode in ("target", *LOSSLESS)}
    jsonschema.validate(json.loads(texts["target"]), person)
    assert all(text == texts["target"] for text in texts.values()), texts
