"""Both models in one process: the reference implementation of every decoding mode.

The edge and the cloud split this loop across a network; here it runs end to end, which makes it
the yardstick for their outputs (same inputs and seed -> same tokens) and the local benchmark.

One speculative round:
    draft a pending block (k tokens, or until the verifier flags one, up to the run-length cap)
    -> one target forward over the block -> a verification rule -> keep n_accepted + 1 tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from common.cached_lm import CachedLM
from common.drafting import PendingBlock, draft_tokens, next_token
from common.models import LoadedModel, check_pair
from common.sampling import SamplingParams, logits_to_probs
from common.stats import DecodeStats, StatsRecorder
from common.verification import VERIFY_RULES, VerifyRule
from common.verifier import ConfidenceVerifier, Verifier

log = logging.getLogger(__name__)

MODES = ("draft", "target", "sd", "sd-block", "sprinter", "sprinter-exact")
SPECULATIVE_MODES = ("sd", "sd-block", "sprinter", "sprinter-exact")


@dataclass(frozen=True)
class DecodeSettings:
    mode: str = "sd"
    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    k: int = 5  # block length of sd and sd-block
    max_run_length: int = 20  # sprinter modes: the pending block goes up at this length even without a flag

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.max_new_tokens < 1 or self.k < 1 or self.max_run_length < 1:
            raise ValueError("max_new_tokens, k and max_run_length must be >= 1")


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    mode: str
    stats: DecodeStats


def verify_rule(mode: str, sampling: SamplingParams) -> VerifyRule:
    """The rule each speculative mode applies to a pending block."""
    if mode == "sprinter":
        return VERIFY_RULES["sprinter"]
    if sampling.greedy:
        return VERIFY_RULES["greedy"]  # every lossless rule reduces to it on one-hot distributions
    return VERIFY_RULES["token" if mode == "sd" else "block"]


class LocalEngine:
    def __init__(self, target: LoadedModel | None, draft: LoadedModel | None,
                 verifier: Verifier | None = None) -> None:
        if target is None and draft is None:
            raise ValueError("need at least one model")
        if target is not None and draft is not None:
            check_pair(target, draft)
        self.target = target
        self.draft = draft
        self.verifier: Verifier = verifier or ConfidenceVerifier()
        self.tokenizer = (target or draft).tokenizer
        self.eos_token_ids = (target or draft).eos_token_ids

    def generate(self, prompt_ids: list[int], settings: DecodeSettings) -> GenerationResult:
        generator = torch.Generator().manual_seed(settings.sampling.seed)
        recorder = StatsRecorder(settings.mode)
        if settings.mode in ("target", "draft"):
            new_tokens = self._autoregressive(prompt_ids, settings, generator, recorder)
        else:
            new_tokens = self._speculative(prompt_ids, settings, generator, recorder)
        return GenerationResult(
            token_ids=new_tokens,
            text=self.tokenizer.decode(new_tokens, skip_special_tokens=True),
            mode=settings.mode,
            stats=recorder.finish(len(new_tokens)),
        )

    def _model(self, which: str) -> LoadedModel:
        model = self.target if which == "target" else self.draft
        if model is None:
            raise ValueError(f"this engine has no {which} model")
        return model

    def _finished(self, new_tokens: list[int], max_new_tokens: int) -> tuple[list[int], bool]:
        """Cut at the first EOS (kept) or the length limit; say whether generation is over."""
        for i, token in enumerate(new_tokens[:max_new_tokens]):
            if token in self.eos_token_ids:
                return new_tokens[: i + 1], True
        return new_tokens[:max_new_tokens], len(new_tokens) >= max_new_tokens

    def _autoregressive(self, prompt_ids: list[int], settings: DecodeSettings, generator: torch.Generator,
                        recorder: StatsRecorder) -> list[int]:
        lm = CachedLM(self._model(settings.mode).model)
        new_tokens: list[int] = []
        done = False
        while not done:
            logits = lm.advance_to(prompt_ids + new_tokens).logits[-1]
            if settings.mode == "target":
                recorder.target_calls += 1
            else:
                recorder.draft_forwards += 1
            new_tokens.append(next_token(logits, settings.sampling, generator)[0])
            recorder.emitted(1)
            new_tokens, done = self._finished(new_tokens, settings.max_new_tokens)
        return new_tokens

    def _speculative(self, prompt_ids: list[int], settings: DecodeSettings, generator: torch.Generator,
                     recorder: StatsRecorder) -> list[int]:
        target_lm = CachedLM(self._model("target").model)
        draft_lm = CachedLM(self._model("draft").model, with_hidden=self.verifier.needs_hidden)
        rule = verify_rule(settings.mode, settings.sampling)
        sprinter = settings.mode in ("sprinter", "sprinter-exact")  # drafting stops at the verifier's flag
        new_tokens: list[int] = []
        done = False
        while not done:
            context = prompt_ids + new_tokens
            budget = settings.max_new_tokens - len(new_tokens)
            limit = min(settings.max_run_length if sprinter else settings.k, budget)
            block = PendingBlock(list(draft_tokens(draft_lm, context, limit, settings.sampling, generator,
                                                   self.eos_token_ids, self.verifier if sprinter else None)))
            recorder.draft_forwards += len(block)
            g = len(block)
            target_logits = target_lm.advance_to(context + block.tokens, n_logits=g + 1).logits
            p_target = logits_to_probs(target_logits, settings.sampling)
            n_accepted, next_token = rule(torch.tensor(block.tokens), block.p_draft, p_target, generator)
            recorder.verified(g, n_accepted)
            new_tokens.extend(block.tokens[:n_accepted] + [next_token])
            recorder.emitted(n_accepted + 1)
            new_tokens, done = self._finished(new_tokens, settings.max_new_tokens)
        return new_tokens
