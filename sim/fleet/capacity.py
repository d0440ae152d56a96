"""Capacity of one cloud replica from its costs: edges per replica at an ITL p99 target, per-user tokens/s by edges.

    edges, at = max_edges_at_itl(costs, profile, itl_p99_ms=400.0)
    projection = project_capacity(costs, {"target": ..., "cloud-sd": ..., "sd-block": ...}, [1, 4, 16], [0.0, 50.0], 400.0)

ITL is the simulator's own (sim.fleet.result.itl_percentiles, `itl="release"`): the gaps between successive
token releases at an edge, a chunk of n tokens released together counting as one gap and n - 1 gaps of 0; ITL
p99 is over all tokens after each generation's first. `itl="per-token"` takes `sprinter bench capacity`'s
definition instead (sim.fleet.result.itl_per_token_percentiles: a release of n tokens after a gap g is n
samples of g / n, a generation's first release none), so that a projection compares with that bench. The search assumes ITL p99 grows with the edges on the replica (more
edges, longer queues and batches): it doubles E until the target is missed, then bisects.

The formula that checks the simulator's drafting cost (mode cloud-sd against the edge-drafting mode it moves,
e.g. sd-block, on a fast network): per round the replica runs gamma draft forwards and one verify for
cloud-sd but only the verify for the edge-drafting mode, so with the replica's compute binding

    edges per replica (edge drafting) / edges per replica (cloud-sd)  ~  1 + gamma * t_d / t_v

gamma the mean draft tokens per round (the cloud-sd profile's), t_d one batched draft step and t_v one batched
verify of gamma + 1 tokens per request, both at batch b = min(max_batch, cloud-sd's edges at the target).
It is exact when forwards cost per request only (no fixed c0), and the edge's drafting and the RTT are short
next to the round; a fixed cost per forward makes batching cheaper per request and the ratio drift from it.
"""

from __future__ import annotations

from dataclasses import replace

from sim.fleet.costs import FleetCosts, ModeProfile
from sim.fleet.simulation import run_fleet
from sim.fleet.result import FleetResult

ITL_DEFINITIONS = ("release", "per-token")


def itl_p99(result: FleetResult, itl: str) -> float | None:
    """A result's ITL p99 by the module docstring's definition `itl`."""
    if itl not in ITL_DEFINITIONS:
        raise ValueError(f"itl must be one of {', '.join(ITL_DEFINITIONS)}, not {itl!r}")
    return result.itl_ms_p99 if itl == "release" else result.itl_per_token_ms_p99


def max_edges_at_itl(costs: FleetCosts, profile: ModeProfile, itl_p99_ms: float, *, e_max: int = 1024,
                     tokens_per_request: int = 128, seed: int = 0, requests: int = 1,
                     itl: str = "release") -> tuple[int, FleetResult | None]:
    """The largest E in [1, e_max] such that E edges on one replica, `requests` generations each, see ITL p99 <=
    itl_p99_ms, and that run's result; (0, None) when one edge alone misses the target. e_max itself when it meets it."""
    if itl_p99_ms <= 0 or e_max < 1:
        raise ValueError("itl_p99_ms must be > 0 and e_max >= 1")
    runs: dict[int, FleetResult] = {}

    def meets(n: int) -> bool:
        runs[n] = run_fleet(costs, profile, n, 1, seed, tokens_per_request=tokens_per_request, requests=requests)
        p99 = itl_p99(runs[n], itl)
        return p99 is not None and p99 <= itl_p99_ms

    if not meets(1):
        return 0, None
    good, bad = 1, None
    while bad is None and good < e_max:
        n = min(2 * good, e_max)
        if meets(n):
            good = n
        else:
            bad = n
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if meets(mid) else (good, mid)
    return good, runs[good]


def formula_ratio(costs: FleetCosts, cloud_profile: ModeProfile, batch: int) -> dict[str, float]:
    """The module docstring's 1 + gamma * t_d / t_v, with its terms, at `batch` requests per forward."""
    gamma = sum(cloud_profile.block_lengths) / len(cloud_profile.block_lengths)
    b = max(1, min(costs.max_batch, batch))
    t_d = costs.draft_model().t_forward_ms(b, b)
    t_v = costs.forward.t_forward_ms(b, round(b * (gamma + 1)))
    return {"gamma": gamma, "batch": b, "t_d_ms": t_d, "t_v_ms": t_v, "predicted": 1 + gamma * t_d / t_v}


def project_capacity(costs: FleetCosts, profiles: dict[str, ModeProfile], edges: list[int], rtts_ms: list[float],
                     itl_p99_ms: float, *, tokens_per_request: int = 128, seed: int = 0,
                     e_max: int = 1024, requests: int = 1, itl: str = "release") -> dict:
    """Per (label, RTT) over one replica: per-user tokens/s and ITL p99 at each E of `edges`, and the edges per
    replica at the ITL target; per RTT and edge-drafting label with the cloud-sd label's record (the same rounds),
    the formula's ratio against the cloud-sd label next to the simulated one. JSON-ready; ms and tokens/s throughout.

    costs: the replica's (its rtt's mean is replaced by each of rtts_ms, its jitter and distribution kept).
    profiles: label -> profile, e.g. {"target": ..., "cloud-sd": ..., "sd-block": ..., "sprinter-exact": ...}.
    requests: generations per edge, back to back; itl: the ITL definition (module docstring).
    """
    cloud = [label for label, p in profiles.items() if p.traits.cloud_drafts]
    rows, formula = [], []
    for rtt in rtts_ms:
        at_rtt = replace(costs, rtt=replace(costs.rtt, mean_ms=float(rtt)))
        capacity: dict[str, int] = {}
        for label, profile in profiles.items():
            by_edges = [run_fleet(at_rtt, profile, n, 1, seed, tokens_per_request=tokens_per_request, requests=requests)
                        for n in edges]
            capacity[label], best = max_edges_at_itl(at_rtt, profile, itl_p99_ms, e_max=e_max, seed=seed,
                                                     tokens_per_request=tokens_per_request, requests=requests, itl=itl)
            rows.append({"label": label, "mode": profile.mode, "profile": profile.name, "rtt_ms": float(rtt),
                         "edges": list(edges),
                         "tokens_per_s_per_user": [r.tokens_per_s_mean for r in by_edges],
                         "itl_ms_p99": [itl_p99(r, itl) for r in by_edges],
                         "edges_at_itl": capacity[label],
                         "tokens_per_s_per_user_at_itl": best.tokens_per_s_mean if best else None})
        for cloud_label in cloud:
            terms = formula_ratio(at_rtt, profiles[cloud_label], capacity[cloud_label])
            cloud_record = (profiles[cloud_label].block_lengths, profiles[cloud_label].emitted)
            for label, profile in profiles.items():  # the formula's premise: the same rounds, drafted elsewhere
                if profile.traits.placeable and (profile.block_lengths, profile.emitted) == cloud_record:
                    simulated = capacity[label] / capacity[cloud_label] if capacity[cloud_label] else None
                    formula.append({"rtt_ms": float(rtt), "edge_label": label, "cloud_label": cloud_label,
                                    **terms, "simulated": simulated})
    return {"itl_p99_ms": itl_p99_ms, "itl": itl, "tokens_per_request": tokens_per_request, "requests": requests,
            "seed": seed, "e_max": e_max, "rows": rows, "formula": formula}
