"""The wire codec: every message the edge and the cloud exchange (proto/sprinter/v1/decoding.proto) is built
here, and what either side reads is decoded here, so no other module spells a proto field.

Glossary (who sends what)
    GetInfo        edge -> cloud: `GetInfoRequest` (`info_request`). cloud -> edge: `ServiceInfo`
                   (`service_info`): the model, the vocabulary's fingerprint and size, EOS ids, `Limits`.
    Limits         what the cloud accepts (`limits_message`): tokens per verify block and per session,
                   bytes per frame, entries per sparse distribution, Generate calls per edge. The edge
                   reads them as `CloudLimits` (0 on the wire means "not said": None there).
    Session        one bidirectional stream per generation.
      edge -> cloud, `EdgeFrame`:
        open       a session on a prompt, with sampling settings and the vocabulary fingerprint
                   (`open_frame`), or a resume of one this edge left behind (`resume_frame`).
        verify     a `VerifyBlock` (`verify_block`, framed by `verify_frame`): the draft tokens after a
                   session of `start_position` tokens, their draft probabilities and, when sampling, the
                   sparse distributions they were drawn from; `method` names the verify rule.
        candidate  a verify block with `after` (an `AfterVerdict`, `after_verdict`): drafted ahead for one
                   verdict on the block in flight, verified only if the cloud gave exactly that verdict.
                   Sent again the ordinary way, `after` dropped: `ordinary_verify_frame`.
        close      the end of the session (`close_frame`).
        residual_answer  the draft's probabilities of a residual query's candidates, or its whole distribution
                   at the queried position (`residual_answer_frame`).
      cloud -> edge, `CloudFrame`, one per open and per verify (none for a dropped candidate):
        opened     the session id and length, the limits, whether it was resumed, and the target's token
                   after the prompt when the open asked for it (`opened_frame`).
        verdict    the first n_accepted draft tokens are kept and next_token follows; named by its
                   block's start_position (`verdict`, framed by `verdict_frame`).
        residual_query  mid-verify of a block sent with `dists_on_rejection` (mode sd under sampling): the
                   token at a position was rejected; the cloud asks for the draft's probabilities of its
                   candidates, or the whole distribution there (`residual_query`, framed by `cloud_frame`); the verdict follows.
        error      a refused frame: gRPC status, message, the cloud's session length, a retry hint
                   (`error_frame`); the stream and the session stay usable.
        queued     the open or verify waits in the cloud's line (`queued`, read by `place_of`); the answer
                   follows. Only to an edge whose open's `Admission` (common/admission.py) says it waits in line.
    Generate       modes target and cloud-sd. edge -> cloud: `GenerateRequest` (`generate_request`). cloud ->
                   edge: `GenerateChunk`s (`generate_chunk`), the last one finished, with its reason.

Encoders take the project's types (method names such as "block", `SamplingParams`, `SparseDistribution`,
`grpc.StatusCode`); decoders return them. Whether what an edge sent is acceptable is the cloud's
admission policy, not encoding: cloud/frames.py checks it, reading fields through the decoders here.

The codec is this package: the limits and service info live in common/wire/limits.py, re-exported here.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Sequence

import grpc
import torch

from common.admission import Admission, QueuePlace
from common.spec.modes import VERIFY_METHODS
from common.sampling.distributions import FLOAT32_TINY, SamplingParams, SparseDistribution
from common.sampling.logprobs import TokenLogprob
from common.sampling.params import GrammarSpec
from common.wire.limits import (CloudLimits, cloud_costs, info_request, limits_message,  # noqa: F401 (the codec's)
                                service_info)
from sprinter.v1 import decoding_pb2 as pb

# -- verify methods -----------------------------------------------------------------------------------------


def method_value(method: str) -> int:
    """The .proto `Method` of a verify method of common/spec/modes.py ('block' -> METHOD_BLOCK)."""
    return pb.Method.Value(f"METHOD_{method.upper()}")


METHOD_NAMES = {method_value(method): method for method in VERIFY_METHODS}  # METHOD_BLOCK -> "block"


def method_name(value: int) -> str | None:
    """The verify method a .proto `Method` names; None when unset or unknown."""
    return METHOD_NAMES.get(value)


# -- sampling settings and sparse distributions -----------------------------------------------------------------


def sampling_to_proto(sampling: SamplingParams) -> pb.SamplingSettings:
    # The wire's floats are 32-bit: a top_p below their range would arrive as 0 (refused); it means "the argmax alone",
    # which the smallest float32 means too.
    settings = pb.SamplingSettings(temperature=sampling.temperature, top_k=sampling.top_k,
                                   top_p=max(sampling.top_p, FLOAT32_TINY), seed=sampling.seed,
                                   logit_bias=dict(sampling.logit_bias), presence_penalty=sampling.presence_penalty,
                                   frequency_penalty=sampling.frequency_penalty)
    if sampling.repetition_penalty != 1.0:
        settings.repetition_penalty = sampling.repetition_penalty
    if sampling.grammar is not None:
        settings.grammar.CopyFrom(pb.Grammar(kind=sampling.grammar.kind, source=sampling.grammar.source))
    if sampling.logprobs is not None:
        settings.logprobs = sampling.logprobs
    if sampling.prompt_logprobs is not None:
        settings.prompt_logprobs = sampling.prompt_logprobs
    return settings


def top_p_of(settings: pb.SamplingSettings) -> float:
    """top_p as sent; unset means 1.0 (off)."""
    return settings.top_p if settings.HasField("top_p") else 1.0


def sampling_from_proto(settings: pb.SamplingSettings) -> SamplingParams:
    """The settings as `SamplingParams` (ValueError for values it refuses: check them first to say more)."""
    repetition = settings.repetition_penalty if settings.HasField("repetition_penalty") else 1.0
    grammar = GrammarSpec(settings.grammar.kind, settings.grammar.source) if settings.HasField("grammar") else None
    return SamplingParams(temperature=settings.temperature, top_k=settings.top_k, top_p=top_p_of(settings),
                          seed=settings.seed, presence_penalty=settings.presence_penalty,
                          frequency_penalty=settings.frequency_penalty, repetition_penalty=repetition,
                          logit_bias=tuple(sorted(settings.logit_bias.items())), grammar=grammar,
                          logprobs=settings.logprobs if settings.HasField("logprobs") else None,
                          prompt_logprobs=settings.prompt_logprobs if settings.HasField("prompt_logprobs") else None)


def sparse_to_proto(dist: SparseDistribution) -> pb.SparseDistribution:
    return pb.SparseDistribution(token_ids=dist.token_ids.tolist(), probs=dist.probs.tolist())


def sparse_from_proto(dist: pb.SparseDistribution) -> SparseDistribution:
    return SparseDistribution(torch.tensor(list(dist.token_ids)), torch.tensor(list(dist.probs)))


# -- edge frames ------------------------------------------------------------------------------------------------


def open_frame(prompt_ids: Sequence[int], sampling: SamplingParams | None = None, vocab_fingerprint: str = "",
               first_token: bool = False, output_start: int | None = None,
               admission: Admission | None = None) -> pb.EdgeFrame:
    """Open a session on `prompt_ids`; without `sampling` the field stays unset, which the cloud reads as greedy.
    `output_start`: where the generated tokens begin in `prompt_ids` (a reopen's context); None: after them all."""
    settings = None if sampling is None else sampling_to_proto(sampling)
    start = None if output_start is None or output_start == len(prompt_ids) else output_start
    return pb.EdgeFrame(open=pb.OpenSession(prompt_ids=prompt_ids, sampling=settings, output_start=start,
                                            vocab_fingerprint=vocab_fingerprint, first_token=first_token,
                                            admission=admission_to_proto(admission)))


# -- the cloud's line (cloud/admission_queue.py) ------------------------------------------------------------------


def admission_to_proto(admission: Admission | None) -> pb.Admission | None:
    return None if admission is None else pb.Admission(**asdict(admission))  # the same fields


def admission_of(request: pb.OpenSession | pb.GenerateRequest) -> Admission:
    """An open's or a Generate's admission; an older edge sets none: priority 0, refused with a hint when busy."""
    a = request.admission
    return Admission(a.priority, a.waits_in_line, a.ticket_id, a.evicted_session_id)


def queued(place: QueuePlace, generate: bool = False) -> pb.CloudFrame | pb.GenerateChunk:
    """Still in line: a Session stream's frame (its answer follows), or a Generate's chunk (its tokens follow)."""
    ticket = pb.QueueTicket(ticket_id=place.ticket_id, position=place.position,
                            estimated_wait_ms=place.estimated_wait_ms, queue_length=place.queue_length)
    return pb.GenerateChunk(queued=ticket) if generate else pb.CloudFrame(queued=ticket)


def place_of(message: pb.CloudFrame | pb.GenerateChunk) -> QueuePlace | None:
    """The queue ticket a frame or chunk carries; None for every other answer."""
    ticket = message.queued
    return QueuePlace(ticket.ticket_id, ticket.position, ticket.estimated_wait_ms,
                      ticket.queue_length) if message.HasField("queued") else None


def set_queued_ms(answer: pb.SessionOpened | pb.Verdict | pb.GenerateChunk, queued_ms: float) -> None:
    answer.queued_ms = queued_ms  # the time in line the answered request spent (0 from a cloud without a line)


def queued_ms_of(answer: pb.SessionOpened | pb.Verdict | pb.GenerateChunk) -> float:  # 0: no time in line
    return answer.queued_ms


def output_start_of(request: pb.OpenSession | pb.GenerateRequest) -> int:
    """Where the generated tokens begin in an open's (or a Generate's) prompt_ids (unset: after them all)."""
    return request.output_start if request.HasField("output_start") else len(request.prompt_ids)


def resume_frame(session_id: str, vocab_fingerprint: str = "") -> pb.EdgeFrame:
    """Reattach to session `session_id`, which this edge owns (on a stream that holds one, it closes that one)."""
    return pb.EdgeFrame(open=pb.OpenSession(resume_session_id=session_id, vocab_fingerprint=vocab_fingerprint))


def after_verdict(start_position: int, n_accepted: int, next_token: int) -> pb.AfterVerdict:
    """The verdict a candidate is drafted for, named by the block it judges (that block's start_position)."""
    return pb.AfterVerdict(start_position=start_position, n_accepted=n_accepted, next_token=next_token)


def verify_block(start_position: int, draft_tokens: Sequence[int], method: str,
                 draft_token_probs: Sequence[float] | None = None,
                 draft_dists: Sequence[SparseDistribution] | None = None,
                 after: pb.AfterVerdict | None = None, dists_on_rejection: bool = False,
                 parents: Sequence[int] | None = None) -> pb.VerifyBlock:
    """A verify block checked by verify `method` ("block"); with `after`, a candidate for that verdict; with
    `dists_on_rejection`, no distributions: the cloud asks for what it needs at a rejection (residual_query);
    with `parents`, a tree of draft tokens (proto VerifyBlock.parents)."""
    return pb.VerifyBlock(start_position=start_position, draft_tokens=draft_tokens, method=method_value(method),
                          draft_token_probs=draft_token_probs or [], after=after, dists_on_rejection=dists_on_rejection,
                          draft_dists=[sparse_to_proto(d) for d in draft_dists or []], parents=parents or [])


def tree_parents(block: pb.VerifyBlock) -> list[int] | None:
    """A tree block's parents (-1: a child of the session's last token); None for a chain."""
    return list(block.parents) or None


def verify_frame(block: pb.VerifyBlock) -> pb.EdgeFrame:
    """The frame that sends `block` as it is (a candidate stays one)."""
    return pb.EdgeFrame(verify=block)


def ordinary_verify_frame(block: pb.VerifyBlock) -> pb.EdgeFrame:
    """The frame that sends `block` as an ordinary verify: a candidate's `after` is dropped."""
    return pb.EdgeFrame(verify=pb.VerifyBlock(start_position=block.start_position, draft_tokens=block.draft_tokens,
                                              draft_token_probs=block.draft_token_probs, draft_dists=block.draft_dists,
                                              method=block.method, dists_on_rejection=block.dists_on_rejection,
                                              parents=block.parents))


def residual_answer_frame(query: pb.ResidualQuery, draft_probs: Sequence[float] = (),
                          draft_dist: SparseDistribution | None = None) -> pb.EdgeFrame:
    """The answer to `query`: the draft's probabilities of its candidates, or (asked for) its whole distribution."""
    return pb.EdgeFrame(residual_answer=pb.ResidualAnswer(
        start_position=query.start_position, position=query.position, draft_probs=draft_probs,
        draft_dist=sparse_to_proto(draft_dist) if draft_dist is not None else None))


def close_frame() -> pb.EdgeFrame:
    return pb.EdgeFrame(close=pb.CloseSession())


def candidate_after(block: pb.VerifyBlock) -> tuple[int, int, int] | None:
    """(start_position, n_accepted, next_token) of the verdict a candidate is for; None for an ordinary block."""
    after = block.after
    return (after.start_position, after.n_accepted, after.next_token) if block.HasField("after") else None


# -- cloud frames -----------------------------------------------------------------------------------------------


def logprobs_to_proto(logprobs: Sequence[TokenLogprob]) -> list[pb.TokenLogprobs]:
    return [pb.TokenLogprobs(logprob=lp.logprob, top_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top])
            for lp in logprobs]


def logprobs_from_proto(entries: Sequence[pb.TokenLogprobs], tokens: Sequence[int]) -> list[TokenLogprob] | None:
    """The target's logprobs of `tokens` (the frame's kept tokens, in order); None when the frame carries none."""
    if not entries:
        return None
    if len(entries) != len(tokens):
        raise ValueError(f"{len(entries)} logprob entries for {len(tokens)} tokens")
    return [TokenLogprob(token, entry.logprob, tuple(zip(entry.top_ids, entry.top_logprobs)))
            for token, entry in zip(tokens, entries)]


def opened_frame(session_id: str, context_length: int, limits: pb.Limits, resumed: bool,
                 first_token: int | None = None, first_token_logprob: TokenLogprob | None = None,
                 prompt_logprobs: Sequence[TokenLogprob] = (), cached_tokens: int = 0,
                 queued_ms: float = 0.0) -> pb.CloudFrame:
    """`cached_tokens`: prompt tokens whose KV came from the cloud's prefix cache; `queued_ms`: the open's time in line."""
    logprobs = logprobs_to_proto([first_token_logprob])[0] if first_token_logprob is not None else None
    return pb.CloudFrame(opened=pb.SessionOpened(
        session_id=session_id, context_length=context_length, limits=limits, resumed=resumed, first_token=first_token,
        first_token_logprobs=logprobs, prompt_logprobs=logprobs_to_proto(prompt_logprobs), cached_tokens=cached_tokens,
        queued_ms=queued_ms))


def opened_cached_tokens(opened: pb.SessionOpened) -> int:
    """Prompt tokens the cloud served from its prefix cache (0 from a cloud that keeps none)."""
    return opened.cached_tokens


def chunk_cached_tokens(chunk: pb.GenerateChunk) -> int:
    """A Generate's prompt tokens served from the cloud's prefix cache (its first chunk says; 0 on the others)."""
    return chunk.cached_tokens


def opened_limits(opened: pb.SessionOpened) -> CloudLimits | None:
    """The limits an opened frame carries; None when it carries none."""
    return CloudLimits.from_proto(opened.limits) if opened.HasField("limits") else None


def opened_first_token(opened: pb.SessionOpened) -> int | None:
    """The target's token after the prompt, when the open asked for it (never on a resume)."""
    return opened.first_token if opened.HasField("first_token") else None


def opened_first_logprob(opened: pb.SessionOpened) -> TokenLogprob | None:
    """The first token's logprob, when the open brought one and the sampling asked for logprobs."""
    brought = opened.HasField("first_token") and opened.HasField("first_token_logprobs")
    return logprobs_from_proto([opened.first_token_logprobs], [opened.first_token])[0] if brought else None


def verdict(*, n_accepted: int, next_token: int, context_length: int, verify_ms: float, queue_ms: float,
            cloud_batch_size: int, start_position: int, candidate: bool,
            logprobs: Sequence[TokenLogprob] = (), path: Sequence[int] | None = None) -> pb.Verdict:
    """`path`: a tree block's kept draft tokens as indices into it (proto Verdict.path); None for a chain."""
    return pb.Verdict(n_accepted=n_accepted, next_token=next_token, context_length=context_length,
                      verify_ms=verify_ms, queue_ms=queue_ms, cloud_batch_size=cloud_batch_size,
                      start_position=start_position, candidate=candidate, logprobs=logprobs_to_proto(logprobs),
                      path=path or [])


def verdict_path(judged: pb.Verdict, block: pb.VerifyBlock) -> list[int] | None:
    """The kept path of a verdict on `block`, as indices into its draft tokens; None when the block was a chain."""
    return list(judged.path) if block.parents else None


def verdict_frame(judged: pb.Verdict) -> pb.CloudFrame:
    return pb.CloudFrame(verdict=judged)


def residual_query(start_position: int, position: int, candidate_ids: Sequence[int] = (),
                   full_distribution: bool = False) -> pb.ResidualQuery:
    return pb.ResidualQuery(start_position=start_position, position=position, candidate_ids=candidate_ids,
                            full_distribution=full_distribution)


def cloud_frame(answer: pb.Verdict | pb.ResidualQuery) -> pb.CloudFrame:
    """A verify's answer framed: its verdict, or the residual query it needs answered first."""
    if isinstance(answer, pb.ResidualQuery):
        return pb.CloudFrame(residual_query=answer)
    return verdict_frame(answer)


def error_frame(code: grpc.StatusCode, message: str, retry_after_ms: int = 0, context_length: int = 0) -> pb.CloudFrame:
    """A refused frame; `context_length` is the cloud's session length (0: no session), for the edge to resync."""
    return pb.CloudFrame(error=pb.Error(code=code.value[0], message=message, retry_after_ms=retry_after_ms,
                                        context_length=context_length))


STATUS_BY_NUMBER = {status.value[0]: status for status in grpc.StatusCode}
RETRY_AFTER_METADATA = "retry-after-ms"  # trailing metadata of a call that ends RESOURCE_EXHAUSTED / UNAVAILABLE


def retry_hint_metadata(retry_after_ms: int) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that tells a caller when a retry may succeed (none: no retry will)."""
    return ((RETRY_AFTER_METADATA, str(retry_after_ms)),) if retry_after_ms > 0 else ()


def retry_hint_s(metadata: grpc.aio.Metadata | tuple | None) -> float:
    """The retry hint in a call's trailing metadata, in seconds; 0 without one."""
    hint = next((value for key, value in metadata or () if key == RETRY_AFTER_METADATA), "0")
    return int(hint) / 1e3 if str(hint).isdigit() else 0.0


def status_of(code: grpc.StatusCode | int) -> grpc.StatusCode:
    """A status from its number (an Error frame's code); UNKNOWN for a number gRPC does not define."""
    return STATUS_BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN) if isinstance(code, int) else code


def error_status(error: pb.Error) -> grpc.StatusCode:
    """The gRPC status an error frame carries (UNKNOWN for a number gRPC does not define)."""
    return status_of(error.code)


# -- Generate (mode target) ------------------------------------------------------------------------------------


def generate_request(prompt_ids: Sequence[int], sampling: SamplingParams, max_new_tokens: int,
                     vocab_fingerprint: str = "", output_start: int | None = None,
                     speculate_block: int | None = None, proposer: str | None = None,
                     admission: Admission | None = None) -> pb.GenerateRequest:
    """A Generate; with `speculate_block`, cloud-sd: the cloud drafts (`proposer`; None: its default) and verifies."""
    start = None if output_start is None or output_start == len(prompt_ids) else output_start
    speculation = pb.Speculation(block=speculate_block, proposer=proposer or "") if speculate_block is not None else None
    return pb.GenerateRequest(prompt_ids=prompt_ids, sampling=sampling_to_proto(sampling), output_start=start,
                              max_new_tokens=max_new_tokens, vocab_fingerprint=vocab_fingerprint,
                              speculation=speculation, admission=admission_to_proto(admission))


def speculation_proposer(speculation: pb.Speculation) -> str | None:  # None: it names none (the cloud's default)
    return speculation.proposer or None


def generate_chunk(token_ids: Sequence[int] = (), step_ms: float = 0.0, finish_reason: str | None = None,
                   logprobs: Sequence[TokenLogprob] = (), prompt_logprobs: Sequence[TokenLogprob] = (),
                   drafted: int = 0, draft_ms: float = 0.0, cached_tokens: int = 0, copied: int = 0,
                   copied_kept: int = 0) -> pb.GenerateChunk:
    """Tokens as they are made; with `finish_reason` ("stop": EOS, "length": a limit), the last. `drafted`, `draft_ms`:
    a cloud-sd round's proposed tokens and their drafting time (`copied`, `copied_kept`: those copied from text, and
    kept); `cached_tokens` (first chunk): prompt tokens whose KV came from the cloud's prefix cache."""
    return pb.GenerateChunk(token_ids=token_ids, step_ms=step_ms, finished=finish_reason is not None,
                            finish_reason=finish_reason or "", logprobs=logprobs_to_proto(logprobs),
                            prompt_logprobs=logprobs_to_proto(prompt_logprobs), drafted=drafted, draft_ms=draft_ms,
                            cached_tokens=cached_tokens, copied=copied, copied_kept=copied_kept)
