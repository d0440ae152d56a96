"""A draft tree verified by a real cloud on loopback (cloud/tree_verify.py, cloud/target_host.py): one forward, the
verdict's kept path (Verdict.path), only that path's KV kept, the frame checks naming their field, the KV budget, and
candidates after a side path. Float32, the tiny random target on both KV layouts, SmolLM2-135M once."""

from __future__ import annotations

import os

import grpc
import pytest
import torch

from cloud.engine import TargetInfo, TargetRows
from cloud.errors import CloudError
from cloud.frames import ServiceLimits, check_verify
from cloud.metrics import CloudMetrics
from cloud.server import CloudSettings, engine_limits
from cloud.tree_verify import forward_parents, on_primary_chain, shaped_tree_rows
from cloud.vllm_engine import VllmEngine
from cloud_harness import ServerThread, SessionStream
from common import wire
from common.spec.acceptance_rules import Proposal, decide
from common.spec.tree.draft_tree import DraftTree
from common.sampling.logits_processing import LogitsProcessor
from common.model.loading import LoadedModel
from common.sampling.distributions import SamplingParams, SparseDistribution
from sprinter.v1 import decoding_pb2 as pb

PROMPT = [5, 6, 7, 8, 9, 10]
S = grpc.StatusCode


@pytest.fixture(scope="module", params=["per-session", "paged"])
def cloud(request, tiny_target):
    """A cloud that verifies trees of up to 16 tokens (the default), its KV budget invariant strict."""
    strict = os.environ.get("SPRINTER_CHECK_INVARIANTS")
    os.environ["SPRINTER_CHECK_INVARIANTS"] = "1"
    try:
        with ServerThread(CloudSettings(target="tiny-random", attention=request.param, max_context=256),
                          tiny_target) as server:
            yield server
    finally:
        if strict is None:
            del os.environ["SPRINTER_CHECK_INVARIANTS"]


@pytest.fixture()
def stream(cloud):
    with grpc.insecure_channel(cloud.address) as channel:
        s = SessionStream(channel)
        yield s
        s.close()


@torch.inference_mode()
def target_logits(target: LoadedModel, context: list[int]) -> torch.Tensor:
    """The target's float32 logits after `context`, from a forward over the whole of it (no cache)."""
    return target.model(torch.tensor([context])).logits[0, -1].float()


def greedy(target: LoadedModel, context: list[int], n: int) -> list[int]:
    out = list(context)
    for _ in range(n):
        out.append(int(target_logits(target, out).argmax()))
    return out[len(context):]


def point(token: int) -> SparseDistribution:
    return SparseDistribution(torch.tensor([token]), torch.tensor([1.0]))


def other(token: int, vocab_size: int) -> int:
    """A token that is not `token`: where the target's argmax is `token`, a draft's mistake."""
    return (token + 1) % vocab_size


def tree_verify(stream: SessionStream, start: int, tokens: list[int], parents: list[int], **kw) -> pb.CloudFrame:
    return stream.send(wire.verify_frame(wire.verify_block(start, tokens, "block", parents=parents, **kw)))


def side_path_rounds(stream: SessionStream, target: LoadedModel, prompt: list[int]) -> list[int]:
    """Two tree verifies whose target path is a side path, then a chain: the tokens the cloud kept, each verdict
    checked (its path, its length) and each kept token's logprob checked against a forward over the whole context."""
    expected = greedy(target, prompt, 14)
    v = target.vocab_size
    t = [None] + expected  # t[i]: the target's i-th token after the prompt
    rounds = [  # (tokens, parents, the path the target follows)
        ([t[1], other(t[2], v), 3, t[2], t[3]], [-1, 0, 1, 0, 3], [0, 3, 4]),  # a side branch after the first token
        ([other(t[5], v), 4, t[5], t[6], t[7]], [-1, 0, -1, 2, 3], [2, 3, 4]),  # the root's second child
    ]
    kept = []
    length = len(prompt)
    for tokens, parents, path in rounds:
        verdict = tree_verify(stream, length, tokens, parents).verdict
        assert list(verdict.path) == path and verdict.n_accepted == len(path)
        assert verdict.context_length == length + len(path) + 1
        kept += [tokens[i] for i in path] + [verdict.next_token]
        _check_logprobs(target, prompt + kept, verdict, len(path) + 1)
        length = verdict.context_length
    chain = expected[len(kept):len(kept) + 2] + [other(expected[len(kept) + 2], v)]
    verdict = stream.verify(length, chain).verdict
    assert verdict.n_accepted == 2 and not verdict.path
    kept += chain[:2] + [verdict.next_token]
    _check_logprobs(target, prompt + kept, verdict, 3)
    assert kept == expected[:len(kept)]
    return kept


def _check_logprobs(target: LoadedModel, context: list[int], verdict: pb.Verdict, n: int) -> None:
    """The verdict's logprobs of its n kept tokens are the target's after the true context: the KV was right."""
    assert len(verdict.logprobs) == n
    for m, scored in enumerate(verdict.logprobs):
        at = len(context) - n + m
        expected = torch.log_softmax(target_logits(target, context[:at]), -1)[context[at]].item()
        assert scored.logprob == pytest.approx(expected, abs=1e-4)


def test_a_side_path_is_kept_and_decoding_goes_on_as_the_targets_greedy(stream, tiny_target):
    opened = stream.open(PROMPT, sampling=pb.SamplingSettings(logprobs=0)).opened
    assert opened.limits.max_tree_tokens == 32 and opened.limits.max_block == 32  # the resident engine's default
    side_path_rounds(stream, tiny_target, PROMPT)


def test_a_tree_verdict_on_smollm2_keeps_the_side_path_the_target_follows(smollm2):
    prompt = smollm2.tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"]
    with ServerThread(CloudSettings(target="smollm2-135m", max_context=256), smollm2) as server, \
            grpc.insecure_channel(server.address) as channel:
        stream = SessionStream(channel)
        stream.open(prompt, sampling=pb.SamplingSettings(logprobs=0))
        side_path_rounds(stream, smollm2, prompt)
        stream.close()


def test_a_sampled_tree_verdict_is_decide_on_the_same_rows(stream, tiny_target):
    """The cloud reads the frame's q rows as the rule's: its verdict is `decide`'s on rows recomputed here, with the
    session's generator (seeded) drawing the same coins."""
    sampling = SamplingParams(temperature=1.0, seed=11)
    stream.open(PROMPT, sampling=wire.sampling_to_proto(sampling))
    tokens, parents = [20, 21, 22, 23, 24, 25], [-1, 0, 1, 0, -1, 4]
    rng = torch.Generator().manual_seed(3)
    dists = []
    for token in tokens:  # each node's q: its token and three others (ids from 30 up, never a node's), random weights
        support = torch.tensor([token] + (30 + torch.randperm(200, generator=rng)[:3]).tolist())
        probs = torch.rand(4, generator=rng) + 0.1
        dists.append(SparseDistribution(support, probs / probs.sum()))
    verdict = tree_verify(stream, len(PROMPT), tokens, parents, draft_dists=dists).verdict
    tree = DraftTree(tokens, parents)
    rows = torch.stack([target_logits(tiny_target, PROMPT)] + [
        target_logits(tiny_target, PROMPT + [tokens[n] for n in tree.path_to(node)]) for node in range(len(tokens))])
    q = torch.stack([d.to_dense(tiny_target.vocab_size) for d in dists])
    local = decide(Proposal(tokens, lambda _: q, parents=parents), "block", sampling,
                   torch.Generator().manual_seed(sampling.seed), logits=rows)
    assert list(verdict.path) == local.path and verdict.next_token == local.next_token
    assert verdict.context_length == len(PROMPT) + len(local.path) + 1


def _host(cloud):
    return cloud.server.servicer.host


def test_the_kv_budget_charges_every_tree_token_and_holds_after_a_side_path(cloud, stream):
    """A wide tree of 16 depth-1 tokens is granted 16 entries (not its depth, 1) before its forward, keep_path leaves
    the session's KV at its kept context inside the pages charged, and the strict invariant never fires."""
    opened = stream.open(PROMPT).opened
    session = _host(cloud).store._sessions[opened.session_id]
    tokens = [30 + i for i in range(16)]
    verdict = tree_verify(stream, len(PROMPT), tokens, [-1] * 16).verdict
    assert verdict.context_length == len(PROMPT) + verdict.n_accepted + 1
    assert session.cache.capacity >= len(PROMPT) + 16 and session.held_tokens >= len(PROMPT) + 16
    assert session.cache.length == session.cached_tokens == session.length - 1
    store, engine = _host(cloud).store, _host(cloud).engine
    assert engine.kv_bytes_in_use() <= store.limits.kv_budget_bytes
    assert session.kv_tokens * store.kv_bytes_per_token <= store.kv_bytes
    assert cloud.server.metrics.kv_over_budget._value.get() == 0


def test_candidates_after_a_side_path_are_dropped_and_after_the_primary_chain_verified(cloud, stream, tiny_target):
    stream.open(PROMPT)
    expected = greedy(tiny_target, PROMPT, 4)
    dropped, sides = _host(cloud).metrics.candidates.labels("dropped"), _host(cloud).metrics.tree_verdicts.labels("side")
    before, sides_before = dropped._value.get(), sides._value.get()
    side = tree_verify(stream, len(PROMPT), [other(expected[0], 259), expected[0]], [-1, -1]).verdict
    assert list(side.path) == [1] and sides._value.get() == sides_before + 1
    after = pb.AfterVerdict(start_position=side.start_position, n_accepted=side.n_accepted,
                            next_token=side.next_token)
    stream._requests.put(wire.verify_frame(wire.verify_block(side.context_length, [7], "block", after=after)))
    chain = stream.verify(side.context_length, [7]).verdict  # the candidate got no answer: this is the chain's
    assert chain.start_position == side.context_length and not chain.candidate
    assert dropped._value.get() == before + 1

    context = PROMPT + [expected[0], side.next_token] + [7][:chain.n_accepted] + [chain.next_token]
    tokens = [greedy(tiny_target, context, 1)[0], 3, 4]
    primary = tree_verify(stream, chain.context_length, tokens, [-1, 0, -1]).verdict
    assert list(primary.path) in ([0], [0, 1])  # the primary chain: a candidate may follow it
    after = pb.AfterVerdict(start_position=primary.start_position, n_accepted=primary.n_accepted,
                            next_token=primary.next_token)
    candidate = stream.send(wire.verify_frame(wire.verify_block(primary.context_length, [7], "block", after=after)))
    assert candidate.verdict.candidate and candidate.verdict.start_position == primary.context_length


@pytest.mark.parametrize("frame_args, field", [
    (dict(tokens=list(range(30, 63)), parents=[-1] * 33), "verify.parents"),  # 33 > 32
    (dict(method="token"), "verify.method"),
    (dict(method="sprinter"), "verify.method"),
    (dict(dists_on_rejection=True, draft_token_probs=[0.5, 0.5]), "verify.dists_on_rejection"),
    (dict(after=pb.AfterVerdict(start_position=0, n_accepted=0, next_token=5)), "verify.after"),  # matches or not
])
def test_tree_frames_the_cloud_refuses_name_the_field(cloud, stream, frame_args, field):
    stream.open(PROMPT, sampling=pb.SamplingSettings(temperature=1.0, seed=1))
    args = dict(tokens=[30, 31], parents=[-1, -1], method="block")
    args.update(frame_args)
    tokens = args.pop("tokens")
    block = wire.verify_block(len(PROMPT), tokens, args.pop("method"), parents=args.pop("parents"),
                              draft_dists=[point(t) for t in tokens], **args)
    if frame_args.get("dists_on_rejection"):
        block.ClearField("draft_dists")
    error = stream.send(wire.verify_frame(block)).error
    assert error.code == S.INVALID_ARGUMENT.value[0] and field in error.message, error


def test_vllm_reports_no_tree_tokens_whatever_the_flag_and_its_tree_frames_are_refused():
    engine = VllmEngine(None, TargetInfo("t", 100, frozenset(), "f"), None, CloudMetrics())
    limits = engine_limits(ServiceLimits(max_block=8), 16, engine)
    assert limits.max_tree_tokens == 0 and limits.to_proto().max_tree_tokens == 0
    with pytest.raises(CloudError) as caught:
        check_verify(wire.verify_block(3, [1, 2], "block", parents=[-1, -1]), 3, SamplingParams(), 100, limits)
    assert caught.value.code == S.INVALID_ARGUMENT and "verify.parents" in str(caught.value)
    with pytest.raises(ValueError, match="--max-tree-tokens 8 does not apply to --engine vllm"):
        CloudSettings(engine="vllm", max_tree_tokens=8)
    assert CloudSettings(engine="vllm").max_tree_tokens == 32  # the default is accepted, and reported as 0


def test_the_forward_chains_the_uncached_tokens_before_the_tree():
    assert forward_parents(1, [-1, 0, -1, 2]) == [-1, 0, 1, 0, 3]
    assert forward_parents(2, [-1, -1]) == [-1, 0, 1, 1]
    tree = DraftTree([1, 2, 3, 4], [-1, 0, 0, -1])
    assert on_primary_chain(tree, [0, 1]) and on_primary_chain(tree, []) and not on_primary_chain(tree, [0, 2])
    assert not on_primary_chain(tree, [3])


def test_each_tree_row_is_shaped_after_its_own_path():
    """Penalties read the tokens before a row: a node's row is shaped as the last row of its path's chain would be."""
    sampling = SamplingParams(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.7, logit_bias=((3, 2.0),))
    context = [1, 2, 3, 4]
    processor = LogitsProcessor(sampling, context[:2])
    tree = DraftTree([5, 6, 5, 7, 6], [-1, 0, -1, 2, 3])
    logits = torch.randn(1 + len(tree), 12, generator=torch.Generator().manual_seed(0))
    shaped = shaped_tree_rows(TargetRows(logits.argmax(-1), logits), processor, context, tree)
    assert torch.allclose(shaped.logits[0], processor.next_row(logits[0], context))
    for node in range(len(tree)):
        path_tokens = [tree.tokens[n] for n in tree.path_to(node)]
        assert torch.allclose(shaped.logits[1 + node], processor.next_row(logits[1 + node], context + path_tokens))
    assert shaped.argmax.tolist() == shaped.logits.argmax(-1).tolist()
    plain = TargetRows(logits.argmax(-1), logits)
    assert shaped_tree_rows(plain, None, context, tree) is plain
