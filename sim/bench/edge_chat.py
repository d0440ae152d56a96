"""A streamed chat request through an edge daemon's OpenAI API, timed; and synthetic text of a set token length.

The text is made of plain English words drawn deterministically from a seed, so a benchmark's conversations and
system prompts are its own (no public benchmark prompt) and every run sends the same tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import httpx

from sim.bench.load import RequestSpec, send_request

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


async def stream_chat(client: httpx.AsyncClient, base: str, messages: list[dict[str, str]],
                      max_tokens: int) -> ChatReply:
    """A greedy streamed chat completion (with usage) to the edge at `base`, in its default mode; raise on any
    failure (sim/bench/load.py judges it)."""
    answer = await send_request(client, base, RequestSpec(0, "", True, None, max_tokens, True, messages=tuple(messages)))
    if not answer.ok or answer.ttft_s is None or not answer.sprinter or "stats" not in answer.sprinter:
        raise RuntimeError(answer.error or "cut stream: no content or no stats in the final chunk")
    return ChatReply(answer.ttft_s * 1e3, answer.latency_s * 1e3, answer.text, answer.prompt_tokens or 0,
                     answer.tokens, answer.sprinter["stats"])
