"""Log-probabilities of emitted tokens, as OpenAI's `logprobs` returns them.

Glossary
    raw distribution  log_softmax of a model's logits as they come out of its forward: before temperature,
                      penalties, logit_bias and a grammar's mask (what vLLM returns by default)
    top N             the N most likely tokens of that distribution at the position, most likely first
    source            "target": the target's values (its forward over the verified block, the first token's,
                      Generate's); "draft": the draft's, for a token no target judged (mode draft, a degraded
                      stretch, a token sprinter's verifier passed)

Shapes: `logits` [n, V] float, `tokens` [n]: row i scored the position where tokens[i] was emitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs (completions' logprobs takes at most 5)


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability and the top N alternatives at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first
    source: Literal["target", "draft"] = "target"


def logprobs_of(logits: torch.Tensor, tokens: list[int], top_n: int,
                source: Literal["target", "draft"] = "target") -> list[TokenLogprob]:
    """The raw distribution's log-probability of each token [n] under its row of `logits` [n, V], and the top N."""
    rows = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)  # [n, V]
    chosen = rows[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()  # [n]
    if top_n:
        values, ids = rows.topk(top_n, dim=-1)  # [n, N]
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, lp, top, source) for t, lp, top in zip(tokens, chosen, tops)]
