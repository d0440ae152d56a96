"""The speculative round's cloud backend: a pending block becomes a verify frame, the cloud's answer a `Verdict`.

One `CloudTarget` per generation, over that generation's cloud session. When the cloud is out of
reach (CloudUnavailable after the session's retries) it answers None, so the round keeps the block
as drafted; the generation is then degraded (`CloudUse`), and the cloud is tried again after
`retry_s`. Once the request's own deadline has passed (DeadlinePassed) it is not tried again. A
refusal (CloudRefused) is not caught here: it ends the generation (edge/decoding/decoder.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Callable

from common import wire
from common.spec.tree.branching import TreeBlock
from common.spec.propose.proposals import PendingBlock
from common.spec.modes import reads_last_draft_only
from common.spec.speculative_round import Verdict
from common.sampling.logprobs import TokenLogprob
from common.sampling.distributions import SamplingParams, SparseDistribution
from common.tracing import NO_SPAN, tracer
from edge.cloud_link.client import CloudLinkError, CloudUnavailable, DeadlinePassed
from edge.cloud_link.session import CloudSession
from sprinter.v1 import decoding_pb2 as pb

log = logging.getLogger(__name__)


@dataclass
class CloudUse:
    """How one generation fared with the cloud: degraded (some tokens never verified) and why, reopens, a refusal.

    Why (`degraded_reason`, the first one): `cloud_unreachable` (no replica answered within the
    attempts), `deadline` (the request's own deadline passed while it waited for the cloud), `loading`
    (it passed while the cloud was still loading its model), or `no_cloud` (this daemon has none). A
    busy or loading cloud is never a reason by itself: it is waited for.
    """

    on_degraded: Callable[[str], None] | None = None  # told once, with the reason, before the first unverified token
    degraded_reason: str | None = None
    reopens: int = 0
    error: CloudLinkError | None = None  # the refusal that ended the generation early
    prompt_logprobs: list[TokenLogprob] | None = None  # the target's, of prompt tokens 2..n, when asked (echo)
    finish_reason: str | None = None  # the cloud's own, in mode target ("stop" | "length")
    queued_ms: float = 0.0  # time in the cloud's admission queue (opens, verifies waiting for KV, Generates)

    @property
    def degraded(self) -> bool:
        return self.degraded_reason is not None

    def mark_degraded(self, reason: str) -> None:
        if self.degraded_reason is None:
            self.degraded_reason = reason
            if self.on_degraded is not None:
                self.on_degraded(reason)


def draft_sampling(sampling: SamplingParams, support: int) -> SamplingParams:
    """The draft's sampling for a cloud that reads at most `support` entries of a distribution: on the wire a sampled
    draft distribution travels sparse, and sampling from the capped support keeps it exact."""
    if sampling.greedy:
        return sampling
    return replace(sampling, top_k=min(sampling.top_k or support, support))


class CloudTarget:
    """The speculative round's backend over one generation's cloud session; None when out of reach."""

    def __init__(self, session: CloudSession, method: str, sampling: SamplingParams, max_sparse_support: int,
                 retry_s: float, use: CloudUse, dists_on_rejection: bool = False) -> None:
        self.session = session
        self.method = method
        self.sampling = sampling
        self.max_sparse_support = max_sparse_support
        # Under sampling: send p_draft(x_i) alone and answer the cloud's residual queries at a rejection
        # (cloud/residual.py) instead of every distribution (EdgeSettings.draft_dists "on-rejection").
        self.dists_on_rejection = dists_on_rejection and not sampling.greedy
        self.retry_s = retry_s
        self.use = use
        self.down_since: float | None = None
        self.deadline_passed = False
        self.degraded_span = NO_SPAN  # a trace's span over a stretch served from the draft alone, while it lasts

    def reachable(self) -> bool:
        if self.deadline_passed:
            return False
        return self.down_since is None or time.monotonic() - self.down_since >= self.retry_s

    @property
    def max_tree_tokens(self) -> int:
        """Draft tokens the cloud verifies in one tree frame (its open's limits; 0: chains only, so no branching)."""
        return self.session.replicas.limits.max_tree_tokens or 0

    def frame(self, start_position: int, block: PendingBlock, after: pb.AfterVerdict | None = None,
              tree: TreeBlock | None = None) -> pb.VerifyBlock:
        """The verify frame of `block` drafted after a context of `start_position` tokens (a candidate with `after`);
        with `tree`, its nodes and parents, one draft distribution per node under sampling."""
        if tree is not None:
            nodes = tree.nodes
            # Under greedy an alternative is the draft's next-best token, not a draw: it has no q(x) to send (the
            # tree's greedy verdict reads the target's argmax alone).
            probs = [] if self.sampling.greedy else [d.probability for d in nodes.drafted]
            return wire.verify_block(start_position, nodes.tokens, self.method, probs, self._draft_dists(nodes),
                                     parents=tree.parents)
        probs = [d.probability for d in block.drafted]
        if self.dists_on_rejection:
            return wire.verify_block(start_position, block.tokens, self.method, probs, None, after,
                                     dists_on_rejection=True)
        return wire.verify_block(start_position, block.tokens, self.method, probs, self._draft_dists(block), after)

    def _residual_answer(self, block: PendingBlock, query: pb.ResidualQuery) -> pb.EdgeFrame:
        """The draft's probabilities of the cloud's candidates at the rejected position, or that whole distribution
        (exact: the draft sampled from at most max_sparse_support tokens); a position outside the block is
        answered with nothing, which the cloud refuses by name."""
        if query.position >= len(block):
            return wire.residual_answer_frame(query)
        proposed = block.drafted[query.position]
        if query.full_distribution:
            return wire.residual_answer_frame(query, draft_dist=proposed.sparse())
        if proposed.p_draft is None:  # a point mass: only its own token has mass
            return wire.residual_answer_frame(query, [float(c == proposed.token) for c in query.candidate_ids])
        return wire.residual_answer_frame(query, proposed.p_draft[list(query.candidate_ids)].tolist())

    @property
    def residual_queries(self) -> int:
        """Residual queries answered: round trips beyond one per verify."""
        return self.session.stream.residual_answers

    @property
    def epoch(self) -> int:
        """Blocks written on the session's stream so far (edge/cloud_link/session.py: a candidate names its block's)."""
        return self.session.stream.epoch

    @property
    def verdict_epoch(self) -> int:
        """The epoch of the block the last verdict answered."""
        return self.session.stream.verdict_epoch

    @property
    def uplink_bytes(self) -> int:
        return self.session.stream.uplink_bytes

    @property
    def downlink_bytes(self) -> int:
        return self.session.stream.downlink_bytes

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the cloud served from its prefix cache when the session first opened."""
        return self.session.cached_tokens

    @property
    def prompt_logprobs(self) -> list[TokenLogprob] | None:
        """The target's logprobs of prompt tokens 2..n from the session's first open, when the sampling asked."""
        return self.session.prompt_logprobs

    def open_ahead(self, context: list[int], first_token: bool) -> None:
        """Open the session on `context` now (the cloud prefills while the edge drafts); `first_token`: the open
        also brings the target's token after the context."""
        self.session.open_ahead(context, first_token=first_token)

    async def opened_first_token(self) -> tuple[int, TokenLogprob | None] | None:
        """The target's token after the opened context (and its logprob, when asked), once the open brings it;
        None if it brought none."""
        return await self.session.opened_first_token()

    async def send_candidate(self, block: PendingBlock, start_position: int, n_accepted: int, next_token: int,
                             epoch: int) -> bool:
        """Send `block` as the candidate for the verdict (n_accepted, next_token) on the block written at `epoch`
        after a context of `start_position` tokens; False if it could not go."""
        after = wire.after_verdict(start_position, n_accepted, next_token)
        frame = self.frame(start_position + n_accepted + 1, block, after)
        return await self.session.send_candidate(frame, epoch)

    async def verify(self, context: list[int], block: PendingBlock, tree: TreeBlock | None = None,
                     matched_candidate: bool = False, waited_since: float | None = None) -> Verdict | None:
        """The verdict on `block` (or `tree`, its chain with branches, in one frame) after `context`; with
        `matched_candidate`, `block` went out as the candidate the cloud matched, and the round trip learned is the
        wait since `waited_since` (when the edge needed it)."""
        # A call that opens (or reopens) the session also pays the open frame and the prompt's prefill:
        # not what one more round trip costs, so it reports no round trip for the cost model to learn.
        steady = self.session.session_id is not None and not self.session.opening
        reopens, started = self.session.reopens, waited_since or time.perf_counter()
        try:
            answer = (lambda query: self._residual_answer(block, query)) \
                if self.dists_on_rejection and tree is None else None
            frame = self.frame(len(context), block, tree=tree)
            with tracer.span("edge.verify", tokens=len(frame.draft_tokens), candidate=matched_candidate) as span:
                verdict = await self.session.verify_block(context, frame, matched_candidate, answer)
                span.set(n_accepted=verdict.n_accepted, verify_ms=verdict.verify_ms)
        except CloudUnavailable as err:
            if self.down_since is None:
                log.warning("%s; continuing from the draft alone (degraded): %s", err.reason, err)
                self.degraded_span = tracer.start("edge.degraded", reason=err.reason)
            self.use.mark_degraded(err.reason)
            self.down_since = time.monotonic()
            self.deadline_passed = isinstance(err, DeadlinePassed)
            return None
        finally:
            self.use.reopens = self.session.reopens
        if self.down_since is not None:
            log.info("cloud is back")
            self.down_since = None
            self.degraded_span.end()
            self.degraded_span = NO_SPAN
        round_trip_ms = (time.perf_counter() - started) * 1e3 if steady and self.session.reopens == reopens else None
        path = wire.verdict_path(verdict, frame)
        if path is not None and len(path) != verdict.n_accepted:
            raise ValueError(f"the cloud's verdict keeps {verdict.n_accepted} tokens but names a path of {len(path)}")
        kept = (tree.tokens_of(path) if path is not None else block.tokens[: verdict.n_accepted]) + [verdict.next_token]
        return Verdict(verdict.n_accepted, verdict.next_token, verdict.verify_ms, round_trip_ms,
                       logprobs=wire.logprobs_from_proto(verdict.logprobs, kept), path=path)

    def _draft_dists(self, block: PendingBlock) -> list[SparseDistribution] | None:
        """Under sampling, the distributions the tokens were drawn from (sprinter's rule reads only the last)."""
        if self.sampling.greedy:
            return None
        rows = block.drafted[-1:] if reads_last_draft_only(self.method) else block.drafted
        return [d.sparse(self.max_sparse_support) for d in rows]

    async def close(self) -> None:
        self.degraded_span.end()  # degraded to the end of the generation
        self.degraded_span = NO_SPAN
        await self.session.close()
