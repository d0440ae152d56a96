"""The sweep's PNG plots: tokens/s vs RTT, target calls per token, quality vs cloud cost, ITL CDF.

One line (or point set) per run, a (mode, pipeline): coloured by mode, styled by pipeline, labelled
'sd-block/send-ahead' (the mode alone when the pipeline is off)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from common.lab.plots import saved_figure
from sim.sweep.results import pipeline_of
from sim.sweep.settings import BASELINES, is_baseline, run_label
from sim.sweep.summary import SummaryRow, mode_rank, pipeline_rank, token_gaps_ms



Run = tuple[str, str]  # (mode, pipeline)
LINE_STYLES = ("-", "--", ":", "-.")


def _runs(rows: list[SummaryRow]) -> list[Run]:
    return sorted({(r.mode, r.pipeline) for r in rows}, key=lambda mp: (mode_rank(mp[0]), mp[0], pipeline_rank(mp[1])))


def _color(mode: str) -> str:  # the same colour for a mode in every plot; the baselines black and grey
    if is_baseline(mode):
        return ("black", "dimgray")[BASELINES.index(mode) % 2]
    return f"C{mode_rank(mode)}"


def _style(run: Run) -> dict[str, str]:
    return {"color": _color(run[0]), "label": run_label(*run)}


def _series(rows: list[SummaryRow], run: Run, metric: str) -> tuple[list[float], list[float]]:
    points = sorted((r.rtt_ms, getattr(r, metric)) for r in rows
                    if (r.mode, r.pipeline) == run and getattr(r, metric) is not None)
    return [x for x, _ in points], [y for _, y in points]


def itl_rtt(rows: list[SummaryRow]) -> float | None:
    """The RTT whose inter-token latencies are plotted: 50 ms if swept, else the middle one."""
    rtts = sorted({r.rtt_ms for r in rows})
    if not rtts:
        return None
    return 50.0 if 50.0 in rtts else rtts[len(rtts) // 2]


def gaps_by_run(records: list[dict[str, Any]], rtt: float) -> dict[Run, np.ndarray]:
    gaps: dict[Run, list[float]] = {}
    for r in records:
        if r["rtt_ms"] == rtt:
            gaps.setdefault((r["mode"], pipeline_of(r)), []).extend(token_gaps_ms(r))
    return {run: np.sort(np.asarray(v)) for run, v in gaps.items() if v}


def plot_all(rows: list[SummaryRow], records: list[dict[str, Any]], out: Path) -> list[Path]:
    runs, paths = _runs(rows), []

    def per_rtt(metric: str, ylabel: str, title: str, name: str) -> None:
        with saved_figure(out / name, figsize=(7, 4.5)) as (_, ax):
            for run in runs:
                xs, ys = _series(rows, run, metric)
                ax.plot(xs, ys, marker="o", linestyle=LINE_STYLES[pipeline_rank(run[1]) % len(LINE_STYLES)], **_style(run))
            ax.set(xlabel="round-trip time (ms)", ylabel=ylabel, title=title)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        paths.append(out / name)

    per_rtt("tokens_per_s", "tokens/s (client wall time)", "Speed vs network latency", "tokens_per_s_vs_rtt.png")
    per_rtt("target_calls_per_token", "target calls per token", "Cloud calls per generated token",
            "target_calls_per_token.png")

    with saved_figure(out / "quality_vs_cloud_cost.png", figsize=(7, 4.5)) as (_, ax):
        markers = ("o", "^", "s", "D")
        for run in runs:
            points = [(r.target_calls_per_token, r.target_nll_per_token) for r in rows
                      if (r.mode, r.pipeline) == run and r.target_nll_per_token is not None]
            if points:
                ax.scatter(*zip(*points), marker=markers[pipeline_rank(run[1]) % len(markers)], **_style(run))
        ax.set(xlabel="cloud cost: target calls per token", ylabel="target NLL per token (nats, lower is better)",
               title="Quality vs cloud cost (one point per RTT)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    paths.append(out / "quality_vs_cloud_cost.png")

    rtt = itl_rtt(rows)
    with saved_figure(out / "itl_cdf.png", figsize=(7, 4.5)) as (_, ax):
        if rtt is not None:
            by_run = gaps_by_run(records, rtt)
            for run in (r for r in runs if r in by_run):
                gaps = by_run[run]
                ax.step(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], where="post",
                        linestyle=LINE_STYLES[pipeline_rank(run[1]) % len(LINE_STYLES)], **_style(run))
            ax.set_xscale("symlog", linthresh=1.0)  # many gaps are 0 (a block released at once), some are round trips
            ax.set_title(f"Inter-token latency CDF at RTT {rtt:g} ms")
        ax.set(xlabel="gap between consecutive tokens (ms)", ylabel="fraction of gaps")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    paths.append(out / "itl_cdf.png")
    return paths
