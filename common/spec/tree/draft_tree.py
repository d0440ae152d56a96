"""A draft tree: several candidate continuations of one context, sharing their prefixes.

    tokens   [N]  node i's token
    parents  [N]  node i's parent: -1 for a child of the root (the token right after the context), else an index < i
                  (parents come before their children, so a prefix of the nodes is a tree too)

A chain of g tokens is the tree with parents [-1, 0, 1, ..., g - 2]. The rows that go with a tree:

    p_target [1 + N, V]  row 0 the target's distribution after the context (the root), row 1 + i the one after
                         node i's prefix (the context and the path to node i, inclusive); a chain's [g + 1, V]
    q        [N, V]      row i the draft's distribution node i was drawn from (given its parent's prefix)

Children are kept in index order: the first child of a node is its primary continuation, later children its
alternatives, in the order they were drafted (the multi-path rule reads them in that order).

The functions below read a parents list alone, for whoever holds no tokens: the cloud's forward lays out a block
(the uncached tokens, then the tree; cloud/tree_verify.py `forward_parents`) by them. A node of depth d sits at RoPE
position `past + d - 1` (its distance from the context, minus one) while its KV goes at entry `past + i` (its place
in the block), and it attends to the past and its ancestors (itself included), never to a sibling's branch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROOT = -1  # the parent of the tokens drafted right after the context


def check_parents(parents: list[int], n_tokens: int) -> None:
    """Raise ValueError unless `parents` make a tree over `n_tokens` nodes, parents before children."""
    if len(parents) != n_tokens:
        raise ValueError(f"a draft tree needs one parent per token: {n_tokens} tokens, {len(parents)} parents")
    for i, parent in enumerate(parents):
        if not ROOT <= parent < i:  # also rules out cycles: every edge points to an earlier node
            raise ValueError(f"parents[{i}] = {parent}: a parent must be -1 (the root) or an earlier node "
                             f"(parents before children)")


def is_chain(parents: list[int] | None) -> bool:
    """Whether `parents` (None: a block without a tree) make one path: each node the child of the one before."""
    return parents is None or all(parent == i - 1 for i, parent in enumerate(parents))


def depths(parents: list[int]) -> list[int]:
    """Node i's depth: 1 for a child of the root (its position after the context), its parent's + 1 otherwise."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent == ROOT else out[parent] + 1)
    return out


def path_to(parents: list[int], node: int) -> list[int]:
    """The nodes from the root's child down to `node`, inclusive."""
    path = []
    while node != ROOT:
        path.append(node)
        node = parents[node]
    return path[::-1]


def check_path(parents: list[int], path: list[int]) -> None:
    """Raise ValueError unless `path` is a root-to-node path of the tree (each node the previous one's child)."""
    previous = ROOT
    for node in path:
        if not 0 <= node < len(parents) or parents[node] != previous:
            raise ValueError(f"{path} is not a path of the tree with parents {parents}: {node} does not follow "
                             f"{previous}")
        previous = node


def ancestors(parents: list[int]) -> torch.Tensor:
    """[N, N] bool: row i marks node i's ancestors and i itself (what node i attends to among the nodes)."""
    seen = torch.eye(len(parents), dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent != ROOT:
            seen[i] |= seen[parent]
    return seen


@dataclass(frozen=True)
class DraftTree:
    tokens: list[int]
    parents: list[int]

    def __post_init__(self) -> None:
        check_parents(self.parents, len(self.tokens))

    @classmethod
    def chain(cls, tokens: list[int]) -> "DraftTree":
        """The tree of one path: each token the child of the one before."""
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return is_chain(self.parents)

    def children(self, node: int) -> list[int]:
        """The children of `node` (ROOT for the tokens right after the context), in index order."""
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def depths(self) -> list[int]:
        """Node i's depth: 1 for a child of the root (its position after the context)."""
        return depths(self.parents)

    def tokens_along(self, path: list[int]) -> list[int]:
        """The tokens of the nodes `path` (a root-to-node path, or any nodes), in its order."""
        return [self.tokens[node] for node in path]

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`, inclusive."""
        return path_to(self.parents, node)

    def primary_chain(self, node: int) -> list[int]:
        """`node` and its first-child descendants down to a leaf: the path the rule checks first from `node`."""
        chain = [node]
        while children := self.children(chain[-1]):
            chain.append(children[0])
        return chain

    def leaves(self) -> list[int]:
        has_children = set(self.parents)
        return [i for i in range(len(self.tokens)) if i not in has_children]

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path, as node indices, in leaf order."""
        return [self.path_to(leaf) for leaf in self.leaves()]
