"""The token rule's residual sampled without the draft's full distributions (VerifyBlock.dists_on_rejection).

Under sampling the token rule (common/spec/acceptance_rules.py `token_verify`) reads the draft's distribution q_i
of a token only where it rejects: there it samples norm(max(p_t - q_j, 0)). So an edge in mode sd may
send p_draft(x_i) alone for each token (a few bytes instead of a sparse distribution of up to 4096
entries): the coins are tossed from those scalars (`token_acceptances`), and on a rejection at j the
cloud samples the residual by rejection sampling: it draws candidates y ~ p_t,j, asks the edge for
q_j(y) (a ResidualQuery of `candidates` ids), and keeps the first y with u < 1 - q_j(y) / p_t,j(y)
(`residual_by_rejection`), which is distributed exactly as the residual. After `max_queries` queries
without a keeper it asks for q_j whole and samples the residual from it: the rounds and that fallback
together still sample the residual exactly, and the fallback (tens of KB once) stays rare.

While a query is out the session stays busy, its forward's cache in place, and `PendingResidual` holds
what the verdict needs. An answer is checked before it is used: a malformed or inconsistent one is
refused INVALID_ARGUMENT naming the field, and the caller then abandons the verify (cloud/target_host.py
`abandon_residual`: the forward rolled back, as a verify that raised is), as it does when the edge sends
anything but the answer or goes away.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cloud.engine import ForwardResult
from cloud.errors import invalid
from cloud.frames import PROBABILITY_SUM_TOLERANCE, ServiceLimits, check_sparse_distribution
from common import wire
from common.sampling.distributions import sample
from common.spec.acceptance_rules import residual, residual_by_rejection, residual_candidates
from sprinter.v1 import decoding_pb2 as pb

# An answer's q of the rejected token itself must repeat the scalar the verify frame sent for it.
SCALAR_AGREEMENT = 1e-4


@dataclass(frozen=True)
class ResidualSettings:
    """How the cloud samples a residual from residual queries (`cloud serve --residual-candidates/-queries`)."""

    candidates: int = 16  # candidate ids per query: each is kept with probability TV(p_t, q) given the rejection
    max_queries: int = 2  # candidate queries before the whole distribution is asked for (0: at once)

    def __post_init__(self) -> None:
        if self.candidates < 1:
            raise ValueError(f"residual candidates must be >= 1, got {self.candidates}")
        if self.max_queries < 0:
            raise ValueError(f"residual queries must be >= 0 (0: ask for the whole distribution), got {self.max_queries}")


@dataclass
class PendingResidual:
    """A verify waiting on the edge's answers: the forward it ran and the rejected position's target row."""

    frame: pb.VerifyBlock
    result: ForwardResult
    new_tokens: int  # tokens the forward fed: the session's cache holds them until the verdict settles it
    position: int  # the rejected draft token's index in the block (n_accepted of the verdict)
    p_target: torch.Tensor  # [V] the target's distribution there, as the rule reads it
    compute_ms: float  # the cloud's own time on this verify so far (not the waits for answers)
    queries: int = 0
    query: pb.ResidualQuery | None = None

    def next_query(self, settings: ResidualSettings, generator: torch.Generator) -> pb.ResidualQuery:
        """The next question for the edge: fresh candidates, or once `max_queries` are spent, the whole q."""
        full = self.queries >= settings.max_queries
        candidates = [] if full else residual_candidates(self.p_target, settings.candidates, generator)
        self.queries += 1
        self.query = wire.residual_query(self.frame.start_position, self.position, candidates, full)
        return self.query

    def resolve(self, answer: pb.ResidualAnswer, limits: ServiceLimits, vocab_size: int,
                generator: torch.Generator) -> int | None:
        """The residual's token from a checked answer; None when no candidate was kept (ask again)."""
        check_residual_answer(answer, self.query, self.frame, limits, vocab_size)
        if self.query.full_distribution:
            q = wire.sparse_from_proto(answer.draft_dist).to_dense(vocab_size)
            return sample(residual(self.p_target, q), generator)
        return residual_by_rejection(list(self.query.candidate_ids), self.p_target, list(answer.draft_probs),
                                     generator)


def check_residual_answer(answer: pb.ResidualAnswer, query: pb.ResidualQuery, frame: pb.VerifyBlock,
                          limits: ServiceLimits, vocab_size: int) -> None:
    """Refuse (INVALID_ARGUMENT, naming the field) an answer that is not one to `query` or cannot be a draft's."""
    if (answer.start_position, answer.position) != (query.start_position, query.position):
        raise invalid(f"residual_answer.start_position/position are {answer.start_position}/{answer.position} but "
                      f"the query asked about {query.start_position}/{query.position}")
    token, scalar = frame.draft_tokens[query.position], frame.draft_token_probs[query.position]
    if query.full_distribution:
        if not answer.HasField("draft_dist"):
            raise invalid("residual_answer.draft_dist is missing: the query asked for the whole draft distribution")
        where = "residual_answer.draft_dist"
        check_sparse_distribution(answer.draft_dist, where, token, limits.max_sparse_support, vocab_size)
        said = dict(zip(answer.draft_dist.token_ids, answer.draft_dist.probs))
        _agrees(said[token], scalar, f"{where} (its draft token {token})")
        return
    probs, candidates = list(answer.draft_probs), list(query.candidate_ids)
    if len(probs) != len(candidates):
        raise invalid(f"residual_answer.draft_probs has {len(probs)} entries for {len(candidates)} candidates")
    if any(not math.isfinite(q) or not 0.0 <= q <= 1.0 + PROBABILITY_SUM_TOLERANCE for q in probs):
        raise invalid("residual_answer.draft_probs must lie in [0, 1]: they are the draft's probabilities")
    said: dict[int, float] = {}
    for y, q in zip(candidates, probs):
        if said.setdefault(y, q) != q:
            raise invalid(f"residual_answer.draft_probs gives candidate {y} two probabilities ({said[y]} and {q})")
    if sum(said.values()) > 1.0 + PROBABILITY_SUM_TOLERANCE:
        raise invalid(f"residual_answer.draft_probs of distinct candidates sum to {sum(said.values()):.6f} > 1")
    if token in said:
        _agrees(said[token], scalar, f"residual_answer.draft_probs (candidate {token}, the draft token)")


def _agrees(answered: float, scalar: float, where: str) -> None:
    if abs(answered - scalar) > SCALAR_AGREEMENT * max(1.0, scalar):
        raise invalid(f"{where}: probability {answered} but verify.draft_token_probs said {scalar}")
