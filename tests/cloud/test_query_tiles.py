"""Query tiles per session (cloud/query_tiles.py): the layout, the block mask's plan, and rows equal to untiled ones.

On the CPU flex_attention runs unfused, so these check correctness, not the fused kernel's speed: with tiles each
16-row query block lists only its own session's pages, padding rows write no KV, and every real row's logits are
those of the untiled forward in float32."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from transformers import PreTrainedModel

import cloud.packed_forward
from cloud.kv_pool import KVPool, PagedKV
from cloud.packed_forward import forward_packed, install, pack
from cloud.paged_attention import Q_BLOCK, VERIFY_KERNEL_OPTIONS, PagedPlan
from cloud.query_tiles import MAX_TILED_ROWS, TILE_ROWS, tile_layout, tiles_for
from cloud.resident_kv import KVLayout
from cloud.settings import CloudSettings
from cloud_harness import ServerThread

# A root with branches of different depths (tests/cloud/test_tree_forward.py's), as the forward sees a block.
TREE = [-1, 0, 1, 0, 3, 3, 1]


def test_the_tile_is_the_verify_kernels_and_a_tiled_forward_fits_one_untiled_block():
    assert TILE_ROWS == VERIFY_KERNEL_OPTIONS["BLOCK_M"] and MAX_TILED_ROWS == Q_BLOCK


def test_the_layout_pads_each_session_to_whole_tiles():
    layout = tile_layout([6, 1, 16, 17], tile=16)
    assert layout.padded_counts == (16, 16, 16, 32) and layout.rows == 80
    assert layout.real_rows == list(range(6)) + [16] + list(range(32, 48)) + list(range(48, 65))
    source = layout.source
    assert len(source) == 80
    assert source[:16] == list(range(6)) + [5] * 10  # padding repeats the session's last real row
    assert source[16:32] == [6] * 16
    assert source[32:48] == list(range(7, 23))
    assert source[48:80] == list(range(23, 40)) + [39] * 15
    assert [source[row] for row in layout.real_rows] == list(range(40))  # a real row is its own source
    assert layout.tile_session == [0, 1, 2, 3, 3]


def test_tiles_apply_while_the_padded_rows_fit_one_untiled_block():
    assert tiles_for([6] * 8).rows == 128  # the owed verify: 8 edges x 6 tokens
    assert tiles_for([6] * 9) is None  # 144 padded rows: a decode-heavy or large forward stays untiled
    assert tiles_for([200]) is None
    with pytest.raises(ValueError):
        tile_layout([3, 0])


def _pool(model: PreTrainedModel, page_tokens: int = 4, pages: int = 96) -> KVPool:
    layout = KVLayout.of(model, page_tokens=page_tokens)
    return KVPool(layout, budget_bytes=pages * layout.bytes_per_page)


def _prefilled(model: PreTrainedModel, pool: KVPool, rng: random.Random, length: int) -> PagedKV:
    cache = pool.session()
    if length:
        forward_packed(model, [cache], [[rng.randrange(model.config.vocab_size) for _ in range(length)]], [1])
    return cache


@pytest.fixture(scope="module")
def model(tiny_target) -> PreTrainedModel:
    install(tiny_target.model)
    return tiny_target.model


def test_each_tiled_query_block_lists_only_its_sessions_pages(model):
    rng = random.Random(1)
    pool = _pool(model)
    caches = [_prefilled(model, pool, rng, n) for n in (9, 0, 22, 5)]
    blocks = [[1] * n for n in (6, 1, 17, 3)]
    tiles = tile_layout([len(b) for b in blocks])
    inputs = pack(model, caches, blocks, [1] * len(blocks), query_tiles=True)
    plan = inputs.plan
    assert plan.tiled and plan.q_block == TILE_ROWS and inputs.n == tiles.rows and plan.n_tokens == tiles.rows
    assert plan.n_written == sum(len(b) for b in blocks) and plan.q_blocks == len(tiles.tile_session)
    mask = plan.on_device(inputs.host[2 * inputs.n + inputs.k:]).block_mask
    counts, indices = mask.kv_num_blocks[0, 0], mask.kv_indices[0, 0]
    for b, session in enumerate(tiles.tile_session):
        cache = caches[session]
        own = cache.pages[:cache.layout.pages(cache.length + len(blocks[session]))]
        assert sorted(indices[b, :counts[b]].tolist()) == sorted(own)
    untiled = pack(model, [_prefilled(model, pool, rng, 3) for _ in range(4)], blocks, [1] * 4).plan
    assert not untiled.tiled and untiled.q_blocks == 1  # one 128-row block lists every session's pages
    for cache in caches:
        cache.release()


def _run(model: PreTrainedModel, query_tiles: bool, fused: bool, monkeypatch) -> tuple[list, list[torch.Tensor]]:
    """The same two rounds (chains of different lengths and a tree) on a fresh pool; the rows and the KV written."""
    monkeypatch.setattr(cloud.packed_forward, "fused", lambda device_type: fused)
    rng = random.Random(5)
    pool = _pool(model)
    caches = [_prefilled(model, pool, rng, n) for n in (0, 7, 30, 13, 2)]
    rows = []
    for round_ in range(2):
        sizes = (6, 1, 3, len(TREE), 16) if round_ == 0 else (2, 5, 1, 4, 9)
        blocks = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in sizes]
        trees = [None, None, None, TREE, None] if round_ == 0 else None
        rows += forward_packed(model, caches, blocks, [n if i % 2 else 1 for i, n in enumerate(sizes)],
                               trees=trees, query_tiles=query_tiles)
        if round_ == 0:
            caches[3].keep_path(caches[3].length - len(TREE), [0, 1, 2])
    entries = [torch.cat([pool.keys[:, :, cache.slots(0, cache.length)],
                          pool.values[:, :, cache.slots(0, cache.length)]]) for cache in caches]
    return rows, entries


@pytest.mark.parametrize("fused", [False, True], ids=["unfused-plan", "fused-plan"])
def test_tiled_rows_and_kv_equal_untiled_in_float32(model, fused, monkeypatch):
    """Several sessions of different rows and contexts, a tree among them: the same logits, argmaxes and KV."""
    want_rows, want_kv = _run(model, False, fused, monkeypatch)
    got_rows, got_kv = _run(model, True, fused, monkeypatch)
    for want, got in zip(want_rows, got_rows):
        assert got.logits.dtype == torch.float32
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
        assert torch.equal(got.argmax, want.argmax)
    for want, got in zip(want_kv, got_kv):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_padding_rows_write_no_kv(model):
    """A session's pages past its new entries stay as they were: padding rows wrote nowhere."""
    rng = random.Random(2)
    pool = _pool(model, page_tokens=16)
    caches = [_prefilled(model, pool, rng, n) for n in (3, 20)]
    before_keys, before_values = pool.keys.clone(), pool.values.clone()
    forward_packed(model, caches, [[7] * 2, [9] * 5], [1, 1], query_tiles=True)
    written = torch.tensor([slot for cache, n in zip(caches, (2, 5))
                            for slot in cache.slots(cache.length - n, cache.length)])
    untouched = torch.ones(pool.keys.shape[2], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(pool.keys[:, :, untouched], before_keys[:, :, untouched])
    assert torch.equal(pool.values[:, :, untouched], before_values[:, :, untouched])
    assert not torch.equal(pool.keys[:, :, written], before_keys[:, :, written])


def test_the_option_is_on_where_the_kernel_is_fused_and_refused_where_it_means_nothing():
    assert CloudSettings().tiled("cuda") and not CloudSettings().tiled("cpu")
    assert CloudSettings(attention="paged", query_tiles="on").tiled("cpu")
    assert not CloudSettings(query_tiles="off").tiled("cuda")
    with pytest.raises(ValueError, match="--attention paged"):
        CloudSettings(device="cpu", attention="per-session", query_tiles="on")
    with pytest.raises(ValueError, match="--query-tiles"):
        CloudSettings(engine="llama.cpp", query_tiles="on")
    with pytest.raises(ValueError, match="auto, on or off"):
        CloudSettings(query_tiles="yes")


def test_the_server_hands_the_option_to_its_forwards(tiny_target, monkeypatch):
    """A paged cloud on the CPU with --query-tiles on: its warm-up and its batcher's forwards are tiled."""
    plans = []
    original = PagedPlan.of
    monkeypatch.setattr(cloud.packed_forward.PagedPlan, "of", lambda *args: plans.append(original(*args)) or plans[-1])
    settings = CloudSettings(target="tiny-random", attention="paged", query_tiles="on")
    with ServerThread(settings, tiny_target) as server:
        engine = server.server.servicer.host.engine
        assert engine.query_tiles and plans and all(plan.tiled for plan in plans)  # warm-up's
        plans.clear()
        cache = engine.new_session_kv()
        try:
            asyncio.run_coroutine_threadsafe(engine.batcher.forward(cache, [1, 2, 3], 1), server._loop).result(60)
        finally:
            cache.release()
    assert plans and plans[-1].tiled and plans[-1].n_tokens == TILE_ROWS
