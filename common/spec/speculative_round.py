"""The speculative round, written once: draft a pending block, verify it, keep what the verdict keeps.

Glossary
    context        the prompt and every committed token; a block is drafted after it
    pending block  x_1..x_g: proposed tokens no target has checked yet (proposals.py: the draft model's, or text
                   copied from where the context matched, behind one seam)
    a_i            the verifier's estimate that the target accepts x_i; the call policy reads a_1..a_g
                   after each token and decides when the block goes to the target
    target         where a block is verified (`Target`): `LocalTarget` below, in this process, or a
                   cloud session on the edge (`CloudTarget`, edge/cloud_link/cloud_target.py)
    verdict        (n_accepted, next_token): keep x_1..x_n, then the target's own token; one round
                   therefore yields n_accepted + 1 tokens
    tree           with branching on (`--branch-tokens`, branching.py), the chain grows alternatives where a_i is
                   low and goes out as one draft tree; the verdict's `path` names the kept nodes, root first
    rule           the acceptance rule of the mode (modes.py, common/spec/acceptance_rules.py), applied by the
                   one verdict entry (common/spec/acceptance_rules.py)

One round, in every process that decodes (local decoder, edge decoder, verifier data collection):
    limit   = block_limit(...)                        the mode's cap within the context's room
    block   = draft_block(...)                        draft after the context until the call policy sends,
                                                      the limit, EOS or the length budget
    tree    = grow_tree(...)                          branches where a_i is lowest, and copies where the
                                                      suffix index differs from the chain, within the budget
                                                      (or None)
    verdict = target.verify(context, block, tree)     one target forward over the block (or tree) + the rule
    apply_verdict(...)                                commit the kept path + [next_token], cut at EOS, a stop
                                                      sequence or the length limit (generation.py); the
                                                      policy sees (g, n), the cost model the round trip
                                                      (except in the first round, which also prefilled)
`speculative_round` is these four lines. The edge's pipeline (edge/decoding/pipeline.py) and its first
token (edge/decoding/decoder.py) call the same halves around a different drafting strategy.
Without a reachable target (mode draft, or a cloud that is down) the block stands as drafted.
"""

from __future__ import annotations

import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from common.model.cached_lm import CachedLM
from common.spec.call_policy import CallPolicy
from common.spec.cost_model import CostModel
from common.spec.tree.branch_budget import tree_budget
from common.spec.tree.branching import TreeBlock, draft_branches, estimate
from common.spec.tree.copy_branches import attach_copies, copy_offers
from common.spec.propose.drafting import Drafter
from common.spec.propose.proposals import PendingBlock, ProposedToken
from common.spec.generation import Generation
from common.sampling.logits_processing import LogitsProcessor
from common.sampling.logprobs import TokenLogprob, logprobs_of
from common.sampling.distributions import SamplingParams
from common.spec.acceptance_rules import Proposal, decide
from common.spec.tree.draft_tree import DraftTree
from common.tracing import tracer

T = TypeVar("T")

# Tokens drafted between deliveries when no target is reachable: the client still sees text flow.
DRAFT_ONLY_BLOCK = 8


@dataclass(frozen=True)
class Verdict:
    n_accepted: int  # draft tokens kept
    next_token: int  # the target's token after them
    verify_ms: float  # the target's forward and the rule
    round_trip_ms: float | None  # what drafting waited; None when the call also paid for an open or a reopen
    target_logits: torch.Tensor | None = None  # [g + 1, V] along the block (local target only)
    p_target: torch.Tensor | None = None  # [g + 1, V] the distributions the rule read (local target only)
    logprobs: list[TokenLogprob] | None = None  # the target's, of the n_accepted + 1 kept tokens, when asked
    path: list[int] | None = None  # a tree's kept nodes, root first (n_accepted of them); None: a chain's x_1..x_n


@dataclass(frozen=True)
class Round:
    block: PendingBlock  # what was drafted
    verdict: Verdict | None  # None: no target was reached, the block stood as drafted


class Target(Protocol):
    """Where pending blocks are verified: the target in this process, or a session on the cloud."""

    def reachable(self) -> bool:
        """Worth calling now (a cloud that just failed is retried only after a while)."""
        ...

    @property
    def max_tree_tokens(self) -> int | None:
        """Draft tokens a tree may hold (0: chains only; None: no limit of its own)."""
        ...

    async def verify(self, context: list[int], block: PendingBlock, tree: TreeBlock | None = None) -> Verdict | None:
        """The verdict on `block` (or `tree`, its chain with branches) drafted after `context`; None when no target
        could be reached."""
        ...


class LocalTarget:
    """Verification in this process: one forward of the target over the block, then the mode's rule."""

    def __init__(self, target_lm: CachedLM, sampling: SamplingParams, generator: torch.Generator,
                 method: str, processor: LogitsProcessor | None = None) -> None:
        self.target_lm = target_lm
        self.sampling = sampling
        self.processor = processor  # the request's logit_bias and penalties: the rule verifies the target so shaped
        self.generator = generator  # the drafter's: one seeded stream per generation, as the cloud has per session
        self.method = method  # the mode's verify method (common/spec/acceptance_rules.py: or greedy, whatever the sampling)

    def reachable(self) -> bool:
        return True

    @property
    def max_tree_tokens(self) -> int | None:
        return None

    async def verify(self, context: list[int], block: PendingBlock, tree: TreeBlock | None = None) -> Verdict:
        started = time.perf_counter()
        if tree is not None:
            return self._verify_tree(context, tree, started)
        g = len(block)
        target_logits = self.target_lm.advance_to(context + block.tokens, n_logits=g + 1).logits  # [g + 1, V]
        shaped = self.processor.rows(target_logits, context, block.tokens) if self.processor else target_logits
        decision = decide(Proposal(block.tokens, block.p_draft), self.method, self.sampling, self.generator,
                          logits=shaped, keep_rows=True)
        n_accepted, next_token = decision.n_accepted, decision.next_token
        verify_ms = (time.perf_counter() - started) * 1e3
        kept = block.tokens[:n_accepted] + [next_token]
        logprobs = logprobs_of(target_logits, kept, self.sampling.logprobs) if self.sampling.logprobs is not None \
            else None
        # In one process the round trip is the target's work alone: the cost model's rtt stays 0.
        return Verdict(n_accepted, next_token, verify_ms, verify_ms, target_logits, decision.p_target, logprobs)

    def _verify_tree(self, context: list[int], tree: TreeBlock, started: float) -> Verdict:
        """A draft tree, path-wise: each root-to-leaf path is one forward of the target (the KV keeps the common
        prefix with the path before, so shared nodes are fed once per divergence), exactly the rows one tree-masked
        forward gives (the cloud's). Then the rule on the tree (`decide` with parents)."""
        draft_tree = DraftTree(tree.nodes.tokens, tree.parents)
        raw: list[torch.Tensor | None] = [None] * (1 + len(draft_tree))
        shaped: list[torch.Tensor | None] = [None] * (1 + len(draft_tree))
        for path in draft_tree.paths():
            tokens = draft_tree.tokens_along(path)
            slots = [0] + [1 + n for n in path]
            first = next(k for k, slot in enumerate(slots) if raw[slot] is None)  # rows before it are known
            # the KV must not hold the token before row `first`'s position: the forward computes rows it feeds
            self.target_lm.rollback(min(len(self.target_lm.tokens), len(context) + first - 1))
            logits = self.target_lm.advance_to(context + tokens, n_logits=len(slots) - first).logits
            rows = self.processor.rows(logits, context + tokens[:first], tokens[first:]) if self.processor else logits
            for k, slot in enumerate(slots[first:]):
                raw[slot], shaped[slot] = logits[k], rows[k]
        decision = decide(Proposal(draft_tree.tokens, tree.nodes.p_draft, parents=draft_tree.parents), self.method,
                          self.sampling, self.generator, logits=torch.stack(shaped), keep_rows=True)
        path, next_token = decision.path, decision.next_token
        kept = draft_tree.tokens_along(path) + [next_token]
        along = torch.stack([raw[slot] for slot in [0] + [1 + n for n in path]])  # the kept path's rows
        logprobs = logprobs_of(along, kept, self.sampling.logprobs) if self.sampling.logprobs is not None else None
        verify_ms = (time.perf_counter() - started) * 1e3
        return Verdict(len(path), next_token, verify_ms, verify_ms, along, None, logprobs, path)


def block_limit(generation: Generation, to_verify: bool) -> int:
    """The longest block the next round may draft: the mode's cap within the room the context has left for it
    and the target's token after it; without a target, the draft-only chunk within the length budget."""
    if not to_verify:
        return min(DRAFT_ONLY_BLOCK, generation.budget)
    return min(generation.settings.round_cap, generation.block_room)


async def draft_block(generation: Generation, drafter: Drafter, context: list[int], limit: int,
                      policy: CallPolicy | None, cost_model: CostModel | None, to_verify: bool = True,
                      prefix: PendingBlock | None = None) -> PendingBlock:
    """The round's first half: a block of at most `limit` tokens after `context`, continuing `prefix` (tokens
    drafted ahead: edge/decoding/pipeline.py), under the call policy. `cost_model` learns the drafting steps
    (pass None in the first round, whose drafting overlaps the prompt's prefill)."""
    # sprinter never checks a token its verifier passed: the client may have it at once.
    def on_passed(drafted: ProposedToken) -> None:  # the draft's logprob: no target judges a passed token
        logprobs = PendingBlock([drafted]).draft_logprobs(generation.top_logprobs)
        generation.append_final(drafted.token, logprobs[0] if logprobs else None)

    on_passed = on_passed if generation.settings.traits.releases_passed else None
    prefix = PendingBlock(prefix.drafted[:limit]) if prefix is not None else None  # drafted for the room there was
    with tracer.span("edge.draft", limit=limit, to_verify=to_verify) as span:
        block = await drafter.draft(context, limit, policy, cost_model, to_verify, on_passed, prefix)
        span.set(tokens=len(block))
    generation.recorder.proposed(block.drafted[len(prefix) if prefix is not None else 0:])
    return block


async def grow_tree(generation: Generation, drafter: Drafter, target: Target, context: list[int],
                    block: PendingBlock, cost_model: CostModel | None) -> TreeBlock | None:
    """The block's tree (branching.py: the draft's alternatives; copy_branches.py: the suffix index's copies) when the
    generation branches and the target verifies trees; else None."""
    setting = generation.settings.branch_tokens
    if setting == 0 or len(block) == 0:  # a chain's round goes on without the branching modules
        return None
    model = drafter.proposer.draft_model
    if model is None:
        return None
    limit = target.max_tree_tokens
    if limit == 0:  # the verifier takes chains only
        return None
    room = None if limit is None else limit - len(block)
    depth_limit = block_limit(generation, to_verify=True)
    offers = copy_offers(drafter.proposer, context, block, depth_limit)
    offered = [(offer.position, offer.estimates) for offer in offers]
    plan = tree_budget(setting, [estimate(d) for d in block.drafted], offered, cost_model, room, depth_limit)
    if plan.budget < 1 and not any(plan.copies):
        return None
    with tracer.span("edge.branch", budget=plan.budget, copied=sum(plan.copies)) as span:
        tree = attach_copies(block, offers, plan.copies)
        if plan.budget > 0:
            tree = await draft_branches(model, context, block, plan.budget, depth_limit, grown=tree,
                                        length=plan.branch_length, cost_model=cost_model)
        span.set(nodes=len(tree.nodes))
    generation.recorder.proposed(tree.nodes.drafted[len(block):])
    return tree if len(tree.nodes) > len(block) else None


def apply_verdict(generation: Generation, context: list[int], block: PendingBlock, verdict: Verdict | None,
                  policy: CallPolicy | None, cost_model: CostModel | None, first_round: bool,
                  tree: TreeBlock | None = None) -> int:
    """The round's second half: commit what `verdict` keeps of `block` (drafted after `context`; of `tree` when it
    went as one), or the block as drafted when no target was reached; the policy and the cost model learn from it.
    The first round's round trip also paid the prompt's prefill: the cost model does not learn it as a round trip.
    Returns how many of the primary chain's tokens were kept (what the chain's learners hear)."""
    start = len(context) - len(generation.prompt_ids)
    if verdict is None:  # only the draft's own tokens stand unverified
        block = block.unverified_prefix(released=max(0, generation.released - start))
        generation.commit(start, block.tokens, block.draft_logprobs(generation.top_logprobs))
        return 0
    on_tree = tree is not None and verdict.path is not None
    kept_nodes = [tree.nodes.drafted[n] for n in verdict.path] if on_tree else block.drafted[:verdict.n_accepted]
    chain_kept = tree.chain_kept(verdict.path) if on_tree else verdict.n_accepted
    generation.recorder.verified(len(block), len(kept_nodes))
    generation.recorder.suffix_kept += sum(not d.from_model for d in kept_nodes)
    if on_tree:
        generation.recorder.branched(len(DraftTree(tree.nodes.tokens, tree.parents).leaves()),
                                     len(tree.nodes) - len(block), len(kept_nodes) - chain_kept,
                                     tree.copy_tokens, tree.copy_path_won(verdict.path))
    if policy is not None:
        policy.observe_verdict(len(block), chain_kept)
    if cost_model is not None:  # every round: the first keeps too (a block drafted without a policy is skipped)
        cost_model.observe_verdict(block.accept_probs, chain_kept)
        if not first_round and verdict.round_trip_ms is not None:  # the target verified every node of a tree
            cost_model.observe_round_trip(verdict.round_trip_ms, verdict.verify_ms,
                                          len(tree.nodes) if tree is not None else len(block))
    generation.commit(start, [d.token for d in kept_nodes] + [verdict.next_token], verdict.logprobs)
    return chain_kept


async def speculative_round(generation: Generation, drafter: Drafter, target: Target | None,
                            policy: CallPolicy | None, cost_model: CostModel | None,
                            prefix: PendingBlock | None = None) -> Round:
    """One round (see the module docstring): its block and the verdict on it. `prefix`: tokens already drafted
    after the context (edge/decoding/pipeline.py), which the block continues."""
    context = generation.context
    to_verify = target is not None and target.reachable()
    first_round = not generation.new_tokens
    limit = block_limit(generation, to_verify)
    if limit < 1:  # only the target's token after a block would still fit: the context is full
        generation.context_full = True
        return Round(PendingBlock(), None)
    block = await draft_block(generation, drafter, context, limit, policy, None if first_round else cost_model,
                              to_verify, prefix if to_verify else None)
    if generation.stopped:  # a passed token completed a stop sequence: nothing left to verify
        return Round(block, None)
    tree = await grow_tree(generation, drafter, target, context, block, cost_model) if to_verify else None
    verdict = (await (target.verify(context, block, tree) if tree is not None else target.verify(context, block))
               if to_verify else None)
    chain_kept = apply_verdict(generation, context, block, verdict, policy, cost_model, first_round, tree)
    if verdict is not None:
        drafter.proposer.observe_verdict(block, chain_kept)
    return Round(block, verdict)


def run_inline(coroutine: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never suspends (local decoding does no I/O), without an event loop."""
    try:
        coroutine.send(None)
    except StopIteration as finished:
        return finished.value
    coroutine.close()
    raise RuntimeError("local decoding suspended: it must not wait on I/O")
