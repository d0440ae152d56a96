"""Whether CUDA graphs pay: one paged verify forward captured as a graph, its replay timed against the eager forward.

The paged layout keeps every shape of a forward fixed for a given batch: the pool spans the same pages,
the mask lists the same width, and N new tokens make an N-column row (cloud/paged_attention.py). So one
graph per (sessions, tokens) bucket could serve every forward of that bucket; this measures what one
such graph saves at the owed size (8 edges x 6 tokens, 1k context). Both sides re-verify the same
block at the same positions: the inputs copied into one static device buffer, the forward, the argmax
rows back on the host.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from cloud.packed_forward import pack, run_packed
from sim.bench.engine import release
from sim.gpu_check.run_state import CheckRun, Deadline

REPEATS = 30


def graphs_step(run: CheckRun, deadline: Deadline) -> dict[str, Any]:
    if run.device.type != "cuda":
        return {"captured": False, "reason": f"CUDA graphs need a CUDA device; this run is on {run.device}"}
    sizes, settings = run.sizes, run.bench_settings()
    model = run.model(sizes.owed)
    _, sessions = run.sessions(model, "paged", sizes.owed_edges, sizes.mid_context, settings)
    rng = random.Random(4)
    caches = [session.cache for session in sessions]
    blocks = [[s.pending] + [rng.randrange(model.config.vocab_size) for _ in range(sizes.k)] for s in sessions]
    inputs = pack(model, caches, blocks, [len(b) for b in blocks])
    static = inputs.host.to(run.device)

    def forward() -> torch.Tensor:
        return run_packed(model, inputs, static, caches, blocks).argmax(-1)

    row = {"target": sizes.owed, "attention": "paged", "edges": sizes.owed_edges, "tokens": sizes.k + 1,
           "context": sizes.mid_context}
    with torch.inference_mode():
        eager_ms = _timed(lambda: forward().cpu(), static, inputs.host, run)
        try:
            graph, output = _capture(forward)
        except Exception as err:  # noqa: BLE001 - what stops a capture is the answer this step gives
            release(sessions)
            return row | {"captured": False, "reason": f"{type(err).__name__}: {err}"[:2000], "eager_p50_ms": eager_ms}
        replay_ms = _timed(lambda: (graph.replay(), output.cpu()), static, inputs.host, run)
    release(sessions)
    return row | {"captured": True, "eager_p50_ms": eager_ms, "graph_p50_ms": replay_ms,
                  "graph_speedup": round(eager_ms / replay_ms, 3)}


def _capture(forward: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Warm up on a side stream (compiled kernels, allocator), then capture one forward."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = forward()
    return graph, output


def _timed(step: Callable[[], object], static: torch.Tensor, host: torch.Tensor, run: CheckRun) -> float:
    """p50 ms of (inputs to the device, `step`, rows to the host) over REPEATS, after 3 untimed."""
    times = []
    for i in range(REPEATS + 3):
        run.synchronize()
        started = time.perf_counter()
        static.copy_(host, non_blocking=False)
        step()
        if i >= 3:
            times.append((time.perf_counter() - started) * 1e3)
    return round(statistics.median(times), 3)
