"""Suffix drafting (`--proposer suffix`): propose from the text itself where it matches, the draft model elsewhere.

Before each position the proposer looks the context's suffix up (common/spec/propose/suffix_match.py)
in the request's own prompt and output so far, and in the edge's cache of earlier outputs. With a
match it proposes what followed there, a run of point masses, as long as the match warrants; without
one the draft model drafts the position. Either way the choice is made from the context alone, so
the lossless rules stay exact (common/spec/propose/proposals.py says why).

Blocks
    A run ends its block: the model's tokens before it went by the call policy as ever, and a run's
    length follows the match: it goes on, within the block's cap, while the product of its scores (which
    grow with the length of the match each token follows) stays above MIN_SURVIVAL. Blocks
    with runs are therefore longer than k: up to the mode's max_run_length and the cloud's max_block.
    The draft's KV follows kept run tokens at its next forward, which feeds what it lacks in one go
    (`ProposedToken.fed` counts it); a run costs no draft step.
    A block that stands unverified (no target reached) keeps only the draft's own tokens, so `to_verify`
    False drafts from the model alone.

Scores (a_i, what the call policy and the cost model read)
    a_i = rate(source, m + i - 1) x (the share of matched occurrences that continue with x_i, among
    those that continued as far as x_{i-1}), for a run after a match of m tokens: x_i follows m + i - 1
    agreeing tokens if the ones before it are kept, which is what a_i is conditioned on. `rate` is
    calibrated on data: P(the target keeps x_i | it kept x_1..x_{i-1}) per source and match-length
    bucket, from the verdicts on this edge's earlier copies, starting from a prior measured on the Qwen
    pair (PRIOR_RATES, worth PRIOR_WEIGHT verdicts); a request's own record scales it (a request whose
    copies keep failing, a math problem quoting its numbers, soon copies no more). A run is proposed
    only where a_1 >= COPY_MIN and the target is expected to keep as many of its tokens as of a block
    of the draft's own (`model_kept`, learned from verdicts); else the draft drafts that position.
    These choices read the context and what the edge learned before the round, never the round's own
    draws: the rules stay exact.

Mode sprinter (its passed tokens reach the client unchecked)
    A token copied from another request's output is always flagged: its block ends there and the
    target checks it. A token copied from this request's own text passes only when its a_i clears the
    verifier's threshold, and never when the request asks for logprobs (a copied token has no draft
    logprob) or shapes its logits (a grammar, penalties: a copy knows nothing of them).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import AsyncIterator, Iterator, Protocol

import torch

from common.spec.call_policy import CallPolicy
from common.spec.cost_model import CostModel
from common.spec.cost_model import Ewma
from common.spec.propose.drafting import ModelProposer
from common.spec.propose.proposals import CACHE, CONTEXT, PendingBlock, ProposedToken
from common.spec.propose.suffix_match import Continuation, OutputCache, TokenIndex, continuation

# A run stops where the chance that the target keeps all of it (the product of its a_i) falls below this: every
# token sent costs the target's forward (on a CPU, in proportion), so a run is as long as its scores warrant.
MIN_SURVIVAL = 0.15
COPY_MIN = 0.5  # copy only where the first copied token's a_i is at least this; else the draft model drafts there
MATCH_BUCKETS = (3, 4, 6, 8, 12, 16, 24, 32)  # match lengths calibrated apart
# The rate before verdicts, per match bucket: what the target kept of copies from the request's own text on the Qwen
# pair (qwen2.5-coder 1.5B <- 0.5B, greedy, prompts 2-3 of each category of sim/data/proposer_prompts.jsonl, 548
# copies reached), rounded down; copies from other requests' outputs (too few there to measure) start lower.
PRIOR_RATES = {CONTEXT: dict(zip(MATCH_BUCKETS, (0.75, 0.75, 0.85, 0.85, 0.9, 0.9, 0.9, 0.9))),
               CACHE: dict.fromkeys(MATCH_BUCKETS, 0.6)}
# Under sampling a copy x is kept with probability p_target(x) (a point mass against the target's distribution), not
# always when it is the argmax: its rates are learned apart. They start at greedy's, optimistic on purpose: a copy the
# edge never proposes is never calibrated, so a low start would stay unproven (the pair's shipped calibration, or
# this edge's verdicts, bring them down).
SAMPLED_PRIOR_RATES = PRIOR_RATES
Priors = dict[str, dict[int, float]]  # source -> match bucket -> P(kept | reached)
PRIOR_WEIGHT = 8.0  # verdicts the prior counts as
MODEL_KEPT_PRIOR = 2.0  # draft tokens kept per model block, before this edge has seen a verdict
MODEL_ESTIMATE_PRIOR = 0.7  # a draft token's a_i before this edge has scored one (Qwen pair, greedy: ~0.7-0.8)
REQUEST_WEIGHT = 4.0  # how many copies' worth of evidence a request needs before its own record moves its rates
DEFAULT_CACHE_TOKENS = 1 << 16


def match_bucket(match_length: int) -> int:
    return next((b for b in reversed(MATCH_BUCKETS) if match_length >= b), MATCH_BUCKETS[0])


@dataclass
class SuffixCalibration:
    """P(the target keeps a copied token | it kept the run's tokens before it), per (source, match bucket)."""

    priors: Priors = field(default_factory=lambda: PRIOR_RATES)  # before verdicts (a shipped calibration, else ours)
    kept: dict[tuple[str, int], float] = field(default_factory=dict)
    reached: dict[tuple[str, int], float] = field(default_factory=dict)
    predicted: dict[tuple[str, int], float] = field(default_factory=dict)  # the sum of a_i the reached tokens carried

    def rate(self, source: str, match_length: int) -> float:
        key = (source, match_bucket(match_length))
        prior = self.priors[source][key[1]]
        return (self.kept.get(key, 0.0) + prior * PRIOR_WEIGHT) / (self.reached.get(key, 0.0) + PRIOR_WEIGHT)

    def observe(self, source: str, match_length: int, kept: bool, predicted: float | None = None) -> None:
        key = (source, match_bucket(match_length))
        self.reached[key] = self.reached.get(key, 0.0) + 1
        self.kept[key] = self.kept.get(key, 0.0) + kept
        self.predicted[key] = self.predicted.get(key, 0.0) + (predicted or 0.0)

    def report(self) -> list[dict[str, float | int | str]]:
        """Per (source, match bucket): copies the target reached, the share it kept, and the mean a_i they carried
        (calibrated: the two agree)."""
        return [{"source": source, "match_length": bucket, "reached": int(n), "kept": self.kept[(source, bucket)] / n,
                 "predicted": self.predicted.get((source, bucket), 0.0) / n}
                for (source, bucket), n in sorted(self.reached.items())]


@dataclass
class SuffixMemory:
    """What suffix drafting keeps across an edge's requests: the cache of earlier outputs (None: `--suffix-cache
    off`) and the calibration of its scores."""

    cache: OutputCache | None = field(default_factory=lambda: OutputCache(DEFAULT_CACHE_TOKENS))
    calibration: SuffixCalibration = field(default_factory=SuffixCalibration)  # greedy requests'
    sampled: SuffixCalibration = field(default_factory=lambda: SuffixCalibration(SAMPLED_PRIOR_RATES))  # T > 0
    # draft tokens the target keeps of a block the draft model proposed alone: what a run at a block's start must beat
    model_kept: Ewma = field(default_factory=lambda: Ewma(MODEL_KEPT_PRIOR, 0.1))
    # hybrid: the verifier's a_i of the draft's own tokens, what a copy must beat to be proposed in their place
    model_estimate: Ewma = field(default_factory=lambda: Ewma(MODEL_ESTIMATE_PRIOR, 0.05))
    match_us: list[float] = field(default_factory=list)  # recent lookups' cost, microseconds (bounded)

    def calibration_for(self, greedy: bool) -> SuffixCalibration:
        """Copies keep at different rates under greedy decoding and under sampling: each has its calibration."""
        return self.calibration if greedy else self.sampled

    def timed(self, started: float) -> None:
        if len(self.match_us) >= 4096:
            del self.match_us[:2048]
        self.match_us.append((time.perf_counter() - started) * 1e6)


def suffix_memory(cache: bool = True, cache_tokens: int = DEFAULT_CACHE_TOKENS,
                  priors: dict[str, Priors] | None = None) -> SuffixMemory:
    """An edge's suffix memory; `cache` False (`--suffix-cache off`): each request copies from its own text alone.
    `priors` ({"greedy": ..., "sampled": ...}, either optional): a calibration shipped for the pair
    (`load_priors`), in place of the built-in priors."""
    priors = priors or {}
    return SuffixMemory(cache=OutputCache(cache_tokens) if cache else None,
                        calibration=SuffixCalibration(priors.get("greedy", PRIOR_RATES)),
                        sampled=SuffixCalibration(priors.get("sampled", SAMPLED_PRIOR_RATES)))


def load_priors(path: Path) -> Priors:
    """A shipped calibration (`sprinter bench proposer --fit-calibration`): per source, P(kept | reached) per match
    bucket. Buckets it lacks keep the built-in prior; a file that names an unknown source or bucket is refused."""
    data = json.loads(path.read_text())["rates"]
    priors = {source: dict(rates) for source, rates in PRIOR_RATES.items()}
    for source, rates in data.items():
        for bucket, rate in rates.items():
            if source not in priors or int(bucket) not in MATCH_BUCKETS or not 0.0 <= rate <= 1.0:
                raise ValueError(f"{path}: no calibration for source {source!r}, bucket {bucket!r}, rate {rate!r}")
            priors[source][int(bucket)] = float(rate)
    return priors


class RunRule(Protocol):
    """How a suffix proposer takes a matched run (`--proposer`): `WholeRuns` here (a run worth it ends its block),
    common/spec/propose/hybrid_proposer.py's `ChainedRuns` (each copied token while it beats the draft, chained with the
    draft's). Both read the run as `SuffixProposer.scored` scores it."""

    def take(self, proposer: SuffixProposer, run: tuple[str, Continuation], block: PendingBlock, limit: int,
             policy: CallPolicy | None) -> list[ProposedToken]:
        """The run's tokens proposed at this position; none: the draft drafts it."""
        ...

    def drafted(self, proposer: SuffixProposer, proposed: ProposedToken) -> ProposedToken:
        """A token the draft drafted in a judged block (a rule may learn from its score)."""
        ...


@dataclass(frozen=True)
class WholeRuns:
    """`--proposer suffix`: a run is proposed whole where it is worth it, and ends its block."""

    def take(self, proposer: SuffixProposer, run: tuple[str, Continuation], block: PendingBlock, limit: int,
             policy: CallPolicy | None) -> list[ProposedToken]:
        """The run's tokens as proposals; the last ends the block (so does EOS, and in sprinter a flag). None when it
        is not worth it: its first token scores under COPY_MIN, or the target would keep fewer of it (the sum of its
        tokens' survival chances) than of a block of the draft's own; the draft drafts there instead."""
        source, found = run
        length = min(len(found.tokens), limit - len(block))
        proposals, expected = [], 0.0
        for i, (token, reach, accept_prob, survival) in enumerate(proposer.scored(source, found, length)):
            if i == 0 and accept_prob < COPY_MIN:
                return []
            if proposals and survival < MIN_SURVIVAL:
                proposals[-1] = replace(proposals[-1], ends_block=True)
                break
            flagged = proposer.passes_unchecked and (source == CACHE or not proposer.may_pass or policy is None
                                                     or policy.should_send([accept_prob], cap=limit))
            ends = flagged or i == length - 1 or token in proposer.model.eos_token_ids
            proposals.append(ProposedToken(token, source, None, flagged, ends, accept_prob, match_length=reach))
            expected += survival
            if ends:
                break
        return proposals if expected >= proposer.memory.model_kept.value else []

    def drafted(self, proposer: SuffixProposer, proposed: ProposedToken) -> ProposedToken:
        return proposed


@dataclass
class SuffixProposer:
    """One generation's suffix drafting over `model` (see the module docstring)."""

    model: ModelProposer
    memory: SuffixMemory
    passes_unchecked: bool = False  # the mode releases passed tokens unchecked (sprinter)
    may_pass: bool = True  # this request's copies may pass unchecked at all (no logprobs, no logits shaping)
    index: TokenIndex = field(default_factory=TokenIndex)
    kept_here: float = 0.0  # this request's copies the target reached and kept ...
    predicted_here: float = 0.0  # ... and the a_i they carried: how this request's copies do against the edge's rates
    rule: RunRule = field(default_factory=WholeRuns)

    async def propose(self, context: list[int], limit: int, policy: CallPolicy | None, cost_model: CostModel | None,
                      to_verify: bool = True, prefix: PendingBlock | None = None) -> AsyncIterator[ProposedToken]:
        if not to_verify:  # it stands as drafted: only the draft's own tokens may
            async for proposed in self.model.propose(context, limit, policy, cost_model, to_verify, prefix):
                yield proposed
            return
        self.index.extend_to(context)
        block = PendingBlock(list(prefix.drafted)) if prefix is not None else PendingBlock()
        while len(block) < limit and not block.complete:
            run = self.lookup(context + block.tokens, limit - len(block))
            proposals = self.rule.take(self, run, block, limit, policy) if run is not None else []
            if not proposals:  # no copy worth it here: the draft drafts this position
                drafted = await self.model.step(context, block, limit, policy, cost_model, to_verify)
                proposals = [self.rule.drafted(self, drafted)]
            for proposed in proposals:
                block.drafted.append(proposed)
                yield proposed

    def lookup(self, context: list[int], room: int) -> tuple[str, Continuation] | None:
        """The longer of the request's own match and the cache's (the request's on a tie), within `room` tokens."""
        started = time.perf_counter()
        own = continuation(self.index, context, room)
        cached = self.memory.cache.continuation(context, room) if self.memory.cache is not None else None
        self.memory.timed(started)
        if cached is not None and (own is None or cached.match_length > own.match_length):
            return CACHE, cached
        return (CONTEXT, own) if own is not None else None

    def branch_run(self, context: list[int], room: int) -> list[ProposedToken]:
        """The run the index proposes after `context` as a candidate path of a draft tree (copy_branches.py): point
        masses with their a_i (the run's scores above), while the chance that the target keeps all of them stays
        above MIN_SURVIVAL (its first token's a_i included), at most `room` tokens, ending at EOS; none without a
        match. No COPY_MIN here: a branch displaces none of the draft's tokens, it is read only where the chain
        failed. Reads the index, the cache and the calibration as they were before the round; changes nothing but
        the cache's recency."""
        found = self.lookup(context, room) if room > 0 else None
        if found is None:
            return []
        source, run = found
        proposals: list[ProposedToken] = []
        for token, reach, accept_prob, survival in self.scored(source, run, room):
            if survival < MIN_SURVIVAL:
                break
            proposals.append(ProposedToken(token, source, None, False, False, accept_prob, match_length=reach))
            if token in self.model.eos_token_ids:
                break
        return proposals

    def scored(self, source: str, found: Continuation, room: int) -> Iterator[tuple[int, int, float, float]]:
        """The run's first `room` tokens, each with what it carries: (token, reach, a_i, survival). The i-th token
        follows a match of reach = match_length + i tokens should the ones before it be kept; a_i is the module
        docstring's; survival is the chance that the target keeps the run up to and with it."""
        before, survival = 1.0, 1.0
        for i, token in enumerate(found.tokens[:room]):
            reach = found.match_length + i
            accept_prob = self.rate(source, reach) * found.scores[i] / before
            before, survival = found.scores[i], survival * accept_prob
            yield token, reach, accept_prob, survival

    def rate(self, source: str, match_length: int) -> float:
        """The edge's calibrated rate, scaled by how this request's copies have done against it so far."""
        factor = (self.kept_here + REQUEST_WEIGHT) / (self.predicted_here + REQUEST_WEIGHT)
        return min(1.0, self.calibration.rate(source, match_length) * factor)

    @property
    def calibration(self) -> SuffixCalibration:
        return self.memory.calibration_for(self.model.sampling.greedy)

    @property
    def draft_model(self) -> ModelProposer:
        return self.model

    def copy_run(self, context: list[int], drafted: list[int], room: int) -> list[ProposedToken]:
        self.index.extend_to(context)  # the generation's own tokens, never a block's unverified ones
        return self.branch_run(context + drafted, room)

    def observe_verdict(self, block: PendingBlock, n_accepted: int) -> None:
        """Calibrate: each copied token the target reached (all before it kept) counts, kept or not; a block of the
        draft's alone tells what a run must beat. The draft model hears the verdict too (its verifier may learn)."""
        self.model.observe_verdict(block, n_accepted)
        if block.drafted and block.model_tokens == len(block):
            self.memory.model_kept.update(n_accepted)
        for i, proposed in enumerate(block.drafted[: n_accepted + 1]):
            if not proposed.from_model:
                self.calibration.observe(proposed.source, proposed.match_length, i < n_accepted,
                                                proposed.accept_prob)
                self.kept_here += i < n_accepted
                self.predicted_here += proposed.accept_prob or 0.0

    def observe_output(self, output: list[int]) -> None:
        if self.memory.cache is not None:
            self.memory.cache.add(output)
