"""What a request does to the logits before they become a distribution: logit_bias, then the penalties.

The same transform runs on the draft's logits (the edge's proposals) and on the target's (the rule in the
cloud, or the local target), so that verification is exact with respect to the *transformed* target: the
output is distributed as the penalized target would sample it. Greedy then means the argmax of the
transformed logits. Order and counting follow vLLM: logit_bias first, then repetition (tokens of the prompt
and of the output), frequency (per occurrence in the output) and presence (once per token in the output);
temperature, top-k and top-p come after (common/sampling.py).

Glossary
    context     the prompt, then the tokens generated so far (the output: what presence and frequency count)
    block       tokens drafted after the context, not yet verified; row i of a block's logits is the
                position after context + block[:i], and sees those tokens counted
    V           logits per row (the model's vocabulary)

A processor is stateless towards its caller: it is told the context at every call, so rollbacks, reopened
sessions and pipelines that draft ahead need nothing from it. Counting costs a bincount over the output.
"""

from __future__ import annotations

import torch

from common.sampling_params import SamplingParams


class LogitsProcessor:
    """One generation's logits transform: `params`' bias and penalties, given the prompt it continues."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int]) -> None:
        self.params = params
        self.output_start = len(prompt_ids)  # the context's tokens from here on are the output
        self.bias_ids = torch.tensor([token for token, _ in params.logit_bias], dtype=torch.long)
        self.bias_values = torch.tensor([bias for _, bias in params.logit_bias], dtype=torch.float32)

    @property
    def active(self) -> bool:
        return self.params.shapes_logits

    def next_row(self, logits: torch.Tensor, context: list[int]) -> torch.Tensor:
        """logits [V] of the position after `context`, transformed."""
        return self.rows(logits.unsqueeze(0), context, [])[0]

    def rows(self, logits: torch.Tensor, context: list[int], block: list[int]) -> torch.Tensor:
        """logits [n, V] of the positions after context + block[:i] (i = 0..n-1, n <= len(block) + 1), transformed."""
        if not self.active:
            return logits
        n, vocab_size = logits.shape
        counts = self._counts(context[self.output_start:], block, n, vocab_size)  # [n, V]
        shaped = logits.float().clone()
        known = self.bias_ids < vocab_size  # a draft with a smaller vocabulary has no such token to lift
        shaped[:, self.bias_ids[known]] += self.bias_values[known]
        p = self.params
        if p.repetition_penalty != 1.0:
            seen = (counts + self._counts(context[: self.output_start], [], 1, vocab_size)) > 0
            penalized = torch.where(shaped > 0, shaped / p.repetition_penalty, shaped * p.repetition_penalty)
            shaped = torch.where(seen, penalized, shaped)
        if p.frequency_penalty:
            shaped = shaped - p.frequency_penalty * counts
        if p.presence_penalty:
            shaped = shaped - p.presence_penalty * (counts > 0).float()
        return shaped

    @staticmethod
    def _counts(tokens: list[int], block: list[int], n: int, vocab_size: int) -> torch.Tensor:
        """[n, V] occurrences in `tokens`, plus block[:i] in row i."""
        base = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=vocab_size)[:vocab_size]
        counts = base.unsqueeze(0).repeat(n, 1)
        for i, token in enumerate(block[: n - 1]):
            if token < vocab_size:
                counts[i + 1:, token] += 1
        return counts.float()


def processor_for(params: SamplingParams, prompt_ids: list[int]) -> LogitsProcessor | None:
    """The processor a generation of `prompt_ids` needs, or None when `params` leave the logits as they are."""
    return LogitsProcessor(params, prompt_ids) if params.shapes_logits else None
