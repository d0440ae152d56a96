"""A tree of draft tokens in one packed forward: each node's row is its own path's, and a kept side path's KV is
that of a session that only ever saw it.

Conventions as a verify's (common/spec/tree/draft_tree.py): the block is the root (the session's pending token)
then N nodes; `parents[i]` is node i's parent, -1 for the root. The reference for a node is the model's own forward, no cache,
over the context and the path to that node; both KV layouts run, batched with other sessions' chains.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import PreTrainedModel

from cloud.kv_pool import KVPool, PagedKV
from cloud.packed_forward import forward_packed, install
from cloud.resident_kv import KVLayout, ResidentKV
from common.spec.tree.draft_tree import ancestors, check_path, depths, path_to

ATOL = 1e-4
# A root with three branches of different depths, one of them branching again: node 4 follows node 2's sibling.
PARENTS = [-1, 0, -1, 2, 2, 4, -1, 1]


@pytest.fixture(scope="module")
def model(tiny_target) -> PreTrainedModel:
    install(tiny_target.model)
    return tiny_target.model


def _plain(model: PreTrainedModel, tokens: list[int], n_logits: int) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens]), logits_to_keep=n_logits).logits[0].float()


def _new_cache(model: PreTrainedModel, paged: bool, pool: KVPool | None) -> ResidentKV | PagedKV:
    return pool.session() if paged else ResidentKV(KVLayout.of(model, page_tokens=8))


def _pool(model: PreTrainedModel) -> KVPool:
    layout = KVLayout.of(model, page_tokens=8)
    return KVPool(layout, budget_bytes=64 * layout.bytes_per_page)


def _block_tree(parents: list[int]) -> list[int]:
    """A verify's block as the forward sees it: the root (follows the past), then node i at block index 1 + i."""
    return [-1] + [parent + 1 for parent in parents]


def _entries(cache: ResidentKV | PagedKV) -> tuple[torch.Tensor, torch.Tensor]:
    """The session's KV entries 0 .. length - 1, [layers, kv_heads, length, head_dim] each."""
    if isinstance(cache, PagedKV):
        slots = torch.tensor(cache.slots(0, cache.length))
        return cache.pool.keys[:, :, slots], cache.pool.values[:, :, slots]
    return cache.keys[:, :, :cache.length], cache.values[:, :, :cache.length]


def _prefilled(model, rng, paged, pool, length) -> tuple[ResidentKV | PagedKV, list[int]]:
    context = [rng.randrange(model.config.vocab_size) for _ in range(length)]
    cache = _new_cache(model, paged, pool)
    forward_packed(model, [cache], [context[:-1]], [1])
    return cache, context


def test_tree_helpers():
    assert depths(PARENTS) == [1, 2, 1, 2, 2, 3, 1, 3]  # 1: right after the past
    assert path_to(PARENTS, 5) == [2, 4, 5]
    seen = ancestors(PARENTS)
    assert seen[5].nonzero().flatten().tolist() == [2, 4, 5] and seen[7].nonzero().flatten().tolist() == [0, 1, 7]
    with pytest.raises(ValueError, match="does not follow"):
        check_path(PARENTS, [2, 5])


@pytest.mark.parametrize("paged", [False, True], ids=["per-session", "paged"])
def test_tree_rows_equal_each_paths_rows_batched_with_chains(model, paged):
    rng = random.Random(3)
    pool = _pool(model) if paged else None
    tree_cache, context = _prefilled(model, rng, paged, pool, 13)
    chain_cache, chain_context = _prefilled(model, rng, paged, pool, 6)
    nodes = [rng.randrange(model.config.vocab_size) for _ in PARENTS]
    chain_block = [chain_context[-1]] + [rng.randrange(model.config.vocab_size) for _ in range(4)]
    tree_rows, chain_rows = forward_packed(model, [chain_cache, tree_cache][::-1], [[context[-1]] + nodes, chain_block],
                                           [1 + len(nodes), len(chain_block)], trees=[_block_tree(PARENTS), None])
    torch.testing.assert_close(tree_rows.logits[0], _plain(model, context, 1)[0], atol=ATOL, rtol=0)
    for node in range(len(PARENTS)):
        path = [nodes[i] for i in path_to(PARENTS, node)]
        torch.testing.assert_close(tree_rows.logits[1 + node], _plain(model, context + path, 1)[0], atol=ATOL, rtol=0)
    want = _plain(model, chain_context + chain_block[1:], len(chain_block))
    torch.testing.assert_close(chain_rows.logits, want, atol=ATOL, rtol=0)
    assert tree_cache.length == len(context) + len(nodes)


@pytest.mark.parametrize("paged", [False, True], ids=["per-session", "paged"])
def test_a_chain_given_as_parents_is_todays_forward_exactly(model, paged):
    rng = random.Random(5)
    pool = _pool(model) if paged else None
    cache, context = _prefilled(model, rng, paged, pool, 9)
    block = [context[-1]] + [rng.randrange(model.config.vocab_size) for _ in range(5)]
    with_parents = forward_packed(model, [cache], [block], [6], trees=[_block_tree([-1, 0, 1, 2, 3])])[0]
    cache.truncate(len(context) - 1)
    without = forward_packed(model, [cache], [block], [6])[0]
    assert torch.equal(with_parents.logits, without.logits)


@pytest.mark.parametrize("paged", [False, True], ids=["per-session", "paged"])
def test_keep_path_of_a_side_path_is_a_session_that_only_saw_it(model, paged):
    rng = random.Random(9)
    pool = _pool(model) if paged else None
    cache, context = _prefilled(model, rng, paged, pool, 11)
    nodes = [rng.randrange(model.config.vocab_size) for _ in PARENTS]
    forward_packed(model, [cache], [[context[-1]] + nodes], [1], trees=[_block_tree(PARENTS)])
    path = path_to(PARENTS, 5)  # [2, 4, 5]: a side path, not a prefix of the block
    cache.keep_path(len(context), path)
    fresh = _new_cache(model, paged, pool)
    forward_packed(model, [fresh], [context + [nodes[i] for i in path]], [1])
    assert cache.length == fresh.length == len(context) + len(path)
    for got, want in zip(_entries(cache), _entries(fresh)):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    following = [rng.randrange(model.config.vocab_size) for _ in range(3)]
    got, want = (forward_packed(model, [c], [following], [3])[0].logits for c in (cache, fresh))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_bad_trees_and_paths_are_refused_and_change_nothing(model):
    cache = ResidentKV(KVLayout.of(model, page_tokens=8))
    with pytest.raises(ValueError, match=r"session 0: parents\[1\] = 1"):
        forward_packed(model, [cache], [[1, 2, 3]], [1], trees=[[-1, 1, 0]])
    with pytest.raises(ValueError, match="one parent per token: 3 tokens, 2 parents"):
        forward_packed(model, [cache], [[1, 2, 3]], [1], trees=[[-1, 0]])
    assert cache.length == 0
    forward_packed(model, [cache], [[1, 2, 3, 4]], [1], trees=[[-1, 0, -1, 2]])
    for start, path in ((1, [1, 0]), (1, [3]), (-1, [0])):
        with pytest.raises(ValueError, match="cannot keep the path"):
            cache.keep_path(start, path)
    assert cache.length == 4


def test_smollm2_tree_rows_and_kept_path(smollm2):
    model = smollm2.model
    install(model)
    rng = random.Random(13)
    cache, context = _prefilled(model, rng, False, None, 10)
    parents = [-1, 0, -1, 2, 3]
    nodes = [rng.randrange(model.config.vocab_size) for _ in parents]
    rows = forward_packed(model, [cache], [[context[-1]] + nodes], [1 + len(nodes)], trees=[_block_tree(parents)])[0]
    for node in range(len(parents)):
        path = [nodes[i] for i in path_to(parents, node)]
        torch.testing.assert_close(rows.logits[1 + node], _plain(model, context + path, 1)[0], atol=2e-4, rtol=0)
    cache.keep_path(len(context), [2, 3, 4])
    following = [rng.randrange(model.config.vocab_size) for _ in range(2)]
    got = forward_packed(model, [cache], [following], [2])[0].logits
    want = _plain(model, context + [nodes[2], nodes[3], nodes[4]] + following, 2)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
