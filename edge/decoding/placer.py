"""Placement per request on the edge: what the decision (edge/decoding/placement.py) reads, learned here.

The edge's own side comes from the decoder's `CostModel` (draft step, round trip, t_verify(gamma)) and from its
finished generations (tokens a round, uplink bytes a round); the cloud's side from the GenerateChunks of earlier
cloud-sd requests (each chunk one round: its tokens, the drafted count, the round's step_ms), with priors before
any: the edge's acceptance (the same pair drafts) and PRIOR_CLOUD_DRAFT_MS a draft step. The cloud's load comes
from its announcements and RESOURCE_EXHAUSTED refusals (edge/cloud_link/replicas.py `drafting_load`).

A placement names where the draft runs: `edge` (the mode as asked), `cloud` (`placed_mode(mode, "cloud")`), or
`auto` (decided per request). Only the placeable modes move; sprinter stays on the edge (it has no cloud form).

`--mode auto` (`chooses_mode`) adds a third option, not speculating: mode target, the cloud decoding alone, at its
decode step as learned from earlier target streams' GenerateChunks, with the cloud's cost table (GetInfo) as the
prior. The cost table is also the prior of the verify time t_verify(gamma) until the edge has timed verdicts. It
chooses at a request's start and again at its round boundaries (`choose_mode`, asked by edge/decoding/mode_switch.py),
from the same estimates, which the request's own rounds and chunks update as they come.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field, replace

from common.spec.cost_model import CostModel, Ewma
from common.spec.modes import (AUTO_MODE, AUTO_SPECULATION, CLOUD_DRAFTING, PLACEMENTS, TARGET_MODE, chooses_mode,
                               mode_of, placed_mode)
from common.spec.round_cost import CloudCosts
from edge.decoding.placement import (CLOUD, DEFAULT_MARGIN, EDGE, TARGET, PlacementDecision, PlacementInputs, decide,
                                     edge_round_ms)
from common.errors import SprinterError
from common.stats import DecodeStats

log = logging.getLogger(__name__)

PRIOR_ACCEPT = 0.6  # a drafted token's chance to be kept, before this edge has seen a verdict
PRIOR_CLOUD_DRAFT_MS = 5.0  # one draft step in the cloud (an accelerator's), before its first cloud-sd round
ALPHA = 0.25
# Mid-request, a `--mode auto` request's own edge rounds weigh against what earlier requests' rounds yielded as if
# those were this many rounds: a few poor rounds of a request (a stretch of prose) are mostly noise about what the
# rest of it yields, and leaving the edge costs a stream's start; a request that keeps yielding little takes over.
REQUEST_PRIOR_ROUNDS = 8.0


@dataclass(frozen=True)
class EdgeYield:
    """Edge rounds: verdicts, the tokens they gave and the draft tokens sent; one request's so far, or earlier
    requests' decayed (`decayed`). E, the tokens a round yields, is tokens / rounds: a ratio of sums, so that a
    request is weighed by its rounds, as its time is (an average of each request's own E would overrate: the
    requests that yield little take the most rounds)."""

    rounds: float = 0.0
    tokens: float = 0.0
    drafted: float = 0.0

    def plus(self, rounds: float, tokens: float, drafted: float) -> EdgeYield:
        return EdgeYield(self.rounds + rounds, self.tokens + tokens, self.drafted + drafted)

    def decayed(self, request: EdgeYield, alpha: float = ALPHA) -> EdgeYield:
        """Earlier requests' sums with `request`'s added at weight `alpha` (each older one's shrinks by 1 - alpha)."""
        keep = 1.0 - alpha
        return EdgeYield(keep * self.rounds + alpha * request.rounds, keep * self.tokens + alpha * request.tokens,
                         keep * self.drafted + alpha * request.drafted)

    @property
    def per_round(self) -> float:
        return self.tokens / self.rounds

    @property
    def drafted_per_round(self) -> float:
        return self.drafted / self.rounds

    def with_prior(self, per_round: float, drafted_per_round: float,
                   prior_rounds: float = REQUEST_PRIOR_ROUNDS) -> EdgeYield:
        """These rounds with earlier requests' yield (`per_round`, `drafted_per_round`) as `prior_rounds` more."""
        return self.plus(prior_rounds, prior_rounds * per_round, prior_rounds * drafted_per_round)


class PlacementRefused(SprinterError, ValueError):
    """A placement this edge cannot serve (no cloud, or no cloud with a draft); names `placement`."""


@dataclass(frozen=True)
class Placed:
    """How a request was placed: what it asked, where it drafted, the mode that ran, and why. Under `--mode auto`
    this is the request's first choice, and `later` its switches at round boundaries (edge/decoding/mode_switch.py)."""

    asked: str
    used: str  # "edge" or "cloud" (or "target": `--mode auto` chose not to speculate)
    mode: str  # the mode actually run (the first, under `--mode auto`)
    decision: PlacementDecision | None = None  # auto's prediction
    note: str | None = None  # e.g. why a cloud placement stayed on the edge
    at_token: int = 0  # the completion token this choice took over at
    later: tuple[Placed, ...] = ()  # `--mode auto`'s switches after the first choice, in order

    def switches(self) -> list[dict[str, object]]:
        """`--mode auto`'s choices (the response's `sprinter.decision`): the mode chosen at each switch (the first at
        token 0), with every option's predicted tokens/s over the tokens left."""
        if self.decision is None or not chooses_mode(self.asked):
            return []
        return [choice._switch() for choice in (self, *self.later)]

    def _switch(self) -> dict[str, object]:
        assert self.decision is not None
        modes = {EDGE: AUTO_SPECULATION, CLOUD: CLOUD_DRAFTING, TARGET: TARGET_MODE}
        predicted = {modes[option]: rate for option, rate in self.decision.predicted().items()}
        return {"at_token": self.at_token, "mode": self.mode, "reason": self.decision.reason,
                "predicted_tokens_per_s": predicted}

    def describe(self) -> dict[str, object]:
        described: dict[str, object] = {"asked": self.asked, "used": self.used, "mode": self.mode}
        if self.decision is not None:
            described.update({k: v for k, v in self.decision.describe().items() if k != "placement"})
        if self.note:
            described["note"] = self.note
        if self.later:
            described["switches"] = len(self.later)
        return described


def check_placement(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise PlacementRefused(f"unknown placement {placement!r}; choose one of {', '.join(PLACEMENTS)}")


@dataclass
class Placer:
    """One per decoder: learns both sides across requests and keeps the last decision (hysteresis)."""

    uplink_mbps: float = 0.0  # 0: unlimited
    margin: float = DEFAULT_MARGIN
    prior_cloud_draft_ms: float = PRIOR_CLOUD_DRAFT_MS  # a cloud draft step before its first cloud-sd round
    previous: str | None = None
    previous_choice: str | None = None  # `--mode auto`'s last choice: its own hysteresis, apart from placement's
    decisions: Counter = field(default_factory=Counter)  # (asked, used) -> requests
    _edge: EdgeYield | None = None  # earlier requests' edge rounds, decayed by request; their drafted: the blocks
    _uplink_bytes: Ewma = field(default_factory=lambda: Ewma(0.0, ALPHA))  # per edge round
    _cloud_tokens: Ewma | None = None  # tokens a cloud-sd round yields
    _cloud_round_ms: Ewma | None = None
    _cloud_decode_ms: Ewma | None = None  # the target's decode step, from mode target's GenerateChunks
    # ms per prompt token each option pays at a request's start beyond its rounds (its prefill): EDGE, CLOUD, TARGET
    _start_ms_per_token: dict[str, Ewma] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.uplink_mbps < 0:
            raise ValueError(f"--uplink-mbps must be >= 0 (0: unlimited), got {self.uplink_mbps:g}")

    def place(self, mode: str, placement: str, k: int, max_tokens: int, cost_model: CostModel,
              cloud: object | None, chooses_mode: bool = False, prompt_tokens: int = 0) -> Placed:
        """The mode a request runs in; PlacementRefused when the placement cannot be served. `cloud` is the
        decoder's ReplicaSet (read: drafts(), drafting_load(), costs()); `chooses_mode` (`--mode auto`): the target
        alone is an option too; `prompt_tokens` prices each option's start (its prefill)."""
        check_placement(placement)
        if chooses_mode:
            if cloud is None:
                raise PlacementRefused("mode 'auto' chooses among ways of using a cloud, and this edge has none "
                                       "(--cloud)")
            return self._count(self.choose_mode(mode, k, max_tokens, cost_model, cloud, self.previous_choice,
                                                prompt_tokens=prompt_tokens))
        if placement == EDGE:
            return self._count(Placed(EDGE, EDGE, mode))
        if cloud is None:
            raise PlacementRefused(f"placement {placement!r} needs a cloud, and this edge has none (--cloud)")
        if not mode_of(mode).placeable:
            note = f"mode {mode!r} has no cloud form: it drafts on the edge" if mode_of(mode).drafts else None
            return self._count(Placed(placement, EDGE if mode_of(mode).drafts else CLOUD, mode, note=note))
        drafts = cloud.drafts()  # type: ignore[attr-defined]
        if placement == CLOUD:
            if not drafts:
                raise PlacementRefused("placement 'cloud' needs a cloud replica with a draft of its own "
                                       "(sprinter cloud serve --draft); none of this edge's has one")
            return self._count(Placed(CLOUD, CLOUD, placed_mode(mode, CLOUD)))
        load, busy = cloud.drafting_load()  # type: ignore[attr-defined]
        decision = decide(self.inputs(k, max_tokens, cost_model, load, busy, drafts, prompt_tokens), self.previous,
                          self.margin)
        self.previous = decision.placement
        log.debug("placement auto: %s", decision)
        return self._count(Placed(placement, decision.placement, placed_mode(mode, decision.placement), decision))

    def choose_mode(self, mode: str, k: int, max_tokens: int, cost_model: CostModel, cloud: object,
                    current: str | None, at_token: int = 0, prompt_tokens: int = 0,
                    own: EdgeYield = EdgeYield()) -> Placed:
        """`--mode auto`: speculate on the edge in `mode`, in the cloud (cloud-sd), or not at all (mode target), for
        the `max_tokens` left. At a request's start `current` is the last request's first choice and `prompt_tokens`
        its prompt. At its round boundaries (`at_token` > 0: edge/decoding/mode_switch.py) `current` is the option
        running, which pays no start again (its stream, if it has one, is open), `prompt_tokens` the context so far,
        which any other option's start prefills, and `own` the request's own edge rounds so far, which weigh with
        earlier requests' (`EdgeYield.with_prior`). The option running wins unless another is predicted faster by more
        than the margin."""
        costs: CloudCosts = cloud.costs()  # type: ignore[attr-defined]
        cost_model.seed_verify_prior(costs)
        load, busy = cloud.drafting_load()  # type: ignore[attr-defined]
        decode_ms = self._cloud_decode_ms.value if self._cloud_decode_ms is not None else \
            costs.decode_ms() or cost_model.t_verify_ms(0)
        drafts = cloud.drafts()  # type: ignore[attr-defined]
        inputs = replace(self.inputs(k, max_tokens, cost_model, load, busy, drafts, prompt_tokens, own),
                         cloud_decode_ms=decode_ms, open_stream=current if at_token else None)
        if at_token and current == EDGE:
            inputs = replace(inputs, edge_start_ms=0.0)  # its session is open, its draft's KV holds the context
        decision = decide(inputs, current, self.margin)
        if not at_token:  # a request's own switches answer its own rounds: the next request starts from this choice
            self.previous_choice = decision.placement
        log.debug("mode auto at token %d: %s", at_token, decision)
        return Placed(AUTO_MODE, decision.placement, option_mode(mode, decision.placement), decision, at_token=at_token)

    def _count(self, placed: Placed) -> Placed:
        self.decisions[(placed.asked, placed.used)] += 1
        return placed

    def inputs(self, k: int, max_tokens: int, cost_model: CostModel, load: float = 1.0, busy: bool = False,
               drafts: bool = True, prompt_tokens: int = 0, own: EdgeYield = EdgeYield()) -> PlacementInputs:
        prior_tokens = 1.0 + sum(PRIOR_ACCEPT ** j for j in range(1, k + 1))
        edge_tokens = self._edge.per_round if self._edge is not None else prior_tokens
        drafted = self._edge.drafted_per_round if self._edge is not None else None  # the policy's blocks, not k
        if own.rounds:  # mid-request: what this request's rounds yielded, weighed with earlier requests'
            blended = own.with_prior(edge_tokens, k if drafted is None else drafted)
            edge_tokens, drafted = blended.per_round, blended.drafted_per_round
        cloud_round = self._cloud_round_ms.value if self._cloud_round_ms is not None else \
            k * self.prior_cloud_draft_ms + cost_model.t_verify_ms(k)
        return PlacementInputs(k, max_tokens, edge_tokens, cost_model.effective_draft_ms, cost_model.rtt_ms,
                               cost_model.t_verify_ms(k if drafted is None else drafted),
                               self._uplink_bytes.value, self.uplink_mbps,
                               self._cloud_tokens.value if self._cloud_tokens is not None else edge_tokens,
                               cloud_round, load, busy, drafts, edge_drafted_per_round=drafted,
                               edge_start_ms=self.start_ms(EDGE, prompt_tokens),
                               cloud_start_ms=self.start_ms(CLOUD, prompt_tokens),
                               target_start_ms=self.start_ms(TARGET, prompt_tokens))

    def start_ms(self, option: str, prompt_tokens: int) -> float:
        """What `option` is expected to pay at the start of a request of `prompt_tokens` beyond its rounds; 0 before
        any request of it was seen."""
        learned = self._start_ms_per_token.get(option)
        return learned.value * prompt_tokens if learned is not None else 0.0

    def observe_start(self, option: str, extra_ms: float, prompt_tokens: int) -> None:
        """A request's start in `option`: what its first round or chunk took beyond a steady one's (the prefill)."""
        if prompt_tokens > 0:
            learned = self._start_ms_per_token.get(option)
            self._start_ms_per_token[option] = _update(learned, max(extra_ms, 0.0) / prompt_tokens)

    def observe_edge_start(self, ttft_ms: float, prompt_tokens: int, k: int, cost_model: CostModel,
                           first_from_open: bool = True) -> None:
        """An edge-speculating request's time to its first token, less what the model charges that token in rounds:
        the request is priced s + (T / E) rounds, so s is the time to first token less 1 / E of a round where the
        first token came from the session's open (the lossless modes), less a whole round where it came with the
        first verdict (its E tokens all came then)."""
        inputs = self.inputs(k, k, cost_model)
        share = 1.0 / max(inputs.edge_tokens_per_round, 1.0) if first_from_open else 1.0
        self.observe_start(EDGE, ttft_ms - share * edge_round_ms(inputs), prompt_tokens)

    def observe_edge(self, stats: DecodeStats) -> None:
        """A finished generation that drafted on the edge and verified in the cloud: tokens and bytes per round.
        A round is a verdict; the target's first token from the session's open (counted as a target call) is not
        one, and its token is the start's, not a round's."""
        rounds = len(stats.block_lengths)
        from_rounds = stats.new_tokens - stats.calls_without_verdict
        if rounds == 0 or from_rounds <= 0:
            return
        self.observe_edge_rounds(EdgeYield(rounds, from_rounds, sum(stats.block_lengths)))
        self._uplink_bytes.update(stats.uplink_bytes / rounds)

    def observe_edge_rounds(self, request: EdgeYield) -> None:
        """A request's edge rounds: their verdicts, the tokens they yielded and the draft tokens they sent (a
        `--mode auto` request's edge segments tell theirs at its end, edge/decoding/mode_switch.py; observe_edge
        would mix its other modes' calls in); its uplink bytes come with `observe_uplink`."""
        if request.rounds > 0:
            self._edge = request if self._edge is None else self._edge.decayed(request)

    def observe_uplink(self, bytes_: int, rounds: int) -> None:
        if rounds > 0:
            self._uplink_bytes.update(bytes_ / rounds)

    def observe_cloud_round(self, tokens: int, drafted: int, step_ms: float, first: bool,
                            prompt_tokens: int = 0) -> None:
        """One cloud-sd round as its GenerateChunk reported it; the first also holds the prefill, so it teaches
        tokens a round and, at a request's start (`prompt_tokens` > 0), the start's cost, but not a round's time."""
        if tokens == 0 or drafted == 0:
            return  # a chunk with no round (the last of a stream, or a round cut to no draft by the budget)
        self._cloud_tokens = _update(self._cloud_tokens, float(tokens))
        if not first:
            self._cloud_round_ms = _update(self._cloud_round_ms, step_ms)
        elif self._cloud_round_ms is not None:
            self.observe_start(CLOUD, step_ms - self._cloud_round_ms.value, prompt_tokens)

    def observe_target_step(self, step_ms: float, first: bool, prompt_tokens: int = 0) -> None:
        """One decode step of mode target as its GenerateChunk reported it; the first also holds the prefill, the
        start's cost of a request (`prompt_tokens` > 0) beyond a step."""
        if not first:
            self._cloud_decode_ms = _update(self._cloud_decode_ms, step_ms)
        elif self._cloud_decode_ms is not None:
            self.observe_start(TARGET, step_ms - self._cloud_decode_ms.value, prompt_tokens)

    def snapshot(self) -> dict[str, object]:
        return {"previous": self.previous, "uplink_mbps": self.uplink_mbps,
                "edge_tokens_per_round": self._edge.per_round if self._edge else None,
                "edge_drafted_per_round": self._edge.drafted_per_round if self._edge else None,
                "uplink_bytes_per_round": self._uplink_bytes.value,
                "cloud_tokens_per_round": self._cloud_tokens.value if self._cloud_tokens else None,
                "cloud_round_ms": self._cloud_round_ms.value if self._cloud_round_ms else None,
                "cloud_decode_ms": self._cloud_decode_ms.value if self._cloud_decode_ms else None,
                "previous_choice": self.previous_choice}


def option_mode(mode: str, option: str) -> str:
    """The mode `--mode auto` runs for `option` (edge, cloud, target) when its edge speculation is `mode`."""
    return TARGET_MODE if option == TARGET else placed_mode(mode, option)


def _update(ewma: Ewma | None, x: float) -> Ewma:
    ewma = ewma or Ewma(x, ALPHA)
    ewma.update(x)
    return ewma
