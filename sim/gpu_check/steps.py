"""The steps of `sprinter gpu check`, in the order they run; each returns what it writes and stops at its deadline.

    env      versions, the GPU, every import the later steps need, and one smallest forward
    owed     the figures the project owes, on the owed architecture, both layouts, checked against the goals
    table    every architecture x layout x context x edges, batching on and off
    graphs   whether a CUDA graph of the paged verify forward can be captured, and what its replay saves (graphs.py)
    prefix   a session opened from a cached prefix against a cold one (prefix.py)
    tree     a verify forward of a 16-token draft tree against chains of 6 and 16, and its rows against each path's (tree.py)
    pytest   tests/cloud/test_cuda.py on the device
    profile  the top kernels of one batched verify forward
"""

from __future__ import annotations

import os
import platform
import random
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from typing import Any

import torch

from common.lab.results_page import commit, machine
from sim.bench.engine import EngineRow, measure_sessions, release
from sim.gpu_check.run_state import CheckRun, Deadline
from sim.gpu_check.sizes import GOAL_BATCHING_GAIN, GOAL_CONTEXT_RATIO, GOAL_VERIFY_P50_MS


def env_step(run: CheckRun, deadline: Deadline) -> dict[str, Any]:
    """What the host has; raises, with what is missing, if a later step could not run."""
    import grpc
    import transformers

    import cloud.server  # noqa: F401  the service tests/cloud/test_cuda.py starts: gRPC, metrics, grammar, fleet plane
    import pytest
    from sprinter.v1 import decoding_pb2  # noqa: F401  the generated stubs came along

    info = {"python": platform.python_version(), "machine": platform.machine(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "transformers": transformers.__version__, "grpc": grpc.__version__,
            "pytest": pytest.__version__, "device": str(run.device), "default_layout": run.default_layout,
            "cpu": machine(), "cpu_cores": os.cpu_count(), "commit": commit(),
            # Triton builds its launchers with a C compiler: without one the paged layout's kernel cannot compile
            "c_compiler": shutil.which("cc") or shutil.which("gcc")}
    if run.device.type == "cuda":
        properties = torch.cuda.get_device_properties(run.device)
        info |= {"gpu": properties.name, "capability": f"{properties.major}.{properties.minor}",
                 "gpu_memory_gb": round(properties.total_memory / 2**30, 1)}
    model = run.model(run.sizes.smoke)
    settings = run.bench_settings(rounds=1)
    _, sessions = run.sessions(model, "per-session", 1, run.sizes.contexts[0], settings)
    row = measure_sessions(model, sessions, run.sizes.smoke, run.sizes.contexts[0], True, settings, random.Random(0))
    release(sessions)
    info["smoke_forward_ms"] = round(row.forward_p50_ms, 2)
    return info


def owed_step(run: CheckRun, deadline: Deadline) -> dict[str, Any]:
    """Verify p50 and tokens/s at `owed_edges` edges, each context, both layouts; unbatched at the mid context."""
    sizes, rows, missed = run.sizes, [], []
    settings = run.bench_settings(rounds=2 * sizes.rounds)
    model = run.model(sizes.owed)
    cases = [(layout, context, batching) for layout in run.layouts for context in sizes.contexts
             for batching in ((True, False) if context == sizes.mid_context else (True,))]
    for layout, context, batching in cases:
        if deadline.passed():
            missed.append({"attention": layout, "context": context, "batching": batching})
            continue
        _, sessions = run.sessions(model, layout, sizes.owed_edges, context, settings)
        rows.append(measure_sessions(model, sessions, sizes.owed, context, batching, settings, random.Random(1)))
        release(sessions)
        run.write("owed.json", {"rows": rows, "not_reached": missed, "goals": owed_goals(rows, run)})
    return {"rows": rows, "not_reached": missed, "goals": owed_goals(rows, run)}


def owed_goals(rows: list[EngineRow], run: CheckRun) -> list[dict[str, Any]]:
    """Each goal on the default layout (the one a cloud on this device runs): value, goal, met (None: not measured)."""
    edges, mid, (short, long) = run.sizes.owed_edges, run.sizes.mid_context, (run.sizes.contexts[0], run.sizes.contexts[-1])

    def row(context: int, batching: bool) -> EngineRow | None:
        return next((r for r in rows if (r.attention, r.context, r.edges, r.batching)
                     == (run.default_layout, context, edges, batching)), None)

    on, off, first, last = row(mid, True), row(mid, False), row(short, True), row(long, True)
    return [
        _goal(f"verify p50 ms, {edges} edges x {run.sizes.k + 1} tokens, context {mid}",
              on and on.verify_p50_ms, "<=", GOAL_VERIFY_P50_MS),
        _goal(f"verified tokens/s batching on / off, {edges} edges, context {mid}",
              on and off and on.tokens_per_s / off.tokens_per_s, ">=", GOAL_BATCHING_GAIN),
        _goal(f"verify p50 context {long} / context {short}, {edges} edges",
              first and last and last.verify_p50_ms / first.verify_p50_ms, "<=", GOAL_CONTEXT_RATIO),
    ]


def _goal(name: str, value: float | None, relation: str, goal: float) -> dict[str, Any]:
    met = None if value is None else (value <= goal if relation == "<=" else value >= goal)
    return {"goal": name, "value": None if value is None else round(value, 3), "relation": relation,
            "target": goal, "met": met}


def table_step(run: CheckRun, deadline: Deadline) -> dict[str, Any]:
    """Every architecture, layout and context: sessions for the most edges opened once, each edge count a prefix.

    Unbatched rows stop at the owed edge count: past it they are that many single forwards a round, whose
    tokens/s is the single forward's, and at 64 edges they would take the slot's time from the 7B rows."""
    sizes, rows, missed = run.sizes, [], []
    settings = run.bench_settings()
    for target in sizes.table:
        for layout in run.layouts:
            for context in sizes.contexts:
                if deadline.passed():
                    missed.append({"target": target, "attention": layout, "context": context})
                    continue
                model = run.model(target)
                kv, sessions = run.sessions(model, layout, max(sizes.edges), context, settings)
                for n_edges in sizes.edges:
                    for batching in (True, False) if n_edges <= sizes.owed_edges else (True,):
                        if not deadline.passed():
                            rows.append(measure_sessions(model, sessions[:n_edges], target, context, batching,
                                                         settings, random.Random(n_edges)))
                release(sessions)
                del kv
                run.write("table.json", {"rows": rows, "not_reached": missed})
    return {"rows": rows, "not_reached": missed}


def pytest_step(run: CheckRun, deadline: Deadline) -> str:
    """tests/cloud/test_cuda.py's report (on a CPU every test skips, saying why)."""
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "tests/cloud/test_cuda.py"],
                              capture_output=True, text=True, timeout=max(1.0, deadline.end - time.perf_counter()))
        report = done.stdout + done.stderr + f"\nexit code {done.returncode}\n"
    except subprocess.TimeoutExpired as err:
        report = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        report += f"\ncut off after {deadline.seconds:.0f} s\n"
    run.write("pytest.txt", report)
    return report


def profile_step(run: CheckRun, deadline: Deadline) -> str:
    """The top kernels (device time on a GPU, CPU time here) of one batched verify forward, owed size, mid context."""
    from torch.profiler import ProfilerActivity, profile

    sizes, settings = run.sizes, run.bench_settings(rounds=1)
    model = run.model(sizes.owed)
    _, sessions = run.sessions(model, run.default_layout, sizes.owed_edges, sizes.mid_context, settings)
    measure_sessions(model, sessions, sizes.owed, sizes.mid_context, True, settings, random.Random(2))  # warm
    on_gpu = run.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as profiler:
        measure_sessions(model, sessions, sizes.owed, sizes.mid_context, True, replace(settings, warmup=0),
                         random.Random(3))
        run.synchronize()
    release(sessions)
    title = (f"{sizes.owed}, {run.default_layout}, {sizes.owed_edges} edges x {sizes.k + 1} tokens, context "
             f"{sizes.mid_context}, on {run.device}\n")
    table = profiler.key_averages().table(sort_by="self_cuda_time_total" if on_gpu else "self_cpu_time_total",
                                          row_limit=15)
    run.write("profile.txt", title + table)
    return title + table
