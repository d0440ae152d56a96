"""The cloud service over real gRPC on loopback: lifecycle, equivalence with the local decoder, resync, batching."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from cloud.server import CloudSettings
from cloud_harness import ServerThread, SessionStream
from common import wire
from common.model.cached_lm import CachedLM
from common.spec.propose.drafting import next_token
from common.spec.local_decoder import LocalDecoder
from common.spec.modes import DecodeSettings
from common.model.loading import vocab_fingerprint
from common.sampling.distributions import SamplingParams, SparseDistribution, logits_to_probs
from common.spec.acceptance_rules import block_verify
from sprinter.v1 import decoding_pb2 as pb
from sprinter.v1 import decoding_pb2_grpc as pb_grpc

OK = grpc.StatusCode.OK.value[0]


@pytest.fixture(scope="module", params=["per-session", "paged", "paged-tiles"])
def cloud(request, tiny_target):
    """Every test here runs on both KV layouts of the resident engine (cloud/packed_forward.py), the paged one with
    query tiles per session too (cloud/query_tiles.py)."""
    settings = CloudSettings(target="tiny-random", batch_window_ms=2, attention=request.param.removesuffix("-tiles"),
                             query_tiles="on" if request.param.endswith("-tiles") else "auto")
    with ServerThread(settings, tiny_target) as server:
        yield server


@pytest.fixture()
def channel(cloud):
    with grpc.insecure_channel(cloud.address) as ch:
        yield ch


def test_info_names_model_vocabulary_and_limits(channel, tiny_target):
    info = pb_grpc.TargetServiceStub(channel).GetInfo(pb.GetInfoRequest())
    assert info.model_id == "tiny-random"
    assert info.vocab_fingerprint == vocab_fingerprint(tiny_target.tokenizer)
    assert info.vocab_size == tiny_target.vocab_size and info.limits.max_block == 32
    assert set(info.eos_token_ids) == set(tiny_target.eos_token_ids)


@pytest.mark.parametrize("attention", ["per-session", "paged"])
def test_info_carries_the_cost_table_timed_at_start(tiny_target, attention):
    """The cloud times a decode step and blocks alone and beside other sessions before serving (cloud/cost_table.py),
    through its engine's own path, and leaves no KV behind."""
    settings = CloudSettings(target="tiny-random", attention=attention)
    with ServerThread(settings, tiny_target, cost_table=True) as server, grpc.insecure_channel(server.address) as channel:
        costs = wire.cloud_costs(pb_grpc.TargetServiceStub(channel).GetInfo(pb.GetInfoRequest()))
        held = server.server.servicer.host.engine.kv_bytes_in_use()
    assert costs.context_tokens == 128
    assert set(costs.forward_ms) == {(n, t) for n in (1, 4) for t in (1, 4, 8, 17)}
    assert all(ms > 0 for ms in costs.forward_ms.values())
    assert costs.decode_ms() == costs.forward_ms[(1, 1)]
    assert held == 0


def test_a_cloud_started_without_a_cost_table_reports_none(tiny_target):
    settings = CloudSettings(target="tiny-random", cost_table="off")
    with ServerThread(settings, tiny_target) as server, grpc.insecure_channel(server.address) as channel:
        info = pb_grpc.TargetServiceStub(channel).GetInfo(pb.GetInfoRequest())
    assert not info.HasField("costs") and not wire.cloud_costs(info)


def test_session_lifecycle_open_verify_close_resume(channel, tiny_target):
    stream = SessionStream(channel)
    opened = stream.open([5, 6, 7], vocab_fingerprint=vocab_fingerprint(tiny_target.tokenizer)).opened
    assert opened.session_id and opened.context_length == 3 and not opened.resumed
    verdict = stream.verify(3, [8, 9]).verdict
    assert 0 <= verdict.n_accepted <= 2 and verdict.context_length == 3 + verdict.n_accepted + 1
    assert verdict.cloud_batch_size == 1 and verdict.verify_ms > 0
    stream.abandon()  # the edge went away without closing: the session survives for a resume

    again = SessionStream(channel)
    resumed = again.open([], resume_session_id=opened.session_id).opened
    assert resumed.resumed and resumed.context_length == verdict.context_length
    assert again.verify(resumed.context_length, [10]).WhichOneof("frame") == "verdict"
    again.close()

    after_close = SessionStream(channel)
    error = after_close.open([], resume_session_id=opened.session_id).error
    assert error.code == grpc.StatusCode.NOT_FOUND.value[0]
    after_close.close()


def _edge_loop(channel, draft, prompt_ids, max_new_tokens, k, sampling):
    """A minimal edge: draft k tokens locally, let the cloud verify them, as the local decoder's sd-block does."""
    stream = SessionStream(channel)
    stream.open(prompt_ids, sampling=pb.SamplingSettings(temperature=sampling.temperature, seed=sampling.seed))
    draft_lm = CachedLM(draft.model)
    generator = torch.Generator().manual_seed(sampling.seed)
    context = list(prompt_ids)
    while len(context) - len(prompt_ids) < max_new_tokens:
        block = []
        for _ in range(k):
            token, _ = next_token(draft_lm.advance_to(context + block).logits[-1], sampling, generator)
            block.append(token)
        verdict = stream.verify(len(context), block).verdict
        context += block[: verdict.n_accepted] + [verdict.next_token]
    stream.close()
    return context[len(prompt_ids):][:max_new_tokens]


@pytest.mark.parametrize("prompt", ["The quick brown fox", "def f(x):"])
def test_greedy_blocks_through_the_cloud_equal_the_local_decoder(channel, tiny_target, tiny_draft, prompt):
    ids = tiny_target.tokenizer(prompt)["input_ids"]
    local = LocalDecoder(tiny_target, tiny_draft).generate(ids, DecodeSettings(mode="sd-block", max_new_tokens=30, k=4))
    target = LocalDecoder(tiny_target, None).generate(ids, DecodeSettings(mode="target", max_new_tokens=30))
    eos = tiny_target.eos_token_ids
    remote = _edge_loop(channel, tiny_draft, ids, 30, 4, SamplingParams())
    cut = next((i + 1 for i, t in enumerate(remote) if t in eos), len(remote))
    assert remote[:cut] == local.token_ids == target.token_ids


def test_sampled_verdicts_equal_block_verify_with_the_same_generator(channel, tiny_target):
    """Same frames, same seed: the cloud's verdicts are exactly block_verify's on the target's own logits."""
    sampling = SamplingParams(temperature=1.0, top_k=20, seed=42)
    generator = torch.Generator().manual_seed(sampling.seed)
    reference_lm = CachedLM(tiny_target.model)
    draft_logits = torch.Generator().manual_seed(1)
    context = [3, 1, 4, 1, 5]
    stream = SessionStream(channel)
    stream.open(context, sampling=pb.SamplingSettings(temperature=1.0, top_k=20, seed=42))
    for _ in range(6):
        p_draft = logits_to_probs(torch.randn(3, tiny_target.vocab_size, generator=draft_logits), sampling)
        block = [int(torch.multinomial(p, 1, generator=draft_logits)) for p in p_draft]
        dists = [SparseDistribution.from_dense(p) for p in p_draft]
        verdict = stream.verify(len(context), block, draft_dists=[
            pb.SparseDistribution(token_ids=d.token_ids.tolist(), probs=d.probs.tolist()) for d in dists]).verdict
        p_target = logits_to_probs(reference_lm.advance_to(context + block, n_logits=4).logits, sampling)
        expected = block_verify(torch.tensor(block), torch.stack([d.to_dense(tiny_target.vocab_size) for d in dists]),
                                p_target, generator)
        assert (verdict.n_accepted, verdict.next_token) == expected
        context += block[: verdict.n_accepted] + [verdict.next_token]
    stream.close()


def test_desync_is_refused_with_the_clouds_length_and_recovers(channel):
    stream = SessionStream(channel)
    stream.open([1, 2, 3])
    error = stream.verify(7, [4]).error
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert error.context_length == 3 and "holds 3 tokens" in error.message
    assert stream.verify(error.context_length, [4]).WhichOneof("frame") == "verdict"
    stream.close()


def test_evicted_session_answers_not_found_and_reopens_with_full_context(tiny_target):
    settings = CloudSettings(max_sessions=2, batch_window_ms=1, evict_grace_s=0, evict_older_idle_s=0)
    with ServerThread(settings, tiny_target) as server, grpc.insecure_channel(server.address) as channel:
        first = SessionStream(channel)
        first.open([1, 2, 3, 4])
        verdict = first.verify(4, [5, 6]).verdict
        context = [1, 2, 3, 4] + [5, 6][: verdict.n_accepted] + [verdict.next_token]
        others = [SessionStream(channel) for _ in range(2)]
        for other in others:  # the session limit evicts the least recently used: the first
            assert other.open([9, 9]).WhichOneof("frame") == "opened"
        error = first.verify(len(context), [7]).error
        assert error.code == grpc.StatusCode.NOT_FOUND.value[0] and "reopen" in error.message
        reopened = first.open(context).opened  # same stream, full context
        assert reopened.context_length == len(context)
        assert first.verify(len(context), [7]).WhichOneof("frame") == "verdict"
        for stream in [first, *others]:
            stream.close()


def test_admission_waits_for_a_session_idle_past_the_grace_instead_of_thrashing(tiny_target):
    """Issue 25: with every session used just now, a newcomer is refused with a retry hint (it waits its turn);
    once the least recently used has been idle for --evict-grace-s, it is evicted to admit the newcomer."""
    settings = CloudSettings(max_sessions=2, batch_window_ms=1, evict_grace_s=1.0, evict_older_idle_s=0)
    with ServerThread(settings, tiny_target) as server, grpc.insecure_channel(server.address) as channel:
        held = [SessionStream(channel) for _ in range(2)]
        for stream in held:
            stream.open([1, 2, 3])
        newcomer = SessionStream(channel)
        refused = newcomer.open([9, 9]).error
        assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and refused.retry_after_ms > 0
        time.sleep(1.1)
        assert newcomer.open([9, 9]).WhichOneof("frame") == "opened"
        assert held[0].verify(3, [4]).error.code == grpc.StatusCode.NOT_FOUND.value[0]  # the LRU one went
        for stream in [*held, newcomer]:
            stream.close()


def test_concurrent_sessions_share_one_target_forward(tiny_target, tiny_draft):
    """With a generous window, concurrent verifies are merged; verdicts stay what they would be alone."""
    settings = CloudSettings(batch_window_ms=200, max_batch=8)
    prompts = [tiny_target.tokenizer(p)["input_ids"] for p in ("alpha", "beta gamma", "delta epsilon zeta", "eta")]
    alone = [LocalDecoder(tiny_target, tiny_draft).generate(p, DecodeSettings(mode="sd-block", max_new_tokens=40, k=3)).token_ids
             for p in prompts]
    rounds = 4
    with ServerThread(settings, tiny_target) as server, grpc.insecure_channel(server.address) as channel:
        streams = [SessionStream(channel) for _ in prompts]
        for stream, prompt in zip(streams, prompts):
            stream.open(prompt)
        barrier = threading.Barrier(len(prompts))
        batch_sizes: list[int] = []
        outputs: list[list[int]] = [[] for _ in prompts]

        def edge(i: int) -> None:
            draft_lm = CachedLM(tiny_draft.model)
            context = list(prompts[i])
            for _ in range(rounds):  # the same number of rounds everywhere, so the barrier lines them up
                block = []
                for _ in range(3):
                    block.append(int(draft_lm.advance_to(context + block).logits[-1].argmax()))
                barrier.wait()
                verdict = streams[i].verify(len(context), block).verdict
                batch_sizes.append(verdict.cloud_batch_size)
                context += block[: verdict.n_accepted] + [verdict.next_token]
            outputs[i] = context[len(prompts[i]):]

        threads = [threading.Thread(target=edge, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for stream in streams:
            stream.close()
    assert max(batch_sizes) > 1, batch_sizes
    eos = tiny_target.eos_token_ids
    for output, expected in zip(outputs, alone):
        cut = next((i + 1 for i, t in enumerate(output) if t in eos), len(output))
        assert len(output) >= rounds and output[:cut] == expected[:cut]
