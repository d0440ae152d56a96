"""`--mode auto` within a request (issue 56): a request runs as segments, one mode each, switching at round ends.

A boundary is where the edge and the cloud agree on the context: a verdict applied (speculating on the edge), a
chunk of a cloud stream committed (mode target's tokens, cloud-sd's rounds). There the runner asks `ModeSwitch.due`:
the placer decides again (edge/decoding/placer.py `choose_mode`) over the tokens left, from what it has learned
of earlier requests and of this one: the edge's rounds so far, weighed with earlier requests' yield (a few poor
rounds are mostly noise about the rest of a request), the cloud's chunks (edge/decoding/target_mode.py), the round
trip and verify times (the cost model). Another option pays its start over the context so far (its stream's
prefill); only when it is still predicted faster by more than the margin does the runner stop there, cleanly; the
next segment continues the same `Generation` from the prompt and the tokens committed so far (the cloud's prefix
cache and the edge's draft KV keep the re-prefill small).

Why the output stays the target's: every mode auto runs is lossless given its context, a segment starts only from
committed tokens, and nothing uncommitted crosses a boundary (drafted-ahead blocks and tokens the cloud streamed
past the boundary are dropped). So each token is drawn from the target's distribution given the tokens before it,
whichever segment drew it; under greedy it is the target's own token. Its randomness must be fresh, though: the
cloud seeds a session or a stream with the request's seed, and the same seed again would replay the coins that
drew the tokens before the switch. A segment starting at token n > 0 is seeded by `segment_seed(seed, n)`:
reproducible for a seeded request, independent of the segment before.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field, replace
from typing import Callable

from common.spec.cost_model import CostModel
from common.spec.generation import Generation
from common.spec.propose.drafting import Drafter
from edge.decoding.edge_settings import EdgeSettings
from edge.decoding.placement import EDGE
from edge.decoding.placer import EdgeYield, Placed, Placer

log = logging.getLogger(__name__)


def segment_seed(seed: int, at_token: int) -> int:
    """The seed of the segment that starts at completion token `at_token` > 0: a hash, so that it is far from the
    seeds of the request's other choices (seed + 1, ...) and of its other segments."""
    digest = hashlib.blake2b(f"sprinter-segment:{seed}:{at_token}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def segment_settings(asked: EdgeSettings, placed: Placed) -> EdgeSettings:
    """The settings a segment runs with: the request's, in the mode chosen (cloud-sd and target take no call policy,
    no tree and send no draft distribution); past token 0 with a fresh seed and no prompt logprobs (the first
    segment's open brought them)."""
    settings = asked
    if placed.mode != asked.decode.mode:
        settings = replace(asked, decode=replace(asked.decode, mode=placed.mode, policy=None, branch_tokens=0),
                           draft_dists="full")
    if placed.at_token:
        sampling = replace(settings.decode.sampling, seed=segment_seed(settings.decode.sampling.seed, placed.at_token),
                           prompt_logprobs=None)
        settings = replace(settings, decode=replace(settings.decode, sampling=sampling))
    return settings


@dataclass
class ModeSwitch:
    """One `--mode auto` request's choices: the first (`Placer.place`), then one at each boundary that switches."""

    placer: Placer
    asked: EdgeSettings  # the request's own settings: its edge mode, k, policy, sampling
    first: Placed
    cost_model: CostModel
    cloud: object  # the decoder's ReplicaSet
    degraded: Callable[[], bool]  # no switching once the request runs from the draft alone
    later: list[Placed] = field(default_factory=list)
    pending: Placed | None = None  # the switch a runner stopped for, not begun yet
    drafter: Drafter | None = None  # the edge segments' drafter, kept across them (its KV holds the context)
    own: EdgeYield = EdgeYield()  # this request's edge rounds so far
    _tokens: int = 0  # completion tokens at the last boundary
    _rounds: int = 0  # verdicts then
    _drafted: int = 0  # draft tokens verified then
    _opened: int = 0  # target calls then that were no verdict: first tokens from a session's open

    @property
    def current(self) -> Placed:
        return self.later[-1] if self.later else self.first

    @property
    def placed(self) -> Placed:
        """The request's placement as its response reports it: the first choice with every switch after it."""
        return replace(self.first, later=tuple(self.later))

    def due(self, generation: Generation) -> bool:
        """At a boundary: whether the runner is to stop here for another mode (then `pending` names it)."""
        at = len(generation.new_tokens)
        self._learn(generation, at)
        if generation.done or at <= self.current.at_token or self.degraded():
            return False
        decode = self.asked.decode
        choice = self.placer.choose_mode(decode.mode, decode.k, generation.budget, self.cost_model, self.cloud,
                                         self.current.used, at, len(generation.prompt_ids) + at, self.own)
        if choice.used == self.current.used:
            return False
        self.pending = replace(choice, at_token=at)
        log.debug("mode auto switches from %s to %s at token %d", self.current.mode, choice.mode, at)
        return True

    def begin(self, generation: Generation) -> EdgeSettings | None:
        """The next segment's settings, in force on `generation` (None: no switch is pending)."""
        if self.pending is None or generation.done:
            return None
        self.later.append(self.pending)
        self.pending = None
        settings = segment_settings(self.asked, self.current)
        generation.settings = settings.decode
        recorder = generation.recorder
        self._tokens, self._rounds = len(generation.new_tokens), len(recorder.block_lengths)
        self._drafted, self._opened = sum(recorder.block_lengths), recorder.calls_without_verdict
        return settings

    @property
    def edge_rounds(self) -> int:
        return int(self.own.rounds)

    def teach(self) -> None:
        """At the request's end: its edge rounds, which later requests' choices weigh theirs with."""
        self.placer.observe_edge_rounds(self.own)

    def _learn(self, generation: Generation, at: int) -> None:
        """An edge segment's rounds since the last boundary: tokens per verdict, as the placer weighs them. The
        target's first token from a session's open is a target call but no round: its token is the start's
        (`Placer.observe_edge_start`)."""
        recorder = generation.recorder
        rounds, drafted = len(recorder.block_lengths), sum(recorder.block_lengths)
        opened = recorder.calls_without_verdict
        from_rounds = (at - self._tokens) - (opened - self._opened)  # since the last boundary, less the opens' tokens
        if self.current.used == EDGE and rounds > self._rounds and from_rounds > 0:
            self.own = self.own.plus(rounds - self._rounds, from_rounds, drafted - self._drafted)
        self._tokens, self._rounds, self._drafted, self._opened = at, rounds, drafted, opened
