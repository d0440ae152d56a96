"""The edge decoding loop: draft locally, pay a cloud round trip only when the mode says so.

Modes (design.md): `draft` never calls the cloud; `target` streams from the cloud alone; `sd` and
`sd-block` send the pending block when their call policy says so (every k drafted tokens by
default); `sprinter` streams the tokens its verifier passes at once and sends the pending block
when a token is flagged; `sprinter-exact` releases tokens only once the cloud block-verified them
and sends when its policy says so (goodput by default). The costs goodput weighs are learned by one
`CostModel` per decoder: the link and the draft are properties of the edge, not of a request.

If the cloud becomes unreachable the loop keeps going from the draft alone, marks the result
degraded, and tries the cloud again after `cloud_retry_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable

import torch

from common.call_policy import CallPolicy, CostModel
from common.companion import Companion
from common.drafting import DraftLM, PendingBlock, draft_tokens
from common.local_engine import SPECULATIVE_MODES, DecodeSettings, call_policy
from common.models import LoadedModel, vocab_fingerprint
from common.sampling import SparseDistribution
from common.stats import DecodeStats, StatsRecorder
from common.verifier import Verifier
from edge.cloud_client import CloudClient, CloudUnavailable
from sprinter.v1 import decoding_pb2 as pb

log = logging.getLogger(__name__)

METHOD_BY_MODE = {"sd": pb.METHOD_TOKEN, "sd-block": pb.METHOD_BLOCK, "sprinter": pb.METHOD_SPRINTER,
                  "sprinter-exact": pb.METHOD_BLOCK}


@dataclass(frozen=True)
class EdgeSettings:
    decode: DecodeSettings
    cloud_retry_s: float = 2.0  # while degraded, how often to try the cloud again
    max_sparse_support: int = 4096  # sampling: the draft samples from at most this many tokens (sent exactly)


@dataclass
class EdgeResult:
    token_ids: list[int]
    text: str
    stats: DecodeStats
    degraded: bool
    cloud_reopens: int = 0


@dataclass
class Generation:
    """One request's state: what the caller has received, and the degraded-mode bookkeeping."""

    prompt_ids: list[int]
    settings: EdgeSettings
    recorder: StatsRecorder
    emit: Callable[[list[int]], None]
    new_tokens: list[int] = field(default_factory=list)
    released: int = 0  # how many of new_tokens the caller already has
    degraded: bool = False
    cloud_down_since: float | None = None

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.new_tokens

    def release(self, upto: int | None = None) -> None:
        upto = len(self.new_tokens) if upto is None else upto
        upto = min(upto, self.settings.decode.max_new_tokens)
        if upto > self.released:
            self.emit(self.new_tokens[self.released:upto])
            self.recorder.emitted(upto - self.released)
            self.released = upto


class EdgeDecoder:
    def __init__(self, draft: LoadedModel, make_draft_lm: Callable[[], DraftLM], verifier: Verifier,
                 cloud: CloudClient | None, cost_model: CostModel | None = None,
                 make_companion: Callable[[], Companion] | None = None) -> None:
        self.draft = draft
        self.make_draft_lm = make_draft_lm  # one runtime (one KV cache) per generation
        self.make_companion = make_companion  # likewise: concurrent generations must not share a cache
        self.verifier = verifier
        self.cloud = cloud
        # Shared by every generation, so it keeps learning across requests. Concurrent generations
        # update it from worker threads too; a lost update under that race costs one sample of an EWMA.
        self.cost_model = cost_model or CostModel()
        self.vocab_fingerprint = vocab_fingerprint(draft.tokenizer)
        self.eos_token_ids = draft.eos_token_ids

    async def stream(self, prompt_ids: list[int], settings: EdgeSettings) -> AsyncIterator[list[int]]:
        """Yield tokens as they are released; the last item is the EdgeResult."""
        queue: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(self.generate(prompt_ids, settings, emit=queue.put_nowait))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (tokens := await queue.get()) is not None:
                yield tokens
            yield task.result()
        finally:
            task.cancel()

    async def generate(self, prompt_ids: list[int], settings: EdgeSettings,
                       emit: Callable[[list[int]], None] = lambda tokens: None) -> EdgeResult:
        mode = settings.decode.mode
        generation = Generation(list(prompt_ids), settings, StatsRecorder(mode), emit)
        reopens = 0
        if mode == "target":
            await self._target(generation)
        else:
            reopens = await self._draft_and_verify(generation)
        tokens = generation.new_tokens[: generation.released]
        return EdgeResult(tokens, self.draft.tokenizer.decode(tokens, skip_special_tokens=True),
                          generation.recorder.finish(len(tokens)), generation.degraded, reopens)

    def _finished(self, generation: Generation) -> bool:
        tokens = generation.new_tokens
        for i, token in enumerate(tokens[: generation.settings.decode.max_new_tokens]):
            if token in self.eos_token_ids:
                del tokens[i + 1:]
                return True
        return len(tokens) >= generation.settings.decode.max_new_tokens

    async def _target(self, generation: Generation) -> None:
        decode = generation.settings.decode
        if self.cloud is None:
            raise ValueError("mode 'target' needs a cloud (--cloud HOST:PORT)")
        try:
            async for token in self.cloud.generate(generation.prompt_ids, decode.sampling, decode.max_new_tokens,
                                                   self.vocab_fingerprint):
                generation.recorder.target_calls += 1
                generation.new_tokens.append(token)
                generation.release()
                if self._finished(generation):
                    break
        except CloudUnavailable as err:  # finish from the draft alone
            log.warning("cloud unavailable in target mode, continuing from the draft: %s", err)
            generation.degraded = True
            await self._draft_and_verify(generation, force_draft_only=True)

    async def _draft_and_verify(self, generation: Generation, force_draft_only: bool = False) -> int:
        settings = generation.settings
        decode = settings.decode
        mode = decode.mode
        draft_only = force_draft_only or mode == "draft" or self.cloud is None
        if mode != "draft" and self.cloud is None:
            log.warning("no cloud configured: mode %s runs from the draft alone", mode)
            generation.degraded = True
        # On the wire a sampled draft distribution travels sparse; sampling from the capped support keeps it exact.
        sampling = decode.sampling
        if not sampling.greedy:
            sampling = replace(sampling, top_k=min(sampling.top_k or settings.max_sparse_support, settings.max_sparse_support))
        generator = torch.Generator().manual_seed(sampling.seed)
        draft_lm = self.make_draft_lm()
        companion = self.make_companion() if self.make_companion is not None else None
        policy: CallPolicy | None = None
        if mode in SPECULATIVE_MODES:  # fresh per generation; what it learns of the link lives in the cost model
            policy = call_policy(decode, self.verifier, self.cost_model)
            generation.recorder.policy = policy.describe()
        session = None if draft_only else self.cloud.session(decode.sampling, self.vocab_fingerprint)
        try:
            while not self._finished(generation):
                context = generation.context
                budget = decode.max_new_tokens - len(generation.new_tokens)
                uses_cloud = not draft_only and self._cloud_worth_trying(generation)
                limit = min(decode.block_cap if uses_cloud else 8, budget)
                block = PendingBlock()
                # The first block's first step prefills the prompt (a fresh draft runtime): not a draft step's cost.
                learn = self.cost_model if len(context) > len(generation.prompt_ids) else None
                steps = draft_tokens(draft_lm, context, limit, sampling, generator, self.eos_token_ids,
                                     self.verifier if uses_cloud else None, policy if uses_cloud else None, learn,
                                     companion if uses_cloud else None)  # only the verifier reads its signals
                while (drafted := await asyncio.to_thread(next, steps, None)) is not None:
                    block.drafted.append(drafted)
                    generation.recorder.draft_forwards += 1
                    if mode == "sprinter" and not drafted.ends_block:
                        # the verifier passed it and sprinter never checks it again: release it now
                        generation.new_tokens.append(drafted.token)
                        generation.release()
                if uses_cloud:
                    verdict = await self._verify(session, generation, context, block, mode)
                    if verdict is not None:
                        n_accepted, next_tok = verdict
                        del generation.new_tokens[len(context) - len(generation.prompt_ids):]
                        generation.new_tokens.extend(block.tokens[:n_accepted] + [next_tok])
                        policy.observe_verdict(len(block), n_accepted)
                        self._finished(generation)
                        generation.release()
                        continue
                # draft alone (mode draft, or the cloud is down): every drafted token stands
                del generation.new_tokens[len(context) - len(generation.prompt_ids):]
                generation.new_tokens.extend(block.tokens)
                self._finished(generation)
                generation.release()
        finally:
            if session is not None:
                await session.close()
        return session.reopens if session is not None else 0

    def _cloud_worth_trying(self, generation: Generation) -> bool:
        down_since = generation.cloud_down_since
        return down_since is None or time.monotonic() - down_since >= generation.settings.cloud_retry_s

    async def _verify(self, session, generation: Generation, context: list[int], block: PendingBlock,
                      mode: str) -> tuple[int, int] | None:
        """The cloud's (n_accepted, next_token), or None when it is unreachable (degraded from here)."""
        sampling = generation.settings.decode.sampling
        dists = None
        if not sampling.greedy:
            rows = block.drafted[-1:] if mode == "sprinter" else block.drafted
            dists = [SparseDistribution.from_dense(d.p_draft, generation.settings.max_sparse_support) for d in rows]
        probs = [float(d.p_draft[d.token]) for d in block.drafted]
        # A call that opens (or reopens) the session also pays the open frame and the prompt's prefill:
        # not what one more round trip costs, so the cost model does not learn from it.
        steady, reopens, started = session.session_id is not None, session.reopens, time.perf_counter()
        try:
            verdict = await session.verify(context, block.tokens, METHOD_BY_MODE[mode], probs, dists)
        except CloudUnavailable as err:
            if generation.cloud_down_since is None:
                log.warning("cloud unavailable; continuing from the draft alone (degraded): %s", err)
            generation.degraded = True
            generation.cloud_down_since = time.monotonic()
            return None
        if generation.cloud_down_since is not None:
            log.info("cloud is back")
            generation.cloud_down_since = None
        if steady and session.reopens == reopens:
            self.cost_model.observe_round_trip((time.perf_counter() - started) * 1e3, verdict.verify_ms, len(block))
        generation.recorder.verified(len(block), verdict.n_accepted)
        return verdict.n_accepted, verdict.next_token
