"""The statistical tests' parts: a target's exact distribution over its first tokens, a near draft, many seeded
generations on an edge, and the chi-square of what they gave against the exact law."""

from __future__ import annotations

import asyncio
import copy
from collections import Counter
from typing import Callable

import torch
from scipy.stats import chisquare

from common.sampling.logits_processing import processor_for
from common.model.loading import LoadedModel
from common.sampling.distributions import SamplingParams, logits_to_probs


def first_tokens_distribution(target: LoadedModel, prompt: list[int], sampling: SamplingParams,
                              n_tokens: int) -> dict[tuple[int, ...], float]:
    """P(first `n_tokens` tokens) under the target with `sampling`, exactly (a sequence ends at EOS); the
    request's logit_bias and penalties, if it has any, transform each step's logits."""
    @torch.inference_mode()
    def next_logits(ids: list[int]) -> torch.Tensor:
        return target.model(torch.tensor([ids])).logits[0, -1].float()

    return rows_distribution(next_logits, target.eos_token_ids, prompt, sampling, n_tokens,
                             target.grammars if sampling.grammar else None)


def rows_distribution(next_logits: Callable[[list[int]], torch.Tensor], eos_token_ids: frozenset[int],
                      prompt: list[int], sampling: SamplingParams, n_tokens: int,
                      grammars=None) -> dict[tuple[int, ...], float]:
    """P(first `n_tokens` tokens) when each step's distribution is `sampling` applied to `next_logits(context)`: the
    law of whatever engine computes those rows (a torch model's, llama.cpp's)."""
    dist: dict[tuple[int, ...], float] = {}
    processor = processor_for(sampling, prompt, grammars)

    def expand(prefix: tuple[int, ...], p: float) -> None:
        if len(prefix) == n_tokens or (prefix and prefix[-1] in eos_token_ids):
            dist[prefix] = dist.get(prefix, 0.0) + p
            return
        logits = next_logits(prompt + list(prefix))
        if processor is not None:
            logits = processor.next_row(logits, prompt + list(prefix))
        probs = logits_to_probs(logits, sampling)
        for token in torch.nonzero(probs).flatten().tolist():
            expand(prefix + (token,), p * float(probs[token]))

    expand((), 1.0)
    return dist


def near_draft(target: LoadedModel, noise: float = 0.3, seed: int = 7) -> LoadedModel:
    """The target with noise on its LM head: it agrees with the target often, not always, so that
    rejections, replacements and hits all happen (a truncated tiny draft is rejected nearly every time at T=1)."""
    model = copy.deepcopy(target.model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.add_(torch.randn(head.shape, generator=generator) * noise * head.std())
    return LoadedModel(target.spec, model, target.tokenizer)


async def seeded_generations(node, prompt: list[int], n: int, settings_for: Callable[[int], object],
                             at_once: int) -> list:
    """EdgeResults of `n` generations of `prompt` on the edge `node`, generation i under `settings_for(i)` (its
    EdgeSettings, seeded i), at most `at_once` in flight (within the cloud's streams and the draft's threads)."""
    gate = asyncio.Semaphore(at_once)

    async def one(seed: int):
        async with gate:
            return await node.decoder.generate(prompt, settings_for(seed))

    return await asyncio.gather(*(one(seed) for seed in range(n)))


def chi_square_pvalue(seen: Counter, law: dict[tuple[int, ...], float]) -> float:
    """Chi-square p-value of the observed sequences against `law` over its support (expected counts scaled to the
    observed total there, so float rounding of the law's mass does not trip scipy's sum check)."""
    cells = [c for c in sorted(law) if law[c] > 0]
    mass = sum(law[c] for c in cells)
    total = sum(seen[c] for c in cells)
    return float(chisquare([seen[c] for c in cells], [law[c] / mass * total for c in cells]).pvalue)
