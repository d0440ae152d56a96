"""Query tiles per session: each session's rows in a packed forward padded to the fused kernel's query tile.

Paged attention (cloud/paged_attention.py) lists, for each block of query rows, the pages its rows may read. With
128-row blocks every session of a verify batch shares one block (8 sessions x 6 rows = 48 rows), so the fused kernel
tiles each session's rows against every session's pages and masks most of the scores away. With query tiles each
session's rows are padded to a whole number of the kernel's 16-row tiles (VERIFY_KERNEL_OPTIONS' BLOCK_M) and the
mask's query blocks are 16 rows: a block then holds one session's rows and lists only that session's pages.

A padding row repeats its session's last real row (token, position, KV entry, tree ancestors): it attends to what
that row attends to, so it is never a fully masked row, and its output is never read. It writes no KV: only the real
rows' keys and values go into the pool (`TileLayout.real_rows`). Every other layer works row by row, so no real
row's output depends on a padding row.

A forward is tiled only while its padded rows fit one 128-row block (`tiles_for`): below that a GEMM is bound by
reading the weights, so the padding costs the linear layers next to nothing; a larger forward (a prefill chunk,
many decoding sessions) keeps 128-row blocks, where padding would cost real compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

TILE_ROWS = 16  # the verify kernel's BLOCK_M (cloud/paged_attention.py: VERIFY_KERNEL_OPTIONS)
MAX_TILED_ROWS = 128  # the untiled mask's query block (Q_BLOCK): a tiled forward's rows fit it


@dataclass(frozen=True)
class TileLayout:
    """Where each real row of a packed forward goes once every session's rows are padded to whole tiles.

    Rows are the packed row's columns: session 0's n_0 rows, then session 1's, ... (cloud/packed_forward.py)."""

    tile: int
    counts: tuple[int, ...]  # n_i: real rows per session
    padded_counts: tuple[int, ...]  # n_i rounded up to a whole number of tiles

    @property
    def rows(self) -> int:
        """The padded forward's rows (a whole number of tiles)."""
        return sum(self.padded_counts)

    @property
    def real_rows(self) -> list[int]:
        """[sum n_i]: the padded row of each real row, in order (the rows that write KV and may be kept)."""
        starts = accumulate(self.padded_counts, initial=0)
        return [start + r for start, n in zip(starts, self.counts) for r in range(n)]

    @property
    def source(self) -> list[int]:
        """[rows]: the real row each padded row repeats (itself for a real row, its session's last for padding)."""
        ends = list(accumulate(self.counts))
        return [end - n + min(r, n - 1) for end, n, padded in zip(ends, self.counts, self.padded_counts)
                for r in range(padded)]

    @property
    def tile_session(self) -> list[int]:
        """[rows / tile]: the one session whose rows fill each tile."""
        return [i for i, padded in enumerate(self.padded_counts) for _ in range(padded // self.tile)]


def tile_layout(counts: list[int], tile: int = TILE_ROWS) -> TileLayout:
    """The layout of sessions with `counts[i]` >= 1 rows each, each padded to a multiple of `tile` rows."""
    if tile < 1 or not counts or min(counts) < 1:
        raise ValueError(f"a tile layout needs a tile >= 1 and >= 1 row per session, got tile {tile}, rows {counts}")
    return TileLayout(tile, tuple(counts), tuple(-(-n // tile) * tile for n in counts))


def tiles_for(counts: list[int], tile: int = TILE_ROWS) -> TileLayout | None:
    """The tile layout of a forward that query tiles apply to (its padded rows fit MAX_TILED_ROWS); None: untiled."""
    layout = tile_layout(counts, tile)
    return layout if layout.rows <= MAX_TILED_ROWS else None
