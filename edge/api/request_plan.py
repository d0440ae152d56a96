"""What an OpenAI request asks the decoder for, beyond its sampling fields: structured output and tools.

    response_format  {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}: the
                     output is constrained by a grammar (common/sampling/grammar.py) on the draft's proposals and in the
                     rule's target distribution, so every output parses (and validates), and the constrained
                     target's distribution is kept exactly in the lossless modes
    tools            rendered by the model's own chat template (edge/api/tool_calls.py); the reply is parsed for
                     calls. tool_choice "auto" lets the model choose, "none" parses nothing, "required" and a
                     named function constrain the reply to calls whose arguments follow the tools' schemas

Combinations that would need one constraint to give way to another are refused, each with the field named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.errors import SprinterError
from common.sampling.params import GrammarError, GrammarSpec
from edge.api.tool_calls import ToolRequestError, check_tools, tool_call_lark


class RequestRefused(SprinterError, ValueError):
    """A request this server cannot serve as asked: `param` names the field, the message says why (a 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's tools are used: rendered into the prompt, and whether the reply is parsed for calls."""

    tools: list[dict[str, Any]] | None  # what the template renders (None: no tools section)
    parse_calls: bool  # the reply's calls become `tool_calls` (tool_choice other than "none")


def grammar_of(response_format: dict[str, Any] | None) -> GrammarSpec | None:
    """The grammar OpenAI's `response_format` asks for; None for text. RequestRefused naming the field."""
    if response_format is None or response_format.get("type") == "text":
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return GrammarSpec.json_object()
    if kind != "json_schema":
        raise RequestRefused("response_format", f"response_format.type {kind!r} is none of text, json_object, "
                                                "json_schema")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise RequestRefused("response_format", 'response_format.json_schema needs "schema", a JSON schema object')
    try:
        return GrammarSpec.json_schema(spec["schema"])
    except GrammarError as err:
        raise RequestRefused("response_format", f"response_format.json_schema.schema: {err}") from None


def tool_plan(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None, grammar: GrammarSpec | None,
              tokenizer: Any = None) -> tuple[ToolPlan, GrammarSpec | None]:
    """The tools' plan and the grammar the reply then follows (the calls' one, when tool_choice requires calls)."""
    try:
        check_tools(tools, tool_choice)
    except ToolRequestError as err:
        raise RequestRefused("tool_choice" if str(err).startswith("tool_choice") else "tools", str(err)) from None
    if not tools:
        return ToolPlan(None, False), grammar
    choice = tool_choice or "auto"
    if choice == "none":
        return ToolPlan(tools, False), grammar
    if grammar is not None:
        raise RequestRefused("response_format", "response_format constrains the reply to JSON, which leaves no room "
                                                "for tool calls: send tool_choice none, or no response_format")
    named = isinstance(choice, dict)
    if parallel_tool_calls is False and not named:
        raise RequestRefused("parallel_tool_calls", "parallel_tool_calls false is kept only with a named tool_choice "
                                                    "(exactly one call): with auto or required the model may call "
                                                    "several, and none would be dropped silently")
    if choice == "auto":
        return ToolPlan(tools, True), None
    return ToolPlan(tools, True), GrammarSpec.lark(tool_call_lark(tools, choice, tokenizer))


@dataclass(frozen=True)
class RequestPlan:
    """What a request adds to its sampling fields: the grammar its output follows, and how its tools are used."""

    grammar: GrammarSpec | None = None
    grammar_field: str = "response_format"  # the field a grammar that does not compile is blamed on
    tools: ToolPlan = ToolPlan(None, False)


def plan_request(response_format: dict[str, Any] | None, tools: Any = None, tool_choice: Any = None,
                 parallel_tool_calls: bool | None = None, tokenizer: Any = None) -> RequestPlan:
    """The plan of a completion (no tools) or a chat completion; RequestRefused naming the field. `tokenizer`:
    the model's, whose own tokens a tool-call grammar names."""
    grammar = grammar_of(response_format)
    plan, constrained = tool_plan(tools, tool_choice, parallel_tool_calls, grammar, tokenizer)
    return RequestPlan(constrained, "response_format" if constrained is grammar else "tools", plan)
