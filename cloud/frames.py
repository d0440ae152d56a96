"""What the cloud reads of an edge's frames: each checked before it costs a forward, and a checked verify frame
read into the proposal it carries. Verdicts are decided elsewhere, in one place (common/spec/acceptance_rules.py).

A verify frame carries x_1..x_g (`draft_tokens`) and the distributions q they were drawn from, sparse
(`draft_dists`; a sprinter frame may send only the last, the one row its rule reads), or only each token's own
probability (`draft_token_probs` with `dists_on_rejection`: the token rule's coins, its residual by queries).

Everything here is pure: no I/O, no model. Each refusal names the gRPC status it maps to and says
what to change, so an edge developer can act on the message alone.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch

from cloud.engine import TargetRows
from cloud.errors import CloudError, invalid
from cloud.tree_verify import shaped_tree_rows
from common import wire
from common.spec.tree.draft_tree import depths
from common.spec.modes import PROPOSERS, reads_draft_dist_at_rejection_only, reads_last_draft_only
from common.spec.acceptance_rules import TREE_METHODS, Decision, Proposal, decide
from common.sampling.logits_processing import LogitsProcessor
from common.sampling.params import SamplingParams
from sprinter.v1 import decoding_pb2 as pb

PROBABILITY_SUM_TOLERANCE = 1e-3


@dataclass(frozen=True)
class ServiceLimits:
    max_block: int = 32
    max_context: int = 4096
    max_message_bytes: int = 4 << 20
    max_sparse_support: int = 4096
    max_generate: int = 0  # per edge identity; 0: no limit
    max_tree_tokens: int = 0  # draft tokens per tree frame (VerifyBlock.parents); 0: chains only

    def to_proto(self) -> pb.Limits:
        return wire.limits_message(self.max_block, self.max_context, self.max_message_bytes, self.max_sparse_support,
                                   self.max_generate, self.max_tree_tokens)


def check_token_ids(tokens: list[int], vocab_size: int, what: str) -> None:
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise invalid(f"{what}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


def admit_sampling(sampling: pb.SamplingSettings, vocab_size: int) -> SamplingParams:
    """The session's sampling settings, refused (INVALID_ARGUMENT, saying which field) when out of range."""
    top_p = wire.top_p_of(sampling)
    if not math.isfinite(sampling.temperature) or sampling.temperature < 0:
        raise invalid(f"sampling.temperature must be a finite number >= 0, got {sampling.temperature}")
    if sampling.top_k < 0:
        raise invalid(f"sampling.top_k must be >= 0 (0 disables it), got {sampling.top_k}")
    if not 0.0 < top_p <= 1.0:
        raise invalid(f"sampling.top_p must be in (0, 1] (leave it unset to disable), got {top_p}")
    check_token_ids(sorted(sampling.logit_bias), vocab_size, "sampling.logit_bias")
    try:
        return wire.sampling_from_proto(sampling)
    except ValueError as err:  # a penalty or a bias out of its range
        raise invalid(f"sampling.{err}") from None


def check_prompt(prompt_ids: list[int], vocab_size: int, limits: ServiceLimits) -> None:
    if not prompt_ids:
        raise invalid("open.prompt_ids is empty: a session starts from at least one token")
    if len(prompt_ids) >= limits.max_context:
        raise invalid(f"prompt has {len(prompt_ids)} tokens; prompts may have at most {limits.max_context - 1} "
                       f"(the context limit is {limits.max_context}, and the first generated token needs a place)")
    check_token_ids(prompt_ids, vocab_size, "open.prompt_ids")


def check_output_start(request: pb.OpenSession | pb.GenerateRequest) -> int:
    """Where the generated tokens begin in the open's prompt_ids, refused when outside it."""
    start = wire.output_start_of(request)
    if not 1 <= start <= len(request.prompt_ids):
        raise invalid(f"output_start is {start}: the generated tokens begin after at least one prompt token and "
                      f"at most after all {len(request.prompt_ids)}")
    return start


def check_speculation(request: pb.GenerateRequest, limits: ServiceLimits, default_proposer: str,
                      draft_spec: str | None) -> tuple[int, str] | None:
    """A cloud-sd Generate's (block, proposer); a proposer it does not name is the cloud's default (`--proposer`).
    None: no speculation (the target alone)."""
    if not request.HasField("speculation"):
        return None
    block = request.speculation.block
    if not 1 <= block <= limits.max_block:
        raise invalid(f"speculation.block must be in 1..{limits.max_block} (max_block), got {block}")
    if draft_spec is None:
        raise CloudError(grpc.StatusCode.FAILED_PRECONDITION,
                         "this cloud has no draft model to speculate with (mode cloud-sd): start it with "
                         "`sprinter cloud serve --draft SPEC`, or draft on the edge (--placement edge)")
    proposer = wire.speculation_proposer(request.speculation) or default_proposer
    if proposer not in PROPOSERS:
        raise invalid(f"speculation.proposer {proposer!r} is unknown; choose one of {', '.join(PROPOSERS)} "
                      "(empty: this cloud's default)")
    return block, proposer


def check_verify(frame: pb.VerifyBlock, session_length: int, sampling: SamplingParams, vocab_size: int,
                 limits: ServiceLimits) -> None:
    """Refuse a verify frame before it costs a target forward."""
    g = len(frame.draft_tokens)
    method = wire.method_name(frame.method)
    if method is None:
        raise invalid("verify.method is unset: choose METHOD_TOKEN, METHOD_BLOCK or METHOD_SPRINTER")
    if g == 0:
        raise invalid("verify.draft_tokens is empty: send at least one draft token")
    parents = wire.tree_parents(frame)
    longest_path = check_tree(parents, g, limits) if parents is not None else g
    if parents is not None:
        _check_tree_frame(frame, method)
    if parents is None and g > limits.max_block:
        raise invalid(f"verify block has {g} tokens; the limit is {limits.max_block} (ServiceInfo.limits.max_block)")
    if frame.start_position != session_length:
        raise CloudError(grpc.StatusCode.FAILED_PRECONDITION,
                         f"verify.start_position is {frame.start_position} but the cloud's session holds "
                         f"{session_length} tokens: resync by reopening with the full context")
    if session_length + longest_path + 1 > limits.max_context:
        raise CloudError(grpc.StatusCode.OUT_OF_RANGE, f"session would exceed the context limit of {limits.max_context} tokens")
    check_token_ids(list(frame.draft_tokens), vocab_size, "verify.draft_tokens")
    if frame.draft_token_probs and len(frame.draft_token_probs) != g:
        raise invalid(f"verify.draft_token_probs has {len(frame.draft_token_probs)} entries for {g} draft tokens")
    if any(not 0.0 < p <= 1.0 + PROBABILITY_SUM_TOLERANCE for p in frame.draft_token_probs):
        raise invalid("verify.draft_token_probs must lie in (0, 1]: the draft sampled these tokens")
    if sampling.greedy:
        return
    if frame.dists_on_rejection:
        _check_dists_on_rejection(frame, method)
        return
    needed = 1 if reads_last_draft_only(method) else g
    if len(frame.draft_dists) not in (needed, g):
        raise invalid(f"verify.draft_dists has {len(frame.draft_dists)} distributions; sampling with this method "
                       f"needs {needed} (one per draft token{', or just the last' if needed == 1 else ''})")
    first_row = g - len(frame.draft_dists)
    for i, dist in enumerate(frame.draft_dists):
        check_sparse_distribution(dist, f"verify.draft_dists[{i}]", frame.draft_tokens[first_row + i],
                                  limits.max_sparse_support, vocab_size)


def check_tree(parents: list[int], g: int, limits: ServiceLimits) -> int:
    """Refuse a tree frame's `parents` (INVALID_ARGUMENT, naming the field) unless they make a tree of the `g` draft
    tokens, parents before children, within the cloud's tree limit; returns the tree's depth (its longest path)."""
    if not limits.max_tree_tokens:
        raise invalid("verify.parents is set but this cloud verifies chains only (ServiceInfo.limits.max_tree_tokens "
                      "is 0): send the block without parents")
    if g > limits.max_tree_tokens:
        raise invalid(f"verify.parents: a tree of {g} tokens; the limit is {limits.max_tree_tokens} "
                      "(ServiceInfo.limits.max_tree_tokens)")
    if len(parents) != g:
        raise invalid(f"verify.parents has {len(parents)} entries for {g} draft tokens: one parent per token")
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise invalid(f"verify.parents[{i}] is {parent}: a parent is -1 (the session's last token) or an earlier "
                          f"draft token's index, 0 .. {i - 1}")
    return max(depths(parents))


def _check_tree_frame(frame: pb.VerifyBlock, method: str) -> None:
    """What a tree frame may not combine with: a rule that reads one path, the token rule's scalars, a candidate."""
    if method not in TREE_METHODS:
        raise invalid(f"verify.method is {method} but the frame is a tree (verify.parents): a tree is verified by "
                      "METHOD_BLOCK (greedy multi-path block verification), the other methods read one path")
    if frame.dists_on_rejection:
        raise invalid("verify.dists_on_rejection is set on a tree frame (verify.parents): a tree's rule reads every "
                      "node's distribution, send them in verify.draft_dists")
    refuse_tree_candidate(frame)


def refuse_tree_candidate(frame: pb.VerifyBlock) -> None:
    """A candidate (verify.after) is drafted along the primary chain of the tree before it: never a tree itself."""
    if frame.parents and frame.HasField("after"):
        raise invalid("verify.after is set on a tree frame (verify.parents): a candidate block is a chain; send the "
                      "tree as an ordinary verify")


def _check_dists_on_rejection(frame: pb.VerifyBlock, method: str) -> None:
    """A frame that leaves its distributions for the residual queries: the token rule only, scalars for all."""
    if not reads_draft_dist_at_rejection_only(method):
        raise invalid(f"verify.dists_on_rejection is set with method {method}, whose rule reads every draft "
                      "distribution: send them all in verify.draft_dists (only METHOD_TOKEN may leave them out)")
    if frame.draft_dists:
        raise invalid("verify.dists_on_rejection is set but verify.draft_dists is not empty: send one or the other")
    if len(frame.draft_token_probs) != len(frame.draft_tokens):
        raise invalid(f"verify.draft_token_probs has {len(frame.draft_token_probs)} entries for "
                      f"{len(frame.draft_tokens)} draft tokens: with dists_on_rejection the rule decides from them")


def check_sparse_distribution(dist: pb.SparseDistribution, where: str, token: int, max_entries: int,
                              vocab_size: int) -> None:
    """A sparse draft distribution `token` was sampled from: well-formed, within `max_entries`, summing to 1."""
    if len(dist.token_ids) != len(dist.probs) or not dist.token_ids:
        raise invalid(f"{where}: token_ids and probs must be non-empty and of equal length")
    if len(dist.token_ids) > max_entries:
        raise invalid(f"{where}: {len(dist.token_ids)} entries; the limit is {max_entries}")
    check_token_ids(list(dist.token_ids), vocab_size, where)
    repeated = [t for t, n in Counter(dist.token_ids).items() if n > 1]
    if repeated:
        raise invalid(f"{where}: token id {repeated[0]} appears more than once; list each id once")
    total = sum(dist.probs)
    if any(p < 0 or not math.isfinite(p) for p in dist.probs) or abs(total - 1.0) > PROBABILITY_SUM_TOLERANCE:
        raise invalid(f"{where}: probabilities must be >= 0 and sum to 1 (they sum to {total:.6f})")
    if not any(t == token and p > 0 for t, p in zip(dist.token_ids, dist.probs)):
        raise invalid(f"{where} gives its draft token {token} probability 0, so the draft cannot have sampled it")


def draft_distributions(frame: pb.VerifyBlock, sampling: SamplingParams, vocab_size: int) -> torch.Tensor:
    """q [g, V] as the edge sampled it: one-hot when greedy, else from the sparse distributions.

    A sprinter frame may carry only the last distribution: only the flagged token is checked, so the
    rows before it are never read (they are filled with one-hots to keep the shape).
    """
    g = len(frame.draft_tokens)
    tokens = torch.tensor(list(frame.draft_tokens))
    p_draft = torch.nn.functional.one_hot(tokens, vocab_size).float()
    if sampling.greedy:
        return p_draft
    first_row = g - len(frame.draft_dists)
    for i, dist in enumerate(frame.draft_dists, start=first_row):
        p_draft[i] = wire.sparse_from_proto(dist).to_dense(vocab_size)
    return p_draft


def frame_proposal(frame: pb.VerifyBlock, sampling: SamplingParams) -> Proposal:
    """The proposal a checked frame carries: its q rows, or (`dists_on_rejection`) its tokens' scalars alone; a tree
    frame's parents (its q rows one per node, each the distribution the node was drawn from given its parent's prefix)."""
    tokens = list(frame.draft_tokens)
    if frame.dists_on_rejection and not sampling.greedy:
        return Proposal(tokens, q_of_tokens=list(frame.draft_token_probs))
    return Proposal(tokens, lambda vocab_size: draft_distributions(frame, sampling, vocab_size),
                    parents=wire.tree_parents(frame))


class Judged(Protocol):
    """What the verdict reads of a session (cloud/sessions.py `Session`)."""

    sampling: SamplingParams
    processor: LogitsProcessor | None
    tokens: list[int]
    generator: torch.Generator


def frame_decision(frame: pb.VerifyBlock, session: Judged, rows: TargetRows) -> Decision:
    """The rule's verdict on a checked frame from its forward's rows [g + 1] (a tree's [1 + N]), shaped as the
    session's request asks: a chain's after the block's tokens before each row, a tree's along each node's path."""
    proposal = frame_proposal(frame, session.sampling)
    tree = proposal.tree()
    rows = (rows.shaped(session.processor, session.tokens, proposal.tokens) if tree is None else
            shaped_tree_rows(rows, session.processor, session.tokens, tree))
    return decide(proposal, wire.method_name(frame.method), session.sampling, session.generator,
                  argmax=rows.argmax.tolist(), logits=rows.logits)
