"""A session's target KV cache, resident where the target's forward reads and writes it in place.

Glossary
    length (L)   entries that hold the KV of the session's cached context (positions 0 .. L-1)
    capacity     entries allocated; always a whole number of pages
    page         `KVLayout.page_tokens` entries: the unit of allocation and of the cloud's KV budget
    granted      capacity the session store has charged to the KV budget for the next forward to allocate

Shapes: `keys` and `values` are [layers, kv_heads, capacity, head_dim]; a layer's past is the view
`keys[layer, :, :L]`.

Why not a transformers `DynamicCache`: its `update` concatenates, so every forward copied the
session's whole past once per layer, and batching sessions copied every past again into a
left-padded batch cache. Here a forward writes its n new entries at L .. L+n-1 and attention reads
`keys[layer, :, :L+n]` as a view (cloud/packed_forward.py); rolling back rejected positions only
moves L (`truncate`). The one copy left is growth: when the capacity runs out the entries move to a
buffer `GROWTH` times larger (rounded up to pages), so a generation of N tokens copies at most about
N / (GROWTH - 1) entries in all, never once per call. `copied_bytes` counts it for the metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GROWTH = 1.25  # capacity factor on growth: at most 25% of a session's allocation idle, amortised copies <= 4N


@dataclass(frozen=True)
class KVLayout:
    """The shape of one token's KV in the target model, and how it is allocated."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")
    page_tokens: int = 64
    max_tokens: int = 1 << 20  # no session grows past this (the cloud's context limit plus a block)

    @classmethod
    def of(cls, model: torch.nn.Module, page_tokens: int = 64, max_tokens: int = 1 << 20) -> "KVLayout":
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        parameter = next(model.parameters())
        return cls(config.num_hidden_layers, kv_heads, head_dim, parameter.dtype, parameter.device, page_tokens,
                   max_tokens)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_page(self) -> int:
        return self.page_tokens * self.bytes_per_token

    def pages(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_tokens)


class ResidentKV:
    """One session's KV: written in place by the packed forward, rolled back by moving `length`."""

    shared_tokens = 0  # its buffers are its own: a cached prefix is copied in (`start_from`), never shared

    def __init__(self, layout: KVLayout, reserve_tokens: int = 0) -> None:
        self.layout = layout
        self.length = 0
        self.copied_bytes = 0  # growth copies so far (past entries moved to a larger buffer)
        # Capacity the session store charged to the KV budget before the forward that allocates it (the store
        # decides on the event loop, the forward grows the buffers in the model's thread).
        self.granted = 0
        self.released = False  # the session is gone: the buffers are freed (after the forward under way, if any)
        self.in_forward = False  # the batcher's forward is using the buffers (set and cleared on the event loop)
        self.keys = self._allocate(0)
        self.values = self._allocate(0)
        if reserve_tokens:
            self.reserve(reserve_tokens)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def _allocate(self, capacity: int) -> torch.Tensor:
        layout = self.layout
        return torch.empty((layout.layers, layout.kv_heads, capacity, layout.head_dim), dtype=layout.dtype,
                           device=layout.device)

    def capacity_for(self, tokens: int, headroom: int = 0) -> int:
        """The capacity the growth rule gives for `tokens` entries (the current one if it holds them): at least
        GROWTH x, plus up to `headroom` more, in whole pages, within the session limit."""
        if tokens <= self.capacity:
            return self.capacity
        layout = self.layout
        if tokens > layout.max_tokens:
            raise ValueError(f"{tokens} KV entries exceed this cloud's limit of {layout.max_tokens} per session")
        wanted = max(tokens + headroom, math.ceil(self.capacity * GROWTH))
        return min(layout.pages(wanted), layout.pages(layout.max_tokens)) * layout.page_tokens

    def reserve(self, tokens: int) -> int:
        """Make room for `tokens` entries in all: to the granted capacity if it holds them, else by the growth
        rule; returns the bytes of past entries copied."""
        if tokens <= self.capacity:
            return 0
        if self.released:
            raise ValueError("this session's KV was released")
        capacity = self.granted if tokens <= self.granted else self.capacity_for(tokens)
        keys, values = self._allocate(capacity), self._allocate(capacity)
        keys[:, :, :self.length] = self.keys[:, :, :self.length]
        values[:, :, :self.length] = self.values[:, :, :self.length]
        self.keys, self.values = keys, values
        copied = self.length * self.layout.bytes_per_token
        self.copied_bytes += copied
        return copied

    def start_from(self, pages: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Begin an empty session with a cached prefix: copies each page's (keys, values) [layers, kv_heads, T,
        head_dim] into the buffers, within the granted capacity; returns the bytes copied."""
        if self.length:
            raise ValueError("a cached prefix can only start an empty session")
        page_tokens = self.layout.page_tokens
        self.reserve(len(pages) * page_tokens)
        for i, (keys, values) in enumerate(pages):
            self.keys[:, :, i * page_tokens:(i + 1) * page_tokens] = keys
            self.values[:, :, i * page_tokens:(i + 1) * page_tokens] = values
        self.length = len(pages) * page_tokens
        return self.length * self.layout.bytes_per_token

    def page(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of page `index` of the entries (keys, values), for the prefix cache."""
        span = slice(index * self.layout.page_tokens, (index + 1) * self.layout.page_tokens)
        return self.keys[:, :, span].clone(), self.values[:, :, span].clone()

    def truncate(self, length: int) -> None:
        """Keep the first `length` entries (a rejected block's positions are simply overwritten later)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate {self.length} KV entries to {length}")
        self.length = length

    @torch.inference_mode()  # the buffers are the forward's inference tensors
    def keep_path(self, start: int, path: list[int]) -> None:
        """Keep entries `start + path[m]` (a tree block's chosen path, common/spec/tree/draft_tree.py) as `start + m`,
        and nothing after them: the path's KV moves into place, then the length drops to `start + len(path)`."""
        source, target = moved_entries(self.length, start, path)
        self.keys[:, :, target] = self.keys[:, :, source]  # gathered first: a source overwritten early is read intact
        self.values[:, :, target] = self.values[:, :, source]
        self.truncate(start + len(path))

    def release(self) -> None:
        """The session is gone: free the buffers now, or when the forward using them ends (`end_forward`), even if
        something (a stream's handler) still holds this handle; what the budget no longer charges is not held."""
        self.released = True
        if not self.in_forward:
            self.keys, self.values, self.length = self._allocate(0), self._allocate(0), 0

    def end_forward(self) -> None:
        self.in_forward = False
        if self.released:
            self.release()


def moved_entries(length: int, start: int, path: list[int]) -> tuple[list[int], list[int]]:
    """The entries a kept path moves from and to (those already in place left out); raises ValueError unless the
    path's entries are written (below `length`) and in increasing order, as a tree's path is."""
    entries = [start + node for node in path]
    if start < 0 or any(b <= a for a, b in zip([start - 1] + entries, entries)) or (entries and entries[-1] >= length):
        raise ValueError(f"cannot keep the path {path} from entry {start} of {length} KV entries")
    moves = [(entry, start + m) for m, entry in enumerate(entries) if entry != start + m]
    return [source for source, _ in moves], [target for _, target in moves]
