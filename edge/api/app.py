"""The edge daemon's HTTP app: OpenAI-compatible completions and chat completions, health and metrics.

Any OpenAI client can point its base URL at `http://127.0.0.1:8000/v1`. This module holds the routes.
The wire format lives in schemas.py (bodies, errors, our `sprinter` extension), choices.py (a choice's
message, tool calls and logprobs) and sse.py (streamed chunks); request_plan.py reads structured output
and tools; completions.py turns a request into `EdgeSettings` and runs its generations on the node's
decoder; responses.py answers, whole or streamed; guards.py holds the API key, body size and concurrency
limits.

What a client can count on: a request that cannot fit the context (the draft's window, the cloud's
max_context) gets a 400 up front, as vLLM does with max_model_len; a generation the cloud refuses
midway ends with the tokens made so far, `finish_reason: "length"` and `sprinter.error` (a 4xx/5xx
only when not one token was made); a stream always ends with a final chunk and `[DONE]`; from the
point a generation degrades (tokens the cloud never verified), every streamed chunk says so and a
non-streamed response carries the header `x-sprinter-degraded: true`. A non-streamed request whose
client goes away is cancelled; a streamed one stops at its next chunk.
"""

from __future__ import annotations

from functools import partial

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from common.model.prompting import encode_prompt
from edge.api.tool_calls import render_chat
from edge.api.completions import ApiSettings, Completions
from edge.api.guards import RequestGuard
from edge.api.request_plan import RequestRefused, plan_request
from edge.api.schemas import ChatCompletionRequest, CompletionRequest, openai_error
from edge.node import EdgeNode

__all__ = ["ApiSettings", "Completions", "create_app"]  # the daemon's settings live with the completions they set


async def invalid_request(_: Request, err: RequestValidationError) -> JSONResponse:
    """A body that fails validation gets OpenAI's error object, naming the field."""
    first = err.errors()[0]
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    return openai_error(400, f"{param or 'body'}: {first.get('msg')}", param)


def create_app(node: EdgeNode, api: ApiSettings | None = None) -> FastAPI:
    api = api or ApiSettings()
    app = FastAPI(title="sprinter edge", version="0.1.0")
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_middleware(RequestGuard, api_key=api.api_key, max_request_bytes=api.max_request_bytes)
    service = Completions(node, api)
    app.state.completions = service  # the fleet plane reads and sets its defaults (edge/fleet_controls.py)
    tokenizer = node.draft.tokenizer

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": api.model_name, "object": "model", "created": 0,
                                            "owned_by": "sprinter"}]}

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        try:
            plan = plan_request(body.response_format)
        except RequestRefused as err:
            return openai_error(400, str(err), err.param)
        return await service.respond(request, body, partial(encode_prompt, tokenizer, body.prompt, chat=False), False,
                                     plan)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        try:
            plan = plan_request(body.response_format, body.tools, body.tool_choice, body.parallel_tool_calls, tokenizer)
        except RequestRefused as err:
            return openai_error(400, str(err), err.param)
        messages = [m.for_template() for m in body.messages]
        return await service.respond(request, body, partial(render_chat, tokenizer, messages, plan.tools.tools), True,
                                     plan)

    @app.get("/healthz")
    async def healthz() -> dict:
        return await service.health()

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(service.metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    return app
