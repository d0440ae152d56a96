"""`sprinter verifier compare`: a learned verifier against the margin-logistic estimator, on the same recorded traces.

The held-out prompts are the learned verifier's own (its metadata names them); every other prompt of the data is
the estimator's training stream. The estimator learns the way it would on the edge (common/spec/margin_logistic.py):
block by block, each verdict adding the block's reached tokens, a refit every 100 verdicts, negative slopes rejected.

Blocks: data collected with `--segment K` records each token's index in its block; data decoded in one block per
prompt (segment 0) is cut into blocks of `block` tokens. A token is reached when no token before it in its block was
rejected; acceptances are the greedy label at T = 0 and events drawn from the soft label at T > 0 (features.py).
The margin is the draft's top-1 minus top-2 logit, log(max_prob / runner_up_prob) of the recorded probabilities.

Reported on the held-out tokens, all of them and the reached ones: ROC AUC (on the events), Brier score and
calibration error (against the training target), for the learned verifier, the estimator and the draft's own
token probability; and calibration by block position on the reached tokens.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

import numpy as np

from common.spec.margin_logistic import MarginLogistic, MarginLogisticSettings, sigmoid
from edge.runtime.verifier import LearnedVerifier
from edge.verifier_training.collect import VerifierDataset
from edge.verifier_training.features import events, feature_matrix, labels_for, resolved_label
from edge.verifier_training.metrics import expected_calibration_error, reliability, roc_auc

log = logging.getLogger(__name__)

LEARNED, ESTIMATOR, CONFIDENCE = "learned", "margin-logistic", "draft token_prob"
POPULATIONS = ("all", "reached")


@dataclass(frozen=True)
class CompareSettings:
    block: int = 8  # block length cut from data decoded in one block per prompt (segment 0)
    label: str = "auto"
    seed: int = 0  # the acceptance events drawn from soft labels
    estimator: MarginLogisticSettings = field(default_factory=MarginLogisticSettings)

    def __post_init__(self) -> None:
        if self.block < 1:
            raise ValueError(f"--block must be >= 1, got {self.block}")


@dataclass(frozen=True)
class Blocks:
    """Per token: its index in its block, the block it belongs to, and whether the target reached it."""

    position: np.ndarray
    block_id: np.ndarray
    reached: np.ndarray


def logit_margins(dataset: VerifierDataset) -> np.ndarray:
    """The draft's top-1 minus top-2 logit per token: log(p1 / p2) under its softmax at T=1."""
    if "runner_up_prob" not in dataset.arrays:
        raise ValueError("this data predates the runner-up probability (the margin): collect it again")
    top = dataset.arrays["confidence"][:, 1].astype(np.float64)
    runner_up = dataset.arrays["runner_up_prob"].astype(np.float64)
    return np.log(np.maximum(top, 1e-300)) - np.log(np.maximum(runner_up, 1e-300))


def blocks_of(dataset: VerifierDataset, accepted: np.ndarray, block: int) -> Blocks:
    """The blocks the tokens were verified in (see the module docstring) and which tokens each block reached."""
    if dataset.manifest["settings"]["segment"] > 0:
        if "block_position" not in dataset.arrays:
            raise ValueError("this data (collected with --segment) predates block positions: collect it again")
        position = dataset.arrays["block_position"].astype(np.int64)
    else:
        position = dataset.arrays["position"].astype(np.int64) % block
    block_id = np.cumsum(position == 0) - 1
    rejected = (~accepted.astype(bool)).astype(np.int64)
    before = np.cumsum(rejected) - rejected  # rejections before each token, over the whole stream
    first = np.flatnonzero(position == 0)
    reached = (before - before[first][block_id]) == 0
    return Blocks(position, block_id, reached)


def fit_online(blocks: Blocks, margins: np.ndarray, accepted: np.ndarray, mask: np.ndarray,
               settings: MarginLogisticSettings) -> MarginLogistic:
    """The estimator after hearing the verdicts on the blocks of the `mask` tokens, in recorded order."""
    estimator = MarginLogistic(settings)
    chosen = np.flatnonzero(mask & blocks.reached)
    ids = blocks.block_id[chosen]
    for rows in np.split(chosen, np.flatnonzero(np.diff(ids)) + 1):
        if len(rows):
            estimator.observe_examples([(int(blocks.position[i]), float(margins[i]), bool(accepted[i])) for i in rows])
    return estimator


def estimator_scores(estimator: MarginLogistic, position: np.ndarray, margins: np.ndarray) -> np.ndarray:
    """p_k per token, as the edge would score it (1.0 at a position still warming up)."""
    scores = np.ones(len(margins))
    for k in np.unique(position):
        parameters = estimator.parameters_at(int(k))
        if parameters is not None:
            at = position == k
            scores[at] = [sigmoid(parameters[0] * m + parameters[1]) for m in margins[at]]
    return scores


def held_out_mask(dataset: VerifierDataset, verifier: LearnedVerifier) -> np.ndarray:
    """The tokens of the prompts the learned verifier never trained on (its metadata's held-out prompts)."""
    held = set(verifier.metadata.get("training", {}).get("held_out_prompt_ids", []))
    in_held = np.array([p.id in held for p in dataset.prompts])
    if not in_held.any():
        raise ValueError("none of the verifier's held-out prompts is in this data: collect the prompts it was "
                         "trained on (its verifier.json names its held-out prompts)")
    return in_held[dataset.arrays["prompt_index"]]


def check_pair(dataset: VerifierDataset, verifier: LearnedVerifier) -> None:
    pair, manifest = verifier.metadata["pair"], dataset.manifest
    if (pair["draft"], pair["target"]) != (manifest["draft"], manifest["target"]) \
            or pair["vocab_fingerprint"] != manifest["vocab_fingerprint"]:
        raise ValueError(f"the verifier is for {pair['draft']} -> {pair['target']}, the data for "
                         f"{manifest['draft']} -> {manifest['target']}")


def metrics(scores: np.ndarray, target: np.ndarray, outcome: np.ndarray) -> dict:
    return {"tokens": int(len(scores)), "base_rate": float(target.mean()), "mean_score": float(scores.mean()),
            "roc_auc": roc_auc(scores, outcome), "brier": float(np.mean((scores - target) ** 2)),
            "ece": expected_calibration_error(scores, target)}


def by_position(scores: dict[str, np.ndarray], target: np.ndarray, position: np.ndarray) -> list[dict]:
    """Per block position: observed acceptance, each method's mean prediction and Brier score."""
    rows = []
    for k in np.unique(position):
        at = position == k
        row = {"position": int(k), "tokens": int(at.sum()), "observed": float(target[at].mean())}
        for name, s in scores.items():
            row[name] = {"predicted": float(s[at].mean()), "brier": float(np.mean((s[at] - target[at]) ** 2))}
        rows.append(row)
    return rows


@dataclass(frozen=True)
class Verdicts:
    """Per token of the data: the training target, the acceptance event drawn from it, the draft's logit margin,
    the block it was verified in, and whether its prompt is one the verifier holds out."""

    target: np.ndarray
    outcome: np.ndarray
    margins: np.ndarray
    blocks: Blocks
    test: np.ndarray


def verdicts_of(dataset: VerifierDataset, verifier: LearnedVerifier, settings: CompareSettings) -> Verdicts:
    check_pair(dataset, verifier)
    target = labels_for(dataset, settings.label)
    outcome = events(target, settings.seed)
    return Verdicts(target, outcome, logit_margins(dataset), blocks_of(dataset, outcome, settings.block),
                    held_out_mask(dataset, verifier))


def fitted_estimator(verdicts: Verdicts, settings: CompareSettings) -> MarginLogistic:
    """The estimator after hearing, block by block, the verdicts on every prompt the verifier does not hold out."""
    return fit_online(verdicts.blocks, verdicts.margins, verdicts.outcome, ~verdicts.test, settings.estimator)


def compare(dataset: VerifierDataset, verifier: LearnedVerifier, settings: CompareSettings) -> dict:
    """The comparison's JSON (see the module docstring)."""
    verdicts = verdicts_of(dataset, verifier, settings)
    estimator = fitted_estimator(verdicts, settings)
    target, outcome, margins, blocks, test = (verdicts.target, verdicts.outcome, verdicts.margins, verdicts.blocks,
                                              verdicts.test)
    features = tuple(verifier.metadata["features"])
    scores = {LEARNED: verifier.score_features(feature_matrix(dataset, features)[test]).astype(np.float64),
              ESTIMATOR: estimator_scores(estimator, blocks.position[test], margins[test]),
              CONFIDENCE: dataset.arrays["confidence"][test, 0].astype(np.float64)}
    reached = blocks.reached[test]
    return {
        "data": {"draft": dataset.manifest["draft"], "target": dataset.manifest["target"],
                 "collection": dataset.manifest["settings"], "label": resolved_label(dataset, settings.label),
                 "train_tokens": int((~test).sum()), "test_tokens": int(test.sum()),
                 "train_verdicts": estimator.verdicts, "test_prompts": int(len(np.unique(dataset.arrays["prompt_index"][test])))},
        "verifier": {"id": verifier.metadata.get("id"), "features": list(features)},
        "settings": {**asdict(settings), "block_source": "recorded" if dataset.manifest["settings"]["segment"] else "cut"},
        "estimator": {"fits": estimator.fits, "params": {str(k): list(v) for k, v in sorted(estimator.params.items())}},
        "metrics": {population: {name: metrics(s[mask], target[test][mask], outcome[test][mask])
                                 for name, s in scores.items()}
                    for population, mask in (("all", np.ones(len(reached), bool)), ("reached", reached))},
        "by_position": by_position({n: s[reached] for n, s in scores.items()}, target[test][reached],
                                   blocks.position[test][reached]),
        "reliability": {name: reliability(s[reached], target[test][reached]) for name, s in scores.items()},
    }


def table(result: dict) -> str:
    """Markdown: the metrics per population and method, then calibration by position."""
    lines = ["| tokens | verifier | n | base rate | mean score | ROC AUC | Brier | ECE |", "|---|---|---|---|---|---|---|---|"]
    for population, methods in result["metrics"].items():
        for name, m in methods.items():
            lines.append(f"| {population} | {name} | {m['tokens']} | {m['base_rate']:.3f} | {m['mean_score']:.3f} | "
                         f"{m['roc_auc']:.3f} | {m['brier']:.4f} | {m['ece']:.3f} |")
    names = list(result["metrics"]["reached"])
    lines += ["", "| position | n | observed | " + " | ".join(f"{n} predicted / Brier" for n in names) + " |",
              "|---|---|---|" + "---|" * len(names)]
    for row in result["by_position"]:
        cells = " | ".join(f"{row[n]['predicted']:.3f} / {row[n]['brier']:.3f}" for n in names)
        lines.append(f"| {row['position']} | {row['tokens']} | {row['observed']:.3f} | {cells} |")
    return "\n".join(lines) + "\n"
