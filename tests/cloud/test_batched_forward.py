"""forward_packed on resident KV: a session verified in a batch gets what it gets alone, and nothing is copied.

The reference is the model's own forward over a session's whole context with no cache at all, so
the resident cache, its rollback and its growth are all checked against plain transformers; so
is the paged layout (one KV pool, flex_attention over the page tables), which runs here unfused.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

import cloud.packed_forward
from cloud.kv_pool import KVPool, KVPoolExhausted
from cloud.packed_forward import forward_packed, install
from cloud.resident_kv import KVLayout, ResidentKV

ATOL = 1e-4


def _tiny_qwen2() -> PreTrainedModel:
    """A tiny random Qwen2 (q/k/v biases, grouped KV heads), with non-zero biases so that they matter."""
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
    install(model)
    return model


@pytest.fixture(scope="module")
def qwen2() -> PreTrainedModel:
    return _tiny_qwen2()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_model(request, tiny_target, qwen2) -> PreTrainedModel:
    if request.param == "qwen2":
        return qwen2
    install(tiny_target.model)
    return tiny_target.model


def _plain(model: PreTrainedModel, context: list[int], n_logits: int) -> torch.Tensor:
    """The reference: the model's own forward over the whole context, no cache; logits of the last n positions."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([context]), logits_to_keep=n_logits).logits[0].float()


def _layout(model: PreTrainedModel, page_tokens: int = 8) -> KVLayout:
    return KVLayout.of(model, page_tokens=page_tokens)


class Session:
    """A context and its resident cache, kept in step the way the cloud's backend keeps them."""

    def __init__(self, model: PreTrainedModel, rng: random.Random, prompt_length: int, page_tokens: int = 8,
                 pool: KVPool | None = None) -> None:
        self.model, self.rng = model, rng
        self.cache = pool.session() if pool is not None else ResidentKV(_layout(model, page_tokens))
        self.context: list[int] = []
        if prompt_length:
            block = self.tokens(prompt_length)
            forward_packed(model, [self.cache], [block], [1])
            self.context += block

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.model.config.vocab_size) for _ in range(n)]

    def reject(self, n: int) -> None:
        self.cache.truncate(self.cache.length - n)
        del self.context[len(self.context) - n:]


def _round(model: PreTrainedModel, sessions: list[Session], block_sizes: list[int], n_logits: list[int],
           atol: float = ATOL) -> None:
    blocks = [session.tokens(n) for session, n in zip(sessions, block_sizes)]
    got = forward_packed(model, [s.cache for s in sessions], blocks, n_logits)
    for session, block, rows, n in zip(sessions, blocks, got, n_logits):
        logits = rows.logits
        assert torch.equal(rows.argmax, logits.argmax(-1))
        session.context += block
        want = _plain(model, session.context, n)
        assert logits.dtype == torch.float32 and logits.shape == (n, model.config.vocab_size)
        torch.testing.assert_close(logits, want, atol=atol, rtol=0)
        assert torch.equal(logits.argmax(-1), want.argmax(-1))
        assert session.cache.length == len(session.context)


@pytest.mark.parametrize("paged", [False, True], ids=["per-session", "paged"])
def test_batched_equals_alone_then_continues_and_rolls_back(tiny_model, paged):
    """On one page pool too: a session never sees another's pages."""
    pool = _pool(tiny_model) if paged else None
    rng = random.Random(7)
    sessions = [Session(tiny_model, rng, n, pool=pool) for n in (0, 5, 12, 3)]
    _round(tiny_model, sessions, block_sizes=[4, 1, 6, 3], n_logits=[4, 1, 2, 3])
    for session, rejected in zip(sessions, (2, 0, 5, 1)):  # rollback after rejections moves a length, nothing else
        session.reject(rejected)
    _round(tiny_model, sessions, block_sizes=[2, 5, 1, 3], n_logits=[2, 5, 1, 1])
    for session in sessions:  # and each continues alone as if it had never been batched
        _round(tiny_model, [session], block_sizes=[3], n_logits=[3])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9), st.integers(0, 8)), min_size=1, max_size=6),
       st.integers(0, 2 ** 16))
def test_property_a_batch_verdict_equals_the_sessions_alone(qwen2, shapes, seed):
    """Random batches of sessions with different context lengths and block sizes, rolled back at random."""
    rng = random.Random(seed)
    sessions = [Session(qwen2, rng, prompt) for prompt, _, _ in shapes]
    blocks = [block for _, block, _ in shapes]
    _round(qwen2, sessions, blocks, [rng.randint(1, n) for n in blocks])
    for session, (_, block, rejected) in zip(sessions, shapes):
        session.reject(min(rejected, block))
    _round(qwen2, sessions, blocks, blocks)


def test_growth_keeps_the_past_and_is_the_only_copy(qwen2):
    rng = random.Random(5)
    session = Session(qwen2, rng, 6, page_tokens=4)
    assert session.cache.capacity == 8 and session.cache.copied_bytes == 0
    _round(qwen2, [session], [2], [2])  # fills the pages it has: nothing moves
    assert session.cache.copied_bytes == 0
    _round(qwen2, [session], [3], [3])  # 11 entries: grows, moving the 8 it had once
    assert session.cache.capacity >= 11 and session.cache.capacity % 4 == 0
    assert session.cache.copied_bytes == 8 * session.cache.layout.bytes_per_token
    copied = session.cache.copied_bytes
    session.reject(3)
    _round(qwen2, [session], [2], [2])  # within capacity again: verifies copy nothing
    assert session.cache.copied_bytes == copied


def test_one_forward_for_the_whole_batch(tiny_target):
    model = tiny_target.model
    install(model)
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        rng = random.Random(1)
        sessions = [Session(model, rng, n) for n in (4, 0, 9)]
        calls.clear()
        forward_packed(model, [s.cache for s in sessions], [[1, 2], [3, 4, 5], [6]], [2, 1, 1])
        assert len(calls) == 1
        assert [s.cache.length for s in sessions] == [6, 3, 10]
    finally:
        handle.remove()


def test_bad_requests_are_refused_and_change_nothing(tiny_target):
    model = tiny_target.model
    install(model)
    caches = [ResidentKV(_layout(model)), ResidentKV(_layout(model))]
    with pytest.raises(ValueError):
        forward_packed(model, caches, [[1, 2], [3]], [1, 2])
    with pytest.raises(ValueError):
        forward_packed(model, caches, [[1, 2], [3]], [0, 1])
    with pytest.raises(ValueError):
        forward_packed(model, [caches[0], caches[0]], [[1], [2]], [1, 1])
    assert [c.length for c in caches] == [0, 0]
    with pytest.raises(ValueError):
        caches[0].truncate(1)


def test_the_model_stays_an_ordinary_model(tiny_target):
    """Without resident segments the registered attention is SDPA with SDPA's masks (a padded batch included)."""
    model = tiny_target.model
    install(model)
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    with torch.inference_mode():
        padded = model(input_ids=ids, attention_mask=mask).logits[1, -1]
        alone = model(input_ids=ids[1:, 2:]).logits[0, -1]
    torch.testing.assert_close(padded, alone, atol=ATOL, rtol=0)


@pytest.mark.smollm2
def test_smollm2_batched_equals_alone(smollm2):
    model = smollm2.model
    install(model)
    rng = random.Random(11)
    sessions = [Session(model, rng, n, page_tokens=16) for n in (7, 0, 15)]
    _round(model, sessions, block_sizes=[3, 5, 1], n_logits=[3, 2, 1], atol=2e-4)
    for session in sessions:
        _round(model, [session], block_sizes=[3], n_logits=[3], atol=2e-4)


def _pool(model: PreTrainedModel, pages: int = 64, page_tokens: int = 8) -> KVPool:
    layout = _layout(model, page_tokens)
    return KVPool(layout, budget_bytes=pages * layout.bytes_per_page)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9), st.integers(0, 8)), min_size=1, max_size=6),
       st.integers(0, 2 ** 16))
def test_property_paged_batches_equal_the_sessions_alone(qwen2, shapes, seed):
    """Random batches on a pool whose pages are handed out interleaved (sessions grow in turns)."""
    rng = random.Random(seed)
    pool = _pool(qwen2, pages=128, page_tokens=4)
    sessions = [Session(qwen2, rng, prompt, pool=pool) for prompt, _, _ in shapes]
    blocks = [block for _, block, _ in shapes]
    for _ in range(2):
        _round(qwen2, sessions, blocks, [rng.randint(1, n) for n in blocks])
        for session, (_, block, rejected) in zip(sessions, shapes):
            session.reject(min(rejected, block))
    for session in sessions:
        session.cache.release()
    assert pool.free_pages == pool.pages


def test_paged_growth_takes_pages_and_copies_nothing(qwen2):
    pool = _pool(qwen2, pages=8, page_tokens=4)
    rng = random.Random(3)
    session = Session(qwen2, rng, 6, pool=pool)
    assert session.cache.capacity == 8 and pool.free_pages == 6
    _round(qwen2, [session], [5], [5])  # 11 entries: a third page, the first two untouched
    assert session.cache.capacity == 12 and session.cache.copied_bytes == 0 and pool.free_pages == 5
    with pytest.raises(KVPoolExhausted):  # more than the pool holds: refused before anything is written
        forward_packed(qwen2, [session.cache], [session.tokens(30)], [1])
    assert session.cache.length == 11
    _round(qwen2, [session], [1], [1])  # and the session goes on
    session.cache.release()
    assert pool.free_pages == pool.pages and session.cache.released
    session.cache.release()  # once only: a second release gives nothing back twice
    assert pool.free_pages == pool.pages


def test_one_forward_takes_one_kind_of_cache(qwen2):
    pool = _pool(qwen2)
    with pytest.raises(ValueError, match="one kind"):
        forward_packed(qwen2, [pool.session(), ResidentKV(_layout(qwen2))], [[1], [2]], [1, 1])
    with pytest.raises(ValueError, match="one kind"):
        forward_packed(qwen2, [pool.session(), _pool(qwen2).session()], [[1], [2]], [1, 1])


def test_the_fused_plan_spans_the_whole_pool(qwen2, monkeypatch):
    """On CUDA the mask spans the pool and lists up to every page per block (fixed shapes for the compiled
    kernel); the same plan, run unfused here, gives the same rows."""
    monkeypatch.setattr(cloud.packed_forward, "fused", lambda device_type: True)
    pool = _pool(qwen2, pages=32, page_tokens=4)
    rng = random.Random(9)
    sessions = [Session(qwen2, rng, n, pool=pool) for n in (3, 17, 0)]
    _round(qwen2, sessions, block_sizes=[5, 2, 4], n_logits=[5, 1, 2])
    sessions[1].reject(2)
    _round(qwen2, sessions, block_sizes=[1, 3, 2], n_logits=[1, 3, 2])
