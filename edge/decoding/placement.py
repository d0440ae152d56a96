"""How a request decodes: speculating with the draft on the edge, with the draft in the cloud beside the target (mode
cloud-sd: its placement), or, for `--mode auto`, not speculating at all (mode target: the cloud decodes alone).

A pure decision over measured quantities, so that a response or a log can say why. Per user, in tokens/s, by the
one cost model (common/spec/round_cost.py):

    edge drafting   T / (s_edge + (T / E_edge) * (g * t_draft_edge + rtt + t_verify(g) + uplink_bytes * 8 / bandwidth))
    cloud drafting  T / (s_cloud + rtt + (T / E_cloud) * t_round_cloud * load)        T = the request's max_tokens
    target alone    T / (s_target + rtt + T * t_decode * load)

where E is the tokens a round yields (accepted + the target's own), g the draft tokens an edge round sends as this
edge's rounds have sent them (a call policy such as goodput grows blocks past k; gamma = k before any),
t_round_cloud = gamma * t_draft_cloud + t_verify(gamma) (the cloud's round, as its GenerateChunks report it),
t_decode the cloud's decode step, and the cloud's stream pays the round trip once at the start. s is what an option
pays once at a request's start beyond its rounds (the prompt's prefill; on the edge also the draft's, overlapped with
the cloud's), learned per prompt token from earlier requests' first round or chunk (edge/decoding/placer.py); at a
round boundary the option running pays none and the others theirs over the context so far (a switch opens a
stream). `load` >= 1 stretches the cloud's steps when it announces a queue: cloud drafting spends the shared cloud's
compute that edge drafting saves, so a cloud that says it is busy (announced a queue, or refused us with
RESOURCE_EXHAUSTED, lately: edge/cloud_link/replicas.py holds either for a while) gets no cloud drafting at all
("never the worse one under load").

Hysteresis: a request keeps the previous request's placement unless the other side is predicted faster by
more than `margin` (a share), so that a request-by-request decision does not flap on noise. `--mode auto` decides
again at a request's round boundaries (edge/decoding/mode_switch.py) over the tokens left, with the option running
as `previous`; a cloud stream already open (`open_stream`) pays no round trip again, so that the end of a request,
where T is small, does not look cheaper anywhere else than where it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.spec.round_cost import request_rate

EDGE, CLOUD, TARGET = "edge", "cloud", "target"  # TARGET: no speculation (`--mode auto` alone offers it)
DEFAULT_MARGIN = 0.15


@dataclass(frozen=True)
class PlacementInputs:
    """What the decision reads; every time in ms. The edge's side from its cost model, the cloud's as learned."""

    gamma: int  # draft tokens a round proposes (the request's k)
    max_tokens: int  # the request's budget: over how many tokens the cloud's one round trip is amortised
    edge_tokens_per_round: float  # E_edge: accepted + 1
    t_draft_edge_ms: float  # one draft step on the edge (less what a pipeline hides)
    rtt_ms: float
    t_verify_ms: float  # t_verify(g): at the observed draft tokens a round (edge_drafted_per_round), else gamma
    uplink_bytes_per_round: float
    uplink_mbps: float  # 0: unlimited (the uplink costs no time)
    cloud_tokens_per_round: float  # E_cloud
    cloud_round_ms: float  # gamma * t_draft_cloud + t_verify(gamma), as the cloud reports its rounds
    cloud_load: float = 1.0  # >= 1: how much the cloud's queue stretches its rounds
    cloud_busy: bool = False  # the cloud announced a queue or refused with RESOURCE_EXHAUSTED lately
    cloud_drafts: bool = True  # some usable replica has a draft (ServiceInfo.draft_model_id)
    cloud_decode_ms: float | None = None  # the target's decode step, offered as an option (`--mode auto`); None: not
    edge_drafted_per_round: float | None = None  # g: draft tokens an edge round sends, as observed; None: gamma
    open_stream: str | None = None  # CLOUD or TARGET: that option's stream is open already (mid-request: no RTT again)
    # What each option pays once at a request's start before its rounds run (its prompt's prefill, and for the edge
    # the draft's too), as learned per prompt token (edge/decoding/placer.py); at a round boundary, over the context
    # so far for the options not running, 0 for the one running
    edge_start_ms: float = 0.0
    cloud_start_ms: float = 0.0
    target_start_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.gamma < 1 or self.max_tokens < 1:
            raise ValueError("gamma and max_tokens must be >= 1")
        if self.uplink_mbps < 0:
            raise ValueError(f"uplink_mbps must be >= 0 (0: unlimited), got {self.uplink_mbps:g}")
        if self.cloud_load < 1.0:
            raise ValueError(f"cloud_load must be >= 1, got {self.cloud_load:g}")


@dataclass(frozen=True)
class PlacementDecision:
    placement: str  # "edge", "cloud" or "target"
    edge_tokens_per_s: float
    cloud_tokens_per_s: float | None  # None: the cloud cannot draft
    reason: str  # faster, kept (hysteresis), cloud_busy, no_cloud_draft
    target_tokens_per_s: float | None = None  # None: not an option (a placement, not `--mode auto`)

    def predicted(self) -> dict[str, float]:
        """Each option's predicted tokens/s."""
        options = {EDGE: self.edge_tokens_per_s, CLOUD: self.cloud_tokens_per_s, TARGET: self.target_tokens_per_s}
        return {name: round(rate, 2) for name, rate in options.items() if rate is not None}

    def describe(self) -> dict[str, object]:
        rates = self.predicted()
        return {"placement": self.placement, "reason": self.reason,
                **{f"{name}_tokens_per_s": rates.get(name) for name in (EDGE, CLOUD)},
                **({"target_tokens_per_s": rates[TARGET]} if TARGET in rates else {})}


def uplink_ms(bytes_: float, mbps: float) -> float:
    """Time the uplink takes to carry `bytes_` at `mbps` megabits/s; 0 when unlimited."""
    return bytes_ * 8.0 / (mbps * 1e3) if mbps > 0 else 0.0


def edge_round_ms(q: PlacementInputs) -> float:
    """One edge round: g draft steps, the round trip, t_verify(g) and the uplink's time for its bytes."""
    drafted = q.gamma if q.edge_drafted_per_round is None else q.edge_drafted_per_round
    return drafted * q.t_draft_edge_ms + q.rtt_ms + q.t_verify_ms + uplink_ms(q.uplink_bytes_per_round, q.uplink_mbps)


def edge_tokens_per_s(q: PlacementInputs) -> float:
    return request_rate(q.max_tokens, q.edge_tokens_per_round, edge_round_ms(q), q.edge_start_ms)


def stream_open_ms(q: PlacementInputs, option: str) -> float:
    """What a cloud stream pays once before its rounds: its start (the prompt's prefill) and the round trip, unless
    it is open already."""
    if q.open_stream == option:
        return 0.0
    return q.rtt_ms + (q.cloud_start_ms if option == CLOUD else q.target_start_ms)


def cloud_tokens_per_s(q: PlacementInputs) -> float:
    return request_rate(q.max_tokens, q.cloud_tokens_per_round, q.cloud_round_ms, stream_open_ms(q, CLOUD),
                        q.cloud_load)


def target_tokens_per_s(q: PlacementInputs) -> float | None:
    if q.cloud_decode_ms is None:
        return None
    return request_rate(q.max_tokens, 1.0, q.cloud_decode_ms, stream_open_ms(q, TARGET), q.cloud_load)


def decide(q: PlacementInputs, previous: str | None = None, margin: float = DEFAULT_MARGIN) -> PlacementDecision:
    """The fastest option for one request: edge or cloud drafting, and the target alone when `cloud_decode_ms` is
    given; `previous`: the last request's choice, which wins unless another is faster by more than `margin`."""
    edge, target = edge_tokens_per_s(q), target_tokens_per_s(q)
    cloud = cloud_tokens_per_s(q) if q.cloud_drafts else None
    reason = "no_cloud_draft" if cloud is None else "cloud_busy" if q.cloud_busy else "faster"
    # a busy cloud gets no cloud drafting: it would spend the shared compute that edge drafting saves
    rates = {name: rate for name, rate in ((EDGE, edge), (CLOUD, cloud if reason == "faster" else None),
                                           (TARGET, target)) if rate is not None}
    choice = max(rates, key=rates.__getitem__)
    if previous in rates and choice != previous and rates[choice] <= rates[previous] * (1.0 + margin):
        choice, reason = previous, "kept"
    elif reason != "faster" and choice == TARGET:
        reason = "faster"
    return PlacementDecision(choice, edge, cloud, reason, target)
