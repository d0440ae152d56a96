"""Drafting a pending block, one token at a time, shared by the local engine and the edge loop.

`draft_tokens` is a generator so that each caller decides what happens between steps: the local
engine just collects the block; the edge streams verifier-passed tokens to its client as they come
and runs each step off its event loop. Where the block ends is the call policy's decision
(common/call_policy.py): after each token it sees a_1..a_g, each token's estimated probability that
the target accepts it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Protocol

import torch

from common.cached_lm import ForwardOutput
from common.call_policy import CallPolicy, CostModel
from common.sampling import SamplingParams, logits_to_probs, sample
from common.verifier import DraftStep, Verifier, draft_confidence_features

if TYPE_CHECKING:  # common.companion builds on DraftLM below
    from common.companion import Companion


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
    flagged: bool  # the verifier does not trust it (score < threshold)
    ends_block: bool  # the policy says send, the cap or EOS: the block goes to the target now

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
                 generator: torch.Generator, eos_token_ids: frozenset[int], verifier: Verifier | None = None,
                 policy: CallPolicy | None = None, cost_model: CostModel | None = None,
                 companion: Companion | None = None) -> Iterator[DraftedToken]:
    """Draft after `context` until `policy.should_send(a_1..a_g, cap=limit)`, EOS, or `limit` tokens.

    a_i is the verifier's score (the learned verifier's is a calibrated acceptance probability), else
    the draft's probability of its token at T=1 (not the sampling distribution's: under greedy that
    is one-hot). Without a policy the block runs to `limit` or EOS. `cost_model`, when given, learns
    the time of a draft step: forward, sampling and scoring, all that one more token costs the edge.
    `companion`, when given, adds its (S, A) features to every step (so its forward counts as drafting cost).
    """
    block: list[int] = []
    accept_probs: list[float] = []
    while len(block) < limit:
        started = time.perf_counter()
        out = draft_lm.advance_to(context + block)
        token, p_draft = next_token(out.logits[-1], sampling, generator)
        signals = companion.features(context + block, out.logits[-1], token) if companion is not None else None
        block.append(token)
        step = DraftStep(token, out.logits[-1], out.hidden[-1] if out.hidden is not None else None, signals)
        score = verifier.score(step) if verifier is not None else None
        flagged = score is not None and score < verifier.threshold
        if policy is not None:
            accept_probs.append(score if score is not None else draft_confidence_features(step)[0])
        if cost_model is not None:
            cost_model.observe_draft_step((time.perf_counter() - started) * 1e3)
        # The limit is checked here too: every policy sends at the cap, but the budget must hold regardless.
        ends_block = (len(block) >= limit or token in eos_token_ids
                      or (policy is not None and policy.should_send(accept_probs, cap=limit)))
        yield DraftedToken(step, p_draft, flagged, ends_block)
        if ends_block:
            return
