"""Attention of a packed forward over the KV pool: one flex_attention call per layer for all sessions.

Shapes (N new tokens in the packed row; S = P * T slots, P the pages up to the highest one read, T a page):
    query         [1, heads, N, head_dim]
    key, value    [1, kv_heads, N, head_dim]   this forward's entries, written to their slots first
    pool layer    [1, kv_heads, S, head_dim]   what every query reads, through the block mask

The block mask is the sessions' page tables: query rows go in blocks of Q_BLOCK, and each block lists
the pages of the sessions its rows belong to (a kv block is a page); with query tiles (cloud/query_tiles.py)
each session's rows are padded to 16-row blocks, so a block lists one session's pages. Within those, `mask_mod` keeps
slot s for query q when s's page is in q's session's page table and s's entry there is at most q's
entry: a session sees its own past (pages it shares with others included) and the causal part of its
block, nothing else of any other session's. A query's entry (where its KV is written) is not its RoPE
position when its block is a tree (common/spec/tree/draft_tree.py): then the block's part of the mask is the tree's
ancestor table, and the entries travel apart from the positions. No
past entry is copied and no page outside a block's sessions is read. On CUDA flex_attention is
compiled into one fused kernel; on the CPU it runs unfused (per-session attention, the CPU default,
is faster there: cloud/packed_forward.py).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from cloud.kv_pool import KVPool, PagedKV
from cloud.query_tiles import TileLayout
from common.spec.tree.draft_tree import ancestors

Q_BLOCK = 128  # query rows per block of the mask
# A pool's page, and so the mask's kv block: a multiple of the fused kernel's key block (64 or 128 on Hopper).
PAGE_TOKENS_PAGED = 128


def fused(device_type: str) -> bool:
    """Whether flex_attention is compiled into a fused kernel on this device: CUDA; on a CPU it runs unfused."""
    return device_type == "cuda"


# The fused kernel's tiles, set rather than left to torch's table, whose default for head_dim 128 in bfloat16 asks an
# H100 for 256 KiB of shared memory (its limit is 227 KiB) and fails to compile. Measured on an H100 (1.5B shapes,
# 8 sessions x 6 tokens, 1k context): 16 x 128 tiles take 0.25 ms a layer against 0.71 ms for 64 x 64, as a verify
# block has few query rows to spread over the GPU; a prefill's many rows keep 64 x 64. Both divide the mask's blocks.
VERIFY_KERNEL_OPTIONS = {"BLOCK_M": 16, "BLOCK_N": 128, "num_stages": 2}
PREFILL_KERNEL_OPTIONS = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2}


def flex_for(device_type: str, n_tokens: int) -> Callable[..., torch.Tensor]:
    """flex_attention compiled for CUDA, tiled for `n_tokens` query rows; as it is on the CPU (a reference path)."""
    if not fused(device_type):
        return _unfused_flex
    options = VERIFY_KERNEL_OPTIONS if n_tokens <= Q_BLOCK else PREFILL_KERNEL_OPTIONS
    return functools.partial(_compiled_flex(), kernel_options=options)


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    return torch.compile(flex_attention, dynamic=True)


def _unfused_flex(*args, **kwargs) -> torch.Tensor:
    with warnings.catch_warnings():  # the CPU's choice, said in the module docstring: not worth a warning per layer
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)


@dataclass(frozen=True)
class PagedBatch:
    """What every layer of one forward needs: the pool, the new entries' slots and the block mask."""

    pool: KVPool
    span_slots: int  # S: the slots attention reads, 0 .. S - 1 (the unfused path computes a score for each)
    slots: torch.Tensor  # [W] int64: pool slot of each new entry (W: the real rows)
    written_rows: torch.Tensor | None  # [W] int64: the row of each new entry with query tiles; None: every row
    block_mask: BlockMask
    attend: Callable[..., torch.Tensor]


@dataclass(frozen=True)
class PagedPlan:
    """A forward's page tables, as host integers that travel with the packed inputs (one copy)."""

    pool: KVPool
    n_tokens: int  # N: query rows (with query tiles, padding rows included)
    n_written: int  # W: new entries written (the real rows; N without query tiles)
    span: int  # P: pages 0 .. P-1 hold every page this forward reads (pages are taken lowest first)
    sessions: int  # R: sessions in the forward
    tiled: bool  # query tiles per session (cloud/query_tiles.py): padding rows, and a block is one tile
    q_block: int  # query rows per block of the mask: Q_BLOCK, or the query tile
    q_blocks: int
    width: int  # kv blocks listed per query block (the most any block has)
    tree_width: int  # A: the largest tree block's tokens; 0: every block is a chain
    host: torch.Tensor  # int64, on the host: slots [W], with tiles written_rows [W], q_session [N], entries [N],
    #                     page_index [R, P], kv_num_blocks [B], kv_indices [B, W']; with trees, block_start [N],
    #                     ancestors [N, A]

    @classmethod
    def of(cls, caches: list[PagedKV], new_tokens: list[list[int]], fused: bool,
           trees: list[list[int] | None] | None = None, tiles: TileLayout | None = None) -> PagedPlan:
        """After every cache reserved its new entries (their pages are taken), before their lengths move.

        `page_index[r, p]` is page p's index in session r's page table, or -1: a page is read through each
        session's own table, so two sessions that share a page (a cached prefix, cloud/prefix_cache.py) in one
        forward each see it at its place in their own past. A query block lists a page shared by its sessions
        once (a page listed twice would be attended twice).

        `fused`: the mask spans the whole pool and lists up to every page per block, so the compiled kernel
        sees the same key length and mask width in every forward; the fused kernel reads only the listed
        pages. Unfused, a score is computed for every slot of the span: it ends at the highest page read.

        `tiles`: the query rows are the padded rows of this layout and a query block is one tile, so each block
        holds one session's rows and lists only its pages (cloud/query_tiles.py); padding rows write nothing."""
        pool = caches[0].pool
        read = [cache.pages[:cache.layout.pages(cache.length + len(tokens))] for cache, tokens in zip(caches, new_tokens)]
        span = pool.pages if fused else max(page for pages in read for page in pages) + 1
        slots = [slot for cache, tokens in zip(caches, new_tokens)
                 for slot in cache.slots(cache.length, cache.length + len(tokens))]
        source = tiles.source if tiles is not None else list(range(len(slots)))  # each query row's real row
        q_block = tiles.tile if tiles is not None else Q_BLOCK
        sessions_of = [i for i, tokens in enumerate(new_tokens) for _ in tokens]
        q_session = [sessions_of[row] for row in source]
        block_pages = [list(dict.fromkeys(page for s in dict.fromkeys(q_session[start:start + q_block])
                                          for page in read[s]))
                       for start in range(0, len(q_session), q_block)]
        width = span if fused else max(len(pages) for pages in block_pages)
        # Tensors, not lists, where the size is the pool's: a fused plan's cost grows with the pages read only.
        sessions = len(caches)
        tables = torch.zeros(sessions * span + len(block_pages) * (1 + width), dtype=torch.long)
        page_index = tables[:sessions * span]
        kv_num_blocks = tables[sessions * span:sessions * span + len(block_pages)]
        kv_indices = tables[sessions * span + len(block_pages):].view(len(block_pages), width)
        page_index.fill_(-1)
        entries = torch.tensor([r * span + page for r, pages in enumerate(read) for page in pages])
        page_index[entries] = torch.tensor([j for pages in read for j in range(len(pages))])
        for b, pages in enumerate(block_pages):
            kv_num_blocks[b] = len(pages)
            kv_indices[b, :len(pages)] = torch.tensor(pages)
        entries = [e for cache, tokens in zip(caches, new_tokens) for e in range(cache.length, cache.length + len(tokens))]
        tree_width, tree_ints = _tree_tables(caches, new_tokens, trees, source)
        written = tiles.real_rows if tiles is not None else []
        host = torch.cat([torch.tensor(slots + written + q_session + [entries[row] for row in source]), tables,
                          tree_ints])
        return cls(pool, len(source), len(slots), span, sessions, tiles is not None, q_block, len(block_pages), width, tree_width, host)

    def on_device(self, packed: torch.Tensor) -> PagedBatch:
        """`packed`: this plan's ints on the device."""
        n, w, pages, blocks, page_tokens = self.n_tokens, self.n_written, self.span, self.q_blocks, self.pool.layout.page_tokens
        tiled = self.tiled
        slots = packed[:w]
        written_rows = packed[w:2 * w] if tiled else None
        rows = packed[2 * w if tiled else w:]
        q_session, entries = rows[:n], rows[n:2 * n]
        table_end = 2 * n + self.sessions * pages
        page_index = rows[2 * n:table_end]
        rest = rows[table_end:]
        kv_num_blocks = rest[:blocks].to(torch.int32).view(1, 1, blocks)
        kv_indices = rest[blocks:blocks * (1 + self.width)].to(torch.int32).view(1, 1, blocks, self.width)
        tree_width, tree = self.tree_width, rest[blocks * (1 + self.width):]
        block_start, tree_ancestors = tree[:n], tree[n:]

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            index = page_index[q_session[q] * pages + kv // page_tokens]  # -1: not a page of q's session
            entry = index * page_tokens + kv % page_tokens
            seen = (index >= 0) & (entry <= entries[q])
            if not tree_width:
                return seen
            in_block = (entry - block_start[q]).clamp(0, tree_width - 1)  # past entries read the past's rule
            return seen & ((entry < block_start[q]) | (tree_ancestors[q * tree_width + in_block] != 0))

        block_mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=(self.q_block, page_tokens),
                                              mask_mod=mask_mod, seq_lengths=(n, pages * page_tokens),
                                              compute_q_blocks=False)
        return PagedBatch(self.pool, pages * page_tokens, slots, written_rows, block_mask,
                          flex_for(packed.device.type, n))


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    batch: PagedBatch, scaling: float | None) -> torch.Tensor:
    """Write this forward's keys and values into their slots, then attend over the pool; [1, N, heads, head_dim]."""
    layer = module.layer_idx
    keys, values = batch.pool.keys[layer], batch.pool.values[layer]  # [kv_heads, pool slots, head_dim]
    key, value = key[0], value[0]  # [kv_heads, N, head_dim]
    if batch.written_rows is not None:  # query tiles: padding rows write nothing
        key, value = key.index_select(1, batch.written_rows), value.index_select(1, batch.written_rows)
    keys.index_copy_(1, batch.slots, key)
    values.index_copy_(1, batch.slots, value)
    keys, values = keys[:, :batch.span_slots], values[:, :batch.span_slots]  # [kv_heads, S, head_dim]
    out = batch.attend(query, keys[None], values[None], block_mask=batch.block_mask, scale=scaling,
                       enable_gqa=keys.shape[0] != query.shape[1])
    return out.transpose(1, 2).contiguous()


def _tree_tables(caches: list[PagedKV], new_tokens: list[list[int]], trees: list[list[int] | None] | None,
                 source: list[int]) -> tuple[int, torch.Tensor]:
    """With a tree in the forward: its width A, and block_start [N] (each query's first block entry) then
    ancestors [N, A] (which of its block's entries a query sees); query row q is real row `source[q]`'s."""
    if trees is None or all(tree is None for tree in trees):
        return 0, torch.zeros(0, dtype=torch.long)
    width = max(len(tokens) for tokens, tree in zip(new_tokens, trees) if tree is not None)
    starts, rows = [], []
    for cache, tokens, tree in zip(caches, new_tokens, trees):
        # A chain's entries <= the query's are all its ancestors: the mask's entry bound is the whole rule there.
        seen = ancestors(tree) if tree is not None else torch.ones(len(tokens), width, dtype=torch.bool)
        rows.append(F.pad(seen, (0, width - seen.shape[1])).long())
        starts += [cache.length] * len(tokens)
    index = torch.tensor(source)
    return width, torch.cat([torch.tensor(starts)[index], torch.cat(rows)[index].flatten()])
