"""`sprinter verifier compare`: the blocks a trace is verified in, the online fit on them, and the command end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

from common.cli import main
from common.spec.margin_logistic import MarginLogisticSettings
from edge.verifier_training.collect import VerifierDataset
from edge.verifier_training.compare import blocks_of, estimator_scores, fit_online, logit_margins
from prompt_files import short_prompt_file

PAIR = ["--target", "tiny-random", "--draft", "tiny-random-draft", "--dtype", "float32"]


def _dataset(position: np.ndarray, segment: int, **arrays: np.ndarray) -> VerifierDataset:
    n = len(position)
    prompt_index = np.cumsum(position == 0) - 1
    base = {"position": position, "prompt_index": prompt_index, "confidence": np.full((n, 3), 0.5, np.float32),
            "runner_up_prob": np.full(n, 0.25, np.float32)}
    manifest = {"settings": {"segment": segment, "temperature": 0.0}, "prompts": []}
    return VerifierDataset(manifest, {**base, **arrays})


def test_one_block_per_prompt_is_cut_into_blocks_and_a_rejection_ends_what_its_block_reaches():
    dataset = _dataset(np.array([0, 1, 2, 3, 4, 0, 1, 2]), segment=0)
    accepted = np.array([1, 0, 1, 1, 1, 0, 1, 1], dtype=bool)
    blocks = blocks_of(dataset, accepted, block=3)
    assert blocks.position.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert blocks.block_id.tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert blocks.reached.tolist() == [True, True, False, True, True, True, False, False]


def test_recorded_block_positions_are_used_when_the_data_has_them():
    dataset = _dataset(np.array([0, 1, 2, 0, 1, 2]), segment=2, block_position=np.array([0, 1, 0, 1, 0, 1]))
    blocks = blocks_of(dataset, np.ones(6, dtype=bool), block=8)
    assert blocks.position.tolist() == [0, 1, 0, 1, 0, 1] and blocks.block_id.tolist() == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="block positions"):
        blocks_of(_dataset(np.array([0, 1]), segment=2), np.ones(2, dtype=bool), block=8)


def test_the_margin_is_the_log_ratio_of_the_top_two_probabilities():
    dataset = _dataset(np.array([0, 1]), segment=0)
    assert logit_margins(dataset) == pytest.approx([np.log(2.0)] * 2)


def test_the_online_fit_on_blocks_recovers_the_curve_and_scores_as_the_edge_would():
    rng = np.random.default_rng(0)
    n, block = 30_000, 4
    position = np.arange(n) % 400  # 75 prompts of 400 tokens
    margins = rng.exponential(2.0, n)
    accepted = rng.random(n) < 1 / (1 + np.exp(-(1.2 * margins - 1.0)))
    blocks = blocks_of(_dataset(position, segment=0), accepted, block)
    estimator = fit_online(blocks, margins, accepted, np.ones(n, dtype=bool), MarginLogisticSettings())
    assert estimator.verdicts == n // block and estimator.fits == estimator.verdicts // 100
    for k in range(block):
        w, b = estimator.params[k]
        assert w == pytest.approx(1.2, abs=0.25) and b == pytest.approx(-1.0, abs=0.3)
    scores = estimator_scores(estimator, blocks.position[:8], margins[:8])
    w, b = estimator.params[int(blocks.position[5])]
    assert scores[5] == pytest.approx(1 / (1 + np.exp(-(w * margins[5] + b))))


def test_compare_end_to_end_on_the_tiny_pair(tmp_path):
    prompts = short_prompt_file(tmp_path, 40)
    out = tmp_path / "verifier"
    assert main(["verifier", "train", *PAIR, "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "12",
                 "--segment", "4", "--draft-weights", "float32", "--epochs", "4", "--threads", "1",
                 "--model", "confidence-mlp"]) == 0
    assert main(["verifier", "compare", "--data", str(out / "data"), "--verifier", str(out / "verifier.json"),
                 "--out", str(tmp_path / "compare")]) == 0
    result = json.loads((tmp_path / "compare" / "compare.json").read_text())
    assert result["settings"]["block_source"] == "recorded" and result["data"]["train_verdicts"] > 0
    assert set(result["metrics"]) == {"all", "reached"}
    assert set(result["metrics"]["all"]) == {"learned", "margin-logistic", "draft token_prob"}
    assert [row["position"] for row in result["by_position"]] == sorted(row["position"] for row in result["by_position"])
    assert (tmp_path / "compare" / "calibration.png").stat().st_size > 0
    assert (tmp_path / "compare" / "compare.md").read_text().startswith("| tokens |")
