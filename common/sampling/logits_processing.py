"""What a request does to the logits before they become a distribution: a grammar's mask, logit_bias, the penalties.

The same transform runs on the draft's logits (the edge's proposals) and on the target's (the rule in the
cloud, or the local target), so that verification is exact with respect to the *transformed* target: the
output is distributed as the constrained, penalized target would sample it. Greedy then means the argmax of
the transformed logits. Order and counting follow vLLM: the grammar's mask (structured output, common/sampling/grammar.py:
-inf where the grammar allows no token), logit_bias, then repetition (tokens of the prompt and of the
output), frequency (per occurrence in the output) and presence (once per token in the output); temperature,
top-k and top-p come after (common/sampling/distributions.py).

Glossary
    context     the prompt, then the tokens generated so far (the output: what presence and frequency count)
    block       tokens drafted after the context, not yet verified; row i of a block's logits is the
                position after context + block[:i], and sees those tokens counted
    V           logits per row (the model's vocabulary)

A processor is stateless towards its caller: it is told the context at every call, so rollbacks, reopened
sessions and pipelines that draft ahead need nothing from it. Counting costs a bincount over the output; the
grammar's matcher follows the output it is told (rolled back to what it shares with the last one, then advanced).
"""

from __future__ import annotations

import torch

from common.sampling.grammar import GrammarCompiler, GrammarMatcher
from common.sampling.params import SamplingParams


class LogitsProcessor:
    """One generation's logits transform: `params`' bias and penalties, given the prompt it continues."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], grammar: GrammarMatcher | None = None) -> None:
        if (params.grammar is None) != (grammar is None):
            raise ValueError("a request with a grammar needs its matcher, and only such a request has one")
        self.params = params
        self.output_start = len(prompt_ids)  # the context's tokens from here on are the output
        self.prompt_ids = list(prompt_ids)
        self._prompt_counts: dict[int, torch.Tensor] = {}  # per vocabulary width: the prompt never changes
        self.grammar = GrammarTrack(grammar) if grammar is not None else None
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
        output = context[self.output_start:]
        shaped = logits.float().clone()
        if self.grammar is not None:
            shaped.masked_fill_(~self.grammar.masks(output, block, n), float("-inf"))
        if not self.params.penalizes:
            return shaped
        counts = self._counts(output, block, n, vocab_size)  # [n, V]
        known = self.bias_ids < vocab_size  # a draft with a smaller vocabulary has no such token to lift
        shaped[:, self.bias_ids[known]] += self.bias_values[known]
        p = self.params
        if p.repetition_penalty != 1.0:
            if vocab_size not in self._prompt_counts:
                self._prompt_counts[vocab_size] = self._counts(self.prompt_ids, [], 1, vocab_size)
            seen = (counts + self._prompt_counts[vocab_size]) > 0
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


class GrammarTrack:
    """A grammar matcher kept at the output it was last told: rolled back to what the new output shares with
    that one, then advanced by the rest (a verdict that rejected drafted tokens, a pipeline's guess)."""

    def __init__(self, matcher: GrammarMatcher) -> None:
        self.matcher = matcher
        self.consumed: list[int] = []

    def masks(self, output: list[int], block: list[int], n: int) -> torch.Tensor:
        """Bool [n, V]: the masks before each of the n positions after output + block[:i]."""
        self.sync(output)
        masks = self.matcher.masks_along(block[: n - 1])  # stops early at a token its row refused
        if masks.shape[0] < n:  # rows past a refused token are never read (its probability is 0): repeat the last
            masks = torch.cat([masks, masks[-1:].expand(n - masks.shape[0], -1)])
        return masks

    def sync(self, output: list[int]) -> None:
        shared = len(self.consumed)
        if output[:shared] != self.consumed:  # the common case, a longer output, is one comparison in C
            shared, limit = 0, min(len(output), len(self.consumed))
            while shared < limit and output[shared] == self.consumed[shared]:
                shared += 1
        self.matcher.rollback(len(self.consumed) - shared)
        self.matcher.accept_all(output[shared:])
        self.consumed = list(output)


def processor_for(params: SamplingParams, prompt_ids: list[int],
                  grammars: GrammarCompiler | None = None) -> LogitsProcessor | None:
    """The processor a generation of `prompt_ids` needs, or None when `params` leave the logits as they are.
    A request with a grammar needs `grammars`, the compiler for the model whose logits are processed."""
    if not params.shapes_logits:
        return None
    if params.grammar is None:
        return LogitsProcessor(params, prompt_ids)
    if grammars is None:
        raise ValueError("structured output needs a grammar compiler for this model's tokenizer")
    return LogitsProcessor(params, prompt_ids, grammars.compile(params.grammar).matcher())
