"""The OpenAI wire format the edge daemon speaks: request bodies, error objects, usage and our extension.

Requests may set sprinter's own fields beside OpenAI's: `mode`, `k` and `policy` (a call policy
spec, e.g. "goodput"). Each response carries the usual `usage` plus a `sprinter` object (mode,
policy, target_calls, tokens_per_call, block_length_mean, degraded, token ids and the full stats).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from edge.decoder import EdgeResult


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class SamplingFields(BaseModel):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=8192)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=8192)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)
    # sprinter extensions
    mode: str | None = None
    k: int | None = Field(default=None, ge=1, le=32)
    policy: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)


def openai_error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param, "code": None}})


def sprinter_extension(result: EdgeResult) -> dict[str, Any]:
    s = result.stats
    return {"mode": s.mode, "policy": s.policy, "target_calls": s.target_calls, "tokens_per_call": s.tokens_per_call,
            "block_length_mean": s.block_length_mean, "degraded": result.degraded, "token_ids": result.token_ids,
            "stats": s.to_dict()}


def usage(prompt_tokens: int, result: EdgeResult) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(result.token_ids),
            "total_tokens": prompt_tokens + len(result.token_ids)}


def finish_reason(result: EdgeResult, max_new_tokens: int) -> str:
    return "length" if len(result.token_ids) >= max_new_tokens else "stop"


def completion(request_id: str, created: int, model: str, chat: bool, result: EdgeResult, prompt_tokens: int,
               max_new_tokens: int) -> dict[str, Any]:
    """A whole (non-streamed) completion or chat completion object."""
    finish = finish_reason(result, max_new_tokens)
    choice = ({"index": 0, "message": {"role": "assistant", "content": result.text}, "finish_reason": finish}
              if chat else {"index": 0, "text": result.text, "finish_reason": finish, "logprobs": None})
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage(prompt_tokens, result),
            "sprinter": sprinter_extension(result)}
