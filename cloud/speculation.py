"""Speculative decoding wholly in the cloud (mode cloud-sd): the cloud's own draft next to the target.

The alternative to edge drafting that a user weighs: vLLM and SGLang speculate with a draft model
beside the target, and the edge only streams tokens. Here it is a Generate call with a speculation
(`sprinter cloud serve --draft SPEC`), run by the resident engine.

Glossary
    draft engine   the draft model in this process with a batcher of its own (cloud/batcher.py): the draft
                   steps of every generation waiting at once run as one packed forward, as verifies do on
                   the target's, so what drafting costs the cloud is real and counted in its forwards
    round          draft g tokens one step at a time, then one target forward over them and the rule
    rule           block verification (sd-block's: common/verification.py block_verify, greedy_verify under
                   greedy), so the output is distributed as the target's alone

Per round, with c = len(context):
    target KV   holds context[:c-1]; the verify forward feeds context[-1], x_1..x_g: rows [g + 1, V]
    draft KV    holds a prefix of the context; step i feeds what it lacks, then x_{i-1}: rows [1, V]
    verdict     keep x_1..x_n and the target's token after them; both caches roll back to c + n

Drafting goes through the one proposer seam (common/decoding/proposals.py): the draft model's
`ModelProposer`, whose forward here (`BatchedDraft`) is an await on the shared draft batcher.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

import torch

from cloud.batcher import Batcher
from cloud.engine import ForwardResult, TargetRows
from cloud.resident_kv import KVLayout, ResidentKV
from common.decoding.drafting import DraftRow, ModelProposer
from common.decoding.proposals import PendingBlock
from common.logits_processing import LogitsProcessor
from common.logprobs import TokenLogprob
from common.models import LoadedModel
from common.sampling import SamplingParams, logits_to_probs
from common.verification import greedy_verdict
from common.decoding.modes import CLOUD_DRAFTING, MODE_RECORDS, verify_rule

TargetForward = Callable[[list[int], int], Awaitable[ForwardResult]]  # (new tokens, n_logits): the target's rows


@dataclass(frozen=True)
class SpeculatedRound:
    """One cloud-sd round, as a Generate chunk carries it."""

    tokens: list[int]  # x_1..x_n and the target's token after them (cut after an end-of-sequence token)
    drafted: int  # g, the draft tokens the round proposed
    step_ms: float  # the round: drafting, the verify forward and the rule (the first also the prefills)
    draft_ms: float  # of which drafting
    logprobs: tuple[TokenLogprob, ...] = ()  # the target's, of `tokens`, when the sampling asks
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # the first round's, when the sampling asks (echo)
    cached_tokens: int = 0  # the first round's: prompt tokens whose target KV came from the prefix cache


@dataclass
class DraftEngine:
    """The cloud's draft: its model, its batcher (which the caller runs) and the layout of its per-generation KV."""

    model: LoadedModel
    batcher: Batcher
    kv_layout: KVLayout

    def new_cache(self, tokens: int) -> ResidentKV:
        cache = ResidentKV(self.kv_layout)
        cache.reserve(tokens)
        return cache


def to_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The draft's logits [n, V_d] over the target's vocabulary [n, V]: a draft padded wider proposes no token the
    target cannot score (its extra columns are dropped), a narrower one none of the target's extra ids (-inf)."""
    width = logits.shape[-1]
    if width >= vocab_size:
        return logits[:, :vocab_size]
    return torch.cat([logits, logits.new_full((logits.shape[0], vocab_size - width), float("-inf"))], dim=-1)


@dataclass
class BatchedDraft:
    """The draft's forward for the proposer seam: one step of the shared draft batcher over a generation's cache,
    which holds a prefix of the context it is asked for (the round truncates it to what the verdict kept)."""

    draft: DraftEngine
    cache: ResidentKV
    vocab_size: int  # the target's
    full: bool  # bring back the logits (sampling, processors, a vocabulary to map); else the argmax is all it reads

    async def __call__(self, context: list[int]) -> DraftRow:
        result = await self.draft.batcher.forward(self.cache, context[self.cache.length:], n_logits=1,
                                                  full_logits=self.full)
        if not self.full:
            return DraftRow(None, argmax=int(result.rows.argmax[-1]))
        return DraftRow(to_vocab(result.rows.logits, self.vocab_size)[-1])


@dataclass
class CloudSpeculation:
    """One generation's rounds: its context, its two caches, its seeded generator and the request's processors."""

    draft: DraftEngine
    target_cache: ResidentKV  # holds context[:-1] before each round
    draft_cache: ResidentKV
    sampling: SamplingParams
    vocab_size: int  # the target's
    eos_token_ids: frozenset[int]
    target_processor: LogitsProcessor | None  # the request's grammar, bias and penalties, on each model's logits
    draft_processor: LogitsProcessor | None

    def __post_init__(self) -> None:
        # one seeded stream for drafting and the rule, as the local engine has (common/decoding/local_engine.py)
        self.generator = torch.Generator().manual_seed(self.sampling.seed)
        full = self.sampling.reads_logits or self.draft.model.vocab_size != self.vocab_size
        self.proposer = ModelProposer(BatchedDraft(self.draft, self.draft_cache, self.vocab_size, full), self.sampling,
                                      self.generator, self.eos_token_ids, processor=self.draft_processor)

    async def rounds(self, context: list[int], max_new: int, block: int,
                     target_forward: TargetForward) -> AsyncIterator[SpeculatedRound]:
        """Rounds until `max_new` tokens or an end-of-sequence token; each block leaves room for the target's token."""
        context, produced = list(context), 0
        while produced < max_new:
            started = time.perf_counter()
            drafted, p_draft = await self._draft(context, min(block, max_new - produced - 1))
            draft_ms = (time.perf_counter() - started) * 1e3
            result = await target_forward(context[self.target_cache.length:] + drafted, len(drafted) + 1)
            n_accepted, next_token = self._verdict(drafted, p_draft, result.rows.shaped(
                self.target_processor, context, drafted))
            kept = drafted[:n_accepted] + [next_token]
            self.target_cache.truncate(len(context) + n_accepted)
            self.draft_cache.truncate(min(self.draft_cache.length, len(context) + n_accepted))
            ended = next((i for i, token in enumerate(kept) if token in self.eos_token_ids), None)
            kept = kept if ended is None else kept[:ended + 1]
            context += kept
            produced += len(kept)
            yield SpeculatedRound(kept, len(drafted), (time.perf_counter() - started) * 1e3, draft_ms,
                                  result.rows.logprobs(self.sampling, kept))
            if ended is not None:
                return

    async def _draft(self, context: list[int], g: int) -> tuple[list[int], list[torch.Tensor]]:
        """x_1..x_g proposed after `context` (one batched draft step each; fewer after an end-of-sequence token) and,
        under sampling, the distributions q_i [V] they were drawn from."""
        block = PendingBlock()
        async for proposed in self.proposer.propose(context, g, None, None, judged=False):
            block.drafted.append(proposed)
        return block.tokens, [d.p_draft for d in block.drafted if d.p_draft is not None]

    def _verdict(self, drafted: list[int], p_draft: list[torch.Tensor], rows: TargetRows) -> tuple[int, int]:
        """sd-block's rule on the round's block: (n_accepted, next_token)."""
        if self.sampling.greedy:  # one-hot distributions: the rule reads the target's argmax alone
            return greedy_verdict(drafted, rows.argmax.tolist())
        p_target = logits_to_probs(rows.logits, self.sampling)  # [g + 1, V]
        q = torch.stack(p_draft) if p_draft else p_target.new_zeros((0, p_target.shape[-1]))  # [g, V]
        rule = verify_rule(MODE_RECORDS[CLOUD_DRAFTING].verify_method, self.sampling)
        return rule(torch.tensor(drafted, dtype=torch.long), q, p_target, self.generator)
