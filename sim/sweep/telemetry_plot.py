"""OUT/telemetry.png: what the fleet plane saw during the sweep (OUT/telemetry.jsonl, sim.sweep.telemetry).

Four panels over time: the edge's tokens/s and target calls per token (its telemetry), the cloud's
open sessions and queue depth, and its verify time p50 (its load announcements). The background
is shaded by the method being measured, with a line and a label where the RTT changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.fleet_plane.messages import CloudLoad, EdgeTelemetry
from common.lab.plots import saved_figure
from sim.sweep.settings import base_mode
from sim.sweep.summary import mode_rank
from sim.sweep.telemetry import TELEMETRY_FILE, TELEMETRY_INTERVAL_S, read_telemetry

if TYPE_CHECKING:  # matplotlib is the optional `bench` extra: imported only when drawing
    from matplotlib.axes import Axes

PLOT_FILE = "telemetry.png"


@dataclass(frozen=True)
class PhaseSpan:
    start: float  # seconds since the first message
    end: float
    rtt_ms: float
    mode: str


def phase_spans(lines: list[dict[str, Any]], t0: float) -> list[PhaseSpan]:
    """Runs of consecutive messages that arrived in one phase, each until the next run's first message.

    Phases are known only through the messages, so a boundary is placed within one report interval.
    """
    spans: list[PhaseSpan] = []
    current: tuple[Any, Any] | None = None
    start = 0.0
    for line in lines:
        phase, at = (line.get("rtt_ms"), line.get("mode")), line["received"] - t0
        if phase != current:
            if current is not None and current[1] is not None:
                spans.append(PhaseSpan(start, at, float(current[0]), str(current[1])))
            current, start = phase, at
    if current is not None and current[1] is not None:  # the last run: at least half a report wide, to be seen
        end = max(lines[-1]["received"] - t0, start + TELEMETRY_INTERVAL_S / 2)
        spans.append(PhaseSpan(start, end, float(current[0]), str(current[1])))
    return spans


def _series(lines: list[dict[str, Any]], t0: float, field: str) -> tuple[list[float], list[float]]:
    """(seconds, values) of one numeric field; null becomes NaN (a gap in the line)."""
    xs = [line["received"] - t0 for line in lines]
    ys = [float(v) if isinstance(v := line.get(field), (int, float)) else math.nan for line in lines]
    return xs, ys


def _calls_per_token(lines: list[dict[str, Any]], t0: float) -> tuple[list[float], list[float]]:
    # An interval in which no request finished reports 0 calls per token: a gap, not a perfect score.
    xs, ys = _series(lines, t0, "target_calls_per_token")
    return xs, [y if line.get("tokens_per_s") else math.nan for line, y in zip(lines, ys)]


def _shade(axes: list[Axes], spans: list[PhaseSpan], colors: dict[str, str]) -> None:
    """Background by method; a dashed line and a label where the RTT changes."""
    previous_rtt = None
    for span in spans:
        for ax in axes:
            ax.axvspan(span.start, span.end, color=colors[span.mode], alpha=0.18, linewidth=0)
        if span.rtt_ms != previous_rtt:
            for ax in axes:
                ax.axvline(span.start, color="0.4", linestyle="--", linewidth=0.8)
            axes[0].annotate(f"RTT {span.rtt_ms:g} ms", (span.start, 1.0), xycoords=("data", "axes fraction"),
                             xytext=(2, -2), textcoords="offset points", va="top", fontsize=7)
            previous_rtt = span.rtt_ms


def plot_telemetry(out: Path) -> Path | None:
    """Draw OUT/telemetry.png from OUT/telemetry.jsonl; None (and no file) when nothing was recorded."""
    lines = sorted(read_telemetry(out / TELEMETRY_FILE), key=lambda line: line["received"])
    edge = [line for line in lines if line.get("schema") == EdgeTelemetry.SCHEMA]
    cloud = [line for line in lines if line.get("schema") == CloudLoad.SCHEMA]
    if not edge and not cloud:
        return None
    t0 = lines[0]["received"]
    spans = phase_spans(lines, t0)
    methods = sorted({s.mode for s in spans}, key=lambda m: (mode_rank(base_mode(m)), m))
    colors = {mode: f"C{i % 10}" for i, mode in enumerate(methods)}
    with saved_figure(out / PLOT_FILE, 4, 1, rect=(0, 0, 1, 0.93), figsize=(9, 9), sharex=True) as (fig, axes):
        axes[0].plot(*_series(edge, t0, "tokens_per_s"), marker=".", color="k")
        axes[0].set_ylabel("edge tokens/s")
        axes[1].plot(*_calls_per_token(edge, t0), marker=".", color="k")
        axes[1].set_ylabel("target calls / token")
        axes[2].step(*_series(cloud, t0, "open_sessions"), where="post", color="k", label="open sessions")
        axes[2].step(*_series(cloud, t0, "queue_depth"), where="post", color="tab:red", label="queue depth")
        axes[2].set_ylabel("cloud sessions")
        axes[2].legend(fontsize=7, loc="upper right")
        axes[3].plot(*_series(cloud, t0, "verify_ms_p50"), marker=".", color="k")
        axes[3].set(ylabel="cloud verify ms p50", xlabel="seconds since the first message")
        _shade(list(axes), spans, colors)
        for ax in axes:
            ax.grid(True, alpha=0.3)
        if methods:
            from matplotlib.patches import Patch

            fig.legend(handles=[Patch(color=colors[m], alpha=0.4, label=m) for m in methods], loc="upper center",
                       bbox_to_anchor=(0.5, 0.97), ncol=min(len(methods), 6), fontsize=8, frameon=False)
        fig.suptitle("Fleet plane telemetry during the sweep (background: the method measured)", y=0.995, fontsize=10)
    return out / PLOT_FILE
