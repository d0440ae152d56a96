"""A number in a table cell, for the benchmarks' and the operator's plain-text and Markdown tables."""

from __future__ import annotations


def cell(value: float | None, spec: str = ".1f") -> str:
    """`value` formatted by `spec` (a format() spec: ".2f", ",.0f", ".0%"); "-" for a missing value (None)."""
    return "-" if value is None else format(value, spec)
