"""Whether CUDA graphs pay: the engine's graph replay (cloud/cuda_graphs.py) of the owed verify forward, against eager.

The forward is the paged verify at the owed size (8 edges x 6 tokens, 1k context) with query tiles per session, as a
CUDA cloud runs it by default: padded to its bucket of sessions x rows (cloud/graph_buckets.py), its ints copied into
the bucket's static buffer, the captured graph replayed. Both sides re-verify the same block at the same positions and
bring the argmax rows back to the host. On a CPU the step plans only (the bucket and the static buffer's size) and
says why it captured nothing.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from cloud.cuda_graphs import GraphForwards
from cloud.graph_buckets import bucket_for, refill_plan
from cloud.packed_forward import pack, run_packed
from sim.bench.engine import release
from sim.gpu_check.run_state import CheckRun, Deadline

REPEATS = 30


def graphs_step(run: CheckRun, deadline: Deadline) -> dict[str, Any]:
    sizes, settings = run.sizes, run.bench_settings()
    model = run.model(sizes.owed)
    pool, sessions = run.sessions(model, "paged", sizes.owed_edges, sizes.mid_context, settings)
    rng = random.Random(4)
    caches = [session.cache for session in sessions]
    blocks = [[s.pending] + [rng.randrange(model.config.vocab_size) for _ in range(sizes.k)] for s in sessions]
    inputs = pack(model, caches, blocks, [len(b) for b in blocks], query_tiles=True)
    choice = bucket_for(len(caches), inputs.n)
    row = {"target": sizes.owed, "attention": "paged", "query_tiles": True, "edges": sizes.owed_edges,
           "tokens": sizes.k + 1, "context": sizes.mid_context,
           "bucket": f"{choice.bucket.sessions}x{choice.bucket.rows}" if choice.bucket else choice.reason}
    if choice.bucket is not None:
        segments = refill_plan(choice.bucket, len(caches), inputs.n, inputs.k, inputs.plan.n_written, pool.pages,
                               inputs.plan.q_block)
        row["static_ints"] = sum(segment.length for segment in segments)
    if run.device.type != "cuda":
        release(sessions)
        return row | {"captured": False, "reason": f"CUDA graphs need a CUDA device; this run is on {run.device} "
                                                   "(the bucket is planned only)"}
    with torch.inference_mode():
        eager_ms = run.p50_ms(lambda: run_packed(model, inputs, inputs.host.to(run.device), caches, blocks)
                             .argmax(-1).cpu(), REPEATS)
        try:
            graphs = GraphForwards(model, pool)
            graphs.replay(inputs)  # captures the bucket's graph
        except Exception as err:  # noqa: BLE001 - what stops a capture is the answer this step gives
            release(sessions)
            return row | {"captured": False, "reason": f"{type(err).__name__}: {err}"[:2000], "eager_p50_ms": eager_ms}
        replay_ms = run.p50_ms(lambda: graphs.replay(inputs).argmax(-1).cpu(), REPEATS)
    release(sessions)
    return row | {"captured": True, "eager_p50_ms": eager_ms, "graph_p50_ms": replay_ms,
                  "graph_speedup": round(eager_ms / replay_ms, 3)}

