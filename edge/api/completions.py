"""Serving completion requests on one edge node: a request's fields become decoding settings, its n
generations run on the node's decoder, and edge/api/responses.py writes the answer.

Refusals come before any work, each a 400 naming its field: a field out of range or not implemented, a
grammar that does not compile, a prompt that does not fit the context (as vLLM does with max_model_len).
n > 1 runs n generations at once, seeded seed, seed + 1, ...: one prefills the prompt and the others reuse
it (the draft's cache on the edge, edge/runtime/draft_reuse.py; the cloud's prefix cache there), and each
counts against --max-concurrent-requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from common.spec.modes import (MODE_CHOICES, PLACEMENTS, POLICY_MODES, PROPOSERS, DecodeSettings, check_branching,
                               chooses_mode, mode_of, needs_cloud, settings_mode, takes_trees)
from common.sampling.distributions import SamplingParams
from common.sampling.params import GrammarError
from edge.api.tool_calls import ToolsUnsupported
from common.tracing import tracer
from edge.api.choices import LogprobFormat
from edge.api.guards import ConcurrencyLimit
from edge.api.metrics import EdgeMetrics
from edge.api.request_plan import RequestPlan
from edge.api.responses import (GuardedStream, Reply, client_left, degraded_headers, merged, refusal_response,
                                refused_before_a_token, stream_body)
from edge.api.schemas import (ChatCompletionRequest, SamplingFields, completion, logit_bias_pairs, openai_error,
                              request_problem)
from edge.decoding.decoder import Degraded, EdgeSettings
from edge.node import EdgeNode

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
HEALTH_PROBE_S = 2.0  # how long /healthz waits for each cloud replica's GetInfo


@dataclass(frozen=True)
class ApiSettings:
    default_mode: str = "sprinter-exact"
    model_name: str = "sprinter"
    default_policy: str | None = None  # applies to requests in modes that take a policy and name none
    default_pipeline: str = "off"  # edge/decoding/pipeline.py; a request may set its own
    default_proposer: str = "model"  # what proposes a block's tokens (common/spec/propose/proposals.py); likewise
    default_branch_tokens: int | str = 0  # branch tokens of requests in tree-taking modes that name none (branching.py)
    default_placement: str = "edge"  # where requests that name none draft (edge/decoding/placer.py)
    default_k: int = 5  # block length of requests that name none (fixed-k policies, sd's default)
    api_key: str | None = None  # required as 'Authorization: Bearer KEY' on /v1/ when set
    max_concurrent_requests: int = 64  # generations in flight; more get 429 (0: no limit)
    max_request_bytes: int = 2 << 20  # larger bodies get 413
    cloud_retry_s: float = 2.0  # while degraded, how often a generation tries the cloud again
    request_deadline_s: float | None = None  # a request's wait for the cloud in all, unless it sets its own
    pipeline_adapts: bool = True  # pipelines run rounds as off while drafting ahead does not pay
    # EdgeSettings.draft_dists of the requests that can use it (a mode whose rule `dists_on_rejection`, no
    # send-ahead); the others send their draft distributions in full, which is as exact
    draft_dists: str = "full"


class Completions:
    """Serves completion requests on one edge node, with the daemon's defaults and limits."""

    def __init__(self, node: EdgeNode, api: ApiSettings) -> None:
        self.node = node
        self.api = api
        self.metrics = EdgeMetrics(node.decoder.cost_model, lambda: node.cloud, lambda: dict(node.decoder.ahead_records))
        self.slots = ConcurrencyLimit(api.max_concurrent_requests)
        self.metrics.in_flight.set_function(lambda: self.slots.in_flight)
        # One thread: a long prompt is tokenized off the event loop, and the tokenizer is never shared by two.
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")

    def settings(self, body: SamplingFields, prompt_tokens: int, plan: RequestPlan) -> EdgeSettings | JSONResponse:
        """The request's decoding settings, or the 400 that says which field is wrong."""
        if problem := request_problem(body):
            return openai_error(400, problem[1], problem[0])
        if body.stream and body.echoed is not None and body.wanted_logprobs is not None:
            return openai_error(400, "echo with logprobs is answered whole, not streamed: the prompt's logprobs come "
                                "with the generation's end; send stream: false", "echo")
        if plan.grammar is not None:
            try:  # compiled once here (cached): a grammar the engine refuses is the request's mistake
                self.node.draft.grammars.compile(plan.grammar)
            except GrammarError as err:
                return openai_error(400, f"{plan.grammar_field}: {err}", plan.grammar_field)
        asked = body.mode or self.api.default_mode
        if asked not in MODE_CHOICES:
            return openai_error(400, f"unknown mode {asked!r}; choose one of {', '.join(MODE_CHOICES)}", "mode")
        mode = settings_mode(asked)  # auto: set up as its edge speculation, which the placer may trade for another
        if needs_cloud(asked) and self.node.cloud is None:  # a drafting mode runs from its draft alone
            return openai_error(400, f"mode {asked!r} needs a cloud, and this daemon has none (--cloud)", "mode")
        proposer = body.proposer or self.api.default_proposer
        if proposer not in PROPOSERS:
            return openai_error(400, f"unknown proposer {proposer!r}; choose one of {', '.join(PROPOSERS)}", "proposer")
        placement = body.placement or self.api.default_placement
        if problem := self._placement_problem(placement):
            return openai_error(400, problem, "placement")
        max_tokens = self._max_tokens(body, mode, prompt_tokens)
        if isinstance(max_tokens, JSONResponse):
            return max_tokens
        try:
            bias = logit_bias_pairs(body.logit_bias, self.node.draft.vocab_size)
        except ValueError as err:
            return openai_error(400, str(err), "logit_bias")
        sampling = SamplingParams(body.temperature, max(body.top_k, 0), body.top_p, body.seed or 0,
                                  body.presence_penalty, body.frequency_penalty, body.repetition_penalty, bias,
                                  plan.grammar, body.wanted_logprobs,
                                  body.wanted_logprobs if body.echoed is not None else None)
        policy = body.policy or (self.api.default_policy if mode in POLICY_MODES else None)
        branch_tokens = body.branch_tokens if body.branch_tokens is not None else (
            self.api.default_branch_tokens if takes_trees(mode_of(mode)) else 0)
        try:
            check_branching(branch_tokens, mode_of(mode))
        except ValueError as err:
            return openai_error(400, str(err), "branch_tokens")
        try:
            decode = DecodeSettings(mode=mode, max_new_tokens=max_tokens, sampling=sampling, k=body.k or self.api.default_k,
                                    policy=policy, proposer=proposer, branch_tokens=branch_tokens)
        except ValueError as err:  # the other fields were checked above; only the policy can be wrong here
            return openai_error(400, str(err), "policy")
        pipeline = body.pipeline or self.api.default_pipeline
        fits = decode.traits.dists_on_rejection and not (pipeline == "send-ahead" and decode.traits.pipelines)
        return EdgeSettings(decode=decode, cloud_retry_s=self.api.cloud_retry_s, stop=body.stop_sequences,
                            pipeline=pipeline, placement=placement, chooses_mode=chooses_mode(asked),
                            draft_dists=self.api.draft_dists if fits else "full",
                            request_deadline_s=body.request_deadline_s or self.api.request_deadline_s,
                            pipeline_adapts=self.api.pipeline_adapts, priority=body.priority)

    def _placement_problem(self, placement: str) -> str | None:
        """Why this edge cannot serve `placement` now (never a silent fallback to the edge); None if it can."""
        if placement not in PLACEMENTS:
            return f"unknown placement {placement!r}; choose one of {', '.join(PLACEMENTS)}"
        if placement != "edge" and self.node.cloud is None:
            return f"placement {placement!r} needs a cloud, and this daemon has none (--cloud)"
        if placement == "cloud" and not self.node.cloud.drafts():
            return ("placement 'cloud' needs a cloud replica with a draft of its own (sprinter cloud serve --draft); "
                    "none of this daemon's has one now")
        return None

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
        with tracer.span("edge.request", chat=chat, stream=bool(body.stream), n=body.n) as span:
            response = await self._respond(request, body, encode, chat, plan)
            span.set(status=response.status_code)
            return response

    async def _respond(self, request: Request, body: SamplingFields, encode: Callable[[], list[int]],
                       chat: bool, plan: RequestPlan) -> Response:
        if not self.slots.try_acquire(body.n):
            self.metrics.rejected.labels("busy").inc()
            return openai_error(429, f"{self.slots.limit} generations are in flight, this daemon's limit "
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
                          LogprobFormat(self.node.draft.tokenizer, chat) if body.wanted_logprobs is not None else None,
                          settings.stop, (body.echoed, prompt_ids) if body.echoed is not None else None)
            choices = [choice_settings(settings, i) for i in range(body.n)]
            if not body.stream:
                return await self._whole(request, prompt_ids, choices, reply)
            response = await self._streamed(prompt_ids, choices, reply)
            handed_to_stream = isinstance(response, GuardedStream)
            return response
        finally:
            if not handed_to_stream:
                self.slots.release(body.n)

    async def _whole(self, request: Request, prompt_ids: list[int], choices: list[EdgeSettings],
                     reply: Reply) -> Response:
        generations = [asyncio.create_task(self.node.decoder.generate(prompt_ids, s)) for s in choices]
        watch = asyncio.create_task(client_left(request.receive))
        all_done = asyncio.gather(*generations)
        try:
            await asyncio.wait({all_done, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not all_done.done():  # the client left (or the server is stopping): stop paying for it
                all_done.cancel()
                self.metrics.cancelled.inc()
                log.info("request %s cancelled: the client disconnected", reply.request_id)
        if all_done.cancelled():
            return Response(status_code=499)  # nginx's "client closed request"; nobody is there to read it
        results = all_done.result()
        for result in results:
            self.metrics.observe(result)
        if refused := next((r for r in results if refused_before_a_token(r)), None):
            return refusal_response(refused.error)
        body = completion(reply.request_id, reply.created, reply.model, reply.chat, results, reply.prompt_tokens,
                          reply.parse_calls, reply.logprobs, reply.echo)
        degraded = next((r.degraded_reason for r in results if r.degraded), None)
        return JSONResponse(body, headers=degraded_headers(degraded))

    async def _streamed(self, prompt_ids: list[int], choices: list[EdgeSettings], reply: Reply) -> Response:
        streams = [self.node.decoder.stream(prompt_ids, s) for s in choices]
        # The first items come before the headers, so that a refusal before any token gets its own status.
        firsts = list(await asyncio.gather(*(anext(s) for s in streams)))
        if refused := next((f for f in firsts if refused_before_a_token(f)), None):
            for stream in streams:
                await stream.aclose()
            self.metrics.observe(refused)
            return refusal_response(refused.error)
        finished = asyncio.Event()

        async def cleanup() -> None:
            for stream in streams:
                await stream.aclose()  # cancels a generation still running
            self.slots.release(len(streams))
            if not finished.is_set():
                self.metrics.cancelled.inc()

        degraded = next((f.reason for f in firsts if isinstance(f, Degraded)), None)
        body = stream_body(reply, self.node.draft.tokenizer, merged(streams, firsts), len(streams),
                           self.metrics.observe, finished)
        return GuardedStream(body, cleanup, headers=degraded_headers(degraded) if degraded else None)

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
                "default_policy": self.api.default_policy, "default_pipeline": self.api.default_pipeline,
                "default_proposer": self.api.default_proposer, "default_branch_tokens": self.api.default_branch_tokens,
                "default_placement": self.api.default_placement, "placement": node.decoder.placer.snapshot(),
                "in_flight": self.slots.in_flight,
                "context_limit": node.decoder.context_limit(settings_mode(self.api.default_mode)),
                "cost_model": node.decoder.cost_model.snapshot()}




def choice_settings(settings: EdgeSettings, index: int) -> EdgeSettings:
    """Choice `index` of a request: its sampling seeded seed + index (a request with a seed is reproducible)."""
    if index == 0:
        return settings
    sampling = replace(settings.decode.sampling, seed=(settings.decode.sampling.seed + index) % 2**64)
    return replace(settings, decode=replace(settings.decode, sampling=sampling))
