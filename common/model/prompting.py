"""Turning a user's prompt into token ids."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, chat: bool) -> list[int]:
    """Token ids of `prompt`; with `chat`, wrapped as one user turn in the tokenizer's chat template."""
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": prompt}])
    return tokenizer(prompt)["input_ids"]


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
