"""Speculative decoding wholly in the cloud (mode cloud-sd): the cloud's own draft next to the target.

The alternative to edge drafting that a user weighs: vLLM and SGLang speculate with a draft model
beside the target, and the edge only streams tokens. Here it is a Generate call with a speculation
(`sprinter cloud serve --draft SPEC`), run by the resident engine.

Glossary
    draft engine   the draft model in this process with a batcher of its own (cloud/batcher.py): the draft
                   steps of every generation waiting at once run as one packed forward, as verifies do on
                   the target's, so what drafting costs the cloud is real and counted in its forwards
    round          draft g tokens one step at a time, then one target forward over them and the rule
    rule           block verification (sd-block's: common/spec/acceptance_rules.py block_verify, greedy_verify under
                   greedy), applied by the one verdict entry (common/spec/acceptance_rules.py), so the output is distributed
                   as the target's alone

Per round, with c = len(context):
    target KV   holds context[:c-1]; the verify forward feeds context[-1], x_1..x_g: rows [g + 1, V]
    draft KV    holds a prefix of the context; step i feeds what it lacks, then x_{i-1}: rows [1, V]
    verdict     keep x_1..x_n and the target's token after them; both caches roll back to c + n

Drafting goes through the one proposer seam (common/spec/propose/proposals.py): the draft model's
`ModelProposer`, whose forward here (`BatchedDraft`) is an await on the shared draft batcher, alone
(`speculation.proposer` model) or wrapped by the strategy the request names (`proposer_for`: suffix, ...).

A wrapping proposer drafts as on the edge: its blocks are to_verify, a fixed policy of the round's `block`
places the draft's own tokens, and a copied run may go past `block`, as its match warrants, up to the
edge's rule for a round's cap (DecodeSettings.round_cap, within Limits.max_block). The rule reads each
token's q row (`PendingBlock.p_draft`: a copied token is a point mass), so it stays exact. Its memory
(earlier outputs, calibration) is the edge identity's own (cloud/suffix_memories.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

import torch

from cloud.batcher import Batcher
from cloud.engine import ForwardResult, TargetRows
from cloud.resident_kv import KVLayout, ResidentKV
from common.spec.call_policy import CallPolicy, parse_policy
from common.spec.propose.drafting import DraftRow, ModelProposer
from common.spec.propose.proposals import PendingBlock, Proposer
from common.spec.propose.proposer_choice import proposer_for
from common.spec.propose.suffix_proposer import SuffixMemory, suffix_memory
from common.sampling.logits_processing import LogitsProcessor
from common.sampling.logprobs import TokenLogprob
from common.model.loading import LoadedModel
from common.sampling.distributions import SamplingParams
from common.spec.acceptance_rules import Proposal, decide
from common.spec.modes import CLOUD_DRAFTING, MODE_RECORDS, DecodeSettings

TargetForward = Callable[[list[int], int], Awaitable[ForwardResult]]  # (new tokens, n_logits): the target's rows


@dataclass(frozen=True)
class SpeculationRequest:
    """What a cloud-sd Generate asks for (its `Speculation`, checked): draft tokens per round and what proposes them."""

    block: int  # the draft's own tokens per round
    proposer: str = "model"  # common/spec/modes.py PROPOSERS
    memory: SuffixMemory | None = None  # the edge identity's; None: a copying proposer copies the request's own text
    max_block: int | None = None  # the cloud's cap on a block (Limits.max_block)

    def settings(self, sampling: SamplingParams | None = None) -> DecodeSettings:
        """The generation's settings as the proposer seam reads them (`proposer_for`, `round_cap`)."""
        return DecodeSettings(mode=CLOUD_DRAFTING, sampling=sampling or SamplingParams(), k=self.block,
                              max_block=self.max_block, proposer=self.proposer)

    @property
    def cap(self) -> int:
        """The longest block a round may send: `block` for the model alone, longer for a copied run (the edge's
        rule); what a verify may write into the KV before its rollback."""
        return self.settings().round_cap


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
    copied: int = 0  # of `drafted`, tokens copied from text (not the draft's own) ...
    copied_kept: int = 0  # ... and those of them the target kept


@dataclass
class DraftEngine:
    """The cloud's draft: its model, its batcher (which the caller runs) and the layout of its per-generation KV."""

    model: LoadedModel
    batcher: Batcher
    kv_layout: KVLayout

    @property
    def spec(self) -> str:
        return self.model.spec

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

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
    batches = False  # a tree's branches are not drafted here: cloud-sd's rounds are chains

    async def __call__(self, context: list[int]) -> DraftRow:
        result = await self.draft.batcher.forward(self.cache, context[self.cache.length:], n_logits=1,
                                                  full_logits=self.full)
        if not self.full:
            return DraftRow(None, argmax=int(result.rows.argmax[-1]))
        return DraftRow(to_vocab(result.rows.logits, self.vocab_size)[-1])


@dataclass
class CloudSpeculation:
    """One generation's rounds: its context, its two caches, its seeded generator, the request's processors and
    its proposer."""

    draft: DraftEngine
    target_cache: ResidentKV  # holds context[:-1] before each round
    draft_cache: ResidentKV
    sampling: SamplingParams
    vocab_size: int  # the target's
    eos_token_ids: frozenset[int]
    target_processor: LogitsProcessor | None  # the request's grammar, bias and penalties, on each model's logits
    draft_processor: LogitsProcessor | None
    speculation: SpeculationRequest

    def __post_init__(self) -> None:
        # one seeded stream for drafting and the rule, as the local decoder has (common/spec/local_decoder.py)
        self.generator = torch.Generator().manual_seed(self.sampling.seed)
        spec = self.speculation
        # a copying proposer without an identity's memory copies from the request's own text alone
        memory = spec.memory if spec.memory is not None or spec.proposer == "model" else suffix_memory(cache=False)
        wrap = proposer_for(spec.settings(self.sampling), memory) if memory is not None else None
        # a wrapping proposer's policy scores the draft's tokens from its logits: a greedy draft must bring them too
        full = self.sampling.reads_logits or self.draft.vocab_size != self.vocab_size or wrap is not None
        model = ModelProposer(BatchedDraft(self.draft, self.draft_cache, self.vocab_size, full), self.sampling,
                              self.generator, self.eos_token_ids, processor=self.draft_processor)
        self.proposer: Proposer = wrap(model) if wrap is not None else model
        # the model alone drafts `block` tokens, unjudged, as ever; a wrapper's model tokens go by cloud-sd's own
        # fixed:k, its copied runs up to `cap`
        self.policy: CallPolicy | None = None
        if wrap is not None:
            self.policy = parse_policy(MODE_RECORDS[CLOUD_DRAFTING].default_policy.format(k=spec.block))
        self.cap = spec.cap if wrap is not None else spec.block

    async def rounds(self, context: list[int], max_new: int,
                     target_forward: TargetForward) -> AsyncIterator[SpeculatedRound]:
        """Rounds until `max_new` tokens or an end-of-sequence token; each block leaves room for the target's token.
        A generation that ends so gives its output to the proposer (what later requests of this edge may copy)."""
        context, produced, prompt_length = list(context), 0, len(context)
        while produced < max_new:
            started = time.perf_counter()
            block = await self._draft(context, min(self.cap, max_new - produced - 1))
            drafted = block.tokens
            draft_ms = (time.perf_counter() - started) * 1e3
            result = await target_forward(context[self.target_cache.length:] + drafted, len(drafted) + 1)
            n_accepted, next_token = self._verdict(block, result.rows.shaped(self.target_processor, context, drafted))
            self.proposer.observe_verdict(block, n_accepted)
            kept = drafted[:n_accepted] + [next_token]
            self.target_cache.truncate(len(context) + n_accepted)
            self.draft_cache.truncate(min(self.draft_cache.length, len(context) + n_accepted))
            ended = next((i for i, token in enumerate(kept) if token in self.eos_token_ids), None)
            kept = kept if ended is None else kept[:ended + 1]
            context += kept
            produced += len(kept)
            copied = [not d.from_model for d in block.drafted]
            yield SpeculatedRound(kept, len(drafted), (time.perf_counter() - started) * 1e3, draft_ms,
                                  result.rows.logprobs(self.sampling, kept), copied=sum(copied),
                                  copied_kept=sum(copied[:min(n_accepted, len(kept))]))
            if ended is not None:
                break
        self.proposer.observe_output(context[prompt_length:])

    async def _draft(self, context: list[int], g: int) -> PendingBlock:
        """x_1..x_g proposed after `context` (fewer after an end-of-sequence token, or where the policy sends; more
        than the round's `block` only for a copied run, within `g`)."""
        block = PendingBlock()
        async for proposed in self.proposer.propose(context, g, self.policy, None, to_verify=self.policy is not None):
            block.drafted.append(proposed)
        return block

    def _verdict(self, block: PendingBlock, rows: TargetRows) -> tuple[int, int]:
        """sd-block's rule on the round's block: (n_accepted, next_token). A copied token's q row is a point mass."""
        decision = decide(Proposal(block.tokens, block.p_draft), MODE_RECORDS[CLOUD_DRAFTING].verify_method,
                          self.sampling, self.generator, argmax=rows.argmax.tolist(), logits=rows.logits)
        return decision.n_accepted, decision.next_token
