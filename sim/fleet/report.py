"""A fleet sweep and its report: every profile x pipeline x replica count x edge count, then results.jsonl,
table.md and three PNG plots (tokens/s per edge, ITL p99, cloud utilisation against N)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from common.spec.modes import mode_of
from common.lab.plots import saved_figure
from common.table_cells import cell
from sim.fleet.costs import FleetCosts, ModeProfile
from sim.fleet.simulation import run_fleet
from sim.fleet.pipeline import PipelineModel
from sim.fleet.result import FleetResult

log = logging.getLogger(__name__)


def sweep(costs: FleetCosts, profiles: list[ModeProfile], edges: list[int], replicas: list[int], seed: int = 0,
          progress: bool = True, pipelines: Sequence[PipelineModel] = (PipelineModel(),),
          **run_kwargs: object) -> list[FleetResult]:
    """Every profile x pipeline x replica count x edge count; `run_kwargs` go to run_fleet. A profile whose
    mode has no pipeline runs once, off."""
    runs = list(dict.fromkeys((p, pl if pl.applies_to(p) else PipelineModel()) for p in profiles for pl in pipelines))
    grid = [(p, pl, m, n) for p, pl in runs for m in replicas for n in edges]
    results = []
    for profile, pipeline, m, n in tqdm(grid, desc="fleet", disable=not progress):
        results.append(run_fleet(costs, profile, n, m, seed, pipeline=pipeline, **run_kwargs))
        log.debug("%s (%s) N=%d M=%d: %.1f s", profile.name, pipeline.pipeline, n, m, results[-1].wall_s)
    return results


def run_label(result: FleetResult) -> str:
    """The profile, with its pipeline when one ran: 'sd-block/send-ahead'."""
    return result.profile if result.pipeline == "off" else f"{result.profile}/{result.pipeline}"


def format_table(results: list[FleetResult]) -> str:
    lines = [("| mode | pipeline | hit rate | edges | replicas | tokens/s per edge (mean) | p50 | fleet tokens/s "
              "| ITL p50 ms | ITL p99 ms | cloud utilisation | forwards/token | mean cloud batch | target calls/token "
              "| uplink bytes/token | simulator runtime s |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.profile} | {r.pipeline} | {cell(r.hit_rate, '.2f')} | {r.n_edges} | {r.n_replicas} | "
                     f"{cell(r.tokens_per_s_mean, '.2f')} | "
                     f"{cell(r.tokens_per_s_p50, '.2f')} | {cell(r.fleet_tokens_per_s)} | {cell(r.itl_ms_p50)} | "
                     f"{cell(r.itl_ms_p99)} | {r.cloud_utilisation:.2f} | {r.cloud_forwards_per_token:.3f} | "
                     f"{cell(r.cloud_batch_size_mean, '.2f')} | {r.target_calls_per_token:.3f} | "
                     f"{cell(r.uplink_bytes_per_token)} | {r.wall_s:.1f} |")
    return "\n".join(lines)


def plot(results: list[FleetResult], out: Path, title: str = "") -> list[Path]:
    charts = [("tokens_per_s_mean", "tokens/s per edge", "tokens_per_s.png", True),
              ("itl_ms_p99", "ITL p99 (ms)", "itl_p99.png", True),
              ("cloud_utilisation", "cloud utilisation (busy fraction)", "cloud_utilisation.png", False)]
    profiles = list(dict.fromkeys(run_label(r) for r in results))
    replica_counts = sorted({r.n_replicas for r in results})
    styles = ["-", "--", ":", "-."]
    paths = []
    for metric, label, name, log_y in charts:
        with saved_figure(out / name, figsize=(7, 4.5)) as (_, ax):
            for i, profile in enumerate(profiles):
                for j, m in enumerate(replica_counts):
                    series = sorted((r for r in results if run_label(r) == profile and r.n_replicas == m), key=lambda r: r.n_edges)
                    if metric == "cloud_utilisation" and series and not mode_of(series[0].mode).uses_cloud:
                        continue  # no cloud
                    ys = [getattr(r, metric) for r in series]
                    if not series or all(y is None for y in ys):
                        continue
                    ax.plot([r.n_edges for r in series], [math.nan if y is None else y for y in ys],
                            color=f"C{i}", linestyle=styles[j % len(styles)], marker="o", markersize=3,
                            label=f"{profile}, {m} replica{'s' if m > 1 else ''}")
            ax.set_xscale("log")
            if log_y:
                ax.set_yscale("log")
            ax.set_xlabel("edges (N)")
            ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
            if title:
                ax.set_title(title, fontsize=9)
        paths.append(out / name)
    return paths


def write_report(results: list[FleetResult], out: Path, header: str = "", title: str = "") -> None:
    """results.jsonl (one FleetResult per line), table.md (header first) and three PNG plots (titled)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "w") as f:
        f.writelines(json.dumps(asdict(r)) + "\n" for r in results)
    (out / "table.md").write_text((header + "\n\n" if header else "") + format_table(results) + "\n")
    plot(results, out, title)
