"""One target forward for the new tokens of many sessions: packed, unpadded, on resident KV caches.

Session i brings n_i >= 1 new tokens on top of its resident cache of length L_i (cloud/resident_kv.py).
With N = sum n_i, the forward sees a single row:

    input_ids     [1, N]   session 0's n_0 tokens, then session 1's n_1, ...
    position_ids  [1, N]   session i's tokens at L_i .. L_i + n_i - 1 (RoPE as if it ran alone)
    logits rows   [K]      only the rows someone reads: session i's last n_logits[i]

Every linear layer (attention projections, MLP, LM head on the kept rows) runs once over the N
tokens: that is where batching pays. Attention is per session (`resident_attention`): session i's
new keys/values [kv_heads, n_i, head_dim] are written into its cache at L_i .. L_i + n_i - 1, then its
queries [1, heads, n_i, head_dim] attend to `keys[layer, :, :L_i + n_i]`, a view of its own cache,
under a causal mask shifted by L_i. No past entry is copied, no session pays for another's context
length, and no padded token is computed. A session alone takes the same path, so its logits are
the same whether it was batched or not (up to the floating-point order of a GEMM over more rows).

A session's block may be a tree of tokens (`trees[i]`, common/spec/tree/draft_tree.py): its tokens are still
written at L_i .. L_i + n_i - 1 in the block's order, but each sits at RoPE position L_i + its depth and
attends to the past and its ancestors only, so its row is the row it would get at the end of its own
path. Only one path's entries are kept afterwards: `keep_path` moves them into place.

With the paged layout (cloud/kv_pool.py, the default on CUDA) the sessions' caches are pages of one
pool, and attention is one call per layer for all of them (cloud/paged_attention.py) instead of
one per session: a GPU pays per kernel launch, a CPU per score computed.

On the way in, every integer the forward needs travels to the device as one tensor; on the way
out, the kept rows' argmaxes and the logits of the sessions that read them come back as one tensor.

The attention function is registered with transformers under `ATTENTION` and falls back to SDPA
when a forward carries no resident segments, so the model stays usable as an ordinary one.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from cloud.engine import TargetRows
from cloud.kv_pool import PagedKV
from cloud.paged_attention import PagedBatch, PagedPlan, fused, paged_attention
from cloud.query_tiles import tiles_for
from cloud.resident_kv import ResidentKV
from common.spec.tree.draft_tree import ancestors, check_parents, depths, is_chain

ATTENTION = "sprinter_resident"


@dataclass(frozen=True)
class Segment:
    """Session i's share of a packed forward: its cache, where its tokens start in the row, and how many."""

    cache: ResidentKV
    start: int  # first column of its tokens in the packed row
    count: int  # n_i
    past: int  # L_i: cache entries before this forward
    causal: torch.Tensor | None  # [n_i, L_i + n_i] bool: which keys query row r sees (None: one query sees all)


def resident_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, heads, N, head_dim]; key, value [1, kv_heads, N, head_dim] (this forward's tokens only).

    Returns the attention output [1, N, heads, head_dim], as transformers' attention functions do.
    """
    paged: PagedBatch | None = kwargs.pop("paged_batch", None)
    if paged is not None:
        return paged_attention(module, query, key, value, paged, scaling), None
    segments: list[Segment] | None = kwargs.pop("resident_segments", None)
    if segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    layer = module.layer_idx
    outputs = []
    for segment in segments:
        new, end = slice(segment.start, segment.start + segment.count), segment.past + segment.count
        keys, values = segment.cache.keys[layer], segment.cache.values[layer]  # [kv_heads, capacity, head_dim]
        keys[:, segment.past:end] = key[0, :, new]
        values[:, segment.past:end] = value[0, :, new]
        outputs.append(F.scaled_dot_product_attention(
            query[:, :, new], keys[None, :, :end], values[None, :, :end], attn_mask=segment.causal, scale=scaling,
            enable_gqa=keys.shape[0] != query.shape[1]))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def install(model: PreTrainedModel) -> None:
    """Make `model` run its attention through `resident_attention` (idempotent)."""
    # Sliding-window or linear-attention layers keep truncated states: a resident full history is another design.
    layer_types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise NotImplementedError(f"the resident KV engine supports full-attention layers only, not {sorted(layer_types)}")
    AttentionInterface.register(ATTENTION, resident_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # the SDPA fallback gets the masks SDPA would
    if model.config._attn_implementation != ATTENTION:
        model.set_attn_implementation(ATTENTION)


def packed_forward_of(model: PreTrainedModel, query_tiles: bool = False,
                      replay: Replay | None = None) -> Callable[..., list[TargetRows]]:
    """`model`'s packed forward as the batcher calls it (cloud/batcher.py: PackedForward), its attention installed;
    `query_tiles`: paged forwards pad each session's rows to the kernel's query tile (cloud/query_tiles.py);
    `replay`: CUDA graphs' (cloud/cuda_graphs.py)."""
    install(model)
    options = ({"query_tiles": True} if query_tiles else {}) | ({"replay": replay} if replay is not None else {})

    def forward(*args: Any, **kwargs: Any) -> list[TargetRows]:
        return forward_packed(model, *args, **kwargs, **options)  # looked up per call: a test's spy may stand in

    return forward


def _check(caches: list[ResidentKV | PagedKV], new_tokens: list[list[int]], n_logits: list[int],
           trees: list[list[int] | None]) -> None:
    if not caches or not len(caches) == len(new_tokens) == len(n_logits) == len(trees):
        raise ValueError("caches, new_tokens, n_logits and trees must be non-empty lists of the same length")
    for i, (tokens, tree) in enumerate(zip(new_tokens, trees)):
        if tree is not None:
            try:
                check_parents(tree, len(tokens))
            except ValueError as err:
                raise ValueError(f"session {i}: {err}") from None
    if len({type(cache) for cache in caches}) != 1 or len({id(getattr(c, "pool", None)) for c in caches}) != 1:
        raise ValueError("one forward's caches must be of one kind (ResidentKV, or PagedKV of one pool)")
    if len({id(cache) for cache in caches}) != len(caches):
        raise ValueError("a session may appear once per forward")
    for i, (tokens, n) in enumerate(zip(new_tokens, n_logits)):
        if not 1 <= n <= len(tokens):
            raise ValueError(f"session {i}: n_logits={n} is outside 1..{len(tokens)} (its number of new tokens)")


@torch.inference_mode()
def forward_packed(model: PreTrainedModel, caches: list[ResidentKV] | list[PagedKV], new_tokens: list[list[int]],
                   n_logits: list[int], full_logits: list[bool] | None = None,
                   trees: list[list[int] | None] | None = None, query_tiles: bool = False,
                   replay: Replay | None = None) -> list[TargetRows]:
    """Run session i's `new_tokens[i]` on top of `caches[i]`, all in one forward; the caches grow in place.

    Returns, per session, the rows of its last `n_logits[i]` new positions (row r predicts the token
    after the r-th of them): their argmax [n], and their float32 logits [n, V] where `full_logits[i]`
    (default: every session). The inputs go to the device in one copy and the rows come back in one,
    with no synchronisation per session. Caches are ResidentKV (attention per session) or PagedKV of
    one pool (cloud/paged_attention.py). `trees[i]`: session i's block as a tree (module docstring); None: a
    chain. `query_tiles`: paged, each session's rows padded to the kernel's query tile where the forward is small
    enough (cloud/query_tiles.py); the rows are the same. `replay`: the logits from a CUDA graph where it has one
    for this forward (cloud/cuda_graphs.py), None to run it eagerly. `install(model)` must have run.
    """
    trees = trees if trees is not None else [None] * len(caches)
    _check(caches, new_tokens, n_logits, trees)
    trees = _chains_as_none(trees, len(caches))
    inputs = pack(model, caches, new_tokens, n_logits, trees, query_tiles)
    logits = replay(inputs) if replay is not None else None
    if logits is None:
        logits = run_packed(model, inputs, inputs.host.to(model.device), caches, new_tokens, trees)
    for cache, tokens in zip(caches, new_tokens):  # only now: a forward that raised leaves every length as it was
        cache.length += len(tokens)
    return _read_rows(logits, n_logits, full_logits or [True] * len(caches))


@dataclass(frozen=True)
class PackedInputs:
    """Every integer one forward needs, as one host tensor: ids [N], positions [N], kept rows [K], then the plan's."""

    host: torch.Tensor
    n: int  # N: columns of the packed row (new tokens, and with query tiles their padding)
    k: int  # K: rows whose logits are kept
    plan: PagedPlan | None  # the page tables, for caches of a pool


# A forward's logits [K, V] replayed from a CUDA graph (cloud/cuda_graphs.py), or None: run it eagerly.
Replay = Callable[[PackedInputs], "torch.Tensor | None"]


def pack(model: PreTrainedModel, caches: list[ResidentKV] | list[PagedKV], new_tokens: list[list[int]],
         n_logits: list[int], trees: list[list[int] | None] | None = None, query_tiles: bool = False) -> PackedInputs:
    """Reserve each cache's new entries and lay out the forward's inputs (the lengths do not move yet); with
    `query_tiles` and a pool, a small enough forward's rows are padded per session (cloud/query_tiles.py)."""
    trees = _chains_as_none(trees, len(caches))
    for cache, tokens in zip(caches, new_tokens):
        cache.reserve(cache.length + len(tokens))
    ids = [t for tokens in new_tokens for t in tokens]
    positions = [cache.length + offset for cache, tokens, tree in zip(caches, new_tokens, trees)
                 for offset in ([d - 1 for d in depths(tree)] if tree is not None else range(len(tokens)))]
    ends = list(accumulate(len(tokens) for tokens in new_tokens))
    kept_rows = [row for end, n in zip(ends, n_logits) for row in range(end - n, end)]
    paged = isinstance(caches[0], PagedKV)
    tiles = tiles_for([len(tokens) for tokens in new_tokens]) if query_tiles and paged else None
    plan = PagedPlan.of(caches, new_tokens, fused(model.device.type), trees, tiles) if paged else None
    if tiles is not None:  # a padding column repeats its session's last token and position; only real rows are kept
        ids, positions = [ids[row] for row in tiles.source], [positions[row] for row in tiles.source]
        kept_rows = [tiles.real_rows[row] for row in kept_rows]
    host = torch.tensor(ids + positions + kept_rows)
    return PackedInputs(torch.cat([host, plan.host]) if plan else host, len(ids), len(kept_rows), plan)


def run_packed(model: PreTrainedModel, inputs: PackedInputs, packed: torch.Tensor,
               caches: list[ResidentKV] | list[PagedKV], new_tokens: list[list[int]],
               trees: list[list[int] | None] | None = None) -> torch.Tensor:
    """The model over `packed` (`inputs.host` on the device): the kept rows' logits [K, V], KV written in place.

    Paged, every tensor the forward reads is a slice of `packed`, so the forward can be captured as a CUDA graph
    and replayed over new contents of the same buffer (sim/gpu_check/graphs.py)."""
    n, k, plan = inputs.n, inputs.k, inputs.plan
    attention = ({"paged_batch": plan.on_device(packed[2 * n + k:])} if plan else
                 {"resident_segments": _segments(caches, new_tokens, _chains_as_none(trees, len(caches)),
                                                 model.device)})
    out = model(input_ids=packed[None, :n], position_ids=packed[None, n:2 * n], use_cache=False,
                logits_to_keep=packed[2 * n:2 * n + k], **attention)
    return out.logits[0]


def _chains_as_none(trees: list[list[int] | None] | None, sessions: int) -> list[list[int] | None]:
    """One entry per session, None for a chain: a chain given as parents takes the chain's path exactly."""
    return [None if tree is None or is_chain(tree) else tree for tree in trees] if trees is not None else [None] * sessions


def _segments(caches: list[ResidentKV], new_tokens: list[list[int]], trees: list[list[int] | None],
              device: torch.device) -> list[Segment]:
    segments, start = [], 0
    for cache, tokens, tree in zip(caches, new_tokens, trees):
        end = cache.length + len(tokens)
        if tree is not None:  # the past, then the tree's ancestors
            causal = torch.cat([torch.ones(len(tokens), cache.length, dtype=torch.bool), ancestors(tree)], 1).to(device)
        else:
            causal = (None if len(tokens) == 1 else  # built once per forward, read by every layer
                      torch.ones(len(tokens), end, dtype=torch.bool, device=device).tril(diagonal=cache.length))
        segments.append(Segment(cache, start, len(tokens), cache.length, causal))
        start += len(tokens)
    return segments


def _read_rows(logits: torch.Tensor, n_logits: list[int], full_logits: list[bool]) -> list[TargetRows]:
    """logits [K, V] on the model's device -> each session's TargetRows on the host, in one copy.

    The argmaxes ride along as float32 (exact for token ids below 2^24), after the full rows.
    """
    bounds = list(accumulate(n_logits, initial=0))
    if logits.shape[-1] > 1 << 24:
        raise ValueError(f"a vocabulary of {logits.shape[-1]} ids does not fit the float32 readout")
    full = torch.cat([logits[bounds[i]:bounds[i + 1]] for i, f in enumerate(full_logits) if f] or [logits[:0]]).float()
    host = torch.cat([full.flatten(), logits.argmax(-1).float()]).cpu()
    argmax = host[full.numel():].long()
    full = host[:full.numel()].view(-1, logits.shape[-1])
    rows, offset = [], 0
    for i, n in enumerate(n_logits):
        session_logits = None
        if full_logits[i]:
            session_logits, offset = full[offset:offset + n], offset + n
        rows.append(TargetRows(argmax[bounds[i]:bounds[i + 1]], session_logits))
    return rows
