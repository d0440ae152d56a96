"""How good is a verifier? Scores against labels, in the terms the edge cares about.

Positive = the target accepts the token. The verifier *passes* a token when its score reaches the
threshold. A false positive is a passed token the target would reject: in sprinter mode that is an
error in the output (research.md: TV = eta_FP * TV(p_target, p_draft)), so thresholds are set to a
false-positive rate, and the figure of merit is the true-positive rate there (tokens that need no
round trip).
"""

from __future__ import annotations

import numpy as np

REPORTED_FPRS = (0.01, 0.02, 0.05, 0.10)


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """P(score of an accepted token > score of a rejected one), ties counting half (Mann-Whitney)."""
    positives = labels.astype(bool)
    n_pos, n_neg = positives.sum(), (~positives).sum()
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    first_rank = np.cumsum(counts) - counts + 1
    average_rank = (first_rank + (counts - 1) / 2.0)[inverse]
    return float((average_rank[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def threshold_for_fpr(scores: np.ndarray, labels: np.ndarray, max_fpr: float) -> float:
    """The lowest threshold whose false-positive rate (passes among rejected tokens) stays <= max_fpr."""
    rejected = np.sort(scores[~labels.astype(bool)])[::-1]
    if len(rejected) == 0:
        return 0.0
    allowed = int(np.floor(max_fpr * len(rejected)))
    if allowed >= len(rejected):
        return 0.0
    # Pass iff score >= threshold: sit just above the (allowed+1)-th highest rejected score.
    return float(np.nextafter(np.float32(rejected[allowed]), np.float32(np.inf)))


def rates(scores: np.ndarray, labels: np.ndarray, threshold: float) -> tuple[float, float]:
    """(true-positive rate, false-positive rate) of passing tokens whose score >= threshold."""
    accepted = labels.astype(bool)
    passed = scores >= threshold
    tpr = passed[accepted].mean() if accepted.any() else float("nan")
    fpr = passed[~accepted].mean() if (~accepted).any() else float("nan")
    return float(tpr), float(fpr)


def reliability(scores: np.ndarray, labels: np.ndarray, bins: int = 10) -> list[dict]:
    """Per score bin: mean predicted probability, observed acceptance rate, count."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.digitize(scores, edges[1:-1]), 0, bins - 1)
    table = []
    for b in range(bins):
        inside = which == b
        if inside.any():
            table.append({"low": float(edges[b]), "high": float(edges[b + 1]), "count": int(inside.sum()),
                          "predicted": float(scores[inside].mean()), "observed": float(labels[inside].mean())})
    return table


def expected_calibration_error(scores: np.ndarray, labels: np.ndarray, bins: int = 10) -> float:
    table = reliability(scores, labels, bins)
    return float(sum(row["count"] * abs(row["predicted"] - row["observed"]) for row in table) / max(1, len(scores)))


def evaluate_scores(scores: np.ndarray, labels: np.ndarray, threshold: float) -> dict:
    """The metrics table of one verifier on one split (scores must be probabilities for brier/ece)."""
    tpr, fpr = rates(scores, labels, threshold)
    return {
        "tokens": int(len(labels)),
        "base_rate": float(labels.mean()),
        "accuracy": float(((scores >= threshold) == labels.astype(bool)).mean()),
        "roc_auc": roc_auc(scores, labels),
        "threshold": float(threshold),
        "verifier_tpr": tpr,
        "verifier_fpr": fpr,
        "tpr_at_fpr": {f"{f:g}": rates(scores, labels, threshold_for_fpr(scores, labels, f))[0] for f in REPORTED_FPRS},
        "brier": float(np.mean((scores - labels) ** 2)),
        "ece": expected_calibration_error(scores, labels),
    }
