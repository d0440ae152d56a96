"""The edge decoding loop: draft locally, pay a cloud round trip only when the mode says so.

Modes (design.md): `draft` never calls the cloud; `target` streams from the cloud alone; `sd` and
`sd-block` send the pending block when their call policy says so (every k drafted tokens by
default); `sprinter` streams the tokens its verifier passes at once and sends the pending block
when a token is flagged; `sprinter-exact` releases tokens only once the cloud block-verified them
and sends when its policy says so (goodput by default). The costs goodput weighs are learned by one
`CostModel` per decoder: the link and the draft are properties of the edge, not of a request.

Each speculative mode runs the one speculative round (common/decoding/speculative_round.py) with
the cloud session as its backend (`CloudVerifier`: a pending block becomes a verify frame, the
cloud's answer a `Verdict`). If the cloud becomes unreachable the round keeps going from the draft
alone, marks the result degraded, and tries the cloud again after `cloud_retry_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable

import torch

from common.cached_lm import DraftLM
from common.call_policy import CostModel
from common.companion import Companion
from common.decoding.drafting import Drafter, PendingBlock
from common.decoding.generation import Generation
from common.decoding.modes import SPECULATIVE_MODES, DecodeSettings, call_policy
from common.decoding.speculative_round import Verdict, speculative_round
from common.models import LoadedModel, vocab_fingerprint
from common.sampling import SamplingParams, SparseDistribution
from common.stats import DecodeStats, StatsRecorder
from common.verifier import Verifier
from edge.cloud_client import CloudClient, CloudSession, CloudUnavailable
from sprinter.v1 import decoding_pb2 as pb

log = logging.getLogger(__name__)


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


def wire_method(method: str) -> int:
    """The .proto `Method` of a verify method of common/decoding/modes.py ('block' -> METHOD_BLOCK)."""
    return pb.Method.Value(f"METHOD_{method.upper()}")


class CloudVerifier:
    """The speculative round's backend over one generation's cloud session; None when out of reach."""

    def __init__(self, session: CloudSession, method: str, sampling: SamplingParams, max_sparse_support: int,
                 retry_s: float) -> None:
        self.session = session
        self.method = method
        self.sampling = sampling
        self.max_sparse_support = max_sparse_support
        self.retry_s = retry_s
        self.degraded = False  # some block of this generation stood as drafted
        self.down_since: float | None = None

    def reachable(self) -> bool:
        return self.down_since is None or time.monotonic() - self.down_since >= self.retry_s

    async def verify(self, context: list[int], block: PendingBlock) -> Verdict | None:
        probs = [float(d.p_draft[d.token]) for d in block.drafted]
        dists = self._draft_dists(block)
        # A call that opens (or reopens) the session also pays the open frame and the prompt's prefill:
        # not what one more round trip costs, so it reports no round trip for the cost model to learn.
        steady, reopens, started = self.session.session_id is not None, self.session.reopens, time.perf_counter()
        try:
            verdict = await self.session.verify(context, block.tokens, wire_method(self.method), probs, dists)
        except CloudUnavailable as err:
            if self.down_since is None:
                log.warning("cloud unavailable; continuing from the draft alone (degraded): %s", err)
            self.degraded = True
            self.down_since = time.monotonic()
            return None
        if self.down_since is not None:
            log.info("cloud is back")
            self.down_since = None
        round_trip_ms = (time.perf_counter() - started) * 1e3 if steady and self.session.reopens == reopens else None
        return Verdict(verdict.n_accepted, verdict.next_token, verdict.verify_ms, round_trip_ms)

    def _draft_dists(self, block: PendingBlock) -> list[SparseDistribution] | None:
        """Under sampling, the distributions the tokens were drawn from (sprinter's rule reads only the last)."""
        if self.sampling.greedy:
            return None
        rows = block.drafted[-1:] if self.method == "sprinter" else block.drafted
        return [SparseDistribution.from_dense(d.p_draft, self.max_sparse_support) for d in rows]

    async def close(self) -> None:
        await self.session.close()


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

    async def stream(self, prompt_ids: list[int], settings: EdgeSettings) -> AsyncIterator[list[int] | EdgeResult]:
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
        generation = Generation(list(prompt_ids), settings.decode, self.eos_token_ids, StatsRecorder(mode), emit)
        if mode == "target":
            degraded, reopens = await self._target(generation, settings), 0
        else:
            degraded, reopens = await self._speculate(generation, settings, draft_only=mode == "draft")
        tokens = generation.new_tokens
        return EdgeResult(tokens, self.draft.tokenizer.decode(tokens, skip_special_tokens=True),
                          generation.recorder.finish(len(tokens)), degraded, reopens)

    async def _target(self, generation: Generation, settings: EdgeSettings) -> bool:
        """Mode target: the cloud generates alone; from the draft alone if it cannot. True when degraded."""
        decode = generation.settings
        if self.cloud is None:
            raise ValueError("mode 'target' needs a cloud (--cloud HOST:PORT)")
        try:
            async for token in self.cloud.generate(generation.prompt_ids, decode.sampling, decode.max_new_tokens,
                                                   self.vocab_fingerprint):
                generation.recorder.target_calls += 1
                generation.commit(len(generation.new_tokens), [token])
                if generation.done:
                    break
        except CloudUnavailable as err:
            log.warning("cloud unavailable in target mode, continuing from the draft: %s", err)
            await self._speculate(generation, settings, draft_only=True)
            return True
        return False

    async def _speculate(self, generation: Generation, settings: EdgeSettings, draft_only: bool) -> tuple[bool, int]:
        """Speculative rounds until the generation is done; (degraded, cloud session reopens)."""
        mode = generation.settings.mode
        degraded = mode != "draft" and self.cloud is None
        if degraded:
            log.warning("no cloud configured: mode %s runs from the draft alone", mode)
        sampling = self._draft_sampling(settings)
        drafter = Drafter(self.make_draft_lm(), sampling, torch.Generator().manual_seed(sampling.seed),
                          self.eos_token_ids, self.verifier,
                          self.make_companion() if self.make_companion is not None else None, offload=True)
        policy = None
        if mode in SPECULATIVE_MODES:  # fresh per generation; what it learns of the link lives in the cost model
            policy = call_policy(generation.settings, self.verifier, self.cost_model)
            generation.recorder.policy = policy.describe()
        backend = None
        if not (draft_only or degraded):
            backend = CloudVerifier(self.cloud.session(generation.settings.sampling, self.vocab_fingerprint),
                                    generation.settings.verify_method, generation.settings.sampling,
                                    settings.max_sparse_support, settings.cloud_retry_s)
        try:
            while not generation.done:
                await speculative_round(generation, drafter, backend, policy, self.cost_model)
        finally:
            if backend is not None:
                await backend.close()
        if backend is None:
            return degraded, 0
        return backend.degraded, backend.session.reopens

    @staticmethod
    def _draft_sampling(settings: EdgeSettings) -> SamplingParams:
        """On the wire a sampled draft distribution travels sparse; sampling from the capped support keeps it exact."""
        sampling = settings.decode.sampling
        if sampling.greedy:
            return sampling
        return replace(sampling, top_k=min(sampling.top_k or settings.max_sparse_support, settings.max_sparse_support))
