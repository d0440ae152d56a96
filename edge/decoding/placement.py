"""Where a request's draft runs (its placement): the edge, or the cloud beside the target (mode cloud-sd).

A pure decision over measured quantities, so that a response or a log can say why. Per user, in tokens/s:

    edge drafting   E_edge / (gamma * t_draft_edge + rtt + t_verify(gamma) + uplink_bytes * 8 / bandwidth)
    cloud drafting  T / (rtt + (T / E_cloud) * t_round_cloud * load)        T = the request's max_tokens

where E is the tokens a round yields (accepted + the target's own), t_round_cloud = gamma * t_draft_cloud +
t_verify(gamma) (the cloud's round, as its GenerateChunks report it), and the cloud's stream pays the round trip
once at the start. `load` >= 1 stretches the cloud's rounds when it announces a queue: cloud drafting spends
the shared cloud's compute that edge drafting saves, so a cloud that says it is busy (announced a queue, or refused
us with RESOURCE_EXHAUSTED, lately: edge/cloud_link/replicas.py holds either for a while) gets no cloud drafting at
all ("never the worse one under load").

Hysteresis: a request keeps the previous request's placement unless the other side is predicted faster by
more than `margin` (a share), so that a request-by-request decision does not flap on noise.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.spec.round_cost import cloud_stream_rate, edge_speculation_rate

EDGE, CLOUD = "edge", "cloud"
DEFAULT_MARGIN = 0.15


@dataclass(frozen=True)
class PlacementInputs:
    """What the decision reads; every time in ms. The edge's side from its cost model, the cloud's as learned."""

    gamma: int  # draft tokens a round proposes (the request's k)
    max_tokens: int  # the request's budget: over how many tokens the cloud's one round trip is amortised
    edge_tokens_per_round: float  # E_edge: accepted + 1
    t_draft_edge_ms: float  # one draft step on the edge (less what a pipeline hides)
    rtt_ms: float
    t_verify_ms: float  # t_verify(gamma)
    uplink_bytes_per_round: float
    uplink_mbps: float  # 0: unlimited (the uplink costs no time)
    cloud_tokens_per_round: float  # E_cloud
    cloud_round_ms: float  # gamma * t_draft_cloud + t_verify(gamma), as the cloud reports its rounds
    cloud_load: float = 1.0  # >= 1: how much the cloud's queue stretches its rounds
    cloud_busy: bool = False  # the cloud announced a queue or refused with RESOURCE_EXHAUSTED lately
    cloud_drafts: bool = True  # some usable replica has a draft (ServiceInfo.draft_model_id)

    def __post_init__(self) -> None:
        if self.gamma < 1 or self.max_tokens < 1:
            raise ValueError("gamma and max_tokens must be >= 1")
        if self.uplink_mbps < 0:
            raise ValueError(f"uplink_mbps must be >= 0 (0: unlimited), got {self.uplink_mbps:g}")
        if self.cloud_load < 1.0:
            raise ValueError(f"cloud_load must be >= 1, got {self.cloud_load:g}")


@dataclass(frozen=True)
class PlacementDecision:
    placement: str  # "edge" or "cloud"
    edge_tokens_per_s: float
    cloud_tokens_per_s: float | None  # None: the cloud cannot draft
    reason: str  # faster, kept (hysteresis), cloud_busy, no_cloud_draft

    def describe(self) -> dict[str, object]:
        cloud = round(self.cloud_tokens_per_s, 2) if self.cloud_tokens_per_s is not None else None
        return {"placement": self.placement, "reason": self.reason,
                "edge_tokens_per_s": round(self.edge_tokens_per_s, 2), "cloud_tokens_per_s": cloud}


def uplink_ms(bytes_: float, mbps: float) -> float:
    """Time the uplink takes to carry `bytes_` at `mbps` megabits/s; 0 when unlimited."""
    return bytes_ * 8.0 / (mbps * 1e3) if mbps > 0 else 0.0


def edge_tokens_per_s(q: PlacementInputs) -> float:
    return edge_speculation_rate(q.edge_tokens_per_round, q.gamma, q.t_draft_edge_ms, q.rtt_ms, q.t_verify_ms,
                                 uplink_ms(q.uplink_bytes_per_round, q.uplink_mbps))


def cloud_tokens_per_s(q: PlacementInputs) -> float:
    return cloud_stream_rate(q.max_tokens, q.cloud_tokens_per_round, q.cloud_round_ms, q.rtt_ms, q.cloud_load)


def decide(q: PlacementInputs, previous: str | None = None, margin: float = DEFAULT_MARGIN) -> PlacementDecision:
    """Edge or cloud for one request; `previous`: the last request's placement, which wins near a tie."""
    edge = edge_tokens_per_s(q)
    if not q.cloud_drafts:
        return PlacementDecision(EDGE, edge, None, "no_cloud_draft")
    cloud = cloud_tokens_per_s(q)
    if q.cloud_busy:
        return PlacementDecision(EDGE, edge, cloud, "cloud_busy")
    faster = CLOUD if cloud > edge else EDGE
    if previous in (EDGE, CLOUD) and faster != previous:
        kept, other = (edge, cloud) if previous == EDGE else (cloud, edge)
        if other <= kept * (1.0 + margin):
            return PlacementDecision(previous, edge, cloud, "kept")
    return PlacementDecision(faster, edge, cloud, "faster")
