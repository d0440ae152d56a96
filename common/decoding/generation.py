"""One generation's tokens: what is committed, what the caller already has, and when it is over.

Every decoding loop (the local engine, the edge decoder, verifier data collection) keeps its output
here, so the rules about the end of a generation are written once: a generation stops at its first
EOS (kept) or at `max_new_tokens`, and tokens past either are never delivered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from common.decoding.modes import DecodeSettings
from common.stats import StatsRecorder


def _ignore(tokens: list[int]) -> None:
    """The default consumer: callers that only want the final result."""


@dataclass
class Generation:
    prompt_ids: list[int]
    settings: DecodeSettings
    eos_token_ids: frozenset[int]
    recorder: StatsRecorder
    emit: Callable[[list[int]], None] = _ignore  # receives each batch of delivered tokens, in order
    new_tokens: list[int] = field(default_factory=list)
    released: int = 0  # how many of new_tokens the caller already has

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.new_tokens

    @property
    def budget(self) -> int:
        """Tokens still allowed before the length limit."""
        return self.settings.max_new_tokens - len(self.new_tokens)

    @property
    def done(self) -> bool:
        return self.budget <= 0 or bool(self.new_tokens) and self.new_tokens[-1] in self.eos_token_ids

    def commit(self, start: int, tokens: list[int]) -> None:
        """Replace new_tokens[start:] by `tokens` (a verdict's), cut at EOS or the length limit, deliver them.

        Tokens released before a verdict (sprinter's passed tokens) are a prefix of what it keeps.
        """
        del self.new_tokens[start:]
        self.new_tokens.extend(tokens)
        self._cut()
        self.release()

    def append_final(self, token: int) -> None:
        """A token no later verdict can take back (one sprinter's verifier passed): deliver it now."""
        self.new_tokens.append(token)
        self.release()

    def release(self) -> None:
        if len(self.new_tokens) > self.released:
            self.emit(self.new_tokens[self.released:])
            self.recorder.emitted(len(self.new_tokens) - self.released)
            self.released = len(self.new_tokens)

    def _cut(self) -> None:
        """Keep up to the first EOS (included) and at most max_new_tokens."""
        limit = self.settings.max_new_tokens
        for i, token in enumerate(self.new_tokens[:limit]):
            if token in self.eos_token_ids:
                limit = i + 1
                break
        del self.new_tokens[limit:]
