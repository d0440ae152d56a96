"""Train, calibrate and export the SPRINTER verifier.

The verifiers are trained on the same split (by prompt, never by token, so the held-out tokens come
from texts the verifier never saw):
    linear:         the paper's verifier, one linear layer + sigmoid on the draft's last hidden state;
    mlp:            a small MLP on the hidden state plus the draft's confidence (token prob, max prob, entropy);
    confidence-mlp: a small MLP on the draft's confidence alone;
    context-mlp:    the confidence plus the features the edge has for free (top-2 margin, the previous
                    token's probability, the entropy's change: edge/verifier_training/features.py);
    companion-mlp:  a small MLP on the confidence plus Speculative Verification's companion signals (S, A),
                    trained only when the data was collected with a companion (`--companion SPEC`).
Prompts split three ways: `train` fits the weights, `calibration` picks the epoch, fits Platt
scaling (so scores are acceptance probabilities, which the call policy needs) and sets the
threshold for `--max-fpr`; `test` measures. The confidence baseline is measured on the same test
tokens. The exported ONNX includes input normalisation and calibration: features in, probability out.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from common.lab.prompt_sets import split_by_prompt
from edge.verifier_training.collect import VerifierDataset
from edge.verifier_training.features import LABELS, events, feature_matrix, has_features, labels_for, resolved_label
from edge.verifier_training.metrics import REPORTED_FPRS, evaluate_scores, reliability, threshold_for_fpr
from edge.runtime.verifier import COMPANION_FEATURES, CONFIDENCE_FEATURES, FORMAT, FREE_FEATURES

log = logging.getLogger(__name__)

MODELS = {"linear": ("hidden",), "mlp": ("hidden", *CONFIDENCE_FEATURES), "confidence-mlp": CONFIDENCE_FEATURES,
          "context-mlp": (*CONFIDENCE_FEATURES, *FREE_FEATURES),
          "companion-mlp": (*CONFIDENCE_FEATURES, *COMPANION_FEATURES)}
LOG_FEATURES = ("token_prob", "max_prob")  # probabilities enter as logs: their useful range spans decades
SPLITS = ("train", "calibration", "test")
CALIBRATION_FPRS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3)


@dataclass(frozen=True)
class TrainSettings:
    model: str = "auto"  # the one exported; auto: the best ROC AUC on the calibration prompts
    label: str = "auto"  # greedy when the data was decoded greedily, else soft (edge/verifier_training/features.py)
    hidden_units: int = 32
    epochs: int = 40
    lr: float = 1e-3
    weight_decay: float = 1e-3
    batch_size: int = 256
    max_fpr: float = 0.05
    split: tuple[float, float, float] = (0.7, 0.15, 0.15)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.model not in (*MODELS, "auto"):
            raise ValueError(f"unknown verifier model {self.model!r}; choose auto or one of {', '.join(MODELS)}")
        if self.label not in (*LABELS, "auto"):
            raise ValueError(f"unknown label {self.label!r}; choose auto or one of {', '.join(LABELS)}")
        if not 0.0 < self.max_fpr < 1.0:
            raise ValueError(f"--max-fpr must be in (0, 1), got {self.max_fpr}")


class VerifierNet(nn.Module):
    """log of probability features -> standardise -> linear layer or MLP -> logit z -> sigmoid(scale * z + bias)."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor, hidden_units: int = 0,
                 log_mask: torch.Tensor | None = None) -> None:
        super().__init__()
        n_features = mean.numel()
        self.register_buffer("log_mask", log_mask if log_mask is not None else torch.zeros(n_features, dtype=torch.bool))
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        self.body = (nn.Linear(n_features, 1) if hidden_units == 0 else
                     nn.Sequential(nn.Linear(n_features, hidden_units), nn.ReLU(), nn.Linear(hidden_units, 1)))
        self.register_buffer("calibration_scale", torch.tensor(1.0))
        self.register_buffer("calibration_bias", torch.tensor(0.0))

    def logit(self, features: torch.Tensor) -> torch.Tensor:
        return self.body((self.transform(features) - self.mean) / self.std).squeeze(-1)

    def transform(self, features: torch.Tensor) -> torch.Tensor:
        return torch.where(self.log_mask, torch.log(features.clamp_min(1e-6)), features)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.calibration_scale * self.logit(features) + self.calibration_bias)


@dataclass
class TrainedVerifier:
    kind: str
    features: tuple[str, ...]
    net: VerifierNet
    threshold: float
    thresholds_at_fpr: dict[str, float]
    metrics: dict[str, dict] = field(default_factory=dict)  # split -> metrics
    reliability: list[dict] = field(default_factory=list)  # on the test split


def available_models(dataset: VerifierDataset) -> tuple[str, ...]:
    """The verifier kinds this data can train: companion signals exist only if a
    companion ran at collection, the margin only in data collected since it was recorded."""
    return tuple(kind for kind in MODELS if has_features(dataset, MODELS[kind]))


def split_masks(dataset: VerifierDataset, fractions: tuple[float, float, float], seed: int) -> dict[str, np.ndarray]:
    """Token masks of the train / calibration / test prompts (stratified by prompt category)."""
    prompts = dataset.prompts
    parts = split_by_prompt(prompts, fractions, seed)
    index_of = {p.id: i for i, p in enumerate(prompts)}
    masks = {}
    for name, part in zip(SPLITS, parts):
        members = np.zeros(len(prompts), dtype=bool)
        members[[index_of[p.id] for p in part]] = True
        masks[name] = members[dataset.arrays["prompt_index"]]
    return masks


def held_out_prompt_ids(dataset: VerifierDataset, settings: TrainSettings) -> list[str]:
    return [p.id for p in split_by_prompt(dataset.prompts, settings.split, settings.seed)[2]]


def _bce(net: VerifierNet, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(nn.functional.binary_cross_entropy_with_logits(net.logit(x), y))


def log_mask(features: tuple[str, ...], hidden_size: int) -> torch.Tensor:
    return torch.tensor([flag for name in features
                         for flag in ([False] * hidden_size if name == "hidden" else [name in LOG_FEATURES])])


def fit(x: np.ndarray, y: np.ndarray, x_val: np.ndarray, y_val: np.ndarray, hidden_units: int,
        settings: TrainSettings, mask: torch.Tensor) -> VerifierNet:
    """Adam on BCE; keeps the epoch with the lowest calibration-split loss (early stopping)."""
    torch.manual_seed(settings.seed)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    xv, yv = torch.from_numpy(x_val), torch.from_numpy(y_val)
    transformed = torch.where(mask, torch.log(xt.clamp_min(1e-6)), xt)
    mean, std = transformed.mean(0), transformed.std(0).clamp_min(1e-4)
    net = VerifierNet(mean, std, hidden_units, mask)
    optimiser = torch.optim.Adam(net.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    best_loss, best_state, stale = float("inf"), None, 0
    for epoch in range(settings.epochs):
        order = torch.randperm(len(xt))
        for start in range(0, len(xt), settings.batch_size):
            batch = order[start:start + settings.batch_size]
            loss = nn.functional.binary_cross_entropy_with_logits(net.logit(xt[batch]), yt[batch])
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
        val_loss = _bce(net, xv, yv)
        log.debug("epoch %d: calibration-split BCE %.4f", epoch, val_loss)
        if val_loss < best_loss - 1e-4:
            best_loss, best_state, stale = val_loss, {k: v.clone() for k, v in net.state_dict().items()}, 0
        else:
            stale += 1
            if stale >= 5:
                break
    net.load_state_dict(best_state)
    return net


def fit_platt(net: VerifierNet, x: torch.Tensor, y: torch.Tensor) -> None:
    """Platt scaling on held-out prompts: sigmoid(a*z + b) matches observed acceptance rates."""
    with torch.no_grad():
        z = net.logit(x)
    a = torch.tensor(1.0, requires_grad=True)
    b = torch.tensor(0.0, requires_grad=True)
    optimiser = torch.optim.LBFGS([a, b], max_iter=100)

    def closure() -> torch.Tensor:
        optimiser.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(a * z + b, y)
        loss.backward()
        return loss

    optimiser.step(closure)
    net.calibration_scale.fill_(float(a.detach()))
    net.calibration_bias.fill_(float(b.detach()))


def score(net: VerifierNet, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return net(torch.from_numpy(x)).numpy()


@dataclass(frozen=True)
class Labels:
    """Per token: what the verifier is trained toward (0/1, or an acceptance probability) and the
    accept/reject events rates and thresholds are measured on (the same, or drawn from it)."""

    target: np.ndarray
    outcome: np.ndarray


def measured(scores: np.ndarray, labels: Labels, mask: np.ndarray, threshold: float) -> dict:
    """One split's metrics: rates on the events, Brier score and calibration against the training target."""
    metrics = evaluate_scores(scores, labels.outcome[mask], threshold)
    metrics["brier"] = float(np.mean((scores - labels.target[mask]) ** 2))
    return metrics


def train_one(kind: str, dataset: VerifierDataset, labels: Labels, masks: dict[str, np.ndarray],
              settings: TrainSettings, features: tuple[str, ...] | None = None) -> TrainedVerifier:
    """One verifier of `kind` (an MLP unless linear) on `features` (default: the kind's own)."""
    features = features or MODELS[kind]
    x = feature_matrix(dataset, features)
    train, calibration = masks["train"], masks["calibration"]
    net = fit(x[train], labels.target[train], x[calibration], labels.target[calibration],
              0 if kind == "linear" else settings.hidden_units, settings,
              log_mask(features, dataset.arrays["hidden"].shape[1]))
    fit_platt(net, torch.from_numpy(x[calibration]), torch.from_numpy(labels.target[calibration]))
    calibration_scores = score(net, x[calibration])
    threshold = threshold_for_fpr(calibration_scores, labels.outcome[calibration], settings.max_fpr)
    thresholds = {f"{f:g}": threshold_for_fpr(calibration_scores, labels.outcome[calibration], f)
                  for f in CALIBRATION_FPRS}
    trained = TrainedVerifier(kind, features, net.eval(), threshold, thresholds)
    for split in SPLITS:
        trained.metrics[split] = measured(score(net, x[masks[split]]), labels, masks[split], threshold)
    trained.reliability = reliability(score(net, x[masks["test"]]), labels.target[masks["test"]])
    return trained


def confidence_baseline(dataset: VerifierDataset, labels: Labels, masks: dict[str, np.ndarray],
                        max_fpr: float) -> dict[str, dict]:
    """The draft's own token probability as the score, thresholded the same way."""
    scores = dataset.arrays["confidence"][:, 0]
    threshold = threshold_for_fpr(scores[masks["calibration"]], labels.outcome[masks["calibration"]], max_fpr)
    return {split: measured(scores[masks[split]], labels, masks[split], threshold) for split in SPLITS}


@dataclass
class TrainingReport:
    label: str
    settings: TrainSettings
    verifiers: dict[str, TrainedVerifier]
    confidence: dict[str, dict]
    split_prompts: dict[str, int]
    held_out_prompt_ids: list[str]

    @property
    def chosen(self) -> TrainedVerifier:
        """The exported verifier: the one asked for, or the best ROC AUC on the calibration prompts."""
        if self.settings.model != "auto":
            return self.verifiers[self.settings.model]
        return max(self.verifiers.values(), key=lambda v: v.metrics["calibration"]["roc_auc"])

    def table(self) -> str:
        """Markdown: every verifier's test-split metrics side by side."""
        rows = [("confidence (token prob)", self.confidence["test"])]
        rows += [(f"{kind} ({', '.join(v.features)})",
                  v.metrics["test"]) for kind, v in self.verifiers.items()]
        fprs = " | ".join(f"TPR@FPR {f:.0%}" for f in REPORTED_FPRS)
        lines = [f"| verifier | test tokens | base rate | accuracy | ROC AUC | {fprs} | threshold (calibrated) | test FPR | test TPR |",
                 "|---" * (8 + len(REPORTED_FPRS)) + "|"]
        for name, m in rows:
            tprs = " | ".join(f"{m['tpr_at_fpr'][f'{f:g}']:.3f}" for f in REPORTED_FPRS)
            lines.append(f"| {name} | {m['tokens']} | {m['base_rate']:.3f} | {m['accuracy']:.3f} | {m['roc_auc']:.3f} | "
                         f"{tprs} | {m['threshold']:.3f} | {m['verifier_fpr']:.3f} | {m['verifier_tpr']:.3f} |")
        return "\n".join(lines)


def train(dataset: VerifierDataset, settings: TrainSettings) -> TrainingReport:
    kinds = available_models(dataset)
    if settings.model not in (*kinds, "auto"):
        raise ValueError(f"--model {settings.model} needs companion signals, and this data has none: "
                         "collect it with --companion SPEC")
    target = labels_for(dataset, settings.label)
    labels = Labels(target, events(target, settings.seed))
    masks = split_masks(dataset, settings.split, settings.seed)
    for split in SPLITS:
        if not masks[split].any() or len(np.unique(labels.outcome[masks[split]])) < 2:
            raise ValueError(f"the {split} split has no tokens or only one label: collect more prompts")
    log.info("training on %d tokens (%d train / %d calibration / %d test), label %s, base rate %.3f",
             len(dataset), *(int(masks[s].sum()) for s in SPLITS), resolved_label(dataset, settings.label),
             target.mean())
    verifiers = {kind: train_one(kind, dataset, labels, masks, settings) for kind in kinds}
    split_sizes = dict(zip(SPLITS, (len(p) for p in split_by_prompt(dataset.prompts, settings.split, settings.seed))))
    return TrainingReport(resolved_label(dataset, settings.label), settings, verifiers,
                          confidence_baseline(dataset, labels, masks, settings.max_fpr), split_sizes,
                          held_out_prompt_ids(dataset, settings))


def export(report: TrainingReport, dataset: VerifierDataset, out_dir: Path) -> Path:
    """Write verifier.onnx + verifier.json (the edge's format) for `report.settings.model`; returns the JSON."""
    chosen = report.chosen
    out_dir.mkdir(parents=True, exist_ok=True)
    n_features = chosen.net.mean.numel()
    torch.onnx.export(chosen.net, (torch.zeros(1, n_features),), str(out_dir / "verifier.onnx"),
                      input_names=["features"], output_names=["score"],
                      dynamic_axes={"features": {0: "n"}, "score": {0: "n"}}, dynamo=False)
    manifest = dataset.manifest
    metadata = {
        "format": FORMAT,
        "onnx": "verifier.onnx",
        "pair": {"draft": manifest["draft"], "target": manifest["target"], "vocab_fingerprint": manifest["vocab_fingerprint"]},
        "features": list(chosen.features),
        "hidden_size": int(dataset.arrays["hidden"].shape[1]),
        "threshold": chosen.threshold,
        "score": "calibrated probability that the target accepts the token (Platt scaling, calibration split)",
        "model": chosen.kind,
        "label": report.label,
        "temperature": manifest["settings"]["temperature"],  # the regime it scores: --verifier auto picks by it
        "max_fpr": report.settings.max_fpr,
        "thresholds_at_fpr": chosen.thresholds_at_fpr,
        "draft_runtime": manifest["settings"]["draft_runtime"],
        "metrics": {kind: v.metrics for kind, v in report.verifiers.items()} | {"confidence": report.confidence},
        "reliability": chosen.reliability,
        "training": {"settings": asdict(report.settings), "tokens": len(dataset), "prompts": report.split_prompts,
                     "collection": manifest["settings"], "held_out_prompt_ids": report.held_out_prompt_ids,
                     "calibration_prompt_ids": [p.id for p in split_by_prompt(dataset.prompts, report.settings.split,
                                                                              report.settings.seed)[1]]},
    }
    if set(chosen.features) & set(COMPANION_FEATURES):  # the edge refuses to run it without this companion
        metadata["companion"] = manifest["settings"]["companion"]
    path = out_dir / "verifier.json"
    path.write_text(json.dumps(metadata, indent=1))
    (out_dir / "metrics.md").write_text(report.table() + "\n")
    log.info("wrote %s (%s verifier, threshold %.3f for FPR <= %.0f%%)", path, chosen.kind, chosen.threshold,
             100 * report.settings.max_fpr)
    return path
