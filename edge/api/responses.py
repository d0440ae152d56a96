"""Answering a request: a whole JSON response, or a stream of server-sent events, over one or n generations.

With n > 1 the request's n generations run at once (each seeded seed + i); a stream interleaves their chunks,
each naming its choice's `index`, and ends with one final chunk per choice, the usage, and `[DONE]`.
What a client can count on: a stream always ends properly (an error mid-stream included); a generation
the cloud refuses before its first token fails the request with the refusal's status; a degraded
generation says so in every chunk from then on, and a whole response in `x-sprinter-degraded`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from common.spec.generation import Released
from edge.api.choices import ChoiceDeltas, LogprobFormat
from edge.api.schemas import openai_error, sprinter_extension, usage
from edge.api.sse import DONE, ChunkFormat
from edge.cloud_link.client import CloudLinkError
from edge.decoding.decoder import Degraded, EdgeResult

log = logging.getLogger(__name__)

# A cloud refusal before a single token was made: the whole request failed, with this HTTP status (else 502).
REFUSAL_STATUS = {"INVALID_ARGUMENT": 400, "OUT_OF_RANGE": 400, "RESOURCE_EXHAUSTED": 429}

Item = Released | Degraded | EdgeResult


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
    stop: tuple[str, ...] = ()
    echo: tuple[str, list[int]] | None = None  # completions' echo: the prompt's text and ids, before the completion


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


async def client_left(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns when the client disconnects (the body was read already: nothing else arrives before that)."""
    while (await receive())["type"] != "http.disconnect":
        pass


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


def refused_before_a_token(result: Item) -> bool:
    return isinstance(result, EdgeResult) and result.error is not None and not result.token_ids


async def merged(streams: list[AsyncIterator[Item]], firsts: list[Item]) -> AsyncIterator[tuple[int, Item]]:
    """(choice index, item) from n generation streams as they come; each stream's last item is its EdgeResult."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, items: AsyncIterator[Item], first: Item) -> None:
        try:
            await queue.put((index, first))
            if not isinstance(first, EdgeResult):
                async for item in items:
                    await queue.put((index, item))
        except Exception as err:  # noqa: BLE001 -- handed to the consumer, which ends the stream properly
            await queue.put((index, err))

    pumps = [asyncio.create_task(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
    finished = 0
    try:
        while finished < len(streams):
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            finished += isinstance(item, EdgeResult)
            yield index, item
    finally:
        for task in pumps:
            task.cancel()


@dataclass
class ChoiceState:
    """One choice of a stream: its deltas, where its logprobs' text stands, whether it degraded."""

    deltas: ChoiceDeltas
    text_offset: int = 0
    degraded: str | None = None
    result: EdgeResult | None = None


async def stream_body(reply: Reply, tokenizer: Any, items: AsyncIterator[tuple[int, Item]], n: int,
                      observe: Callable[[EdgeResult], None], finished: asyncio.Event) -> AsyncIterator[str]:
    """The `data:` lines of a streamed response over `n` choices."""
    chunks = ChunkFormat(reply.request_id, reply.created, reply.model, reply.chat, reply.include_usage)
    states = [ChoiceState(ChoiceDeltas(tokenizer, reply.stop, reply.parse_calls)) for _ in range(n)]
    for index in range(n):
        if reply.chat:
            yield chunks.role(index)
        elif reply.echo is not None:  # the prompt first, as the completion's opening text
            yield chunks.event(reply.echo[0], index=index)
    try:
        async for index, item in items:
            for line in _lines(chunks, reply, states[index], index, item):
                yield line
            if isinstance(item, EdgeResult):
                observe(item)
    except Exception as err:  # a bug of ours mid-stream: say so in the stream, and still end it properly
        log.exception("request %s failed mid-stream", reply.request_id)
        yield "data: " + ChunkFormat.error_object(f"internal error: {err}") + "\n\n"
        yield DONE
        return
    finished.set()
    if chunks.include_usage:
        yield chunks.usage(usage(reply.prompt_tokens, [s.result for s in states if s.result is not None]))
    yield DONE


def _lines(chunks: ChunkFormat, reply: Reply, state: ChoiceState, index: int, item: Item) -> list[str]:
    if isinstance(item, Degraded):
        state.degraded = item.reason
        return []
    if isinstance(item, EdgeResult):
        state.result = item
        lines = [chunks.event(delta, degraded=state.degraded, index=index) for delta in state.deltas.finish(item.text)]
        return lines + [chunks.event(None, state.deltas.finish_reason(item.finish_reason), index=index,
                                     sprinter=sprinter_extension(item))]
    pieces = state.deltas.push(item.tokens)
    logprobs = None
    if reply.logprobs is not None and item.logprobs:  # the tokens' logprobs ride with their text, or come alone
        logprobs = reply.logprobs.entries(item.logprobs, state.text_offset)
        if not reply.chat:  # completions' logprobs place each token in the text: the next chunk's start there
            state.text_offset += sum(map(len, logprobs["tokens"]))
        pieces = pieces or [""]
    return [chunks.event(delta, degraded=state.degraded, logprobs=logprobs if i == 0 else None, index=index)
            for i, delta in enumerate(pieces)]
