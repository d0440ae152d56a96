"""The sweep's PNG plots: tokens/s vs RTT, target calls per token, quality vs cloud cost, ITL CDF."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from common.plots import pyplot
from sim.sweep.summary import SummaryRow, mode_rank, token_gaps_ms

if TYPE_CHECKING:  # matplotlib is the optional `bench` extra: imported only when drawing
    from matplotlib.figure import Figure


def _modes(rows: list[SummaryRow]) -> list[str]:
    return sorted({r.mode for r in rows}, key=lambda m: (mode_rank(m), m))


def _color(mode: str) -> str:  # the same colour for a mode in every plot
    return f"C{mode_rank(mode)}"


def _series(rows: list[SummaryRow], mode: str, metric: str) -> tuple[list[float], list[float]]:
    points = sorted((r.rtt_ms, getattr(r, metric)) for r in rows if r.mode == mode and getattr(r, metric) is not None)
    return [x for x, _ in points], [y for _, y in points]


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


def plot_all(rows: list[SummaryRow], records: list[dict[str, Any]], out: Path) -> list[Path]:
    plt = pyplot()
    paths = []

    def save(fig: Figure, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        paths.append(out / name)

    modes = _modes(rows)
    def per_rtt(metric: str, ylabel: str, title: str, name: str) -> None:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for mode in modes:
            xs, ys = _series(rows, mode, metric)
            ax.plot(xs, ys, marker="o", color=_color(mode), label=mode)
        ax.set(xlabel="round-trip time (ms)", ylabel=ylabel, title=title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, name)

    per_rtt("tokens_per_s", "tokens/s (client wall time)", "Speed vs network latency", "tokens_per_s_vs_rtt.png")
    per_rtt("target_calls_per_token", "target calls per token", "Cloud calls per generated token",
            "target_calls_per_token.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in modes:
        points = [(r.target_calls_per_token, r.target_nll_per_token) for r in rows
                  if r.mode == mode and r.target_nll_per_token is not None]
        if points:
            ax.scatter(*zip(*points), color=_color(mode), label=mode)
    ax.set(xlabel="cloud cost: target calls per token", ylabel="target NLL per token (nats, lower is better)",
           title="Quality vs cloud cost (one point per RTT)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, "quality_vs_cloud_cost.png")

    rtt = itl_rtt(rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if rtt is not None:
        by_mode = gaps_by_mode(records, rtt)
        for mode in (m for m in modes if m in by_mode):
            gaps = by_mode[mode]
            ax.step(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], where="post", color=_color(mode), label=mode)
        ax.set_xscale("symlog", linthresh=1.0)  # many gaps are 0 (a block released at once), some are round trips
        ax.set_title(f"Inter-token latency CDF at RTT {rtt:g} ms")
    ax.set(xlabel="gap between consecutive tokens (ms)", ylabel="fraction of gaps")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, "itl_cdf.png")
    return paths
