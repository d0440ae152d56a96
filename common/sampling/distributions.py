"""From logits to the distributions that decoding samples from and verification compares.

Temperature 0 means greedy: the distribution is one-hot on the argmax, so the same verification
rules serve greedy and sampled decoding. Top-k and top-p truncate the support; `SparseDistribution`
carries just that support, which is exact (not an approximation) for truncated sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.sampling.params import SamplingParams


# The smallest normal float32. Logits are float32: a temperature below it would round to 0 there (NaN
# probabilities), so it gets the distribution it tends to, the argmax's one-hot.
FLOAT32_TINY = 1.1754943508222875e-38


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Distributions [..., V] (float32) after temperature, top-k and top-p, as the sampler uses them."""
    logits = logits.float()
    if params.temperature < FLOAT32_TINY:  # greedy, or so close that float32 cannot tell
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    # Shift before scaling: a tiny temperature then gives -inf (never NaN) away from the argmax.
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does.
        # The most likely token always stays (a top_p that rounds to 0 in float32 would drop them all).
        drop = mass_before >= params.top_p
        drop[..., 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token id from a distribution [V]."""
    return int(torch.multinomial(probs.float(), 1, generator=generator).item())


@dataclass(frozen=True)
class SparseDistribution:
    """The nonzero part of a distribution: `token_ids` [n] and their `probs` [n]."""

    token_ids: torch.Tensor
    probs: torch.Tensor

    @classmethod
    def from_dense(cls, probs: torch.Tensor, max_support: int | None = None) -> "SparseDistribution":
        """Exact when the support is at most `max_support` (always true after top-k); else the top mass, renormalised."""
        support = torch.nonzero(probs > 0).flatten()
        if max_support is None or len(support) <= max_support:
            return cls(token_ids=support, probs=probs[support])
        kept = torch.topk(probs, max_support)
        return cls(token_ids=kept.indices, probs=kept.values / kept.values.sum())

    def to_dense(self, vocab_size: int) -> torch.Tensor:
        return torch.zeros(vocab_size, dtype=torch.float32).index_put_((self.token_ids,), self.probs.float())
