"""Streamed responses: server-sent events in OpenAI's chunk format, and text deltas from growing token lists."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase


class IncrementalText:
    """Decodes a growing token list into text deltas, holding back half-finished UTF-8 characters."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
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


@dataclass(frozen=True)
class ChunkFormat:
    """The `data:` lines of one streamed response (a completion or a chat completion)."""

    request_id: str
    created: int
    model: str
    chat: bool

    def _line(self, choice: dict[str, Any], **extra: Any) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return "data: " + json.dumps({"id": self.request_id, "object": kind, "created": self.created,
                                      "model": self.model, "choices": [choice], **extra}) + "\n\n"

    def role(self) -> str:
        """A chat stream opens by naming the assistant's role."""
        return self._line({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})

    def event(self, delta: str | None, finish: str | None = None, **extra: Any) -> str:
        if self.chat:
            choice = {"index": 0, "delta": {} if delta is None else {"content": delta}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        return self._line(choice, **extra)


DONE = "data: [DONE]\n\n"
