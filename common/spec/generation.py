"""One generation's tokens: what is committed, what the caller already has, and when it is over.

Every decoding loop (the local decoder, the edge decoder, verifier data collection) keeps its output
here, so the rules about the end of a generation are written once: a generation stops at its first
EOS (kept), at a stop sequence, at `max_new_tokens`, or when the context is full (`context_limit`:
what the verifying backend can hold); tokens past any of these are never delivered.

Stop sequences (OpenAI's `stop`) are text, so they are matched on the decoded text, across token
boundaries. They live here rather than in the HTTP layer because a match must end the decoding
loop (no more rounds, no more target calls), not only trim what the client sees; the generation
keeps the tokens up to the one that completes the match and `StopSequences.cut` trims the text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from common.spec.modes import DecodeSettings
from common.sampling.logprobs import TokenLogprob
from common.stats import StatsRecorder


@dataclass(frozen=True)
class Released:
    """Tokens handed to the caller, in order, with their logprobs when the request asked for them."""

    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None


def _ignore(released: Released) -> None:
    """The default consumer: callers that only want the final result."""


@dataclass(frozen=True)
class StopSequences:
    """Strings that end a generation; `decode` turns token ids into the text the client sees."""

    strings: tuple[str, ...]
    decode: Callable[[list[int]], str]

    @property
    def window(self) -> int:
        """Tokens looked back over for a match that began before the new ones (a token holds >= 1 char,
        except pieces of a multi-byte character; four per char covers UTF-8)."""
        return 4 * max(len(s) for s in self.strings) + 4

    def match_end(self, tokens: list[int], checked: int) -> int | None:
        """How many of `tokens` to keep when a stop string ends in tokens[checked:], else None."""
        start = max(0, checked - self.window)
        if not any(s in self.decode(tokens[start:]) for s in self.strings):
            return None
        for end in range(checked + 1, len(tokens) + 1):
            text = self.decode(tokens[start:end])
            if any(s in text for s in self.strings):
                return end
        return None  # only the whole window's decoding holds it (a byte-level merge); nothing to cut at

    def cut(self, text: str) -> str:
        """The text before the first stop string (OpenAI's output never includes it)."""
        found = [i for i in (text.find(s) for s in self.strings) if i >= 0]
        return text[: min(found)] if found else text

    def held_back(self, text: str) -> int:
        """How many trailing characters of `text` might begin a stop string: a stream holds them back."""
        return max((n for s in self.strings for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if s.startswith(text[-n:])), default=0)


@dataclass
class Generation:
    prompt_ids: list[int]
    settings: DecodeSettings
    eos_token_ids: frozenset[int]
    recorder: StatsRecorder
    emit: Callable[[Released], None] = _ignore  # receives each batch of delivered tokens, in order
    new_tokens: list[int] = field(default_factory=list)
    released: int = 0  # how many of new_tokens the caller already has
    context_limit: int | None = None  # tokens the context (prompt + new) may hold; None: no limit but max_new_tokens
    stop: StopSequences | None = None
    stopped: bool = False  # a stop sequence matched
    context_full: bool = False  # no block fits before context_limit any more (see `block_room`)
    # one per new token when the request asks for logprobs (common/sampling/logprobs.py), else None
    logprobs: list[TokenLogprob] | None = None

    def __post_init__(self) -> None:
        if self.settings.sampling.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def top_logprobs(self) -> int | None:
        """N of the top N alternatives the request asks for per token; None: it asks for no logprobs."""
        return self.settings.sampling.logprobs

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.new_tokens

    @property
    def budget(self) -> int:
        """Tokens still allowed before the length limit (max_new_tokens, or a full context)."""
        budget = self.settings.max_new_tokens - len(self.new_tokens)
        if self.context_limit is not None:
            budget = min(budget, self.context_limit - len(self.prompt_ids) - len(self.new_tokens))
        return budget

    @property
    def block_room(self) -> int:
        """Longest block a verified round may draft: within the budget, and leaving a place in the context
        for the target's token after the block (a cloud refuses a block that could overflow its context)."""
        if self.context_limit is None:
            return self.budget
        return min(self.budget, self.context_limit - len(self.prompt_ids) - len(self.new_tokens) - 1)

    @property
    def ended_at_stop(self) -> bool:
        """Ended by EOS or a stop sequence (OpenAI's finish_reason "stop"), rather than by a limit."""
        return self.stopped or bool(self.new_tokens) and self.new_tokens[-1] in self.eos_token_ids

    @property
    def done(self) -> bool:
        return self.budget <= 0 or self.context_full or self.ended_at_stop

    @property
    def finish_reason(self) -> str:
        """OpenAI's: "stop" at EOS or a stop sequence, "length" otherwise (a limit, or cut short)."""
        return "stop" if self.ended_at_stop else "length"

    def commit(self, start: int, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """Replace new_tokens[start:] by `tokens` (a verdict's), cut at EOS or the length limit, deliver them;
        `logprobs`, one per token, when the request asks for them.

        Tokens released before a verdict (sprinter's passed tokens) are a prefix of what it keeps; they keep the
        logprobs they were released with.
        """
        if self.stopped:  # a passed token already completed a stop sequence: nothing after it counts
            return
        del self.new_tokens[start:]
        self.new_tokens.extend(tokens)
        if self.logprobs is not None:
            if logprobs is None or len(logprobs) != len(tokens):
                raise ValueError("this generation keeps logprobs: every commit brings one per token")
            released = self.logprobs[start:self.released]
            self.logprobs[start:] = released + list(logprobs[len(released):])
        self._cut()
        self.release()

    def append_final(self, token: int, logprob: TokenLogprob | None = None) -> None:
        """A token no later verdict can take back (one sprinter's verifier passed): deliver it now."""
        if self.done:  # a stop sequence matched on an earlier passed token of this block
            return
        self.new_tokens.append(token)
        if self.logprobs is not None:
            if logprob is None:
                raise ValueError("this generation keeps logprobs: a released token brings its own")
            self.logprobs.append(logprob)
        self.release()

    def release(self) -> None:
        if self.stop is not None and len(self.new_tokens) > self.released:
            end = self.stop.match_end(self.new_tokens, self.released)
            if end is not None:
                del self.new_tokens[end:]
                self._trim_logprobs()
                self.stopped = True
        if len(self.new_tokens) > self.released:
            logprobs = self.logprobs[self.released:] if self.logprobs is not None else None
            self.emit(Released(self.new_tokens[self.released:], logprobs))
            self.recorder.emitted(len(self.new_tokens) - self.released)
            self.released = len(self.new_tokens)

    def _cut(self) -> None:
        """Keep up to the first EOS (included) and within the budget."""
        limit = len(self.new_tokens) - max(0, -self.budget)
        for i, token in enumerate(self.new_tokens[:limit]):
            if token in self.eos_token_ids:
                limit = i + 1
                break
        del self.new_tokens[limit:]
        self._trim_logprobs()

    def _trim_logprobs(self) -> None:
        if self.logprobs is not None:
            del self.logprobs[len(self.new_tokens):]
