"""`sprinter verifier study`: does more data, or another feature, make a better verifier?

Learning curve: every verifier kind trained on growing shares of the training prompts (the same
calibration and test prompts throughout: a split by prompt, as in train.py), its held-out ROC AUC
against the training tokens it saw. The paper's verifier reads the draft's hidden state (896
numbers for Qwen2.5-0.5B); whether that beats the draft's confidence is a question of data size,
which this answers for the data at hand.

Feature ablation: the confidence MLP plus one free feature at a time (edge/verifier_training/features.py),
kept only if it raises the held-out AUC by at least MIN_GAIN.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from edge.verifier_training.collect import VerifierDataset
from edge.verifier_training.features import events, has_features, labels_for, resolved_label
from edge.verifier_training.train import MODELS, Labels, TrainSettings, split_masks, train_one
from edge.runtime.verifier import CONFIDENCE_FEATURES, FREE_FEATURES

log = logging.getLogger(__name__)

CURVE_KINDS = ("linear", "mlp", "confidence-mlp", "context-mlp")
MIN_GAIN = 0.002  # held-out ROC AUC a feature must add to be kept: smaller differences are seed noise
SHARES = (0.125, 0.25, 0.5, 1.0)


@dataclass(frozen=True)
class CurvePoint:
    kind: str
    share: float  # of the training prompts
    train_tokens: int
    test_auc: float
    test_brier: float


@dataclass(frozen=True)
class AblationRow:
    features: tuple[str, ...]
    added: str  # the free feature on top of the confidence ("-" for the confidence alone)
    test_auc: float
    kept: bool  # raised the held-out AUC over the confidence alone by at least MIN_GAIN


def _subsample(train: np.ndarray, prompt_index: np.ndarray, share: float, seed: int) -> np.ndarray:
    """The training mask restricted to a random `share` of its prompts (nested: a larger share keeps them)."""
    prompts = np.unique(prompt_index[train])
    order = np.random.default_rng(seed).permutation(prompts)
    chosen = order[: max(1, int(round(share * len(prompts))))]
    return train & np.isin(prompt_index, chosen)


def learning_curve(dataset: VerifierDataset, settings: TrainSettings,
                   kinds: tuple[str, ...] = CURVE_KINDS, shares: tuple[float, ...] = SHARES) -> list[CurvePoint]:
    target = labels_for(dataset, settings.label)
    labels = Labels(target, events(target, settings.seed))
    masks = split_masks(dataset, settings.split, settings.seed)
    points = []
    for share in shares:
        sub = {**masks, "train": _subsample(masks["train"], dataset.arrays["prompt_index"], share, settings.seed)}
        for kind in kinds:
            if not has_features(dataset, MODELS[kind]):
                continue
            test = train_one(kind, dataset, labels, sub, settings).metrics["test"]
            points.append(CurvePoint(kind, share, int(sub["train"].sum()), test["roc_auc"], test["brier"]))
            log.info("%s on %d training tokens: test ROC AUC %.3f", kind, points[-1].train_tokens, test["roc_auc"])
    return points


def feature_ablation(dataset: VerifierDataset, settings: TrainSettings) -> list[AblationRow]:
    target = labels_for(dataset, settings.label)
    labels = Labels(target, events(target, settings.seed))
    masks = split_masks(dataset, settings.split, settings.seed)
    candidates = [("-", CONFIDENCE_FEATURES)] + [(f, (*CONFIDENCE_FEATURES, f)) for f in FREE_FEATURES]
    candidates.append(("all free", (*CONFIDENCE_FEATURES, *FREE_FEATURES)))
    rows, baseline = [], None
    for added, features in candidates:
        if not has_features(dataset, features):
            continue
        auc = train_one("confidence-mlp", dataset, labels, masks, settings, features).metrics["test"]["roc_auc"]
        baseline = auc if baseline is None else baseline
        rows.append(AblationRow(features, added, auc, added != "-" and auc >= baseline + MIN_GAIN))
    return rows


def study_tables(points: list[CurvePoint], ablation: list[AblationRow], label: str) -> str:
    kinds = list(dict.fromkeys(p.kind for p in points))
    shares = sorted({p.share for p in points})
    by = {(p.kind, p.share): p for p in points}
    lines = [f"Learning curve (label {label}): held-out ROC AUC by training tokens", "",
             "| training prompts | training tokens | " + " | ".join(kinds) + " |", "|---" * (2 + len(kinds)) + "|"]
    for share in shares:
        row = [by[(k, share)] for k in kinds if (k, share) in by]
        lines.append(f"| {share:.0%} | {row[0].train_tokens} | " + " | ".join(f"{p.test_auc:.4f}" for p in row) + " |")
    lines += ["", f"Free features on top of the confidence MLP (held-out ROC AUC; kept: at least +{MIN_GAIN})", "",
              "| added | ROC AUC | kept |", "|---|---|---|"]
    lines += [f"| {r.added} | {r.test_auc:.4f} | {'yes' if r.kept else 'no'} |" for r in ablation]
    return "\n".join(lines)


def plot_learning_curve(points: list[CurvePoint], label: str, path: Path) -> None:
    from common.lab.plots import saved_figure

    with saved_figure(path, figsize=(5.5, 4.2)) as (fig, ax):
        for kind in dict.fromkeys(p.kind for p in points):
            mine = sorted((p.train_tokens, p.test_auc) for p in points if p.kind == kind)
            ax.plot(*zip(*mine), marker="o", label=kind)
        ax.set_xscale("log")
        ax.set_xlabel("training tokens")
        ax.set_ylabel("held-out ROC AUC")
        ax.set_title(f"verifier learning curve ({label} label)")
        ax.grid(alpha=0.3)
        ax.legend()


def run_study(dataset: VerifierDataset, settings: TrainSettings, out: Path) -> str:
    """Learning curve + ablation into OUT/study.json, OUT/study.md, OUT/learning_curve.png; returns the tables."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    points, ablation = learning_curve(dataset, settings), feature_ablation(dataset, settings)
    label = resolved_label(dataset, settings.label)
    tables = study_tables(points, ablation, label)
    (out / "study.json").write_text(json.dumps({"label": label, "tokens": len(dataset),
                                                "settings": asdict(replace(settings)),
                                                "learning_curve": [asdict(p) for p in points],
                                                "ablation": [asdict(r) for r in ablation]}, indent=1))
    (out / "study.md").write_text(tables + "\n")
    plot_learning_curve(points, label, out / "learning_curve.png")
    return tables
