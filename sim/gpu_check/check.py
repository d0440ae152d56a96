"""`sprinter gpu check`: the steps in order, each within its budget, each writing its results as it finishes.

What comes back (8 files in OUT): summary.json (each step's status, seconds and budget), env.json, owed.json,
table.json, features.json (a row per engine feature: CUDA graphs, the prefix cache, draft trees; later GPU
work adds its row there), pytest.txt, profile.txt and the run's log, gpu-check.log. The first step fails the run within its 30 s, with one line that says what is
missing; a later step that fails is recorded and the rest still run.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.model.devices import resolve_device
from sim.gpu_check.graphs import graphs_step
from sim.gpu_check.tiles import tiles_step
from sim.gpu_check.prefix import prefix_step
from sim.gpu_check.run_state import CheckRun, Deadline
from sim.gpu_check.sizes import STEP_BUDGET_S, sizes_for
from sim.gpu_check.steps import env_step, owed_step, profile_step, pytest_step, table_step
from sim.gpu_check.tree import tree_step

log = logging.getLogger(__name__)
STEPS: tuple[tuple[str, Callable[[CheckRun, Deadline], Any]], ...] = (
    ("env", env_step), ("owed", owed_step), ("table", table_step), ("graphs", graphs_step), ("tiles", tiles_step),
    ("prefix", prefix_step), ("tree", tree_step), ("pytest", pytest_step), ("profile", profile_step))
FEATURES = ("graphs", "tiles", "prefix", "tree")  # steps whose result is one row of features.json; env's is env.json, the others
#                                  write their own files as rows come


@dataclass(frozen=True)
class GpuCheckSettings:
    out: Path = Path("results/gpu-check")
    device: str = "cuda"
    dtype: str = "bfloat16"
    steps: tuple[str, ...] = tuple(name for name, _ in STEPS)


def run_check(settings: GpuCheckSettings) -> int:
    """Run the steps; 0 when every step ran (whatever the goals say), 1 when the first failed, 3 when a later one did."""
    device = resolve_device(settings.device)
    settings.out.mkdir(parents=True, exist_ok=True)
    run = CheckRun(device, sizes_for(device.type), settings.out, settings.dtype)
    summary: dict[str, Any] = {"date": datetime.date.today().isoformat(), "device": str(device),
                               "sizes": run.sizes.__dict__, "steps": []}
    features: dict[str, Any] = {}
    with open(settings.out / "gpu-check.log", "w") as log_file:
        def say(line: str) -> None:
            print(line, flush=True)
            print(line, file=log_file, flush=True)

        for number, (name, step) in enumerate(STEPS, start=1):
            if name not in settings.steps:
                continue
            say(f"== step {number}/{len(STEPS)} {name} (budget {STEP_BUDGET_S[name]:.0f} s)")
            record, result = _run_step(run, name, step)
            if name == "env" and result is not None:
                run.write("env.json", result)
            if name in FEATURES and result is not None:
                features[name] = result
                run.write("features.json", features)
            summary["steps"].append(record)
            run.write("summary.json", summary)
            say(f"   {name}: {record['status']} in {record['seconds']} s" + (f": {record['error']}" if "error" in record else ""))
            if result is not None:
                say(_brief(name, result))
            if record["status"] == "failed" and name == "env":
                say(f"gpu-check: FAILED in 'env', nothing else can run: {record['error']}")
                return 1
        failed = [r["step"] for r in summary["steps"] if r["status"] == "failed"]
        say(f"gpu-check: {'failed steps: ' + ', '.join(failed) if failed else 'every step ran'}; results in {settings.out}")
    return 3 if failed else 0


def _run_step(run: CheckRun, name: str, step: Callable[[CheckRun, Deadline], Any]) -> tuple[dict[str, Any], Any]:
    """(what summary.json records of the step, its result; None if it failed)."""
    deadline = Deadline(STEP_BUDGET_S[name])
    started = time.perf_counter()
    try:
        result = step(run, deadline)
    except Exception as err:  # noqa: BLE001 - a step that fails is reported, and the next one still runs
        log.debug("step %s failed", name, exc_info=True)
        return {"step": name, "status": "failed", "seconds": round(time.perf_counter() - started, 1),
                "budget_s": deadline.seconds, "error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc(limit=8)}, None
    record = {"step": name, "status": _status(result), "seconds": round(time.perf_counter() - started, 1),
              "budget_s": deadline.seconds}
    return record, result


def _status(result: Any) -> str:
    if isinstance(result, dict) and result.get("not_reached"):
        return "partial"
    if isinstance(result, dict) and result.get("captured") is False and "eager_p50_ms" not in result:
        return "skipped"
    return "done"


def _brief(name: str, result: Any) -> str:
    """A few lines for the log: what a person watching the run wants to see."""
    if name == "owed":
        return "\n".join(f"   {g['goal']}: {g['value']} (goal {g['relation']} {g['target']}, "
                         f"{'met' if g['met'] else 'not met' if g['met'] is False else 'not measured'})"
                         for g in result["goals"])
    if name == "table":
        return f"   {len(result['rows'])} rows, {len(result['not_reached'])} groups not reached"
    if name == "pytest":
        lines = [line for line in result.splitlines() if line.strip()]
        return "   " + (lines[-2] if len(lines) > 1 else "(no output)")
    if name == "env" and result["device"].startswith("cuda") and not result["c_compiler"]:
        return "   " + json.dumps(result) + "\n   no C compiler (cc, gcc): Triton cannot build the paged kernel's launcher"
    if name == "tree":
        return "\n".join([f"   {r['sessions']} session(s): chain 6 {r['chain6_ms']} ms, chain 16 {r['chain16_ms']} ms, "
                          f"tree 16 {r['tree16_ms']} ms ({r['tree16_over_chain6']}x chain 6, "
                          f"{r['tree16_over_chain16']}x chain 16)" for r in result["rows"]]
                         + [f"   tree rows against each path's: {json.dumps(result['check'])}"])
    if name == "profile":
        return "\n".join("   " + line for line in result.splitlines()[:8])
    return "   " + json.dumps(result)
