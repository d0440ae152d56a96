"""The edge daemon's HTTP app: OpenAI-compatible completions and chat completions, health and metrics.

Any OpenAI client can point its base URL at `http://127.0.0.1:8000/v1`. The wire format lives in
schemas.py (bodies, errors, our `sprinter` extension) and sse.py (streamed chunks); this module
turns a request into `EdgeSettings`, runs it on the node's decoder and answers.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from common.decoding.modes import MODES, POLICY_MODES, DecodeSettings
from common.prompting import encode_chat, encode_prompt
from common.sampling import SamplingParams
from edge.api.metrics import EdgeMetrics
from edge.api.schemas import (ChatCompletionRequest, CompletionRequest, SamplingFields, completion, finish_reason,
                              openai_error, sprinter_extension, usage)
from edge.api.sse import DONE, ChunkFormat, IncrementalText
from edge.decoder import EdgeResult, EdgeSettings
from edge.node import EdgeNode

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256


class Completions:
    """Serves completion requests on one edge node, with the daemon's default mode and policy."""

    def __init__(self, node: EdgeNode, default_mode: str, model_name: str, default_policy: str | None) -> None:
        self.node = node
        self.default_mode = default_mode
        self.model_name = model_name
        self.default_policy = default_policy
        self.metrics = EdgeMetrics(node.decoder.cost_model)

    def settings(self, body: SamplingFields) -> EdgeSettings | JSONResponse:
        """The request's decoding settings, or the 400 that says which field is wrong."""
        mode = body.mode or self.default_mode
        if mode not in MODES:
            return openai_error(400, f"unknown mode {mode!r}; choose one of {', '.join(MODES)}", "mode")
        max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS
        sampling = SamplingParams(body.temperature, body.top_k, body.top_p, body.seed or 0)
        policy = body.policy or (self.default_policy if mode in POLICY_MODES else None)
        try:
            decode = DecodeSettings(mode=mode, max_new_tokens=max_tokens, sampling=sampling, k=body.k or 5,
                                    policy=policy)
        except ValueError as err:  # the other fields were checked above; only the policy can be wrong here
            return openai_error(400, str(err), "policy")
        return EdgeSettings(decode=decode)

    async def respond(self, body: SamplingFields, prompt_ids: list[int], chat: bool) -> Any:
        settings = self.settings(body)
        if isinstance(settings, JSONResponse):
            return settings
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if body.stream:
            chunks = ChunkFormat(request_id, created, self.model_name, chat)
            return StreamingResponse(self.stream(prompt_ids, settings, chunks), media_type="text/event-stream")
        result = await self.node.decoder.generate(prompt_ids, settings)
        self.metrics.observe(result)
        return completion(request_id, created, self.model_name, chat, result, len(prompt_ids),
                          settings.decode.max_new_tokens)

    async def stream(self, prompt_ids: list[int], settings: EdgeSettings, chunks: ChunkFormat) -> AsyncIterator[str]:
        text = IncrementalText(self.node.draft.tokenizer)
        if chunks.chat:
            yield chunks.role()
        async for item in self.node.decoder.stream(prompt_ids, settings):
            if isinstance(item, EdgeResult):
                self.metrics.observe(item)
                tail = text.flush()  # anything held back as a partial character
                if tail:
                    yield chunks.event(tail)
                yield chunks.event(None, finish_reason(item, settings.decode.max_new_tokens),
                                   usage=usage(len(prompt_ids), item), sprinter=sprinter_extension(item))
            elif delta := text.push(item):
                yield chunks.event(delta)
        yield DONE

    async def health(self) -> dict:
        node = self.node
        cloud = None
        if node.cloud is not None:
            cloud = "reachable" if await node.check_cloud() else "unreachable"
        return {"status": "ok", "draft": node.settings.draft, "cloud": cloud, "default_mode": self.default_mode,
                "default_policy": self.default_policy, "cost_model": node.decoder.cost_model.snapshot()}


async def invalid_request(_: Request, err: RequestValidationError) -> JSONResponse:
    """A body that fails validation gets OpenAI's error object, naming the field."""
    first = err.errors()[0]
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    return openai_error(400, f"{param or 'body'}: {first.get('msg')}", param)


def create_app(node: EdgeNode, default_mode: str, model_name: str, default_policy: str | None = None) -> FastAPI:
    """`default_policy` applies to requests in modes that take a policy and name none."""
    app = FastAPI(title="sprinter edge", version="0.1.0")
    app.add_exception_handler(RequestValidationError, invalid_request)
    service = Completions(node, default_mode, model_name, default_policy)
    tokenizer = node.draft.tokenizer

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "sprinter"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        return await service.respond(body, encode_prompt(tokenizer, body.prompt, chat=False), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Any:
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        return await service.respond(body, encode_chat(tokenizer, messages), chat=True)

    @app.get("/healthz")
    async def healthz() -> dict:
        return await service.health()

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(service.metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    return app
