"""`sprinter bench proposer`: its prompt suite and its summary (the measurement itself: docs/benchmarks/proposers.md)."""

from __future__ import annotations

from collections import Counter

import pytest

from common.cli import build_parser
from common.errors import UsageError
from common.lab.prompt_sets import load_prompts
from sim.bench.proposer import chosen_prompts, summarize, table, tree_table
from sim.bench.settings.sweeps import SUITE, ProposerBenchSettings

CATEGORIES = {"code-edit", "summarize", "passage-qa", "chat-history", "math", "translation", "code-complete"}


def test_the_suite_has_a_few_prompts_in_every_category() -> None:
    records = load_prompts(SUITE)  # the shipped format, checked line by line
    counts = Counter(r.category for r in records)
    assert set(counts) == CATEGORIES and min(counts.values()) >= 3
    assert [r.category for r in chosen_prompts(records, ("math", "summarize"), 1)] == ["summarize", "math"]
    held_out = [r.id for r in chosen_prompts(records, ("math",), None, skip=1)]  # fitting leaves prompt 1 out
    assert held_out == [r.id for r in records if r.category == "math"][1:]


def test_the_summary_takes_medians_of_passes_and_suffix_over_model() -> None:
    def row(run: int, proposer: str, tokens: int, calls: int, wall_s: float, copied: int) -> dict:
        return {"run": run, "proposer": proposer, "mode": "sd-block", "category": "summarize", "prompt_id": "s",
                "tokens": tokens, "wall_s": wall_s, "target_calls": calls, "draft_forwards": tokens - copied,
                "draft_fed_tokens": tokens, "suffix_tokens": copied, "suffix_kept": copied // 2,
                "block_lengths": [5] * calls, "accepted_lengths": [2] * calls}

    rows = [row(r, "model", 60, 20, 10.0 + r, 0) for r in range(3)] + \
           [row(r, "suffix", 60, 10 - r, 5.0, 30) for r in range(3)]
    summary = {(s["category"], s["proposer"]): s for s in summarize(rows)}
    suffix = summary[("summarize", "suffix")]
    assert summary[("summarize", "model")]["tokens_per_call"] == pytest.approx(3.0)
    assert suffix["tokens_per_call"] == pytest.approx(60 / 9) and suffix["passes"] == 3
    assert suffix["tokens_per_call_x"] == pytest.approx(60 / 9 / 3) and suffix["tokens_per_s_x"] == pytest.approx(11 / 5)
    assert suffix["suffix_share"] == pytest.approx(0.5) and summary[("all", "suffix")]["tokens_per_call"] == suffix["tokens_per_call"]
    assert "| sd-block | summarize | suffix | 6.67 |" in table(ProposerBenchSettings(), summarize(rows), 12.0)
    # the hindsight oracle on 2 of 5 kept per block: p = 2/3 survival, (1 - p^21) / (1 - p) tokens per call
    assert summary[("summarize", "model")]["oracle_calls_per_token"] == pytest.approx(1 / 3, rel=1e-3)


def test_a_fitted_calibration_loads_back_as_the_edges_priors(tmp_path) -> None:
    from common.spec.propose.suffix_proposer import PRIOR_RATES, load_priors
    from sim.bench.proposer_calibration import fit_calibration
    measured = [{"source": "context", "match_length": 8, "reached": 92, "kept": 0.5, "predicted": 0.8}]
    fitted = fit_calibration(measured, "greedy", "a test")
    path = tmp_path / "suffix_calibration.json"
    path.write_text(__import__("json").dumps(fitted))
    priors = load_priors(path)
    assert priors["context"][8] == pytest.approx((46 + 0.85 * 8) / 100, abs=1e-3)  # drawn toward the prior by 8
    assert priors["context"][3] == PRIOR_RATES["context"][3] and priors["cache"] == PRIOR_RATES["cache"]


def test_the_command_parses() -> None:
    args = build_parser().parse_args(["bench", "proposer", "--categories", "math,code-edit", "--per-category", "1",
                                      "--suffix-cache", "off", "--page", "docs/benchmarks/proposers.md"])
    assert args.categories == ("math", "code-edit") and args.proposers == ("model", "suffix", "hybrid") and args.rtt_ms == 50
    assert args.suffix_cache == "off" and args.per_category == 1


def test_branch_budgets_make_variants_and_their_trees_are_tabled():
    settings = ProposerBenchSettings(proposers=("model",), branch_tokens=("0", "auto"))
    assert settings.variants == ("model", "model+tree:auto")
    row = {"mode": "sprinter-exact", "category": "math", "run": 0, "tokens": 40, "wall_s": 4.0, "target_calls": 8,
           "draft_forwards": 40, "block_lengths": [5] * 8, "accepted_lengths": [4] * 8}
    rows = [{**row, "proposer": "model"},
            {**row, "proposer": "model+tree:auto", "target_calls": 5, "tree_rounds": 4, "tree_paths": 10,
             "branch_tokens_sent": 12, "branch_tokens_kept": 3, "side_path_wins": 2, "copy_branch_tokens": 4,
             "copy_path_wins": 1}]
    summary = summarize(rows)
    treed = next(s for s in summary if s["proposer"] == "model+tree:auto" and s["category"] == "math")
    assert treed["tokens_per_call_x"] == pytest.approx(8 / 5)
    assert "| sprinter-exact | math | model+tree:auto | 4 | 2.50 | 3.00 | 0.75 | 0.50 | 1.00 | 0.25 |" in \
        tree_table(summary)
    assert tree_table([s for s in summary if s["proposer"] == "model"]) == ""


def test_llama_server_alone_is_a_row_of_its_own_and_every_row_is_timed_against_it():
    from sim.sweep.baselines import LLAMA_SERVER
    row = {"category": "math", "prompt_id": "m", "tokens": 40, "block_lengths": [5] * 8, "accepted_lengths": [4] * 8}
    rows = [{**row, "run": r, "proposer": "model", "mode": "sprinter-exact", "wall_s": 4.0, "target_calls": 8}
            for r in range(3)]
    rows += [{**row, "run": r, "proposer": LLAMA_SERVER, "mode": LLAMA_SERVER, "wall_s": 5.0 + r, "target_calls": 40,
              "block_lengths": [], "accepted_lengths": []} for r in range(3)]
    summary = {(s["category"], s["proposer"]): s for s in summarize(rows)}
    alone = summary[("math", LLAMA_SERVER)]
    assert alone["tokens_per_s"] == pytest.approx(40 / 6) and alone["calls_per_token"] == 1.0  # a forward a token
    assert summary[("math", "model")]["tokens_per_s_x_llama_server"] == pytest.approx(10 / (40 / 6))
    text = table(ProposerBenchSettings(), summarize(rows), None)
    assert "| sprinter-exact | math | model | 5.00 | 0.200 | 0.99 | 10.00 | 0.00 | 0.00 | - | - | 1.50 |" in text
    assert "| llama-server | all | llama-server | 1.00 | 1.000 | 1.00 | 6.67 |" in text


def test_draft_weights_are_the_onnx_drafts_and_refused_with_another_runtime() -> None:
    assert ProposerBenchSettings(draft_weights="w8a8").runtime_weights == "w8a8"
    assert ProposerBenchSettings(draft_runtime="torch").runtime_weights is None  # torch runs --dtype
    with pytest.raises(UsageError, match="--draft-weights w8a8 is for --draft-runtime onnx, not llama.cpp"):
        ProposerBenchSettings(draft_runtime="llama.cpp", draft_weights="w8a8")
