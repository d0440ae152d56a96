"""The edge decoding loop: draft locally, pay a cloud round trip only when the mode says so.

Modes (design.md): `draft` never calls the cloud; `target` streams from the cloud alone, and `cloud-sd`
from the cloud speculating with its own draft (a Generate with a speculation); `sd` and
`sd-block` send the pending block when their call policy says so (every k drafted tokens by
default); `sprinter` streams the tokens its verifier passes at once and sends the pending block
when a token is flagged; `sprinter-exact` releases tokens only once the cloud block-verified them
and sends when its policy says so (goodput by default). The costs goodput weighs are learned by one
`CostModel` per decoder: the link and the draft are properties of the edge, not of a request.

Each speculative mode runs the one speculative round (common/spec/speculative_round.py) with the cloud
session as its target (edge/cloud_link/cloud_target.py: a block becomes a verify frame, the answer a `Verdict`),
its blocks proposed by the request's proposer (common/spec/propose/proposals.py: the draft model, or suffix drafting);
with a pipeline on (edge/decoding/pipeline.py) the edge drafts ahead while a block is in flight, and with
send-ahead sends those candidates too. Blocks and the context are kept within the cloud's limits. The
cloud is a set of replicas (edge/cloud_link/replicas.py): a session that loses its replica reopens on
another with the full context. If no replica is reachable the round keeps going from the draft
alone, marks the result degraded (and tells a streaming caller at once, with the reason), and tries
the cloud again after `cloud_retry_s`; mode target does the same with its Generate stream. A busy
cloud is waited for, never a reason to degrade; a request's own deadline (`request_deadline_s`) is:
past it the rest of the generation comes from the draft, reason `deadline`. If the cloud refuses a
frame (a limit, a bug), the generation ends with the tokens made so far and the refusal in `EdgeResult.error`.

`--mode auto` (`EdgeSettings.chooses_mode`) runs a request as segments of one mode each: every runner asks at each
round boundary whether to go on, and the next mode continues the same `Generation` (edge/decoding/mode_switch.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable

import torch

from common.model.cached_lm import DraftLM
from common.spec.call_policy import CallPolicy
from common.spec.cost_model import CostModel
from common.spec.companion import Companion
from common.spec.propose.drafting import Drafter, model_drafter
from common.spec.propose.proposals import PendingBlock
from common.spec.propose.proposer_choice import proposer_for
from common.spec.propose.suffix_proposer import SuffixMemory
from common.spec.generation import Generation, Released, StopSequences
from common.sampling.logprobs import TokenLogprob, logprobs_of
from common.spec.modes import DecodeSettings, call_policy, mode_of
from common.spec.speculative_round import block_limit, draft_block, speculative_round
from common.sampling.logits_processing import processor_for
from common.model.loading import LoadedModel, vocab_fingerprint
from common.sampling.distributions import SamplingParams
from common.stats import DecodeStats, StatsRecorder
from common.tracing import tracer
from common.spec.verifier import Verifier, verifier_for
from edge.cloud_link.client import CloudLinkError, CloudRefused
from edge.decoding.ahead_gauge import AheadGauge, AheadRecord
from edge.cloud_link.cloud_target import CloudUse, CloudTarget, draft_sampling
from edge.decoding.edge_settings import EdgeSettings
from edge.decoding.mode_switch import ModeSwitch, segment_settings
from edge.decoding.pipeline import PipelinedRounds
from edge.decoding.placement import EDGE
from edge.decoding.placer import Placed, Placer
from edge.decoding.target_mode import CloudGenerate
from edge.runtime.draft_reuse import GenerationDrafts
from edge.cloud_link.replicas import ReplicaSet

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Degraded:
    """What `EdgeDecoder.stream` yields when the first unverified token is about to follow, and why
    (`CloudUse.degraded_reason`: cloud_unreachable, deadline, no_cloud)."""

    reason: str


@dataclass
class EdgeResult:
    token_ids: list[int]
    text: str
    stats: DecodeStats
    degraded_reason: str | None  # None: every token is as the mode promises (CloudUse says the reasons)
    cloud_reopens: int = 0
    finish_reason: str = "length"  # OpenAI's: "stop" (EOS or a stop sequence) or "length" (a limit, or cut short)
    error: CloudLinkError | None = None  # the cloud's refusal that ended the generation early (finish_reason "length")
    verifier: dict | None = None  # {"id", "sha256"} of the verifier in force when the generation started
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 2..n, when the request asked (echo)
    placed: Placed | None = None  # where the request drafted, the mode run, and why
    queued_s: float = 0.0  # time the request waited in the cloud's admission queue (cloud/admission_queue.py)

    @property
    def degraded(self) -> bool:
        return self.degraded_reason is not None


def _never() -> bool:
    """The boundary of a request that never switches mode."""
    return False


class EdgeDecoder:
    def __init__(self, draft: LoadedModel, make_draft_lm: Callable[[bool], DraftLM], verifier: Verifier,
                 cloud: ReplicaSet | None, cost_model: CostModel | None = None,
                 make_companion: Callable[[], Companion] | None = None, max_context: int | None = None,
                 placer: Placer | None = None, suffix_memory: SuffixMemory | None = None) -> None:
        self.draft = draft
        self.make_draft_lm = make_draft_lm  # with_hidden -> one runtime (one KV cache) per generation
        self.make_companion = make_companion  # likewise: concurrent generations must not share a cache
        self.verifier = verifier
        self.verifier_identity: dict | None = None  # how the fleet plane names `verifier` (set by the node)
        self.cloud = cloud
        # Shared by every generation, so it keeps learning across requests. Concurrent generations
        # update it from worker threads too; a lost update under that race costs one sample of an EWMA.
        self.cost_model = cost_model or CostModel()
        self.placer = placer or Placer()  # where auto places a request: learned across requests, like the cost model
        # Whether drafting ahead pays, per (pipeline, mode): like the cost model, a property of this edge and its link.
        self.ahead_records: dict[tuple[str, str], AheadRecord] = {}
        self.suffix_memory = suffix_memory or SuffixMemory()  # suffix drafting's cache of outputs and its calibration
        self.vocab_fingerprint = vocab_fingerprint(draft.tokenizer)
        self.eos_token_ids = draft.eos_token_ids
        # the draft's own window (and the operator's --max-model-len): drafting past it is undefined
        window = getattr(draft.model.config, "max_position_embeddings", None)
        self.max_context = min(n for n in (max_context, window) if n) if (max_context or window) else None

    def use_verifier(self, verifier: Verifier, make_companion: Callable[[], Companion] | None,
                     identity: dict | None = None) -> None:
        """Swap the verifier and the runtime it reads, together: a generation reads them as it starts (on the
        event loop, with no await between), so it runs wholly with the old set or wholly with the new (whether the
        draft's runtime brings back hidden states is the verifier's `needs_hidden`)."""
        self.verifier, self.make_companion = verifier, make_companion
        self.verifier_identity = identity

    def context_limit(self, mode: str) -> int | None:
        """Tokens a generation's context (prompt + completion) may hold in `mode`: the draft's window, and
        the cloud's max_context where the cloud takes part (as last heard from it)."""
        limits = [self.max_context]
        if mode_of(mode).uses_cloud and self.cloud is not None:
            limits.append(self.cloud.limits.max_context)
        known = [n for n in limits if n]
        return min(known) if known else None

    async def stream(self, prompt_ids: list[int], settings: EdgeSettings) -> AsyncIterator[Released | Degraded | EdgeResult]:
        """Yield tokens as they are released, `Degraded` before the first unverified one; the last item is the EdgeResult."""
        queue: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(self.generate(prompt_ids, settings, emit=queue.put_nowait,
                                                 on_degraded=lambda reason: queue.put_nowait(Degraded(reason))))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (item := await queue.get()) is not None:
                yield item
            yield task.result()
        finally:
            task.cancel()

    async def generate(self, prompt_ids: list[int], settings: EdgeSettings,
                       emit: Callable[[Released], None] = lambda released: None,
                       on_degraded: Callable[[str], None] | None = None) -> EdgeResult:
        placed = self.placer.place(settings.decode.mode, settings.placement, settings.decode.k,
                                   settings.decode.max_new_tokens, self.cost_model, self.cloud, settings.chooses_mode,
                                   len(prompt_ids))
        asked, settings = settings, segment_settings(settings, placed)
        mode = settings.decode.mode
        stop = StopSequences(settings.stop, self._decode) if settings.stop else None
        generation = Generation(list(prompt_ids), settings.decode, self.eos_token_ids, StatsRecorder(mode), emit,
                                context_limit=self.context_limit(mode), stop=stop)
        use = CloudUse(on_degraded)
        verifier = self.verifier_identity
        deadline_at = time.monotonic() + settings.request_deadline_s if settings.request_deadline_s else None
        drafts = GenerationDrafts(self.make_draft_lm)
        switch = ModeSwitch(self.placer, asked, placed, self.cost_model, self.cloud,
                            lambda: use.degraded_reason is not None) if asked.chooses_mode else None
        with tracer.span("edge.generate", mode=mode, placement=placed.used, prompt_tokens=len(prompt_ids)) as span:
            try:
                await self._segments(generation, settings, use, deadline_at, drafts, switch)
            except CloudRefused as err:  # keep what was made; the response says why it ended early
                log.warning("the cloud refused mid-generation after %d tokens: %s", len(generation.new_tokens), err)
                use.error = err
            span.set(new_tokens=len(generation.new_tokens), degraded_reason=use.degraded_reason, reopens=use.reopens,
                     switches=len(switch.later) if switch is not None else 0)
        # off the event loop: keeping the context for the next turn copies the draft's KV
        await asyncio.to_thread(drafts.release, generation.recorder)
        tokens = generation.new_tokens
        text = self._decode(tokens)
        stats = generation.recorder.finish(len(tokens))
        self._learn_placement(generation, stats, use, switch, placed)
        finish = "length" if use.error else use.finish_reason or generation.finish_reason
        # off the event loop: where no target scored the prompt, the draft's forward over it does
        prompt_logprobs = await asyncio.to_thread(self._prompt_logprobs, prompt_ids, settings.decode.sampling, use) \
            if settings.decode.sampling.prompt_logprobs is not None else None
        return EdgeResult(tokens, stop.cut(text) if stop else text, stats,
                          use.degraded_reason, use.reopens, finish, use.error, verifier, generation.logprobs,
                          prompt_logprobs, switch.placed if switch is not None else placed, use.queued_ms / 1e3)

    async def _segments(self, generation: Generation, settings: EdgeSettings, use: CloudUse,
                        deadline_at: float | None, drafts: GenerationDrafts, switch: ModeSwitch | None) -> None:
        """Run the request in its mode; under `--mode auto` segment by segment (edge/decoding/mode_switch.py), each
        continuing from the tokens the ones before committed."""
        segment: EdgeSettings | None = settings
        while segment is not None:
            with tracer.span("edge.segment", mode=generation.settings.mode, at_token=len(generation.new_tokens)) \
                    if switch is not None else contextlib.nullcontext():
                if not generation.settings.traits.drafts:
                    boundary = (lambda: switch.due(generation)) if switch is not None else _never
                    await self._target(generation, segment, use, deadline_at, drafts, boundary)
                else:
                    await self._speculate(generation, segment, use, deadline_at, drafts, switch)
            segment = switch.begin(generation) if switch is not None else None

    def _learn_placement(self, generation: Generation, stats: DecodeStats, use: CloudUse,
                         switch: ModeSwitch | None, placed: Placed) -> None:
        """What placement learns of a finished request that ran as promised: the edge's tokens and uplink bytes a
        round (`--mode auto` learned its rounds' tokens as they came, and may have run other modes besides), and
        what its start cost where it began speculating on the edge and released its first token at a verdict."""
        if use.degraded_reason or use.error is not None:
            return
        first = mode_of(placed.mode)
        if placed.used == EDGE and first.placeable and not first.releases_passed and stats.ttft_ms is not None:
            self.placer.observe_edge_start(stats.ttft_ms, len(generation.prompt_ids), generation.settings.k,
                                           self.cost_model, first.first_token_from_open)
        if switch is not None:
            switch.teach()
            self.placer.observe_uplink(stats.uplink_bytes, switch.edge_rounds)
        elif generation.settings.traits.placeable:
            self.placer.observe_edge(stats)

    def _prompt_logprobs(self, prompt_ids: list[int], sampling: SamplingParams,
                         use: CloudUse) -> list[TokenLogprob] | None:
        """The logprobs of prompt tokens 2..n the request asked for (echo): the target's from its prefill, or
        where no target gave them (mode draft, a cloud out of reach at the open) the draft's."""
        if sampling.prompt_logprobs is None or len(prompt_ids) < 2:
            return None
        if use.prompt_logprobs is not None:
            return use.prompt_logprobs
        with torch.inference_mode():
            logits = self.draft.model(torch.tensor([prompt_ids])).logits[0, :-1]  # [n - 1, V]
        return logprobs_of(logits, prompt_ids[1:], sampling.prompt_logprobs, "draft")

    def _decode(self, tokens: list[int]) -> str:
        return self.draft.tokenizer.decode(tokens, skip_special_tokens=True)

    async def _target(self, generation: Generation, settings: EdgeSettings, use: CloudUse,
                      deadline_at: float | None, drafts: GenerationDrafts, boundary: Callable[[], bool]) -> None:
        """Modes target and cloud-sd: the cloud generates (speculates) alone (edge/decoding/target_mode.py)."""
        if self.cloud is None:
            raise ValueError(f"mode {generation.settings.mode!r} needs a cloud (--cloud HOST:PORT)")
        run = CloudGenerate(self.cloud, self.vocab_fingerprint, self.cost_model, self.placer,
                            lambda: self._drafter(replace(settings.decode, proposer="model"), generation.prompt_ids, drafts),
                            settings.priority, settings.cloud_retry_s, boundary=boundary)
        await run.run(generation, use, deadline_at)

    def _drafter(self, decode: DecodeSettings, prompt_ids: list[int], drafts: GenerationDrafts) -> Drafter:
        sampling, grammars = decode.sampling, self.draft.grammars if decode.sampling.grammar else None
        return model_drafter(drafts.new(self.verifier.needs_hidden), sampling, torch.Generator().manual_seed(sampling.seed),
                             self.eos_token_ids, verifier_for(self.verifier, sampling.temperature),
                             self.make_companion() if self.make_companion else None, True,
                             processor_for(sampling, prompt_ids, grammars), proposer_for(decode, self.suffix_memory))

    async def _speculate(self, generation: Generation, settings: EdgeSettings, use: CloudUse,
                         deadline_at: float | None, drafts: GenerationDrafts, switch: ModeSwitch | None) -> None:
        """Speculative rounds until the generation is done, or (`--mode auto`) a boundary where `switch` switches;
        the drafter stays for the request's next edge segment (its KV holds the context)."""
        mode, traits = generation.settings.mode, generation.settings.traits
        if traits.uses_cloud and self.cloud is None:
            log.warning("no cloud configured: mode %s runs from the draft alone", mode)
            use.mark_degraded("no_cloud")
        support = min(settings.max_sparse_support, self.cloud.limits.max_sparse_support or settings.max_sparse_support
                      ) if self.cloud is not None else settings.max_sparse_support
        decode = replace(settings.decode, sampling=draft_sampling(settings.decode.sampling, support))
        drafter = switch.drafter if switch is not None and switch.drafter is not None else \
            self._drafter(decode, generation.prompt_ids, drafts)
        if switch is not None:
            switch.drafter = drafter
        policy = None
        if traits.speculative:  # fresh per generation; what it learns of the link lives in the cost model
            policy = call_policy(generation.settings, verifier_for(self.verifier, decode.sampling.temperature), self.cost_model)
            generation.recorder.policy = policy.describe()
        cloud_target = None if not traits.uses_cloud or self.cloud is None else self._cloud_target(generation, settings, use, support,
                                                                                    deadline_at)
        try:
            await self._rounds(generation, settings, drafter, cloud_target, policy,
                               (lambda: switch.due(generation)) if switch is not None else _never)
            if cloud_target is not None and not use.degraded_reason and generation.done:
                drafter.proposer.observe_output(generation.new_tokens)  # verified output: what later requests may copy
        finally:
            if cloud_target is not None:
                generation.recorder.uplink_bytes += cloud_target.uplink_bytes  # += : one session per edge segment
                generation.recorder.downlink_bytes += cloud_target.downlink_bytes
                generation.recorder.residual_queries += cloud_target.residual_queries
                generation.recorder.cached_tokens += cloud_target.cached_tokens
                use.prompt_logprobs = use.prompt_logprobs or cloud_target.prompt_logprobs
                use.queued_ms += cloud_target.session.queued_ms
                await cloud_target.close()

    def _cloud_target(self, generation: Generation, settings: EdgeSettings, use: CloudUse,
                       support: int, deadline_at: float | None) -> CloudTarget:
        session = self.cloud.session(generation.settings.sampling, self.vocab_fingerprint, deadline_at,
                                     output_start=len(generation.prompt_ids), priority=settings.priority)
        cloud_target = CloudTarget(session,
                                generation.settings.verify_method, generation.settings.sampling,
                                support, settings.cloud_retry_s, use, settings.draft_dists == "on-rejection")
        # The cloud prefills the prompt while the first block is drafted: TTFT pays max(the two), not their sum.
        # The lossless modes also take the target's first token from that open (see `_first_token`).
        cloud_target.open_ahead(generation.context, first_token=generation.settings.traits.first_token_from_open)
        return cloud_target

    async def _rounds(self, generation: Generation, settings: EdgeSettings, drafter: Drafter,
                      cloud_target: CloudTarget | None, policy: CallPolicy | None, boundary: Callable[[], bool]) -> None:
        """Rounds until the generation is done or `boundary()`, asked after each verdict, says to stop there."""
        carried = None
        traits = generation.settings.traits
        if cloud_target is not None and traits.first_token_from_open:
            carried = await self._first_token(generation, drafter, cloud_target, policy)
        if cloud_target is not None and settings.pipeline != "off" and traits.pipelines:
            generation.recorder.pipeline = settings.pipeline
            record = self.ahead_records.setdefault((settings.pipeline, generation.settings.mode), AheadRecord())
            await PipelinedRounds(generation, drafter, cloud_target, policy, self.cost_model, settings.pipeline,
                                  lambda: self._fit_to_cloud(generation),
                                  AheadGauge(record, settings.pipeline_adapts), boundary=boundary).run(carried)
            return
        while not generation.done:
            if cloud_target is not None:
                self._fit_to_cloud(generation)
            round_ = await speculative_round(generation, drafter, cloud_target, policy, self.cost_model,
                                             prefix=carried)
            carried = None
            if round_.verdict is not None and boundary():
                return

    async def _first_token(self, generation: Generation, drafter: Drafter, cloud_target: CloudTarget,
                           policy: CallPolicy | None) -> PendingBlock | None:
        """Release the target's first token as soon as the session's open brings it, while the first block is
        drafted after the prompt; a block that starts with that token goes on as the next block's start (its
        other tokens were drafted after the very context they now follow: see edge/decoding/pipeline.py on why
        that stays lossless). Without a token (the first verify then meets the open's failure) the block itself goes on."""
        self._fit_to_cloud(generation)
        limit = block_limit(generation, to_verify=True)
        drafting = asyncio.create_task(draft_block(generation, drafter, generation.context, limit, policy, None)
                                       ) if limit > 0 else None
        try:
            first = await cloud_target.opened_first_token()
            token = first[0] if first is not None else None
            if first is not None:
                generation.recorder.target_calls += 1
                generation.commit(len(generation.new_tokens), [token], [first[1]] if first[1] is not None else None)
            block = await drafting if drafting is not None else PendingBlock()
        finally:
            if drafting is not None:
                drafting.cancel()
        if token is None:
            return block if len(block) else None
        if generation.done or block.tokens[:1] != [token]:
            return None
        return PendingBlock(block.drafted[1:]) if len(block) > 1 else None

    def _fit_to_cloud(self, generation: Generation) -> None:
        """Blocks within the cloud's max_block, the context within its max_context: as last heard (a reopen
        on a restarted cloud may have brought new limits)."""
        max_block = self.cloud.limits.max_block
        if max_block != generation.settings.max_block:
            generation.settings = replace(generation.settings, max_block=max_block)
        generation.context_limit = self.context_limit(generation.settings.mode)
