"""What a draft tree (VerifyBlock.parents) adds as the target host runs a verify frame: one forward over the whole
tree, the rows the rule reads, and which rows and KV entries it keeps (a frame's verdict: cloud/frames.py
`frame_decision`).

    uncached   the session's tokens the engine has not seen yet (the last verdict's next token): a chain fed first
    tree       N draft tokens, parents[i] in -1 .. i - 1 (-1: a child of the session's last token)
    rows       [1 + N]: row 0 after the session's context (the row of its last token), row 1 + i after node i's path
    path       the verdict's kept nodes, root to last kept (common/spec/acceptance_rules.py `Decision.path`)

The forward writes all N nodes' KV (N entries charged, not the tree's depth); the kept path's entries are then
moved into place (`keep_path`) and the rest dropped, within the capacity the session was granted.

Logit shaping (bias, penalties, grammar) depends on the tokens before a row: each root-to-leaf path is shaped as a
chain is, so a node's row sees its own path's tokens, never a sibling branch's.
"""

from __future__ import annotations

import torch

from cloud.engine import TargetRows
from common.spec.tree.draft_tree import ROOT, DraftTree
from common.sampling.logits_processing import LogitsProcessor


def forward_parents(uncached: int, parents: list[int]) -> list[int]:
    """The forward's parents over `uncached` chained tokens then the tree (common/spec/tree/draft_tree.py): the tree's
    roots follow the last uncached token."""
    chain = list(range(-1, uncached - 1))
    return chain + [parent + uncached if parent != ROOT else uncached - 1 for parent in parents]


def shaped_tree_rows(rows: TargetRows, processor: LogitsProcessor | None, context: list[int],
                     tree: DraftTree) -> TargetRows:
    """`rows` [1 + N] after the request's shaping: row 0 after `context`, row 1 + i after `context` and node i's path
    (what the rule and the sampler read). Without shaping, the rows as they are."""
    if processor is None or not processor.active:
        return rows
    logits = rows.logits.clone()
    for path in tree.paths():  # a root-to-leaf path is a chain: shaped as one, a grammar never fed a refused token
        index = torch.tensor([0] + [1 + node for node in path])
        logits[index] = processor.rows(rows.logits[index], context, tree.tokens_along(path))
    return TargetRows(logits.argmax(dim=-1), logits)


def kept_path(tree: DraftTree, path: list[int], next_token: int,
              rows: TargetRows) -> tuple[list[int], TargetRows, bool]:
    """What a tree's verdict keeps: its tokens (the path's, then `next_token`), the rows that scored them, as a chain's
    [len(path) + 1], and whether the path is on the tree's primary chain."""
    index = torch.tensor([0] + [1 + node for node in path])
    kept_rows = TargetRows(rows.argmax[index], rows.logits[index] if rows.logits is not None else None)
    return tree.tokens_along(path) + [next_token], kept_rows, on_primary_chain(tree, path)


def on_primary_chain(tree: DraftTree, path: list[int]) -> bool:
    """Whether the kept path is a prefix of the tree's primary chain (the root's first child and its first children):
    the one path the edge drafts candidate blocks along."""
    roots = tree.children(ROOT)
    return not path or bool(roots) and tree.primary_chain(roots[0])[:len(path)] == path
