"""One choice of a response: its text or message, tool calls, finish reason and logprobs, whole or streamed.

Logprobs follow OpenAI's two shapes: chat's `{"content": [{token, logprob, bytes, top_logprobs}]}` and the
completions API's `{tokens, token_logprobs, top_logprobs, text_offset}`. The values are the raw distribution's
(common/sampling/logprobs.py): the target's for every token a target produced or judged, the draft's for a token none
did (mode draft, a degraded stretch, a token sprinter's verifier passed); `sprinter.logprob_sources` says which,
token by token.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from common.sampling.logprobs import TokenLogprob
from edge.api.tool_calls import ToolCallStream, parse_tool_calls
from edge.api.sse import IncrementalText


class LogprobFormat:
    """Turns TokenLogprobs into OpenAI's chat or completions logprobs objects."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat: bool) -> None:
        self.tokenizer = tokenizer
        self.chat = chat

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def entries(self, logprobs: list[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
        """The logprobs object of consecutive tokens; `text_offset`: where the first one's text begins."""
        if self.chat:
            return {"content": [self._chat_entry(lp) for lp in logprobs]}
        texts, offsets, at = [self.text(lp.token) for lp in logprobs], [], text_offset
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {"tokens": texts,
                "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{self.text(t): v for t, v in lp.top} for lp in logprobs],
                "text_offset": offsets}

    def echoed(self, prompt_ids: list[int], prompt_logprobs: list[TokenLogprob],
               logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        """Completions' logprobs with `echo`: the prompt's tokens first (the first has no logprob, as OpenAI
        returns it), then the completion's."""
        first = {"tokens": [self.text(prompt_ids[0])], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
        rest = self.entries(list(prompt_logprobs) + list(logprobs or []), len(first["tokens"][0]))
        return {key: first[key] + rest[key] for key in first}

    def _chat_entry(self, lp: TokenLogprob) -> dict[str, Any]:
        def one(token: int, logprob: float) -> dict[str, Any]:
            text = self.text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        return {**one(lp.token, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]}


def sources(logprobs: list[TokenLogprob] | None) -> list[str] | None:
    """Per token, whose logprob it carries: "target" or "draft" (the sprinter extension's `logprob_sources`)."""
    return None if logprobs is None else [lp.source for lp in logprobs]


def whole_choice(index: int, text: str, finish: str, chat: bool, parse_calls: bool,
                 logprobs: dict[str, Any] | None) -> dict[str, Any]:
    """A non-streamed choice; with `parse_calls` the reply's tool calls become the message's `tool_calls`
    (finish_reason "tool_calls")."""
    if not chat:
        return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if parse_calls:
        content, calls = parse_tool_calls(text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
            finish = "tool_calls" if finish == "stop" else finish
    return {"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs}


class ChoiceDeltas:
    """One choice's streamed deltas from its tokens: text (IncrementalText), or with `parse_calls` chat deltas where
    the model's tool calls become `tool_calls` (edge/api/tool_calls.py: ToolCallStream)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...], parse_calls: bool) -> None:
        self.text = IncrementalText(tokenizer, stop)
        self.calls = ToolCallStream() if parse_calls else None

    def push(self, tokens: list[int]) -> list[str | dict[str, Any]]:
        return self._split(self.text.push(tokens))

    def finish(self, final_text: str) -> list[str | dict[str, Any]]:
        deltas = self._split(self.text.finish(final_text))
        return deltas + (self.calls.finish() if self.calls is not None else [])

    def finish_reason(self, reason: str) -> str:
        """OpenAI's "tool_calls" when the reply called tools (and was not cut by a limit), else the generation's."""
        return "tool_calls" if self.calls is not None and self.calls.made_calls and reason == "stop" else reason

    def _split(self, text: str) -> list[str | dict[str, Any]]:
        if not text:
            return []
        return [text] if self.calls is None else self.calls.push(text)
