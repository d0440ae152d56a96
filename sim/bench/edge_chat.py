"""A streamed chat request through an edge daemon's OpenAI API, timed; and synthetic text of a set token length.

The text is made of plain English words drawn deterministically from a seed, so a benchmark's conversations and
system prompts are its own (no public benchmark prompt) and every run sends the same tokens.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx

WORDS = ("the service reads each request and writes a short answer to the log before it closes the file "
         "a small team keeps the build green while the nightly jobs move data between the two stores "
         "every table has a primary key and an owner who reviews the schema when a column changes "
         "the parser splits the input into tokens then folds them into a tree that the checker walks "
         "when the cache is cold the first call waits for the disk and later calls return at once "
         "our guide explains how to name things clearly how to test small parts and how to ship safely "
         "please keep functions short and give every error a message that tells the reader what to fix "
         "the garden behind the station grows beans tomatoes and tall yellow flowers every summer "
         "a river runs past the old mill where children learn to swim and fish on warm evenings").split()


def synthetic_text(seed: int, n_tokens: int, tokenizer: Any) -> str:
    """Sentences of `WORDS` drawn from `seed`, cut to `n_tokens` tokens of `tokenizer` (encoded alone)."""
    rng = random.Random(seed)
    sentences: list[str] = []
    while len(tokenizer.encode(" ".join(sentences), add_special_tokens=False)) < n_tokens:
        words = [rng.choice(WORDS) for _ in range(rng.randint(8, 16))]
        sentences.append(" ".join(words).capitalize() + ".")
    ids = tokenizer.encode(" ".join(sentences), add_special_tokens=False)[:n_tokens]
    return tokenizer.decode(ids)


@dataclass
class ChatReply:
    """One streamed request's outcome: the time to its first content chunk, the whole text and its stats."""

    ttft_ms: float
    total_ms: float
    text: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict[str, Any] = field(default_factory=dict)  # the final chunk's `sprinter.stats`

    @property
    def cached_tokens(self) -> int:
        return int(self.stats.get("cached_tokens", 0))

    @property
    def draft_reused_tokens(self) -> int:
        return int(self.stats.get("draft_reused_tokens", 0))


async def sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any] | None]:
    """The JSON events of a streamed OpenAI answer, in order; None last when the stream ended with [DONE]."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):].strip()
        if payload == "[DONE]":
            yield None
            return
        yield json.loads(payload)


async def stream_chat(client: httpx.AsyncClient, base: str, messages: list[dict[str, str]],
                      max_tokens: int) -> ChatReply:
    """POST a greedy streamed chat completion (with usage) to the edge at `base`; raise on any failure."""
    body = {"model": "x", "messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first_at, pieces, stats, usage, done = None, [], None, None, False
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')}")
        async for event in sse_events(response):
            if event is None:
                done = True
                break
            if "error" in event:
                raise RuntimeError(f"error event in the stream: {event['error']}")
            choice = event["choices"][0] if event.get("choices") else {}
            content = (choice.get("delta") or {}).get("content")
            if content:
                first_at = first_at or time.perf_counter()
                pieces.append(content)
            if choice.get("finish_reason"):
                stats = event["sprinter"]["stats"]
            usage = event.get("usage") or usage
    if not done or stats is None or usage is None or first_at is None:
        raise RuntimeError("cut stream: no content, no final chunk, no usage or no [DONE]")
    return ChatReply((first_at - started) * 1e3, (time.perf_counter() - started) * 1e3, "".join(pieces),
                     usage["prompt_tokens"], usage["completion_tokens"], stats)
