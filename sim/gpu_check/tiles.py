"""Query tiles per session on and off (cloud/query_tiles.py): the paged verify forward at the owed size, each context.

Both sides re-verify the same blocks at the same positions over the same sessions (the inputs packed once, as the
graphs step does), so only the mask's query blocks and the padding differ. On a GPU it reports the forward's p50 and
the attention kernel's device time per layer (the fused flex_attention kernel, Triton's `triton_tem` template); the
CPU dry run runs the same code, unfused, and reports the forward's time only. Each context also records the CUDA-graph
bucket its tiled forward would pad to (cloud/graph_buckets.py), which the dry run checks as planning.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from cloud.graph_buckets import bucket_for
from cloud.packed_forward import pack, run_packed
from sim.bench.engine import BenchSession, release
from sim.gpu_check.run_state import CheckRun, Deadline

REPEATS = 10
KERNEL = "triton_tem"  # the name Inductor gives the compiled flex_attention template's kernels


def tiles_step(run: CheckRun, deadline: Deadline) -> dict[str, Any]:
    sizes, settings = run.sizes, run.bench_settings()
    model = run.model(sizes.owed)
    rows, missed = [], []
    for context in sizes.contexts:
        if deadline.passed():
            missed.append({"context": context})
            continue
        _, sessions = run.sessions(model, "paged", sizes.owed_edges, context, settings)
        row: dict[str, Any] = {"target": sizes.owed, "edges": sizes.owed_edges, "tokens": sizes.k + 1,
                               "context": context}
        for tiles in (False, True):
            row |= _measured(run, model, sessions, tiles, "tiles_on" if tiles else "tiles_off")
        row["tiled_over_untiled"] = round(row["tiles_on_forward_ms"] / row["tiles_off_forward_ms"], 3)
        release(sessions)
        rows.append(row)
        run.write("tiles.json", {"rows": rows, "not_reached": missed})
    return {"rows": rows, "not_reached": missed}


def _measured(run: CheckRun, model: torch.nn.Module, sessions: list[BenchSession], tiles: bool,
              name: str) -> dict[str, Any]:
    """p50 ms of one forward (inputs in, argmaxes out), its rows, its graph bucket and, on CUDA, the attention
    kernel's device ms per layer."""
    rng = random.Random(5)  # the same blocks with tiles on and off
    caches = [session.cache for session in sessions]
    blocks = [[s.pending] + [rng.randrange(model.config.vocab_size) for _ in range(run.sizes.k)] for s in sessions]
    with torch.inference_mode():
        inputs = pack(model, caches, blocks, [len(b) for b in blocks], query_tiles=tiles)

        def forward() -> torch.Tensor:
            return run_packed(model, inputs, inputs.host.to(run.device), caches, blocks).argmax(-1).cpu()

        forward_ms = run.p50_ms(forward, REPEATS)
        kernel_ms = _kernel_ms_per_layer(run, model, forward) if run.device.type == "cuda" else None
    choice = bucket_for(len(caches), inputs.n)
    return {f"{name}_forward_ms": forward_ms, f"{name}_rows": inputs.n,
            f"{name}_attention_ms_per_layer": kernel_ms,
            f"{name}_graph_bucket": (f"{choice.bucket.sessions}x{choice.bucket.rows}" if choice.bucket
                                     else choice.reason)}


def _kernel_ms_per_layer(run: CheckRun, model: torch.nn.Module, forward: Any) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for _ in range(REPEATS):
            forward()
        run.synchronize()
    device_us = sum(event.self_device_time_total for event in profiler.key_averages() if KERNEL in event.key)
    return round(device_us / 1e3 / REPEATS / model.config.num_hidden_layers, 4)
