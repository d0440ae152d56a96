"""bench capacity's arithmetic: what the edges saw, summed into rows; edges per replica; the prediction; table, plot.

Pure: no model, no network (sim/bench/capacity.py measures and calls these).

Inter-token latency (ITL), per token: each release of n tokens at the edge (a Generate chunk, a verdict's
n_accepted + 1 tokens) after a gap g since the previous release of the same generation gives n samples of
g / n. The first release (time to first token) gives none. This is the time per output token within a round,
vLLM's TPOT taken per release: the samples of a generation add up to its decode time, whether it streams a
token a chunk (target), a round a chunk (cloud-sd) or a verdict a round (sd-block), so the modes compare on
one scale. The gap between releases themselves (vLLM's ITL: a round counted once) is kept too, as
`release_gap_p99_ms`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.lab.plots import saved_figure
from common.stats import percentile
from common.table_cells import cell


@dataclass
class GenerationTrace:
    """One generation as its edge saw it: when it started (before any RTT) and each release (time, tokens)."""

    started: float
    releases: list[tuple[float, int]] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)  # per round (speculative modes): draft tokens proposed
    draft_ms: list[float] = field(default_factory=list)  # cloud-sd, per round: the cloud's drafting (chunk draft_ms)
    verify_ms: dict[int, list[float]] = field(default_factory=dict)  # session modes: batch size -> verdict verify_ms
    diverged: int = 0  # replayed rounds whose verdict was not the recorded one

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.releases)

    @property
    def ended(self) -> float:
        return self.releases[-1][0] if self.releases else self.started


def replayed_length(kept: int, drafted: int, cut_at_rejection: bool) -> int:
    """The length of the block an edge replays for a recorded round of `kept` tokens (the accepted ones and the
    target's) and `drafted` draft tokens (sim/bench/capacity.py replay_block): the count drafted (at least 1), or
    with `cut_at_rejection` (sprinter-exact) the accepted tokens and the rejected one when a token was rejected."""
    length, accepted = max(1, drafted), kept - 1
    return accepted + 1 if cut_at_rejection and accepted < length else length


def itl_samples(trace: GenerationTrace) -> tuple[list[float], list[float]]:
    """(per-token ITL samples ms, release gaps ms) of one generation (module docstring)."""
    per_token, gaps = [], []
    for (before, _), (at, n) in zip(trace.releases, trace.releases[1:]):
        gap = (at - before) * 1e3
        gaps.append(gap)
        per_token += [gap / n] * n
    return per_token, gaps


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _cloud_side(increases: dict[str, float]) -> dict[str, float | None]:
    """The replica's own forwards over the point, from its Prometheus metrics' increases."""
    d = lambda name: increases.get(name, 0.0)  # noqa: E731
    target_n, draft_n = d("sprinter_cloud_target_forward_seconds_count"), d("sprinter_cloud_draft_forward_seconds_count")
    per = lambda total, n: total / n if n else None  # noqa: E731
    return {"target_forwards": target_n,
            "target_forward_ms": per(d("sprinter_cloud_target_forward_seconds_sum") * 1e3, target_n),
            "target_batch_mean": per(d("sprinter_cloud_batch_size_sum"), target_n),
            "target_tokens_mean": per(d("sprinter_cloud_forward_tokens_sum"), target_n),
            "draft_forwards": draft_n,
            "draft_forward_ms": per(d("sprinter_cloud_draft_forward_seconds_sum") * 1e3, draft_n),
            # draft steps (one a drafted token) per draft forward; the prompts' prefill forwards count as forwards
            "draft_batch_mean": per(d("sprinter_cloud_draft_tokens_total"), draft_n)}


def summarise(mode: str, edges: int, rtt_ms: float, k: int, per_edge: list[list[GenerationTrace]],
              cloud_metrics: dict[str, float]) -> dict[str, Any]:
    """One (mode, edges, RTT) point: a results row (sim/bench/capacity.py's docstring lists its fields)."""
    traces = [t for generations in per_edge for t in generations]
    per_token, gaps = [], []
    for trace in traces:
        samples, between = itl_samples(trace)
        per_token += samples
        gaps += between
    user_rates = [sum(t.tokens for t in g) / (g[-1].ended - g[0].started) for g in per_edge if g and g[-1].ended > g[0].started]
    elapsed = max(t.ended for t in traces) - min(t.started for t in traces)
    rounds = sum(len(t.releases) for t in traces)
    tokens = sum(t.tokens for t in traces)
    drafted = [d for t in traces for d in t.drafted]
    draft_ms = [ms / d for t in traces for ms, d in zip(t.draft_ms, t.drafted) if d]
    by_batch: dict[int, list[float]] = {}
    for trace in traces:
        for b, ms in trace.verify_ms.items():
            by_batch.setdefault(b, []).extend(ms)
    accepted = tokens - rounds if drafted else None  # a speculative round releases its accepted tokens and one more
    return {"mode": mode, "edges": edges, "rtt_ms": rtt_ms, "k": k, "generations": len(traces), "tokens": tokens,
            "elapsed_s": round(elapsed, 3), "tokens_per_s_per_user": _mean(user_rates),
            "tokens_per_s_total": tokens / elapsed if elapsed > 0 else None,
            "itl_ms_mean": _mean(per_token), "itl_ms_p50": percentile(per_token, 0.5),
            "itl_ms_p90": percentile(per_token, 0.9), "itl_ms_p99": percentile(per_token, 0.99),
            "release_gap_p99_ms": percentile(gaps, 0.99),
            "ttft_ms_p50": percentile([(t.releases[0][0] - t.started) * 1e3 for t in traces if t.releases], 0.5),
            "rounds": rounds, "tokens_per_round": tokens / rounds if rounds else None,
            "drafted_per_round": _mean(drafted), "acceptance": accepted / sum(drafted) if drafted and sum(drafted) else None,
            "draft_ms_per_token_seen": _mean(draft_ms),
            "verify_ms_by_batch": {str(b): statistics.median(ms) for b, ms in sorted(by_batch.items())},
            "diverged_rounds": sum(t.diverged for t in traces),
            "cloud": _cloud_side(cloud_metrics)}


def edges_per_replica(rows: list[dict[str, Any]], mode: str, itl_p99_ms: float, rtt_ms: float = 0.0) -> int | None:
    """The largest edge count at which `mode`'s per-token ITL p99 stays within `itl_p99_ms` (None: not even one)."""
    fits = [r["edges"] for r in rows if r["mode"] == mode and r["rtt_ms"] == rtt_ms
            and r["itl_ms_p99"] is not None and r["itl_ms_p99"] <= itl_p99_ms]
    return max(fits, default=None)


def itl_target(rows: list[dict[str, Any]], reference_mode: str, factor: float) -> float | None:
    """`factor` x the reference mode's single-edge per-token ITL p99 at RTT 0 (None: that row was not measured)."""
    single = next((r for r in rows if r["mode"] == reference_mode and r["edges"] == 1 and r["rtt_ms"] == 0), None)
    return factor * single["itl_ms_p99"] if single and single["itl_ms_p99"] else None


def _row(rows: list[dict[str, Any]], mode: str, edges: int | None) -> dict[str, Any] | None:
    return next((r for r in rows if r["mode"] == mode and r["edges"] == edges and r["rtt_ms"] == 0), None)


def prediction(rows: list[dict[str, Any]], cloud_mode: str, edge_mode: str, itl_p99_ms: float) -> dict[str, Any]:
    """(1 + gamma t_d / t_v) from cloud_mode's rows at RTT 0, against the measured ratio of edges per replica.

    gamma: draft tokens per round; t_d: one draft forward (the replica's metrics), t_v: one target forward, both at
    the cloud-drafting mode's own capacity point (where the ratio is decided), and at one edge for reference."""
    capacity = {m: edges_per_replica(rows, m, itl_p99_ms) for m in (cloud_mode, edge_mode)}
    out: dict[str, Any] = {"cloud_mode": cloud_mode, "edge_mode": edge_mode, "itl_p99_target_ms": itl_p99_ms,
                           "edges_per_replica": capacity}
    for name, edges in (("at_one_edge", 1), ("at_capacity", capacity[cloud_mode])):
        row = _row(rows, cloud_mode, edges)
        cloud = row["cloud"] if row else {}
        t_d, t_v, gamma = cloud.get("draft_forward_ms"), cloud.get("target_forward_ms"), row and row["drafted_per_round"]
        out[name] = ({"edges": edges, "gamma": gamma, "t_d_ms": t_d, "t_v_ms": t_v,
                      "predicted_ratio": 1 + gamma * t_d / t_v} if gamma and t_d and t_v else None)
    a, b = capacity[edge_mode], capacity[cloud_mode]
    out["measured_ratio"] = a / b if a and b else None
    return out


def format_table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    lines = ["| mode | RTT ms | edges | tokens/s per user | ITL p50 ms | ITL p99 ms | tokens/round | acceptance | "
             "target fwd ms (batch) | draft fwd ms (batch) | replica's core share |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["cloud"]
        lines.append(f"| {r['mode']} | {r['rtt_ms']:g} | {r['edges']} | {cell(r['tokens_per_s_per_user'])} | "
                     f"{cell(r['itl_ms_p50'])} | {cell(r['itl_ms_p99'])} | {cell(r['tokens_per_round'], '.2f')} | "
                     f"{cell(r['acceptance'], '.2f')} | {cell(c['target_forward_ms'])} ({cell(c['target_batch_mean'])}) | "
                     f"{cell(c['draft_forward_ms'])} ({cell(c['draft_batch_mean'])}) | "
                     f"{cell(r.get('cloud_cpu_share'), '.0%')} |")
    lines += ["", f"Replaying edges' draft time: {summary['edge_draft_ms']:g} ms a block token.",
              "", f"Edges per replica at per-token ITL p99 <= {summary['itl_p99_target_ms']:.1f} ms (RTT 0; "
              f"{summary['itl_p99_target_basis']}):", "", "| mode | edges per replica |", "|---|---|"]
    lines += [f"| {mode} | {edges if edges is not None else '< 1'} |" for mode, edges in summary["capacity"].items()]
    pred = summary["prediction"]
    for name in ("at_one_edge", "at_capacity"):
        p = pred.get(name)
        if p:
            lines.append(f"\nPredicted edge-drafting gain {name.replace('_', ' ')} (E={p['edges']}): 1 + gamma t_d / t_v = "
                         f"1 + {p['gamma']:.2f} x {p['t_d_ms']:.1f} / {p['t_v_ms']:.1f} = {p['predicted_ratio']:.2f}x")
    lines.append(f"Measured: edges per replica {pred['edge_mode']} / {pred['cloud_mode']} = "
                 f"{cell(pred['measured_ratio'], '.2f')}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Per-user tokens/s against edges per replica: a panel per RTT, a line per mode."""
    rtts = sorted({r["rtt_ms"] for r in rows})
    with saved_figure(path, 1, len(rtts), figsize=(4.5 * len(rtts), 4), squeeze=False) as (fig, axes):
        for ax, rtt in zip(axes[0], rtts):
            for mode in dict.fromkeys(r["mode"] for r in rows):
                series = sorted((r["edges"], r["tokens_per_s_per_user"]) for r in rows
                                if r["mode"] == mode and r["rtt_ms"] == rtt and r["tokens_per_s_per_user"])
                if series:
                    ax.plot(*zip(*series), marker="o", label=mode)
            ax.set_xscale("log", base=2)
            ax.set(xlabel="edges per replica", ylabel="tokens/s per user", title=f"RTT {rtt:g} ms")
            ax.legend(fontsize=7)
