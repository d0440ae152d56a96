"""The CUDA-graph bucket plan (cloud/graph_buckets.py): which bucket a forward pads to, when it runs eagerly, and
where its ints land in the bucket's static buffer. Pure planning: it runs the same on a CPU."""

from __future__ import annotations

import random

import pytest
import torch

import cloud.packed_forward
from cloud.kv_pool import KVPool
from cloud.packed_forward import forward_packed, install, pack, run_packed
from cloud.resident_kv import KVLayout

from cloud.graph_buckets import ROW_BUCKETS, Bucket, bucket_for, padded_to, refill_plan
from cloud.paged_attention import Q_BLOCK
from cloud.query_tiles import TILE_ROWS, tiles_for


def test_the_owed_verify_pads_to_a_bucket_of_its_own_size():
    rows = tiles_for([6] * 8).rows  # 8 edges x 6 tokens, each padded to a query tile: 128 rows
    choice = bucket_for(8, rows)
    assert choice.bucket == Bucket(8, 128) and choice.pad_sessions == 0 and choice.pad_rows == 0


def test_the_smallest_bucket_that_holds_the_forward():
    assert bucket_for(3, 20).bucket == Bucket(4, 32)
    assert (bucket_for(3, 20).pad_sessions, bucket_for(3, 20).pad_rows) == (1, 12)
    assert bucket_for(1, 1).bucket == Bucket(1, 16)
    assert bucket_for(8, 128).bucket == Bucket(8, 128)


def test_past_the_largest_bucket_or_with_a_tree_it_runs_eagerly():
    assert bucket_for(9, 64).bucket is None and "largest bucket" in bucket_for(9, 64).reason
    assert bucket_for(8, 300).bucket is None
    assert bucket_for(2, 20, has_tree=True).bucket is None and "tree" in bucket_for(2, 20, has_tree=True).reason
    with pytest.raises(ValueError):
        bucket_for(4, 3)


def test_row_buckets_are_whole_query_tiles_within_one_untiled_block():
    assert all(rows % TILE_ROWS == 0 for rows in ROW_BUCKETS) and max(ROW_BUCKETS) == Q_BLOCK


def test_the_refill_plan_lays_the_packed_ints_end_to_end():
    bucket = Bucket(4, 32)
    segments = refill_plan(bucket, sessions=3, rows=20, kept=5, written=17, pool_pages=10, q_block=TILE_ROWS)
    assert [s.name for s in segments] == ["ids", "positions", "kept_rows", "slots", "written_rows", "q_session",
                                          "entries", "page_index", "kv_num_blocks", "kv_indices"]
    assert all(a.offset + a.length == b.offset for a, b in zip(segments, segments[1:]))
    by_name = {s.name: s for s in segments}
    assert by_name["ids"].length == 32 and by_name["ids"].real == 20
    assert by_name["kept_rows"].real == 5 and "dropped" in by_name["kept_rows"].padding
    assert by_name["page_index"].length == 40 and by_name["page_index"].real == 30
    assert by_name["kv_num_blocks"].length == 2 and by_name["kv_num_blocks"].real == 2
    assert by_name["kv_indices"].length == 20
    assert by_name["slots"].padding == "the scratch slot" and by_name["slots"].real == 17
    with pytest.raises(ValueError):
        refill_plan(bucket, sessions=5, rows=20, kept=1, written=17, pool_pages=10, q_block=TILE_ROWS)


def test_the_real_parts_are_the_packed_forwards_ints_in_order(tiny_target, monkeypatch):
    """A tiled forward packed as CUDA would pack it (whole-pool plan): its ints are the plan's real parts, end to end."""
    monkeypatch.setattr(cloud.packed_forward, "fused", lambda device_type: True)
    model = tiny_target.model
    install(model)
    layout = KVLayout.of(model, page_tokens=4)
    pool = KVPool(layout, budget_bytes=24 * layout.bytes_per_page)
    caches = [pool.session() for _ in range(3)]
    blocks, n_logits = [[1] * 6, [2], [3] * 3], [6, 1, 1]
    inputs = pack(model, caches, blocks, n_logits, query_tiles=True)
    rows = inputs.n
    choice = bucket_for(len(caches), rows)
    segments = refill_plan(choice.bucket, len(caches), rows, inputs.k, inputs.plan.n_written, pool.pages, TILE_ROWS)
    assert sum(s.real for s in segments) == inputs.host.numel()
    real = dict(zip([s.name for s in segments],
                    inputs.host.split([s.real for s in segments])))
    assert real["slots"].tolist() == [slot for cache, block in zip(caches, blocks) for slot in cache.slots(0, len(block))]
    assert real["kv_num_blocks"].tolist() == [len(cache.pages) for cache in caches]
    for cache in caches:
        cache.release()


def test_a_forward_padded_to_its_bucket_gives_the_same_rows_and_kv(tiny_target, monkeypatch):
    """What a graph replay computes, run eagerly: sessions and rows padded to the bucket, the padding's KV in the
    scratch slot. The kept rows and every session's KV equal the unpadded forward's in float32."""
    monkeypatch.setattr(cloud.packed_forward, "fused", lambda device_type: True)
    model = tiny_target.model
    install(model)
    results = []
    for padded in (False, True):
        layout = KVLayout.of(model, page_tokens=4)
        pool = KVPool(layout, budget_bytes=40 * layout.bytes_per_page)
        scratch_page = pool.take(1)[0]  # a page no session owns
        rng = random.Random(3)
        caches = [pool.session() for _ in range(3)]
        for cache, n in zip(caches, (5, 0, 11)):
            if n:
                forward_packed(model, [cache], [[rng.randrange(model.config.vocab_size) for _ in range(n)]], [1])
        blocks = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in (6, 1, 3)]
        with torch.inference_mode():
            inputs = pack(model, caches, blocks, [6, 1, 2], query_tiles=True)
            if padded:
                choice = bucket_for(3, inputs.n)
                assert choice.bucket == Bucket(4, 64) and choice.pad_rows == 16
                inputs = padded_to(inputs, choice.bucket, scratch_page * layout.page_tokens)
                assert inputs.n == inputs.k == 64 and inputs.plan.sessions == 4
            logits = run_packed(model, inputs, inputs.host, caches, blocks)[:9]
        kv = [pool.keys[:, :, cache.slots(0, cache.length + len(b))] for cache, b in zip(caches, blocks)]
        results.append((logits, kv))
    (want, want_kv), (got, got_kv) = results
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for a, b in zip(got_kv, want_kv):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_only_a_tiled_fused_chain_forward_pads(tiny_target):
    model = tiny_target.model
    install(model)
    layout = KVLayout.of(model, page_tokens=4)
    pool = KVPool(layout, budget_bytes=8 * layout.bytes_per_page)
    cache = pool.session()
    inputs = pack(model, [cache], [[1, 2]], [1])  # untiled (and unfused on a CPU)
    with pytest.raises(ValueError, match="query tiles"):
        padded_to(inputs, Bucket(1, 16), 0)
    cache.release()
