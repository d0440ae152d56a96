"""Output quality in the design's terms: how the target model judges text another method produced."""

from __future__ import annotations

import torch

from common.model.cached_lm import CachedLM
from common.model.loading import LoadedModel


def agreement(tokens: list[int], reference: list[int]) -> float:
    """agreement_with_target: share of the reference's positions reproduced exactly (greedy runs)."""
    if not reference:
        return 1.0
    return sum(a == b for a, b in zip(tokens, reference)) / len(reference)


@torch.inference_mode()
def target_nll_per_token(target: LoadedModel, prompt_ids: list[int], output_ids: list[int]) -> float:
    """Mean negative log-likelihood (nats) of `output_ids` after `prompt_ids` under the target at T=1."""
    if not output_ids:
        return 0.0
    logits = CachedLM(target.model).advance_to(prompt_ids + output_ids, n_logits=len(output_ids) + 1).logits[:-1]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return float(-log_probs[torch.arange(len(output_ids)), torch.tensor(output_ids)].mean())
