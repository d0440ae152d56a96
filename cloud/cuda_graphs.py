"""The resident engine's paged forwards replayed from CUDA graphs (`--cuda-graphs`), one graph per bucket.

An eager forward launches hundreds of small kernels from Python: on the first H100 run a verify of 8 edges x 6
tokens took 37.5 ms of CPU time for 13.1 ms of GPU time. A graph replays the whole forward in one launch. A forward
that fits a bucket (cloud/graph_buckets.py: query tiles on, the fused plan, no tree block) is padded to it, its ints
are copied into the bucket's static device buffer, and the bucket's graph is replayed; the graph is captured the
first time its bucket is used (after a few eager runs on a side stream, which compile and warm the kernels). Every
other forward runs eagerly. Padding rows write their KV to a scratch slot: a page of the pool that no session
owns, taken when the engine starts. All graphs share one memory pool, as vLLM's do; each keeps its output logits
[bucket rows, V] alive (for a 152k vocabulary in bf16, up to 39 MB a bucket).

Only CUDA has graphs: on any other device the option is refused at start (cloud/settings.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from cloud.graph_buckets import Bucket, BucketChoice, bucket_for, padded_to
from cloud.kv_pool import KVPool
from cloud.packed_forward import PackedInputs, run_packed

log = logging.getLogger(__name__)
WARMUP_RUNS = 3  # eager runs on a side stream before a capture: compiled kernels built, allocator settled


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    static: torch.Tensor  # [the bucket's ints] on the device: refilled before each replay
    logits: torch.Tensor  # [bucket rows, V]: the replay's output, overwritten by the next replay


class GraphForwards:
    """Replays paged forwards that fit a bucket; `replay` is what cloud/packed_forward.py's forwards call."""

    def __init__(self, model: PreTrainedModel, pool: KVPool) -> None:
        if model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the target is on {model.device}")
        self.model = model
        self.scratch_slot = pool.take(1)[0] * pool.layout.page_tokens  # padding rows' KV: read by no session
        self._captured: dict[Bucket, _Captured] = {}
        self._memory = torch.cuda.graph_pool_handle()
        self.replays = 0
        self.eager = 0

    def choice(self, inputs: PackedInputs) -> BucketChoice:
        plan = inputs.plan
        if plan is None or not plan.tiled or plan.width != plan.pool.pages:
            return BucketChoice(None, reason="not a paged forward with query tiles and the fused plan: eager")
        return bucket_for(plan.sessions, inputs.n, has_tree=bool(plan.tree_width))

    def replay(self, inputs: PackedInputs) -> torch.Tensor | None:
        """The kept rows' logits [K, V] from the bucket's graph (valid until the next replay); None: run it eagerly."""
        bucket = self.choice(inputs).bucket
        if bucket is None:
            self.eager += 1
            return None
        padded = padded_to(inputs, bucket, self.scratch_slot)
        captured = self._captured.get(bucket) or self._capture(bucket, padded)
        captured.static.copy_(padded.host)
        captured.graph.replay()
        self.replays += 1
        return captured.logits[:inputs.k]

    def _capture(self, bucket: Bucket, padded: PackedInputs) -> _Captured:
        """Capture `bucket`'s forward over `padded` (a real forward's ints: its warm-up runs write the KV the real
        forward writes, and the replay that follows writes it again, the same)."""
        static = padded.host.to(self.model.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                run_packed(self.model, padded, static, [], [])
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the cloud's draft may run its own forwards on another thread while this one captures
        with torch.cuda.graph(graph, pool=self._memory, capture_error_mode="thread_local"):
            logits = run_packed(self.model, padded, static, [], [])
        log.info("captured a CUDA graph for %d sessions x %d rows", bucket.sessions, bucket.rows)
        self._captured[bucket] = _Captured(graph, static, logits)
        return self._captured[bucket]
