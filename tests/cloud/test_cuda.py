"""The resident engine on a CUDA GPU: the properties tests/cloud/test_batched_forward.py and tests/common/model/test_devices.py
check on the CPU, on the device (skipped, with the reason, where torch sees no GPU).

    python -m pytest tests/cloud/test_cuda.py     # on a GPU host; needs no model packages and no network

On CUDA the default layout is paged: one pool, flex_attention compiled into a fused kernel.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from cloud.kv_pool import KVPool
from cloud.packed_forward import forward_packed, install
from cloud.resident_kv import KVLayout, ResidentKV
from common.model.devices import resolve_device
from common.spec.acceptance_rules import greedy_verdict

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason=f"no CUDA GPU here (torch {torch.__version__}): the CUDA engine is untested")


def _tiny_qwen2(dtype: torch.dtype) -> PreTrainedModel:
    """A tiny random Qwen2 (biases, grouped KV heads, head_dim 32) built on the GPU."""
    config = Qwen2Config(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         initializer_range=0.25, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    install(model)
    return model


def _plain(model: PreTrainedModel, context: list[int], n: int) -> torch.Tensor:
    with torch.inference_mode():
        ids = torch.tensor([context], device=model.device)
        return model(input_ids=ids, logits_to_keep=n).logits[0].float().cpu()


def _caches(model: PreTrainedModel, kind: str, n: int) -> list:
    if kind == "paged":
        layout = KVLayout.of(model, page_tokens=128)
        pool = KVPool(layout, 64 * layout.bytes_per_page)
        return [pool.session() for _ in range(n)]
    return [ResidentKV(KVLayout.of(model, page_tokens=16)) for _ in range(n)]


@pytest.mark.parametrize("kind", ["per-session", "paged"])
def test_cuda_batches_equal_the_model_alone_in_float32(kind):
    model = _tiny_qwen2(torch.float32)
    rng = random.Random(3)
    caches = _caches(model, kind, 4)
    contexts = [[rng.randrange(300) for _ in range(n)] for n in (1, 9, 200, 40)]
    for cache, context in zip(caches, contexts):
        forward_packed(model, [cache], [context], [1])
    for _ in range(3):  # verify, roll back part of each block, verify again
        blocks = [[rng.randrange(300) for _ in range(rng.randint(1, 7))] for _ in caches]
        rows = forward_packed(model, caches, blocks, [len(b) for b in blocks])
        for cache, context, block, row in zip(caches, contexts, blocks, rows):
            context += block
            want = _plain(model, context, len(block))
            assert row.logits.device.type == "cpu" and row.argmax.device.type == "cpu"
            torch.testing.assert_close(row.logits, want, atol=1e-4, rtol=0)
            assert torch.equal(row.argmax, want.argmax(-1))
            rejected = rng.randint(0, len(block) - 1)
            cache.truncate(cache.length - rejected)
            del context[len(context) - rejected:]


@pytest.mark.parametrize("kind", ["per-session", "paged"])
def test_cuda_bf16_batches_agree_with_the_sessions_alone(kind):
    model = _tiny_qwen2(torch.bfloat16)
    rng = random.Random(4)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (5, 130, 1)]
    blocks = [[rng.randrange(300) for _ in range(n)] for n in (6, 2, 6)]
    alone = []
    for prompt, block in zip(prompts, blocks):
        (own,) = _caches(model, kind, 1)
        forward_packed(model, [own], [prompt], [1])
        alone.append(forward_packed(model, [own], [block], [len(block)])[0])
    batched = _caches(model, kind, len(prompts))
    for cache, prompt in zip(batched, prompts):
        forward_packed(model, [cache], [prompt], [1])
    together = forward_packed(model, batched, blocks, [len(b) for b in blocks])
    for one, many in zip(alone, together):
        torch.testing.assert_close(many.logits, one.logits, atol=0.05, rtol=0.02)


def test_cuda_greedy_rows_bring_back_the_argmax_alone():
    model = _tiny_qwen2(torch.bfloat16)
    caches = _caches(model, "paged", 2)
    rows = forward_packed(model, caches, [[1, 2, 3], [4, 5]], [3, 2], [False, True])
    assert rows[0].logits is None and rows[0].argmax.shape == (3,)
    assert rows[1].logits.shape == (2, 300) and torch.equal(rows[1].argmax, rows[1].logits.argmax(-1))
    assert greedy_verdict([2, 3], rows[0].argmax.tolist())[0] in (0, 1, 2)


def test_cuda_sessions_sharing_cached_pages_in_one_fused_forward_each_see_their_own_prefix():
    """The prefix cache on the fused kernel: three sessions read two shared pages of the pool in one forward, and
    each gets the logits of its own prompt alone (float32)."""
    from cloud.prefix_cache import PrefixCache

    model = _tiny_qwen2(torch.float32)
    layout = KVLayout.of(model, page_tokens=128)
    pool = KVPool(layout, 16 * layout.bytes_per_page)
    cache = PrefixCache(layout, pool)
    rng = random.Random(5)
    prefix = [rng.randrange(300) for _ in range(2 * 128)]
    first = pool.session()
    forward_packed(model, [first], [prefix], [1])
    assert cache.remember(first, "edge", prefix) == 2
    sharing = [pool.session() for _ in range(2)]
    for session in sharing:
        assert cache.start(session, "edge", prefix).tokens == 2 * 128
    tails = [[rng.randrange(300) for _ in range(n)] for n in (5, 131, 2)]
    rows = forward_packed(model, [first] + sharing, tails, [len(t) for t in tails])
    for tail, row in zip(tails, rows):
        torch.testing.assert_close(row.logits, _plain(model, prefix + tail, len(tail)), atol=1e-4, rtol=0)
    for session in [first] + sharing:
        session.release()
    cache.clear()
    assert pool.free_pages == pool.pages


def test_cuda_is_what_auto_picks():
    assert resolve_device("auto").type == "cuda"


@pytest.mark.parametrize("attention", ["per-session", "paged"])
def test_cuda_cloud_over_grpc_equals_the_target_alone(tiny_target, tiny_draft, attention):
    """The service with its target on the GPU (float32): greedy sd-block blocks give the target's own tokens."""
    pytest.importorskip("sprinter.v1.decoding_pb2", reason="generated gRPC stubs are missing (make proto)")
    import grpc

    from cloud.server import CloudSettings
    from cloud_harness import ServerThread
    from common.spec.local_decoder import LocalDecoder
    from common.spec.modes import DecodeSettings
    from common.model.loading import load_model
    from common.sampling.distributions import SamplingParams
    from test_cloud_sessions import _edge_loop

    on_gpu = load_model("tiny-random", torch.float32, torch.device("cuda"))
    settings = CloudSettings(target="tiny-random", dtype="float32", device="cuda", attention=attention)
    ids = tiny_target.tokenizer("def f(x):")["input_ids"]
    expected = LocalDecoder(tiny_target, None).generate(ids, DecodeSettings(mode="target", max_new_tokens=24)).token_ids
    with ServerThread(settings, on_gpu) as server, grpc.insecure_channel(server.address) as channel:
        remote = _edge_loop(channel, tiny_draft, ids, 24, 4, SamplingParams())
    cut = next((i + 1 for i, t in enumerate(remote) if t in tiny_target.eos_token_ids), len(remote))
    assert remote[:cut] == expected


def test_cuda_tiled_forwards_replayed_from_graphs_equal_the_model_alone_in_float32():
    """Query tiles per session and CUDA graphs (cloud/query_tiles.py, cloud/cuda_graphs.py): the first forward of a
    bucket captures its graph, the next replay it, and every row is the model's own; a forward past the buckets (a
    tree block) runs eagerly."""
    from cloud.cuda_graphs import GraphForwards

    model = _tiny_qwen2(torch.float32)
    layout = KVLayout.of(model, page_tokens=128)
    pool = KVPool(layout, 64 * layout.bytes_per_page)
    graphs = GraphForwards(model, pool)
    rng = random.Random(6)
    caches = [pool.session() for _ in range(3)]
    contexts = [[rng.randrange(300) for _ in range(n)] for n in (3, 150, 40)]
    for cache, context in zip(caches, contexts):
        forward_packed(model, [cache], [context], [1])
    for _ in range(3):  # the same bucket (3 sessions, each <= 16 rows: 4 x 64), captured once, replayed twice
        blocks = [[rng.randrange(300) for _ in range(rng.randint(1, 6))] for _ in caches]
        rows = forward_packed(model, caches, blocks, [len(b) for b in blocks], query_tiles=True, replay=graphs.replay)
        for cache, context, block, row in zip(caches, contexts, blocks, rows):
            context += block
            torch.testing.assert_close(row.logits, _plain(model, context, len(block)), atol=1e-4, rtol=0)
    assert graphs.replays == 3 and len(graphs._captured) == 1
    tree_rows = forward_packed(model, caches[:1], [[1, 2, 3]], [3], trees=[[-1, 0, 0]], query_tiles=True,
                               replay=graphs.replay)
    assert graphs.eager == 1 and tree_rows[0].logits.shape == (3, 300)
