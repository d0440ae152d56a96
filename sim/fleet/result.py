"""What one fleet simulation reports (`FleetResult`), and its comparison with measured runs."""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass, field

import numpy as np

from common.stats import nearest_rank_index

log = logging.getLogger(__name__)


@dataclass
class FleetResult:
    mode: str
    profile: str
    n_edges: int
    n_replicas: int
    seed: int
    tokens_per_request: int
    requests: int | None
    duration_s: float | None
    routing: str
    tokens: int
    sim_s: float  # simulated time until the last token (or the duration)
    tokens_per_s_mean: float  # per edge: its tokens / the wall time of its generations
    tokens_per_s_p50: float
    fleet_tokens_per_s: float  # all edges' tokens / sim_s
    ttft_ms_p50: float | None
    itl_ms_p50: float | None  # gaps between consecutive tokens of a generation, as the user sees them
    itl_ms_p99: float | None
    # a call from send to verdict, a generation's first including the session open (target: from
    # queueing the token's forward to its arrival at the edge)
    call_ms_p50: float | None
    call_ms_p99: float | None
    request_ms_p50: float | None  # one generation of tokens_per_request tokens
    cloud_utilisation: float  # busy fraction of the replicas over sim_s
    cloud_forwards: int
    cloud_forwards_per_token: float
    cloud_batch_size_mean: float | None  # requests per forward, as the cloud's histogram counts it
    target_calls: int
    target_calls_per_token: float
    tokens_per_call: float | None
    wall_s: float = field(default=0.0, compare=False)  # how long the simulation itself took
    # The edges' pipeline (sim.fleet.pipeline): off, ahead or send-ahead, the hit rate it was run with,
    # the fraction of verdicts drafted ahead of that hit, sent candidates the cloud verified with no round
    # trip, and the uplink's bytes (blocks and candidates; prompts not counted) per token.
    pipeline: str = "off"
    hit_rate: float | None = None
    ahead_hit_rate: float | None = None
    candidate_hits: int = 0
    uplink_bytes_per_token: float | None = None
    # cloud-sd: the cloud's draft forwards (cloud_forwards counts the target's) and their mean batch
    cloud_draft_forwards: int = 0
    cloud_draft_batch_size_mean: float | None = None
    # ITL per token (itl_per_token_percentiles): a release of n tokens after a gap g is n samples of g / n, as
    # `sprinter bench capacity` measures it; itl_ms_p50/p99 above count it as one gap of g and n - 1 of 0
    itl_per_token_ms_p50: float | None = None
    itl_per_token_ms_p99: float | None = None


def percentile(values: array, q: float) -> float | None:
    """common.stats.percentile over an array of doubles: the same rank, so simulated and measured percentiles
    compare; sorted by numpy, as a simulated run's samples are too many for sorted() to be cheap."""
    if not len(values):
        return None
    ordered = np.sort(np.frombuffer(values, dtype=float))
    return float(ordered[nearest_rank_index(len(ordered), q)])


def itl_percentiles(step_ms: float, zero_gaps: int, step_gaps: int, other_gaps: array) -> tuple[float | None, float | None]:
    """p50 and p99 of the gaps between tokens: zero_gaps gaps of 0 and step_gaps of one draft step,
    which are only counted (they are most gaps), and other_gaps as measured."""
    values = np.concatenate([[0.0, step_ms], np.frombuffer(other_gaps, dtype=float)])
    counts = np.concatenate([[zero_gaps, step_gaps], np.ones(len(other_gaps))])
    return weighted_percentiles(values, counts)


def itl_per_token_percentiles(step_ms: float, step_gaps: int, other_gaps: array,
                              other_tokens: array) -> tuple[float | None, float | None]:
    """p50 and p99 of the per-token ITL (sim/bench/capacity_report.py's): other_gaps[i], a gap before a release of
    other_tokens[i] tokens, gives that many samples of other_gaps[i] / other_tokens[i]; step_gaps tokens streamed a
    draft step apart give one sample of step_ms each. A generation's first release gives none (it is no gap)."""
    tokens = np.frombuffer(other_tokens, dtype=float)
    values = np.concatenate([[step_ms], np.frombuffer(other_gaps, dtype=float) / np.maximum(tokens, 1.0)])
    return weighted_percentiles(values, np.concatenate([[step_gaps], tokens]))


def weighted_percentiles(values: np.ndarray, counts: np.ndarray) -> tuple[float | None, float | None]:
    """Nearest-rank p50 and p99 of `values`, each repeated counts[i] times (None, None: no samples)."""
    if counts.sum() == 0:
        return None, None
    order = np.argsort(values, kind="stable")
    values, cumulative = values[order], np.cumsum(counts[order])
    return tuple(float(values[np.searchsorted(cumulative, nearest_rank_index(int(cumulative[-1]), q), side="right")])
                 for q in (0.5, 0.99))


def compare_with_measured(predicted: FleetResult, measured: dict, tolerance: float = 0.15) -> dict:
    """Relative errors (predicted - measured) / measured of tokens_per_s and target_calls_per_token.

    `measured` uses the design's names, e.g. a DecodeStats dict or a bench row; tokens_per_s is
    compared with the simulated per-edge mean. `within_tolerance` is True when every error is within it.
    """
    pairs = {"tokens_per_s": predicted.tokens_per_s_mean, "target_calls_per_token": predicted.target_calls_per_token}
    report: dict = {}
    for name, value in pairs.items():
        if measured.get(name):
            report[name] = {"predicted": value, "measured": measured[name],
                            "rel_error": (value - measured[name]) / measured[name]}
    report["tolerance"] = tolerance
    report["within_tolerance"] = bool(report) and all(abs(v["rel_error"]) <= tolerance
                                                      for v in report.values() if isinstance(v, dict))
    return report


def compare_all(results: list[FleetResult], measured_rows: list[dict], tolerance: float = 0.15) -> list[dict]:
    """Each measured row {"mode" or "profile", "edges", "replicas" (1), "pipeline" (off), tokens_per_s,
    target_calls_per_token} against the matching simulated run."""
    rows = []
    for m in measured_rows:
        name = m.get("profile", m.get("mode"))
        match = next((r for r in results if r.profile == name and r.n_edges == m.get("edges", 1)
                      and r.n_replicas == m.get("replicas", 1) and r.pipeline == m.get("pipeline", "off")), None)
        if match is None:
            log.warning("no simulated run for measured row %s", m)
            continue
        rows.append({"profile": name, "pipeline": match.pipeline, "edges": match.n_edges, "replicas": match.n_replicas}
                    | compare_with_measured(match, m, tolerance))
    return rows
