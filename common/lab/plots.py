"""Plots are files: matplotlib on its non-interactive backend, imported only by code that draws.

    with saved_figure(out / "plot.png", 1, 2, figsize=(10, 4)) as (fig, axes):
        axes[0].plot(...)                 # laid out tight, saved and closed when the block ends
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any


def pyplot() -> ModuleType:
    """`matplotlib.pyplot` on the Agg backend (no display on a server); matplotlib is the `bench` extra."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextmanager
def saved_figure(path: Path, rows: int = 1, columns: int = 1, dpi: int = 120,
                 rect: tuple[float, float, float, float] | None = None, **subplots: Any) -> Iterator[tuple[Any, Any]]:
    """A figure of rows x columns axes (`plt.subplots`' keywords pass on) that the block draws on; laid out tight
    (within `rect`), written to `path` and closed when it ends. A block that raises writes nothing."""
    plt = pyplot()
    fig, axes = plt.subplots(rows, columns, **subplots)
    try:
        yield fig, axes
        fig.tight_layout(**({"rect": rect} if rect else {}))
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def grouped_bars(ax: Any, groups: list[str], bars: dict[str, list[float]], **ticks: Any) -> None:
    """A bar per entry of `bars` (label -> a value per group) in each group, side by side, each group's name under its
    middle (`ticks`: the tick labels' keywords: rotation, fontsize)."""
    width = 0.8 / max(1, len(bars))
    for i, (label, values) in enumerate(bars.items()):
        ax.bar([x + i * width for x in range(len(groups))], values, width, label=label)
    ax.set_xticks([x + width * (len(bars) - 1) / 2 for x in range(len(groups))], groups, **ticks)
