"""Streamed responses: server-sent events in OpenAI's chunk format, and text deltas from growing token lists."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from common.spec.generation import StopSequences


class IncrementalText:
    """Decodes a growing token list into text deltas, holding back half-finished UTF-8 characters and any
    tail that might begin a stop sequence (the client must never see a stop sequence, even in part).

    Linear in the stream's length: each push decodes a window, not the whole list. The window starts
    at `prefix` (tokens already turned into text) and its text up to `read` is known; the delta is
    what decoding the window with the new tokens adds to that. Starting the window a token early
    keeps the decoding in context (a leading space, a byte-level merge), so the deltas add up to the
    whole list's decoding. A stop string cannot begin in text already sent: every tail that could
    begin one was held back, so matching runs over the unsent text alone.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = StopSequences(stop, self._decode) if stop else None
        self.tokens: list[int] = []
        self.prefix = 0  # the window's first token
        self.read = 0  # tokens whose text has been taken
        self.unsent = ""  # decoded, not yet sent: a tail that may begin a stop string
        self.sent_chars = 0
        self.stopped = False  # a stop string was found: nothing more is sent before `finish`
        self.decoded_tokens = 0  # tokens decoded so far, all windows together (the work a stream costs)

    def _decode(self, tokens: list[int]) -> str:
        self.decoded_tokens += len(tokens)
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def push(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        if self.stopped:
            return ""
        known = self._decode(self.tokens[self.prefix:self.read])
        window = self._decode(self.tokens[self.prefix:])
        if window.endswith("\ufffd") or len(window) <= len(known):
            return ""  # inside a multi-byte character, or nothing visible yet
        self.unsent += window[len(known):]
        self.prefix, self.read = self.read, len(self.tokens)
        text = self.unsent
        if self.stop is not None:
            text = self.stop.cut(text)
            self.stopped = len(text) < len(self.unsent)
            text = text[: len(text) - self.stop.held_back(text)]
        self.unsent = self.unsent[len(text):]
        self.sent_chars += len(text)
        return text

    def finish(self, final_text: str) -> str:
        """The rest of the final text (held-back characters, a character the generation ended inside)."""
        delta = final_text[self.sent_chars:]
        self.sent_chars = len(final_text)
        return delta


@dataclass(frozen=True)
class ChunkFormat:
    """The `data:` lines of one streamed response (a completion or a chat completion)."""

    request_id: str
    created: int
    model: str
    chat: bool
    include_usage: bool = False  # stream_options.include_usage: every chunk has `usage`, null until the last

    def _line(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        if self.include_usage:
            extra.setdefault("usage", None)
        return "data: " + json.dumps({"id": self.request_id, "object": kind, "created": self.created,
                                      "model": self.model, "choices": choices, **extra}) + "\n\n"

    @staticmethod
    def error_object(message: str) -> str:
        """OpenAI's in-stream error (the openai client raises it as an APIError)."""
        return json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": None}})

    def role(self, index: int = 0) -> str:
        """A chat stream opens by naming the assistant's role (once per choice)."""
        return self._line([{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])

    def event(self, delta: str | dict[str, Any] | None, finish: str | None = None, degraded: str | None = None,
              logprobs: dict[str, Any] | None = None, index: int = 0, **extra: Any) -> str:
        """One chunk: text, or (chat) a whole delta object such as a tool call's; from the point a generation
        degrades, every chunk says so and why (`sprinter.degraded`, `sprinter.degraded_reason`)."""
        if degraded and "sprinter" not in extra:
            extra["sprinter"] = {"degraded": True, "degraded_reason": degraded}
        if self.chat:
            content = {} if delta is None else delta if isinstance(delta, dict) else {"content": delta}
            choice = {"index": index, "delta": content, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": delta or "", "finish_reason": finish, "logprobs": logprobs}
        return self._line([choice], **extra)

    def usage(self, usage: dict[str, Any]) -> str:
        """The chunk `include_usage` asks for, after the last choice: no choices, the whole request's usage."""
        return self._line([], usage=usage)


DONE = "data: [DONE]\n\n"
