r"""`sprinter bench pipeline`: the edge pipeline at fleet scale, projected from a measured sweep.

    sprinter simulate --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --dtype float32 \
        --modes target,sd-block,sprinter-exact --pipeline off,ahead,send-ahead --rtt-ms 0,50,100,200 --out results/pipeline
    sprinter bench pipeline --sweep results/pipeline --edges 1000 --replicas 2 --out results/bench-pipeline

From the sweep it takes, per mode, the (block length, emitted) record of its pipeline-off requests
and the hit rate each pipeline measured (ahead: verdicts that picked the block drafted ahead;
send-ahead: verdicts answered by a candidate the cloud had already verified). The cloud's costs are
a GPU profile that is an ASSUMPTION, not a measurement (this machine has no GPU): see GPU_NOTE. The
fleet simulator (sim/fleet/) then runs N edges on M replicas at each RTT with each pipeline and
prints tokens/s per edge, ITL p99 and cloud utilisation; OUT gets results.json, table.md and pipeline.png.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

from common.errors import UsageError
from common.spec.modes import PIPELINED_MODES
from common.lab.plots import saved_figure
from sim.bench.run_folder import RunFolder
from sim.bench.settings.capacity import PipelineBenchSettings
from sim.fleet.costs import FleetCosts, ForwardModel, ModeProfile, RttModel
from sim.fleet.simulation import run_fleet
from sim.fleet.pipeline import PIPELINES, PipelineModel

log = logging.getLogger(__name__)

GPU_NOTE = ("ASSUMED GPU cloud (not measured here: no GPU on this machine): a 1.5B bf16 target on one A100-class "
            "GPU, forward = 12 ms + 0.03 ms per token + 0.2 ms per sequence (3 GB of weights at ~1.5 TB/s is ~2 ms; "
            "the rest is eager-mode kernel launches over 28 layers), batches of up to 64, a 2 ms window; the edge's "
            "draft step 18 ms (ONNX int8 0.5B, `sprinter bench draft` on the AVX-512 machine of earlier sessions)")


def gpu_costs(rtt_ms: float) -> FleetCosts:
    return FleetCosts(draft_step_ms=18.0, verifier_ms=0.8, forward=ForwardModel(12.0, 0.03, 0.2),
                      rtt=RttModel(mean_ms=rtt_ms, jitter_ms=0.1 * rtt_ms), window_ms=2.0, max_batch=64,
                      note=GPU_NOTE)


def sweep_inputs(sweep_dir: Path) -> tuple[list[ModeProfile], dict[tuple[str, str], float]]:
    """Per mode: the pipeline-off call record; per (mode, pipeline): the measured hit rate."""
    calls: dict[str, list[tuple[int, int]]] = defaultdict(list)
    rounds: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for line in (sweep_dir / "results.jsonl").read_text().splitlines():
        row = json.loads(line)
        mode, pipeline, stats = row["mode"], row.get("pipeline", "off"), row["sprinter"]["stats"]
        if mode not in PIPELINED_MODES:
            continue
        if pipeline == "off":
            calls[mode] += [(g, n + 1) for g, n in zip(stats["block_lengths"], stats["accepted_lengths"])]
        else:
            hits = stats["ahead_hits"] if pipeline == "ahead" else stats["candidate_hits"]
            rounds[mode, pipeline][0] += hits
            rounds[mode, pipeline][1] += stats["ahead_rounds"]
    profiles = [ModeProfile(mode, mode, tuple(g for g, _ in record), tuple(e for _, e in record),
                            note=f"measured: {sweep_dir} (pipeline off)") for mode, record in calls.items()]
    return profiles, {key: hits / n for key, (hits, n) in rounds.items() if n}


def project(sweep_dir: Path, edges: int, replicas: int, rtts: list[float], tokens: int) -> list[dict]:
    profiles, hit_rates = sweep_inputs(sweep_dir)
    rows = []
    for rtt in rtts:
        for profile in profiles:
            for pipeline in PIPELINES:
                hit_rate = hit_rates.get((profile.mode, pipeline), 0.0)
                result = run_fleet(gpu_costs(rtt), profile, edges, replicas, tokens_per_request=tokens,
                                   pipeline=PipelineModel(pipeline, hit_rate))
                rows.append({"rtt_ms": rtt, "mode": profile.mode, "pipeline": pipeline, "hit_rate": hit_rate,
                             "edges": edges, "replicas": replicas, "tokens_per_s": result.tokens_per_s_mean,
                             "itl_ms_p99": result.itl_ms_p99, "cloud_utilisation": result.cloud_utilisation})
                log.info("rtt %g %s/%s: %.1f tok/s per edge", rtt, profile.mode, pipeline, result.tokens_per_s_mean)
    return rows


def table_of(rows: list[dict]) -> str:
    lines = ["| RTT ms | mode | pipeline | hit rate (measured) | tokens/s per edge | vs off | ITL p99 ms | cloud utilisation |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    off = {(r["rtt_ms"], r["mode"]): r["tokens_per_s"] for r in rows if r["pipeline"] == "off"}
    for r in rows:
        lines.append(f"| {r['rtt_ms']:g} | {r['mode']} | {r['pipeline']} | {r['hit_rate']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {r['tokens_per_s'] / off[r['rtt_ms'], r['mode']]:.2f}x | "
                     f"{r['itl_ms_p99']:.0f} | {r['cloud_utilisation']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    with saved_figure(path, figsize=(7, 4)) as (fig, ax):
        for (mode, pipeline) in dict.fromkeys((r["mode"], r["pipeline"]) for r in rows):
            mine = [r for r in rows if (r["mode"], r["pipeline"]) == (mode, pipeline)]
            ax.plot([r["rtt_ms"] for r in mine], [r["tokens_per_s"] for r in mine], marker="o",
                    linestyle={"off": ":", "ahead": "--", "send-ahead": "-"}[pipeline], label=f"{mode}/{pipeline}")
        ax.set(xlabel="round trip (ms)", ylabel="tokens/s per edge", title=f"{rows[0]['edges']} edges, "
               f"{rows[0]['replicas']} GPU replicas (ASSUMED costs), measured hit rates")
        ax.legend(fontsize=8)


def bench_pipeline(settings: PipelineBenchSettings) -> str:
    """The projection of the sweep; writes OUT/results.json, table.md and pipeline.png, returns the note and the table."""
    if settings.sweep is None or not (settings.sweep / "results.jsonl").is_file():
        raise UsageError(f"--sweep: {settings.sweep or 'required'}: not a `sprinter simulate` OUT (no results.jsonl)")
    rows = project(settings.sweep, settings.edges, settings.replicas, list(settings.rtt_ms), settings.tokens_per_request)
    folder = RunFolder(settings.out)
    folder.write_results(settings, costs_note=GPU_NOTE, rows=rows)
    plot(rows, folder.path("pipeline.png"))
    return folder.write_table(GPU_NOTE + "\n\n" + table_of(rows))
