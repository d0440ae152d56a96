"""The cloud as the speculative round's backend: a `BlockVerifier` over one generation's cloud session.

It turns a pending block into a verify frame (the mode's method, the draft's token probabilities,
and under sampling the sparse distributions the tokens were drawn from) and the cloud's answer into
a `Verdict`. When the cloud is out of reach it answers None, so the round keeps the block as
drafted and the generation is marked degraded; it tries the cloud again after `retry_s`.
"""

from __future__ import annotations

import logging
import time

from common.decoding.drafting import PendingBlock
from common.decoding.speculative_round import Verdict
from common.sampling import SamplingParams, SparseDistribution
from edge.cloud_client import CloudSession, CloudUnavailable
from sprinter.v1 import decoding_pb2 as pb

log = logging.getLogger(__name__)


def wire_method(method: str) -> int:
    """The .proto `Method` of a verify method of common/decoding/modes.py ('block' -> METHOD_BLOCK)."""
    return pb.Method.Value(f"METHOD_{method.upper()}")


class CloudVerifier:
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
