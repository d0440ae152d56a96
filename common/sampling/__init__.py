"""From logits to distributions: sampling settings, logits processors and grammars, logprobs."""
