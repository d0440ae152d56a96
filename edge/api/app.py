"""The edge daemon's HTTP app: OpenAI-compatible completions and chat completions, health and metrics.

Any OpenAI client can point its base URL at `http://127.0.0.1:8000/v1`. The wire format lives in
schemas.py (bodies, errors, our `sprinter` extension) and sse.py (streamed chunks); guards.py
holds the API key, body size and concurrency limits. This module turns a request into
`EdgeSettings`, runs it on the node's decoder and answers.

What a client can count on: a request that cannot fit the context (the draft's window, the cloud's
max_context) gets a 400 up front, as vLLM does with max_model_len; a generation the cloud refuses
midway ends with the tokens made so far, `finish_reason: "length"` and `sprinter.error` (a 4xx/5xx
only when not one token was made); a stream always ends with a final chunk and `[DONE]`; from the
point a generation degrades (tokens the cloud never verified), every streamed chunk says so and a
non-streamed response carries the header `x-sprinter-degraded: true`. A non-streamed request whose
client goes away is cancelled; a streamed one stops at its next chunk.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.requests import ClientDisconnect
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from common.decoding.modes import MODES, POLICY_MODES, DecodeSettings, mode_of
from common.prompting import encode_prompt
from common.sampling_params import GrammarError
from common.tool_calls import ToolsUnsupported, render_chat
from common.sampling import SamplingParams
from edge.api.guards import ConcurrencyLimit, RequestGuard
from edge.api.metrics import EdgeMetrics
from edge.api.request_plan import RequestPlan, RequestRefused, plan_request
from edge.api.schemas import (ChatCompletionRequest, CompletionRequest, SamplingFields, completion, logit_bias_pairs,
                              openai_error, request_problem, sprinter_extension, usage)
from edge.api.choices import ChoiceDeltas, LogprobFormat
from edge.api.sse import DONE, ChunkFormat
from edge.cloud_link.client import CloudLinkError
from edge.decoding.decoder import Degraded, EdgeResult, EdgeSettings
from edge.node import EdgeNode

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
HEALTH_PROBE_S = 2.0  # how long /healthz waits for each cloud replica's GetInfo
# A cloud refusal before a single token was made: the whole request failed, with this HTTP status (else 502).
REFUSAL_STATUS = {"INVALID_ARGUMENT": 400, "OUT_OF_RANGE": 400, "RESOURCE_EXHAUSTED": 429}


@dataclass(frozen=True)
class ApiSettings:
    default_mode: str = "sprinter-exact"
    model_name: str = "sprinter"
    default_policy: str | None = None  # applies to requests in modes that take a policy and name none
    default_pipeline: str = "off"  # edge/decoding/pipeline.py; a request may set its own
    default_k: int = 5  # block length of requests that name none (fixed-k policies, sd's default)
    api_key: str | None = None  # required as 'Authorization: Bearer KEY' on /v1/ when set
    max_concurrent_requests: int = 64  # generations in flight; more get 429 (0: no limit)
    max_request_bytes: int = 2 << 20  # larger bodies get 413
    cloud_retry_s: float = 2.0  # while degraded, how often a generation tries the cloud again
    request_deadline_s: float | None = None  # a request's wait for the cloud in all, unless it sets its own
    pipeline_adapts: bool = True  # pipelines run rounds as off while drafting ahead does not pay


@dataclass(frozen=True)
class Reply:
    """What every response of one request shares."""

    request_id: str
    created: int
    model: str
    chat: bool
    prompt_tokens: int
    include_usage: bool = False  # streamed: stream_options.include_usage
    parse_calls: bool = False  # the reply's tool calls become `tool_calls` (edge/api/request_plan.py)
    logprobs: LogprobFormat | None = None  # how the tokens' logprobs are written, when the request asks for them


class GuardedStream(StreamingResponse):
    """A streamed response that stops when its client leaves, even while no token is coming (a stalled
    cloud), and whose cleanup runs however it ends, even if the client left before the first byte."""

    def __init__(self, content: AsyncIterator[str], cleanup: Callable[[], Awaitable[None]], **kw: Any) -> None:
        super().__init__(content, media_type="text/event-stream", **kw)
        self.cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        streaming = asyncio.create_task(super().__call__(scope, receive, send))
        watch = asyncio.create_task(client_left(receive))
        try:
            await asyncio.wait({streaming, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            streaming.cancel()
            outcome = (await asyncio.gather(streaming, return_exceptions=True))[0]
            await self.cleanup()
        if isinstance(outcome, Exception) and not isinstance(outcome, (ClientDisconnect, OSError)):
            log.error("streamed response failed: %r", outcome)


def degraded_headers(reason: str | None) -> dict[str, str]:
    """`x-sprinter-degraded` (true/false) and, when true, `x-sprinter-degraded-reason`."""
    if reason is None:
        return {"x-sprinter-degraded": "false"}
    return {"x-sprinter-degraded": "true", "x-sprinter-degraded-reason": reason}


def refusal_response(err: CloudLinkError) -> JSONResponse:
    status = REFUSAL_STATUS.get(err.code.name, 502)
    kind = {400: "invalid_request_error", 429: "rate_limit_error"}.get(status, "cloud_error")
    headers = {"Retry-After": "1"} if status == 429 else None
    return openai_error(status, f"the cloud refused this request: {err}", None, kind, err.code.name, headers)


async def client_left(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns when the client disconnects (the body was read already: nothing else arrives before that)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class Completions:
    """Serves completion requests on one edge node, with the daemon's defaults and limits."""

    def __init__(self, node: EdgeNode, api: ApiSettings) -> None:
        self.node = node
        self.api = api
        self.metrics = EdgeMetrics(node.decoder.cost_model, lambda: node.cloud)
        self.slots = ConcurrencyLimit(api.max_concurrent_requests)
        self.metrics.in_flight.set_function(lambda: self.slots.in_flight)
        # One thread: a long prompt is tokenized off the event loop, and the tokenizer is never shared by two.
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")

    def settings(self, body: SamplingFields, prompt_tokens: int, plan: RequestPlan) -> EdgeSettings | JSONResponse:
        """The request's decoding settings, or the 400 that says which field is wrong."""
        if problem := request_problem(body):
            return openai_error(400, problem[1], problem[0])
        if plan.grammar is not None:
            try:  # compiled once here (cached): a grammar the engine refuses is the request's mistake
                self.node.draft.grammars.compile(plan.grammar)
            except GrammarError as err:
                return openai_error(400, f"{plan.grammar_field}: {err}", plan.grammar_field)
        mode = body.mode or self.api.default_mode
        if mode not in MODES:
            return openai_error(400, f"unknown mode {mode!r}; choose one of {', '.join(MODES)}", "mode")
        if not mode_of(mode).drafts and self.node.cloud is None:  # a drafting mode runs from its draft alone
            return openai_error(400, f"mode {mode!r} needs a cloud, and this daemon has none (--cloud)", "mode")
        max_tokens = self._max_tokens(body, mode, prompt_tokens)
        if isinstance(max_tokens, JSONResponse):
            return max_tokens
        try:
            bias = logit_bias_pairs(body.logit_bias, self.node.draft.vocab_size)
        except ValueError as err:
            return openai_error(400, str(err), "logit_bias")
        sampling = SamplingParams(body.temperature, max(body.top_k, 0), body.top_p, body.seed or 0,
                                  body.presence_penalty, body.frequency_penalty, body.repetition_penalty, bias,
                                  plan.grammar, body.wanted_logprobs)
        policy = body.policy or (self.api.default_policy if mode in POLICY_MODES else None)
        try:
            decode = DecodeSettings(mode=mode, max_new_tokens=max_tokens, sampling=sampling, k=body.k or self.api.default_k,
                                    policy=policy)
        except ValueError as err:  # the other fields were checked above; only the policy can be wrong here
            return openai_error(400, str(err), "policy")
        return EdgeSettings(decode=decode, cloud_retry_s=self.api.cloud_retry_s, stop=body.stop_sequences,
                            pipeline=body.pipeline or self.api.default_pipeline,
                            request_deadline_s=body.request_deadline_s or self.api.request_deadline_s,
                            pipeline_adapts=self.api.pipeline_adapts)

    def _max_tokens(self, body: SamplingFields, mode: str, prompt_tokens: int) -> int | JSONResponse:
        """vLLM's rule: prompt + max_tokens must fit the context (the draft's window, the cloud's max_context);
        without max_tokens the completion may fill what is left, up to the default."""
        requested = body.max_completion_tokens or body.max_tokens
        limit = self.node.decoder.context_limit(mode)
        if limit is None:
            return requested or DEFAULT_MAX_TOKENS
        what = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        if prompt_tokens >= limit:
            return openai_error(400, f"This model's maximum context length is {limit} tokens. However, your {what} "
                                f"has {prompt_tokens} tokens, leaving no room for a completion.", what)
        if requested is None:
            return min(DEFAULT_MAX_TOKENS, limit - prompt_tokens)
        if prompt_tokens + requested > limit:
            return openai_error(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{prompt_tokens + requested} tokens ({prompt_tokens} in the {what}, {requested} in "
                                f"the completion). Please reduce the length of the {what} or completion.", what)
        return requested

    async def respond(self, request: Request, body: SamplingFields, encode: Callable[[], list[int]],
                      chat: bool, plan: RequestPlan) -> Response:
        if not self.slots.try_acquire():
            self.metrics.rejected.labels("busy").inc()
            return openai_error(429, f"{self.slots.limit} requests are in flight, this daemon's limit "
                                "(--max-concurrent-requests); retry shortly", None, "rate_limit_error",
                                "too_many_requests", {"Retry-After": "1"})
        handed_to_stream = False
        try:
            try:
                prompt_ids = await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, encode)
            except ToolsUnsupported as err:
                self.metrics.rejected.labels("invalid").inc()
                return openai_error(400, str(err), "tools")
            settings = self.settings(body, len(prompt_ids), plan) if prompt_ids else openai_error(
                400, "the prompt is empty: a completion continues at least one token", "prompt")
            if isinstance(settings, JSONResponse):
                self.metrics.rejected.labels("invalid").inc()
                return settings
            reply = Reply(("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], int(time.time()),
                          self.api.model_name, chat, len(prompt_ids),
                          body.stream_options is not None and body.stream_options.include_usage,
                          plan.tools.parse_calls,
                          LogprobFormat(self.node.draft.tokenizer, chat) if body.wanted_logprobs is not None else None)
            if not body.stream:
                return await self._whole(request, prompt_ids, settings, reply)
            response = await self._streamed(prompt_ids, settings, reply)
            handed_to_stream = isinstance(response, GuardedStream)
            return response
        finally:
            if not handed_to_stream:
                self.slots.release()

    async def _whole(self, request: Request, prompt_ids: list[int], settings: EdgeSettings, reply: Reply) -> Response:
        generation = asyncio.create_task(self.node.decoder.generate(prompt_ids, settings))
        watch = asyncio.create_task(client_left(request.receive))
        try:
            await asyncio.wait({generation, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not generation.done():  # the client left (or the server is stopping): stop paying for it
                generation.cancel()
                self.metrics.cancelled.inc()
                log.info("request %s cancelled: the client disconnected", reply.request_id)
        if generation.cancelled():
            return Response(status_code=499)  # nginx's "client closed request"; nobody is there to read it
        result = generation.result()
        self.metrics.observe(result)
        if result.error is not None and not result.token_ids:
            return refusal_response(result.error)
        body = completion(reply.request_id, reply.created, reply.model, reply.chat, result, reply.prompt_tokens,
                          reply.parse_calls, reply.logprobs)
        return JSONResponse(body, headers=degraded_headers(result.degraded_reason))

    async def _streamed(self, prompt_ids: list[int], settings: EdgeSettings, reply: Reply) -> Response:
        items = self.node.decoder.stream(prompt_ids, settings)
        # The first item comes before the headers, so that a refusal before any token gets its own status.
        first = await anext(items)
        if isinstance(first, EdgeResult) and first.error is not None and not first.token_ids:
            await items.aclose()
            self.metrics.observe(first)
            return refusal_response(first.error)
        finished = asyncio.Event()

        async def cleanup() -> None:
            await items.aclose()  # cancels the generation if it is still running
            self.slots.release()
            if not finished.is_set():
                self.metrics.cancelled.inc()

        headers = degraded_headers(first.reason) if isinstance(first, Degraded) else None
        return GuardedStream(self.stream(first, items, settings, reply, finished), cleanup, headers=headers)

    async def stream(self, first: Any, items: AsyncIterator[Any], settings: EdgeSettings, reply: Reply,
                     finished: asyncio.Event) -> AsyncIterator[str]:
        chunks = ChunkFormat(reply.request_id, reply.created, reply.model, reply.chat, reply.include_usage)
        deltas = ChoiceDeltas(self.node.draft.tokenizer, settings.stop, reply.parse_calls)
        degraded: str | None = None  # the reason, once the generation degraded
        if reply.chat:
            yield chunks.role()
        item, text_offset = first, 0
        try:
            while not isinstance(item, EdgeResult):
                if isinstance(item, Degraded):
                    degraded = item.reason
                else:
                    pieces = deltas.push(item.tokens)
                    logprobs = reply.logprobs.entries(item.logprobs, text_offset) \
                        if reply.logprobs is not None and item.logprobs else None
                    if logprobs is not None:  # the tokens' logprobs ride with their text, or come on their own
                        text_offset += sum(len(reply.logprobs.text(lp.token)) for lp in item.logprobs)
                        pieces = pieces or [""]
                    for i, delta in enumerate(pieces):
                        yield chunks.event(delta, degraded=degraded, logprobs=logprobs if i == 0 else None)
                item = await anext(items)
        except Exception as err:  # a bug of ours mid-stream: say so in the stream, and still end it properly
            log.exception("request %s failed mid-stream", reply.request_id)
            yield "data: " + ChunkFormat.error_object(f"internal error: {err}") + "\n\n"
            yield DONE
            return
        finished.set()
        self.metrics.observe(item)
        for delta in deltas.finish(item.text):
            yield chunks.event(delta, degraded=degraded)
        yield chunks.event(None, deltas.finish_reason(item.finish_reason), sprinter=sprinter_extension(item))
        if chunks.include_usage:
            yield chunks.usage(usage(reply.prompt_tokens, item))
        yield DONE

    async def health(self) -> dict:
        node = self.node
        cloud, replicas = None, None
        if node.cloud is not None:
            # A health check must answer fast even when the cloud does not (a readiness probe has seconds).
            cloud = "reachable" if await node.check_cloud(timeout_s=HEALTH_PROBE_S) else "unreachable"
            replicas = node.cloud.describe()
        return {"status": "ok", "draft": node.settings.draft, "cloud": cloud, "cloud_replicas": replicas,
                "cloud_reopens": dict(node.cloud.reopen_causes) if node.cloud is not None else {},
                "default_mode": self.api.default_mode,
                "default_policy": self.api.default_policy, "default_pipeline": self.api.default_pipeline, "in_flight": self.slots.in_flight,
                "context_limit": node.decoder.context_limit(self.api.default_mode),
                "cost_model": node.decoder.cost_model.snapshot()}


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
            plan = plan_request(body.response_format, body.tools, body.tool_choice, body.parallel_tool_calls)
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
