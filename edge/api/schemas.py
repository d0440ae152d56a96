"""The OpenAI wire format the edge daemon speaks: request bodies, error objects, usage and our extension.

Requests may set sprinter's own fields beside OpenAI's: `mode`, `k`, `policy` (a call policy
spec, e.g. "goodput"), `pipeline` (off, ahead, send-ahead: edge/decoding/pipeline.py) and
`placement` (edge, cloud or auto: where the draft runs, edge/decoding/placer.py), `proposer` (model,
suffix or hybrid: what proposes the tokens, common/spec/propose/proposals.py) and
`request_deadline_s` (how long the request may wait for the cloud in all; past it the rest comes
from the draft, degraded with reason `deadline`) and `priority` (as vLLM's: lower first, within this
edge's share of the cloud's admission queue). Each response carries the usual `usage` plus a
`sprinter` object (mode, policy, target_calls, tokens_per_call, block_length_mean, degraded and
degraded_reason, token ids, `queue_s` (time in the cloud's line) and the full stats; `error` when the
cloud refused mid-generation).

Every field has a range that fits where it goes (seed: the wire's uint64; top_k: int32). OpenAI
fields this server does not implement are refused with a 400 naming them, unless their value
asks for nothing (`presence_penalty: 0`, `logprobs: null`...), which many clients send by default.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from common.admission import PRIORITY_RANGE
from edge.api.choices import LogprobFormat, sources, whole_choice
from edge.decoding.decoder import EdgeResult

MAX_STOP_SEQUENCES = 16


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64)
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: CalledFunction


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (OpenAI's shape; edge/api/tool_calls.py converts the calls)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.name is not None:
            message["name"] = self.name
        return message


class SystemMessage(_Message):
    role: Literal["system", "developer"]


class UserMessage(_Message):
    role: Literal["user"]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: str | list[TextPart] | None = None  # None: a turn that only called tools
    tool_calls: list[MessageToolCall] | None = None

    def for_template(self) -> dict[str, Any]:
        message = super().for_template()
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return message


class ToolMessage(_Message):
    role: Literal["tool"]
    tool_call_id: str = Field(min_length=1, max_length=128)  # the call this result answers

    def for_template(self) -> dict[str, Any]:
        return {**super().for_template(), "tool_call_id": self.tool_call_id}


ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False  # a last chunk of its own, with empty `choices`, carries the usage


class SamplingFields(BaseModel):
    # Unknown fields are kept (not dropped silently) so that `unsupported_field` can name them.
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=8192)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=8192)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=2**31 - 1, description="0 or -1: off")
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=16, description="choices, generated at once, seeded seed, seed + 1, ...")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, ge=0.01, le=100.0, description="vLLM's: 1 is off")
    logit_bias: dict[str, float] | None = Field(default=None, description="token id (a string) -> bias in [-100, 100]")
    response_format: dict[str, Any] | None = Field(default=None, description="text, json_object or json_schema")
    stop: str | list[str] | None = Field(default=None, description=f"up to {MAX_STOP_SEQUENCES} strings")
    # sprinter extensions
    mode: str | None = Field(default=None, max_length=32)
    k: int | None = Field(default=None, ge=1, le=32)
    policy: str | None = Field(default=None, max_length=64)
    pipeline: Literal["off", "ahead", "send-ahead"] | None = None
    proposer: str | None = Field(default=None, max_length=16, description="model, suffix or hybrid: what proposes the tokens")
    placement: str | None = Field(default=None, max_length=16, description="edge, cloud or auto: where the draft runs")
    branch_tokens: Annotated[int, Field(ge=0, le=64)] | Literal["auto"] | None = Field(
        default=None, description="tree branch tokens per round (sd-block, sprinter-exact): N, auto, or 0 (off)")
    request_deadline_s: float | None = Field(default=None, gt=0, le=86400,
                                             description="how long this request may wait for the cloud in all")
    priority: int = Field(default=0, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1],
                          description="as vLLM's: lower is served first within this edge's share of the cloud's line")

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


    @property
    def wanted_logprobs(self) -> int | None:
        """The top N per token the request asks logprobs for; None: no logprobs."""
        return None

    @property
    def echoed(self) -> str | None:
        """The prompt text a response repeats before the completion (completions' `echo`); None: none."""
        return None


class CompletionRequest(SamplingFields):
    prompt: str
    logprobs: int | None = Field(default=None, ge=0, le=20, strict=True, description="the top N per token (OpenAI: at most 5)")
    echo: bool = Field(default=False, strict=True, description="the prompt comes back before the completion (with its logprobs)")

    @property
    def wanted_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echoed(self) -> str | None:
        return self.prompt if self.echo else None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _none_or(*allowed: Any) -> Callable[[Any], bool]:
    # `is` for booleans: 0 == False in Python, and logprobs=0 is a request, not a no-op
    return lambda value: value is None or any(value is a if isinstance(a, bool) else
                                              (not isinstance(value, bool) and value == a) for a in allowed)


# OpenAI fields accepted only with a value that asks for nothing; any other value is refused by name.
NO_OP_FIELDS: dict[str, Callable[[Any], bool]] = {
    "user": lambda value: value is None or isinstance(value, str),  # an end-user id for abuse tracking
    "best_of": _none_or(1),
    "suffix": _none_or(""),
}


def request_problem(body: SamplingFields) -> tuple[str, str] | None:
    """(field, message) for a field this server does not implement or a stop list it cannot take; else None."""
    for name, value in (body.model_extra or {}).items():
        if name not in NO_OP_FIELDS:
            return name, f"unsupported field {name!r}: this server does not implement it"
        if not NO_OP_FIELDS[name](value):
            return name, f"unsupported value of {name!r}: this server does not implement it (leave it unset)"
    if body.stream_options is not None and not body.stream:
        return "stream_options", "stream_options is only allowed when stream is true"
    stops = body.stop_sequences
    if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
        return "stop", f"stop takes at most {MAX_STOP_SEQUENCES} non-empty strings"
    return None


def logit_bias_pairs(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias (token ids as strings) as sorted (id, bias) pairs; ValueError naming a bad entry."""
    pairs = []
    for key, value in (bias or {}).items():
        if not key.strip().isdigit() or not 0 <= int(key) < vocab_size:
            raise ValueError(f"logit_bias: {key!r} is not a token id of this model (0 to {vocab_size - 1})")
        if not -100.0 <= value <= 100.0:
            raise ValueError(f"logit_bias: the bias of token {key} is {value}; it must be in [-100, 100]")
        pairs.append((int(key), float(value)))
    if len({token for token, _ in pairs}) != len(pairs):
        raise ValueError("logit_bias names a token id twice")
    return tuple(sorted(pairs))


def openai_error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers,
                        content={"error": {"message": message, "type": kind, "param": param, "code": code}})


def sprinter_extension(result: EdgeResult) -> dict[str, Any]:
    s = result.stats
    extension = {"mode": s.mode, "policy": s.policy, "pipeline": s.pipeline, "target_calls": s.target_calls,
                 "tokens_per_call": s.tokens_per_call, "block_length_mean": s.block_length_mean,
                 "degraded": result.degraded, "degraded_reason": result.degraded_reason, "verifier": result.verifier, "token_ids": result.token_ids,
                 "cached_tokens": s.cached_tokens, "queue_s": round(result.queued_s, 3), "stats": s.to_dict()}
    if s.tree_rounds:  # branching: paths per tree round, branch tokens sent and kept, side paths that won
        extension["tree"] = {"rounds": s.tree_rounds, "paths_per_round": s.paths_per_round,
                             "branch_tokens_sent": s.branch_tokens_sent, "branch_tokens_kept": s.branch_tokens_kept,
                             "side_path_wins": s.side_path_wins, "copy_branch_tokens": s.copy_branch_tokens,
                             "copy_path_wins": s.copy_path_wins}
    if result.error is not None:
        extension["error"] = {"code": result.error.code.name, "message": result.error.detail}
    if result.placed is not None:  # where it drafted, the mode actually run (stats.mode), and auto's prediction
        extension["placement"] = result.placed.describe()
        if switches := result.placed.switches():  # mode auto: what it chose, and what it predicted of each option
            extension["decision"] = {"switches": switches}
    if result.logprobs is not None:
        extension["logprob_sources"] = sources(result.logprobs)
    return extension


def usage(prompt_tokens: int, results: list[EdgeResult]) -> dict[str, Any]:
    """OpenAI's usage of a request: its prompt once, the completion tokens of all its choices, and the prompt
    tokens the cloud had cached before the request (the fewest any choice found: the first of `n` choices may
    compute what the others then reuse; each choice's own count is in its `sprinter.stats.cached_tokens`)."""
    completion_tokens = sum(len(result.token_ids) for result in results)
    cached_tokens = min((result.stats.cached_tokens for result in results), default=0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion(request_id: str, created: int, model: str, chat: bool, results: list[EdgeResult],
               prompt_tokens: int, parse_calls: bool = False, logprobs: LogprobFormat | None = None,
               echo: tuple[str, list[int]] | None = None) -> dict[str, Any]:
    """A whole (non-streamed) completion or chat completion object with a choice per result
    (edge/api/choices.py: the choice). With n > 1 the sprinter extension lists each choice's as `choices`.
    `echo`: the prompt's text and ids, put before each completion (and its logprobs before theirs)."""
    choices = []
    for index, result in enumerate(results):
        entries = logprobs.entries(result.logprobs) if logprobs is not None and result.logprobs is not None else None
        text = result.text
        if echo is not None:
            text = echo[0] + text
            if logprobs is not None and result.prompt_logprobs is not None:
                entries = logprobs.echoed(echo[1], result.prompt_logprobs, result.logprobs)
        choices.append(whole_choice(index, text, result.finish_reason, chat, parse_calls, entries))
    extension = sprinter_extension(results[0])
    if len(results) > 1:
        extension["choices"] = [sprinter_extension(result) for result in results]
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage(prompt_tokens, results), "sprinter": extension}
