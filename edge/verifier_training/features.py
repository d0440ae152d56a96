"""What a verifier learns from: the labels and the feature columns of a collected dataset.

Labels (positive = the target accepts the drafted token x):
    greedy: the target's argmax is x (what greedy verification checks);
    paper:  p_draft(x) <= p_target(x) (SPRINTER's label for sampling: x is never "over-drafted");
    soft:   min(1, p_target(x) / p_draft(x)), the probability that speculative sampling accepts x.
            Trained as the Bernoulli mean under binary cross-entropy, whose minimiser is the expected
            acceptance, so the score is what the call policy reads as a_i at T > 0. Rates, ROC AUC and
            thresholds need events: they are measured on acceptances drawn from it with a fixed seed.
`auto` is greedy for data decoded at T = 0, soft otherwise.

Features: the draft's last hidden state, its confidence (token_prob, max_prob, entropy) and
FREE_FEATURES, which the edge has at no cost: the top-2 margin (max_prob - runner-up probability),
the previous drafted token's probability and the entropy's change from it (acceptance runs in
streaks: boilerplate, then a hard spot). A token with no previous drafted token in its block (the
first one) reads its own values: prev_token_prob = token_prob, entropy_delta = 0.
"""

from __future__ import annotations

import numpy as np

from edge.verifier_training.collect import VerifierDataset
from edge.runtime.verifier import COMPANION_FEATURES, CONFIDENCE_FEATURES, FREE_FEATURES

LABELS = ("greedy", "paper", "soft")


def soft_label(p_draft: np.ndarray, p_target: np.ndarray) -> np.ndarray:
    """min(1, p_target / p_draft): speculative sampling's probability of accepting the drafted token."""
    return np.minimum(1.0, p_target / np.maximum(p_draft, 1e-12)).astype(np.float32)


def resolved_label(dataset: VerifierDataset, label: str) -> str:
    if label != "auto":
        return label
    return "greedy" if dataset.manifest["settings"]["temperature"] == 0 else "soft"


def labels_for(dataset: VerifierDataset, label: str) -> np.ndarray:
    """The training target per token: 0/1, or an acceptance probability for `soft`."""
    label = resolved_label(dataset, label)
    arrays = dataset.arrays
    if label == "greedy":
        return arrays["target_argmax_match"].astype(np.float32)
    if label == "paper":
        return (arrays["p_draft"] <= arrays["p_target"]).astype(np.float32)
    if label == "soft":
        return soft_label(arrays["p_draft"], arrays["p_target"])
    raise ValueError(f"unknown label {label!r}; choose auto or one of {', '.join(LABELS)}")


def events(labels: np.ndarray, seed: int) -> np.ndarray:
    """Accept/reject events: the labels themselves when 0/1, else one acceptance drawn per token."""
    if np.isin(labels, (0.0, 1.0)).all():
        return labels
    return (np.random.default_rng(seed).random(len(labels)) < labels).astype(np.float32)


def _previous_in_prompt(values: np.ndarray, dataset: VerifierDataset) -> tuple[np.ndarray, np.ndarray]:
    """(the previous token's value, whether there was one) along each prompt's continuation."""
    index, position = dataset.arrays["prompt_index"], dataset.arrays["position"]
    has_previous = np.zeros(len(values), dtype=bool)
    has_previous[1:] = (index[1:] == index[:-1]) & (position[1:] == position[:-1] + 1)
    previous = np.where(has_previous, np.roll(values, 1), values)
    return previous, has_previous


def feature_column(dataset: VerifierDataset, name: str) -> np.ndarray:
    """One feature per token, [n]."""
    arrays = dataset.arrays
    if name in CONFIDENCE_FEATURES:
        return arrays["confidence"][:, CONFIDENCE_FEATURES.index(name)]
    if name in COMPANION_FEATURES:
        return arrays["companion"][:, COMPANION_FEATURES.index(name)]
    if name == "margin":
        return arrays["confidence"][:, 1] - arrays["runner_up_prob"]
    if name == "prev_token_prob":
        return _previous_in_prompt(arrays["confidence"][:, 0], dataset)[0]
    if name == "entropy_delta":
        entropy = arrays["confidence"][:, 2]
        return entropy - _previous_in_prompt(entropy, dataset)[0]
    raise ValueError(f"unknown feature {name!r}")


def feature_matrix(dataset: VerifierDataset, features: tuple[str, ...]) -> np.ndarray:
    """[n, F]: the hidden state expands to its H columns, every other feature is one column."""
    parts = [dataset.arrays["hidden"].astype(np.float32) if name == "hidden" else feature_column(dataset, name)[:, None]
             for name in features]
    return np.concatenate(parts, axis=1).astype(np.float32)


def has_features(dataset: VerifierDataset, features: tuple[str, ...]) -> bool:
    """Whether this data can give these features (companion signals and the margin came later)."""
    needed = {"companion" for f in features if f in COMPANION_FEATURES} | {"runner_up_prob" for f in features
                                                                           if f == "margin"}
    return needed <= set(dataset.arrays)
