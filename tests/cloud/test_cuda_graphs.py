"""CUDA graphs in the resident engine (cloud/cuda_graphs.py), what a CPU can check: the option's refusals, and that a
forward takes its rows from the replay when there is one. The capture itself needs CUDA (sim/gpu_check measures it);
here a stand-in replay runs the padded bucket forward eagerly, which is what a replay of its capture computes."""

from __future__ import annotations

import random

import pytest
import torch

import cloud.packed_forward
from cloud.cuda_graphs import GraphForwards
from cloud.graph_buckets import bucket_for, padded_to
from cloud.kv_pool import KVPool
from cloud.packed_forward import PackedInputs, forward_packed, install, run_packed
from cloud.resident_kv import KVLayout
from cloud.settings import CloudSettings


def test_graphs_are_on_by_default_on_cuda_only_and_refused_elsewhere():
    assert CloudSettings().graphed("cuda") and not CloudSettings().graphed("cpu")
    assert not CloudSettings(cuda_graphs="off").graphed("cuda")
    assert not CloudSettings(query_tiles="off").graphed("cuda")  # graphs replay tiled forwards only
    with pytest.raises(ValueError, match="--cuda-graphs on needs a CUDA device"):
        CloudSettings(device="cpu", attention="paged", query_tiles="on", cuda_graphs="on")
    with pytest.raises(ValueError, match="--cuda-graphs"):
        CloudSettings(engine="llama.cpp", cuda_graphs="on")


def test_the_graph_runner_refuses_a_model_off_cuda(tiny_target):
    layout = KVLayout.of(tiny_target.model, page_tokens=4)
    with pytest.raises(ValueError, match="CUDA device"):
        GraphForwards(tiny_target.model, KVPool(layout, budget_bytes=4 * layout.bytes_per_page))


def _sessions(model, pool, rng):
    caches = [pool.session() for _ in range(3)]
    for cache, n in zip(caches, (7, 2, 0)):
        if n:
            forward_packed(model, [cache], [[rng.randrange(model.config.vocab_size) for _ in range(n)]], [1])
    return caches


def test_a_forward_takes_its_rows_from_the_replay_and_moves_on_as_eager(tiny_target, monkeypatch):
    monkeypatch.setattr(cloud.packed_forward, "fused", lambda device_type: True)
    model = tiny_target.model
    install(model)
    outcomes = []
    for replayed in (False, True):
        layout = KVLayout.of(model, page_tokens=4)
        pool = KVPool(layout, budget_bytes=40 * layout.bytes_per_page)
        scratch = pool.take(1)[0] * layout.page_tokens
        rng = random.Random(8)
        caches = _sessions(model, pool, rng)
        used = []

        def replay(inputs: PackedInputs) -> torch.Tensor | None:
            bucket = bucket_for(inputs.plan.sessions, inputs.n).bucket
            padded = padded_to(inputs, bucket, scratch)
            used.append(bucket)
            return run_packed(model, padded, padded.host, [], [])[:inputs.k]

        rows = []
        for sizes in ((6, 1, 3), (1, 1, 1)):
            blocks = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in sizes]
            rows += forward_packed(model, caches, blocks, list(sizes), query_tiles=True,
                                   replay=replay if replayed else None)
        assert len(used) == (2 if replayed else 0) and [c.length for c in caches] == [14, 4, 4]
        outcomes.append(rows)
    for want, got in zip(*outcomes):
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
        assert torch.equal(got.argmax, want.argmax)


def test_a_replay_that_declines_leaves_the_forward_eager(tiny_target):
    model = tiny_target.model
    install(model)
    layout = KVLayout.of(model, page_tokens=4)
    pool = KVPool(layout, budget_bytes=40 * layout.bytes_per_page)
    caches = _sessions(model, pool, random.Random(1))
    asked = []
    rows = forward_packed(model, caches, [[1, 2], [3], [4]], [2, 1, 1], replay=lambda inputs: asked.append(1))
    assert asked == [1] and [r.logits.shape[0] for r in rows] == [2, 1, 1]
