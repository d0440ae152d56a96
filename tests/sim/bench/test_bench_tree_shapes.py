"""`sprinter bench tree-shapes` (sim/bench/tree_shapes.py): greedy rounds replayed over a trace
(sim/bench/tree_replay.py).

* on a constructed trace, where every round's verdict is known by hand: one path, the edge's shape (read from
  common/spec/tree/branching.py, its branches past the chain's end), the round-robin shape (and its depth cap), the
  grid at the lowest estimate, a nested alternative inside a branch, and the oracle path that stops at the
  first token the draft ranks too low;
* on the tiny pair (float32), a trace's rows are what the draft proposes step by step: each row's best token is the
  draft's argmax after the target's text, and each fork is its own chain after its token;
* the bench's smallest scenario end to end: its table, results.json, and a rerun that reads the traces' cache.
"""

from __future__ import annotations

import pytest
import torch

from common.errors import UsageError
from common.lab.prompt_sets import PromptRecord
from common.model.cached_lm import CachedLM
from common.spec.cost_model import CostModel
from common.spec.tree.branching import MAX_ALTERNATIVES, branch_length
from sim.bench import tree_replay
from sim.bench.run_folder import RunFolder
from sim.bench.settings.trees import TreeShapesSettings
from sim.bench.tree_replay import (Branch, DraftTopTokens, PromptTrace, Scored, TraceSettings, TreeShape, build_trace,
                                   decode, place)
from sim.bench.tree_shapes import bench_tree_shapes

OUTPUT = list(range(10, 22))  # the target's 12 tokens; no EOS: the output ends at max_tokens
EOS = 0
REJECTED = 3  # the draft's best token there is EOS, not the target's (its second best): the block ends there too
LOW = 0.2  # the estimate at the rejected position: the lowest of the chain
CAP = 4  # rounds send blocks of at most 4 (the policy, with a huge round trip, never sends earlier)


def constructed(deviate_after: bool = False) -> Scored:
    """Rows that follow the target except at REJECTED, where the draft proposes EOS and ranks the target's token
    second: the chain that reaches it ends there, rejected at its last token (as goodput's blocks often are). With
    `deviate_after`, the draft's best after the target's token there is not the target's next either (its second)."""
    rows = [DraftTopTokens([token, 90 + p, 91 + p, 92 + p], [0.7, 0.2, 0.05, 0.05], 1.0)
            for p, token in enumerate(OUTPUT)]
    rows[REJECTED] = DraftTopTokens([EOS, OUTPUT[REJECTED], 51, 52], [0.4, 0.3, 0.2, 0.1], 2.0)
    forks, fork_estimates = {REJECTED: []}, {REJECTED: []}
    if deviate_after:
        rows[REJECTED + 1] = DraftTopTokens([70, OUTPUT[REJECTED + 1], 71, 72], [0.5, 0.3, 0.1, 0.1], 1.5)
        forks[REJECTED + 1] = [DraftTopTokens([60 + k], [0.9], 0.5) for k in range(CAP)]
        fork_estimates[REJECTED + 1] = [0.95] * CAP
    trace = PromptTrace("p", "c", 5, OUTPUT, [EOS], rows, forks)
    estimates = [LOW if p == REJECTED else 0.99 for p in range(len(OUTPUT))]
    return Scored(trace, estimates, fork_estimates)


def replay(shape: TreeShape, oracle_rank: int = 5, deviate_after: bool = False):
    costs = CostModel(prior_draft_ms=1.0, prior_rtt_ms=1e7, prior_verify_base_ms=1.0, prior_verify_per_token_ms=0.0)
    return decode(constructed(deviate_after), shape, costs, len(OUTPUT), CAP, None, oracle_rank)


def rounds(result) -> list[tuple[int, int, int | None, int]]:
    """(start, chain length, rejection, tokens kept) of each round."""
    return [(r.start, r.chain, r.rejection, r.kept) for r in result.rounds]


def test_one_path_keeps_the_chain_up_to_its_rejection():
    result = replay(TreeShape("one path", "chain"))
    # the open brings output[0]; round 1 drafts positions 1-3 (EOS at 3) and keeps 2, then the target's token at 3
    assert rounds(result) == [(1, 3, 2, 2), (4, 4, None, 4), (9, 3, None, 3)]
    assert (result.tokens, result.calls) == (12, 4)
    assert result.rounds[0].lowest[0] == 2  # the rejected token has the chain's lowest estimate


def test_the_edges_shape_spends_its_budget_at_the_lowest_estimate_first_down_to_the_rounds_limit():
    lowest_first = [0.9, 0.5, 0.2, 0.8, 0.95]  # a chain of 5: positions 2, 1, 3, 0, 4 by estimate
    longest = branch_length(16)
    assert MAX_ALTERNATIVES * longest < 16, "the budget reaches the second point (else pick a larger one here)"
    branches = place(TreeShape("edge:16", "edge", budget=16), lowest_first, None, 16, 20, constructed().trace, 1, 5)
    at_lowest = [Branch(2, nth + 1, longest) for nth in range(1, MAX_ALTERNATIVES + 1)]
    assert branches == at_lowest + [Branch(1, 2, 16 - MAX_ALTERNATIVES * longest)]
    assert 2 + longest > len(lowest_first)  # deeper than the chain: the branches may go to the round's limit
    limited = place(TreeShape("edge:16", "edge", budget=16), lowest_first, None, 16, 4, constructed().trace, 1, 5)
    assert [b.length for b in limited if b.position == 2] == [2] * MAX_ALTERNATIVES  # the limit is 4 deep
    # the tree's room, not the shape's budget, sets the branches' length (as the edge's budget is within it)
    roomy = place(TreeShape("edge:16", "edge", budget=16), lowest_first, None, 9, 20, constructed().trace, 1, 5)
    assert roomy[0].length == branch_length(9) and sum(b.length for b in roomy) == 9


def test_the_edges_shape_on_a_constructed_trace():
    edge = replay(TreeShape("edge:6", "edge", budget=6))
    first = edge.rounds[0]
    # the alternatives beside chain index 2 (the lowest) first, each 2 tokens (the round's limit is 4 deep, the
    # chain 3): past the chain's end, which the round-robin shape (below) never goes
    assert first.branch_tokens == 6 and first.at_rejection == min(6, MAX_ALTERNATIVES * min(branch_length(6), 2))
    # the first alternative is the target's token and the draft's next after it the target's too
    assert (first.kept, first.chain_kept) == (4, 2)
    assert rounds(edge)[1:] == [(6, 4, None, 4), (11, 1, None, 1)]


def test_the_round_robin_shape_branches_at_each_lowest_estimate_in_turn_no_deeper_than_the_chain():
    first = replay(TreeShape("round-robin:6", "round-robin", budget=6)).rounds[0]
    # 1 token beside chain index 2 (no deeper than the chain's 3), 3 beside index 0, 2 beside index 1
    assert (first.branch_tokens, first.at_rejection) == (6, 1)
    assert (first.kept, first.chain_kept) == (3, 2)  # the alternative is the target's token: one more kept
    deep = replay(TreeShape("round-robin-deep:6", "round-robin", budget=6, deep=True))
    # without the cap the branch there has 2 tokens (the round's limit is 4 deep), and the draft's next is the target's
    assert (deep.rounds[0].at_rejection, deep.rounds[0].kept) == (2, 4)
    assert rounds(deep)[1:] == [(6, 4, None, 4), (11, 1, None, 1)]


def test_the_grid_at_the_lowest_estimate_and_the_oracle_path():
    grid = replay(TreeShape("lowest:2x3", "grid", alternatives=2, length=3)).rounds[0]
    # 2 alternatives of 2 tokens (the round's depth limit) beside index 2: the first is the target's text
    assert (grid.branch_tokens, grid.at_rejection, grid.kept, grid.chain_kept) == (4, 4, 4, 2)
    oracle = replay(TreeShape("oracle-path:8", "oracle-path", budget=8)).rounds[0]
    assert (oracle.branch_tokens, oracle.kept) == (2, 4)
    # the target's token at the rejection is the draft's second: an oracle within its best one has no tree
    none = replay(TreeShape("oracle-path:8", "oracle-path", budget=8), oracle_rank=1).rounds[0]
    assert (none.branch_tokens, none.kept) == (0, 2)


def test_a_nested_alternative_recovers_where_the_branch_itself_leaves_the_target():
    grid = replay(TreeShape("lowest:1x2", "grid", length=2), deviate_after=True).rounds[0]
    assert (grid.branch_tokens, grid.kept) == (2, 3)  # the alternative is kept, the draft's token after it is not
    nested = replay(TreeShape("nested:1x2+1x1", "nested", length=2, inner_alternatives=1, inner_length=1),
                    deviate_after=True).rounds[0]
    # one more token beside the branch's second node (its lowest estimate): the draft's second best, the target's
    assert (nested.branch_tokens, nested.kept, nested.chain_kept) == (3, 4, 2)


@pytest.fixture(scope="module")
def tiny_trace(tiny_target, tiny_draft):
    torch.set_num_threads(1)
    record = PromptRecord("tiny-1", "test", False, "The quick brown fox")
    settings = TraceSettings("tiny-random", "tiny-random-draft", "float32", 24, 5, 6)
    return build_trace(record, tiny_target, tiny_draft, settings), tiny_target, tiny_draft


def test_a_traces_rows_are_the_drafts_own_steps(tiny_trace):
    trace, target, draft = tiny_trace
    prompt = draft.tokenizer(trace_prompt := "The quick brown fox")["input_ids"]
    assert trace_prompt and len(trace.rows) == len(trace.output) and trace.prompt_tokens == len(prompt)
    assert trace.rejections(), "the tiny pair disagrees somewhere: the forks are checked below"
    lm = CachedLM(draft.model)
    for j, row in enumerate(trace.rows):  # one token a forward, as the edge drafts
        assert row.token == int(lm.advance_to(prompt + trace.output[:j]).logits[-1].argmax())
    for j, fork in trace.forks.items():
        context = prompt + trace.output[:j] + [trace.rows[j].token]
        for row in fork:
            assert row.token == int(lm.advance_to(context).logits[-1].argmax())
            context = context + [row.token]


def test_the_smallest_scenario_end_to_end_and_its_cache(tmp_path, monkeypatch):
    settings = TreeShapesSettings(target="tiny-random", draft="tiny-random-draft", dtype="float32", per_category=1,
                                  max_tokens=8, estimate="draft", budgets=(4,), out=tmp_path)
    table = bench_tree_shapes(settings)
    results = RunFolder(tmp_path).read_results()
    assert list(results)[:4] == ["date", "machine", "commit", "settings"] and results["settings"]["rtt_ms"] == 0.0
    shapes = results["summary"]["shapes"]
    assert shapes["one path"]["x_one_path"] == 1.0 and shapes["one path"]["branch_tokens_per_round"] == 0
    assert 0 < shapes["edge:4"]["branch_tokens_per_round"] <= 4  # within its budget, as the edge's tree is
    assert shapes["oracle-path:4"]["tokens_per_call"] >= shapes["one path"]["tokens_per_call"]
    for heading in ("| 4 | the edge's shape (tree:B) |", "All branch tokens at the lowest estimate", "Rank of the "
                    "target's token", "After an alternative of rank 2-5", "Rounds whose chain was rejected"):
        assert heading in table
    assert (tmp_path / "table.md").read_text() == table + "\n" and (tmp_path / "tree_shapes.png").exists()
    monkeypatch.setattr(tree_replay, "load_model", lambda *_: pytest.fail("the traces are cached: no model loads"))
    assert bench_tree_shapes(settings) == table


def test_settings_refuse_what_the_study_cannot_replay():
    with pytest.raises(UsageError, match="--budgets"):
        TreeShapesSettings(budgets=())
    with pytest.raises(UsageError, match="--oracle-rank"):
        TreeShapesSettings(top=6, oracle_rank=7)
