"""A sweep's summary: one row per (rtt, method, pipeline), pooled from its requests and their judged quality.

tokens_per_s is total tokens / total client wall time (what a user of the API gets, link and
prompt processing included); itl_ms pools the gaps between consecutive tokens of every request,
from the edge's token emission times (`stats.token_times_ms`; the client's SSE arrival times when
the daemon does not send them); ttft_ms is measured at the client. The pipeline columns
(edge/decoding/pipeline.py) pool the edge's stats: ahead_hit_rate = verdicts that picked a drafted-ahead block /
verdicts that had one (None when nothing was drafted ahead), candidate_hits = sent candidates the cloud
verified without a round trip (summed over the requests), uplink_bytes_per_token = verify and
candidate frames the edge wrote / tokens (None when the daemon does not count them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.spec.modes import MODES, mode_of
from common.stats import mean, oracle_calls_per_token, percentile
from sim.sweep.quality import Quality
from sim.sweep.results import pipeline_of, result_key
from sim.sweep.settings import PIPELINES

# The reference (target) first, then as modes.py lists them: target, draft, sd, sd-block, sprinter, sprinter-exact.
MODE_ORDER = tuple(sorted(MODES, key=lambda name: not mode_of(name).reference))


def mode_rank(mode: str) -> int:
    return MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER)


def pipeline_rank(pipeline: str) -> int:
    return PIPELINES.index(pipeline) if pipeline in PIPELINES else len(PIPELINES)


@dataclass
class SummaryRow:
    rtt_ms: float
    mode: str
    pipeline: str  # edge/decoding/pipeline.py: off, ahead, send-ahead
    requests: int
    tokens: int
    tokens_per_s: float
    target_calls_per_token: float
    tokens_per_call: float | None
    block_length_mean: float | None
    ttft_ms_p50: float | None
    itl_ms_p50: float | None
    itl_ms_p99: float | None
    target_nll_per_token: float | None
    agreement_with_target: float | None
    exact_match_rate: float | None
    degraded: int
    oracle_calls_per_token: float | None = None  # the hindsight oracle's: hindsight_calls_per_token
    ahead_hit_rate: float | None = None
    candidate_hits: int = 0
    uplink_bytes_per_token: float | None = None
    engine: str = ""  # what computed the target's rows: the cloud's engine, or the baseline's program


def nearest_rank(values: list[float], q: float) -> float | None:
    """common.stats' nearest-rank percentile, as a float (as the fleet simulator's are)."""
    value = percentile(values, q)
    return None if value is None else float(value)


def token_gaps_ms(record: dict[str, Any]) -> list[float]:
    stats = record["sprinter"].get("stats", {})
    times = stats.get("token_times_ms") or record.get("client_event_ms") or []
    return [b - a for a, b in zip(times, times[1:])]


def _calls(record: dict[str, Any]) -> tuple[list[int], int]:
    """(block lengths of every call, number of calls); block lengths may be unknown (empty)."""
    s = record["sprinter"]
    stats = s.get("stats", {})
    calls = int(s.get("target_calls") or 0)
    blocks = stats.get("block_lengths")
    if blocks is None and s.get("block_length_mean") is not None and mode_of(record["mode"]).drafts:
        blocks = [s["block_length_mean"]] * calls  # older daemons: the mean, weighted by calls
    return list(blocks or []), calls


def _engine(record: dict[str, Any]) -> str:
    """What computed the target's rows for this row: a mode that never calls the cloud (draft) had none."""
    if record["mode"] in MODES and not mode_of(record["mode"]).uses_cloud:
        return "-"
    return record.get("engine", "")


def _pipeline_columns(group: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    """ahead_hit_rate, candidate_hits, uplink_bytes_per_token, pooled over the group's requests."""
    stats = [r["sprinter"].get("stats", {}) for r in group]
    rounds = sum(s.get("ahead_rounds") or 0 for s in stats)
    uplink = sum(s.get("uplink_bytes") or 0 for s in stats)
    return {"ahead_hit_rate": sum(s.get("ahead_hits") or 0 for s in stats) / rounds if rounds else None,
            "candidate_hits": sum(s.get("candidate_hits") or 0 for s in stats),
            "uplink_bytes_per_token": uplink / tokens if uplink and tokens else None}


def _sort_key(key: tuple[float, str, str]) -> tuple:
    rtt, mode, pipeline = key
    return rtt, mode_rank(mode), mode, pipeline_rank(pipeline)


def hindsight_calls_per_token(group: list[dict[str, Any]], tokens: int) -> float | None:
    """The hindsight oracle's calls per token on these requests' acceptance record (common.stats), with the
    calls no verifier decides counted as they are: a session's open that samples the first token is a target
    call in every mode (target_calls less the verified blocks), so the ratio of a mode's calls to this one
    compares only what its verifier and policy chose. From a handful of requests it is a rough estimate."""
    stats = [r["sprinter"].get("stats", {}) for r in group]
    called = [g for s in stats for g in s.get("block_lengths") or []]
    accepted = [n for s in stats for n in s.get("accepted_lengths") or []]
    rate = oracle_calls_per_token(called, accepted) if called else None
    if rate is None or not tokens:
        return None
    opens = sum(max(0, int(r["sprinter"].get("target_calls") or 0) - len(s.get("block_lengths") or []))
                for r, s in zip(group, stats))
    return (opens + rate * max(0, tokens - opens)) / tokens


def summarize(records: list[dict[str, Any]], quality: dict[tuple, Quality]) -> list[SummaryRow]:
    groups: dict[tuple[float, str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["rtt_ms"], r["mode"], pipeline_of(r)), []).append(r)
    rows = []
    for (rtt, mode, pipeline), group in sorted(groups.items(), key=lambda kv: _sort_key(kv[0])):
        tokens = sum(r["completion_tokens"] for r in group)
        wall_s = sum(r["wall_ms"] for r in group) / 1e3
        blocks, calls = [], 0
        for r in group:
            b, c = _calls(r)
            blocks += b
            calls += c
        gaps = [g for r in group for g in token_gaps_ms(r)]
        judged = [(r, quality[result_key(r)]) for r in group if result_key(r) in quality]
        # NLL per token over the group's tokens, not per request: a long output weighs more
        nll_sum = weight = 0.0
        for r, q in judged:
            if q.target_nll_per_token is not None:
                nll_sum += q.target_nll_per_token * r["completion_tokens"]
                weight += r["completion_tokens"]
        agreements = [q.agreement_with_target for _, q in judged if q.agreement_with_target is not None]
        exact = [float(q.exact_match) for _, q in judged if q.exact_match is not None]
        rows.append(SummaryRow(
            rtt_ms=rtt, mode=mode, pipeline=pipeline, requests=len(group), tokens=tokens,
            tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
            target_calls_per_token=calls / tokens if tokens else 0.0,
            tokens_per_call=tokens / calls if calls else None,
            block_length_mean=mean(blocks),
            ttft_ms_p50=nearest_rank([r["ttft_ms"] for r in group if r["ttft_ms"] is not None], 0.5),
            itl_ms_p50=nearest_rank(gaps, 0.5), itl_ms_p99=nearest_rank(gaps, 0.99),
            target_nll_per_token=nll_sum / weight if weight else None,
            agreement_with_target=mean(agreements),
            exact_match_rate=mean(exact),
            degraded=sum(bool(r["degraded"]) for r in group),
            oracle_calls_per_token=hindsight_calls_per_token(group, tokens), engine=_engine(group[0]),
            **_pipeline_columns(group, tokens)))
    return rows
