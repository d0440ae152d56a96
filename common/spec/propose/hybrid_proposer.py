"""Hybrid drafting (`--proposer hybrid`): each position from the source the target is likelier to keep, chained.

Suffix drafting (common/spec/propose/suffix_proposer.py) copies a run where the text matches and ends its
block there. Hybrid weighs the two sources token by token and chains them:

    a position   is copied where the match's next token scores a_i >= the draft's expected a_i, else the
                 draft model drafts it. The draft's expectation (`SuffixMemory.model_estimate`) is the mean
                 of the verifier's recent scores of the draft's own tokens; both scores are calibrated on the
                 target's verdicts (the verifier by `sprinter verifier train`, the copies' rates by the
                 calibration shipped beside it, `suffix_calibration.json`, then by this edge's verdicts),
                 so they are on one scale.
    a run        goes on while each copy still beats the draft and the chance that the target keeps all of
                 it stays above MIN_SURVIVAL. Where it stops, the call policy reads every a_i of the block,
                 copies' and the draft's alike, and says whether to send it or let the draft go on from the
                 run's end (its next forward feeds the run in one go: `ProposedToken.fed`).

The call policy sees one estimate per token, as it does with the draft alone. The choice of source reads
the context and what the edge learned before the round, never the round's own draws, so the lossless
rules stay exact (common/spec/propose/proposals.py says why).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from common.spec.call_policy import CallPolicy
from common.spec.propose.proposals import CACHE, PendingBlock, ProposedToken
from common.spec.propose.suffix_match import Continuation
from common.spec.propose.suffix_proposer import COPY_MIN, MIN_SURVIVAL, SuffixProposer


@dataclass(frozen=True)
class ChainedRuns:
    """`--proposer hybrid`'s rule for a suffix proposer (see the module docstring)."""

    def drafted(self, proposer: SuffixProposer, proposed: ProposedToken) -> ProposedToken:
        if proposed.accept_prob is not None:  # the verifier's score: what the next copy must beat
            proposer.memory.model_estimate.update(proposed.accept_prob)
        return proposed

    def take(self, proposer: SuffixProposer, run: tuple[str, Continuation], block: PendingBlock, limit: int,
             policy: CallPolicy | None) -> list[ProposedToken]:
        """The run's tokens that beat the draft (none: the draft drafts this position). The last ends the block
        where the cap, EOS or (sprinter) a flag says, else where the policy says at the run's end."""
        source, found = run
        bar = max(COPY_MIN, proposer.memory.model_estimate.value)
        accept_probs = block.accept_probs
        proposals: list[ProposedToken] = []
        room = limit - len(block)
        for i, (token, reach, accept_prob, survival) in enumerate(proposer.scored(source, found, room)):
            if accept_prob < bar or survival < MIN_SURVIVAL:
                break
            accept_probs.append(accept_prob)
            flagged = proposer.passes_unchecked and (source == CACHE or not proposer.may_pass or policy is None
                                                     or policy.should_send([accept_prob], cap=limit))
            ends = flagged or len(block) + i + 1 >= limit or token in proposer.model.eos_token_ids
            proposals.append(ProposedToken(token, source, None, flagged, ends, accept_prob, match_length=reach))
            if ends:
                return proposals
        if proposals:  # the run stopped short of the cap: send now, or chain the draft's tokens after it
            ends = policy is None or policy.should_send(accept_probs, cap=limit)
            proposals[-1] = replace(proposals[-1], ends_block=ends)
        return proposals
