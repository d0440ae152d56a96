"""`sprinter verifier replay`: call policies replayed on recorded traces, against two oracles.

What bounds the goodput policy's cloud calls? Decoding the pair for every policy, RTT and seed costs
hours on this machine; the collected data already holds what a round depends on, so this replays the
rounds on it in seconds, with the same random acceptances for every policy.

Glossary
    trace       one held-out prompt's recorded continuation: per drafted token x_i its acceptance
                probability a_i (min(1, p_target/p_draft) at T > 0, 0/1 under greedy) and the verifier's
                score s_i (its estimate of a_i from what the edge sees).
    coin        u_i ~ U(0, 1), drawn once per trace position and seed; the cloud keeps x_i iff u_i < a_i
                (token verification). Every policy meets the same coins.
    round       the edge drafts g tokens at `pos` and sends them; the cloud keeps the run n before the
                first failing coin and adds its own token, so the trace moves on by n + 1. A round takes
                g * t_draft + rtt + t_verify(g), t_verify(g) = a + b g (RoundCosts: the pair's measured costs).

Policies (every block stops at the cap, 20, and at the trace's end):
    fixed:K             send every K tokens.
    goodput             common.spec.call_policy.GoodputPolicy reading the verifier's scores s_i. Its cost model
                        starts fresh on every trace and hears the plan of each block sent (the planned rate that
                        prices a drafted token's time); the keep model hears no verdicts here, so rho stays 0
                        (fed the trace's verdicts as on the edge, it lowers goodput's tokens/s on the Qwen data:
                        docs/benchmarks/verifier.md).
    goodput exact-a     the same policy reading a_i itself: a perfectly sharp and calibrated verifier, the
                        best any verifier can do under this policy. The learned one's gap to it is what a
                        better verifier could still win.
    hindsight oracle    knows the coins and sends the accepted run just before the first failing coin: no
                        drafted token is ever thrown away. At T > 0 no edge verifier can match it, since the
                        coin is flipped at the cloud after the edge has sent. Its calls per token equal
                        drafting to the cap every round (the same runs are kept); what it saves is drafting.
    ... +price:P        goodput with a price of P ms on a cloud call (`--policy goodput:price=P`): it plans as
                        if every round took P ms longer, which buys fewer calls with tokens/s (the frontier
                        in the plot).
    adaptive ...        the budget rule of vLLM's adaptive verification (common/spec/adaptive_policy.py).
    ... + margin-logistic  reading the margin-logistic estimator (common/spec/margin_logistic.py) instead of the
                        learned verifier: fitted, as an edge would fit it online, on the verdicts of every prompt
                        that is not held out, and scoring each token at its position in the round's block.
                        "adaptive + margin-logistic" is vLLM's configuration (issue 58).

Every policy is tallied over all traces and per prompt category (each against the hindsight oracle of its own
category).

Approximation: after a rejection the real edge drafts on from the target's token, the trace from the draft's
own; the trace's later tokens stand in for that continuation (at segment-0 collection, the a_i of tokens
after a draft mistake are judged on a prefix that holds it, as in sprinter's own contexts).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from common.spec.adaptive_policy import AdaptivePolicy
from common.spec.call_policy import CallPolicy, FixedPolicy, GoodputPolicy
from common.spec.cost_model import CostModel
from common.spec.margin_logistic import MarginLogistic, sigmoid
from common.lab.prompt_sets import interleave_categories
from edge.verifier_training.collect import VerifierDataset
from edge.verifier_training.compare import logit_margins
from edge.verifier_training.features import feature_matrix, labels_for

CAP = 20  # the run-length cap of the edge's loop
HINDSIGHT = "hindsight oracle"
EXACT = "goodput exact-a"
LEARNED = "goodput"
ESTIMATOR_BUDGET = "adaptive + margin-logistic"  # vLLM's adaptive verification
ALL = "all"

BlockChooser = Callable[[int, int, np.ndarray], int]  # (pos, cap, kept-by-coin) -> tokens to draft, g


@dataclass(frozen=True)
class Trace:
    accept_prob: list[float]  # [n] a_i
    score: list[float]  # [n] s_i
    category: str = ""
    block_scores: np.ndarray | None = None  # [CAP, n] the estimator's p for token i at block position j; None: no estimator


@dataclass(frozen=True)
class RoundCosts:
    draft_ms: float  # per drafted token
    verify_base_ms: float  # t_verify(g) = verify_base_ms + verify_per_token_ms * g
    verify_per_token_ms: float

    def round_ms(self, g: int, rtt_ms: float) -> float:
        return g * self.draft_ms + rtt_ms + self.verify_base_ms + self.verify_per_token_ms * g


@dataclass(frozen=True)
class ReplaySettings:
    rtts_ms: tuple[float, ...] = (0.0, 50.0, 100.0, 200.0)
    fixed_ks: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 10, 14, 20)
    prices_ms: tuple[float, ...] = (500.0, 1000.0, 2000.0, 4000.0)
    seeds: int = 8


@dataclass
class Tally:
    calls: int = 0
    tokens: int = 0
    drafted: int = 0
    kept: int = 0  # drafted tokens the cloud kept
    time_ms: float = 0.0


@dataclass(frozen=True)
class ReplayRow:
    rtt_ms: float
    policy: str
    calls_per_token: float
    tokens_per_s: float
    block_length_mean: float
    wasted_draft_share: float  # drafted tokens the cloud threw away / drafted
    calls_vs_hindsight: float
    calls_vs_exact: float  # against goodput exact-a at the same RTT
    category: str = ALL  # the prompts tallied: all, or one category


def kept_run(kept: np.ndarray, pos: int, g: int) -> int:
    """How many of the g tokens at pos the cloud keeps: those before the first failing coin."""
    failing = np.flatnonzero(~kept[pos:pos + g])
    return int(failing[0]) if len(failing) else g


def policy_chooser(policy: CallPolicy, scores: Sequence[float], costs: CostModel | None = None) -> BlockChooser:
    """Draft while the policy, asked after every token with the scores so far, says not to send; `costs`: the cost
    model the policy reads, which hears the plan of every block sent (`CostModel.observe_plan`; see the module
    docstring for the keep model)."""
    def choose(pos: int, cap: int, kept: np.ndarray) -> int:
        g = 1
        while not policy.should_send(scores[pos:pos + g], cap):
            g += 1
        if costs is not None:
            costs.observe_plan(scores[pos:pos + g])
        return g
    return choose


def block_position_chooser(policy: CallPolicy, block_scores: np.ndarray,
                           costs: CostModel | None = None) -> BlockChooser:
    """As policy_chooser, with scores that depend on where a token sits in the block: block_scores[j, i] ([CAP, n])."""
    def choose(pos: int, cap: int, kept: np.ndarray) -> int:
        g = 1
        while not policy.should_send(block_scores[np.arange(g), pos + np.arange(g)].tolist(), cap):
            g += 1
        if costs is not None:
            costs.observe_plan(block_scores[np.arange(g), pos + np.arange(g)].tolist())
        return g
    return choose


def estimator_block_scores(estimator: MarginLogistic, margins: np.ndarray) -> np.ndarray:
    """[CAP, n]: p = sigmoid(w_j * margin_i + b_j) of token i at block position j (1.0 where j is still warming up)."""
    scores = np.ones((CAP, len(margins)))
    for j in range(CAP):
        parameters = estimator.parameters_at(j)
        if parameters is not None:
            scores[j] = [sigmoid(parameters[0] * m + parameters[1]) for m in margins]
    return scores


def hindsight_chooser(pos: int, cap: int, kept: np.ndarray) -> int:
    return kept_run(kept, pos, cap)


def replay_trace(choose: BlockChooser, kept: np.ndarray, costs: RoundCosts, rtt_ms: float, tally: Tally) -> None:
    """Play one trace's rounds to its end, adding them to tally."""
    pos, n = 0, len(kept)
    while pos < n:
        g = choose(pos, min(CAP, n - pos), kept)
        run = kept_run(kept, pos, g)
        tally.calls += 1
        tally.tokens += run + 1  # the kept run and the target's own token
        tally.drafted += g
        tally.kept += run
        tally.time_ms += costs.round_ms(g, rtt_ms)
        pos += run + 1


def goodput_policy(costs: RoundCosts, rtt_ms: float, price_ms: float = 0.0) -> GoodputPolicy:
    """Goodput planning with these costs known from the start (no observations: the priors answer)."""
    return GoodputPolicy(CostModel(prior_draft_ms=costs.draft_ms, prior_rtt_ms=rtt_ms,
                                   prior_verify_base_ms=costs.verify_base_ms,
                                   prior_verify_per_token_ms=costs.verify_per_token_ms), max_block=CAP,
                         call_price_ms=price_ms)


def adaptive_policy(costs: RoundCosts, rtt_ms: float) -> AdaptivePolicy:
    return AdaptivePolicy(goodput_policy(costs, rtt_ms).cost_model, max_block=CAP)


def _goodput_chooser(scores: Sequence[float], costs: RoundCosts, rtt_ms: float, price_ms: float = 0.0) -> BlockChooser:
    policy = goodput_policy(costs, rtt_ms, price_ms)
    return policy_chooser(policy, scores, policy.cost_model)


def _choosers(trace: Trace, costs: RoundCosts, rtt_ms: float, settings: ReplaySettings) -> dict[str, BlockChooser]:
    """Every policy replayed on this trace; each goodput policy with a fresh cost model that hears its blocks' plans."""
    choosers: dict[str, BlockChooser] = {HINDSIGHT: hindsight_chooser}
    choosers |= {f"fixed:{k}": policy_chooser(FixedPolicy(k), trace.score) for k in settings.fixed_ks}
    for name, scores in ((LEARNED, trace.score), (EXACT, trace.accept_prob)):
        choosers[name] = _goodput_chooser(scores, costs, rtt_ms)
        for price in settings.prices_ms:
            choosers[f"{name} +price:{price:g}"] = _goodput_chooser(scores, costs, rtt_ms, price)
    choosers["adaptive + learned"] = policy_chooser(adaptive_policy(costs, rtt_ms), trace.score)
    if trace.block_scores is not None:  # adaptive reads no plans: only goodput's cost model hears them
        goodput = goodput_policy(costs, rtt_ms)
        choosers[ESTIMATOR_BUDGET] = block_position_chooser(adaptive_policy(costs, rtt_ms), trace.block_scores)
        choosers["goodput + margin-logistic"] = block_position_chooser(goodput, trace.block_scores, goodput.cost_model)
    return choosers


def replay(traces: list[Trace], costs: RoundCosts, settings: ReplaySettings) -> list[ReplayRow]:
    """Rows per RTT and policy over all traces (category "all"), then per prompt category when there are several."""
    categories = sorted({t.category for t in traces})
    rows: list[ReplayRow] = []
    for rtt in settings.rtts_ms:
        tallies: dict[tuple[str, str], Tally] = {}
        for seed in range(settings.seeds):
            rng = np.random.default_rng(seed)
            for trace in traces:
                kept = rng.random(len(trace.accept_prob)) < np.asarray(trace.accept_prob)
                for name, choose in _choosers(trace, costs, rtt, settings).items():
                    for category in (ALL, trace.category) if len(categories) > 1 else (ALL,):
                        replay_trace(choose, kept, costs, rtt, tallies.setdefault((name, category), Tally()))
        for category in (ALL, *categories) if len(categories) > 1 else (ALL,):
            rows += [replace(r, category=category)
                     for r in _rows(rtt, {n: t for (n, c), t in tallies.items() if c == category})]
    return rows


def _rows(rtt_ms: float, tallies: dict[str, Tally]) -> list[ReplayRow]:
    def calls_per_token(t: Tally) -> float:
        return t.calls / t.tokens

    hindsight, exact = calls_per_token(tallies[HINDSIGHT]), calls_per_token(tallies[EXACT])
    return [ReplayRow(rtt_ms, name, calls_per_token(t), t.tokens / t.time_ms * 1e3, t.drafted / t.calls,
                      1 - t.kept / t.drafted if t.drafted else 0.0, calls_per_token(t) / hindsight,
                      calls_per_token(t) / exact)
            for name, t in tallies.items()]


def overall(rows: list[ReplayRow]) -> list[ReplayRow]:
    return [r for r in rows if r.category == ALL]


def held_out_traces(dataset: VerifierDataset, metadata: dict, score: Callable[[np.ndarray], np.ndarray],
                    limit: int | None = None, estimator: MarginLogistic | None = None) -> list[Trace]:
    """One trace per held-out prompt of the verifier (never its training or calibration prompts), in position
    order; `limit`: the first N prompts with categories interleaved, the ones `sprinter simulate --limit N` decodes.
    With a fitted `estimator`, each trace also holds its scores by block position (the estimator's policies)."""
    held_out = set(metadata.get("training", {}).get("held_out_prompt_ids", []))
    index_of = {p.id: i for i, p in enumerate(dataset.prompts)}
    # id order is the shipped prompt file's order, from which simulate interleaves its prompts
    chosen = interleave_categories(sorted((p for p in dataset.prompts if p.id in held_out), key=lambda p: p.id))[:limit]
    indices = [index_of[p.id] for p in chosen]
    if not indices:
        raise ValueError("none of the verifier's held-out prompts are in this data: replay it on the data it was "
                         "trained on (sprinter verifier train --data)")
    accept = labels_for(dataset, "auto")  # a_i: the soft label when sampled, 0/1 under greedy
    scores = score(feature_matrix(dataset, tuple(metadata["features"])))
    margins = logit_margins(dataset) if estimator is not None else None
    prompt_index, position = dataset.arrays["prompt_index"], dataset.arrays["position"]
    traces = []
    for i in indices:
        rows = np.flatnonzero(prompt_index == i)
        rows = rows[np.argsort(position[rows])]
        if len(rows):
            block_scores = estimator_block_scores(estimator, margins[rows]) if margins is not None else None
            traces.append(Trace(accept[rows].astype(float).tolist(), scores[rows].astype(float).tolist(),
                                dataset.prompts[i].category, block_scores))
    return traces


def table(rows: list[ReplayRow]) -> str:
    lines = ["| RTT ms | policy | calls/token | tokens/s | block length | drafted thrown away | calls / hindsight "
             "| calls / exact-a |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r.rtt_ms:g} | {r.policy} | {r.calls_per_token:.3f} | {r.tokens_per_s:.2f} | "
              f"{r.block_length_mean:.2f} | {r.wasted_draft_share:.0%} | {r.calls_vs_hindsight:.2f}x | "
              f"{r.calls_vs_exact:.2f}x |" for r in rows]
    return "\n".join(lines)


def best_fixed(rows: list[ReplayRow], rtt_ms: float) -> ReplayRow:
    return max((r for r in overall(rows) if r.rtt_ms == rtt_ms and r.policy.startswith("fixed:")),
               key=lambda r: r.tokens_per_s)


def by_category(rows: list[ReplayRow], policies: Sequence[str] = (LEARNED, ESTIMATOR_BUDGET, HINDSIGHT)) -> str:
    """Per RTT and prompt category: tokens/s and calls per token (x that category's hindsight oracle) per policy."""
    shown = [p for p in policies if any(r.policy == p for r in rows)]
    lines = ["| RTT ms | category | " + " | ".join(shown) + " |", "|---|---|" + "---|" * len(shown)]
    at = {(r.rtt_ms, r.category, r.policy): r for r in rows}
    for rtt, category in sorted({(r.rtt_ms, r.category) for r in rows}, key=lambda k: (k[0], k[1] != ALL, k[1])):
        cells = [f"{at[rtt, category, p].tokens_per_s:.2f} tok/s, {at[rtt, category, p].calls_per_token:.3f} "
                 f"({at[rtt, category, p].calls_vs_hindsight:.2f}x)" for p in shown]
        lines.append(f"| {rtt:g} | {category} | {' | '.join(cells)} |")
    return "\n".join(lines)


def headline(rows: list[ReplayRow]) -> str:
    """Per RTT: the best fixed K, goodput with the verifier, with exact a_i, vLLM's configuration (when the data
    holds margins) and the hindsight oracle."""
    policies = [p for p in (LEARNED, EXACT, ESTIMATOR_BUDGET, HINDSIGHT) if any(r.policy == p for r in rows)]
    lines = ["| RTT ms | best fixed K (tokens/s, calls/token) | " + " | ".join(policies) + " |",
             "|---|---|" + "---|" * len(policies)]
    for rtt in sorted({r.rtt_ms for r in rows}):
        at = {r.policy: r for r in overall(rows) if r.rtt_ms == rtt}
        fixed = best_fixed(rows, rtt)
        cells = [f"{r.tokens_per_s:.2f} tok/s, {r.calls_per_token:.3f} ({r.calls_vs_hindsight:.2f}x)"
                 for r in (fixed, *(at[p] for p in policies))]
        lines.append(f"| {rtt:g} | {fixed.policy}: {' | '.join(cells)} |")
    return "\n".join(lines)


def write_report(rows: list[ReplayRow], costs: RoundCosts, settings: ReplaySettings, traces: list[Trace],
                 out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    tokens = sum(len(t.accept_prob) for t in traces)
    summary = (f"Replay on {len(traces)} held-out traces ({tokens} drafted tokens) x {settings.seeds} seeds; "
               f"costs {asdict(costs)} ms. calls/token (x the hindsight oracle's) per policy:\n\n"
               f"{headline(rows)}\n\nBy prompt category\n\n{by_category(rows)}\n\n"
               f"Every policy, all prompts\n\n{table(overall(rows))}")
    (out / "replay.md").write_text(summary + "\n")
    (out / "replay.json").write_text(json.dumps({"costs": asdict(costs), "settings": asdict(settings),
                                                 "traces": len(traces), "tokens": tokens,
                                                 "rows": [asdict(r) for r in rows]}, indent=1))
    return summary
