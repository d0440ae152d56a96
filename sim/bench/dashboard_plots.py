"""A dashboard's evaluated panels drawn as a grid of time series (two per row, as the dashboards lay them out): a
picture of what the dashboard's own queries show, drawn by matplotlib, not by Grafana."""

from __future__ import annotations

import math
from pathlib import Path

from common.lab.plots import saved_figure
from sim.bench.dashboard_queries import PanelResult

COLUMNS = 2
MOST_LINES = 8  # a panel's legend beyond this says how many more series it draws
# Grafana unit -> (divisor, axis label) so that the axis reads as the panel would.
UNITS = {"percentunit": (0.01, "%"), "s": (1e-3, "ms"), "ms": (1.0, "ms"), "bytes": (2**20, "MiB"),
         "reqps": (1.0, "req/s"), "ops": (1.0, "/s"), "short": (1.0, "")}


def plot_dashboard(title: str, results: list[PanelResult], start: float, end: float, out: Path, caption: str) -> Path:
    """One PNG: every panel of `results` over [start, end], x in seconds from `start`."""
    rows = max(1, math.ceil(len(results) / COLUMNS))
    out.parent.mkdir(parents=True, exist_ok=True)
    with saved_figure(out, rows, COLUMNS, dpi=80, rect=(0, 0, 1, 1 - 0.5 / rows / 2.6), figsize=(13, 2.6 * rows),
                      squeeze=False) as (figure, axes):
        for ax, result in zip(axes.flat, results):
            _draw_panel(ax, result, start)
            ax.set_xlim(0, end - start)
            ax.set_xlabel("s into the recording", fontsize=7)
        for ax in list(axes.flat)[len(results):]:
            ax.set_visible(False)
        figure.suptitle(f"{title}\n{caption}", fontsize=11)
    return out


def _draw_panel(ax, result: PanelResult, start: float) -> None:
    divisor, label = UNITS.get(result.unit, (1.0, result.unit))
    drawn = [s for s in result.series if any(math.isfinite(v) for v in s.values)]
    for series in drawn[:MOST_LINES]:
        ax.plot([t - start for t in series.times], [v / divisor for v in series.values], label=series.name, lw=1.2)
    ax.set_title(f"{result.section}: {result.title}" if result.section else result.title, fontsize=9)
    ax.set_ylabel(label, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if not drawn:
        why = "query error" if result.errors else "no data"
        ax.text(0.5, 0.5, why, transform=ax.transAxes, ha="center", va="center", color="grey")
    elif any(s.name for s in drawn):
        more = len(drawn) - MOST_LINES
        ax.legend(fontsize=6, loc="upper left", title=f"+{more} more" if more > 0 else None, title_fontsize=6)
