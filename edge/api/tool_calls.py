"""OpenAI tools on the model's own chat template: rendering, parsing, streaming, and the grammar of a call.

The format is Hermes's, as Qwen2.5 was trained on: the chat template lists the tools in its system turn, and
the model calls one by writing

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

possibly several times in one reply (a newline between calls), possibly after some text. Supported:

- `supports_tools` / `render_chat`: OpenAI chat messages (with assistant `tool_calls` and `tool` results)
  rendered through the tokenizer's own template. A template without a tools section is refused
  (`ToolsUnsupported`): no template is ever invented for a model, as a model never trained on tools would
  only imitate the format.
- `parse_tool_calls` / `ToolCallStream`: a reply's calls, whole or as OpenAI chat chunk deltas.
- `tool_call_lark`: a Lark grammar (llguidance's dialect) forcing `tool_choice` "required" (one or more
  calls) or a named function (exactly one call), each call's arguments held to its tool's JSON schema.
- `check_tools`: the request's `tools` and `tool_choice` checked before anything runs.

`tool_choice` "auto" needs no grammar (the model chooses) and "none" renders the tools but parses no calls;
both are the API's to apply. A call whose JSON does not parse, or lacks a name, stays content: calls are
never invented.
"""

from __future__ import annotations

import copy
import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase

from common.errors import SprinterError

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_CALL_PATTERN = re.compile(re.escape(CALL_OPEN) + "(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
# OpenAI's rule for function names; it also keeps a name safe to paste into a grammar's string literal.
_NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
_PROBE_TOOL_NAME = "sprinter_probe_tool_q7x"
_CHOICES = ("none", "auto", "required")


class ToolsUnsupported(SprinterError, ValueError):
    """The model's chat template has no tools section, so the model cannot be asked to call tools."""


class ToolRequestError(SprinterError, ValueError):
    """A request's `tools` or `tool_choice` is malformed; the message names the field."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: `arguments` is the JSON text of an object, as OpenAI's API carries it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id(rng: random.Random | None = None) -> str:
    """'call_' and 24 hex digits; from `rng` when given (reproducible), else from the random module."""
    return "call_" + f"{(rng or random).getrandbits(96):024x}"


# ----------------------------------------------------------------------------------------------- rendering


def _template_key(tokenizer: PreTrainedTokenizerBase) -> str:
    return repr(getattr(tokenizer, "chat_template", None))


_SUPPORT_BY_TEMPLATE: dict[str, bool] = {}


def supports_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template renders the `tools` it is given (a template that ignores them
    does not support them). Answered once per template."""
    key = _template_key(tokenizer)
    if key not in _SUPPORT_BY_TEMPLATE:
        probe = {"type": "function", "function": {
            "name": _PROBE_TOOL_NAME, "description": "probe", "parameters": {"type": "object", "properties": {}}}}
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe], tokenize=False,
                                                 add_generation_prompt=True)
        except (ValueError, jinja2.TemplateError):  # no chat template at all, or one that refuses tools
            text = ""
        _SUPPORT_BY_TEMPLATE[key] = _PROBE_TOOL_NAME in str(text)
    return _SUPPORT_BY_TEMPLATE[key]


def _text_of(content: Any) -> str:
    """OpenAI content: a string, None (an assistant turn that only calls tools), or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def _arguments_for_template(arguments: Any) -> Any:
    """HF templates (Qwen2.5's among them) write `arguments | tojson`: a JSON string would come out quoted
    twice, so it goes in as the object it encodes. Text that is no JSON stays text."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    converted = copy.deepcopy(message)
    converted["content"] = _text_of(message.get("content"))
    calls = message.get("tool_calls")
    if calls:
        converted["tool_calls"] = [
            {"id": call.get("id"), "type": "function",
             "function": {"name": call["function"]["name"],
                          "arguments": _arguments_for_template(call["function"].get("arguments", "{}"))}}
            for call in calls
        ]
    elif "tool_calls" in converted:
        del converted["tool_calls"]  # None or [] would read as "has calls" in some templates
    return converted


def _uses_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    return bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The prompt's token ids (with the generation prompt) for OpenAI chat `messages` and `tools`.
    Raises ToolsUnsupported when tools (or a history of calls) meet a template without a tools section."""
    if _uses_tools(messages, tools) and not supports_tools(tokenizer):
        raise ToolsUnsupported(
            f"this model's chat template ({type(tokenizer).__name__} {tokenizer.name_or_path!r}) has no tools "
            "section: the model was not trained to call tools; send the request without tools and tool messages"
        )
    converted = [_template_message(m) for m in messages]
    ids = tokenizer.apply_chat_template(converted, tools=tools or None, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    return list(ids)


# ----------------------------------------------------------------------------------------------- parsing


def _call_of(body: str, rng: random.Random | None) -> ToolCall | None:
    """The call a tag's body holds, or None when it is no call (then the tag stays content)."""
    try:
        payload = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
        return None
    arguments = payload.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(rng), payload["name"], json.dumps(arguments, ensure_ascii=False))


def _content_of(segments: list[str]) -> str | None:
    """The text around the calls; a stretch of whitespace between calls is layout, not content."""
    return "".join(s for s in segments if s.strip()) or None


def parse_tool_calls(text: str, rng: random.Random | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole reply. Content is the text outside the calls, None when only whitespace;
    a tag whose body is not a call's JSON stays in the content, as does an unclosed tag."""
    segments, calls, segment, position = [], [], "", 0
    for match in _CALL_PATTERN.finditer(text):
        call = _call_of(match.group(1), rng)
        segment += text[position:match.start()]
        if call is None:
            segment += match.group(0)
        else:
            segments.append(segment)
            calls.append(call)
            segment = ""
        position = match.end()
    segments.append(segment + text[position:])
    return _content_of(segments), calls


def _partial_open_length(text: str) -> int:
    """How many characters at the end of `text` could begin CALL_OPEN (held back until the next delta)."""
    for length in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-length:]):
            return length
    return 0


@dataclass
class ToolCallStream:
    """Text deltas in, OpenAI chat chunk `delta` objects out. Plain text streams as content at once (but a
    possible start of a tag, and whitespace that may only separate calls, wait); a call is sent once its
    closing tag arrives, so that a malformed one falls back to content exactly as `parse_tool_calls` does:
    first its id and name with empty arguments, then its arguments. The concatenated deltas equal
    `parse_tool_calls` of the whole text."""

    rng: random.Random | None = None
    calls: list[ToolCall] = field(default_factory=list)
    # Text not yet decided on: a partial opening tag, or the body of an open call.
    _buffer: str = field(default="", init=False, repr=False)
    _in_call: bool = field(default=False, init=False, repr=False)
    # Whitespace at the start of a segment of content, dropped if a call ends the segment.
    _pending_space: str = field(default="", init=False, repr=False)
    _segment_has_text: bool = field(default=False, init=False, repr=False)

    @property
    def made_calls(self) -> bool:
        """Whether the reply called a tool (its finish_reason is then "tool_calls")."""
        return bool(self.calls)

    def push(self, text_delta: str) -> list[dict[str, Any]]:
        self._buffer += text_delta
        deltas: list[dict[str, Any]] = []
        while True:
            marker = CALL_CLOSE if self._in_call else CALL_OPEN
            at = self._buffer.find(marker)
            if at < 0:
                break
            before, self._buffer = self._buffer[:at], self._buffer[at + len(marker):]
            deltas += self._close_call(before) if self._in_call else self._content(before)
            self._in_call = not self._in_call
        if not self._in_call:
            keep = _partial_open_length(self._buffer)
            deltas += self._content(self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
        return deltas

    def finish(self) -> list[dict[str, Any]]:
        """Flush what was held: an unclosed call or a partial tag is content."""
        held = (CALL_OPEN if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        return self._content(held)

    def _content(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if not self._segment_has_text:
            self._pending_space += text
            if not self._pending_space.strip():
                return []
            text, self._pending_space, self._segment_has_text = self._pending_space, "", True
        return [{"content": text}]

    def _close_call(self, body: str) -> list[dict[str, Any]]:
        call = _call_of(body, self.rng)
        if call is None:
            return self._content(CALL_OPEN + body + CALL_CLOSE)
        index = len(self.calls)
        self.calls.append(call)
        self._pending_space, self._segment_has_text = "", False
        return [
            {"tool_calls": [{"index": index, "id": call.id, "type": "function",
                             "function": {"name": call.name, "arguments": ""}}]},
            {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]},
        ]


# ----------------------------------------------------------------------------------------------- grammar

_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def _arguments_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The tool's parameter schema, with JSON laid out as the template writes it (", " and ": ") unless the
    schema says otherwise. A function without parameters takes none, as OpenAI reads it."""
    schema = dict(tool["function"].get("parameters") or _NO_PARAMETERS)
    schema.setdefault("x-guidance", {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    return schema


def tool_call_lark(tools: list[dict[str, Any]], choice: str | dict[str, Any],
                   tokenizer: PreTrainedTokenizerBase | None = None) -> str:
    """A Lark grammar (llguidance) for a reply that is only tool calls: "required" gives one or more calls of
    any of `tools`, a named choice ({"type": "function", "function": {"name": ...}}) exactly one call of that
    function. Each call's arguments follow its tool's JSON schema. Check the request with `check_tools` first.

    Where `tokenizer` has the call tags as tokens of their own (Qwen2.5's added `<tool_call>`), the grammar names
    those tokens: llguidance reads an added token as a special one, which literal text never matches."""
    added = tokenizer.get_added_vocab() if tokenizer is not None else {}
    opening_tag, closing_tag = (_tag(CALL_OPEN, added), _tag(CALL_CLOSE, added))
    if choice == "required":
        chosen, start = list(tools), 'start: call ("\\n" call)*'
    elif isinstance(choice, dict):
        name = choice["function"]["name"]
        chosen, start = [t for t in tools if t["function"]["name"] == name], "start: call"
        if not chosen:
            raise ToolRequestError(f"tool_choice: function {name!r} is not in tools")
    else:
        raise ToolRequestError(f"tool_choice: {choice!r} takes no grammar (only 'required' or a named function)")
    lines = [start, "call: " + " | ".join(f"call_{i}" for i in range(len(chosen)))]
    for i, tool in enumerate(chosen):
        opening = json.dumps(f'\n{{"name": "{tool["function"]["name"]}", "arguments": ')
        lines.append(f'call_{i}: {opening_tag} {opening} arguments_{i} "}}\\n" {closing_tag}')
        lines.append(f"arguments_{i}: %json {json.dumps(_arguments_schema(tool))}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------- checking


def _tag(tag: str, added: dict[str, int]) -> str:
    """A call tag in the grammar: the added token by id where the tokenizer has one, else the literal text."""
    return f"<[{added[tag]}]>" if tag in added else json.dumps(tag)


def _check_tool(index: int, tool: Any) -> str:
    """The tool's name, once its shape is checked."""
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ToolRequestError(f'{where}.type: must be "function"')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ToolRequestError(f"{where}.function: must be an object with a name")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME_PATTERN.fullmatch(name):
        raise ToolRequestError(f"{where}.function.name: {name!r} is not a name of 1 to 64 letters, digits, _ or -")
    if not isinstance(function.get("description", ""), str):
        raise ToolRequestError(f"{where}.function.description: must be a string")
    parameters = function.get("parameters")
    if parameters is not None and (not isinstance(parameters, dict) or parameters.get("type") != "object"):
        raise ToolRequestError(f'{where}.function.parameters: must be a JSON schema of "type": "object"')
    return name


def _check_choice(tool_choice: Any, names: list[str]) -> None:
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if tool_choice == "required":
        if not names:
            raise ToolRequestError('tool_choice: "required" needs tools')
        return
    if isinstance(tool_choice, str):
        raise ToolRequestError(f"tool_choice: {tool_choice!r} is none of {', '.join(_CHOICES)} or a named function")
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(function, dict):
        raise ToolRequestError('tool_choice: a named choice is {"type": "function", "function": {"name": ...}}')
    if function.get("name") not in names:
        raise ToolRequestError(f"tool_choice.function.name: {function.get('name')!r} is not in tools "
                               f"({', '.join(names) or 'none given'})")


def check_tools(tools: Any, tool_choice: Any) -> None:
    """Raise ToolRequestError, naming the field, when `tools` or `tool_choice` cannot be acted on."""
    if tools is not None and not isinstance(tools, list):
        raise ToolRequestError("tools: must be a list of function tools")
    names = [_check_tool(i, tool) for i, tool in enumerate(tools or [])]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ToolRequestError(f"tools: function names must be unique ({', '.join(repeated)} repeated)")
    _check_choice(tool_choice, names)
