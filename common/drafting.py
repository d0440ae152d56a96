"""Drafting a pending block, one token at a time, shared by the local engine and the edge loop.

`draft_tokens` is a generator so that each caller decides what happens between steps: the local
engine just collects the block; the edge streams verifier-passed tokens to its client as they come
and runs each step off its event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Protocol

import torch

from common.cached_lm import ForwardOutput
from common.sampling import SamplingParams, logits_to_probs, sample
from common.verifier import DraftStep, Verifier, flags


class DraftLM(Protocol):
    """What drafting needs of a runtime: the torch `CachedLM` and the edge's ONNX runtime both fit."""

    def advance_to(self, context: list[int], n_logits: int = 1) -> ForwardOutput: ...


def next_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> tuple[int, torch.Tensor]:
    """Pick a token from logits [V]; also return the distribution it was picked from."""
    probs = logits_to_probs(logits, sampling)
    # Greedy: the argmax directly; multinomial over a one-hot of 150k entries costs milliseconds.
    return (int(probs.argmax()) if sampling.greedy else sample(probs, generator)), probs


@dataclass(frozen=True)
class DraftedToken:
    step: DraftStep  # token, raw logits, hidden state: what the verifier judged
    p_draft: torch.Tensor  # [V] the distribution the token was sampled from
    flagged: bool  # the verifier does not trust it
    ends_block: bool  # flagged, the cap, the budget or EOS: the block goes to the target now

    @property
    def token(self) -> int:
        return self.step.token


@dataclass
class PendingBlock:
    drafted: list[DraftedToken] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return [d.token for d in self.drafted]

    @property
    def p_draft(self) -> torch.Tensor:
        return torch.stack([d.p_draft for d in self.drafted])

    def __len__(self) -> int:
        return len(self.drafted)


def draft_tokens(draft_lm: DraftLM, context: list[int], limit: int, sampling: SamplingParams,
                 generator: torch.Generator, eos_token_ids: frozenset[int],
                 verifier: Verifier | None = None) -> Iterator[DraftedToken]:
    """Draft up to `limit` tokens after `context`; with a verifier, stop after the first flagged one."""
    block: list[int] = []
    while len(block) < limit:
        out = draft_lm.advance_to(context + block)
        token, p_draft = next_token(out.logits[-1], sampling, generator)
        block.append(token)
        step = DraftStep(token, out.logits[-1], out.hidden[-1] if out.hidden is not None else None)
        flagged = verifier is not None and flags(verifier, step)
        ends_block = flagged or len(block) == limit or token in eos_token_ids
        yield DraftedToken(step, p_draft, flagged, ends_block)
        if ends_block:
            return
