"""The edge daemon's HTTP API: OpenAI-compatible completions and chat completions, health and metrics.

Any OpenAI client can point its base URL at `http://127.0.0.1:8000/v1`. Each response carries the
usual `usage` plus a `sprinter` object (mode, policy, target_calls, tokens_per_call,
block_length_mean, degraded and the full stats). Requests may set `mode`, `k` and `policy` (a call
policy spec, e.g. "goodput") as extra body fields.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, Field

from common.call_policy import CostModel
from common.local_engine import MODES, POLICY_MODES, DecodeSettings
from common.prompting import encode_chat, encode_prompt
from common.sampling import SamplingParams
from edge.decoder import EdgeResult, EdgeSettings
from edge.node import EdgeNode

log = logging.getLogger(__name__)


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


class EdgeMetrics:
    def __init__(self, cost_model: CostModel) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # Read at scrape time: the cost model learns between scrapes, from every request.
        estimates = Gauge("sprinter_edge_cost_model", "The call policy's cost model: learned draft, link and "
                          "verify costs (ms) and observation counts", ["estimate"], registry=r)
        for key in cost_model.snapshot():
            estimates.labels(key).set_function(lambda key=key: cost_model.snapshot()[key])
        self.requests = Counter("sprinter_edge_requests", "Generation requests", ["mode"], registry=r)
        self.tokens = Counter("sprinter_edge_tokens_generated", "Tokens returned to clients", ["mode"], registry=r)
        self.target_calls = Counter("sprinter_edge_target_calls", "Cloud verifications", ["mode"], registry=r)
        self.degraded = Counter("sprinter_edge_degraded_requests", "Requests served partly without the cloud", registry=r)
        self.tokens_per_s = Histogram("sprinter_edge_tokens_per_s", "Generation speed per request", registry=r,
                                      buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))

    def observe(self, result: EdgeResult) -> None:
        mode = result.stats.mode
        self.requests.labels(mode).inc()
        self.tokens.labels(mode).inc(result.stats.new_tokens)
        self.target_calls.labels(mode).inc(result.stats.target_calls)
        self.tokens_per_s.observe(result.stats.tokens_per_s)
        if result.degraded:
            self.degraded.inc()


def sprinter_extension(result: EdgeResult) -> dict[str, Any]:
    s = result.stats
    return {"mode": s.mode, "policy": s.policy, "target_calls": s.target_calls, "tokens_per_call": s.tokens_per_call,
            "block_length_mean": s.block_length_mean, "degraded": result.degraded, "token_ids": result.token_ids,
            "stats": s.to_dict()}


def usage(prompt_tokens: int, result: EdgeResult) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(result.token_ids),
            "total_tokens": prompt_tokens + len(result.token_ids)}


class IncrementalText:
    """Decodes a growing token list into text deltas, holding back half-finished UTF-8 characters."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.sent = ""

    def push(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def flush(self) -> str:
        """The rest, even a character the generation ended in the middle of (as the non-streamed text has it)."""
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        delta, self.sent = text[len(self.sent):], text
        return delta


def create_app(node: EdgeNode, default_mode: str, model_name: str, default_policy: str | None = None) -> FastAPI:
    """`default_policy` applies to requests in modes that take a policy and name none."""
    app = FastAPI(title="sprinter edge", version="0.1.0")
    metrics = EdgeMetrics(node.decoder.cost_model)
    tokenizer = node.draft.tokenizer

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return openai_error(400, f"{param or 'body'}: {first.get('msg')}", param)

    def decode_settings(body: SamplingFields) -> EdgeSettings | JSONResponse:
        mode = body.mode or default_mode
        if mode not in MODES:
            return openai_error(400, f"unknown mode {mode!r}; choose one of {', '.join(MODES)}", "mode")
        max_tokens = body.max_completion_tokens or body.max_tokens or 256
        sampling = SamplingParams(body.temperature, body.top_k, body.top_p, body.seed or 0)
        policy = body.policy or (default_policy if mode in POLICY_MODES else None)
        try:
            decode = DecodeSettings(mode=mode, max_new_tokens=max_tokens, sampling=sampling, k=body.k or 5,
                                    policy=policy)
        except ValueError as err:  # the other fields were checked above; only the policy can be wrong here
            return openai_error(400, str(err), "policy")
        return EdgeSettings(decode=decode)

    async def respond(body: SamplingFields, prompt_ids: list[int], chat: bool) -> Any:
        settings = decode_settings(body)
        if isinstance(settings, JSONResponse):
            return settings
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        if body.stream:
            return StreamingResponse(stream_events(prompt_ids, settings, request_id, created, chat),
                                     media_type="text/event-stream")
        result = await node.decoder.generate(prompt_ids, settings)
        metrics.observe(result)
        finish = finish_reason(result, settings)
        choice = ({"index": 0, "message": {"role": "assistant", "content": result.text}, "finish_reason": finish}
                  if chat else {"index": 0, "text": result.text, "finish_reason": finish, "logprobs": None})
        return {"id": request_id, "object": kind, "created": created, "model": model_name, "choices": [choice],
                "usage": usage(len(prompt_ids), result), "sprinter": sprinter_extension(result)}

    def finish_reason(result: EdgeResult, settings: EdgeSettings) -> str:
        return "length" if len(result.token_ids) >= settings.decode.max_new_tokens else "stop"

    async def stream_events(prompt_ids: list[int], settings: EdgeSettings, request_id: str, created: int,
                            chat: bool) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        text = IncrementalText(tokenizer)

        def event(delta: str | None, finish: str | None, **extra: Any) -> str:
            if chat:
                choice = {"index": 0, "delta": {} if delta is None else {"content": delta}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
            return "data: " + json.dumps({"id": request_id, "object": kind, "created": created, "model": model_name,
                                          "choices": [choice], **extra}) + "\n\n"

        if chat:
            yield "data: " + json.dumps({"id": request_id, "object": kind, "created": created, "model": model_name,
                                         "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                      "finish_reason": None}]}) + "\n\n"
        async for item in node.decoder.stream(prompt_ids, settings):
            if isinstance(item, EdgeResult):
                metrics.observe(item)
                tail = text.flush()  # anything held back as a partial character
                if tail:
                    yield event(tail, None)
                yield event(None, finish_reason(item, settings), usage=usage(len(prompt_ids), item),
                            sprinter=sprinter_extension(item))
            else:
                delta = text.push(item)
                if delta:
                    yield event(delta, None)
        yield "data: [DONE]\n\n"

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "sprinter"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        return await respond(body, encode_prompt(tokenizer, body.prompt, chat=False), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Any:
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        return await respond(body, encode_chat(tokenizer, messages), chat=True)

    @app.get("/healthz")
    async def healthz() -> dict:
        cloud = None
        if node.cloud is not None:
            cloud = "reachable" if await node.check_cloud() else "unreachable"
        return {"status": "ok", "draft": node.settings.draft, "cloud": cloud, "default_mode": default_mode,
                "default_policy": default_policy, "cost_model": node.decoder.cost_model.snapshot()}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    return app
