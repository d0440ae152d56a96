"""A causal LM together with its KV cache and the tokens that cache holds.

`advance_to(context)` is the only way in: it keeps the longest cached prefix of `context`, crops the
rest (rollback after a rejection is just the next call with a shorter context) and feeds what is
missing in one forward. The last token is always fed, so the caller always gets its logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor  # [n, V] float32: row i predicts the token after the i-th of the last n positions
    hidden: torch.Tensor | None  # [n, H] last-layer hidden states there, when asked for


class DraftLM(Protocol):
    """What drafting needs of a runtime: the torch `CachedLM` and the edge's ONNX runtime both fit. A runtime whose
    `batches` is true also has `advance_batch` (a tree's branches at one point drafted side by side)."""

    batches: bool

    def advance_to(self, context: list[int], n_logits: int = 1) -> ForwardOutput: ...


def greedy_continuation(lm: DraftLM, context: list[int], new_tokens: int) -> list[int]:
    """`context` followed by `lm`'s `new_tokens` greedy tokens, one forward each (no stop at end of text)."""
    tokens = list(context)
    for _ in range(new_tokens):
        tokens.append(int(lm.advance_to(tokens, 1).logits[-1].argmax()))
    return tokens


def top1_matches(lm: DraftLM, tokens: list[int], start: int) -> list[bool]:
    """Whether `lm`'s top-1 is the token there, at each position of `tokens` from `start` on: one forward over the
    text (teacher forcing), as a greedy speculative round would see each position."""
    proposed = lm.advance_to(tokens[:-1], len(tokens) - start).logits.argmax(-1).tolist()
    return [p == t for p, t in zip(proposed, tokens[start:])]


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Fork:
    """Copies of a cache's KV side by side (batch rows), one per branch, and the tokens each row holds: a
    `DynamicCache` in `CachedLM`, the past tensors in the ONNX runtime."""

    cache: object
    rows: list[list[int]]

    def continued_by(self, contexts: list[list[int]]) -> bool:
        """Each context extends its row by the same number of tokens (one or more)."""
        return (len(contexts) == len(self.rows) and len({len(c) - len(r) for c, r in zip(contexts, self.rows)}) == 1
                and len(contexts[0]) > len(self.rows[0]) and all(c[:len(r)] == r for c, r in zip(contexts, self.rows)))


def shared_prefix(contexts: list[list[int]]) -> int:
    """The length of the prefix rows drafted side by side start from: what all `contexts` share, each keeping at
    least one token to feed. They must have one length (the rows grow in step)."""
    shared = min([common_prefix_length(contexts[0], c) for c in contexts] + [len(c) - 1 for c in contexts])
    if len({len(c) for c in contexts}) != 1 or shared < 1:
        raise ValueError("branches drafted side by side share a prefix and have one length")
    return shared


class CachedLM:
    def __init__(self, model: PreTrainedModel, with_hidden: bool = False) -> None:
        self.model = model
        self.with_hidden = with_hidden
        self.cache = DynamicCache(config=model.config)
        self.tokens: list[int] = []
        self.forward_calls = 0
        self._fork: Fork | None = None  # the branches' rows (`advance_batch`), until the next single forward

    def rollback(self, length: int) -> None:
        drop = len(self.tokens) - length
        if drop > 0:
            self.cache.crop(-drop)  # transformers 5.23: crop takes a negative count (tokens to drop)
            del self.tokens[length:]

    @property
    def reusable(self) -> bool:
        """Whether a copy of this cache stands for its tokens: plain layers, none a sliding window (which keeps only
        its last positions, so a copy cut shorter would lack the rows before them)."""
        return all(type(layer) is DynamicLayer for layer in self.cache.layers)

    def kv_snapshot(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
        """An owned copy of the KV of `tokens` (the edge's draft cache keeps it across requests), and its bytes."""
        kv = [(layer.keys.clone(), layer.values.clone()) for layer in self.cache.layers]
        return kv, sum(keys.nbytes + values.nbytes for keys, values in kv)

    def start_from(self, tokens: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Replace the cache with a copy of the first len(tokens) positions of a snapshot of `tokens` (or more)."""
        self.cache = DynamicCache(config=self.model.config)
        for index, (keys, values) in enumerate(kv):  # update concatenates onto an empty layer: a copy, never shared
            self.cache.update(keys[..., :len(tokens), :], values[..., :len(tokens), :], index)
        self.tokens = list(tokens)

    @property
    def batches(self) -> bool:
        """Whether `advance_batch` can copy this cache into rows (plain layers: `reusable`)."""
        return self.reusable

    @torch.inference_mode()
    def advance_batch(self, contexts: list[list[int]]) -> torch.Tensor:
        """The next-token logits [B, V] after each of `contexts`, in one batched forward: a tree's branches at one
        point, which share everything before it and grow by the same number of tokens per call. The first call (or
        one that does not continue the last) makes the cache hold the longest common prefix and copies it into one
        row per context; later calls feed each row its new tokens. The cache itself keeps that prefix."""
        if self._fork is None or not self._fork.continued_by(contexts):
            shared = shared_prefix(contexts)
            self.advance_to(contexts[0][:shared])
            fork = DynamicCache(config=self.model.config)
            for index, layer in enumerate(self.cache.layers):
                fork.update(layer.keys.repeat(len(contexts), 1, 1, 1), layer.values.repeat(len(contexts), 1, 1, 1),
                            index)
            self._fork = Fork(fork, [list(contexts[0][:shared]) for _ in contexts])
        new_tokens = [c[len(r):] for c, r in zip(contexts, self._fork.rows)]
        out = self.model(input_ids=torch.tensor(new_tokens, device=self.model.device),
                         past_key_values=self._fork.cache, use_cache=True, logits_to_keep=1)
        self._fork.rows = [list(c) for c in contexts]
        self.forward_calls += 1
        return out.logits[:, -1].float().cpu()

    @torch.inference_mode()
    def advance_to(self, context: list[int], n_logits: int = 1) -> ForwardOutput:
        """Make the cache hold `context`; return logits (and hidden states) of its last `n_logits` positions.

        Only those positions go through the LM head: on a long prompt that head is most of the cost.
        """
        if not context:
            raise ValueError("context must hold at least one token")
        self._fork = None
        keep = min(common_prefix_length(self.tokens, context), len(context) - 1)
        self.rollback(keep)
        new_tokens = context[keep:]
        out = self.model(
            input_ids=torch.tensor([new_tokens], device=self.model.device),
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=self.with_hidden,
            logits_to_keep=n_logits,
        )
        self.tokens.extend(new_tokens)
        self.forward_calls += 1
        hidden = out.hidden_states[-1][0, -n_logits:].cpu() if self.with_hidden else None
        # The rules and their coins run on the host (common/model/devices.py): a no-op on the CPU.
        return ForwardOutput(logits=out.logits[0].float().cpu(), hidden=hidden)
