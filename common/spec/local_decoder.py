"""Both models in one process: the reference implementation of every decoding mode.

The edge and the cloud split this loop across a network; here it runs end to end, which makes it
the yardstick for their outputs (same inputs and seed -> same tokens) and the local benchmark.
Speculative modes run the one speculative round (speculative_round.py) against `LocalTarget`;
target and draft modes decode one token per forward.

Nothing here waits on I/O, so the round's coroutine is driven inline (`run_inline`), without an
event loop: `generate` can be called from anywhere, a running event loop included.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from common.model.cached_lm import CachedLM, DraftLM
from common.spec.cost_model import CostModel
from common.spec.companion import Companion
from common.spec.propose.drafting import model_drafter, next_token
from common.spec.generation import Generation
from common.spec.modes import DecodeSettings, call_policy
from common.spec.speculative_round import LocalTarget, run_inline, speculative_round
from common.spec.propose.proposer_choice import proposer_for
from common.spec.propose.suffix_proposer import SuffixMemory
from common.sampling.logits_processing import LogitsProcessor, processor_for
from common.sampling.logprobs import logprobs_of
from common.sampling.params import SamplingParams
from common.model.loading import LoadedModel, check_pair
from common.stats import DecodeStats, StatsRecorder
from common.spec.verifier import ConfidenceVerifier, Verifier, verifier_for

log = logging.getLogger(__name__)

@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    mode: str
    stats: DecodeStats


class LocalDecoder:
    def __init__(self, target: LoadedModel | None, draft: LoadedModel | None,
                 verifier: Verifier | None = None, make_draft_lm: Callable[[bool], DraftLM] | None = None,
                 make_companion: Callable[[], Companion] | None = None,
                 suffix_memory: SuffixMemory | None = None) -> None:
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
        # suffix drafting's cache of earlier outputs (None in it: off) and its score calibration, across generations
        self.suffix_memory = suffix_memory or SuffixMemory()

    def generate(self, prompt_ids: list[int], settings: DecodeSettings) -> GenerationResult:
        generation = Generation(list(prompt_ids), settings, self.eos_token_ids, StatsRecorder(settings.mode))
        generator = torch.Generator().manual_seed(settings.sampling.seed)
        if not settings.traits.speculative:
            self._autoregressive(generation, generator)
        else:
            run_inline(self._speculative(generation, generator))
        tokens = generation.new_tokens
        return GenerationResult(
            token_ids=tokens,
            text=self.tokenizer.decode(tokens, skip_special_tokens=True),
            mode=settings.mode,
            stats=generation.recorder.finish(len(tokens)),
        )

    def _model(self, which: str) -> LoadedModel:
        model = self.target if which == "target" else self.draft
        if model is None:
            raise ValueError(f"this engine has no {which} model")
        return model

    def _processor(self, sampling: SamplingParams, prompt_ids: list[int], which: str) -> LogitsProcessor | None:
        """The request's grammar, bias and penalties over `which` model's logits (each its own grammar matcher)."""
        return processor_for(sampling, prompt_ids, self._model(which).grammars if sampling.grammar else None)

    def _autoregressive(self, generation: Generation, generator: torch.Generator) -> None:
        by_target = not generation.settings.traits.drafts  # else the draft decodes alone
        lm = CachedLM(self._model("target").model) if by_target else self.make_draft_lm(False)
        processor = self._processor(generation.settings.sampling, generation.prompt_ids, "target" if by_target else "draft")
        while not generation.done:
            logits = lm.advance_to(generation.context).logits[-1]
            if by_target:
                generation.recorder.target_calls += 1
            else:
                generation.recorder.draft_forwards += 1
            shaped = processor.next_row(logits, generation.context) if processor is not None else logits
            token, _ = next_token(shaped, generation.settings.sampling, generator)
            top_n = generation.top_logprobs
            logprobs = logprobs_of(logits[None], [token], top_n, "target" if by_target else "draft") \
                if top_n is not None else None
            generation.commit(len(generation.new_tokens), [token], logprobs)

    async def _speculative(self, generation: Generation, generator: torch.Generator) -> None:
        settings = generation.settings
        companion = self.make_companion() if self.make_companion is not None else None
        verifier = verifier_for(self.verifier, settings.sampling.temperature)
        processor = self._processor(settings.sampling, generation.prompt_ids, "draft")
        drafter = model_drafter(self.make_draft_lm(self.verifier.needs_hidden), settings.sampling, generator,
                                self.eos_token_ids, verifier, companion, processor=processor,
                                wrap=proposer_for(settings, self.suffix_memory))
        target = LocalTarget(CachedLM(self._model("target").model), settings.sampling, generator, settings.verify_method,
                             self._processor(settings.sampling, generation.prompt_ids, "target"))
        cost_model = CostModel()  # in one process the round trip is the target forward alone: rtt stays 0
        policy = call_policy(settings, verifier, cost_model)
        generation.recorder.policy = policy.describe()
        while not generation.done:
            await speculative_round(generation, drafter, target, policy, cost_model)
        drafter.proposer.observe_output(generation.new_tokens)
