"""Plots are files: matplotlib on its non-interactive backend, imported only by code that draws."""

from __future__ import annotations

from types import ModuleType


def pyplot() -> ModuleType:
    """`matplotlib.pyplot` on the Agg backend (no display on a server); matplotlib is the `bench` extra."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
