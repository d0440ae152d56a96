"""The whole network sweep as one call: measure (resuming), judge quality, report, validate the fleet simulator.

    from sim.sweep.settings import SimulateSettings
    from sim.sweep.simulate import simulate
    simulate(SimulateSettings(out=Path("results/sim"), rtt_ms=(0, 50, 100)))

The cloud (`sprinter cloud serve`) and the edge daemon (`sprinter edge serve`) run as separate
processes (pinned to separate cores when there are two), the edge's gRPC channel going through a
`LinkProxy` in this process. For each RTT x mode x pipeline x prompt one streamed request goes through the
edge's OpenAI API (sim.sweep.run); then, with both processes stopped, the target judges every
output (sim.sweep.quality), and OUT gets summary.csv/md and plots (sim.sweep.report) and a
fleet-simulator validation (sim.sweep.fleet_validation). An interrupted sweep resumes where it stopped.
With a fleet plane broker (`mqtt`, sim.sweep.telemetry) both processes report to it while they are
measured, and OUT gets telemetry.jsonl and telemetry.png as well.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from common.lab.prompt_sets import PromptRecord, interleave_categories, load_prompts, split_by_prompt
from sim.sweep.fleet_validation import validate_fleet
from sim.sweep.quality import judge
from sim.sweep.report import write_report
from sim.sweep.results import ResultStore, result_key
from sim.sweep.run import run_sweep
from sim.sweep.settings import IDENTITY_BEFORE, SimulateSettings

log = logging.getLogger(__name__)


def select_prompts(settings: SimulateSettings) -> list[PromptRecord]:
    """The first `limit` prompts, categories interleaved; by default from the shipped set's held-out
    split (the prompts the shipped verifier never trained on)."""
    if settings.prompts is None:
        records = split_by_prompt(load_prompts(), seed=0)[2]
    else:
        records = load_prompts(settings.prompts)
    return interleave_categories(records)[: settings.limit]


def check_out_dir(settings: SimulateSettings) -> None:
    """Write OUT/config.json, refusing to resume a sweep that ran with other result-defining settings."""
    settings.out.mkdir(parents=True, exist_ok=True)
    path = settings.out / "config.json"
    if path.exists():
        previous = json.loads(path.read_text()).get("identity", {})
        previous = {**IDENTITY_BEFORE, **previous}
        changed = {k: (previous.get(k), v) for k, v in settings.identity().items() if previous.get(k) != v}
        if changed:
            raise ValueError(f"{settings.out} holds a sweep run with other settings ({changed}: before, now); "
                             "use another --out, or delete its results.jsonl to start over")
    path.write_text(json.dumps({"settings": settings.to_dict(), "identity": settings.identity()}, indent=1) + "\n")


def simulate(settings: SimulateSettings, progress: bool = True) -> dict[str, Path]:
    """The whole sweep: measure (resuming), judge quality, report, validate the fleet simulator."""
    check_out_dir(settings)
    prompts = select_prompts(settings)
    asyncio.run(run_sweep(settings, prompts, progress))
    records = ResultStore(settings.out / "results.jsonl").records()
    wanted = {(float(r), m, pipeline, p.id) for r in settings.rtt_ms for m, pipeline in settings.runs() for p in prompts}
    records = [r for r in records if result_key(r) in wanted]
    quality = judge(settings, prompts, records, progress)
    written = write_report(settings, records, quality)
    if settings.fleet_validation:
        try:
            written["fleet_validation"] = validate_fleet(settings, records)
        except Exception:  # optional: a failed calibration must not cost the measured sweep its report
            log.exception("fleet validation failed; the sweep's results and report are unaffected")
    return written
