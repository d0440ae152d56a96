"""The target host: what the gRPC service asks of the target (open, verify, generate).

Every method checks its input (cloud/frames.py) and is admitted by the session store (KV budget,
quotas) before it costs a forward. The target itself runs in an engine behind one seam
(cloud/engine.py: resident or vllm); its rows become a verdict in one place for both
(common/spec/acceptance_rules.py `decide`). `abandoned` is how a caller says it has left: work it queued is then
skipped before its forward.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, TypeVar

import grpc

from cloud.admission_queue import AdmissionQueue, Tell, busy
from cloud.engine import (Abandoned, ForwardResult, GeneratedToken, TargetEngine, TargetRows, scored_prefill,
                          whole_pages)
from cloud.errors import CloudError, invalid
from cloud.frames import (ServiceLimits, admit_sampling, check_output_start, check_prompt, check_speculation,
                          check_verify, frame_decision, refuse_tree_candidate)
from cloud.metrics import CloudMetrics
from cloud.prefix_cache import reusing
from cloud.residual import PendingResidual, ResidualSettings
from cloud.sessions import Session, SessionStore
from cloud.cloud_sd import SpeculatedRound, SpeculationRequest
from cloud.suffix_memories import SuffixMemories
from cloud.tree_verify import forward_parents, kept_path
from common import wire
from common.sampling.grammar import GrammarCompiler
from common.sampling.logits_processing import LogitsProcessor, processor_for
from common.sampling.logprobs import TokenLogprob
from common.sampling.params import GrammarError, SamplingParams
from common.spec.round_cost import CloudCosts
from common.spec.tree.draft_tree import DraftTree
from common.admission import Admission
from common.tracing import tracer
from sprinter.v1 import decoding_pb2 as pb

T = TypeVar("T")


@dataclass
class TargetHost:
    """What exists once the target is loaded."""

    engine: TargetEngine
    limits: ServiceLimits
    store: SessionStore
    metrics: CloudMetrics
    grammars: GrammarCompiler | None = None  # made at the first request with a grammar (it converts the tokenizer)
    residual: ResidualSettings = field(default_factory=ResidualSettings)  # cloud/residual.py: dists_on_rejection
    proposer: str = "model"  # cloud-sd's proposer for a Generate that names none (`--proposer`)
    suffix_memories: SuffixMemories = field(default_factory=SuffixMemories)  # per edge identity, never shared
    queue: AdmissionQueue = field(default_factory=AdmissionQueue)  # cloud/admission_queue.py: work waiting for room
    costs: CloudCosts = field(default_factory=CloudCosts)  # cloud/cost_table.py: timed at start, reported in GetInfo

    @property
    def vocab_size(self) -> int:
        return self.engine.info.vocab_size

    @property
    def vocab_fingerprint(self) -> str:
        return self.engine.info.vocab_fingerprint

    def info(self) -> pb.ServiceInfo:
        target = self.engine.info
        return wire.service_info(target.spec, target.vocab_fingerprint, target.vocab_size, self.limits.to_proto(),
                                 sorted(target.eos_token_ids), self.engine.draft_spec or "", self.costs)

    def _check_fingerprint(self, fingerprint: str) -> None:
        if fingerprint and fingerprint != self.vocab_fingerprint:
            raise CloudError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"vocabulary fingerprint {fingerprint[:12]}... differs from this cloud's "
                             f"({self.vocab_fingerprint[:12]}..., model {self.engine.info.spec}): "
                             "the draft must share the target's tokenizer")

    def close(self, session: Session) -> None:
        self.store.close(session.session_id)
        self.update_gauges()

    async def open(self, owner: str, request: pb.OpenSession, previous: Session | None = None,
                   abandoned: Abandoned | None = None, tell: Tell | None = None) -> tuple[Session, bool]:
        """Open (or resume) a session; `previous`, the stream's current session, is closed: a stream holds one.
        A cloud without room puts a new session in line (cloud/admission_queue.py), telling `tell` its place."""
        self._check_fingerprint(request.vocab_fingerprint)
        if request.resume_session_id:
            session = self.store.get(request.resume_session_id, owner)
            if previous is not None and previous is not session:
                self.close(previous)
            return session, True
        sampling = admit_sampling(request.sampling, self.vocab_size)
        self.engine.check_sampling(sampling)
        prompt_ids = list(request.prompt_ids)
        check_prompt(prompt_ids, self.vocab_size, self.limits)
        processor = self._processor(sampling, prompt_ids[:check_output_start(request)])
        if previous is not None:
            self.close(previous)
        admission = wire.admission_of(request)
        seniority = self.store.seniority_of_evicted(admission.evicted_session_id, owner) or self.store.stamp()
        session, session.queued_s = await self._admit(
            owner, admission, lambda: self.store.admit(owner, prompt_ids, sampling, self.engine.new_session_kv(), seniority), tell, abandoned, seniority)
        session.processor, session.admission = processor, admission
        session.busy = True
        try:
            if len(prompt_ids) > 1 and sampling.prompt_logprobs is not None:  # echo: the prefill's rows are read
                session.prompt_logprobs = await self._scored_prefill(session, prompt_ids, sampling.prompt_logprobs,
                                                                     abandoned)
            elif len(prompt_ids) > 1:  # the last prompt token is fed with the first block
                async with reusing(self.store.prefix_cache, session.cache, self._prefix_scope(owner),
                                   prompt_ids[:-1]) as reuse:
                    session.cached_tokens = session.reused_tokens = reuse.tokens
                    await self.engine.prefill(session, prompt_ids[reuse.tokens:-1], abandoned)
                    session.cached_tokens = len(prompt_ids) - 1
                self._count_reuse(reuse.tokens, reuse.copied_bytes)
                self.store.check_kv("forward")
        except BaseException:
            self.close(session)
            raise
        finally:
            session.busy = False
        session.touch()
        self.store.enforce_budget(protect=session)
        self.update_gauges()
        return session, False

    def _prefix_scope(self, owner: str) -> str | None:
        """Whose cached prefixes `owner`'s work may start from; None: this engine keeps no prefix cache."""
        cache = self.store.prefix_cache
        return cache.scope(owner) if cache is not None else None

    def _count_reuse(self, tokens: int, copied_bytes: int = 0) -> None:
        """One prompt looked up in the prefix cache: a hit when it gave `tokens` > 0."""
        if self.store.prefix_cache is None:
            return
        self.metrics.prefix_cache_queries.inc()
        if tokens:
            self.metrics.prefix_cache_hits.inc()
            self.metrics.prefix_cache_tokens.inc(tokens)
            self.metrics.prefix_cache_copied_bytes.inc(copied_bytes)

    async def _scored_prefill(self, session: Session, prompt_ids: list[int], top_n: int,
                              abandoned: Abandoned | None) -> list[TokenLogprob]:
        """Prefill the session with prompt_ids[:-1], its rows scoring the prompt's tokens (echo)."""
        async def forward(chunk: list[int]) -> TargetRows:
            result = await self.engine.forward(session, chunk, n_logits=len(chunk), abandoned=abandoned)
            session.cached_tokens += len(chunk)
            self.store.check_kv("forward")
            return result.rows

        return await scored_prefill(forward, prompt_ids, top_n)

    async def first_token(self, session: Session,
                          abandoned: Abandoned | None = None) -> tuple[int, TokenLogprob | None]:
        """The target's token after a freshly opened session's prompt, sampled with the session's generator
        (as a Generate's first token is) and appended to its context; its logprob when the sampling asks."""
        session.busy = True
        try:
            self.store.grant_kv(session, session.length)
            result = await self.engine.forward(session, session.tokens[session.cached_tokens:], n_logits=1,
                                               abandoned=abandoned)
            session.cached_tokens = session.length
            self.store.check_kv("forward")
            token = result.rows.shaped(session.processor, session.tokens, []).next_token(session.sampling,
                                                                                       session.generator)
            logprob = next(iter(result.rows.logprobs(session.sampling, [token])), None)
            session.tokens.append(token)
        finally:
            session.busy = False
        self.metrics.tokens_generated.inc()
        self.store.enforce_budget(protect=session)
        self.update_gauges()
        return token, logprob

    async def verify(self, session: Session, frame: pb.VerifyBlock, abandoned: Abandoned | None = None,
                     tell: Tell | None = None) -> pb.Verdict | pb.ResidualQuery:
        """The verdict on `frame`, or (a frame with dists_on_rejection that the rule rejects in) the residual
        query the edge must answer first (`answer_residual`); the session stays busy until then. KV the budget
        cannot grant now is waited for in line, ahead of new work (cloud/admission_queue.py)."""
        check_verify(frame, session.length, session.sampling, self.vocab_size, self.limits)
        if session.busy:
            raise CloudError(grpc.StatusCode.ABORTED, "this session is already verifying on another stream")
        # Not busy until its KV is granted (`SessionStore.grant_live`): a session busy while it waits in line could
        # never be evicted, and sessions all waiting for KV would hold the budget between them for good.
        try:
            draft_tokens = list(frame.draft_tokens)
            new_tokens = session.tokens[session.cached_tokens:] + draft_tokens
            with tracer.span("cloud.queue"):
                _, queued_s = await self._admit(session.owner, session.admission,
                                                lambda: self.store.grant_live(session, session.cached_tokens + len(new_tokens)),
                                                tell if session.admission.waits_in_line else None, abandoned,
                                                session.seniority, running=True)
            parents = wire.tree_parents(frame)  # a tree's N tokens are all written: N entries granted above
            tree = None if parents is None else forward_parents(len(new_tokens) - len(draft_tokens), parents)
            with tracer.span("cloud.forward", tokens=len(new_tokens)):
                result = await self.engine.forward(session, new_tokens, n_logits=len(draft_tokens) + 1,
                                                   abandoned=abandoned, tree=tree)
            self.store.check_kv("forward")
            started = time.perf_counter()
            try:
                with tracer.span("cloud.rule", method=wire.method_name(frame.method)):
                    decision = frame_decision(frame, session, result.rows)
                n_accepted, next_token = decision.n_accepted, decision.next_token
                if next_token is None:  # the token rule rejected: its residual needs the edge's distribution
                    if abandoned is not None and abandoned():  # the stream that would answer is gone
                        raise CloudError(grpc.StatusCode.CANCELLED, "the edge left before its residual query")
                    session.pending_residual = PendingResidual(frame, result, len(new_tokens), n_accepted,
                                                               decision.p_target[n_accepted].clone(),
                                                               (time.perf_counter() - started) * 1e3)
                    return self._ask(session.pending_residual, session)  # busy until answered
            except BaseException:  # keep cache and tokens in step: drop what this forward appended
                self.engine.rollback(session, session.cached_tokens)
                raise
            verdict = self._settle(session, frame, result, len(new_tokens), n_accepted, next_token,
                                   (time.perf_counter() - started) * 1e3, decision.path)
            wire.set_queued_ms(verdict, queued_s * 1e3)
            return verdict
        finally:
            session.busy = session.pending_residual is not None

    async def _admit(self, owner: str, admission: Admission, attempt: Callable[[], T], tell: Tell | None,
                     abandoned: Abandoned | None, seniority: int, running: bool = False) -> tuple[T, float]:
        """`attempt()` at once while nobody waits ahead (no cost but the attempt), else in line (or refused as busy)."""
        if not (self.queue.running_waiting if running else self.queue.waiting):
            try:
                return attempt(), 0.0
            except CloudError as err:
                if tell is None or not busy(err):
                    raise
            return await self.queue.admit(owner, admission, attempt, tell, seniority, abandoned, running, tried=True)
        return await self.queue.admit(owner, admission, attempt, tell, seniority, abandoned, running)

    def answer_residual(self, session: Session, answer: pb.ResidualAnswer) -> pb.Verdict | pb.ResidualQuery:
        """Go on with the verify waiting on `answer`: its verdict, or the next query. A refused answer abandons
        that verify (its forward rolled back) and raises, as a verify that fails does."""
        pending = session.pending_residual
        if pending is None:
            raise invalid("residual_answer without a residual_query pending: answer only the cloud's queries, "
                          "each once, before any other frame")
        started = time.perf_counter()
        try:
            token = pending.resolve(answer, self.limits, self.vocab_size, session.generator)
            if token is None:
                return self._ask(pending, session)
        except BaseException:
            self.abandon_residual(session)
            raise
        session.pending_residual = None
        session.busy = False
        return self._settle(session, pending.frame, pending.result, pending.new_tokens, pending.position, token,
                            pending.compute_ms + (time.perf_counter() - started) * 1e3)

    def _ask(self, pending: PendingResidual, session: Session) -> pb.ResidualQuery:
        query = pending.next_query(self.residual, session.generator)
        self.metrics.residual_queries.labels("full" if query.full_distribution else "candidates").inc()
        return query

    def abandon_residual(self, session: Session) -> None:
        """Drop a verify still waiting on residual answers (the edge sent something else, went away, or answered
        garbage): its forward is rolled back and the session is as before that verify."""
        if session.pending_residual is None:
            return
        session.pending_residual = None
        self.engine.rollback(session, session.cached_tokens)
        session.busy = False
        self.metrics.residual_queries.labels("abandoned").inc()

    def _settle(self, session: Session, frame: pb.VerifyBlock, result: ForwardResult, new_tokens: int,
                n_accepted: int, next_token: int, decide_ms: float, path: list[int] | None = None) -> pb.Verdict:
        """Keep the verdict's tokens: the cache rolled back to the accepted prefix (a tree's: its kept `path` moved
        into place), next_token fed with the next block."""
        draft_tokens = list(frame.draft_tokens)
        session.cached_tokens += new_tokens
        start_position = session.length
        keep = session.length + n_accepted
        rows, on_chain = result.rows, True
        if path is None:
            self.engine.rollback(session, keep)
            kept = draft_tokens[:n_accepted] + [next_token]
        else:  # a candidate is drafted along a tree's primary chain: none follows a side path's verdict
            self.engine.keep_path(session, start_position, path)
            kept, rows, on_chain = kept_path(DraftTree(draft_tokens, wire.tree_parents(frame)), path, next_token, rows)
            self.metrics.tree_verdicts.labels("primary" if on_chain else "side").inc()
        session.cached_tokens = keep
        logprobs = rows.logprobs(session.sampling, kept)  # the raw rows, before the request's transform
        session.tokens.extend(kept)
        session.last_verdict = (start_position, n_accepted, next_token) if on_chain else None
        session.touch()
        self.metrics.count_verdict(wire.method_name(frame.method), len(draft_tokens), n_accepted)
        self.store.enforce_budget(protect=session)
        self.update_gauges()
        return wire.verdict(n_accepted=n_accepted, next_token=next_token, context_length=session.length,
                            verify_ms=result.forward_ms + decide_ms, queue_ms=result.queue_ms,
                            cloud_batch_size=result.batch_size, start_position=start_position,
                            candidate=wire.candidate_after(frame) is not None, logprobs=logprobs, path=path)

    def candidate_matches(self, session: Session, frame: pb.VerifyBlock) -> bool:
        """Whether a candidate block follows the session's latest verdict, so verifying it now is what the edge
        would ask for next; a candidate that does not is dropped unchecked (counted, no forward, no reply). None follows
        a tree verdict that kept a side path (`last_verdict` None); a tree sent as a candidate is refused."""
        refuse_tree_candidate(frame)
        matches = session.last_verdict == wire.candidate_after(frame)
        if not matches:
            self.metrics.candidates.labels("dropped").inc()
        return matches

    async def generate(self, owner: str, request: pb.GenerateRequest, abandoned: Abandoned | None = None,
                       tell: Tell | None = None) -> AsyncIterator[pb.GenerateChunk]:
        """Target-only decoding, or with a speculation cloud-sd's rounds (cloud/cloud_sd.py), its KV held inside
        the budget; a chunk per token (per round), the last says why it finished. Without room it waits in the
        line sessions wait in, telling `tell` its place (an edge that reads queue tickets)."""
        self._check_fingerprint(request.vocab_fingerprint)
        sampling = admit_sampling(request.sampling, self.vocab_size)
        context = list(request.prompt_ids)
        check_prompt(context, self.vocab_size, self.limits)
        output_start = check_output_start(request)
        asked = check_speculation(request, self.limits, self.proposer, self.engine.draft_spec)  # (block, proposer)
        speculation = None if asked is None else SpeculationRequest(
            *asked, self.suffix_memories.of(owner) if asked[1] != "model" else None, self.limits.max_block)
        processor = self._processor(sampling, context[:output_start])
        if request.max_new_tokens < 1:
            raise CloudError(grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens must be >= 1")
        max_new = min(request.max_new_tokens, self.limits.max_context - len(context))
        scope = self._prefix_scope(owner)
        if speculation is None:
            steps = self.engine.generate(context, max_new, sampling, processor, scope)
        else:  # the draft shapes its logits with a processor of its own: each follows its own model's rows
            steps = self.engine.speculate(context, max_new, sampling,
                                          (processor, self._processor(sampling, context[:output_start])), speculation,
                                          scope)
        round_cap = speculation.cap if speculation is not None else 0  # a verify writes its block before the rollback
        kv_tokens, admission = whole_pages(self.engine, len(context) + max_new + round_cap), wire.admission_of(request)
        seniority = self.store.stamp()
        key, queued_s = await self._admit(owner, admission,
                                          lambda: self.store.start_generation(owner, kv_tokens, seniority),
                                          tell if admission.waits_in_line else None, abandoned, seniority)
        try:
            async for chunk in self._generated(steps, queued_s):
                yield chunk
        finally:
            self.store.end_generation(key)
            self.update_gauges()

    async def _generated(self, steps: AsyncIterator[GeneratedToken | SpeculatedRound],
                         queued_s: float) -> AsyncIterator[pb.GenerateChunk]:
        self.update_gauges()
        # aclosing: a generation that ends at EOS releases its cache now, not when the generator is collected
        async with contextlib.aclosing(steps):
            looked_up = False
            async for step in steps:
                self.store.check_kv("forward")
                self.metrics.count_step(step)
                stop = "stop" if step.tokens[-1] in self.engine.info.eos_token_ids else None
                chunk = wire.generate_chunk(step.tokens, step.step_ms, stop, step.logprobs, step.prompt_logprobs,
                                            drafted=step.drafted, draft_ms=step.draft_ms,
                                            cached_tokens=step.cached_tokens, copied=step.copied,
                                            copied_kept=step.copied_kept)
                if not looked_up:  # the first step says what the prompt found in the prefix cache
                    self._count_reuse(step.cached_tokens)
                    wire.set_queued_ms(chunk, queued_s * 1e3)
                    looked_up = True
                yield chunk
                if stop:
                    return
        yield wire.generate_chunk(finish_reason="length")  # max_new_tokens, or the context limit

    def _processor(self, sampling: SamplingParams, prompt_ids: list[int]) -> LogitsProcessor | None:
        """The request's grammar, bias and penalties over the target's logits; a grammar that does not compile
        for the target's tokenizer is refused (INVALID_ARGUMENT, the compiler's words)."""
        if sampling.grammar is not None and self.grammars is None:
            self.grammars = GrammarCompiler(self.engine.tokenizer, self.vocab_size)
        try:
            return processor_for(sampling, prompt_ids, self.grammars)
        except GrammarError as err:
            raise CloudError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.grammar: {err}") from None

    def update_gauges(self) -> None:
        if self.queue.waiting:  # every change of what is held may make room for the head of the line
            self.queue.kick()
        self.metrics.sessions_open.set(len(self.store))
        self.metrics.kv_cache_bytes.set(self.store.kv_bytes)
        self.metrics.prefix_cache_bytes.set(self.store.cached_tokens * self.store.kv_bytes_per_token)
        page = self.engine.kv_bytes_per_page
        if page:  # an engine that keeps its own KV (vllm) reports its cache in its own metrics
            used = -(-self.store.kv_bytes // page)
            self.metrics.kv_pages_used.set(used)
            self.metrics.kv_pages_free.set(max(0, self.store.limits.kv_budget_bytes // page - used))
