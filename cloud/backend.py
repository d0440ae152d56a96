"""The target backend: what the gRPC service asks of the loaded model (open, verify, generate).

Every method checks its input (cloud/frames.py) and is admitted by the session store (KV budget,
quotas) before it costs a forward. `abandoned` is how a caller says it has left: work it queued
is then skipped before its forward (cloud/batcher.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import grpc
import torch

from cloud.batcher import Batcher
from cloud.errors import CloudError
from cloud.frames import METHOD_NAMES, ServiceLimits, check_prompt, check_verify, decide, sampling_from_proto
from cloud.metrics import CloudMetrics
from cloud.resident_kv import KVLayout, ResidentKV
from cloud.sessions import Session, SessionStore
from common.models import LoadedModel
from common.sampling import SamplingParams, logits_to_probs, sample
from sprinter.v1 import decoding_pb2 as pb

Abandoned = Callable[[], bool]


@dataclass
class TargetBackend:
    """What exists once the target model is loaded."""

    target: LoadedModel
    vocab_fingerprint: str
    limits: ServiceLimits
    store: SessionStore
    batcher: Batcher
    metrics: CloudMetrics
    kv_layout: KVLayout

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    def info(self) -> pb.ServiceInfo:
        return pb.ServiceInfo(model_id=self.target.spec, vocab_fingerprint=self.vocab_fingerprint,
                              vocab_size=self.vocab_size, limits=self.limits.to_proto(),
                              eos_token_ids=sorted(self.target.eos_token_ids))

    def _check_fingerprint(self, fingerprint: str) -> None:
        if fingerprint and fingerprint != self.vocab_fingerprint:
            raise CloudError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"vocabulary fingerprint {fingerprint[:12]}... differs from this cloud's "
                             f"({self.vocab_fingerprint[:12]}..., model {self.target.spec}): the draft must share the target's tokenizer")

    def close(self, session: Session) -> None:
        self.store.close(session.session_id)
        self.update_gauges()

    async def open(self, owner: str, request: pb.OpenSession, previous: Session | None = None,
                   abandoned: Abandoned | None = None) -> tuple[Session, bool]:
        """Open (or resume) a session; `previous`, the stream's current session, is closed: a stream holds one."""
        self._check_fingerprint(request.vocab_fingerprint)
        if request.resume_session_id:
            session = self.store.get(request.resume_session_id, owner)
            if previous is not None and previous is not session:
                self.close(previous)
            return session, True
        sampling = sampling_from_proto(request.sampling)
        prompt_ids = list(request.prompt_ids)
        check_prompt(prompt_ids, self.vocab_size, self.limits)
        if previous is not None:
            self.close(previous)
        session = self.store.create(owner, prompt_ids, sampling, ResidentKV(self.kv_layout))
        session.busy = True
        try:
            # The prompt's pages and two more at once, if the budget has them: no growth copy in the first verifies.
            self.store.grant_kv(session, len(prompt_ids), headroom=2 * self.kv_layout.page_tokens)
            if len(prompt_ids) > 1:  # the last prompt token is fed with the first block
                await self.batcher.prefill(session.cache, prompt_ids[:-1], abandoned)
                session.cached_tokens = len(prompt_ids) - 1
        except BaseException:
            self.close(session)
            raise
        finally:
            session.busy = False
        session.touch()
        self.store.enforce_budget(protect=session)
        self.update_gauges()
        return session, False

    async def first_token(self, session: Session, abandoned: Abandoned | None = None) -> int:
        """The target's token after a freshly opened session's prompt, sampled with the session's generator
        (as a Generate's first token is) and appended to its context."""
        session.busy = True
        try:
            self.store.grant_kv(session, session.length)
            result = await self.batcher.forward(session.cache, session.tokens[session.cached_tokens:], n_logits=1,
                                                abandoned=abandoned)
            session.cached_tokens = session.length
            token = sample(logits_to_probs(result.logits[-1], session.sampling), session.generator)
            session.tokens.append(token)
        finally:
            session.busy = False
        self.metrics.tokens_generated.inc()
        self.store.enforce_budget(protect=session)
        self.update_gauges()
        return token

    async def verify(self, session: Session, frame: pb.VerifyBlock, abandoned: Abandoned | None = None) -> pb.Verdict:
        check_verify(frame, session.length, session.sampling, self.vocab_size, self.limits)
        if session.busy:
            raise CloudError(grpc.StatusCode.ABORTED, "this session is already verifying on another stream")
        session.busy = True
        try:
            draft_tokens = list(frame.draft_tokens)
            g = len(draft_tokens)
            new_tokens = session.tokens[session.cached_tokens:] + draft_tokens
            self.store.grant_kv(session, session.cached_tokens + len(new_tokens))
            result = await self.batcher.forward(session.cache, new_tokens, n_logits=g + 1, abandoned=abandoned)
            started = time.perf_counter()
            try:
                n_accepted, next_token = decide(frame, result.logits, session.sampling, session.generator)
            except BaseException:  # keep cache and tokens in step: drop what this forward appended
                session.cache.truncate(session.cached_tokens)
                raise
            session.cached_tokens += len(new_tokens)
            # Roll the cache back to the accepted prefix; next_token is fed with the next block.
            start_position = session.length
            keep = session.length + n_accepted
            session.cache.truncate(keep)  # moves the length: the rejected entries are overwritten later
            session.cached_tokens = keep
            session.tokens.extend(draft_tokens[:n_accepted] + [next_token])
            session.last_verdict = (start_position, n_accepted, next_token)
        finally:
            session.busy = False
        session.touch()
        self.metrics.verify_calls.labels(METHOD_NAMES[frame.method]).inc()
        self.metrics.tokens_verified.inc(g)
        self.metrics.tokens_accepted.inc(n_accepted)
        self.store.enforce_budget(protect=session)
        self.update_gauges()
        return pb.Verdict(n_accepted=n_accepted, next_token=next_token, context_length=session.length,
                          verify_ms=result.forward_ms + (time.perf_counter() - started) * 1e3,
                          queue_ms=result.queue_ms, cloud_batch_size=result.batch_size,
                          start_position=start_position, candidate=frame.HasField("after"))

    def candidate_matches(self, session: Session, frame: pb.VerifyBlock) -> bool:
        """Whether a candidate block follows the session's latest verdict, so verifying it now is what the edge
        would ask for next; a candidate that does not is dropped unchecked (counted, no forward, no reply)."""
        after = frame.after
        matches = session.last_verdict == (after.start_position, after.n_accepted, after.next_token)
        if not matches:
            self.metrics.candidates.labels("dropped").inc()
        return matches

    async def generate(self, owner: str, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateChunk]:
        """Target-only decoding, its KV held inside the budget; the last chunk says why it finished."""
        self._check_fingerprint(request.vocab_fingerprint)
        sampling = sampling_from_proto(request.sampling)
        context = list(request.prompt_ids)
        check_prompt(context, self.vocab_size, self.limits)
        if request.max_new_tokens < 1:
            raise CloudError(grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens must be >= 1")
        max_new = min(request.max_new_tokens, self.limits.max_context - len(context))
        with self.store.generation(owner, len(context) + max_new):
            self.update_gauges()
            try:
                async for chunk in self._decode(context, max_new, sampling):
                    yield chunk
            finally:
                self.update_gauges()

    async def _decode(self, context: list[int], max_new: int, sampling: SamplingParams) -> AsyncIterator[pb.GenerateChunk]:
        generator = torch.Generator().manual_seed(sampling.seed)
        cache = ResidentKV(self.kv_layout, reserve_tokens=len(context) + max_new)
        started = time.perf_counter()
        if len(context) > 1:  # the prompt apart from verify batches, like a session's
            await self.batcher.prefill(cache, context[:-1])
        prefill_ms = (time.perf_counter() - started) * 1e3
        new_tokens = context[-1:]
        for _ in range(max_new):
            result = await self.batcher.forward(cache, new_tokens, n_logits=1)
            token = sample(logits_to_probs(result.logits[-1], sampling), generator)
            self.metrics.tokens_generated.inc()
            if token in self.target.eos_token_ids:
                yield pb.GenerateChunk(token_ids=[token], finished=True, finish_reason="stop",
                                       step_ms=prefill_ms + result.queue_ms + result.forward_ms)
                return
            yield pb.GenerateChunk(token_ids=[token], step_ms=prefill_ms + result.queue_ms + result.forward_ms)
            new_tokens, prefill_ms = [token], 0.0
        yield pb.GenerateChunk(finished=True, finish_reason="length")  # max_new_tokens, or the context limit

    def update_gauges(self) -> None:
        self.metrics.sessions_open.set(len(self.store))
        self.metrics.kv_cache_bytes.set(self.store.kv_bytes)
        page = self.kv_layout.bytes_per_page
        used = -(-self.store.kv_bytes // page)
        self.metrics.kv_pages_used.set(used)
        self.metrics.kv_pages_free.set(max(0, self.store.limits.kv_budget_bytes // page - used))
