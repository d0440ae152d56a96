"""The gRPC TargetService: sessions that verify edge blocks, and cloud-only generation.

A bad frame is answered with an Error frame carrying the gRPC status code and a message; the stream
and the session stay usable, and no other session notices. Calls that cannot start (no or wrong
bearer token, model still loading, draining) end with that status instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
import torch
from transformers import DynamicCache

from cloud.auth import EdgeAuthenticator
from cloud.batcher import Batcher
from cloud.errors import CloudError
from cloud.frames import METHOD_NAMES, ServiceLimits, check_prompt, check_verify, decide, sampling_from_proto
from cloud.metrics import CloudMetrics
from cloud.sessions import Session, SessionStore
from common.models import LoadedModel
from common.sampling import logits_to_probs, sample
from sprinter.v1 import decoding_pb2 as pb
from sprinter.v1 import decoding_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


@dataclass
class TargetBackend:
    """What exists once the target model is loaded."""

    target: LoadedModel
    vocab_fingerprint: str
    limits: ServiceLimits
    store: SessionStore
    batcher: Batcher
    metrics: CloudMetrics

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

    async def open(self, owner: str, request: pb.OpenSession) -> tuple[Session, bool]:
        self._check_fingerprint(request.vocab_fingerprint)
        if request.resume_session_id:
            return self.store.get(request.resume_session_id, owner), True
        sampling = sampling_from_proto(request.sampling)
        prompt_ids = list(request.prompt_ids)
        check_prompt(prompt_ids, self.vocab_size, self.limits)
        session = self.store.create(owner, prompt_ids, sampling, DynamicCache(config=self.target.model.config))
        session.busy = True
        try:
            if len(prompt_ids) > 1:  # the last prompt token is fed with the first block
                await self.batcher.forward(session.cache, prompt_ids[:-1], n_logits=1)
                session.cached_tokens = len(prompt_ids) - 1
        except BaseException:
            self.store.close(session.session_id)
            raise
        finally:
            session.busy = False
        self.store.enforce_budget()
        self.update_gauges()
        return session, False

    async def verify(self, session: Session, frame: pb.VerifyBlock) -> pb.Verdict:
        check_verify(frame, session.length, session.sampling, self.vocab_size, self.limits)
        if session.busy:
            raise CloudError(grpc.StatusCode.ABORTED, "this session is already verifying on another stream")
        session.busy = True
        try:
            draft_tokens = list(frame.draft_tokens)
            g = len(draft_tokens)
            new_tokens = session.tokens[session.cached_tokens:] + draft_tokens
            result = await self.batcher.forward(session.cache, new_tokens, n_logits=g + 1)
            started = time.perf_counter()
            try:
                n_accepted, next_token = decide(frame, result.logits, session.sampling, session.generator)
            except BaseException:  # keep cache and tokens in step: drop what this forward appended
                session.cache.crop(-len(new_tokens))
                raise
            session.cached_tokens += len(new_tokens)
            # Roll the cache back to the accepted prefix; next_token is fed with the next block.
            keep = session.length + n_accepted
            if session.cached_tokens > keep:
                session.cache.crop(-(session.cached_tokens - keep))  # transformers 5.23: a negative count
            session.cached_tokens = keep
            session.tokens.extend(draft_tokens[:n_accepted] + [next_token])
        finally:
            session.busy = False
        session.touch()
        self.metrics.verify_calls.labels(METHOD_NAMES[frame.method]).inc()
        self.metrics.tokens_verified.inc(g)
        self.metrics.tokens_accepted.inc(n_accepted)
        self.store.enforce_budget()
        self.update_gauges()
        return pb.Verdict(n_accepted=n_accepted, next_token=next_token, context_length=session.length,
                          verify_ms=result.forward_ms + (time.perf_counter() - started) * 1e3,
                          queue_ms=result.queue_ms, cloud_batch_size=result.batch_size)

    async def generate(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateChunk]:
        self._check_fingerprint(request.vocab_fingerprint)
        sampling = sampling_from_proto(request.sampling)
        context = list(request.prompt_ids)
        check_prompt(context, self.vocab_size, self.limits)
        if request.max_new_tokens < 1:
            raise CloudError(grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens must be >= 1")
        max_new = min(request.max_new_tokens, self.limits.max_context - len(context))
        generator = torch.Generator().manual_seed(sampling.seed)
        cache = DynamicCache(config=self.target.model.config)
        new_tokens = context
        for _ in range(max_new):
            result = await self.batcher.forward(cache, new_tokens, n_logits=1)
            token = sample(logits_to_probs(result.logits[-1], sampling), generator)
            self.metrics.tokens_generated.inc()
            finished = token in self.target.eos_token_ids
            yield pb.GenerateChunk(token_ids=[token], finished=finished, step_ms=result.queue_ms + result.forward_ms)
            if finished:
                return
            new_tokens = [token]
        yield pb.GenerateChunk(finished=True)

    def update_gauges(self) -> None:
        self.metrics.sessions_open.set(len(self.store))
        self.metrics.kv_cache_bytes.set(self.store.kv_bytes)


class TargetServicer(pb_grpc.TargetServiceServicer):
    def __init__(self, authenticator: EdgeAuthenticator, metrics: CloudMetrics) -> None:
        self.authenticator = authenticator
        self.metrics = metrics
        self.backend: TargetBackend | None = None  # set once the model is loaded
        self.draining = False
        self.open_streams = 0

    async def _admit(self, context: grpc.aio.ServicerContext) -> tuple[str, TargetBackend]:
        identity = self.authenticator.identify(context.invocation_metadata())
        if identity is None:
            self.metrics.errors.labels("UNAUTHENTICATED").inc()
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or unknown bearer token: send metadata 'authorization: Bearer <token>'")
        if self.backend is None:
            self.metrics.errors.labels("UNAVAILABLE").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the target model is still loading; retry shortly")
        if self.draining:
            self.metrics.errors.labels("UNAVAILABLE").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this cloud is shutting down; connect to another replica")
        return identity, self.backend

    def _error_frame(self, err: CloudError, session: Session | None) -> pb.CloudFrame:
        self.metrics.errors.labels(err.code.name).inc()
        log.info("refused frame: %s %s", err.code.name, err)
        return pb.CloudFrame(error=pb.Error(code=err.code.value[0], message=str(err),
                                            context_length=session.length if session else 0))

    async def GetInfo(self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext) -> pb.ServiceInfo:
        _, backend = await self._admit(context)
        return backend.info()

    async def Session(self, request_iterator: AsyncIterator[pb.EdgeFrame],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.CloudFrame]:
        owner, backend = await self._admit(context)
        session: Session | None = None
        self.open_streams += 1
        try:
            async for frame in request_iterator:
                kind = frame.WhichOneof("frame")
                try:
                    if kind == "open":
                        if self.draining:
                            raise CloudError(grpc.StatusCode.UNAVAILABLE, "this cloud is shutting down; open the session elsewhere")
                        # shield: a client that cancels mid-prefill must not leave a half-built session
                        session, resumed = await asyncio.shield(backend.open(owner, frame.open))
                        yield pb.CloudFrame(opened=pb.SessionOpened(
                            session_id=session.session_id, context_length=session.length,
                            limits=backend.limits.to_proto(), resumed=resumed))
                    elif kind == "verify":
                        if session is None:
                            raise CloudError(grpc.StatusCode.FAILED_PRECONDITION, "verify before open: send an open frame first")
                        session = backend.store.get(session.session_id, owner)
                        # shield: the cache and the token list must move together even if the edge goes away
                        verdict = await asyncio.shield(backend.verify(session, frame.verify))
                        yield pb.CloudFrame(verdict=verdict)
                    elif kind == "close":
                        if session is not None:
                            backend.store.close(session.session_id)
                            backend.update_gauges()
                        return
                    else:
                        raise CloudError(grpc.StatusCode.INVALID_ARGUMENT, "empty frame: set one of open, verify or close")
                except CloudError as err:
                    yield self._error_frame(err, session if session and backend.store.contains(session.session_id) else None)
                except Exception as err:  # a bug of ours: say so on this frame, keep the stream and the server up
                    log.exception("internal error on a %s frame", kind)
                    yield self._error_frame(CloudError(grpc.StatusCode.INTERNAL, f"internal error: {err}"), None)
        finally:
            self.open_streams -= 1

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        _, backend = await self._admit(context)
        self.open_streams += 1
        try:
            async for chunk in backend.generate(request):
                yield chunk
        except CloudError as err:
            self.metrics.errors.labels(err.code.name).inc()
            await context.abort(err.code, str(err))
        finally:
            self.open_streams -= 1
