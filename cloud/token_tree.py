"""A forward's block of new tokens as a tree: which earlier token of the block each one follows.

A block's `parents[j]` is the index in the block of the token that token j follows, or -1 when it follows the
session's cached past directly; parents come before children (parents[j] < j). A chain is [-1, 0, 1, ...]: every
token follows the one before, which is what a block without a tree means. Token j then sits at RoPE position
`past + depth[j]` (its distance from the past) while its KV is written at entry `past + j` (its place in the block),
and it attends to the past and to its ancestors in the block (itself included), never to a sibling's branch.
"""

from __future__ import annotations

import torch


def check_parents(parents: list[int], n_tokens: int) -> None:
    """Raise ValueError unless `parents` is a tree over `n_tokens` tokens in the block's order."""
    if len(parents) != n_tokens:
        raise ValueError(f"a tree over {n_tokens} tokens needs {n_tokens} parents, not {len(parents)}")
    for j, parent in enumerate(parents):
        if not -1 <= parent < j:
            raise ValueError(f"parents[{j}] = {parent} is outside -1..{j - 1} (a parent comes before its child)")


def is_chain(parents: list[int] | None) -> bool:
    return parents is None or all(parent == j - 1 for j, parent in enumerate(parents))


def depths(parents: list[int]) -> list[int]:
    """Each token's distance from the past: 0 for a token that follows the past, its parent's + 1 otherwise."""
    out: list[int] = []
    for parent in parents:
        out.append(0 if parent < 0 else out[parent] + 1)
    return out


def ancestors(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: row j marks token j's ancestors in the block and j itself (what j attends to in the block)."""
    n = len(parents)
    seen = torch.eye(n, dtype=torch.bool)
    for j, parent in enumerate(parents):
        if parent >= 0:
            seen[j] |= seen[parent]
    return seen


def path_to(parents: list[int], node: int) -> list[int]:
    """The block indices from the first token after the past down to `node`, in order."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def check_path(parents: list[int], path: list[int]) -> None:
    """Raise ValueError unless `path` is a root-to-node path of the tree (each entry the previous one's child)."""
    previous = -1
    for node in path:
        if not 0 <= node < len(parents) or parents[node] != previous:
            raise ValueError(f"{path} is not a path of the tree with parents {parents}: {node} does not follow "
                             f"{previous}")
        previous = node
