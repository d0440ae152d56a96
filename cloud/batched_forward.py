"""One padded target forward for the token blocks of many sessions, each on top of its own KV cache.

Every session owns a batch-1 `DynamicCache` of its own length L_i and brings n_i >= 1 new tokens.
`forward_batch` lays them out as one batch:

    cache part (left-padded to L = max L_i)     new part (right-padded to T = max n_i)
    [pad pad k0 k1 k2 ... k_{L_i-1}]            [t0 t1 ... t_{n_i-1} pad pad]

The 2D attention mask hides the padding on both sides and explicit position ids put session i's new
tokens at L_i .. L_i + n_i - 1, so every real query sees exactly what it would see alone. No query row
is ever fully masked (each sees at least its block's first real token), so SDPA produces no NaNs.
Right-padded query rows compute garbage that nobody reads, and their KV entries are never copied back:
after the forward, each session's cache gets exactly its n_i new entries appended, as if it had run
alone, so later single-session forwards and `crop()` work on it unchanged.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicLayer


def _check_arguments(caches: list[DynamicCache], new_tokens: list[list[int]], n_logits: list[int]) -> None:
    if not caches or not len(caches) == len(new_tokens) == len(n_logits):
        raise ValueError("caches, new_tokens and n_logits must be non-empty lists of the same length")
    for i, (cache, tokens, n) in enumerate(zip(caches, new_tokens, n_logits)):
        if not 1 <= n <= len(tokens):
            raise ValueError(f"session {i}: n_logits={n} is outside 1..{len(tokens)} (its number of new tokens)")
        # Sliding-window or linear-attention layers keep truncated states: left-padding them is another problem.
        if any(type(layer) is not DynamicLayer for layer in cache.layers):
            raise NotImplementedError(f"session {i}: only full-attention DynamicLayer caches are supported")
        if any(layer.get_seq_length() > 0 and layer.keys.shape[0] != 1 for layer in cache.layers):
            raise ValueError(f"session {i}: each cache must hold a single sequence (batch size 1)")


def _left_padded_cache(
    caches: list[DynamicCache], lengths: list[int], past: int, config: PreTrainedConfig
) -> DynamicCache:
    """A batch cache whose row i is session i's cache, left-padded with zeros to `past` entries."""
    if past == 0:
        return DynamicCache(config=config)
    donor = caches[lengths.index(past)]  # a non-empty cache gives every layer's head count, head dim and dtype
    layers = []
    for layer_idx, ref in enumerate(donor.layers):
        keys = ref.keys.new_zeros((len(caches), ref.keys.shape[1], past, ref.keys.shape[3]))
        values = ref.values.new_zeros((len(caches), ref.values.shape[1], past, ref.values.shape[3]))
        for row, (cache, length) in enumerate(zip(caches, lengths)):
            if length:
                keys[row, :, past - length :] = cache.layers[layer_idx].keys[0]
                values[row, :, past - length :] = cache.layers[layer_idx].values[0]
        layers.append((keys, values))
    return DynamicCache(layers, config=config)


@torch.inference_mode()
def forward_batch(
    model: PreTrainedModel, caches: list[DynamicCache], new_tokens: list[list[int]], n_logits: list[int]
) -> list[torch.Tensor]:
    """Run session i's `new_tokens[i]` on top of `caches[i]`, all sessions in one forward.

    Appends each session's new KV entries to its own cache and returns, per session, the float32
    logits of its last `n_logits[i]` new positions ([n_logits[i], V]; row r predicts the token after
    the r-th of those positions).
    """
    _check_arguments(caches, new_tokens, n_logits)
    device = model.device
    if len(caches) == 1:  # fast path: a plain forward on the session's own cache, nothing copied
        out = model(
            input_ids=torch.tensor(new_tokens, device=device),
            past_key_values=caches[0],
            use_cache=True,
            logits_to_keep=n_logits[0],
        )
        return [out.logits[0].float()]

    lengths = [cache.get_seq_length() for cache in caches]
    counts = [len(tokens) for tokens in new_tokens]
    past, width = max(lengths), max(counts)
    batch_cache = _left_padded_cache(caches, lengths, past, model.config)

    pad_id = new_tokens[0][0]  # any valid id: padded positions are masked as keys and their outputs are dropped
    input_ids = torch.tensor([tokens + [pad_id] * (width - len(tokens)) for tokens in new_tokens], device=device)
    attention_mask = torch.zeros((len(caches), past + width), dtype=torch.long, device=device)
    for row, (length, count) in enumerate(zip(lengths, counts)):
        attention_mask[row, past - length : past + count] = 1
    # Real positions, not padded ones: RoPE must rotate session i's new keys/queries as if it ran alone.
    position_ids = torch.tensor(lengths, device=device)[:, None] + torch.arange(width, device=device)

    # The LM head runs on the last `keep` columns only: enough to cover every session's wanted rows.
    keep = max(width - count + n for count, n in zip(counts, n_logits))
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=batch_cache,
        use_cache=True,
        logits_to_keep=keep,
    )

    # Hand each session its own new KV entries (the padded ones are dropped). `update` concatenates,
    # so the session caches hold fresh tensors and keep nothing of the batch cache alive.
    for layer_idx, layer in enumerate(batch_cache.layers):
        for row, (cache, count) in enumerate(zip(caches, counts)):
            cache.update(
                layer.keys[row : row + 1, :, past : past + count],
                layer.values[row : row + 1, :, past : past + count],
                layer_idx,
            )

    first_kept = width - keep  # out.logits[:, c] belongs to new position first_kept + c
    return [
        out.logits[row, count - n - first_kept : count - first_kept].float()
        for row, (count, n) in enumerate(zip(counts, n_logits))
    ]
