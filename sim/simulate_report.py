"""The report of a sweep: one summary row per (rtt, mode), summary.csv / summary.md, and PNG plots.

tokens_per_s is total tokens / total client wall time (what a user of the API gets, link and
prompt processing included); itl_ms pools the gaps between consecutive tokens of every request,
from the edge's token emission times (`stats.token_times_ms`; the client's SSE arrival times when
the daemon does not send them); ttft_ms is measured at the client.
"""

from __future__ import annotations

import csv
import logging
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from common.stats import oracle_calls_per_token
from sim.simulate import SimulateSettings
from sim.simulate_quality import Quality
from sim.simulate_run import result_key

log = logging.getLogger(__name__)

LOSSLESS = ("target", "sd", "sd-block", "sprinter-exact")
MODE_ORDER = ("target", "draft", "sd", "sd-block", "sprinter", "sprinter-exact")  # reference first, as the design lists them


def mode_rank(mode: str) -> int:
    return MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER)


@dataclass
class SummaryRow:
    rtt_ms: float
    mode: str
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
    oracle_calls_per_token: float | None = None  # a perfect verifier's call rate on this run's acceptance record


def nearest_rank(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile, as common.stats and the fleet simulator compute theirs."""
    if not values:
        return None
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))])


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
    if blocks is None and s.get("block_length_mean") is not None and record["mode"] != "target":
        blocks = [s["block_length_mean"]] * calls  # older daemons: the mean, weighted by calls
    return list(blocks or []), calls


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(records: list[dict[str, Any]], quality: dict[tuple, Quality]) -> list[SummaryRow]:
    groups: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["rtt_ms"], r["mode"]), []).append(r)
    rows = []
    for (rtt, mode), group in sorted(groups.items(), key=lambda kv: (kv[0][0], mode_rank(kv[0][1]), kv[0][1])):
        tokens = sum(r["completion_tokens"] for r in group)
        wall_s = sum(r["wall_ms"] for r in group) / 1e3
        blocks, calls = [], 0
        accepted = [n for r in group for n in r["sprinter"].get("stats", {}).get("accepted_lengths") or []]
        called = [g for r in group for g in r["sprinter"].get("stats", {}).get("block_lengths") or []]
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
            rtt_ms=rtt, mode=mode, requests=len(group), tokens=tokens,
            tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
            target_calls_per_token=calls / tokens if tokens else 0.0,
            tokens_per_call=tokens / calls if calls else None,
            block_length_mean=_mean(blocks),
            ttft_ms_p50=nearest_rank([r["ttft_ms"] for r in group if r["ttft_ms"] is not None], 0.5),
            itl_ms_p50=nearest_rank(gaps, 0.5), itl_ms_p99=nearest_rank(gaps, 0.99),
            target_nll_per_token=nll_sum / weight if weight else None,
            agreement_with_target=_mean(agreements),
            exact_match_rate=_mean(exact),
            degraded=sum(bool(r["degraded"]) for r in group),
            oracle_calls_per_token=oracle_calls_per_token(called, accepted) if called else None))
    return rows


# --- files ---------------------------------------------------------------------------------------

def write_csv(rows: list[SummaryRow], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[f.name for f in fields(SummaryRow)])
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)


def read_csv(path: Path) -> list[SummaryRow]:
    def parse(name: str, text: str) -> Any:
        if text == "":
            return None
        return text if name == "mode" else int(text) if name in ("requests", "tokens", "degraded") else float(text)

    with open(path, newline="") as f:
        return [SummaryRow(**{k: parse(k, v) for k, v in row.items()}) for row in csv.DictReader(f)]


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def markdown_table(rows: list[SummaryRow]) -> str:
    lines = ["| RTT ms | mode | tokens/s | target calls/token | tokens/call | block length | TTFT p50 ms "
             "| ITL p50 ms | ITL p99 ms | target NLL/token | agreement | exact match | degraded | oracle calls/token |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.rtt_ms:g} | {r.mode} | {_fmt(r.tokens_per_s, 2)} | {_fmt(r.target_calls_per_token, 3)} | "
                     f"{_fmt(r.tokens_per_call, 2)} | {_fmt(r.block_length_mean, 2)} | {_fmt(r.ttft_ms_p50, 0)} | "
                     f"{_fmt(r.itl_ms_p50, 1)} | {_fmt(r.itl_ms_p99, 1)} | {_fmt(r.target_nll_per_token, 3)} | "
                     f"{_fmt(r.agreement_with_target, 3)} | {_fmt(r.exact_match_rate, 2)} | {r.degraded} | "
                     f"{_fmt(r.oracle_calls_per_token, 3)} |")
    return "\n".join(lines)


def speedup_lines(rows: list[SummaryRow]) -> list[str]:
    """tokens/s of the sprinter modes over sd's, per RTT."""
    speed = {(r.rtt_ms, r.mode): r.tokens_per_s for r in rows}
    lines = []
    for rtt in sorted({r.rtt_ms for r in rows}):
        sd = speed.get((rtt, "sd"))
        parts = [f"{mode}/sd {speed[(rtt, mode)] / sd:.2f}x" for mode in ("sprinter", "sprinter-exact")
                 if sd and (rtt, mode) in speed]
        if parts:
            lines.append(f"- RTT {rtt:g} ms: " + ", ".join(parts))
    return lines


def summary_markdown(settings: SimulateSettings, rows: list[SummaryRow]) -> str:
    link = f"jitter {settings.jitter_ms:g} ms ({settings.jitter_distribution})" if settings.jitter_ms else "no jitter"
    link += f", {settings.bandwidth_mbps:g} Mbit/s" if settings.bandwidth_mbps else ", unlimited bandwidth"
    link += f", loss {settings.loss:g}" if settings.loss else ""
    header = (f"Network sweep: target {settings.target}, draft {settings.draft}, verifier {settings.verifier}, "
              f"{settings.dtype}, T={settings.temperature:g}, {settings.limit} prompts x {settings.max_new_tokens} "
              f"tokens, {link}, CPUs {'pinned (cloud one core, edge another)' if settings.pin_cpus else 'shared'}.")
    parts = [header, "", markdown_table(rows)]
    speedups = speedup_lines(rows)
    if speedups:
        parts += ["", "tokens/s relative to sd:", *speedups]
    lossy = sorted({r.mode for r in rows if r.exact_match_rate is not None and r.mode.partition("@")[0] in LOSSLESS
                    and r.exact_match_rate < 1.0})
    if lossy:
        parts += ["", f"Lossless modes below 100% exact match: {', '.join(lossy)} "
                      f"({'expected in bfloat16: see README, Exactness' if settings.dtype == 'bfloat16' else 'a bug: float32 should match'})."]
    return "\n".join(parts) + "\n"


def write_report(settings: SimulateSettings, records: list[dict[str, Any]],
                 quality: dict[tuple, Quality]) -> dict[str, Path]:
    from sim.simulate_plots import plot_all

    out = settings.out
    rows = summarize(records, quality)
    write_csv(rows, out / "summary.csv")
    (out / "summary.md").write_text(summary_markdown(settings, rows))
    written = {"results": out / "results.jsonl", "summary_csv": out / "summary.csv", "summary_md": out / "summary.md"}
    for path in plot_all(rows, records, out):
        written[path.stem] = path
    return written


def format_summary(out: Path) -> str:
    return (out / "summary.md").read_text() if (out / "summary.md").exists() else ""


def itl_rtt(rows: list[SummaryRow]) -> float | None:
    """The RTT whose inter-token latencies are plotted: 50 ms if swept, else the middle one."""
    rtts = sorted({r.rtt_ms for r in rows})
    if not rtts:
        return None
    return 50.0 if 50.0 in rtts else rtts[len(rtts) // 2]


def gaps_by_mode(records: list[dict[str, Any]], rtt: float) -> dict[str, np.ndarray]:
    gaps: dict[str, list[float]] = {}
    for r in records:
        if r["rtt_ms"] == rtt:
            gaps.setdefault(r["mode"], []).extend(token_gaps_ms(r))
    return {mode: np.sort(np.asarray(v)) for mode, v in gaps.items() if v}
