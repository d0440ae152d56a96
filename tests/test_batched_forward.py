"""forward_batch: one padded forward for many sessions equals each session run alone, before and after."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

import cloud.batcher as batcher
from cloud.batcher import forward_batch

ATOL = 1e-4


def _tiny_qwen2() -> PreTrainedModel:
    """A tiny random Qwen2 (q/k/v biases), with non-zero biases so that they matter."""
    config = Qwen2Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.25, tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).float().eval()
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(".bias"):
                    parameter.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_model(request, tiny_target) -> PreTrainedModel:
    return tiny_target.model if request.param == "llama" else _tiny_qwen2()


def _alone(model: PreTrainedModel, cache: DynamicCache, tokens: list[int], n_logits: int) -> torch.Tensor:
    """The reference: one session's plain forward on its own cache."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True, logits_to_keep=n_logits)
    return out.logits[0].float()


def _random_tokens(rng: random.Random, model: PreTrainedModel, n: int) -> list[int]:
    return [rng.randrange(model.config.vocab_size) for _ in range(n)]


def _sessions(model: PreTrainedModel, rng: random.Random, prompt_lengths: list[int]) -> list[DynamicCache]:
    caches = []
    for length in prompt_lengths:
        cache = DynamicCache(config=model.config)
        if length:
            _alone(model, cache, _random_tokens(rng, model, length), 1)
        caches.append(cache)
    return caches


def _copy(cache: DynamicCache) -> DynamicCache:
    copy = DynamicCache()
    for layer_idx, layer in enumerate(cache.layers):
        if layer.get_seq_length():
            copy.update(layer.keys.clone(), layer.values.clone(), layer_idx)
    return copy


def _assert_same_caches(got: list[DynamicCache], want: list[DynamicCache]) -> None:
    for mine, theirs in zip(got, want):
        assert mine.get_seq_length() == theirs.get_seq_length()
        for a, b in zip(mine.layers, theirs.layers):
            torch.testing.assert_close(a.keys, b.keys, atol=ATOL, rtol=0)
            torch.testing.assert_close(a.values, b.values, atol=ATOL, rtol=0)


def _batched_round(
    model: PreTrainedModel, rng: random.Random, batched: list[DynamicCache], reference: list[DynamicCache],
    block_sizes: list[int], n_logits: list[int], atol: float = ATOL,
) -> None:
    """One forward_batch round against the same blocks run alone on the reference caches."""
    blocks = [_random_tokens(rng, model, n) for n in block_sizes]
    lengths = [cache.get_seq_length() for cache in batched]
    got = forward_batch(model, batched, blocks, n_logits)
    want = [_alone(model, cache, block, n) for cache, block, n in zip(reference, blocks, n_logits)]
    for g, w, n in zip(got, want, n_logits):
        assert g.dtype == torch.float32 and g.shape == (n, model.config.vocab_size)
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, atol=atol, rtol=0)
        assert torch.equal(g.argmax(-1), w.argmax(-1))
    assert [cache.get_seq_length() for cache in batched] == [length + n for length, n in zip(lengths, block_sizes)]


def _continue_alone(
    model: PreTrainedModel, rng: random.Random, batched: list[DynamicCache], reference: list[DynamicCache],
    atol: float = ATOL,
) -> None:
    """Caches that went through a batch continue, alone, exactly like caches that never did."""
    for mine, theirs in zip(batched, reference):
        block = _random_tokens(rng, model, 3)
        torch.testing.assert_close(_alone(model, mine, block, 3), _alone(model, theirs, block, 3), atol=atol, rtol=0)


def test_batched_equals_alone_then_continues_and_rolls_back(tiny_model):
    rng = random.Random(7)
    batched = _sessions(tiny_model, rng, [0, 5, 12, 3])
    reference = [_copy(cache) for cache in batched]

    _batched_round(tiny_model, rng, batched, reference, block_sizes=[4, 1, 6, 3], n_logits=[4, 1, 2, 3])
    _assert_same_caches(batched, reference)
    _continue_alone(tiny_model, rng, batched, reference)

    # Rollback after rejections: crop some sessions, then another batched round on the cropped caches.
    for cache_list in (batched, reference):
        cache_list[0].crop(-2)
        cache_list[2].crop(-5)
        cache_list[3].crop(-1)
    _batched_round(tiny_model, rng, batched, reference, block_sizes=[2, 5, 1, 3], n_logits=[2, 5, 1, 1])
    _assert_same_caches(batched, reference)
    _continue_alone(tiny_model, rng, batched, reference)


def test_all_caches_empty(tiny_model):
    rng = random.Random(3)
    batched = _sessions(tiny_model, rng, [0, 0, 0])
    reference = _sessions(tiny_model, rng, [0, 0, 0])
    _batched_round(tiny_model, rng, batched, reference, block_sizes=[1, 3, 2], n_logits=[1, 3, 1])
    _assert_same_caches(batched, reference)
    _continue_alone(tiny_model, rng, batched, reference)


def test_one_forward_for_the_whole_batch(tiny_target, monkeypatch):
    model = tiny_target.model
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        caches = _sessions(model, random.Random(1), [4, 0, 9])
        calls.clear()
        forward_batch(model, caches, [[1, 2], [3, 4, 5], [6]], [2, 1, 1])
        assert len(calls) == 1

        # B == 1: a plain forward on the session's own cache, no padded copy.
        monkeypatch.setattr(batcher, "_left_padded_cache", lambda *args: pytest.fail("B=1 copied the cache"))
        calls.clear()
        (logits,) = forward_batch(model, caches[:1], [[7, 8, 9]], [2])
        assert len(calls) == 1 and logits.shape == (2, model.config.vocab_size)
        assert caches[0].get_seq_length() == 4 + 2 + 3
    finally:
        handle.remove()


def test_bad_n_logits_is_refused(tiny_target):
    model = tiny_target.model
    with pytest.raises(ValueError):
        forward_batch(model, [DynamicCache(), DynamicCache()], [[1, 2], [3]], [1, 2])
    with pytest.raises(ValueError):
        forward_batch(model, [DynamicCache(), DynamicCache()], [[1, 2], [3]], [0, 1])


@pytest.mark.smollm2
def test_smollm2_batched_equals_alone(smollm2):
    model = smollm2.model
    rng = random.Random(11)
    batched = _sessions(model, rng, [7, 0, 15])
    reference = [_copy(cache) for cache in batched]
    _batched_round(model, rng, batched, reference, block_sizes=[3, 5, 1], n_logits=[3, 2, 1], atol=2e-4)
    _continue_alone(model, rng, batched, reference, atol=2e-4)
