"""Branching (common/spec/tree/branching.py): trees drafted where the estimate a_i is lowest, verified by the one rule.

* greedy: with branching on, the local decoder's output is the target's own, token for token, and side paths win;
* sampling at T=1: the first tokens' joint law with adaptive branching on is the target's (chi-square over fixed
  seeds); alternatives are drawn without replacement, each carrying its renormalised row, and a wrong variant
  (the draft's next-best tokens told as draws from q) fails the same check;
* the budget: more branch tokens with a longer round trip, none where the verifier takes no trees;
* settings: modes whose rule reads one path refuse branching;
* copy branches (common/spec/tree/copy_branches.py): with the hybrid proposer, where the suffix index continues a
  chain's prefix with another token, the copy is a side path; greedy keeps the target's output with copy paths
  winning (locally and over a real cloud), sampling keeps the target's law (and a copy told as a draw from the
  draft's row is caught), and auto prices a copy at the target's cost alone.
"""

from __future__ import annotations

import asyncio
import collections

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from common.spec.tree.branch_budget import auto_budget, auto_copy_lengths, tree_budget
from common.spec.cost_model import CostModel
from common.spec.cost_model import Ewma
from common.spec.tree import branching
from common.spec.tree.draft_tree import DraftTree
from common.spec.local_decoder import LocalDecoder
from common.spec.modes import DecodeSettings, parse_branch_tokens
from common.spec.propose.suffix_proposer import SuffixMemory, SuffixProposer
from common.sampling.distributions import SamplingParams, logits_to_probs
from common.spec.verifier import ConfidenceVerifier

PROMPTS = ("The quick brown fox", "def add(a, b):", "Once upon a time")
P_PASS = 1e-3  # the exact construction must not be rejected at this level
P_POWER = 1e-6  # a wrong construction must be rejected at this level
TOP_K = 6  # both models' supports overlap in part: branches are kept sometimes, and the joint has 36 cells
SEEDS = 300
BRANCH = 5  # WIDE one-token alternatives at the least trusted position: the wrong variant below enumerates q's best
WIDE = 5  # ones there (the default shape, fewer and longer branches, biases the first two tokens too little to be
#           caught in 300 seeds; exactness does not depend on the shape)


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny rows: torch's thread pool only adds wake-up latency on this busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("mode", ["sd-block", "sprinter-exact"])
def test_greedy_branching_keeps_the_targets_output_and_side_paths_win(tiny_target, tiny_draft, mode):
    engine = LocalDecoder(tiny_target, tiny_draft, ConfidenceVerifier(0.3))
    side_wins = 0
    for prompt in PROMPTS:
        ids = tiny_target.tokenizer(prompt)["input_ids"]
        reference = engine.generate(ids, DecodeSettings(mode="target", max_new_tokens=40)).token_ids
        result = engine.generate(ids, DecodeSettings(mode=mode, max_new_tokens=40, k=4, branch_tokens=6))
        assert result.token_ids == reference, prompt
        stats = result.stats
        assert stats.tree_rounds > 0 and stats.paths_per_round > 1
        assert stats.branch_tokens_kept >= stats.side_path_wins
        side_wins += stats.side_path_wins
    assert side_wins > 0  # the identity above covers rounds whose kept path left the chain


def _target_joint(target, ids: list[int], sampling: SamplingParams) -> dict[tuple[int, int], float]:
    """P(first two tokens) of the target's own sampling: p(t1) p(t2 | t1)."""
    with torch.no_grad():
        first = logits_to_probs(target.model(torch.tensor([ids])).logits[0, -1], sampling)
        joint = {}
        for t1 in first.nonzero().flatten().tolist():
            second = logits_to_probs(target.model(torch.tensor([ids + [t1]])).logits[0, -1], sampling)
            for t2 in second.nonzero().flatten().tolist():
                joint[(t1, t2)] = float(first[t1] * second[t2])
    return joint


def _joint_pvalue(engine: LocalDecoder, target, n: int, top_k: int = TOP_K, proposer: str = "model",
                  wins: str = "side_path_wins") -> tuple[float, int]:
    """The chi-square p-value of the first two tokens over `n` seeds against the target's law, and side-path wins
    (or the stat `wins` names)."""
    ids = target.tokenizer(PROMPTS[0])["input_ids"]
    sampling = SamplingParams(temperature=1.0, top_k=top_k)
    expected = _target_joint(target, ids, sampling)
    counts: collections.Counter = collections.Counter()
    side_wins = 0
    for seed in range(n):
        settings = DecodeSettings(mode="sprinter-exact", max_new_tokens=2, max_run_length=2, branch_tokens=BRANCH,
                                  proposer=proposer, sampling=SamplingParams(temperature=1.0, top_k=top_k, seed=seed))
        result = engine.generate(ids, settings)
        counts[tuple(result.token_ids[:2])] += 1
        side_wins += getattr(result.stats, wins)
    assert set(counts) <= set(expected)
    cells = sorted(expected)
    observed = np.array([counts[c] for c in cells], dtype=float)
    probs = np.array([expected[c] for c in cells])
    return chisquare(observed, probs / probs.sum() * n).pvalue, side_wins


def wide_and_short(monkeypatch) -> None:
    monkeypatch.setattr(branching, "MAX_ALTERNATIVES", WIDE)
    monkeypatch.setattr(branching, "branch_length", lambda budget: 1)


@pytest.mark.parametrize("shape", ["default", "wide and short"])
def test_sampled_branching_keeps_the_targets_law(tiny_target, tiny_draft, monkeypatch, shape):
    """The default shape, and the one the power check below catches a wrong construction in."""
    if shape != "default":
        wide_and_short(monkeypatch)
    engine = LocalDecoder(tiny_target, tiny_draft, ConfidenceVerifier(0.5))
    pvalue, side_wins = _joint_pvalue(engine, tiny_target, SEEDS)
    assert side_wins > 0
    assert pvalue > P_PASS


def _next_best(row, taken, greedy, generator):
    """Wrong: q's best token not yet taken, told as a draw from q."""
    rest = row.clone()
    rest[taken] = -1.0
    return int(torch.argmax(rest)), row


def test_next_best_alternatives_under_sampling_are_caught(tiny_target, tiny_draft, monkeypatch):
    """Power: siblings that are the draft's next-best tokens (not draws from the row they carry) bias the output.
    (Draws without replacement told as draws from q are caught at the rule level: tests/common/spec/tree/test_multipath_rules.py.)"""
    monkeypatch.setattr(branching, "alternative", _next_best)
    wide_and_short(monkeypatch)
    engine = LocalDecoder(tiny_target, tiny_draft, ConfidenceVerifier(0.5))
    pvalue, _ = _joint_pvalue(engine, tiny_target, SEEDS)
    assert pvalue < P_POWER


def test_auto_budget_branches_more_over_a_longer_round_trip():
    accept = [0.9, 0.6, 0.4, 0.7]
    budgets = []
    for rtt in (0.0, 50.0, 200.0):
        costs = CostModel(prior_draft_ms=5.0, prior_verify_base_ms=20.0, prior_verify_per_token_ms=2.0)
        costs.observe_rtt(rtt)
        costs.observe_rtt(rtt)
        budgets.append(auto_budget(accept, costs, room=24, depth_limit=8)[0])
    assert budgets[0] <= budgets[1] <= budgets[2]
    assert budgets[0] < budgets[2]
    assert auto_budget([0.99, 0.99], CostModel(prior_draft_ms=50.0), room=12, depth_limit=8)[0] == 0


def test_auto_prices_the_shape_the_edge_drafts():
    """Auto's tokens are whole branches of its length in the shape's order (the least trusted position first, up to
    three alternatives there), and a cheaper extra row of the batched draft step buys more of them."""
    accept = [0.9, 0.6, 0.4, 0.7]
    plans = []
    for extra_row in (1.0, 0.1):
        costs = CostModel(prior_draft_ms=5.0, prior_verify_base_ms=20.0, prior_verify_per_token_ms=2.0,
                          prior_extra_row_share=extra_row)
        costs.observe_rtt(200.0)
        plans.append(auto_budget(accept, costs, room=24, depth_limit=8))
    (sequential, length_s), (batched, length_b) = plans
    assert sequential % length_s == 0 and batched % length_b == 0  # whole branches (none cut by room or depth)
    assert batched > sequential >= length_s  # the second alternative pays when its steps are nearly free
    costs.observe_rtt(1000.0)
    wide, length = auto_budget(accept, costs, room=24, depth_limit=8)
    assert wide > batched and branching.MIN_BRANCH_LENGTH <= length <= branching.MAX_BRANCH_LENGTH
    assert 0 < auto_budget(accept, costs, room=24, depth_limit=3)[0] < wide  # the third position: branches 1 deep
    costs = CostModel(prior_draft_ms=20.0)
    costs.observe_draft_step(20.0)
    costs.observe_batched_step(26.0, rows=3)
    assert costs.extra_row_share < 0.25  # learned from the step: (26 / 20 - 1) / 2 = 0.15, pulled from the prior
    costs.observe_sequential_rows()
    assert costs.extra_row_share > 0.3


def test_the_plan_spends_the_budget_lowest_estimate_first_and_gives_what_a_point_left_to_the_next():
    points = branching.lowest_first([0.9, 0.5, 0.2, 0.8], among=[0, 1, 2])
    assert points == [2, 1, 0] and branching.lowest_first([0.5, 0.5]) == [0, 1]  # earlier first on a tie
    plan = branching.BranchPlan(points, 10, depth_limit=6, longest=3)
    first = next(iter_plan := iter(plan))
    assert first == (2, [3] * branching.MAX_ALTERNATIVES)
    plan.spend(3)  # one alternative only (say no token was left to draw): the next point gets the rest
    assert next(iter_plan) == (1, [3, 3, 1])
    plan.spend(7)
    assert list(iter_plan) == []  # spent: no further point


def test_budget_respects_the_verifiers_tree_limit():
    costs = CostModel(prior_rtt_ms=500.0)
    assert tree_budget(6, [0.5, 0.5], (), costs, room=0, depth_limit=8).budget == 0  # max_tree_tokens 0: chains only
    assert tree_budget("auto", [0.5, 0.5], (), costs, room=-1, depth_limit=8).budget == 0
    assert tree_budget(6, [0.5, 0.5], (), costs, room=4, depth_limit=8).budget == 4
    assert tree_budget(6, [0.5, 0.5], (), costs, room=None, depth_limit=8).budget == 6
    assert tree_budget(0, [0.5, 0.5], (), costs, room=None, depth_limit=8).budget == 0


@pytest.mark.parametrize("mode", ["sd", "sprinter", "cloud-sd", "target", "draft"])
def test_modes_whose_rule_reads_one_path_refuse_branching(mode):
    with pytest.raises(ValueError, match="branch_tokens"):
        DecodeSettings(mode=mode, branch_tokens=4)
    DecodeSettings(mode=mode, branch_tokens=0)


def test_branch_tokens_parse():
    assert parse_branch_tokens("auto") == "auto" and parse_branch_tokens("8") == 8
    with pytest.raises(ValueError, match="branch tokens"):
        parse_branch_tokens("-2")
    with pytest.raises(ValueError, match="branch_tokens"):
        DecodeSettings(mode="sd-block", branch_tokens=-1)


def _edge_generate(tiny_draft, address: str, settings: DecodeSettings):
    from edge.cloud_link.client import CloudEndpoint
    from edge.cloud_link.replicas import ReplicaSet
    from edge.decoding.decoder import EdgeDecoder, EdgeSettings
    from edge_harness import scripted

    async def run():
        replicas = ReplicaSet([address], lambda a, _: CloudEndpoint(a), scripted(tiny_draft).tokenizer_fingerprint)
        async with replicas:
            from common.model.cached_lm import CachedLM
            decoder = EdgeDecoder(tiny_draft, lambda with_hidden: CachedLM(tiny_draft.model, with_hidden),
                                  ConfidenceVerifier(0.5), replicas)
            prompt = tiny_draft.tokenizer("The quick brown fox")["input_ids"]
            return await decoder.generate(prompt, EdgeSettings(settings))
    return asyncio.run(run())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cloud_target_sends_the_tree_and_commits_the_kept_path(tiny_draft, temperature):
    """Over a scripted cloud that keeps each tree's path to its last node: the frame carries the parents (and one
    draft distribution per node under sampling), and the edge commits that side path's tokens."""
    from edge_harness import ScriptedCloud, scripted

    script = scripted(tiny_draft, max_tree_tokens=10)
    settings = DecodeSettings(mode="sd-block", k=4, max_new_tokens=12, branch_tokens=4,
                              sampling=SamplingParams(temperature=temperature, seed=1))
    with ScriptedCloud(script) as cloud:
        result = _edge_generate(tiny_draft, cloud.address, settings)
    trees = [f for f in script.frames if f.parents]
    assert trees and result.stats.side_path_wins == len(trees)
    output, committed = result.token_ids, 0
    for frame in script.frames:
        tokens, parents = list(frame.draft_tokens), list(frame.parents)
        assert len(tokens) <= 10
        assert len(frame.draft_dists) == (0 if temperature == 0 else len(tokens))
        path = DraftTree(tokens, parents).path_to(len(tokens) - 1) if parents else list(range(len(tokens)))
        kept = [tokens[n] for n in path] + [script.next_token]
        assert output[committed:committed + len(kept)] == kept[:len(output) - committed]
        committed += len(kept)


def test_no_branching_when_the_cloud_verifies_chains_only(tiny_draft):
    from edge_harness import ScriptedCloud, scripted

    script = scripted(tiny_draft)  # max_tree_tokens 0
    with ScriptedCloud(script) as cloud:
        result = _edge_generate(tiny_draft, cloud.address, DecodeSettings(mode="sd-block", k=4, max_new_tokens=8,
                                                                          branch_tokens=4))
    assert script.frames and not any(f.parents for f in script.frames)
    assert result.stats.tree_rounds == 0


def _drafted_chain(model, context: list[int], length: int):
    """The draft's chain of `length` tokens after `context`, with no target (as a round's first half drafts it)."""
    from common.spec.propose.proposals import PendingBlock
    from common.spec.speculative_round import run_inline

    async def chain() -> PendingBlock:
        block = PendingBlock()
        async for proposed in model.propose(context, length, None, None, to_verify=False):
            block.drafted.append(proposed)
        return block

    return run_inline(chain())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tree_layout_chain_first_then_branches_from_the_lowest_estimates(tiny_draft, temperature):
    """Nodes 0..g-1 are the chain; each branch hangs off the chain at a branch point, lowest a_i first, its first
    node drawn from the chain token's row without the tokens already there (and carrying that row), never deeper
    than the round's limit."""
    from common.model.cached_lm import CachedLM
    from common.spec.propose.drafting import LocalDraft, ModelProposer
    from common.spec.speculative_round import run_inline

    sampling = SamplingParams(temperature=temperature, seed=0)
    model = ModelProposer(LocalDraft(CachedLM(tiny_draft.model)), sampling, torch.Generator().manual_seed(0),
                          frozenset())
    context = tiny_draft.tokenizer("Once upon a time")["input_ids"]

    block = _drafted_chain(model, context, 5)
    tree = run_inline(branching.draft_branches(model, context, block, 7, len(block)))
    draft_tree = DraftTree(tree.nodes.tokens, tree.parents)
    assert tree.nodes.tokens[:5] == block.tokens and draft_tree.primary_chain(0) == list(range(5))
    assert len(tree.nodes) == 5 + 7 and max(draft_tree.depths()) <= 5
    points = branching.branch_points(block, sampling.greedy)
    roots = [i for i in range(5, len(tree.nodes)) if tree.parents[i] < 5]
    positions = [tree.parents[r] + 1 for r in roots]  # the least trusted position first, up to 3 alternatives each
    ranks = [points.index(position) for position in positions]
    assert ranks == sorted(ranks) and ranks[0] == 0
    assert all(positions.count(p) <= branching.MAX_ALTERNATIVES for p in positions)
    for r in roots:
        position = tree.parents[r] + 1
        if temperature == 0:
            assert tree.nodes.drafted[r].token != block.tokens[position]
        else:  # q without the tokens its parent already had, renormalised: the row it was drawn from
            row = tree.nodes.drafted[r].p_draft
            taken = [tree.nodes.drafted[k].token for k in range(r) if tree.parents[k] == tree.parents[r]]
            q = block.drafted[position].p_draft
            assert float(row[taken].sum()) == 0 and abs(float(row.sum()) - 1) < 1e-5
            assert torch.allclose(row, branching.without(q, taken))
            assert tree.nodes.drafted[r].token not in taken
    deep = run_inline(branching.draft_branches(model, context, block, 6, 9, points=[4]))  # beside the last token
    deep_tree = DraftTree(deep.nodes.tokens, deep.parents)
    assert [deep.parents[i] for i in range(5, 11) if deep.parents[i] < 5] == [3, 3]  # two alternatives of 3 tokens
    assert max(deep_tree.depths()) == 4 + 3  # past the chain's length, within the round's limit
    for p in set(positions):  # each token once: next-best under greedy, drawn without replacement under sampling
        alternatives = [tree.nodes.drafted[r].token for r, q in zip(roots, positions) if q == p]
        assert len(set(alternatives)) == len(alternatives) and block.tokens[p] not in alternatives


class _OneAtATime:
    """A draft runtime that cannot batch (as the ONNX export): the branches are drafted one after another."""

    def __init__(self, lm) -> None:
        self.lm = lm

    def advance_to(self, context: list[int], n_logits: int = 1):
        return self.lm.advance_to(context, n_logits)


def test_branches_at_a_point_drafted_side_by_side_are_those_drafted_one_after_another(tiny_draft):
    """Under greedy, the alternatives at one point continued in one batched forward per token give the tokens that
    drafting them one after another gives, in fewer forwards; the EOS-free branches run to their length."""
    from common.model.cached_lm import CachedLM
    from common.spec.propose.drafting import LocalDraft, ModelProposer
    from common.spec.speculative_round import run_inline

    context = tiny_draft.tokenizer("Once upon a time")["input_ids"]
    trees, calls = [], []
    for batched in (True, False):
        lm = CachedLM(tiny_draft.model)
        model = ModelProposer(LocalDraft(lm if batched else _OneAtATime(lm)), SamplingParams(temperature=0.0),
                              torch.Generator(), frozenset())
        block = _drafted_chain(model, context, 5)
        before = lm.forward_calls
        trees.append(run_inline(branching.draft_branches(model, context, block, 12, 9, points=[2])))
        calls.append(lm.forward_calls - before)
    assert trees[0].nodes.tokens == trees[1].nodes.tokens and trees[0].parents == trees[1].parents
    assert len(trees[0].nodes) == 5 + 12  # three alternatives of 4 tokens at position 2
    assert calls[0] < calls[1]  # 1 + 3 (the prefix, then each token of the three rows at once) against 3 x 3


@pytest.mark.parametrize("runtime", ["torch", "onnx"])
def test_branching_over_a_real_cloud_keeps_the_targets_output(tiny_target, tiny_draft, runtime):
    """An edge over a real resident cloud on loopback (tree forward, GBV's greedy form, keep_path): every lossless
    tree mode's output is the target's own under greedy, side paths win, and the cloud counts them."""
    from cloud.server import CloudSettings
    from cloud_harness import ServerThread
    from edge.decoding.decoder import EdgeSettings
    from edge.node import EdgeNode, EdgeNodeSettings

    prompts = [tiny_target.tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    reference = [LocalDecoder(tiny_target, None).generate(p, DecodeSettings(mode="target", max_new_tokens=40)).token_ids
                 for p in prompts]

    async def work(address: str) -> dict:
        settings = EdgeNodeSettings(draft=tiny_draft.spec, cloud=address, draft_runtime=runtime, dtype="float32",
                                    verifier="confidence:0.3")
        async with EdgeNode(settings, tiny_draft) as node:
            return {(mode, i): await node.decoder.generate(p, EdgeSettings(DecodeSettings(
                        mode=mode, max_new_tokens=40, k=4, branch_tokens=6)))
                    for mode in ("sd-block", "sprinter-exact") for i, p in enumerate(prompts)}

    async def sampled(address: str):  # GBV in the cloud: the per-node distributions travel and are read
        settings = EdgeNodeSettings(draft=tiny_draft.spec, cloud=address, draft_runtime=runtime, dtype="float32",
                                    verifier="confidence:0.5")
        async with EdgeNode(settings, tiny_draft) as node:
            return await node.decoder.generate(prompts[0], EdgeSettings(DecodeSettings(
                mode="sprinter-exact", max_new_tokens=24, k=4, branch_tokens=6,
                sampling=SamplingParams(temperature=1.0, top_k=TOP_K, seed=3))))

    with ServerThread(CloudSettings(target="tiny-random", batch_window_ms=1), tiny_target) as cloud:
        results = asyncio.run(work(cloud.address))
        side_verdicts = cloud.server.metrics.tree_verdicts.labels("side")._value.get()
        drawn = asyncio.run(sampled(cloud.address))
    assert not drawn.degraded and drawn.stats.tree_rounds > 0
    for (mode, i), result in results.items():
        assert not result.degraded, mode
        assert result.token_ids == reference[i], (mode, i)
    assert sum(r.stats.tree_rounds for r in results.values()) > 0
    side_wins = sum(r.stats.side_path_wins for r in results.values())
    assert side_wins > 0 and side_verdicts == side_wins


def test_greedy_alternatives_follow_the_requests_shaped_logits(tiny_draft):
    """A token the request's logit_bias buries is never offered as an alternative; a row with no allowed token left
    offers none."""
    from common.spec.propose.drafting import LocalDraft, ModelProposer
    from common.model.cached_lm import CachedLM
    from common.sampling.logits_processing import LogitsProcessor

    context = tiny_draft.tokenizer("Once upon a time")["input_ids"]
    greedy = SamplingParams(temperature=0.0)
    plain = ModelProposer(LocalDraft(CachedLM(tiny_draft.model)), greedy, torch.Generator(), frozenset())

    block = _drafted_chain(plain, context, 2)
    ranked = torch.topk(block.drafted[0].step.logits.float(), 3).indices.tolist()  # the chain's token, then 2nd, 3rd
    biased = SamplingParams(temperature=0.0, logit_bias=((ranked[1], -100.0),))
    model = ModelProposer(LocalDraft(CachedLM(tiny_draft.model)), biased, torch.Generator(), frozenset(),
                          processor=LogitsProcessor(biased, context))
    row = branching.shaped_row(model, context, block, 0)
    taken = [ranked[0]]  # the chain's token
    assert branching.alternative(row, taken, True, model.generator) == (ranked[2], None)
    assert branching.alternative(branching.shaped_row(plain, context, block, 0), taken, True, plain.generator) \
        == (ranked[1], None)
    only_the_chains = torch.full_like(row, float("-inf"))
    only_the_chains[ranked[0]] = 0.0
    assert branching.alternative(only_the_chains, taken, True, model.generator) is None


def _copying_memory() -> SuffixMemory:
    """A suffix memory whose draft estimate is pinned above every copy's rate: the hybrid proposer's chains are the
    draft's own, so the suffix index's proposals go to the tree as copy branches."""
    return SuffixMemory(model_estimate=Ewma(0.95, 0.0, n=1))


def _greedy_reference(target, prompt: str, tokens: int = 40) -> tuple[list[int], list[int]]:
    ids = target.tokenizer(prompt)["input_ids"]
    return ids, LocalDecoder(target, None).generate(ids, DecodeSettings(mode="target", max_new_tokens=tokens)).token_ids


@pytest.mark.parametrize("mode", ["sd-block", "sprinter-exact"])
def test_greedy_copy_branches_keep_the_targets_output_and_win(tiny_target, tiny_draft, mode):
    """An earlier request's output (the target's own continuation) in the edge's cache: where the draft's chain
    leaves it, the copy is a side path, and the target follows it."""
    copy_wins = 0
    for prompt in PROMPTS:
        ids, reference = _greedy_reference(tiny_target, prompt)
        memory = _copying_memory()
        memory.cache.add(reference)
        engine = LocalDecoder(tiny_target, tiny_draft, ConfidenceVerifier(0.3), suffix_memory=memory)
        result = engine.generate(ids, DecodeSettings(mode=mode, max_new_tokens=40, k=4, branch_tokens=6,
                                                     proposer="hybrid"))
        assert result.token_ids == reference, prompt
        assert result.stats.copy_branch_tokens > 0 and result.stats.copy_path_wins <= result.stats.side_path_wins
        copy_wins += result.stats.copy_path_wins
    assert copy_wins > 0


def _quoting_memory(target) -> SuffixMemory:
    """A cache holding an earlier output that quotes the first prompt and the target's greedy continuation: copies
    from the root on."""
    ids, reference = _greedy_reference(target, PROMPTS[0], 8)
    memory = _copying_memory()
    memory.cache.add(ids + reference)
    return memory


def test_sampled_copy_branches_keep_the_targets_law(tiny_target, tiny_draft):
    engine = LocalDecoder(tiny_target, tiny_draft, ConfidenceVerifier(0.5), suffix_memory=_quoting_memory(tiny_target))
    pvalue, copy_wins = _joint_pvalue(engine, tiny_target, SEEDS, proposer="hybrid", wins="copy_path_wins")
    assert copy_wins > 0
    assert pvalue > P_PASS


def test_a_copy_told_as_a_draw_from_the_drafts_row_is_caught(tiny_target, tiny_draft, monkeypatch):
    """Power: a copy sent with the chain token's row (as if the draft had drawn it) instead of its point mass."""
    from dataclasses import replace

    from common.spec import speculative_round
    from common.spec.tree import copy_branches

    def as_drawn(chain, offers, lengths):
        tree = copy_branches.attach_copies(chain, offers, lengths)
        first = len(chain)
        for offer, length in zip(offers, lengths):
            if length:
                tree.nodes.drafted[first] = replace(tree.nodes.drafted[first],
                                                    p_draft=chain.drafted[offer.position].p_draft)
            first += length
        return tree

    monkeypatch.setattr(speculative_round, "attach_copies", as_drawn)
    engine = LocalDecoder(tiny_target, tiny_draft, ConfidenceVerifier(0.5), suffix_memory=_quoting_memory(tiny_target))
    pvalue, _ = _joint_pvalue(engine, tiny_target, SEEDS, proposer="hybrid")
    assert pvalue < P_POWER


def test_auto_sends_copies_where_the_drafts_branches_never_pay():
    """A CPU edge: a draft step dearer than what a kept token is worth, a cheap target token. The draft's branches
    never pay; a copy, which takes no draft step, does, as long as its tokens' gain stays above the target's cost."""
    accept = [0.9, 0.6, 0.4, 0.7]
    costs = CostModel(prior_draft_ms=40.0, prior_verify_base_ms=20.0, prior_verify_per_token_ms=2.0)
    costs.observe_rtt(50.0)
    assert auto_budget(accept, costs, room=12, depth_limit=8)[0] == 0
    offers = [(2, [0.8] * 8), (1, [0.6] * 8)]
    lengths = auto_copy_lengths(accept, offers, costs, room=12)
    assert lengths[0] > 0 and sum(lengths) <= 12
    plan = tree_budget("auto", accept, offers, costs, room=12, depth_limit=8)
    assert plan.copies == lengths and plan.budget == 0
    dear = CostModel(prior_draft_ms=40.0, prior_verify_base_ms=20.0, prior_verify_per_token_ms=10.0)
    dear.observe_rtt(50.0)
    assert auto_copy_lengths(accept, offers, dear, room=12)[0] < lengths[0]  # a dearer target token: shorter copies
    assert auto_copy_lengths(accept, offers, costs, room=3) == [3, 0]


def test_a_fixed_budget_takes_the_copies_first_then_the_drafts_branches():
    offers = [(2, [0.8] * 4), (0, [0.7] * 3)]
    def plan(n, room):
        made = tree_budget(n, [0.5, 0.5, 0.5], offers, None, room=room, depth_limit=8)
        return made.copies, made.budget

    assert plan(6, None) == ([4, 2], 0)
    assert plan(9, None) == ([4, 3], 2)
    assert plan(9, 5) == ([4, 1], 0)
    assert plan(0, None) == ([0, 0], 0)


def test_copy_branches_over_a_real_cloud_keep_the_targets_output(tiny_target, tiny_draft):
    """The hybrid edge over a real resident cloud on loopback: copy branches travel in the tree frame (point masses
    under sampling), the cloud keeps copy paths, and the output is the target's own under greedy."""
    from cloud.server import CloudSettings
    from cloud_harness import ServerThread
    from edge.decoding.decoder import EdgeSettings
    from edge.node import EdgeNode, EdgeNodeSettings

    references = [_greedy_reference(tiny_target, prompt) for prompt in PROMPTS[:2]]

    async def work(address: str) -> list:
        settings = EdgeNodeSettings(draft=tiny_draft.spec, cloud=address, dtype="float32", verifier="confidence:0.3")
        async with EdgeNode(settings, tiny_draft) as node:
            memory = node.decoder.suffix_memory
            memory.model_estimate = _copying_memory().model_estimate
            for ids, reference in references:
                memory.cache.add(ids + reference)  # an earlier output that quoted the prompt: copies from the root on
            greedy = [await node.decoder.generate(ids, EdgeSettings(DecodeSettings(
                          mode=mode, max_new_tokens=40, k=4, branch_tokens=6, proposer="hybrid")))
                      for mode in ("sd-block", "sprinter-exact") for ids, _ in references]
            sampled = await node.decoder.generate(references[0][0], EdgeSettings(DecodeSettings(
                mode="sprinter-exact", max_new_tokens=24, k=4, branch_tokens=6, proposer="hybrid",
                sampling=SamplingParams(temperature=1.0, top_k=TOP_K, seed=3))))
            return greedy, sampled

    with ServerThread(CloudSettings(target="tiny-random", batch_window_ms=1), tiny_target) as cloud:
        results, sampled = asyncio.run(work(cloud.address))
    assert not sampled.degraded and sampled.stats.copy_branch_tokens > 0
    for result, (_, reference) in zip(results, references * 2):
        assert not result.degraded and result.token_ids == reference
    assert sum(r.stats.copy_branch_tokens for r in results) > 0
    assert sum(r.stats.copy_path_wins for r in results) > 0


def test_tree_layout_chain_then_copies_then_the_drafts_branches(tiny_target, tiny_draft):
    """Nodes 0..g-1 are the chain; then each copy offer whole (point masses, a sibling of the chain's token at its
    position, another token than it), lowest chain estimate first; then the draft's branches."""
    from common.model.cached_lm import CachedLM
    from common.spec.tree.copy_branches import attach_copies, copy_offers
    from common.spec.propose.drafting import LocalDraft, ModelProposer
    from common.spec.propose.hybrid_proposer import ChainedRuns
    from common.spec.speculative_round import run_inline

    model = ModelProposer(LocalDraft(CachedLM(tiny_draft.model)), SamplingParams(), torch.Generator(), frozenset())
    proposer = SuffixProposer(model, _quoting_memory(tiny_target), rule=ChainedRuns())
    context = tiny_draft.tokenizer(PROMPTS[0])["input_ids"]

    block = _drafted_chain(model, context, 5)
    offers = copy_offers(proposer, context, block, depth_limit=5)
    assert offers and all(o.run[0].token != block.tokens[o.position] for o in offers)
    estimates = [branching.estimate(d) for d in block.drafted]
    assert [o.position for o in offers] == sorted((o.position for o in offers), key=lambda i: (estimates[i], i))
    lengths = [len(o.run) for o in offers]
    tree = run_inline(branching.draft_branches(model, context, block, 3, len(block),
                                               grown=attach_copies(block, offers, lengths)))
    copied = len(block) + sum(lengths)
    assert tree.nodes.tokens[:5] == block.tokens and len(tree.nodes) == copied + 3
    assert all(d.p_draft is None and not d.from_model for d in tree.nodes.drafted[5:copied])
    assert all(d.from_model for d in tree.nodes.drafted[copied:]) and tree.copy_tokens == sum(lengths)
    first = len(block)
    for offer, length in zip(offers, lengths):
        assert tree.parents[first] == offer.position - 1 and tree.nodes.drafted[first].token == offer.run[0].token
        assert tree.parents[first + 1:first + length] == list(range(first, first + length - 1))
        assert max(DraftTree(tree.nodes.tokens, tree.parents).depths()) <= 5
        first += length
