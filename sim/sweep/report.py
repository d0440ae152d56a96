"""The report of a sweep: summary.csv / summary.md from the summary rows (sim.sweep.summary), and the plots
(telemetry.png too when the fleet plane was recorded)."""

from __future__ import annotations

import csv
import logging
import math
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from common.spec.modes import MODES, mode_of
from common.table_cells import cell
from sim.sweep.plots import plot_all
from sim.sweep.quality import Quality
from sim.sweep.results import pipeline_of
from sim.sweep.settings import SimulateSettings, run_label
from sim.sweep.summary import SummaryRow, summarize
from sim.sweep.telemetry_plot import plot_telemetry

log = logging.getLogger(__name__)


def write_csv(rows: list[SummaryRow], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[f.name for f in fields(SummaryRow)])
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)


def read_csv(path: Path) -> list[SummaryRow]:
    """The rows of a summary.csv; one written before the pipeline columns reads as pipeline off."""
    def parse(name: str, text: str) -> Any:
        if text == "":
            return None
        if name in ("mode", "pipeline", "engine"):
            return text
        return int(text) if name in ("requests", "tokens", "degraded", "candidate_hits") else float(text)

    with open(path, newline="") as f:
        return [SummaryRow(**{"pipeline": "off", **{k: parse(k, v) for k, v in row.items()}}) for row in csv.DictReader(f)]


def _fmt(value: float | None, digits: int) -> str:
    # unlike cell() alone, a NaN shows as missing too: the sweep's tables have always printed it so
    return cell(None if isinstance(value, float) and math.isnan(value) else value, f".{digits}f")


def markdown_table(rows: list[SummaryRow]) -> str:
    lines = ["| RTT ms | mode | engine | pipeline | tokens/s | target calls/token | tokens/call | block length | TTFT p50 ms "
             "| ITL p50 ms | ITL p99 ms | target NLL/token | agreement | exact match | degraded | hindsight-oracle calls/token "
             "| ahead hit rate | candidate hits | uplink bytes/token |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.rtt_ms:g} | {r.mode} | {r.engine or '-'} | {r.pipeline} | {_fmt(r.tokens_per_s, 2)} | "
                     f"{_fmt(r.target_calls_per_token, 3)} | "
                     f"{_fmt(r.tokens_per_call, 2)} | {_fmt(r.block_length_mean, 2)} | {_fmt(r.ttft_ms_p50, 0)} | "
                     f"{_fmt(r.itl_ms_p50, 1)} | {_fmt(r.itl_ms_p99, 1)} | {_fmt(r.target_nll_per_token, 3)} | "
                     f"{_fmt(r.agreement_with_target, 3)} | {_fmt(r.exact_match_rate, 2)} | {r.degraded} | "
                     f"{_fmt(r.oracle_calls_per_token, 3)} | {_fmt(r.ahead_hit_rate, 2)} | {r.candidate_hits} | "
                     f"{_fmt(r.uplink_bytes_per_token, 1)} |")
    return "\n".join(lines)


def speedup_lines(rows: list[SummaryRow]) -> list[str]:
    """tokens/s over sd's (pipeline off), per RTT: the sprinter modes', and every pipelined run's."""
    speed = {(r.rtt_ms, r.mode, r.pipeline): r.tokens_per_s for r in rows}
    lines = []
    for rtt in sorted({r.rtt_ms for r in rows}):
        sd = speed.get((rtt, "sd", "off"))
        # pipeline off: the modes that use a verifier, by their plain names (not a mode@policy method)
        compared = [r for r in rows if r.rtt_ms == rtt
                    and (r.pipeline != "off" or (r.mode in MODES and mode_of(r.mode).uses_verifier))]
        labels = [r.mode if r.pipeline == "off" else f"({run_label(r.mode, r.pipeline)})" for r in compared]
        parts = [f"{label}/sd {r.tokens_per_s / sd:.2f}x" for label, r in zip(labels, compared) if sd]
        if parts:
            lines.append(f"- RTT {rtt:g} ms: " + ", ".join(parts))
    return lines


def category_table(records: list[dict[str, Any]]) -> str:
    """tokens/s (total tokens over total client wall time) per RTT and prompt category, a column per row label:
    where speculation pays depends on the prompt as much as on the link."""
    cells: dict[tuple[float, str, str], list[float]] = {}
    for r in records:
        label = run_label(r["mode"], pipeline_of(r))
        totals = cells.setdefault((r["rtt_ms"], r.get("category") or "-", label), [0.0, 0.0])
        totals[0] += r["completion_tokens"]
        totals[1] += r["wall_ms"] / 1e3
    labels = list(dict.fromkeys(label for _, _, label in cells))
    lines = ["| RTT ms | category | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]
    for rtt, category in sorted({(rtt, category) for rtt, category, _ in cells}):
        values = [cells.get((rtt, category, label)) for label in labels]
        lines.append(f"| {rtt:g} | {category} | " + " | ".join(
            _fmt(v[0] / v[1], 2) if v and v[1] else "-" for v in values) + " |")
    return "\n".join(lines)


def summary_markdown(settings: SimulateSettings, rows: list[SummaryRow],
                     records: list[dict[str, Any]] | None = None) -> str:
    link = f"jitter {settings.jitter_ms:g} ms ({settings.jitter_distribution})" if settings.jitter_ms else "no jitter"
    link += f", {settings.bandwidth_mbps:g} Mbit/s" if settings.bandwidth_mbps else ", unlimited bandwidth"
    link += f", loss {settings.loss:g}" if settings.loss else ""
    numbers = "llama.cpp (the GGUF as shipped)" if settings.engine == "llama.cpp" else settings.dtype
    header = (f"Network sweep: target {settings.target}, draft {settings.draft}, verifier {settings.verifier}, "
              f"{numbers}, T={settings.temperature:g}, {settings.limit} prompts x {settings.max_new_tokens} "
              f"tokens, {link}, CPUs {'pinned (cloud one core, edge another)' if settings.pin_cpus else 'shared'}.")
    parts = [header, "", markdown_table(rows)]
    speedups = speedup_lines(rows)
    if speedups:
        parts += ["", "tokens/s relative to sd (pipeline off):", *speedups]
    against = baseline_lines(rows)
    if against:
        parts += ["", "tokens/s relative to llama-server alone (what a user would run instead, on the cloud's core):",
                  *against]
    if records and len({r.get("category") for r in records}) > 1:
        parts += ["", "tokens/s by prompt category:", "", category_table(records)]
    lossy = sorted({run_label(r.mode, r.pipeline) for r in rows if r.exact_match_rate is not None and r.mode in MODES
                    and mode_of(r.mode).lossless and r.exact_match_rate < 1.0})
    if lossy:
        parts += ["", f"Lossless modes below 100% exact match: {', '.join(lossy)} ({_why_below(settings)})."]
    return "\n".join(parts) + "\n"


def _why_below(settings: SimulateSettings) -> str:
    if settings.engine == "llama.cpp":
        return ("expected on llama.cpp, which is not batch-invariant: a block's rows round differently from its "
                "one-token rows, so near-ties flip; see docs/llama-cpp-engine.md, Exactness")
    if settings.dtype == "bfloat16":
        return "expected in bfloat16: see docs/getting-started.md, Exactness"
    return "a bug: float32 should match"


def baseline_lines(rows: list[SummaryRow]) -> list[str]:
    """Per RTT, every other row's tokens/s over llama-server's (measured at the same RTT, though it has no link)."""
    lines = []
    for rtt in sorted({r.rtt_ms for r in rows}):
        base = next((r.tokens_per_s for r in rows if r.rtt_ms == rtt and r.mode == "llama-server"), None)
        if base:
            parts = [f"{run_label(r.mode, r.pipeline)} {r.tokens_per_s / base:.2f}x" for r in rows
                     if r.rtt_ms == rtt and r.mode != "llama-server"]
            lines.append(f"- RTT {rtt:g} ms: " + ", ".join(parts))
    return lines


def write_report(settings: SimulateSettings, records: list[dict[str, Any]],
                 quality: dict[tuple, Quality]) -> dict[str, Path]:
    out = settings.out
    rows = summarize(records, quality)
    write_csv(rows, out / "summary.csv")
    (out / "summary.md").write_text(summary_markdown(settings, rows, records))
    written = {"results": out / "results.jsonl", "summary_csv": out / "summary.csv", "summary_md": out / "summary.md"}
    for path in plot_all(rows, records, out):
        written[path.stem] = path
    try:
        telemetry = plot_telemetry(out)
    except Exception:  # the fleet plane only watched: its plot must not cost the sweep its report
        log.exception("the telemetry plot failed; the sweep's results and report are unaffected")
        telemetry = None
    if telemetry is not None:
        written["telemetry"] = telemetry
    return written


def format_summary(out: Path) -> str:
    return (out / "summary.md").read_text() if (out / "summary.md").exists() else ""
