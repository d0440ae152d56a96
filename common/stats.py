"""Decoding statistics, in the design's measurement vocabulary."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


class _TargetCalls:
    """What a generation's target calls say, for its stats and its recorder alike (both have these fields)."""

    target_calls: int
    block_lengths: list[int]

    @property
    def calls_without_verdict(self) -> int:
        """Target calls that verified no block: a session's open (its first token) or a step of the target alone."""
        return self.target_calls - len(self.block_lengths)


@dataclass
class DecodeStats(_TargetCalls):
    mode: str
    policy: str | None  # the call policy's spec, e.g. "fixed:5"; None in modes draft and target
    new_tokens: int
    wall_s: float
    tokens_per_s: float
    target_calls: int
    target_calls_per_token: float
    tokens_per_call: float | None  # block efficiency; None when the target is never called
    block_length_mean: float | None  # draft tokens sent per verification (what the call policy chose)
    accepted_len_mean: float | None  # draft tokens kept per verification
    accept_rate_by_position: list[float]  # P(token i of a block kept | block had a token i)
    drafted_tokens: int
    draft_forwards: int
    ttft_ms: float | None
    itl_ms_p50: float | None
    itl_ms_p99: float | None
    # The raw record behind the means: one entry per target call, and each delivered token's time.
    block_lengths: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    token_times_ms: list[float] = field(default_factory=list)  # since the request started
    # Pipelined rounds (edge/decoding/pipeline.py): rounds that drafted ahead, and those whose verdict picked a candidate.
    pipeline: str = "off"
    ahead_rounds: int = 0
    ahead_hits: int = 0
    ahead_off_rounds: int = 0  # rounds run as `off` because drafting ahead did not pay (edge/decoding/ahead_gauge.py)
    candidates_sent: int = 0
    candidate_hits: int = 0  # sent candidates the cloud verified with no round trip in between
    uplink_bytes: int = 0  # verify frames and candidates the edge wrote
    downlink_bytes: int = 0  # session frames the edge read (opens, verdicts: logprobs make them longer)
    residual_queries: int = 0  # the cloud's residual queries answered (draft_dists on-rejection): extra round trips
    cached_tokens: int = 0  # prompt tokens the cloud took from its prefix cache instead of prefilling them
    # The edge draft's own reuse across requests (edge/runtime/draft_reuse.py): prompt tokens whose draft KV came
    # from an earlier request, and the draft prefill time that saved (estimated from the edge's prefill rate).
    draft_reused_tokens: int = 0
    draft_prefill_saved_ms: float = 0.0
    # Suffix drafting (common/spec/propose/suffix_proposer.py): tokens proposed by copying text, and how many the target
    # kept; what the draft's forwards fed (one a step, more where its KV caught up on kept copied tokens).
    suffix_tokens: int = 0
    suffix_kept: int = 0
    draft_fed_tokens: int = 0
    # Branching (common/spec/tree/branching.py): rounds sent as a tree, their root-to-leaf paths, the branch tokens
    # sent (beyond the primary chain), branch tokens kept, and rounds whose kept path left the chain; of those, the
    # branch tokens copied from text and the rounds whose kept path left through a copy (copy_branches.py).
    tree_rounds: int = 0
    tree_paths: int = 0
    branch_tokens_sent: int = 0
    branch_tokens_kept: int = 0
    side_path_wins: int = 0
    copy_branch_tokens: int = 0
    copy_path_wins: int = 0

    @property
    def paths_per_round(self) -> float | None:
        """Root-to-leaf paths per tree round (1 would be a chain)."""
        return self.tree_paths / self.tree_rounds if self.tree_rounds else None

    @property
    def suffix_share(self) -> float | None:
        """The share of proposed tokens that were copied from text rather than drafted."""
        proposed = self.suffix_tokens + self.draft_forwards
        return self.suffix_tokens / proposed if proposed else None

    @property
    def ahead_hit_rate(self) -> float | None:
        return self.ahead_hits / self.ahead_rounds if self.ahead_rounds else None

    @property
    def uplink_bytes_per_token(self) -> float | None:
        return self.uplink_bytes / self.new_tokens if self.new_tokens and self.uplink_bytes else None

    @property
    def downlink_bytes_per_token(self) -> float | None:
        return self.downlink_bytes / self.new_tokens if self.new_tokens and self.downlink_bytes else None

    def to_dict(self) -> dict:
        return {**asdict(self), "suffix_share": self.suffix_share, "ahead_hit_rate": self.ahead_hit_rate, "uplink_bytes_per_token": self.uplink_bytes_per_token,
                "downlink_bytes_per_token": self.downlink_bytes_per_token}


def mean(values: Sequence[float]) -> float | None:
    """The arithmetic mean; None for no values."""
    return sum(values) / len(values) if values else None


def nearest_rank_index(n: int, q: float) -> int:
    """Where the nearest-rank q-quantile (q in 0..1) stands among n sorted values: round(q (n - 1)), half to even.
    One rule for every percentile here and in the fleet simulator, so simulated and measured ones compare."""
    return min(n - 1, round(q * (n - 1)))


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank q-quantile (q in 0..1); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[nearest_rank_index(len(ordered), q)]


@dataclass
class StatsRecorder(_TargetCalls):
    """Collects one generation's events; `finish()` turns them into DecodeStats."""

    mode: str
    policy: str | None = None
    started: float = field(default_factory=time.perf_counter)
    emitted_at: list[float] = field(default_factory=list)
    target_calls: int = 0
    draft_forwards: int = 0
    block_lengths: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    pipeline: str = "off"
    ahead_rounds: int = 0
    ahead_hits: int = 0
    ahead_off_rounds: int = 0
    candidates_sent: int = 0
    candidate_hits: int = 0
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    residual_queries: int = 0
    cached_tokens: int = 0
    draft_reused_tokens: int = 0
    draft_prefill_saved_ms: float = 0.0
    suffix_tokens: int = 0
    suffix_kept: int = 0
    draft_fed_tokens: int = 0
    tree_rounds: int = 0
    tree_paths: int = 0
    branch_tokens_sent: int = 0
    branch_tokens_kept: int = 0
    side_path_wins: int = 0
    copy_branch_tokens: int = 0
    copy_path_wins: int = 0

    def proposed(self, tokens: list) -> None:
        """New proposals (common/spec/propose/proposals.py ProposedToken): a draft step for each of the draft's own."""
        for token in tokens:
            if token.from_model:
                self.draft_forwards += 1
                self.draft_fed_tokens += token.fed
            else:
                self.suffix_tokens += 1

    def emitted(self, n_tokens: int) -> None:
        now = time.perf_counter()
        self.emitted_at.extend([now] * n_tokens)

    def verified(self, block_length: int, n_accepted: int, copied: int = 0, copied_kept: int = 0) -> None:
        """A verdict; `copied`, `copied_kept`: a cloud-sd round's copied tokens, and those kept (an edge's own
        proposals count as they are proposed and judged: `proposed`, speculative_round)."""
        self.target_calls += 1
        self.suffix_tokens += copied
        self.suffix_kept += copied_kept
        self.block_lengths.append(block_length)
        self.accepted_lengths.append(n_accepted)

    def branched(self, paths: int, branch_tokens: int, kept_off_chain: int, copied: int = 0,
                 copy_won: bool = False) -> None:
        """A round sent as a tree: its paths, its branch tokens, how many of them the verdict kept, how many were
        copies, and whether the kept path left the chain through a copy."""
        self.tree_rounds += 1
        self.tree_paths += paths
        self.branch_tokens_sent += branch_tokens
        self.branch_tokens_kept += kept_off_chain
        self.side_path_wins += kept_off_chain > 0
        self.copy_branch_tokens += copied
        self.copy_path_wins += copy_won

    def pipelined(self, drafted_ahead: bool, hit: bool, sent: int) -> None:
        """One verdict of a pipelined round: whether anything was drafted ahead of it, and whether it picked a candidate."""
        self.ahead_rounds += drafted_ahead
        self.ahead_hits += hit
        self.candidates_sent += sent

    def finish(self, new_tokens: int) -> DecodeStats:
        wall_s = time.perf_counter() - self.started
        del self.emitted_at[new_tokens:]  # tokens cut at EOS or the length limit were never delivered
        gaps = [(b - a) * 1e3 for a, b in zip(self.emitted_at, self.emitted_at[1:])]
        longest = max(self.block_lengths, default=0)
        accept_rate_by_position = [
            sum(n > i for n in self.accepted_lengths) / sum(g > i for g in self.block_lengths) for i in range(longest)
        ]
        return DecodeStats(
            mode=self.mode,
            policy=self.policy,
            new_tokens=new_tokens,
            wall_s=wall_s,
            tokens_per_s=new_tokens / wall_s if wall_s > 0 else 0.0,
            target_calls=self.target_calls,
            target_calls_per_token=self.target_calls / new_tokens if new_tokens else 0.0,
            tokens_per_call=new_tokens / self.target_calls if self.target_calls else None,
            block_length_mean=mean(self.block_lengths),
            accepted_len_mean=mean(self.accepted_lengths),
            accept_rate_by_position=accept_rate_by_position,
            drafted_tokens=sum(self.block_lengths),
            draft_forwards=self.draft_forwards,
            ttft_ms=(self.emitted_at[0] - self.started) * 1e3 if self.emitted_at else None,
            itl_ms_p50=percentile(gaps, 0.5),
            itl_ms_p99=percentile(gaps, 0.99),
            block_lengths=list(self.block_lengths),
            accepted_lengths=list(self.accepted_lengths),
            token_times_ms=[round((t - self.started) * 1e3, 3) for t in self.emitted_at],
            pipeline=self.pipeline, ahead_rounds=self.ahead_rounds, ahead_hits=self.ahead_hits,
            ahead_off_rounds=self.ahead_off_rounds,
            candidates_sent=self.candidates_sent, candidate_hits=self.candidate_hits, uplink_bytes=self.uplink_bytes,
            downlink_bytes=self.downlink_bytes, residual_queries=self.residual_queries,
            cached_tokens=self.cached_tokens, draft_reused_tokens=self.draft_reused_tokens,
            draft_prefill_saved_ms=self.draft_prefill_saved_ms,
            suffix_tokens=self.suffix_tokens, suffix_kept=self.suffix_kept, draft_fed_tokens=self.draft_fed_tokens,
            tree_rounds=self.tree_rounds, tree_paths=self.tree_paths, branch_tokens_sent=self.branch_tokens_sent,
            branch_tokens_kept=self.branch_tokens_kept, side_path_wins=self.side_path_wins,
            copy_branch_tokens=self.copy_branch_tokens, copy_path_wins=self.copy_path_wins,
        )


def oracle_calls_per_token(block_lengths: list[int], accepted_lengths: list[int], cap: int = 20) -> float | None:
    """The call rate of a perfect verifier in the SPRINTER loop, from a run's acceptance record.

    A perfect verifier sends the block exactly at the first draft token the target rejects (or at
    the cap), so every call yields its accepted run plus the target's token. Each examined draft
    token survives with the run's observed rate p = accepted / (accepted + rejections); taking runs
    as geometric, a call yields (1 - p^(cap+1)) / (1 - p) tokens (cap accepted + 1 at most).
    """
    accepted = sum(accepted_lengths)
    rejections = sum(n < g for g, n in zip(block_lengths, accepted_lengths))
    if accepted + rejections == 0:
        return None
    p = accepted / (accepted + rejections)
    tokens_per_call = cap + 1 if p == 1 else (1 - p ** (cap + 1)) / (1 - p)
    return 1 / tokens_per_call
