"""Both models in one process: the reference implementation of every decoding mode.

The edge and the cloud split this loop across a network; here it runs end to end, which makes it
the yardstick for their outputs (same inputs and seed -> same tokens) and the local benchmark.

One speculative round:
    draft a pending block until the call policy says send (fixed k, heuristic, the verifier's flag,
    goodput; up to the block cap) -> one target forward over the block -> a verification rule
    -> keep n_accepted + 1 tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from common.cached_lm import CachedLM
from common.call_policy import CallPolicy, CostModel, FlagPolicy, parse_policy
from common.drafting import DraftLM, PendingBlock, draft_tokens, next_token
from common.models import LoadedModel, check_pair
from common.sampling import SamplingParams, logits_to_probs
from common.stats import DecodeStats, StatsRecorder
from common.verification import VERIFY_RULES, VerifyRule
from common.verifier import ConfidenceVerifier, Verifier

if TYPE_CHECKING:  # common.companion imports common.drafting, as this module does
    from common.companion import Companion

log = logging.getLogger(__name__)

MODES = ("draft", "target", "sd", "sd-block", "sprinter", "sprinter-exact")
SPECULATIVE_MODES = ("sd", "sd-block", "sprinter", "sprinter-exact")
# sprinter is the paper's loop: it calls at the verifier's flag, and its output depends on that rule.
POLICY_MODES = ("sd", "sd-block", "sprinter-exact")


@dataclass(frozen=True)
class DecodeSettings:
    mode: str = "sd"
    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    k: int = 5  # block length of sd and sd-block
    max_run_length: int = 20  # cap on a pending block (sprinter modes, and any explicit policy)
    policy: str | None = None  # call policy spec (common/call_policy.py); None: the mode's default

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.max_new_tokens < 1 or self.k < 1 or self.max_run_length < 1:
            raise ValueError("max_new_tokens, k and max_run_length must be >= 1")
        if self.policy is not None:
            if self.mode not in POLICY_MODES:
                raise ValueError(f"a call policy applies to modes {', '.join(POLICY_MODES)}, not {self.mode!r} "
                                 "(sprinter always calls at the verifier's flag)")
            parse_policy(self.policy)  # a bad spec fails here, before any decoding

    @property
    def block_cap(self) -> int:
        """Longest pending block: k under sd's default fixed:k (as before policies), else the run-length cap."""
        return self.k if self.mode in ("sd", "sd-block") and self.policy is None else self.max_run_length


def call_policy(settings: DecodeSettings, verifier: Verifier, cost_model: CostModel | None = None) -> CallPolicy:
    """A fresh policy for one generation of a speculative mode; goodput reads (not owns) `cost_model`.

    Defaults: sd and sd-block fixed:k, sprinter flag at the verifier's threshold, sprinter-exact goodput.
    """
    if settings.mode == "sprinter":
        return FlagPolicy(verifier.threshold)
    spec = settings.policy or ("goodput" if settings.mode == "sprinter-exact" else f"fixed:{settings.k}")
    if spec.strip() == "flag":  # a bare flag means the verifier's own threshold (a learned one is tuned), not 0.5
        return FlagPolicy(verifier.threshold)
    return parse_policy(spec, cost_model)


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
                 verifier: Verifier | None = None, make_draft_lm: Callable[[bool], DraftLM] | None = None,
                 make_companion: Callable[[], Companion] | None = None) -> None:
        """`make_draft_lm(with_hidden)` swaps the draft's runtime (e.g. the edge's ONNX export); torch by default.

        `make_companion`, when given, makes one companion (own KV cache) per generation: its signals feed the verifier.
        """
        if target is None and draft is None:
            raise ValueError("need at least one model")
        if target is not None and draft is not None:
            check_pair(target, draft)
        self.target = target
        self.draft = draft
        self.verifier: Verifier = verifier or ConfidenceVerifier()
        self.tokenizer = (target or draft).tokenizer
        self.eos_token_ids = (target or draft).eos_token_ids
        self.make_companion = make_companion
        self.make_draft_lm = make_draft_lm or (lambda with_hidden: CachedLM(self._model("draft").model, with_hidden))

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
        lm = CachedLM(self._model("target").model) if settings.mode == "target" else self.make_draft_lm(False)
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
        draft_lm = self.make_draft_lm(self.verifier.needs_hidden)
        companion = self.make_companion() if self.make_companion is not None else None
        rule = verify_rule(settings.mode, settings.sampling)
        cost_model = CostModel()  # in one process the round trip is the target forward alone: rtt stays 0
        policy = call_policy(settings, self.verifier, cost_model)
        recorder.policy = policy.describe()
        new_tokens: list[int] = []
        done = False
        while not done:
            context = prompt_ids + new_tokens
            limit = min(settings.block_cap, settings.max_new_tokens - len(new_tokens))
            # The first round prefills the prompt in both models: not what a draft step or a verify costs.
            learn = cost_model if new_tokens else None
            block = PendingBlock(list(draft_tokens(draft_lm, context, limit, settings.sampling, generator,
                                                   self.eos_token_ids, self.verifier, policy, learn, companion)))
            recorder.draft_forwards += len(block)
            g = len(block)
            started = time.perf_counter()
            target_logits = target_lm.advance_to(context + block.tokens, n_logits=g + 1).logits
            p_target = logits_to_probs(target_logits, settings.sampling)
            n_accepted, next_token = rule(torch.tensor(block.tokens), block.p_draft, p_target, generator)
            verify_ms = (time.perf_counter() - started) * 1e3
            recorder.verified(g, n_accepted)
            policy.observe_verdict(g, n_accepted)
            if learn is not None:
                learn.observe_round_trip(verify_ms, verify_ms, g)
            new_tokens.extend(block.tokens[:n_accepted] + [next_token])
            recorder.emitted(n_accepted + 1)
            new_tokens, done = self._finished(new_tokens, settings.max_new_tokens)
        return new_tokens
